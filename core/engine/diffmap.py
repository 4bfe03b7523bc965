"""The element-wise difference behind one metrics row: the dashboard's drill-down into a cell.

A row of the metrics table says *how much* a tensor drifts; `element_diff` says *where*. It
reads the one tensor from the run's capture (never the whole capture: a real model's capture
is gigabytes), asks the row's check for the very reference the metrics used, and recomputes the
row through the check's own `rows`, so what the drill-down shows always agrees with the table.
The dashboard draws the arrays; it computes nothing itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from core.capture import BASE, Capture, TensorKey
from core.checks import get_checks
from core.checks.base import Check, Reference, redraw_rounding, tolerance
from core.engine.store import RunRecord
from core.numerics import metrics
from core.numerics.sketch import Sketch, as_2d
from core.spec import ProbeSpec, Target

__all__ = ["ElementDiff", "SketchedDiff", "element_diff", "as_2d"]


@dataclass(frozen=True)
class ElementDiff:
    """One tensor's element-wise difference to its reference, with the row it belongs to.

    The arrays are 2-D views of the tensor (see `as_2d`): ``diff[i, j]`` is the element whose
    flat index is ``i * diff.shape[1] + j``. ``mismatch`` is the exact fail mask of
    `metrics.close_mask` (assert_close's rule in `metrics.rule_dtype`), NaN/Inf included, whose
    count is the row's ``n_mismatch``: a finite element fails where ``|diff|`` rounded to that
    dtype exceeds ``allowed``, so ``|diff| > allowed`` can differ from it within that rounding.
    """

    check: str
    target: str
    adapter: str | None
    tensor: str
    reference: str  # the reference label, as in the metrics row ("checkpoint", "cpu/float64", …)
    shape: tuple[int, ...]  # the tensor's own shape
    dtype: str  # the target tensor's dtype, e.g. "bfloat16"
    diff: np.ndarray  # float64, 2-D: target − reference; 0 where both are equal (NaN == NaN)
    allowed: np.ndarray  # float64, 2-D: atol + rtol·|reference| as assert_close computes it (in rule_dtype)
    mismatch: np.ndarray  # bool, 2-D: the elements counted in the row's n_mismatch
    rtol: float
    atol: float
    explanation: str  # the row's assert_close-style explanation, recomputed
    row: dict[str, Any]  # the whole metrics row, recomputed by the check's own `rows`

    @property
    def n_mismatch(self) -> int:
        """How many elements fail the tolerance (the row's `n_mismatch`)."""
        return int(self.mismatch.sum())


@dataclass(frozen=True)
class SketchedDiff:
    """A tensor compared in its worker and not kept whole: its row and its bounded `Sketch`.

    What the drill-down draws for a large model (block-max |Δ| map, failing blocks, histogram,
    worst elements); the element-wise map needs the run made with ``keep_tensors``. ``sketch`` is
    None when the tensor equals its reference bit for bit (nothing to draw).
    """

    check: str
    target: str
    adapter: str | None
    tensor: str
    reference: str
    shape: tuple[int, ...]
    dtype: str
    sketch: Sketch | None
    explanation: str
    row: dict[str, Any]


def element_diff(
    record: RunRecord, check: str, target: str, adapter: str | None, tensor: str
) -> ElementDiff | SketchedDiff:
    """The element-wise difference of one captured tensor to its reference, and its recomputed row.

    `check`, `target`, `adapter` (None for the bare base model) and `tensor` are the columns of
    the metrics row being drilled into. Only that tensor is read from the capture (and, for
    checks compared against cpu/float64, from the reference capture). Raises KeyError when the
    run has no such check, target, adapter or tensor (or no reference for it), and ValueError
    when the run's spec is unreadable, the target string is malformed or the shapes differ;
    the messages are meant to be shown to the user as they are.
    """
    spec = _spec(record)
    the_check = _check(record, spec, check)
    parsed = _target(record, spec, target)
    adapter_slot = _adapter_slot(record, spec, adapter)
    key = TensorKey(check, adapter_slot, tensor)
    where = f"in check {check} on {parsed}"

    capture, present = _read_capture(record.run_dir / "captures" / parsed.slug, key)
    measured = capture.result(key)
    if key.encode() not in capture.tensors and measured is not None:
        # compared in the worker and not kept: the row and the sketch are all there is
        row = _row(
            the_check, spec, capture, Reference(label=measured["reference"], tensors={}, notes={}), key
        )
        sketch = capture.sketch(key)
        if sketch is None and measured.get("rounding"):
            # the reference rounded to the target's dtype, bit for bit: its map is drawn from the reference
            sketch = redraw_rounding(the_check, spec, parsed, key, measured["dtype"])
            if sketch is None:
                raise KeyError(
                    f"tensor {tensor!r}{_for(adapter)} {where} is its reference ({measured['reference']}) "
                    f"rounded to {measured['dtype']}, and its map is drawn from that reference, which "
                    "cannot be read here"
                )
        return SketchedDiff(
            check=check,
            target=str(parsed),
            adapter=adapter,
            tensor=tensor,
            reference=measured["reference"],
            shape=tuple(int(n) for n in str(row.get("shape") or "").split("x") if n),
            dtype=measured["dtype"],
            sketch=sketch,
            explanation=str(row.get("explanation", "")),
            row=row,
        )
    if key.encode() not in capture.tensors:
        raise KeyError(_no_tensor(key, adapter, where, present))
    target_tensor = capture.tensors[key.encode()]

    reference_capture = None
    if the_check.needs_reference_target:
        ref_folder = record.run_dir / "captures" / spec.reference.slug
        if not ref_folder.is_dir():
            raise KeyError(
                f"run {record.run_id} has no {spec.reference} capture, which check {check} compares against"
            )
        # The check looks the same key up in the reference capture (outputs: the fp64 logits).
        reference_capture, _ = _read_capture(ref_folder, key)
    full = the_check.reference_for(spec, key, reference_capture)
    ref_tensor = full.tensors.get(key.encode())
    if ref_tensor is None:
        raise KeyError(f"no reference ({full.label}) for tensor {tensor!r}{_for(adapter)} {where}")
    if tuple(ref_tensor.shape) != tuple(target_tensor.shape):
        raise ValueError(
            f"shape mismatch for tensor {tensor!r}{_for(adapter)} {where}: target "
            f"{_shape(target_tensor.shape)} vs reference ({full.label}) {_shape(ref_tensor.shape)}"
        )
    # Only this key: a check's rows may add rows for reference tensors the capture lacks
    # (weights: "in the checkpoint but not loaded"), which would be noise here.
    reference = Reference(
        label=full.label,
        tensors={key.encode(): ref_tensor},
        notes={k: v for k, v in full.notes.items() if k == key.encode()},
    )
    row = _row(the_check, spec, capture, reference, key)

    # The same tolerance Check.rows used: the target's dtype and the row's role.
    tol = tolerance(spec, the_check.role_of(spec, key), getattr(torch, parsed.float_dtype))
    diff, allowed, mismatch = _elementwise(target_tensor, ref_tensor, tol.rtol, tol.atol)
    return ElementDiff(
        check=check,
        target=str(parsed),
        adapter=adapter,
        tensor=tensor,
        reference=full.label,
        shape=tuple(target_tensor.shape),
        dtype=str(target_tensor.dtype).removeprefix("torch."),
        diff=diff,
        allowed=allowed,
        mismatch=mismatch,
        rtol=float(tol.rtol),
        atol=float(tol.atol),
        explanation=row["explanation"],
        row=row,
    )


def _spec(record: RunRecord) -> ProbeSpec:
    if record.spec is None:
        raise ValueError(f"run {record.run_id} has no readable spec.json; its captures cannot be compared")
    return record.spec


def _check(record: RunRecord, spec: ProbeSpec, name: str) -> Check:
    if name not in spec.checks:
        raise KeyError(f"run {record.run_id} did not run check {name} (checks: {', '.join(spec.checks)})")
    return get_checks([name])[0]


def _target(record: RunRecord, spec: ProbeSpec, text: str) -> Target:
    parsed = Target.parse(text)  # SpecError (a ValueError) with the accepted forms
    targets = ", ".join(map(str, spec.targets))
    if parsed not in spec.targets:
        raise KeyError(f"run {record.run_id} has no capture for target {parsed} (targets: {targets})")
    if not (record.run_dir / "captures" / parsed.slug / "tensors.safetensors").is_file():
        raise KeyError(
            f"run {record.run_id} has no capture for target {parsed}: "
            f"its capture folder is missing (status: {record.status})"
        )
    return parsed


def _adapter_slot(record: RunRecord, spec: ProbeSpec, adapter: str | None) -> str:
    if adapter is None:
        return BASE
    names = [a.name for a in spec.adapters]
    if adapter not in names:
        raise KeyError(
            f"run {record.run_id} has no adapter {adapter!r} (adapters: {', '.join(names) or 'none'})"
        )
    return adapter


def _for(adapter: str | None) -> str:
    return f" for adapter {adapter}" if adapter is not None else " of the base model"


def _shape(shape: tuple[int, ...] | torch.Size) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


def _no_tensor(key: TensorKey, adapter: str | None, where: str, present: set[str]) -> str:
    # The names this check did capture for that adapter, so a typo is easy to spot.
    names = sorted(
        k.name for k in map(TensorKey.decode, present) if (k.check, k.adapter) == (key.check, key.adapter)
    )
    hint = f"; it has {len(names)}, e.g. {', '.join(map(repr, names[:3]))}" if names else ""
    return f"no tensor {key.name!r}{_for(adapter)} {where}{hint}"


def _read_capture(folder: Path, key: TensorKey) -> tuple[Capture, set[str]]:
    """A Capture holding only `key` (kept tensor or worker result) plus the folder's JSON fields, and
    every key the capture has.

    `safe_open` reads just the requested tensor's bytes, never the whole (possibly GB) file.
    """
    try:
        doc = json.loads((folder / "capture.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{folder / 'capture.json'}: unreadable capture metadata ({e})") from e
    tensors: dict[str, torch.Tensor] = {}
    path = folder / "tensors.safetensors"
    try:
        with safe_open(str(path), framework="pt") as f:
            present = set(f.keys())
            if key.encode() in present:
                tensors[key.encode()] = f.get_tensor(key.encode())
    except Exception as e:  # truncated or corrupt file: say which
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from e
    results = doc.get("results") or {}
    capture = Capture(
        target=doc["target"],
        environment=doc.get("environment", {}),
        tensors=tensors,
        notes=doc.get("notes", []),
        meta=doc.get("meta", {}),
        # only this key's: the check's rows then describe this tensor alone
        results={key.encode(): results[key.encode()]} if key.encode() in results else {},
        folder=folder,
    )
    return capture, present | set(results)


def _row(
    check: Check, spec: ProbeSpec, capture: Capture, reference: Reference, key: TensorKey
) -> dict[str, Any]:
    """The metrics row for `key`, made by the check's own `rows` (notes, extra columns and all)."""
    adapter = None if key.adapter == BASE else key.adapter
    for row in check.rows(spec, capture, reference):
        if row["tensor"] == key.name and row["adapter"] == adapter:
            return row
    raise KeyError(f"check {check.name} made no row for tensor {key.name!r}{_for(adapter)}")


def _elementwise(
    target: torch.Tensor, reference: torch.Tensor, rtol: float, atol: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(diff, allowed, mismatch) as 2-D arrays, by the rule `metrics.compare` counts with.

    ``diff`` is in float64, whose element-wise ops are exact IEEE operations, so doing them whole
    rather than in `compare`'s chunks gives the same bits: the max of |diff| is the row's
    `max_abs`. ``mismatch`` is `metrics.close_mask`'s, whose count is the row's `n_mismatch`.
    """
    shape2 = as_2d(tuple(target.shape))
    target, reference = target.detach().to("cpu"), reference.detach().to("cpu")
    t = target.to(torch.float64).reshape(shape2)
    r = reference.to(torch.float64).reshape(shape2)
    # Equal values (and NaN against NaN, as assert_close with equal_nan) show as no difference,
    # not as inf − inf = NaN.
    same = (t == r) | (t.isnan() & r.isnan())
    diff = torch.where(same, torch.zeros((), dtype=torch.float64), t - r)
    # torch.isclose's bound, in the dtype the rule is evaluated in.
    rule = metrics.rule_dtype(target.dtype, reference.dtype)
    allowed = (atol + (rtol * reference.to(rule)).abs()).to(torch.float64).reshape(shape2)
    tol = metrics.Tolerance(rtol=rtol, atol=atol)
    mismatch = ~metrics.close_mask(target, reference, tol).reshape(shape2)
    return diff.numpy(), allowed.numpy(), mismatch.numpy()
