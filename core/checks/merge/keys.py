"""The merge check's key scheme (`role:stage:name`), its notes and the helpers its rows share."""

from __future__ import annotations

from typing import Any

import torch

from core.methods import adapter_keys
from core.models.checkpoint import Checkpoint, read_adapter_config
from core.spec import AdapterRef, Target

ROLES = ("merged", "roundtrip", "delta", "tied", adapter_keys.SAVED_MODULE, "output")
ROUNDTRIP_NOTE = "unmerge_adapter() must restore W: this is what it left"
SAVED_NOTE = (
    "modules_to_save: merge_and_unload puts the adapter's copy of this module in place of the base's "
    "(replaced, not merged: no W + ΔW); compared with the adapter file"
)


def key_name(role: str, stage: str, name: str) -> str:
    """The capture tensor name of one measurement: ``role:stage:name``."""
    return f"{role}:{stage}:{name}"


def parse_name(name: str) -> tuple[str, str, str]:
    """(role, stage, name) of a capture tensor name made by `key_name`."""
    role, stage, rest = name.split(":", 2)
    return role, stage, rest


def dtype_of(target: Target) -> torch.dtype:
    """The dtype a target's rows are judged in (its tolerances follow it)."""
    return getattr(torch, target.float_dtype)


def broken(row: dict[str, Any], explanation: str) -> None:
    """Mark `row` broken, with `explanation` after any it has."""
    row["verdict"] = "broken"
    row["explanation"] = " · ".join(filter(None, [row.get("explanation"), explanation]))


def no_reference(tensor: torch.Tensor, label: str, note: str) -> dict[str, Any]:
    """The measured part of a `broken` row for a tensor without a reference."""
    return {
        "shape": "x".join(map(str, tensor.shape)),
        "numel": tensor.numel(),
        "bitwise_equal": False,
        "verdict": "broken",
        "explanation": f"no reference ({label}) for this tensor" + (f": {note}" if note else ""),
    }


def exact_stage(stage: str) -> str:
    """The stage of the cpu/float64 capture an output is compared with: the exact model's unmerged one."""
    return "subset unmerged" if stage.startswith("subset") else "unmerged"


def trained_biases(adapter: AdapterRef) -> list[str]:
    """The biases the adapter trained and saves (``<module>.bias``), by its file's index: no tensor read."""
    names = Checkpoint.open(adapter.path, prefix="adapter_model").names()
    return adapter_keys.trained_biases(names, read_adapter_config(adapter))
