"""Captures: what a worker took from one target, in the snapshot format.

A capture is a folder with `tensors.safetensors` (every captured tensor, on the CPU, in the
dtype it had on the target) and `capture.json` (target, environment provenance, notes,
timings). A capture made by the CLI on another machine has the same format, so comparing
devices, machines and days is one operation.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

SEP = "::"
BASE = "-"  # the adapter slot of a tensor taken from the bare base model


def capture_folder_name(target_slug: str, check: str = "", variant: str = "") -> str:
    """`cpu_float32` for the shared load loop, `cpu_float32@adapters-load_adapter` for an own-worker check."""
    if not check:
        return target_slug
    return f"{target_slug}@{check}" + (f"-{variant}" if variant else "")


@dataclass(frozen=True)
class TensorKey:
    """Names one captured tensor: which check took it, with which adapter, and its own name."""

    check: str
    adapter: str  # adapter name, or BASE for the bare base model
    name: str  # parameter name, module path, or output name

    def encode(self) -> str:
        return SEP.join((self.check, self.adapter, self.name))

    @staticmethod
    def decode(key: str) -> TensorKey:
        check, adapter, name = key.split(SEP, 2)
        return TensorKey(check, adapter, name)


@dataclass
class Capture:
    """One target's capture: tensors plus JSON metadata."""

    target: str
    environment: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    # Set for the capture of a check that runs in its own worker (`Check.own_worker`), and the
    # variant it ran (a load strategy, …); empty for the shared load loop's capture.
    check: str = ""
    variant: str = ""

    @property
    def label(self) -> str:
        """`cpu/float32`, or `cpu/float32 · adapters:load_adapter` for an own-worker capture."""
        if not self.check:
            return self.target
        return f"{self.target} · {self.check}" + (f":{self.variant}" if self.variant else "")

    def add(self, key: TensorKey, tensor: torch.Tensor) -> None:
        """Keep a detached CPU copy (same dtype) so the capture outlives the model."""
        self.tensors[key.encode()] = tensor.detach().to("cpu", copy=True).contiguous()

    def keys(self, check: str) -> list[TensorKey]:
        return [k for k in map(TensorKey.decode, self.tensors) if k.check == check]

    def get(self, key: TensorKey) -> torch.Tensor | None:
        return self.tensors.get(key.encode())

    def save(self, folder: Path) -> Path:
        """Write into a temporary sibling folder, then rename it into place."""
        folder = Path(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = folder.with_name(f".{folder.name}.{secrets.token_hex(4)}.tmp")
        tmp.mkdir()
        save_file(self.tensors, str(tmp / "tensors.safetensors"))
        doc = {
            "format": "weightdrift-capture/1",
            "target": self.target,
            "check": self.check,
            "variant": self.variant,
            "environment": self.environment,
            "notes": self.notes,
            "meta": self.meta,
        }
        (tmp / "capture.json").write_text(json.dumps(doc, indent=2, sort_keys=True, default=str))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
        return folder

    @staticmethod
    def load(folder: Path) -> Capture:
        """Read a capture (or snapshot) folder back."""
        folder = Path(folder)
        doc = json.loads((folder / "capture.json").read_text())
        tensors = load_file(str(folder / "tensors.safetensors"))
        return Capture(
            target=doc["target"],
            environment=doc.get("environment", {}),
            tensors=tensors,
            notes=doc.get("notes", []),
            meta=doc.get("meta", {}),
            check=doc.get("check", ""),
            variant=doc.get("variant", ""),
        )
