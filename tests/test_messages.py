"""Messages a person can act on (issue 16): each bad input, given to the CLI and to the run form,
is refused before anything runs with one message naming the file, field or flag, what is wrong
and what was expected, and never a Python exception's name.
"""

from __future__ import annotations

import builtins
import json
import re
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import pytest
from peft import PeftType

from core.checks import CHECKS
from core.cli import main
from core.models.targets import discover_devices
from core.spec import ToleranceOverride

# What PEFT itself can load, read from PEFT (not from core.models.validate).
PEFT_EXPECTED = (
    f"expected one of {', '.join(t.value for t in PeftType)} "
    f"(the methods PEFT {metadata.version('peft')} loads)"
)
THREADS_EXPECTED = "expected threads=N with N a whole number from 1 to 1024 written in digits 0-9"
FORM_FIELDS = ("base", "adapters", "targets", "checks", "merge_subset", "tolerance")

# Builtin exception names (KeyError, OverflowError, …) and any *Error/*Exception of ours.
BUILTIN_EXCEPTIONS = [
    n
    for n in dir(builtins)
    if isinstance(getattr(builtins, n), type) and issubclass(getattr(builtins, n), BaseException)
]
EXCEPTION_NAME = re.compile(rf"\b[A-Z]\w*(Error|Exception)\b|Traceback|\b({'|'.join(BUILTIN_EXCEPTIONS)})\b")


@dataclass
class Bad:
    """One bad input: what is typed, the form field that shows the message, and the message."""

    message: str | re.Pattern[str]
    field: str | None  # None: the form offers no way to type it (the case is in CLI_ONLY)
    base: str | None = None
    adapters: list[str] = field(default_factory=list)
    targets: list[str] = field(default_factory=lambda: ["cpu/float32"])
    checks: list[str] = field(default_factory=lambda: ["weights"])
    merge_subset: list[str] = field(default_factory=list)
    atol: float | None = None
    seed: int = 0
    form_message: str | None = None  # where the form says it its own way

    def argv(self, home: Path) -> list[str]:
        argv = ["run", "--home", str(home), "--in-process", "--seed", str(self.seed)]
        argv += ["--base", self.base] if self.base else []
        argv += ["--adapter", *self.adapters] if self.adapters else []
        argv += ["--target", *self.targets, "--check", *self.checks]
        argv += ["--merge-subset", *self.merge_subset] if self.merge_subset else []
        argv += ["--atol", str(self.atol)] if self.atol is not None else []
        return argv


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_adapter_config(folder: Path, edit: Callable[[dict], object]) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(edit(config)))


def _header_only(path: Path, header: bytes) -> None:
    """A safetensors file holding nothing but `header` (its length, then the JSON)."""
    path.write_bytes(struct.pack("<Q", len(header)) + header)


def _without_peft_type(config: dict) -> dict:
    del config["peft_type"]
    return config


def _case(name: str, demo: dict, tmp: Path) -> Bad:
    """The bad input `name`, made from the demo workspace in `tmp`."""
    llama = demo["models"]["tiny-llama"]
    lora = demo["adapters"]["lora"]["path"]
    two = [f"{lora}=a", f"{demo['adapters']['lora_b']['path']}=b"]
    if name == "config.json is a list":
        base = _copy(llama, tmp / "m")
        (base / "config.json").write_text("[1, 2]")
        return Bad(
            f"base model {base}: config.json holds a JSON list; expected a JSON object of the model's "
            "settings, as transformers saves them",
            "base",
            base=str(base),
        )
    if name == "adapter_config.json is a list":
        ad = _copy(lora, tmp / "ad")
        _edit_adapter_config(ad, lambda c: [c])
        return Bad(
            f"adapter bad ({ad}): adapter_config.json holds a JSON list; expected a JSON object of the "
            "adapter's settings, as PEFT saves them",
            "adapters",
            base=llama,
            adapters=[f"{ad}=bad"],
        )
    if name == "adapter_config.json is not UTF-8":
        ad = _copy(lora, tmp / "ad")
        (ad / "adapter_config.json").write_bytes(b"\x80{}")
        return Bad(
            f"adapter bad ({ad}): adapter_config.json is not valid JSON ('utf-8' codec can't decode byte "
            "0x80 in position 0: invalid start byte)",
            "adapters",
            base=llama,
            adapters=[f"{ad}=bad"],
        )
    if name == "base safetensors header is a list":
        base = _copy(llama, tmp / "m")
        _header_only(base / "model.safetensors", b"[1, 2]")
        return Bad(
            f"{base / 'model.safetensors'}: not a safetensors file (its header is a JSON list; expected a "
            "JSON object of tensor names, each with its dtype, shape and data_offsets)",
            "base",
            base=str(base),
        )
    if name == "adapter safetensors header is a list":
        ad = _copy(lora, tmp / "ad")
        _header_only(ad / "adapter_model.safetensors", b"[]")
        return Bad(
            f"{ad / 'adapter_model.safetensors'}: not a safetensors file (its header is a JSON list; "
            "expected a JSON object of tensor names, each with its dtype, shape and data_offsets)",
            "adapters",
            base=llama,
            adapters=[f"{ad}=bad"],
        )
    if name in ("peft_type SUPERLORA", "peft_type lowercase"):
        ad = _copy(lora, tmp / "ad")
        value = "SUPERLORA" if name == "peft_type SUPERLORA" else "lora"
        _edit_adapter_config(ad, lambda c: c | {"peft_type": value})
        return Bad(
            f'adapter bad ({ad}): adapter_config.json field peft_type is "{value}"; {PEFT_EXPECTED}',
            "adapters",
            base=llama,
            adapters=[f"{ad}=bad"],
        )
    if name == "peft_type missing":
        ad = _copy(lora, tmp / "ad")
        _edit_adapter_config(ad, _without_peft_type)
        return Bad(
            f"adapter bad ({ad}): adapter_config.json has no peft_type field; {PEFT_EXPECTED}",
            "adapters",
            base=llama,
            adapters=[f"{ad}=bad"],
        )
    if name in ("threads=²", "threads=100000000000", "threads=0"):
        target = f"cpu/float32+{name}"
        return Bad(
            f"target {target!r}: flag {name} is not a CPU thread count; {THREADS_EXPECTED}",
            "targets",
            base=llama,
            targets=[target],
        )
    if name == "matmul=HIGH":
        return Bad(
            "target 'cpu/float32+matmul=HIGH': flag matmul=HIGH is not a float32 matmul precision; "
            "expected matmul=highest|high|medium",
            "targets",
            base=llama,
            targets=["cpu/float32+matmul=HIGH"],
        )
    if name == "merge subset: unknown name":
        return Bad(
            "merge subset: zz is not an adapter of this run; its adapters are a, b",
            "merge_subset",
            base=llama,
            adapters=two,
            checks=["merge"],
            merge_subset=["a", "zz"],
        )
    if name == "merge subset: one name":
        return Bad(
            "merge subset names a alone; name two or more adapters to merge together",
            "merge_subset",
            base=llama,
            adapters=two,
            checks=["merge"],
            merge_subset=["a"],
        )
    if name == "merge subset: a name twice":
        return Bad(
            "merge subset names a twice; name each adapter once",
            "merge_subset",
            base=llama,
            adapters=two,
            checks=["merge"],
            merge_subset=["a", "b", "a"],
        )
    if name == "merge subset without the merge check":
        return Bad(
            "merge subset a, b is given, but the merge check that merges it is not run; "
            "add merge to the checks",
            None,  # the form shows its subset picker only with the merge check
            base=llama,
            adapters=two,
            merge_subset=["a", "b"],
        )
    if name == "negative atol":
        return Bad(
            "tolerance atol=-1.0 for every row: expected a number ≥ 0", "tolerance", base=llama, atol=-1.0
        )
    if name == "seed beyond torch's":
        return Bad(
            f"seed {2**64}: expected a whole number from {-(2**63)} to {2**64 - 1}",
            None,  # the form's seed field is a bounded number input
            base=llama,
            seed=2**64,
        )
    # The bad inputs tests/test_cli.py already holds.
    if name == "no such folder":
        return Bad(f"base model {tmp / 'nope'}: no such folder", "base", base=str(tmp / "nope"))
    if name == "no config.json":
        (tmp / "empty").mkdir()
        return Bad(
            f"base model {tmp / 'empty'}: not a model folder (no config.json)",
            "base",
            base=str(tmp / "empty"),
        )
    if name == "adapter for another base":
        return Bad(
            "adapter bert was made for a different base model: none of its modules "
            f"(e.g. encoder.layer.0.attention.self.query) exist in {llama}",
            "adapters",
            base=llama,
            adapters=[f"{demo['adapters']['bert-lora']['path']}=bert"],
        )
    if name == "truncated weights":
        base = _copy(llama, tmp / "m")
        weights = base / "model.safetensors"
        size = weights.stat().st_size
        weights.write_bytes(weights.read_bytes()[:-1000])
        return Bad(
            re.compile(
                rf"{re.escape(str(weights))}: truncated: tensor '[\w.]+' ends at byte \d+, "
                rf"the file has {size - 1000}"
            ),
            "base",
            base=str(base),
        )
    if name == "unknown check":
        return Bad(f"unknown check nope; available: {', '.join(CHECKS)}", None, base=llama, checks=["nope"])
    if name == "missing device":
        available = ", ".join(d.name for d in discover_devices())
        return Bad(
            f"device cuda:7 does not exist on this machine; available: {available}",
            "targets",
            base=llama,
            targets=["cuda:7/float32"],
        )
    if name == "unknown dtype":
        return Bad(
            "target 'cpu/int4': unknown dtype 'int4'; use one of float32, bfloat16, float16, float64, "
            "or a bitsandbytes format: nf4, fp4, int8",
            "targets",
            base=llama,
            targets=["cpu/int4"],
        )
    if name == "no base":
        return Bad(
            "--base is required (or --demo)",
            "base",
            form_message="Choose a base model folder or type a path or hub id.",
        )
    raise AssertionError(name)


CASES = (
    "config.json is a list",
    "adapter_config.json is a list",
    "adapter_config.json is not UTF-8",
    "base safetensors header is a list",
    "adapter safetensors header is a list",
    "peft_type SUPERLORA",
    "peft_type lowercase",
    "peft_type missing",
    "threads=²",
    "threads=100000000000",
    "threads=0",
    "matmul=HIGH",
    "merge subset: unknown name",
    "merge subset: one name",
    "merge subset: a name twice",
    "merge subset without the merge check",
    "negative atol",
    "seed beyond torch's",
    "no such folder",
    "no config.json",
    "adapter for another base",
    "truncated weights",
    "unknown check",
    "missing device",
    "unknown dtype",
    "no base",
)
# The form offers no way to type these: its checks and subset are pickers, its seed a bounded number.
CLI_ONLY = ("merge subset without the merge check", "seed beyond torch's", "unknown check")


def _assert_says(message: str, expected: str | re.Pattern[str]) -> None:
    if isinstance(expected, str):
        assert message == expected
    else:
        assert expected.fullmatch(message), message
    assert not EXCEPTION_NAME.search(message), message


@pytest.mark.parametrize("name", CASES)
def test_the_cli_refuses_a_bad_input_with_what_was_expected(name, demo_workspace, tmp_path, capsys):
    bad = _case(name, demo_workspace, tmp_path)
    code = main(bad.argv(tmp_path / "home"))
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.endswith("\n") and err.count("\n") == 1, err
    _assert_says(err.removeprefix("error: ").removesuffix("\n"), bad.message)
    assert not (tmp_path / "home" / "runs").exists() or not any((tmp_path / "home" / "runs").iterdir())


@pytest.mark.parametrize("name", [c for c in CASES if c not in CLI_ONLY])
def test_the_form_shows_the_same_message_under_its_field(name, demo_workspace, tmp_path):
    from dashboard.run_form import validate_form

    bad = _case(name, demo_workspace, tmp_path)
    assert bad.field is not None
    errors = validate_form(
        bad.base,
        bad.adapters,
        bad.targets,
        bad.checks,
        discover_devices(),
        ToleranceOverride(atol=bad.atol) if bad.atol is not None else None,
        None,
        bad.merge_subset,
    )
    messages = getattr(errors, bad.field)
    assert len(messages) == 1, errors
    _assert_says(messages[0], bad.form_message or bad.message)
    assert not any(getattr(errors, f) for f in FORM_FIELDS if f != bad.field), errors


@pytest.mark.parametrize(
    "old",
    [
        "AttributeError: 'list' object has no attribute 'get'",
        "ValueError: invalid literal for int() with base 10: '²'",
        "run failed: cpu/float32: CheckpointError: x",
        "KeyboardInterrupt",
    ],
)
def test_the_exception_name_check_catches_what_the_issue_saw(old):
    assert EXCEPTION_NAME.search(old)
