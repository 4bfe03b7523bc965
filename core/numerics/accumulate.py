"""The torch paths of `metrics.compare`: the fused kernel's pass in torch on any device (`compare_torch`,
bit for bit the kernel's), and for what the kernel does not read (float8, a float64 difference that
overflows) the chunked accumulator: chunk helpers, float64 sums kept with an unbounded exponent (no
partial sum overflows or underflows), the statistics and the isclose rule chunk after chunk.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable

import torch

from core.numerics import kernel
from core.numerics.sketch import TOP_K
from core.numerics.tolerance import (
    Tolerance,
    float_format,
    format_spacing,
    narrow_tolerance_scalars,
    round_to,
    rule_dtype,
    rule_fails,
    rule_isclose,
)

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def chunk_bounds(n: int, size: int) -> Iterable[tuple[int, int]]:
    """(start, stop) of consecutive chunks of `size` elements covering `n` (the last one shorter)."""
    for start in range(0, n, size):
        yield start, min(start + size, n)


def bitwise_equal_chunks(t_flat: torch.Tensor, r_flat: torch.Tensor, chunk: int) -> bool:
    """Identical bit patterns after casting both to the wider dtype (widening casts are exact)."""
    wide = t_flat.dtype if t_flat.dtype == r_flat.dtype else rule_dtype(t_flat.dtype, r_flat.dtype)
    as_int = _INT_OF_SIZE[wide.itemsize]
    for start, stop in chunk_bounds(t_flat.numel(), chunk):
        a = t_flat[start:stop].to("cpu").to(wide).view(as_int)
        b = r_flat[start:stop].to("cpu").to(wide).view(as_int)
        if not torch.equal(a, b):
            return False
    return True


def nan_inf_nonzero_counts(flat: torch.Tensor, chunk: int) -> tuple[int, int, int]:
    """(NaN count, Inf count, non-zero count) of a flat tensor, chunk by chunk."""
    n_nan = n_inf = n_nonzero = 0
    for start, stop in chunk_bounds(flat.numel(), chunk):
        c = flat[start:stop].to("cpu")
        n_nan += int(c.isnan().sum())
        n_inf += int(c.isinf().sum())
        n_nonzero += int((c != 0).sum())
    return n_nan, n_inf, n_nonzero


def unravel_index(flat_index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The index in `shape` of a row-major flat index."""
    index = []
    for size in reversed(shape):
        flat_index, rest = divmod(flat_index, size)
        index.append(rest)
    return tuple(reversed(index))


def ldexp_or_inf(m: float, e: int) -> float:
    """``m · 2**e`` rounded once, ±inf where it overflows (where math.ldexp raises)."""
    try:
        return math.ldexp(m, e)
    except OverflowError:
        return math.copysign(math.inf, m)


def sqrt_wide(m: float, e: int) -> float:
    """``sqrt(m · 2**e)`` for ``m >= 0`` and any integer exponent."""
    if e % 2:
        m, e = 2.0 * m, e - 1
    return ldexp_or_inf(math.sqrt(m), e // 2)


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


class ChunkAccumulator:
    """Running sums, counts and maxima over the chunks of one comparison (internal, mutable)."""

    def __init__(self, target_dtype: torch.dtype, rule: torch.dtype, tol: Tolerance) -> None:
        self.p, self.e_min = float_format(target_dtype)
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

        spacing = format_spacing(rf.abs(), self.p, self.e_min)
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
        close = rule_isclose(tp, rp, self.tol.rtol, self.tol.atol)
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
            return bool(rule_isclose(tc, rc, self.tol.rtol, atol).all())

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


# ---------------------------------------------------------------- the kernel's pass in torch, on any device
#
# `compare_torch` computes what `kernel.compare_cpu` computes, bit for bit, with whole-tensor torch
# ops on the tensors' device (a GPU's tensors never cross to the host): the same per-element values
# (the kernel's exact float64 and narrow-dtype arithmetic, each rounding spelled out), the same
# blocks of `kernel.DEFAULT_BLOCK` elements summed by the same pairwise tree (`kernel_arith.fold`),
# the blocks combined by the same tree (`kernel_jit.combine`), and the same exact min_atol.

_NAN_BITS = 0x7FF8000000000000  # canonical NaN, above inf as int64 (as `kernel_arith.NAN_BITS`)
_SAFE_LO, _SAFE_HI = 2.0**-450, 2.0**450  # squares of magnitudes in between are normal floats
_HIST_BINS = 8192
_NARROW = {torch.float32: (2.0**-23, 2.0**-149, 3.0e38), torch.bfloat16: (2.0**-7, 2.0**-133, 3.0e38),
           torch.float16: (2.0**-10, 2.0**-24, 6.0e4)}  # fmt: skip  # eps, least subnormal, no overflow below


def _f64_bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int64)


def _bits_f64(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float64)


def _ldexp_exact(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``x · 2**m`` (int64 m, broadcast) in the kernel's exact power-of-two steps (`kernel_arith.ldexp`)."""
    m = m.expand_as(x) if m.dim() else m.expand(x.shape)
    while True:
        hi, lo = m > 900, m < -900
        if not bool((hi | lo).any()):
            break
        x = torch.where(hi, x * 2.0**900, torch.where(lo, x * 2.0**-900, x))
        m = torch.where(hi, m - 900, torch.where(lo, m + 900, m))
    return x * _bits_f64((m + 1023) << 52)


def _canon(v: torch.Tensor) -> torch.Tensor:
    v = v.to(torch.float64)
    return torch.where(v == v, _f64_bits(v), _NAN_BITS)


def _mismatch_bits(mode, a, b, mis):
    """assert_close's abs and rel differences in `mode` as canonical bits, 0 where the element matches."""
    if mode == torch.float64:
        ad = (a - b).abs()
        rel = ad / b.abs()
    else:
        ad = round_to(a - b, mode).abs()
        rel = round_to(ad / b.abs(), mode)
    return torch.where(mis, _canon(ad), 0), torch.where(mis, _canon(rel), 0)


def _first_max(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, first index of it) of an int64 tensor, as 0-dim tensors (no host sync)."""
    idx = bits.argmax()  # the first maximal index, on every device
    return bits[idx], idx


def _least_atol(mode, a, b, need, margin, rtol, atol_of, rtol_nonzero: bool, best: float) -> float:
    """max(best, the least float64 atol passing every pair (a, b)); inf where none passes one.

    The rule is monotonic in atol, so each pair is bisected on float64 bit patterns with the rule
    itself (`kernel_arith.least_atol_narrow`; for float64 pairs `least_atol`'s predicate), from
    its naive `need` ± `margin` where those bracket it, the pairs of greatest need first: most
    others then pass at the atol found, unbisected.
    """

    def passes(x: float | torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            x = torch.full(a.shape, x, dtype=torch.float64, device=a.device)
        return ~rule_fails(mode, a, b, rtol, atol_of(x), (x != 0) | rtol_nonzero)

    order = torch.argsort(need, descending=True)
    a, b, need, margin = a[order], b[order], need[order], margin[order]
    while True:
        more = ~passes(best, a, b)
        if not bool(more.any()):
            return best
        a, b, need, margin = a[more], b[more], need[more], margin[more]
        ba, bb = a[:32], b[:32]
        if not bool(passes(math.inf, ba, bb).all()):
            return math.inf  # a difference overflows the dtype: no atol passes it
        # lo fails, hi passes: from best and inf, or nearer where the naive need's bracket holds
        x_lo = (need[:32] - margin[:32]).clamp(min=best)
        x_hi = (need[:32] + margin[:32]).clamp(min=best)
        lo = torch.where(passes(x_lo, ba, bb), _bits(best), _f64_bits(x_lo))
        hi = torch.where(passes(x_hi, ba, bb), _f64_bits(x_hi), _bits(math.inf))
        while bool((hi - lo > 1).any()):
            mid = lo + (hi - lo) // 2
            ok = passes(_bits_f64(mid), ba, bb)
            hi, lo = torch.where(ok, mid, hi), torch.where(ok, lo, mid)
        best = max(best, float(_bits_f64(hi).max()))
        a, b, need, margin = a[32:], b[32:], need[32:], margin[32:]


def _pair_add(e1, s1, e2, s2, square: bool):
    """`kernel_jit._lin_add` (or `_sq_add`) element-wise: 2^e1 s1 + 2^e2 s2 (4^e for squares)."""
    e = torch.maximum(e1, e2)
    k = 2 if square else 1
    s = _ldexp_exact(s1, k * (e1 - e)) + _ldexp_exact(s2, k * (e2 - e))
    step = 300 if square else 600
    big = (s.abs() > 2.0**600) & (s.abs() < math.inf)
    small = (s != 0) & (s.abs() < 2.0**-600)
    s = torch.where(big, s * 2.0**-600, torch.where(small, s * 2.0**600, s))
    e = torch.where(big, e + step, torch.where(small, e - step, e))
    right0, left0 = s2 == 0, s1 == 0
    e = torch.where(right0, e1, torch.where(left0, e2, e))
    s = torch.where(right0, s1, torch.where(left0, s2, s))
    return e, s


def _fold_torch(x: torch.Tensor) -> torch.Tensor:
    """`kernel_arith.fold` over the last dim (a power of two wide, padded with -0.0)."""
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def _combine_sums(exps: torch.Tensor, sums: torch.Tensor) -> list[tuple[int, float]]:
    """The blocks' (exponent, sum) pairs (5 rows) added as `kernel_jit.combine` adds them: a pairwise tree."""
    n = sums.shape[1]
    w = 1 << max(0, (n - 1).bit_length())
    exps = torch.nn.functional.pad(exps, (0, w - n))
    sums = torch.nn.functional.pad(sums, (0, w - n))
    square = torch.tensor([False, True, True, True, False], device=sums.device)[:, None]
    while exps.shape[1] > 1:
        h = exps.shape[1] // 2
        el, sl, er, sr = exps[:, :h], sums[:, :h], exps[:, h:], sums[:, h:]
        e_lin, s_lin = _pair_add(el, sl, er, sr, square=False)
        e_sq, s_sq = _pair_add(el, sl, er, sr, square=True)
        exps, sums = torch.where(square, e_sq, e_lin), torch.where(square, s_sq, s_lin)
    return [(int(e), float(s)) for e, s in zip(exps[:, 0].tolist(), sums[:, 0].tolist(), strict=True)]


def compare_torch(
    target: torch.Tensor,
    reference: torch.Tensor,
    rtol: float,
    atol: float,
    *,
    sketch: bool = False,
    chunk_elems: int = 1 << 22,
):
    """`kernel.compare_cpu(target, reference, rtol, atol, sketch=sketch)`, bit for bit, in torch on
    target's device (the reference is moved there whole). Whole blocks of `kernel.DEFAULT_BLOCK` are
    read at a time, at least `chunk_elems` elements; only scalars and the sketch's small arrays
    reach the host. For the dtypes of `kernel.SUPPORTED_DTYPES`, tensors of one shape.
    """
    device = target.device
    t_flat = target.detach().reshape(-1)
    r_flat = reference.detach().to(device).reshape(-1)
    numel = t_flat.numel()
    fold = kernel.default_fold(tuple(target.shape))
    block = kernel.DEFAULT_BLOCK
    chunk = max(1, -(-chunk_elems // block)) * block
    eq, n_nan, n_inf = kernel.bitwise_census_torch(t_flat, r_flat, chunk)
    if eq:
        return kernel.identical_stats(numel, n_nan, n_inf, sketch, fold)

    mode = torch.promote_types(target.dtype, reference.dtype)
    p, e_min = kernel.FLOAT_FORMATS[target.dtype]
    ulp_floor = 2.0 ** (e_min - 1)
    tol_on = not (rtol == 0 and atol == 0)
    if mode == torch.float64:
        rule_rtol, rule_atol = rtol, atol

        def atol_of(x: torch.Tensor) -> torch.Tensor:
            return x
    else:
        rule_rtol, rule_atol = narrow_tolerance_scalars(mode, rtol, atol, device)

        def atol_of(x: torch.Tensor) -> torch.Tensor:
            return round_to(x.to(torch.float32), mode)  # via float32, then the dtype (`_scalar_in`)

    rb, cb, gr, gc = kernel.pooled_grid(*fold)
    i64 = dict(dtype=torch.int64, device=device)
    counts = torch.zeros(12, **i64)  # n_same n_mis n_fin t_nz r_nz t_nan t_inf r_nan r_inf new t_nzf r_nzf
    max_ulp = torch.zeros((), dtype=torch.float64, device=device)
    worst_val, worst_idx = torch.zeros((), **i64), torch.full((), -1, **i64)
    mis_best = [(torch.full((), -1, **i64), torch.full((), -1, **i64)) for _ in range(2)]
    min_atol, any_inf = 0.0, False
    block_exps, block_sums = [], []
    if sketch:
        hist = torch.zeros(_HIST_BINS, **i64)
        pmap, pcnt = torch.zeros(gr * gc, **i64), torch.zeros(gr * gc, **i64)
        top_key, top_idx = torch.empty(0, **i64), torch.empty(0, **i64)
    for lo, hi in chunk_bounds(numel, chunk):
        tc, rc = t_flat[lo:hi], r_flat[lo:hi]
        t, r = tc.to(torch.float64), rc.to(torch.float64)
        if mode == torch.float64:
            a, b = t, r
        else:
            a, b = tc.to(torch.float32), rc.to(torch.float32)
        mis = rule_fails(mode, a, b, rule_rtol, rule_atol, tol_on)
        t_fin, r_fin = t.isfinite(), r.isfinite()
        fin = t_fin & r_fin
        all_finite = bool(fin.all())
        if all_finite:  # the common case: no masking, and the non-finite counts are zero
            same, tf, rf = t == r, t, r
        else:
            same = (t == r) | (t.isnan() & r.isnan())
            tf, rf = torch.where(fin, t, 0.0), torch.where(fin, r, 0.0)
        d = tf - rf
        ad, ar = d.abs(), rf.abs()
        nv = ad - (rf * rtol).abs()
        k = (_f64_bits(ar.clamp(min=ulp_floor)) >> 52) + (1 - p)
        spacing = _bits_f64(
            torch.where(k >= 1, k << 52, torch.bitwise_left_shift(torch.ones_like(k), (k + 51).clamp(0, 62)))
        )
        u = ad / spacing
        t_nz, r_nz = (t != 0).sum(), (r != 0).sum()
        if all_finite:
            zero = torch.zeros((), **i64)
            counts += torch.stack([same.sum(), mis.sum(), fin.sum(), t_nz, r_nz] + [zero] * 5 + [t_nz, r_nz])
        else:
            t_nan, r_nan = t.isnan(), r.isnan()
            counts += torch.stack([
                same.sum(), mis.sum(), fin.sum(), t_nz, r_nz, t_nan.sum(), (~t_fin).sum() - t_nan.sum(),
                r_nan.sum(), (~r_fin).sum() - r_nan.sum(), (~t_fin & ~same).sum(), (fin & (t != 0)).sum(),
                (fin & (r != 0)).sum(),
            ])  # fmt: skip
        max_ulp = torch.maximum(max_ulp, u.max())
        # the first index of the greatest |d| (over elements finite in both), the earlier chunk on ties
        m, i = _first_max(_f64_bits(ad))
        upd = m > worst_val
        worst_idx, worst_val = torch.where(upd, lo + i, worst_idx), torch.maximum(worst_val, m)

        # the sums: per-element terms, -0.0 past the end, each block folded pairwise
        nb = -(-(hi - lo) // block)
        pad = nb * block - (hi - lo)

        def blocks(x: torch.Tensor, pad: int = pad, nb: int = nb) -> torch.Tensor:
            return (torch.nn.functional.pad(x, (0, pad), value=-0.0) if pad else x).reshape(nb, block)

        terms = [blocks(x) for x in (ad, d * d, tf * tf, rf * rf, tf * rf)]
        exps = torch.zeros(5, nb, **i64)
        m_d, m_t, m_r = (blocks(x).amax(1) for x in (ad, tf.abs(), ar))
        unsafe = torch.zeros(nb, dtype=torch.bool, device=device)
        for mx in (m_d, m_t, m_r):
            unsafe |= (mx > 0) & ((mx < _SAFE_LO) | (mx > _SAFE_HI))
        if bool(unsafe.any()):
            e_d, e_t, e_r = (
                torch.where((mx > 0) & (mx < math.inf), torch.frexp(mx)[1].to(torch.int64), 0)
                for mx in (m_d, m_t, m_r)
            )
            fb = blocks(fin.to(torch.float64)) > 0
            ds = _ldexp_exact(blocks(ad), -e_d[:, None])
            ts = _ldexp_exact(blocks(tf), -e_t[:, None])
            rs = _ldexp_exact(blocks(rf), -e_r[:, None])
            scaled = (ds, ds * ds, ts * ts, rs * rs, ts * rs)
            terms = [
                torch.where(unsafe[:, None], x.masked_fill(~fb, -0.0), y)
                for x, y in zip(scaled, terms, strict=True)
            ]
            exps = torch.where(unsafe, torch.stack([e_d, e_d, e_t, e_r, e_t + e_r]), exps)
        block_sums.append(torch.stack([_fold_torch(x) for x in terms]))
        block_exps.append(exps)

        if bool(same.all()):
            continue
        if bool(mis.any()):  # assert_close's greatest mismatched differences: NaN first, then the first
            oa, orel = _mismatch_bits(mode, a, b, mis)
            for j, bits in enumerate((oa, orel)):
                m, i = _first_max(torch.where(mis, bits, -1))
                bv, bi = mis_best[j]
                mis_best[j] = (torch.maximum(bv, m), torch.where(m > bv, lo + i, bi))
        # min_atol, exact: only pairs whose naive need is within rounding of the greatest can hold it
        max_abs = float(ad.max())
        if max_abs == math.inf:
            any_inf = True
        elif not any_inf:
            top = max(0.0, float(torch.where(fin, nv, -math.inf).max()))
            # (the kernel's margins, per block there: a chunk's greatest need only narrows the choice)
            if mode == torch.float64:
                eps, tiny = 2.0**-52, 2.0**-1074
                cand = fin & (nv > 0) & (nv >= top - 16.0 * (eps * max_abs + tiny))
            else:
                eps, tiny, ovf = _NARROW[mode]
                cand = fin & (a != b) & ((nv >= top - 16.0 * (eps * max_abs + tiny)) | (ad >= ovf))
            if bool(cand.any()):
                margin = 16.0 * (eps * ad[cand] + tiny)
                min_atol = _least_atol(
                    mode, a[cand], b[cand], nv[cand], margin, rule_rtol, atol_of, rtol != 0, min_atol
                )
                any_inf = min_atol == math.inf
        if sketch:
            key = _f64_bits(ad)
            if not all_finite:
                mv = (t - r).abs()
                key = torch.where(
                    fin, key, torch.where(same, 0, torch.where(mv == mv, _f64_bits(mv), _NAN_BITS))
                )
            hist += torch.bincount(key[key > 0] >> 50, minlength=_HIST_BINS)
            idx = torch.arange(lo, hi, device=device)
            row = idx // fold[1]
            cell = (row // rb) * gc + (idx - row * fold[1]) // cb
            pmap.scatter_reduce_(0, cell, key, "amax")
            pcnt.index_add_(0, cell, mis.to(torch.int64))
            # the TOP_K greatest keys, ties by index: those at or above the TOP_K-th, in index order
            kth = torch.topk(key, min(TOP_K, key.numel())).values[-1].clamp(min=1)
            order = torch.nonzero(key >= kth).reshape(-1)
            top_key, top_idx = torch.cat([top_key, key[order]]), torch.cat([top_idx, order + lo])
            order = torch.sort(top_key, descending=True, stable=True)[1][:TOP_K]
            top_key, top_idx = top_key[order], top_idx[order]

    c = counts.tolist()
    sums = _combine_sums(torch.cat(block_exps, 1), torch.cat(block_sums, 1))
    parts = dict(zip(("n_same", "n_mis", "n_fin", "t_nz", "r_nz", "t_nan", "t_inf", "r_nan", "r_inf", "new",
                      "t_nzf", "r_nzf"), c, strict=True))  # fmt: skip
    parts.update(zip(("sum_abs", "sum_d2", "sum_t2", "sum_r2", "dot"), sums, strict=True))
    wv = int(worst_val)
    parts.update(
        worst=int(worst_idx) if wv > 0 else -1,
        max_abs=_from_bits(wv),
        max_ulp=float(max_ulp),
        min_atol=math.inf if any_inf else min_atol,
    )
    for j, name in enumerate(("abs", "rel")):
        bv, bi = (int(x) for x in mis_best[j])
        parts[f"mis_{name}_idx"] = bi
        parts[f"mis_{name}"] = _from_bits(bv) if bi >= 0 else 0.0
    sk = None
    if sketch:
        k = TOP_K
        tk_key = torch.full((1, k), -1, dtype=torch.int64)
        tk_idx = torch.full((1, k), -1, dtype=torch.int64)
        tk_key[0, : top_key.numel()], tk_idx[0, : top_idx.numel()] = top_key.cpu(), top_idx.cpu()
        sk = (hist.cpu().numpy()[None], pmap.cpu().numpy()[None], pcnt.cpu().numpy()[None], tk_key.numpy(),
              tk_idx.numpy())  # fmt: skip
    return kernel.assemble(target, r_flat.reshape(target.shape), parts, sk, fold, (rb, cb, gr, gc))
