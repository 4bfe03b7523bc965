"""Numerical drift between a target tensor and a reference tensor.

Pure tensor math: no Streamlit, no global state. Every statistic is computed in float64 on the
CPU, chunk by chunk, so comparing a multi-gigabyte tensor needs only a few chunks of memory and
a tensor on any device (or on two different devices) can be compared.

Definitions follow the design doc: ``d = target - reference`` (both upcast to float64); an
element passes where ``|d| <= atol + rtol * |reference|`` (the rule of
``torch.testing.assert_close``); ULP distances are in units of the *target's* dtype at the
reference value.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any

import torch

__all__ = [
    "DEFAULT_TOLERANCES",
    "VERDICTS",
    "DiffStats",
    "Health",
    "Tolerance",
    "compare",
    "default_tolerance",
    "explain",
    "health",
    "stats_to_row",
    "ulp",
    "verdict",
    "worst_verdict",
]

VERDICTS = ("identical", "within tolerance", "drift", "broken")  # ordered by severity

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Tolerance:
    """Element-wise tolerance: an element passes where ``|d| <= atol + rtol * |reference|``."""

    rtol: float
    atol: float

    def __post_init__(self) -> None:
        # Negative or NaN tolerances would make equal elements fail and min_atol meaningless.
        if not (self.rtol >= 0 and self.atol >= 0):
            raise ValueError(f"rtol and atol must be non-negative, not rtol={self.rtol}, atol={self.atol}")


# Read-only so that no caller can change the defaults for everybody else.
DEFAULT_TOLERANCES: Mapping[str, Tolerance] = MappingProxyType(
    {
        "float16": Tolerance(rtol=1e-3, atol=1e-5),
        "bfloat16": Tolerance(rtol=1.6e-2, atol=1e-5),
        "float32": Tolerance(rtol=1.3e-6, atol=1e-5),
        "float64": Tolerance(rtol=1e-7, atol=1e-7),
    }
)


@dataclass(frozen=True)
class DiffStats:
    """Everything `compare` measures about one target tensor against its reference.

    Difference statistics (``max_abs`` … ``worst_*``) are over the elements finite in both
    tensors; they are NaN when the shapes differ.
    """

    numel: int
    shape: tuple[int, ...]
    ref_shape: tuple[int, ...]
    target_dtype: str
    reference_dtype: str
    bitwise_equal: bool
    shape_mismatch: bool
    n_diff: int  # elements whose values are not exactly equal (NaN == NaN here)
    n_mismatch: int  # elements failing the tolerance rule
    max_abs: float
    mean_abs: float
    rmse: float
    rel_l2: float
    cos_sim: float
    max_ulp: float
    min_atol: float  # smallest atol that passes every finite element at `rtol`
    worst_index: tuple[int, ...] | None  # None when no finite element differs
    worst_target: float | None
    worst_reference: float | None
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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def default_tolerance(dtype: torch.dtype | str) -> Tolerance:
    """The default tolerance for a TARGET dtype (a ``torch.dtype`` or its name, e.g. ``"float32"``).

    Raises TypeError for non-floating dtypes and ValueError for floating dtypes without a default
    (e.g. float8): pass an explicit `Tolerance` for those.
    """
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise TypeError(f"no tolerance for non-floating dtype {dtype}")
        name = _dtype_name(dtype)
    else:
        name = dtype.removeprefix("torch.")
    try:
        return DEFAULT_TOLERANCES[name]
    except KeyError:
        raise ValueError(f"no default tolerance for dtype {name!r}; pass a Tolerance") from None


def _float_format(dtype: torch.dtype) -> tuple[int, int]:
    """(p, e_min): mantissa digits incl. the implicit bit, and frexp's exponent of the smallest normal."""
    if not dtype.is_floating_point:
        raise TypeError(f"ULP is defined for floating dtypes only, not {dtype}")
    info = torch.finfo(dtype)
    # Derived from finfo (exact powers of two) so float8 formats work too: eps = 2^(1-p).
    _, eps_exp = math.frexp(info.eps)
    _, e_min = math.frexp(info.tiny)
    return 2 - eps_exp, e_min


def _spacing(abs_x: torch.Tensor, p: int, e_min: int) -> torch.Tensor:
    """ulp for finite, non-negative float64 `abs_x`, built from float64 bit patterns.

    Exact (no exp2/ldexp, which are not guaranteed exact for subnormal results) and cheap:
    the clamp to the dtype's smallest normal turns frexp's exponent e into max(e, e_min).
    """
    a = abs_x.clamp(min=2.0 ** (e_min - 1))
    # For a normal float64 a with biased exponent b, frexp's e is b - 1022, so 2^(e - p)
    # has biased exponent b + 1 - p.
    k = (a.view(torch.int64) >> 52) + (1 - p)
    if e_min - p >= -1022:  # every format but float64: the spacing is a normal float64
        return (k << 52).view(torch.float64)
    # float64 targets: spacings below 2^-1022 are float64 subnormals, 2^(k - 1023) = bit k + 51.
    subnormal = torch.bitwise_left_shift(torch.ones_like(k), (k + 51).clamp(0, 62))
    return torch.where(k >= 1, k << 52, subnormal).view(torch.float64)


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at ``|x|``, element-wise, as float64 on x's device.

    With ``x = m·2^e`` (``m`` in [0.5, 1)), the spacing is ``2^(max(e, e_min) - p)``; zero and
    subnormals get the subnormal spacing, e.g. ``ulp(1.0, float32) = 2^-23`` and
    ``ulp(0, float32) = 2^-149``. Non-finite x gives NaN. Raises TypeError for non-floating dtypes.
    """
    p, e_min = _float_format(dtype)
    x64 = x.detach().to(torch.float64)
    finite = torch.isfinite(x64)
    spacing = _spacing(torch.where(finite, x64, 0.0).abs(), p, e_min)
    return torch.where(finite, spacing, math.nan)


def _cpu_f64(t: torch.Tensor) -> torch.Tensor:
    # Two steps: some devices (MPS) cannot hold float64, so convert only once on the CPU.
    return t.to("cpu").to(torch.float64)


def _chunks(n: int, size: int) -> Iterable[tuple[int, int]]:
    for start in range(0, n, size):
        yield start, min(start + size, n)


def _bitwise_equal(t_flat: torch.Tensor, r_flat: torch.Tensor, chunk: int) -> bool:
    """Identical bit patterns after casting both to the wider dtype (widening casts are exact)."""
    if t_flat.dtype == r_flat.dtype:
        wide = t_flat.dtype
    else:
        try:
            wide = torch.promote_types(t_flat.dtype, r_flat.dtype)
        except RuntimeError:  # e.g. float8 has no promotion rules; float64 holds every format
            wide = torch.float64
    as_int = _INT_OF_SIZE[wide.itemsize]
    for start, stop in _chunks(t_flat.numel(), chunk):
        a = t_flat[start:stop].to("cpu").to(wide).view(as_int)
        b = r_flat[start:stop].to("cpu").to(wide).view(as_int)
        if not torch.equal(a, b):
            return False
    return True


def _census(flat: torch.Tensor, chunk: int) -> tuple[int, int, int]:
    """(NaN count, Inf count, non-zero count) of a flat tensor, chunk by chunk."""
    n_nan = n_inf = n_nonzero = 0
    for start, stop in _chunks(flat.numel(), chunk):
        c = flat[start:stop].to("cpu")
        n_nan += int(c.isnan().sum())
        n_inf += int(c.isinf().sum())
        n_nonzero += int((c != 0).sum())
    return n_nan, n_inf, n_nonzero


def _unravel(flat_index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        flat_index, rest = divmod(flat_index, size)
        index.append(rest)
    return tuple(reversed(index))


class _Accumulator:
    """Running sums, counts and maxima over the chunks of one comparison (internal, mutable)."""

    def __init__(self, target_dtype: torch.dtype, tol: Tolerance) -> None:
        self.p, self.e_min = _float_format(target_dtype)
        self.tol = tol
        self.n_diff = self.n_mismatch = self.n_finite = 0
        self.n_nan = self.n_inf = self.ref_nan = self.ref_inf = self.n_nonfinite_new = 0
        self.t_nonzero = self.r_nonzero = 0  # over all elements (NaN/Inf count as non-zero)
        self.t_nonzero_finite = self.r_nonzero_finite = 0
        self.sum_abs = self.sum_sq = self.sum_r2 = self.sum_t2 = self.sum_tr = 0.0
        self.max_abs = self.max_ulp = self.min_atol = 0.0
        self.worst_flat: int | None = None
        self.worst_target: float | None = None
        self.worst_reference: float | None = None

    def add(self, t: torch.Tensor, r: torch.Tensor, offset: int) -> None:
        """Fold one chunk in: `t`, `r` are flat float64 CPU tensors starting at flat `offset`."""
        t_finite, r_finite = t.isfinite(), r.isfinite()
        if bool(t_finite.all()) and bool(r_finite.all()):
            # The common case, without the masking below.
            tf, rf, d = t, r, t - r
            same = t == r
            n_finite = t.numel()
        else:
            self._add_nonfinite(t, r, t_finite, r_finite)
            finite = t_finite & r_finite
            zero = torch.zeros((), dtype=torch.float64)
            tf = torch.where(finite, t, zero)
            rf = torch.where(finite, r, zero)
            d = tf - rf
            # Both NaN, or the same infinity, counts as equal (assert_close with equal_nan=True).
            same = (t == r) | (t.isnan() & r.isnan())
            self.n_nonfinite_new += int((~t_finite & ~same).sum())
            n_finite = int(finite.sum())

        ad = d.abs()
        # Same operations and order as torch.isclose, so pass/fail agrees bit for bit.
        # Masked elements have ad == 0 and so pass here; `same` decides them.
        rel_allowed = (rf * self.tol.rtol).abs()
        fails = ad > self.tol.atol + rel_allowed
        self.n_diff += int((~same).sum())
        self.n_mismatch += int((fails | ~(same | t_finite & r_finite)).sum())
        self.t_nonzero += int((t != 0).sum())
        self.r_nonzero += int((r != 0).sum())
        self.n_finite += n_finite
        self.t_nonzero_finite += int((tf != 0).sum())
        self.r_nonzero_finite += int((rf != 0).sum())

        self.sum_abs += float(ad.sum())
        self.sum_sq += float((d * d).sum())
        self.sum_r2 += float((rf * rf).sum())
        self.sum_t2 += float((tf * tf).sum())
        self.sum_tr += float((tf * rf).sum())

        if ad.numel() == 0:
            return
        i = int(ad.argmax())  # first occurrence of the maximum, so ties do not depend on chunking
        max_abs = float(ad[i])
        if max_abs > self.max_abs:  # strict: an earlier chunk wins ties
            self.max_abs = max_abs
            self.worst_flat = offset + i
            self.worst_target = float(t[i])
            self.worst_reference = float(r[i])
        if max_abs == 0.0:
            return  # no finite difference: max_ulp and min_atol stay 0

        self.max_ulp = max(self.max_ulp, float((ad / _spacing(rf.abs(), self.p, self.e_min)).max()))
        self.min_atol = max(self.min_atol, _least_passing_atol(ad, rel_allowed, max_abs))

    def _add_nonfinite(
        self, t: torch.Tensor, r: torch.Tensor, t_finite: torch.Tensor, r_finite: torch.Tensor
    ) -> None:
        t_nan, r_nan = t.isnan(), r.isnan()
        self.n_nan += int(t_nan.sum())
        self.ref_nan += int(r_nan.sum())
        self.n_inf += int((~t_finite).sum()) - int(t_nan.sum())
        self.ref_inf += int((~r_finite).sum()) - int(r_nan.sum())


def _least_passing_atol(ad: torch.Tensor, rel_allowed: torch.Tensor, max_abs: float) -> float:
    """The smallest float64 atol with ``ad <= atol + rel_allowed`` (in float64) for all elements.

    ``ad - rel_allowed`` is within two ulps of ``ad`` of the per-element answer, but rounding of
    the subtraction and of isclose's addition can put it on either side, and under cancellation
    two ulps of ``ad`` are many ulps of the answer. So bisect on the bit patterns (ordered like
    the values for non-negative floats). Only elements within that rounding margin of the
    naive maximum can hold the maximum. The test is monotonic in atol, so the result is exact
    whatever the chunking.
    """
    naive = (ad - rel_allowed).clamp(min=0)
    top = float(naive.max())
    if top == 0.0:
        return 0.0  # naive 0 means ad <= rel_allowed exactly: atol 0 passes
    margin = 16 * (max_abs * 2.0**-52 + 2.0**-1074)  # >= 8 ulps of any ad in the chunk
    idx = torch.nonzero(naive >= top - margin).squeeze(1)
    ad, rel, naive = ad[idx], rel_allowed[idx], naive[idx]

    def passes(bits: torch.Tensor) -> torch.Tensor:
        return ad <= bits.clamp(min=0).view(torch.float64) + rel

    # hi passes: naive is at most an ulp of itself short of passing.
    hi = naive.view(torch.int64)
    for _ in range(64):  # the cap only guards against a bug
        short = ~passes(hi)
        if not bool(short.any()):
            break
        hi = hi + short.to(torch.int64)
    # lo fails, or is -1 standing for "below 0.0": two ulps of ad below naive never pass.
    lo_val = naive - 2 * _spacing(ad, 53, -1021)
    lo = torch.where(lo_val > 0, lo_val.clamp(min=0).view(torch.int64), -1)
    lo = torch.where((lo >= 0) & passes(lo), -1, lo)
    while bool((hi - lo > 1).any()):  # at most 64 rounds: the gap halves each time
        mid = lo + (hi - lo) // 2
        ok = passes(mid) & (mid >= 0)
        hi = torch.where(ok, mid, hi)
        lo = torch.where(ok, lo, mid)
    return float(hi.view(torch.float64).max())


def _fields(target: torch.Tensor, reference: torch.Tensor, tol: Tolerance) -> dict[str, Any]:
    return {
        "numel": target.numel(),
        "shape": tuple(target.shape),
        "ref_shape": tuple(reference.shape),
        "target_dtype": _dtype_name(target.dtype),
        "reference_dtype": _dtype_name(reference.dtype),
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

    `tolerance` defaults to `default_tolerance(target.dtype)`. The tensors may live on any
    devices (chunks are moved to the CPU as float64), and memory stays bounded by `chunk_elems`
    (plus a flattening copy for non-contiguous inputs). Different shapes do not raise: the
    result has ``shape_mismatch=True`` and NaN metrics. Integer and bool tensors are compared
    exactly (tolerance 0); an integer tensor against a floating one is compared as floating.
    """
    if chunk_elems < 1:
        raise ValueError(f"chunk_elems must be positive, not {chunk_elems}")
    if not (target.is_floating_point() or reference.is_floating_point()):
        # Integer and bool tensors (position ids, masks) are compared exactly, as assert_close does.
        return _compare_exact(target.detach(), reference.detach(), chunk_elems)
    if not target.is_floating_point():
        target = target.to(reference.dtype)
    elif not reference.is_floating_point():
        reference = reference.to(torch.float64)
    tol = tolerance if tolerance is not None else default_tolerance(target.dtype)
    target, reference = target.detach(), reference.detach()
    t_flat, r_flat = target.reshape(-1), reference.reshape(-1)
    fields = _fields(target, reference, tol)
    numel = target.numel()

    if target.shape != reference.shape:
        n_nan, n_inf, t_nonzero = _census(t_flat, chunk_elems)
        ref_nan, ref_inf, r_nonzero = _census(r_flat, chunk_elems)
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
            n_nan=n_nan,
            n_inf=n_inf,
            ref_nan=ref_nan,
            ref_inf=ref_inf,
            n_nonfinite_new=0,
            all_zero=numel > 0 and t_nonzero == 0 and r_nonzero > 0,
        )

    if _bitwise_equal(t_flat, r_flat, chunk_elems):
        # Fast path: no float64 difference needed. Same bits means same NaN/Inf positions.
        n_nan, n_inf, _ = _census(t_flat, chunk_elems)
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
            n_nan=n_nan,
            n_inf=n_inf,
            ref_nan=n_nan,
            ref_inf=n_inf,
            n_nonfinite_new=0,
            all_zero=False,
        )

    acc = _Accumulator(target.dtype, tol)
    for start, stop in _chunks(numel, chunk_elems):
        acc.add(_cpu_f64(t_flat[start:stop]), _cpu_f64(r_flat[start:stop]), start)

    n = acc.n_finite
    # Sums over no finite element are zero, so the empty case reads as "no drift measured".
    mean_abs = acc.sum_abs / n if n else 0.0
    rmse = math.sqrt(acc.sum_sq / n) if n else 0.0
    if acc.r_nonzero_finite == 0 or acc.sum_r2 == 0.0:
        rel_l2 = 0.0 if acc.max_abs == 0.0 else math.inf
    else:
        rel_l2 = math.sqrt(acc.sum_sq) / math.sqrt(acc.sum_r2)
    t_zero, r_zero = acc.t_nonzero_finite == 0, acc.r_nonzero_finite == 0
    if t_zero and r_zero:
        cos_sim = 1.0
    elif t_zero or r_zero:
        cos_sim = math.nan
    else:
        denom = math.sqrt(acc.sum_t2) * math.sqrt(acc.sum_r2)
        # Clamped: rounding can push nearly parallel vectors just past ±1.
        cos_sim = max(-1.0, min(1.0, acc.sum_tr / denom)) if denom > 0 else math.nan

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
        worst_index=None if acc.worst_flat is None else _unravel(acc.worst_flat, tuple(target.shape)),
        worst_target=acc.worst_target,
        worst_reference=acc.worst_reference,
        n_nan=acc.n_nan,
        n_inf=acc.n_inf,
        ref_nan=acc.ref_nan,
        ref_inf=acc.ref_inf,
        n_nonfinite_new=acc.n_nonfinite_new,
        all_zero=numel > 0 and acc.t_nonzero == 0 and acc.r_nonzero > 0,
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
            worst_index=None, worst_target=None, worst_reference=None, n_nan=0, n_inf=0, ref_nan=0,
            ref_inf=0, n_nonfinite_new=0, all_zero=False,
        )  # fmt: skip
    t_flat, r_flat = target.reshape(-1), reference.reshape(-1)
    n_diff = 0
    max_abs = sum_abs = sum_sq = sum_r2 = sum_t2 = sum_tr = 0.0
    worst: int | None = None
    worst_t = worst_r = None
    for start, stop in _chunks(numel, chunk_elems):
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
        worst_index=None if worst is None else _unravel(worst, tuple(target.shape)),
        worst_target=worst_t,
        worst_reference=worst_r,
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
    if s.worst_index is not None and s.worst_target is not None and s.worst_reference is not None:
        parts.append(
            f"greatest abs diff {_g(s.max_abs)} at {_fmt_tuple(s.worst_index)} "
            f"(target {_g(s.worst_target)}, reference {_g(s.worst_reference)})"
        )
        parts.append(f"greatest ulp diff {_g(s.max_ulp)}")
    # Mismatches may come only from NaN/Inf, where no atol helps.
    if s.min_atol > s.atol:
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

    Shapes become strings like "4x8" and the worst index a string like "(3, 17)" (None when
    there is none), so every column has a scalar type.
    """
    row = asdict(stats)
    row["shape"] = "x".join(map(str, stats.shape))
    row["ref_shape"] = "x".join(map(str, stats.ref_shape))
    row["worst_index"] = None if stats.worst_index is None else _fmt_tuple(stats.worst_index)
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


def mismatch_mask(target: torch.Tensor, reference: torch.Tensor, tol: Tolerance) -> torch.Tensor:
    """The elements of two same-shape tensors that `compare` counts in `n_mismatch`, as a bool mask.

    On the target's device; the rule of ``torch.testing.assert_close`` (with NaN equal to NaN),
    a NaN/Inf the other side does not share failing whatever the tolerance.
    """
    t = target.detach().to(torch.float64)
    r = reference.detach().to(target.device).to(torch.float64)
    same = (t == r) | (t.isnan() & r.isnan())
    finite = t.isfinite() & r.isfinite()
    d = torch.where(finite, t - r, torch.zeros((), dtype=torch.float64, device=t.device)).abs()
    fails = d > tol.atol + (torch.where(finite, r, 0.0) * tol.rtol).abs()
    return (finite & fails) | ~(same | finite)
