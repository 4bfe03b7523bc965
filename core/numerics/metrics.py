"""Numerical drift between a target tensor and a reference tensor.

Pure tensor math: no Streamlit, no global state. A pair is compared in one fused pass where the
target is: the numba kernel on the CPU, its torch port (`accumulate.compare_torch`, the same
numbers bit for bit) on a GPU, the reference moved there; other dtypes chunk by chunk on the CPU,
so a multi-gigabyte tensor needs only a few chunks of memory there.

Two kinds of numbers, each defined exactly:

- Pass/fail (``n_mismatch``, the verdict, ``min_atol`` and the greatest mismatched difference in
  the explanation) is ``torch.testing.assert_close(target, reference, rtol=…, atol=…,
  equal_nan=True, check_dtype=False)``: both tensors promoted to `rule_dtype` (e.g. bfloat16
  for two bfloat16 tensors, float32 for bfloat16 against float32) and compared there with
  ``torch.isclose`` (``|target − reference| <= atol + rtol·|reference|``, both sides rounded as
  that dtype rounds them). NaN against NaN passes (``equal_nan=True``, unlike assert_close's
  default), as does an infinity against the same infinity.
- Statistics (``max_abs``, ``mean_abs``, ``rmse``, ``rel_l2``, ``cos_sim``, ``max_ulp``) are of
  ``d = target − reference`` with both upcast to float64, over the elements finite in both,
  computed in float64 (sums and norms are kept with an unbounded exponent, so no partial sum
  overflows or underflows). ULP distances are in units of the *target's* dtype at the
  reference value.

The rule is evaluated with the rounding of torch's CPU kernels, on every device (as assert_close
does for tensors on different devices, which it compares on the CPU).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from core.numerics import kernel
from core.numerics.accumulate import (
    ChunkAccumulator,
    bitwise_equal_chunks,
    chunk_bounds,
    compare_torch,
    ldexp_or_inf,
    nan_inf_nonzero_counts,
    sqrt_wide,
    unravel_index,
)
from core.numerics.sketch import Sketch, block_starts, hist_bin_index, make_sketch
from core.numerics.tolerance import (
    DEFAULT_TOLERANCES,
    Tolerance,
    close_mask,
    default_tolerance,
    dtype_name,
    rule_dtype,
    ulp,
)

__all__ = [
    "DEFAULT_TOLERANCES",
    "VERDICTS",
    "DiffStats",
    "Health",
    "Tolerance",
    "close_mask",
    "compare",
    "default_tolerance",
    "explain",
    "health",
    "rule_dtype",
    "stats_to_row",
    "ulp",
    "verdict",
    "worst_verdict",
]

VERDICTS = ("identical", "within tolerance", "drift", "broken")  # ordered by severity


@dataclass(frozen=True)
class DiffStats:
    """Everything `compare` measures about one target tensor against its reference.

    Difference statistics (``max_abs`` … ``worst_*``) are over the elements finite in both
    tensors, in float64; they are NaN when the shapes differ. ``n_mismatch``, ``min_atol`` and
    ``mismatch_*`` follow the tolerance rule, evaluated in `rule_dtype` as assert_close does.
    """

    numel: int
    shape: tuple[int, ...]
    ref_shape: tuple[int, ...]
    target_dtype: str
    reference_dtype: str
    bitwise_equal: bool
    shape_mismatch: bool
    n_diff: int  # elements whose values are not exactly equal (NaN == NaN here)
    n_mismatch: int  # elements failing the tolerance rule (assert_close's "Mismatched elements")
    max_abs: float
    mean_abs: float
    rmse: float
    rel_l2: float
    cos_sim: float
    max_ulp: float
    # Smallest atol that passes every element finite in both at `rtol`; inf when a difference
    # overflows the rule's dtype (no atol passes it).
    min_atol: float
    worst_index: tuple[int, ...] | None  # where max_abs is; None when no finite element differs
    worst_target: float | None
    worst_reference: float | None
    # assert_close's "greatest absolute difference": the largest |target - reference| in the
    # rule's dtype over the mismatched elements only (NaN if one is NaN, the first such
    # element on ties); all None when nothing mismatches.
    mismatch_max_abs: float | None
    mismatch_index: tuple[int, ...] | None
    mismatch_target: float | None
    mismatch_reference: float | None
    n_nan: int
    n_inf: int
    ref_nan: int
    ref_inf: int
    n_nonfinite_new: int  # target NaN/Inf where the reference is finite or a different non-finite
    all_zero: bool  # target is all zeros while the reference is not
    rtol: float
    atol: float


@dataclass(frozen=True)
class Health:
    """Output health of a logits / hidden-state tensor."""

    n_nan: int
    n_inf: int
    all_zero: bool
    identical_rows: bool


def _fields(target: torch.Tensor, reference: torch.Tensor, tol: Tolerance) -> dict[str, Any]:
    return {
        "numel": target.numel(),
        "shape": tuple(target.shape),
        "ref_shape": tuple(reference.shape),
        "target_dtype": dtype_name(target.dtype),
        "reference_dtype": dtype_name(reference.dtype),
        "rtol": float(tol.rtol),
        "atol": float(tol.atol),
    }


def compare(
    target: torch.Tensor,
    reference: torch.Tensor,
    tolerance: Tolerance | None = None,
    chunk_elems: int = 1 << 22,
) -> DiffStats:
    """Measure how far `target` drifts from `reference`.

    `tolerance` defaults to `default_tolerance(target.dtype)`. Pass/fail is assert_close's
    (``equal_nan=True``, in `rule_dtype`), the statistics are float64 (see the module doc). The
    tensors may live on any devices (chunks are moved to the CPU), and memory stays bounded by
    `chunk_elems` (plus a flattening copy for non-contiguous inputs). Different shapes do not
    raise: the result has ``shape_mismatch=True`` and NaN metrics; nor does any value of a
    floating, integer or bool dtype. Integer and bool tensors are compared exactly (tolerance
    0); an integer tensor against a floating one is compared in the floating one's dtype, as
    assert_close promotes it.
    """
    if chunk_elems < 1:
        raise ValueError(f"chunk_elems must be positive, not {chunk_elems}")
    if not (target.is_floating_point() or reference.is_floating_point()):
        # Integer and bool tensors (position ids, masks) are compared exactly, as assert_close does.
        return _compare_exact(target.detach(), reference.detach(), chunk_elems)
    if not target.is_floating_point():
        target = target.to(reference.dtype)
    elif not reference.is_floating_point():
        reference = reference.to(target.dtype)
    tol = tolerance if tolerance is not None else default_tolerance(target.dtype)
    target, reference = target.detach(), reference.detach()
    t_flat, r_flat = target.reshape(-1), reference.reshape(-1)
    fields = _fields(target, reference, tol)
    numel = target.numel()

    if target.shape != reference.shape:
        n_nan, n_inf, t_nonzero = nan_inf_nonzero_counts(t_flat, chunk_elems)
        ref_nan, ref_inf, r_nonzero = nan_inf_nonzero_counts(r_flat, chunk_elems)
        nan = math.nan
        return DiffStats(
            **fields,
            bitwise_equal=False,
            shape_mismatch=True,
            # Nothing lines up, so every element counts as differing.
            n_diff=numel,
            n_mismatch=numel,
            max_abs=nan,
            mean_abs=nan,
            rmse=nan,
            rel_l2=nan,
            cos_sim=nan,
            max_ulp=nan,
            min_atol=nan,
            worst_index=None,
            worst_target=None,
            worst_reference=None,
            mismatch_max_abs=None,
            mismatch_index=None,
            mismatch_target=None,
            mismatch_reference=None,
            n_nan=n_nan,
            n_inf=n_inf,
            ref_nan=ref_nan,
            ref_inf=ref_inf,
            n_nonfinite_new=0,
            all_zero=numel > 0 and t_nonzero == 0 and r_nonzero > 0,
        )

    if _kernel_applies(target, reference):
        stats, _ = _kernel_measure(target, reference, tol, fields, chunk_elems, sketch=False)
        if stats is not None:
            return stats

    if bitwise_equal_chunks(t_flat, r_flat, chunk_elems):
        # Fast path: no float64 difference needed. Same bits means same NaN/Inf positions.
        n_nan, n_inf, _ = nan_inf_nonzero_counts(t_flat, chunk_elems)
        return DiffStats(
            **fields,
            bitwise_equal=True,
            shape_mismatch=False,
            n_diff=0,
            n_mismatch=0,
            max_abs=0.0,
            mean_abs=0.0,
            rmse=0.0,
            rel_l2=0.0,
            cos_sim=1.0,
            max_ulp=0.0,
            min_atol=0.0,
            worst_index=None,
            worst_target=None,
            worst_reference=None,
            mismatch_max_abs=None,
            mismatch_index=None,
            mismatch_target=None,
            mismatch_reference=None,
            n_nan=n_nan,
            n_inf=n_inf,
            ref_nan=n_nan,
            ref_inf=n_inf,
            n_nonfinite_new=0,
            all_zero=False,
        )

    acc = ChunkAccumulator(target.dtype, rule_dtype(target.dtype, reference.dtype), tol)
    for start, stop in chunk_bounds(numel, chunk_elems):
        acc.add(t_flat[start:stop].to("cpu"), r_flat[start:stop].to("cpu"), start)

    n = acc.n_finite
    # Sums over no finite element are zero, so the empty case reads as "no drift measured".
    mean_abs = ldexp_or_inf(acc.sum_abs.mant / n, acc.sum_abs.exp) if n else 0.0
    rmse = sqrt_wide(acc.sum_sq.mant / n, acc.sum_sq.exp) if n else 0.0
    t_zero, r_zero = acc.t_nonzero_finite == 0, acc.r_nonzero_finite == 0
    if r_zero:
        rel_l2 = 0.0 if acc.max_abs == 0.0 else math.inf
    else:
        rel_l2 = sqrt_wide(acc.sum_sq.mant / acc.sum_r2.mant, acc.sum_sq.exp - acc.sum_r2.exp)
    if t_zero and r_zero:
        cos_sim = 1.0
    elif t_zero or r_zero:
        cos_sim = math.nan
    else:
        # Σtr / sqrt(Σt²·Σr²) with the exponents apart; the product's exponent made even first.
        norms, exp = acc.sum_t2.mant * acc.sum_r2.mant, acc.sum_t2.exp + acc.sum_r2.exp
        if exp % 2:
            norms, exp = 2.0 * norms, exp - 1
        cos = ldexp_or_inf(acc.sum_tr.mant / math.sqrt(norms), acc.sum_tr.exp - exp // 2)
        # Clamped: rounding can push nearly parallel vectors just past ±1.
        cos_sim = max(-1.0, min(1.0, cos))
    shape = tuple(target.shape)

    return DiffStats(
        **fields,
        bitwise_equal=False,
        shape_mismatch=False,
        n_diff=acc.n_diff,
        n_mismatch=acc.n_mismatch,
        max_abs=acc.max_abs,
        mean_abs=mean_abs,
        rmse=rmse,
        rel_l2=rel_l2,
        cos_sim=cos_sim,
        max_ulp=acc.max_ulp,
        min_atol=acc.min_atol,
        worst_index=None if acc.worst_flat is None else unravel_index(acc.worst_flat, shape),
        worst_target=acc.worst_target,
        worst_reference=acc.worst_reference,
        mismatch_max_abs=acc.mismatch_max_abs,
        mismatch_index=None if acc.mismatch_flat is None else unravel_index(acc.mismatch_flat, shape),
        mismatch_target=acc.mismatch_target,
        mismatch_reference=acc.mismatch_reference,
        n_nan=acc.n_nan,
        n_inf=acc.n_inf,
        ref_nan=acc.ref_nan,
        ref_inf=acc.ref_inf,
        n_nonfinite_new=acc.n_nonfinite_new,
        all_zero=numel > 0 and acc.t_nonzero == 0 and acc.r_nonzero > 0,
    )


def _kernel_applies(target: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether the fused pass (`core.numerics.kernel`, or its torch port) measures this pair: dtypes it
    reads, the same shape."""
    return (
        target.dtype in kernel.SUPPORTED_DTYPES
        and reference.dtype in kernel.SUPPORTED_DTYPES
        and target.shape == reference.shape
    )


def _fused(
    target: torch.Tensor, reference: torch.Tensor, tol: Tolerance, chunk_elems: int, sketch: bool
) -> kernel.KernelStats:
    """The fused pass where the target is: the numba kernel on the CPU (the reference copied there if it is
    elsewhere), else its torch port (`accumulate.compare_torch`) on the target's device, the reference moved
    there whole: a GPU target never crosses to the host. Both give the same numbers, bit for bit."""
    if target.device.type == "cpu" and kernel.available():
        return kernel.compare_cpu(target, reference.cpu(), tol.rtol, tol.atol, sketch=sketch)
    return compare_torch(target, reference, tol.rtol, tol.atol, sketch=sketch, chunk_elems=chunk_elems)


def _kernel_measure(
    target: torch.Tensor,
    reference: torch.Tensor,
    tol: Tolerance,
    fields: dict[str, Any],
    chunk_elems: int,
    sketch: bool,
) -> tuple[DiffStats | None, Sketch | None]:
    """`compare` (and the sketch, when asked) in the fused pass (`_fused`); (None, None) where it does not measure."""
    k = _fused(target, reference, tol, chunk_elems, sketch)
    stats = _from_kernel(k, fields, target, reference)
    if stats is None:
        return None, None
    if not sketch or stats.bitwise_equal:
        return stats, None
    return stats, _sketch_from_kernel(
        k.sketch, tuple(target.shape), target.reshape(-1), reference.reshape(-1)
    )


def _sketch_from_kernel(
    k: kernel.Sketch, shape: tuple[int, ...], t_flat: torch.Tensor, r_flat: torch.Tensor
) -> Sketch:
    """The kernel's sketch in `core.numerics.sketch`'s terms (same fold and blocks; its log2 bins renumbered)."""
    rows, cols = k.fold
    bins = np.arange(k.hist_first_bin, k.hist_first_bin + len(k.hist_counts))
    keep = np.asarray(k.hist_counts) > 0
    edges = kernel.hist_bin_edges(bins[keep])
    flat = [int(i) for i in k.topk_index]
    return Sketch(
        shape=shape,
        rows=rows,
        cols=cols,
        row_starts=block_starts(rows),
        col_starts=block_starts(cols),
        pooled=np.asarray(k.pooled_abs, dtype=np.float64),
        failing=np.asarray(k.cell_mismatches, dtype=np.int64),
        hist_bins=hist_bin_index(edges),
        hist_counts=np.asarray(k.hist_counts, dtype=np.int64)[keep],
        n_zero=int(k.n_zero),
        n_nonfinite=int(k.n_nonfinite),
        top_index=[unravel_index(i, shape) for i in flat],
        top_target=[float(t_flat[i]) for i in flat],
        top_reference=[float(r_flat[i]) for i in flat],
    )


def measure(
    target: torch.Tensor, reference: torch.Tensor, tolerance: Tolerance, chunk_elems: int = 1 << 22
) -> tuple[DiffStats, Sketch | None]:
    """`compare`, and the `Sketch` of the difference when the tensors differ (same shape).

    Both come from the fused pass (`_fused`: the kernel on the CPU, its torch port on the target's
    device); for other dtypes the sketch is made row block by row block on the target's device. The
    sketch's failing counts follow `close_mask`.
    """
    target, reference = target.detach(), reference.detach()
    if _kernel_applies(target, reference):
        fields = _fields(target, reference, tolerance)
        stats, sketch = _kernel_measure(target, reference, tolerance, fields, chunk_elems, True)
        if stats is not None:
            return stats, sketch
    stats = compare(target, reference, tolerance, chunk_elems)
    if stats.bitwise_equal or stats.shape_mismatch:
        return stats, None
    return stats, make_sketch(
        target, reference, lambda t, r: ~close_mask(t, r, tolerance).to(t.device), chunk_elems=chunk_elems
    )


def _from_kernel(
    k: kernel.KernelStats, fields: dict[str, Any], target: torch.Tensor, reference: torch.Tensor
) -> DiffStats | None:
    """The kernel's measurement as DiffStats; None where the chunked path must measure instead.

    A float64 difference that overflows (±1.7e308 against ∓1.7e308) leaves the kernel's sums
    infinite, where the chunked path sums it at half size: that rare pair goes the chunked way.
    """
    if k.max_abs == math.inf and k.n_finite and k.n_nonfinite_new == 0:
        return None
    shape = tuple(target.shape)
    t_flat, r_flat = target.reshape(-1), reference.reshape(-1)
    mismatch = k.mismatch_max_abs_index
    return DiffStats(
        **fields,
        bitwise_equal=k.bitwise_equal,
        shape_mismatch=False,
        n_diff=k.n_diff,
        n_mismatch=k.n_mismatch,
        max_abs=k.max_abs,
        mean_abs=k.mean_abs,
        rmse=k.rmse,
        rel_l2=k.rel_l2,
        cos_sim=k.cos_sim,
        max_ulp=k.max_ulp,
        min_atol=k.min_atol,
        worst_index=None if k.worst_index is None else unravel_index(k.worst_index, shape),
        worst_target=k.worst_target,
        worst_reference=k.worst_reference,
        mismatch_max_abs=None if mismatch is None else k.mismatch_max_abs,
        mismatch_index=None if mismatch is None else unravel_index(mismatch, shape),
        mismatch_target=None if mismatch is None else float(t_flat[mismatch]),
        mismatch_reference=None if mismatch is None else float(r_flat[mismatch]),
        n_nan=k.n_nan,
        n_inf=k.n_inf,
        ref_nan=k.ref_nan,
        ref_inf=k.ref_inf,
        n_nonfinite_new=k.n_nonfinite_new,
        all_zero=k.all_zero,
    )


def _compare_exact(target: torch.Tensor, reference: torch.Tensor, chunk_elems: int) -> DiffStats:
    """Integer/bool tensors: equal or not, element by element (tolerance 0, as assert_close's default)."""
    fields = _fields(target, reference, Tolerance(rtol=0.0, atol=0.0))
    numel = target.numel()
    nan = math.nan
    if target.shape != reference.shape:
        return DiffStats(
            **fields, bitwise_equal=False, shape_mismatch=True, n_diff=numel, n_mismatch=numel,
            max_abs=nan, mean_abs=nan, rmse=nan, rel_l2=nan, cos_sim=nan, max_ulp=nan, min_atol=nan,
            worst_index=None, worst_target=None, worst_reference=None, mismatch_max_abs=None,
            mismatch_index=None, mismatch_target=None, mismatch_reference=None, n_nan=0, n_inf=0,
            ref_nan=0, ref_inf=0, n_nonfinite_new=0, all_zero=False,
        )  # fmt: skip
    t_flat, r_flat = target.reshape(-1), reference.reshape(-1)
    n_diff = 0
    max_abs = sum_abs = sum_sq = sum_r2 = sum_t2 = sum_tr = 0.0
    worst: int | None = None
    worst_t = worst_r = None
    for start, stop in chunk_bounds(numel, chunk_elems):
        # int64 differences are exact for every integer dtype but uint64 beyond 2^63 (not a torch weight).
        t = t_flat[start:stop].to("cpu").to(torch.int64)
        r = r_flat[start:stop].to("cpu").to(torch.int64)
        d = (t - r).abs()
        n_diff += int((d != 0).sum())
        tf, rf, df = t.to(torch.float64), r.to(torch.float64), d.to(torch.float64)
        sum_abs += float(df.sum())
        sum_sq += float((df * df).sum())
        sum_r2 += float((rf * rf).sum())
        sum_t2 += float((tf * tf).sum())
        sum_tr += float((tf * rf).sum())
        if d.numel():
            i = int(d.argmax())
            if float(d[i]) > max_abs:
                max_abs, worst, worst_t, worst_r = float(d[i]), start + i, float(t[i]), float(r[i])
    if n_diff == 0:
        cos = 1.0
    elif sum_t2 == 0 or sum_r2 == 0:
        cos = nan
    else:
        cos = max(-1.0, min(1.0, sum_tr / (math.sqrt(sum_t2) * math.sqrt(sum_r2))))
    return DiffStats(
        **fields,
        bitwise_equal=n_diff == 0 and target.dtype == reference.dtype,
        shape_mismatch=False,
        n_diff=n_diff,
        n_mismatch=n_diff,
        max_abs=max_abs,
        mean_abs=sum_abs / numel if numel else 0.0,
        rmse=math.sqrt(sum_sq / numel) if numel else 0.0,
        rel_l2=(math.sqrt(sum_sq) / math.sqrt(sum_r2)) if sum_r2 else (0.0 if n_diff == 0 else math.inf),
        cos_sim=cos,
        max_ulp=max_abs,  # integers are spaced 1 apart
        min_atol=max_abs,
        worst_index=None if worst is None else unravel_index(worst, tuple(target.shape)),
        worst_target=worst_t,
        worst_reference=worst_r,
        # Every differing integer mismatches, so assert_close's greatest is the first maximum.
        mismatch_max_abs=max_abs if worst is not None else None,
        mismatch_index=None if worst is None else unravel_index(worst, tuple(target.shape)),
        mismatch_target=worst_t,
        mismatch_reference=worst_r,
        n_nan=0,
        n_inf=0,
        ref_nan=0,
        ref_inf=0,
        n_nonfinite_new=0,
        all_zero=False,  # zeros where the file has values is a mismatch of values here, not a dead output
    )


def verdict(stats: DiffStats) -> str:
    """One of `VERDICTS`.

    "broken" (shape mismatch, NaN/Inf the reference does not have, or an all-zero target),
    "identical" (bitwise equal), "within tolerance" (no mismatched element), else "drift".
    """
    if stats.shape_mismatch or stats.n_nonfinite_new > 0 or stats.all_zero:
        return "broken"
    if stats.bitwise_equal:
        return "identical"
    if stats.n_mismatch == 0:
        return "within tolerance"
    return "drift"


def worst_verdict(verdicts: Iterable[str]) -> str:
    """The most severe of `verdicts`; ValueError if it is empty or holds an unknown verdict."""
    rank = -1
    for v in verdicts:
        if v not in VERDICTS:
            raise ValueError(f"unknown verdict {v!r}; expected one of {VERDICTS}")
        rank = max(rank, VERDICTS.index(v))
    if rank < 0:
        raise ValueError("worst_verdict() of no verdicts")
    return VERDICTS[rank]


def _g(x: float) -> str:
    return f"{x:.3g}"


def _fmt_tuple(t: tuple[int, ...]) -> str:
    # "(3)" rather than Python's "(3,)" for one dimension: this is for people.
    return "(" + ", ".join(map(str, t)) + ")"


def _mismatch_text(s: DiffStats) -> str:
    pct = 100.0 * s.n_mismatch / s.numel if s.numel else 0.0
    parts = [f"Mismatched elements: {s.n_mismatch} / {s.numel} ({pct:.1f}%)"]
    index, value, t, r = s.mismatch_index, s.mismatch_max_abs, s.mismatch_target, s.mismatch_reference
    if index is not None and value is not None and t is not None and r is not None:
        # assert_close's greatest absolute difference: over the mismatched elements only.
        parts.append(
            f"greatest abs diff {_g(value)} at {_fmt_tuple(index)} (target {_g(t)}, reference {_g(r)})"
        )
    if s.worst_index is not None:  # some finite element differs
        parts.append(f"greatest ulp diff {_g(s.max_ulp)}")
    # Mismatches may come only from NaN/Inf, where no atol helps.
    if s.min_atol == math.inf:
        rule = rule_dtype(getattr(torch, s.target_dtype), getattr(torch, s.reference_dtype))
        parts.append(f"no atol passes at rtol {_g(s.rtol)}: a difference overflows {dtype_name(rule)}")
    elif s.min_atol > s.atol:
        parts.append(f"needs atol ≥ {_g(s.min_atol)} at rtol {_g(s.rtol)}")
    return " · ".join(parts)


def explain(stats: DiffStats) -> str:
    """A one-line, assert_close-style explanation of the verdict (detailed for failing rows)."""
    if stats.shape_mismatch:
        return f"shape mismatch: target {_fmt_tuple(stats.shape)} vs reference {_fmt_tuple(stats.ref_shape)}"
    if stats.all_zero:
        return "target is all zeros, reference is not"
    if stats.n_nonfinite_new > 0:
        if stats.ref_nan == 0 and stats.ref_inf == 0:
            cause = f"{stats.n_nan} NaN / {stats.n_inf} Inf where the reference is finite"
        else:
            cause = (
                f"{stats.n_nonfinite_new} NaN/Inf where the reference differs "
                f"(target {stats.n_nan} NaN / {stats.n_inf} Inf, "
                f"reference {stats.ref_nan} NaN / {stats.ref_inf} Inf)"
            )
        return f"{cause} · {_mismatch_text(stats)}"
    if stats.bitwise_equal:
        return "bitwise identical"
    if stats.n_mismatch == 0:
        if stats.n_diff == 0:
            return "within tolerance (equal values, different bits: signed zeros or NaN payloads)"
        return f"within tolerance (max abs {_g(stats.max_abs)}, {_g(stats.max_ulp)} ulp)"
    return _mismatch_text(stats)


def stats_to_row(stats: DiffStats) -> dict[str, Any]:
    """A flat dict of `stats` for a pandas metrics table, plus "verdict" and "explanation".

    Shapes become strings like "4x8" and the worst and mismatch indices strings like
    "(3, 17)" (None when there is none), so every column has a scalar type.
    """
    # its fields are scalars and tuples: a shallow copy (asdict's deep one cost 0.3 ms a row)
    row = {f.name: getattr(stats, f.name) for f in fields(stats)}
    row["shape"] = "x".join(map(str, stats.shape))
    row["ref_shape"] = "x".join(map(str, stats.ref_shape))
    for name in ("worst_index", "mismatch_index"):
        index = getattr(stats, name)
        row[name] = None if index is None else _fmt_tuple(index)
    row["verdict"] = verdict(stats)
    row["explanation"] = explain(stats)
    return row


def health(t: torch.Tensor) -> Health:
    """Output health of a logits / hidden-state tensor.

    Rows are all leading dims flattened, the last dim holds the features. ``identical_rows`` is
    True when there are at least two rows and every row equals the first exactly (NaN equal to
    NaN), a typical sign of a collapsed model. Works on the tensor's device, in row blocks.
    """
    t = t.detach()
    if t.numel() == 0:
        return Health(n_nan=0, n_inf=0, all_zero=False, identical_rows=False)
    features = t.shape[-1] if t.dim() > 0 else 1
    rows = t.reshape(-1, features)
    first = rows[0]
    floating = t.is_floating_point()
    block = max(1, (1 << 22) // features)
    n_nan = n_inf = 0
    any_nonzero = False
    identical = rows.shape[0] >= 2
    for start in range(0, rows.shape[0], block):
        b = rows[start : start + block]
        eq = b == first
        if floating:
            b_nan = b.isnan()
            n_nan += int(b_nan.sum())
            n_inf += int(b.isinf().sum())
            eq |= b_nan & first.isnan()
        any_nonzero = any_nonzero or bool((b != 0).any())
        identical = identical and bool(eq.all())
    return Health(n_nan=n_nan, n_inf=n_inf, all_zero=not any_nonzero, identical_rows=identical)
