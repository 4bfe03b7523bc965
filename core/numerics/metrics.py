"""Numerical drift between a target tensor and a reference tensor.

Pure tensor math: no Streamlit, no global state. Tensors are compared chunk by chunk on the CPU,
so comparing a multi-gigabyte tensor needs only a few chunks of memory and a tensor on any
device (or on two different devices) can be compared.

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

The rule is evaluated on the CPU, as assert_close does for tensors on different devices.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from core.numerics import kernel
from core.numerics.sketch import Sketch, block_starts, hist_bin_index, make_sketch

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

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_RULE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def rule_dtype(target_dtype: torch.dtype, reference_dtype: torch.dtype) -> torch.dtype:
    """The dtype the tolerance rule is evaluated in: ``torch.promote_types`` of the two, as in assert_close.

    Formats without promotion or arithmetic in torch (float8) fall back to float64, which holds
    them exactly.
    """
    try:
        dtype = torch.promote_types(target_dtype, reference_dtype)
    except RuntimeError:
        return torch.float64
    return dtype if dtype in _RULE_DTYPES else torch.float64


def _isclose(t: torch.Tensor, r: torch.Tensor, rtol: float, atol: float) -> torch.Tensor:
    # The one place pass/fail is decided: t and r already in rule_dtype. Exactly what
    # assert_close(equal_nan=True) computes after promoting, so the two agree bit for bit.
    return torch.isclose(t, r, rtol=rtol, atol=atol, equal_nan=True)


def close_mask(target: torch.Tensor, reference: torch.Tensor, tolerance: Tolerance) -> torch.Tensor:
    """Where `target` passes the tolerance rule against `reference`, element-wise, on the CPU.

    The rule of `compare`: both promoted to `rule_dtype`, then ``torch.isclose`` with
    ``equal_nan=True``. Integer and bool tensors are compared exactly, as `compare` does.
    """
    target, reference = target.detach().to("cpu"), reference.detach().to("cpu")
    if not (target.is_floating_point() or reference.is_floating_point()):
        return target.to(torch.int64) == reference.to(torch.int64)
    dtype = rule_dtype(target.dtype, reference.dtype)
    return _isclose(target.to(dtype), reference.to(dtype), tolerance.rtol, tolerance.atol)


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


def _chunks(n: int, size: int) -> Iterable[tuple[int, int]]:
    for start in range(0, n, size):
        yield start, min(start + size, n)


def _bitwise_equal(t_flat: torch.Tensor, r_flat: torch.Tensor, chunk: int) -> bool:
    """Identical bit patterns after casting both to the wider dtype (widening casts are exact)."""
    wide = t_flat.dtype if t_flat.dtype == r_flat.dtype else rule_dtype(t_flat.dtype, r_flat.dtype)
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


def _ldexp(m: float, e: int) -> float:
    """``m · 2**e`` rounded once, ±inf where it overflows (where math.ldexp raises)."""
    try:
        return math.ldexp(m, e)
    except OverflowError:
        return math.copysign(math.inf, m)


def _sqrt_wide(m: float, e: int) -> float:
    """``sqrt(m · 2**e)`` for ``m >= 0`` and any integer exponent."""
    if e % 2:
        m, e = 2.0 * m, e - 1
    return _ldexp(math.sqrt(m), e // 2)


def _bits(x: float) -> int:
    """The bit pattern of a non-negative float64, ordered like the values."""
    return int(struct.unpack("<q", struct.pack("<d", x))[0])


def _from_bits(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])


class _WideSum:
    """A running float64 sum with an unbounded exponent: ``mant · 2**exp``, ``mant`` in [0.5, 1).

    Each `add` rounds like one float64 addition, but no partial sum overflows or underflows:
    the sum of 1e200² and 2e200², or of squared subnormals, keeps its 53 bits.
    """

    def __init__(self) -> None:
        self.mant, self.exp = 0.0, 0

    def add(self, value: float, exp: int = 0) -> None:
        """Add ``value · 2**exp`` (`value` finite)."""
        if value == 0.0:
            return
        m, e = math.frexp(value)
        e += exp
        if self.mant != 0.0:
            top = max(e, self.exp)
            # Aligned to the larger exponent both terms are below 1: the sum cannot overflow.
            m, e = math.frexp(math.ldexp(self.mant, self.exp - top) + math.ldexp(m, e - top))
            e += top
        self.mant, self.exp = m, e


def _scale2(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x · 2**k`` in two exact steps (one power of two cannot span the float64 range)."""
    half = k // 2
    return x * 2.0**half * 2.0 ** (k - half)


def _sum_squares(x: torch.Tensor) -> tuple[float, int]:
    """``Σx²`` of a finite float64 tensor as ``(s, k)``, meaning ``s · 4**k``.

    Plain float64 squares are right to rounding when their sum is finite and at least 2^-800:
    the squares that underflow (of elements below 2^-511) then add under 2^-200 of it.
    Otherwise scale by the power of two above the peak first (exact), as LAPACK's dnrm2 does,
    so that nothing that matters overflows or underflows.
    """
    s = float((x * x).sum())
    if 2.0**-800 <= s < math.inf:
        return s, 0
    peak = float(x.abs().max()) if x.numel() else 0.0
    if peak == 0.0:
        return 0.0, 0
    k = math.frexp(peak)[1]  # peak < 2**k
    y = _scale2(x, -k)
    return float((y * y).sum()), k


def _sum_abs(ad: torch.Tensor, peak: float) -> tuple[float, int]:
    """``Σ ad`` of finite non-negative float64 `ad` (largest element `peak`) as ``(s, k)``: ``s · 2**k``."""
    s = float(ad.sum())
    if s < math.inf:
        return s, 0
    k = math.frexp(peak)[1]
    return float(_scale2(ad, -k).sum()), k


def _dot(t: torch.Tensor, r: torch.Tensor, kt: int, kr: int) -> tuple[float, int]:
    """``Σ t·r`` as ``(s, e)``: ``s · 2**e``, with t and r scaled by the ``2**-k`` of their `_sum_squares`.

    Scaled so, no product overflows, and the ones that underflow are negligible next to
    ``‖t‖·‖r‖`` (the only thing the dot product is divided by).
    """
    if kt == kr == 0:
        return float((t * r).sum()), 0
    return float((_scale2(t, -kt) * _scale2(r, -kr)).sum()), kt + kr


class _Accumulator:
    """Running sums, counts and maxima over the chunks of one comparison (internal, mutable)."""

    def __init__(self, target_dtype: torch.dtype, rule: torch.dtype, tol: Tolerance) -> None:
        self.p, self.e_min = _float_format(target_dtype)
        self.rule = rule
        self.tol = tol
        self.n_diff = self.n_mismatch = self.n_finite = 0
        self.n_nan = self.n_inf = self.ref_nan = self.ref_inf = self.n_nonfinite_new = 0
        self.t_nonzero = self.r_nonzero = 0  # over all elements (NaN/Inf count as non-zero)
        self.t_nonzero_finite = self.r_nonzero_finite = 0
        self.sum_abs, self.sum_sq, self.sum_t2, self.sum_r2, self.sum_tr = (_WideSum() for _ in range(5))
        self.max_abs = self.max_ulp = self.min_atol = 0.0
        self.worst_flat: int | None = None
        self.worst_target: float | None = None
        self.worst_reference: float | None = None
        self.mismatch_max_abs: float | None = None
        self.mismatch_flat: int | None = None
        self.mismatch_target: float | None = None
        self.mismatch_reference: float | None = None

    def add(self, t_raw: torch.Tensor, r_raw: torch.Tensor, offset: int) -> None:
        """Fold one chunk in: flat CPU tensors in their own dtypes, starting at flat `offset`."""
        t, r = t_raw.to(torch.float64), r_raw.to(torch.float64)
        t_finite, r_finite = t.isfinite(), r.isfinite()
        finite: torch.Tensor | None = None  # None: every element is finite in both
        if bool(t_finite.all()) and bool(r_finite.all()):
            # The common case, without the masking below.
            tf, rf = t, r
            same = t == r
            n_finite = t.numel()
        else:
            self._add_nonfinite(t, r, t_finite, r_finite)
            finite = t_finite & r_finite
            zero = torch.zeros((), dtype=torch.float64)
            tf = torch.where(finite, t, zero)
            rf = torch.where(finite, r, zero)
            # Both NaN, or the same infinity, counts as equal (assert_close with equal_nan=True).
            same = (t == r) | (t.isnan() & r.isnan())
            self.n_nonfinite_new += int((~t_finite & ~same).sum())
            n_finite = int(finite.sum())

        n_diff = t.numel() - int(same.sum())
        self.n_diff += n_diff
        self.t_nonzero += int((t != 0).sum())
        self.r_nonzero += int((r != 0).sum())
        self.n_finite += n_finite
        self.t_nonzero_finite += int((tf != 0).sum())
        self.r_nonzero_finite += int((rf != 0).sum())
        st, kt = _sum_squares(tf)
        sr, kr = _sum_squares(rf)
        self.sum_t2.add(st, 2 * kt)
        self.sum_r2.add(sr, 2 * kr)
        self.sum_tr.add(*_dot(tf, rf, kt, kr))
        if n_diff == 0:
            return  # equal values pass the rule and add nothing to the difference statistics

        self._add_rule(t_raw.to(self.rule), r_raw.to(self.rule), finite, t, r, offset)

        d = tf - rf
        ad = d.abs()
        i = int(ad.argmax())  # first occurrence of the maximum, so ties do not depend on chunking
        max_abs = float(ad[i])
        if max_abs > self.max_abs:  # strict: an earlier chunk wins ties
            self.max_abs = max_abs
            self.worst_flat = offset + i
            self.worst_target = float(t[i])
            self.worst_reference = float(r[i])
        if max_abs == 0.0:
            return  # no finite difference: nothing to add to sums or max_ulp

        spacing = _spacing(rf.abs(), self.p, self.e_min)
        if max_abs < math.inf:
            self.sum_abs.add(*_sum_abs(ad, max_abs))
            s, k = _sum_squares(d)
            self.sum_sq.add(s, 2 * k)
            ulps = ad / spacing
        else:
            # t - r overflowed float64 (both near ±1.8e308): sum d/2 instead, exact but for
            # the last bit of subnormals, far below the overflowing terms.
            dh = tf * 0.5 - rf * 0.5
            adh = dh.abs()
            s, k = _sum_abs(adh, float(adh.max()))
            self.sum_abs.add(s, k + 1)
            s, k = _sum_squares(dh)
            self.sum_sq.add(s, 2 * k + 2)
            ulps = torch.where(ad < math.inf, ad / spacing, 2.0 * (adh / spacing))
        self.max_ulp = max(self.max_ulp, float(ulps.max()))

    def _add_rule(
        self,
        tp: torch.Tensor,
        rp: torch.Tensor,
        finite: torch.Tensor | None,
        t: torch.Tensor,
        r: torch.Tensor,
        offset: int,
    ) -> None:
        """The tolerance rule on a chunk in the rule's dtype: mismatches, their greatest, min_atol."""
        close = _isclose(tp, rp, self.tol.rtol, self.tol.atol)
        err = (tp - rp).abs()  # isclose's "actual error" and assert_close's "abs_diff"
        n_fail = close.numel() - int(close.sum())
        if n_fail:
            self.n_mismatch += n_fail
            # As assert_close's message: the largest error over mismatched elements only, where a
            # NaN beats every number and the first element wins ties (torch.max on the CPU).
            value, index = torch.max(err.masked_fill(close, 0), 0)
            v, i = float(value), int(index)
            best = self.mismatch_max_abs
            if best is None or (not math.isnan(best) and (math.isnan(v) or v > best)):
                self.mismatch_max_abs = v
                self.mismatch_flat = offset + i
                self.mismatch_target = float(t[i])
                self.mismatch_reference = float(r[i])
        self.min_atol = self._least_passing_atol(tp, rp, err, finite)

    def _least_passing_atol(
        self, tp: torch.Tensor, rp: torch.Tensor, err: torch.Tensor, finite: torch.Tensor | None
    ) -> float:
        """The smallest float atol, at least ``self.min_atol``, passing every element finite in both.

        isclose rounds atol, ``atol + rtol·|r|`` and ``|t − r|`` to the rule's dtype, so an
        element's need is ``|t − r| − rtol·|r|`` only to within a few units of that dtype. The
        rule is monotonic in atol, so bisect on float64 bit patterns with the rule itself, over
        the elements whose approximate need is within that margin of the largest (the others
        cannot hold the maximum): exact in every dtype, and the same whatever the chunking.
        """
        current = self.min_atol
        need = err - (self.tol.rtol * rp).abs()  # isclose's allowed error but for atol
        if finite is not None:
            need = need.masked_fill(~finite, -math.inf)  # NaN/Inf pass or fail whatever the atol
        value, index = torch.max(need, 0)
        top = float(value)
        if not top < math.inf:  # inf or NaN: a difference overflowed the rule's dtype
            return math.inf
        if top <= 0.0:
            return current  # |t − r| <= rtol·|r| everywhere: atol 0 passes
        # Rounding atol, the sum and the subtraction: a few units of the error and of the need
        # (terms kept apart so that the margin cannot overflow and let masked elements in).
        info = torch.finfo(self.rule)
        margin = (
            2 * info.eps * float(err[int(index)]) + 4 * info.eps * top + 4 * info.eps * info.smallest_normal
        )
        if top + margin <= current:
            return current  # no element here needs more than the chunks before
        idx = torch.nonzero(need >= top - margin).squeeze(1)
        tc, rc = tp[idx], rp[idx]

        def passes(atol: float) -> bool:
            return bool(_isclose(tc, rc, self.tol.rtol, atol).all())

        if passes(current):
            return current
        hi = top + margin  # passes, by the margin; doubling only guards that argument
        while not passes(hi):  # ends: at atol = inf every finite difference passes
            hi *= 2.0
        lo = top - margin  # fails, by the margin; a tighter start than `current`
        if lo <= current:
            lo = current
        lo_bits, hi_bits = _bits(lo), _bits(hi)
        while hi_bits - lo_bits > 1:
            mid = (lo_bits + hi_bits) // 2
            if passes(_from_bits(mid)):
                hi_bits = mid
            else:
                lo_bits = mid
        return _from_bits(hi_bits)

    def _add_nonfinite(
        self, t: torch.Tensor, r: torch.Tensor, t_finite: torch.Tensor, r_finite: torch.Tensor
    ) -> None:
        t_nan, r_nan = t.isnan(), r.isnan()
        self.n_nan += int(t_nan.sum())
        self.ref_nan += int(r_nan.sum())
        self.n_inf += int((~t_finite).sum()) - int(t_nan.sum())
        self.ref_inf += int((~r_finite).sum()) - int(r_nan.sum())


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
        # A GPU tensor crosses to the host once, one tensor at a time, for the fused kernel.
        stats, _ = _kernel_measure(target.cpu(), reference.cpu(), tol, fields, sketch=False)
        if stats is not None:
            return stats

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

    acc = _Accumulator(target.dtype, rule_dtype(target.dtype, reference.dtype), tol)
    for start, stop in _chunks(numel, chunk_elems):
        acc.add(t_flat[start:stop].to("cpu"), r_flat[start:stop].to("cpu"), start)

    n = acc.n_finite
    # Sums over no finite element are zero, so the empty case reads as "no drift measured".
    mean_abs = _ldexp(acc.sum_abs.mant / n, acc.sum_abs.exp) if n else 0.0
    rmse = _sqrt_wide(acc.sum_sq.mant / n, acc.sum_sq.exp) if n else 0.0
    t_zero, r_zero = acc.t_nonzero_finite == 0, acc.r_nonzero_finite == 0
    if r_zero:
        rel_l2 = 0.0 if acc.max_abs == 0.0 else math.inf
    else:
        rel_l2 = _sqrt_wide(acc.sum_sq.mant / acc.sum_r2.mant, acc.sum_sq.exp - acc.sum_r2.exp)
    if t_zero and r_zero:
        cos_sim = 1.0
    elif t_zero or r_zero:
        cos_sim = math.nan
    else:
        # Σtr / sqrt(Σt²·Σr²) with the exponents apart; the product's exponent made even first.
        norms, exp = acc.sum_t2.mant * acc.sum_r2.mant, acc.sum_t2.exp + acc.sum_r2.exp
        if exp % 2:
            norms, exp = 2.0 * norms, exp - 1
        cos = _ldexp(acc.sum_tr.mant / math.sqrt(norms), acc.sum_tr.exp - exp // 2)
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
        worst_index=None if acc.worst_flat is None else _unravel(acc.worst_flat, shape),
        worst_target=acc.worst_target,
        worst_reference=acc.worst_reference,
        mismatch_max_abs=acc.mismatch_max_abs,
        mismatch_index=None if acc.mismatch_flat is None else _unravel(acc.mismatch_flat, shape),
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
    """Whether the fused CPU kernel (`core.numerics.kernel`) measures this pair: dtypes it reads, the same shape.

    Tensors on another device are measured on a host copy (one tensor at a time): the kernel at
    1.5–15 GB/s beats the chunked path even after the copy.
    """
    return (
        kernel.available()
        and target.dtype in kernel.SUPPORTED_DTYPES
        and reference.dtype in kernel.SUPPORTED_DTYPES
        and target.shape == reference.shape
    )


def _kernel_measure(
    target: torch.Tensor,
    reference: torch.Tensor,
    tol: Tolerance,
    fields: dict[str, Any],
    sketch: bool,
) -> tuple[DiffStats | None, Sketch | None]:
    """`compare` (and the sketch, when asked) in the fused kernel's one pass; (None, None) where it does not measure."""
    k = kernel.compare_cpu(target, reference, tol.rtol, tol.atol, sketch=sketch)
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
        top_index=[_unravel(i, shape) for i in flat],
        top_target=[float(t_flat[i]) for i in flat],
        top_reference=[float(r_flat[i]) for i in flat],
    )


def measure(
    target: torch.Tensor, reference: torch.Tensor, tolerance: Tolerance, chunk_elems: int = 1 << 22
) -> tuple[DiffStats, Sketch | None]:
    """`compare`, and the `Sketch` of the difference when the tensors differ (same shape).

    Both come from the fused kernel's one pass (a GPU tensor on a host copy); without the kernel
    the sketch is made row block by row block on the target's device. The sketch's failing counts
    follow `close_mask`.
    """
    target, reference = target.detach(), reference.detach()
    if _kernel_applies(target, reference):
        fields = _fields(target, reference, tolerance)
        stats, sketch = _kernel_measure(target.cpu(), reference.cpu(), tolerance, fields, True)
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
        worst_index=None if k.worst_index is None else _unravel(k.worst_index, shape),
        worst_target=k.worst_target,
        worst_reference=k.worst_reference,
        mismatch_max_abs=None if mismatch is None else k.mismatch_max_abs,
        mismatch_index=None if mismatch is None else _unravel(mismatch, shape),
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
        # Every differing integer mismatches, so assert_close's greatest is the first maximum.
        mismatch_max_abs=max_abs if worst is not None else None,
        mismatch_index=None if worst is None else _unravel(worst, tuple(target.shape)),
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
        parts.append(f"no atol passes at rtol {_g(s.rtol)}: a difference overflows {_dtype_name(rule)}")
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
    row = asdict(stats)
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
