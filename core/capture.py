"""Captures: what a worker took from one target, in the snapshot format.

A capture is a folder with `capture.json` (target, environment provenance, notes, timings, and
the results of the comparisons the worker made itself), `tensors.safetensors` (the tensors
kept whole, on the CPU, in the dtype they had on the target) and `sketches.safetensors` (the
array parts of each compared tensor's `Sketch`). Tensors compared against the checkpoint are
compared in the worker, where they are, and kept whole only for small models or when the user
asks: a real model's capture is its metric rows and sketches, not a second copy of the model.
A capture made by the CLI on another machine has the same format, so comparing devices,
machines and days is one operation.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from core.numerics.sketch import Sketch

SEP = "::"
# separates a tensor's encoded key from the name of one of its sketch's arrays in sketches.safetensors
SKETCH_SEP = "##"
FORMAT = "weightdrift-capture/2"
BASE = "-"  # the adapter slot of a tensor taken from the bare base model


def capture_folder_name(target_slug: str, check: str = "", variant: str = "") -> str:
    """`cpu_float32` for the shared load loop, `cpu_float32@adapters-load_adapter` for an own-worker check."""
    if not check:
        return target_slug
    return f"{target_slug}@{check}" + (f"-{variant}" if variant else "")


# What capture.json holds (as `Capture.save` writes it), each key with its JSON type.
_DOC_FIELDS: dict[str, type] = {
    "target": str,
    "check": str,
    "variant": str,
    "environment": dict,
    "notes": list,
    "meta": dict,
    "results": dict,
}
_SKETCH_FIELDS = ("shape", "rows", "cols", "n_zero", "n_nonfinite")


def capture_problem(doc: Any, tensors: Collection[str], sketch_arrays: Collection[str]) -> str | None:
    """Why a capture folder's files do not make a capture (None when they do): `doc` is its parsed
    capture.json, `tensors` and `sketch_arrays` the tensor names its tensors.safetensors and
    sketches.safetensors hold. A capture made on another machine is read as it is by the checks, so
    its shape is checked before it is stored: every row names a tensor key, and the sketch arrays
    are exactly those its rows' sketches need."""
    if not isinstance(doc, dict):
        return f"capture.json holds a JSON {type(doc).__name__}, not an object"
    if doc.get("format") != FORMAT:
        return f"capture.json is in format {doc.get('format')!r}, this version reads {FORMAT!r}"
    for name, kind in _DOC_FIELDS.items():
        if not isinstance(doc.get(name), kind):
            return f"capture.json's {name!r} is {doc.get(name)!r:.80}, not a JSON {kind.__name__}"
    needed = set()
    for key, record in doc["results"].items():
        if key.count(SEP) < 2:
            return (
                f"capture.json names row {key!r:.120}, which is not a tensor key (check{SEP}adapter{SEP}name)"
            )
        if not isinstance(record, dict) or not isinstance(record.get("row"), dict):
            return f"capture.json's row {key!r:.120} is not an object with a 'row' object"
        sketch = record.get("sketch")
        if sketch is None:
            continue
        if not isinstance(sketch, dict) or any(
            not isinstance(sketch.get(f), list if f == "shape" else int) for f in _SKETCH_FIELDS
        ):
            return f"capture.json's row {key!r:.120} has a sketch without its {', '.join(_SKETCH_FIELDS)}"
        needed.update(f"{key}{SKETCH_SEP}{part}" for part in Sketch.ARRAY_PARTS)
    unnamed = sorted(set(sketch_arrays) - needed)
    if unnamed:
        return f"sketches.safetensors holds {unnamed[0]!r:.160}, which no row of capture.json names"
    missing = sorted(needed - set(sketch_arrays))
    if missing:
        return f"sketches.safetensors lacks {missing[0]!r:.160}, which a row of capture.json needs"
    bad = next((k for k in tensors if k.count(SEP) < 2), None)
    if bad is not None:
        return (
            f"tensors.safetensors holds {bad!r:.120}, which is not a tensor key (check{SEP}adapter{SEP}name)"
        )
    return None


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
    # encoded TensorKey -> what the worker measured itself: {"reference", "note", "dtype", "row",
    # "sketch" (the sketch's JSON part, or None when the tensor equals its reference)}
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    sketches: dict[str, Sketch] = field(default_factory=dict)
    # Set by the worker: called by `add` for every tensor; it may compare the tensor where it is and
    # store a result, and returns None (not compared: keep it), True (compared, keep it too) or
    # False (compared, drop it).
    comparator: Callable[[TensorKey, torch.Tensor, Capture], bool | None] | None = field(
        default=None, repr=False, compare=False
    )
    folder: Path | None = field(default=None, repr=False, compare=False)  # where it was loaded from

    @property
    def label(self) -> str:
        """`cpu/float32`, or `cpu/float32 · adapters:load_adapter` for an own-worker capture."""
        if not self.check:
            return self.target
        return f"{self.target} · {self.check}" + (f":{self.variant}" if self.variant else "")

    def add(self, key: TensorKey, tensor: torch.Tensor) -> None:
        """Hand `tensor` to the comparator, if any; keep a detached CPU copy unless it says not to."""
        keep = None if self.comparator is None else self.comparator(key, tensor, self)
        if keep is not False:
            self.keep(key, tensor)

    def keep(self, key: TensorKey, tensor: torch.Tensor) -> None:
        """Keep a detached CPU copy (same dtype) so the capture outlives the model."""
        self.tensors[key.encode()] = tensor.detach().to("cpu", copy=True).contiguous()

    def keys(self, check: str) -> list[TensorKey]:
        """Every tensor of `check`: kept ones first, then those only compared in the worker."""
        encoded = list(self.tensors) + [k for k in self.results if k not in self.tensors]
        return [k for k in map(TensorKey.decode, encoded) if k.check == check]

    def get(self, key: TensorKey) -> torch.Tensor | None:
        """The kept tensor, or None (not captured, or compared in the worker and not kept)."""
        return self.tensors.get(key.encode())

    def result(self, key: TensorKey) -> dict[str, Any] | None:
        """What the worker measured for `key` itself, or None."""
        return self.results.get(key.encode())

    def sketch(self, key: TensorKey) -> Sketch | None:
        """The sketch of a tensor compared in the worker (read from the folder on first use)."""
        encoded = key.encode()
        if encoded not in self.sketches:
            self._read_sketches([encoded])
        return self.sketches.get(encoded)

    def _read_sketches(self, encoded: list[str]) -> None:
        """Read the sketches of these keys that are in the folder and not yet read, opening its file once."""
        wanted = [
            k
            for k in encoded
            if k not in self.sketches
            and (self.results.get(k) or {}).get("sketch")
            and self.folder is not None
        ]
        if not wanted:
            return
        from safetensors import safe_open

        with safe_open(str(self.folder / "sketches.safetensors"), framework="np") as f:
            for k in wanted:
                arrays = {part: f.get_tensor(k + SKETCH_SEP + part) for part in Sketch.ARRAY_PARTS}
                self.sketches[k] = Sketch.from_parts(self.results[k]["sketch"], arrays)

    def save(self, folder: Path) -> Path:
        """Write into a temporary sibling folder, then rename it into place."""
        folder = Path(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = folder.with_name(f".{folder.name}.{secrets.token_hex(4)}.tmp")
        tmp.mkdir()
        save_file(self.tensors, str(tmp / "tensors.safetensors"))
        arrays = {
            f"{key}{SKETCH_SEP}{part}": np.ascontiguousarray(a)
            for key, sketch in self.sketches.items()
            for part, a in sketch.arrays().items()
        }
        from safetensors.numpy import save_file as save_arrays

        save_arrays(arrays, str(tmp / "sketches.safetensors"))
        doc = {
            "format": FORMAT,
            "target": self.target,
            "check": self.check,
            "variant": self.variant,
            "environment": self.environment,
            "notes": self.notes,
            "meta": self.meta,
            "results": self.results,
        }
        # one line: json's C encoder runs only without indent (a capture has a record per tensor)
        (tmp / "capture.json").write_text(json.dumps(doc, sort_keys=True, default=str))
        if folder.exists():
            # out of the way in one rename, so a reader (the dashboard's drill-down while the run goes
            # on) finds the old capture or the new one, not a half-removed folder
            old = folder.with_name(f".{folder.name}.{secrets.token_hex(4)}.old.tmp")
            os.replace(folder, old)
            os.replace(tmp, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, folder)
        return folder

    def join(self, earlier: Capture) -> None:
        """Take in what an earlier pass on the same target captured into the same folder (other checks:
        `core.engine` captures a small model's checks in passes), so that saving writes one capture.

        Its tensors, results, sketches, notes and per-check metadata join this capture's; the earlier
        environment is kept (the same target on the same machine), load timings add up.
        """
        earlier._read_sketches(list(earlier.results))  # read now: saving replaces its folder
        self.tensors = {**earlier.tensors, **self.tensors}
        self.results = {**earlier.results, **self.results}
        self.sketches = {**earlier.sketches, **self.sketches}
        self.notes = list(dict.fromkeys([*earlier.notes, *self.notes]))
        self.environment = earlier.environment or self.environment
        meta = {**earlier.meta, **self.meta}
        notes = {**earlier.meta.get("load_notes", {})}
        for name, found in self.meta.get("load_notes", {}).items():
            notes[name] = list(dict.fromkeys([*notes.get(name, []), *found]))
        if notes:
            meta["load_notes"] = notes
        spent = [m.get("timings", {}).get("load_and_capture_s") for m in (earlier.meta, self.meta)]
        if all(isinstance(s, int | float) for s in spent):
            meta["timings"] = {"load_and_capture_s": round(sum(spent), 3)}
        self.meta = meta

    @staticmethod
    def load(folder: Path) -> Capture:
        """Read a capture (or snapshot) folder back; sketches are read when asked for (`sketch`)."""
        folder = Path(folder)
        doc = json.loads((folder / "capture.json").read_text())
        tensors = load_file(str(folder / "tensors.safetensors"))
        return Capture(
            results=doc.get("results", {}),
            folder=folder,
            target=doc["target"],
            environment=doc.get("environment", {}),
            tensors=tensors,
            notes=doc.get("notes", []),
            meta=doc.get("meta", {}),
            check=doc.get("check", ""),
            variant=doc.get("variant", ""),
        )
