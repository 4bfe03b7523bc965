"""The chunked torch path of `metrics.compare`: chunk helpers, float64 sums kept with an unbounded
exponent (no partial sum overflows or underflows), and the accumulator that measures one chunk after
another (the statistics and the isclose rule, exactly as the module doc of `metrics` defines them).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable

import torch

from core.numerics.tolerance import Tolerance, _float_format, _isclose, _spacing, rule_dtype

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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
