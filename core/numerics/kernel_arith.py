"""The numba building blocks of `core.numerics.kernel_jit`: format codes, bit casts, exact widening and
rounding, the isclose emulation per format, exact helpers (ldexp, least atol) and the per-block helpers
of the fused pass. Compiled loops only, imported only where numba is; the exactness rules are those of
`kernel_jit`'s module doc (no fast-math flags here: every helper rounds exactly).
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

JIT_OPTIONS = {"cache": True, "error_model": "numpy", "nogil": True}

KIND_F64, KIND_F32, KIND_BF16, KIND_F16 = 0, 1, 2, 3

INF = math.inf
INF32 = np.float32(math.inf)
HALF32 = np.float32(0.5)
H_MIN_NORMAL32 = np.float32(2.0**-14)
H_OVERFLOW32 = np.float32(65520.0)  # the least float32 that rounds to inf in float16
NAN_BITS = 0x7FF8000000000000  # canonical NaN: orders above inf as int64
SAFE_LO_BITS = (1023 - 450) << 52  # squares of magnitudes in [2^-450, 2^450] are normal floats
SAFE_HI_BITS = (1023 + 450) << 52
HIST_BINS = 8192  # the top 13 bits of a non-negative float64: exponent and 2 significand bits

# Columns of the per-block partial results.
I_SAME, I_MIS, I_FIN, I_TNZ, I_RNZ, I_TNAN, I_TINF, I_RNAN, I_RINF, I_NEW, I_TNZF, I_RNZF = range(12)
I_WORST, I_MISABS_IDX, I_MISREL_IDX = 12, 13, 14
N_I = 15
F_SA_E, F_SA, F_QD_E, F_QD, F_QT_E, F_QT, F_QR_E, F_QR, F_DOT_E, F_DOT = range(10)
F_MAXABS, F_MAXULP, F_MINATOL, F_MISABS, F_MISREL = 10, 11, 12, 13, 14
N_F = 15


# ---------------------------------------------------------------- bit casts


@intrinsic
def f64_bits(typingctx, x):
    """float64 -> its int64 bit pattern."""
    if x != types.float64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return types.int64(types.float64), codegen


@intrinsic
def bits_f64(typingctx, x):
    """int64 bit pattern -> float64."""
    if not (isinstance(x, types.Integer) and x.bitwidth == 64):
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(x), codegen


@intrinsic
def f32_bits(typingctx, x):
    """float32 -> its bit pattern, zero-extended to int64."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.zext(builder.bitcast(args[0], ir.IntType(32)), ir.IntType(64))

    return types.int64(types.float32), codegen


@intrinsic
def bits_f32(typingctx, x):
    """The low 32 bits of an int64 -> float32."""
    if not (isinstance(x, types.Integer) and x.bitwidth == 64):
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.trunc(args[0], ir.IntType(32)), ir.FloatType())

    return types.float32(x), codegen


# ---------------------------------------------------------------- formats


@njit(**JIT_OPTIONS)
def half_bits_to_f32_bits(h):
    """float16 bits -> float32 bits (int64), exact; a NaN keeps its payload and gets the quiet bit."""
    u = np.int64(h) & 0xFFFF
    sign = (u & 0x8000) << 16
    e = (u >> 10) & 0x1F
    m = u & 0x3FF
    out = ((e + 112) << 23) | (m << 13)
    if e == 0:
        out = f32_bits(np.float32(m) * np.float32(2.0**-24))  # exact: m < 2^10
    if e == 31:
        out = 0x7F800000 | (m << 13) | (np.int64(m != 0) << 22)
    return out | sign


@njit(**JIT_OPTIONS)
def round_bf16(x):
    """float32 -> the nearest bfloat16 (ties to even), as float32: c10's rounding."""
    u = f32_bits(x)
    y = bits_f32((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000)
    return x if x != x else y


@njit(**JIT_OPTIONS)
def round_f16(x):
    """float32 -> the nearest float16 (ties to even, gradual underflow), as float32."""
    a = abs(x)
    u = f32_bits(a)
    y = bits_f32((u + 0xFFF + ((u >> 13) & 1)) & 0xFFFFE000)
    if a < H_MIN_NORMAL32:
        y = (a + HALF32) - HALF32  # rounds to a multiple of 2^-24, ties to even
    if a >= H_OVERFLOW32:
        y = INF32
    y = bits_f32(f32_bits(y) | (f32_bits(x) & 0x80000000))
    return x if x != x else y


@njit(**JIT_OPTIONS)
def stage64(raw, kind, lo, hi, out):
    """Elements lo..hi-1 of a raw byte array holding `kind`, widened exactly into out[:hi-lo]."""
    n = hi - lo
    if kind == KIND_F64:
        s64 = raw[lo * 8 : hi * 8].view(np.float64)
        for i in range(n):
            out[i] = s64[i]
    elif kind == KIND_F32:
        s32 = raw[lo * 4 : hi * 4].view(np.float32)
        for i in range(n):
            out[i] = np.float64(s32[i])
    elif kind == KIND_BF16:
        sb = raw[lo * 2 : hi * 2].view(np.uint16)
        for i in range(n):
            out[i] = np.float64(bits_f32(np.int64(sb[i]) << 16))
    else:
        sh = raw[lo * 2 : hi * 2].view(np.int16)
        for i in range(n):
            out[i] = np.float64(bits_f32(half_bits_to_f32_bits(sh[i])))


@njit(**JIT_OPTIONS)
def stage32_bits(raw, kind, lo, hi, out):
    """Bits of elements lo..hi-1 widened to float32 (kind float32, bfloat16 or float16) into out (int64)."""
    n = hi - lo
    if kind == KIND_F32:
        s32 = raw[lo * 4 : hi * 4].view(np.float32)
        for i in range(n):
            out[i] = f32_bits(s32[i])
    elif kind == KIND_BF16:
        sb = raw[lo * 2 : hi * 2].view(np.uint16)
        for i in range(n):
            out[i] = np.int64(sb[i]) << 16
    else:
        sh = raw[lo * 2 : hi * 2].view(np.int16)
        for i in range(n):
            out[i] = half_bits_to_f32_bits(sh[i])


# ---------------------------------------------------------------- the tolerance rule


@njit(**JIT_OPTIONS)
def mis64(t, r, rtol, atol, tol_on):
    """not torch.isclose(t, r, rtol, atol, equal_nan=True) in float64."""
    eq = (t == r) | ((t != t) & (r != r))
    actual = abs(t - r)
    allowed = atol + abs(rtol * r)
    return not (eq | ((actual < INF) & (actual <= allowed) & tol_on))


@njit(**JIT_OPTIONS)
def mis32(a, b, rtol32, atol32, tol_on):
    """The same in float32 (rtol, atol as float32 scalars)."""
    eq = (a == b) | ((a != a) & (b != b))
    actual = abs(a - b)
    allowed = atol32 + abs(rtol32 * b)
    return not (eq | ((actual < INF32) & (actual <= allowed) & tol_on))


@njit(**JIT_OPTIONS)
def mis_bf16(a, b, rtol32, atolh, tol_on):
    """The same for bfloat16 tensors: float32 ops, each result rounded to bfloat16."""
    eq = (a == b) | ((a != a) & (b != b))
    actual = abs(round_bf16(a - b))
    allowed = round_bf16(atolh + abs(round_bf16(rtol32 * b)))
    return not (eq | ((actual < INF32) & (actual <= allowed) & tol_on))


@njit(**JIT_OPTIONS)
def mis_f16(a, b, rtol32, atolh, tol_on):
    """The same for float16 tensors."""
    eq = (a == b) | ((a != a) & (b != b))
    actual = abs(round_f16(a - b))
    allowed = round_f16(atolh + abs(round_f16(rtol32 * b)))
    return not (eq | ((actual < INF32) & (actual <= allowed) & tol_on))


@njit(**JIT_OPTIONS)
def mismatch_flags(mode, t, r, rtol, atol, rtol32, atol32, atolh, tol_on, flg):
    """flg[i] = 1 where the pair fails torch.isclose in the promoted dtype `mode` (a KIND_*), else 0."""
    n = t.size
    if mode == KIND_F64:
        for i in range(n):
            flg[i] = mis64(t[i], r[i], rtol, atol, tol_on)
    elif mode == KIND_F32:
        for i in range(n):
            flg[i] = mis32(np.float32(t[i]), np.float32(r[i]), rtol32, atol32, tol_on)
    elif mode == KIND_BF16:
        for i in range(n):
            flg[i] = mis_bf16(np.float32(t[i]), np.float32(r[i]), rtol32, atolh, tol_on)
    else:
        for i in range(n):
            flg[i] = mis_f16(np.float32(t[i]), np.float32(r[i]), rtol32, atolh, tol_on)


# ---------------------------------------------------------------- exact helpers


@njit(**JIT_OPTIONS)
def ldexp(x, m):
    """x * 2^m for any int m, in exact power-of-two steps (underflows to 0, overflows to inf)."""
    while m > 900:
        x *= 2.0**900
        m -= 900
        if x == 0.0 or abs(x) == INF:
            return x
    while m < -900:
        x *= 2.0**-900
        m += 900
        if x == 0.0 or abs(x) == INF:
            return x
    return x * bits_f64(np.int64(m + 1023) << 52)


@njit(**JIT_OPTIONS)
def least_atol(ad, rel):
    """The least float64 atol >= 0 with ``ad <= fl(atol + rel)`` (ad finite > 0, rel finite >= 0).

    fl(.) reaches ad from T on, the midpoint below ad (ties to even), so the answer is the
    least float at or above T - rel. That is formed accurately with TwoSum, the exact
    predicate settles the last ulps, and a bisection on the bit patterns backs it up.
    """
    if ad <= rel:
        return 0.0
    bad = f64_bits(ad)
    if bad < (np.int64(2) << 52):
        c = ad - rel  # below 2^-1021 every sum and difference here is exact
    else:
        pred = bits_f64(bad - 1)
        h = (ad - pred) * 0.5
        s = pred - rel
        bb = s - pred
        e = (pred - (s - bb)) + (-rel - bb)  # TwoSum: pred - rel == s + e exactly
        c = max((s + h) + e, 0.0)
    cb = f64_bits(c)
    if ad <= c + rel:
        for _ in range(8):
            if cb == 0:
                return 0.0
            if ad <= bits_f64(cb - 1) + rel:
                cb -= 1
            else:
                return bits_f64(cb)
    else:
        for _ in range(8):
            cb += 1
            if ad <= bits_f64(cb) + rel:
                return bits_f64(cb)
    lo = np.int64(0)  # atol 0 fails: ad > rel
    hi = bad  # atol ad passes: fl(ad + rel) >= ad
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        if ad <= bits_f64(mid) + rel:
            hi = mid
        else:
            lo = mid
    return bits_f64(hi)


# ---------------------------------------------------------------- the fused pass's per-block helpers


@njit(**JIT_OPTIONS)
def nonfinite_counts(t, r):
    """Counts that are trivial when every element is finite: NaN/Inf on each side, new non-finites."""
    t_nan = t_inf = r_nan = r_inf = new = t_nzf = r_nzf = 0
    for i in range(t.size):
        tt = t[i]
        rr = r[i]
        tn = tt != tt
        rn = rr != rr
        ti = abs(tt) == INF
        ri = abs(rr) == INF
        fin = (abs(tt) < INF) & (abs(rr) < INF)
        same = (tt == rr) | (tn & rn)
        t_nan += tn
        r_nan += rn
        t_inf += ti
        r_inf += ri
        new += (tn | ti) & (not same)
        t_nzf += fin & (tt != 0.0)
        r_nzf += fin & (rr != 0.0)
    return t_nan, t_inf, r_nan, r_inf, new, t_nzf, r_nzf


@njit(**JIT_OPTIONS)
def _frexp_exp(x):
    return math.frexp(x)[1]


@njit(**JIT_OPTIONS)
def scaled_terms(t, r, m_d, m_t, m_r, terms):
    """The terms of `_pass1`'s sums with power-of-two scales, for blocks whose squares would overflow
    or lose precision to underflow: |d|·2^-E_d, (|d|·2^-E_d)², (t·2^-E_t)², (r·2^-E_r)² and their
    product, -0.0 (the identity of `fold`) where an element is not finite in both. Returns
    (E_d, E_t, E_r): sum|d| = 2^E_d Σ, ||d||^2 = 4^E_d Σ, ..., t.r = 2^(E_t + E_r) Σ. A d that
    overflowed float64 stays inf.
    """
    md = bits_f64(m_d)
    mt = bits_f64(m_t)
    mr = bits_f64(m_r)
    e_d = _frexp_exp(md) if (md > 0.0) & (md < INF) else 0
    e_t = _frexp_exp(mt) if mt > 0.0 else 0
    e_r = _frexp_exp(mr) if mr > 0.0 else 0
    for i in range(t.size):
        tt = t[i]
        rr = r[i]
        if not ((abs(tt) < INF) & (abs(rr) < INF)):
            for c in range(5):
                terms[c, i] = -0.0
            continue
        ds = ldexp(abs(tt - rr), -e_d)
        ts = ldexp(tt, -e_t)
        rs = ldexp(rr, -e_r)
        terms[0, i] = ds
        terms[1, i] = ds * ds
        terms[2, i] = ts * ts
        terms[3, i] = rs * rs
        terms[4, i] = ts * rs
    return e_d, e_t, e_r


@njit(**JIT_OPTIONS)
def _terms_of(tt, rr):
    """|d|, d², t², r², t·r of one element, zero where it is not finite in both (as `_pass1` reads it)."""
    fin = (abs(tt) < INF) & (abs(rr) < INF)
    tf = tt if fin else 0.0
    rf = rr if fin else 0.0
    d = tf - rf
    return abs(d), d * d, tf * tf, rf * rf, tf * rf


@njit(**JIT_OPTIONS)
def first_fold(t, r, n, terms):
    """`fold`'s first level over the terms of the block's sums, computed from t and r (no per-element
    store): terms[c, i] = term(i) + term(i + w/2), or term(i) where i + w/2 is past n (adding the
    padding's -0.0 changes nothing). Returns the width left, a power of two, for `fold`."""
    h = fold_width(n) >> 1
    if h == 0:
        terms[0, 0], terms[1, 0], terms[2, 0], terms[3, 0], terms[4, 0] = _terms_of(t[0], r[0])
        return 1
    for i in range(n - h):
        a0, a1, a2, a3, a4 = _terms_of(t[i], r[i])
        b0, b1, b2, b3, b4 = _terms_of(t[i + h], r[i + h])
        terms[0, i] = a0 + b0
        terms[1, i] = a1 + b1
        terms[2, i] = a2 + b2
        terms[3, i] = a3 + b3
        terms[4, i] = a4 + b4
    for i in range(n - h, h):
        terms[0, i], terms[1, i], terms[2, i], terms[3, i], terms[4, i] = _terms_of(t[i], r[i])
    return h


@njit(**JIT_OPTIONS)
def fold_width(n):
    """The least power of two >= n (1 for n <= 1): the width `fold` pairs elements over."""
    w = 1
    while w < n:
        w <<= 1
    return w


@njit(**JIT_OPTIONS)
def fold(a, n):
    """Σ a[:n] as a pairwise tree that torch reproduces with whole-tensor adds: padded with -0.0 (which
    adds nothing, so the width does not matter) to a power of two w, then a[i] += a[i + w/2] for every
    i < w/2, halving w until one element is left. `a` is scratch of at least `fold_width(n)` elements.
    """
    w = fold_width(n)
    for i in range(n, w):
        a[i] = -0.0
    h = w >> 1
    while h >= 1:
        for i in range(h):
            a[i] = a[i] + a[i + h]
        h >>= 1
    return a[0] if n > 0 else 0.0


@njit(**JIT_OPTIONS)
def _canon(x):
    """Bits of a non-negative float or NaN; every NaN as the canonical one (above inf)."""
    return f64_bits(x) if x == x else np.int64(NAN_BITS)


@njit(**JIT_OPTIONS)
def _diffs64(t, r):
    ad = abs(t - r)
    return ad, ad / abs(r)


@njit(**JIT_OPTIONS)
def _diffs32(t, r):
    a = np.float32(t)
    b = np.float32(r)
    ad = abs(a - b)
    return np.float64(ad), np.float64(ad / abs(b))


@njit(**JIT_OPTIONS)
def _diffs_bf16(t, r):
    a = np.float32(t)
    b = np.float32(r)
    ad = abs(round_bf16(a - b))
    return np.float64(ad), np.float64(round_bf16(ad / abs(b)))


@njit(**JIT_OPTIONS)
def _diffs_f16(t, r):
    a = np.float32(t)
    b = np.float32(r)
    ad = abs(round_f16(a - b))
    return np.float64(ad), np.float64(round_f16(ad / abs(b)))


@njit(**JIT_OPTIONS)
def mismatch_bits(mode, t, r, flg, oa, orel):
    """assert_close's abs_diff and rel_diff in the promoted dtype `mode`, zeroed where the element
    matches, as canonical bits (NaN above inf), into oa and orel. One loop per dtype, so each
    vectorises.
    """
    n = t.size
    if mode == KIND_F64:
        for i in range(n):
            av, rv = _diffs64(t[i], r[i])
            m = (flg[i] & 1) != 0
            oa[i] = _canon(av) if m else np.int64(0)
            orel[i] = _canon(rv) if m else np.int64(0)
    elif mode == KIND_F32:
        for i in range(n):
            av, rv = _diffs32(t[i], r[i])
            m = (flg[i] & 1) != 0
            oa[i] = _canon(av) if m else np.int64(0)
            orel[i] = _canon(rv) if m else np.int64(0)
    elif mode == KIND_BF16:
        for i in range(n):
            av, rv = _diffs_bf16(t[i], r[i])
            m = (flg[i] & 1) != 0
            oa[i] = _canon(av) if m else np.int64(0)
            orel[i] = _canon(rv) if m else np.int64(0)
    else:
        for i in range(n):
            av, rv = _diffs_f16(t[i], r[i])
            m = (flg[i] & 1) != 0
            oa[i] = _canon(av) if m else np.int64(0)
            orel[i] = _canon(rv) if m else np.int64(0)


@njit(**JIT_OPTIONS)
def first_max(x):
    """(max, first index of it) of an int64 array: torch.max's rule on canonical bits."""
    m = np.int64(0)
    for i in range(x.size):
        m = max(m, x[i])
    for i in range(x.size):
        if x[i] == m:
            return m, i
    return m, -1


@njit(**JIT_OPTIONS)
def passes_narrow(mode, a, b, rtol, rtol32, x):
    """torch.isclose(a, b, rtol, atol=x, equal_nan=True) for a finite pair in the promoted float32,
    bfloat16 or float16 `mode`, with the float64 atol x converted as torch's CPU kernels do (via
    float32, then the dtype: `kernel._scalar_in`)."""
    x32 = np.float32(x)
    tol_on = (rtol != 0.0) | (x != 0.0)
    if mode == KIND_F32:
        return not mis32(a, b, rtol32, x32, tol_on)
    if mode == KIND_BF16:
        return not mis_bf16(a, b, rtol32, round_bf16(x32), tol_on)
    return not mis_f16(a, b, rtol32, round_f16(x32), tol_on)


@njit(**JIT_OPTIONS)
def least_atol_narrow(mode, a, b, rtol, rtol32, lo):
    """The least float64 atol >= lo passing the finite pair (a, b) in `mode`; inf where none does.

    The rule is monotonic in atol, so bisect on float64 bit patterns with the rule itself: exact
    whatever the rounding of atol, of the bound and of the difference in the narrow dtype.
    """
    if passes_narrow(mode, a, b, rtol, rtol32, lo):
        return lo
    if not passes_narrow(mode, a, b, rtol, rtol32, INF):
        return INF  # the difference overflows the dtype: no atol passes it
    lo_b = f64_bits(lo)
    hi_b = f64_bits(INF)
    while hi_b - lo_b > 1:
        mid = lo_b + (hi_b - lo_b) // 2
        if passes_narrow(mode, a, b, rtol, rtol32, bits_f64(mid)):
            hi_b = mid
        else:
            lo_b = mid
    return bits_f64(hi_b)


# Per narrow mode (F32, BF16, F16): the dtype's eps, its least subnormal, and a magnitude below
# which a difference cannot overflow it.
_NARROW_EPS = (2.0**-23, 2.0**-7, 2.0**-10)
_NARROW_TINY = (2.0**-149, 2.0**-133, 2.0**-24)
_NARROW_OVF = (3.0e38, 3.0e38, 6.0e4)


@njit(**JIT_OPTIONS)
def least_atol_block_narrow(mode, t, r, key, nvb, flg, max_abs, top, rtol, rtol32):
    """The block's exact least passing atol under a float32/bfloat16/float16 rule.

    The float64 naive need |d| - |rtol r| is within a few units of the narrow dtype of the rule's
    own need (the rule rounds the difference, rtol·|r|, atol and their sum), so only elements whose
    naive need is within that margin of the block's greatest can hold the answer, plus any whose
    difference could overflow the dtype. Each is tested at the best atol so far (one evaluation)
    and bisected only where it needs more.
    """
    m = mode - 1
    eps = _NARROW_EPS[m]
    thr = top - 16.0 * eps * max_abs - 16.0 * _NARROW_TINY[m]
    ovf = _NARROW_OVF[m]
    best = 0.0
    for j in range(t.size):
        if (flg[j] & 2) == 0:
            continue  # NaN/Inf pass or fail whatever the atol
        if (bits_f64(nvb[j]) < thr) & (bits_f64(key[j]) < ovf):
            continue
        a = np.float32(t[j])
        b = np.float32(r[j])
        if a == b:
            continue
        if not passes_narrow(mode, a, b, rtol, rtol32, best):
            best = least_atol_narrow(mode, a, b, rtol, rtol32, best)
            if best == INF:
                break
    return best
