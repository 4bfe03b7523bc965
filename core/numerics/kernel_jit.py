"""The numba half of `core.numerics.kernel`: compiled loops only, imported only where numba is.

One compiled kernel serves every dtype pair, so it compiles once (not once per pair): the
tensors arrive as raw byte views with a format code each (KIND_*), and each block is first
widened (exactly) into a small thread-local float64 staging buffer; the format, the isclose
dtype and the ULP format are runtime values chosen once per block, never per element.

Exactness rules (the contract is in `core.numerics.kernel`):
- No fast-math flags anywhere: every float operation rounds as IEEE says. Sums are not left to
  LLVM's reassociation (an order that depends on the CPU's vector width): `_pass1` stores each
  element's terms and `fold` adds them as a fixed pairwise tree, which vectorises without
  reordering and which `core.numerics.accumulate.compare_torch` reproduces on any device.
- Maxima of non-negative floats are taken on their int64 bit patterns (ordered like the
  values), which vectorises without NaN flags and makes ties exact.
- Loops index slices from 0: a signed ``range(lo, hi)`` index keeps numba's negative-index
  wraparound in the loop and stops LLVM from vectorising it (4x slower, measured).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from core.numerics.kernel_arith import (
    F_DOT,
    F_DOT_E,
    F_MAXABS,
    F_MAXULP,
    F_MINATOL,
    F_MISABS,
    F_MISREL,
    F_QD,
    F_QD_E,
    F_QR,
    F_QR_E,
    F_QT,
    F_QT_E,
    F_SA,
    F_SA_E,
    HIST_BINS,
    I_FIN,
    I_MIS,
    I_MISABS_IDX,
    I_MISREL_IDX,
    I_NEW,
    I_RINF,
    I_RNAN,
    I_RNZ,
    I_RNZF,
    I_SAME,
    I_TINF,
    I_TNAN,
    I_TNZ,
    I_TNZF,
    I_WORST,
    INF,
    JIT_OPTIONS,
    KIND_BF16,
    KIND_F32,
    KIND_F64,
    N_F,
    N_I,
    NAN_BITS,
    SAFE_HI_BITS,
    SAFE_LO_BITS,
    bits_f64,
    f64_bits,
    first_fold,
    first_max,
    fold,
    fold_width,
    ldexp,
    least_atol,
    least_atol_block_narrow,
    mismatch_bits,
    mismatch_flags,
    nonfinite_counts,
    scaled_terms,
    stage32_bits,
    stage64,
)

# ---------------------------------------------------------------- bitwise pass


@njit(**JIT_OPTIONS)
def _cmp_count(a, b, e_mask, m_mask):
    """(OR of a ^ b, NaN count, Inf count of a) for integer views a, b of one float format."""
    acc = 0
    nn = 0
    ni = 0
    for i in range(a.size):
        x = a[i]
        acc |= x ^ b[i]
        nonfinite = (x & e_mask) == e_mask
        nan = (x & m_mask) != 0
        nn += nonfinite & nan
        ni += nonfinite & (not nan)
    return acc, nn, ni


@njit(**JIT_OPTIONS)
def _census_block(raw_t, raw_r, tk, rk, lo, hi, bt, br):
    """(differs, NaN count, Inf count of the target) for one block; bt, br are scratch buffers."""
    if tk == rk:
        if tk == KIND_F64:
            acc, nn, ni = _cmp_count(
                raw_t[lo * 8 : hi * 8].view(np.int64), raw_r[lo * 8 : hi * 8].view(np.int64),
                np.int64(0x7FF0000000000000), np.int64(0x000FFFFFFFFFFFFF),
            )  # fmt: skip
        elif tk == KIND_F32:
            acc, nn, ni = _cmp_count(
                raw_t[lo * 4 : hi * 4].view(np.int32), raw_r[lo * 4 : hi * 4].view(np.int32),
                np.int32(0x7F800000), np.int32(0x007FFFFF),
            )  # fmt: skip
        else:
            e_mask = np.int16(0x7F80) if tk == KIND_BF16 else np.int16(0x7C00)
            m_mask = np.int16(0x007F) if tk == KIND_BF16 else np.int16(0x03FF)
            acc, nn, ni = _cmp_count(
                raw_t[lo * 2 : hi * 2].view(np.int16), raw_r[lo * 2 : hi * 2].view(np.int16), e_mask, m_mask
            )
        return acc != 0, np.int64(nn), np.int64(ni)
    n = hi - lo
    ib = bt.view(np.int64)
    jb = br.view(np.int64)
    if tk == KIND_F64 or rk == KIND_F64:  # promoted to float64: compare float64 bits
        stage64(raw_t, tk, lo, hi, bt)
        stage64(raw_r, rk, lo, hi, br)
        acc, nn, ni = _cmp_count(ib[:n], jb[:n], np.int64(0x7FF0000000000000), np.int64(0x000FFFFFFFFFFFFF))
    else:  # float32 is the promoted dtype of any other pair of different formats
        stage32_bits(raw_t, tk, lo, hi, ib)
        stage32_bits(raw_r, rk, lo, hi, jb)
        acc, nn, ni = _cmp_count(ib[:n], jb[:n], np.int64(0x7F800000), np.int64(0x007FFFFF))
    return acc != 0, np.int64(nn), np.int64(ni)


@njit(**JIT_OPTIONS)
def _census_alloc(nblocks, nthreads, scratch):
    return (
        np.zeros(1, np.int64),
        np.zeros((nblocks, 2), np.int64),
        np.empty((nthreads, 2, scratch), np.float64),
    )


@njit(**JIT_OPTIONS)
def _census_total(stop, counts):
    nn = 0
    ni = 0
    for s in range(counts.shape[0]):
        nn += counts[s, 0]
        ni += counts[s, 1]
    return stop[0] == 0, nn, ni


@njit(**JIT_OPTIONS)
def _census_one(s, tid, raw_t, raw_r, tk, rk, n, block, stop, counts, scratch):
    if stop[0] != 0:
        return
    lo = s * block
    hi = min(n, lo + block)
    differs, nn, ni = _census_block(raw_t, raw_r, tk, rk, lo, hi, scratch[tid, 0], scratch[tid, 1])
    if differs:
        stop[0] = 1  # read by the other threads before their next block: a benign race
    counts[s, 0] = nn
    counts[s, 1] = ni


@njit(parallel=True, **JIT_OPTIONS)
def bitwise_census(raw_t, raw_r, tk, rk, n, block, nthreads):
    """(equal, target NaN count, target Inf count): bits compared after widening to the promoted dtype.

    Raw bits for equal formats. Stops early (at block granularity) once a block differs; the
    counts are meaningful only when equal.
    """
    # Only the loop is parallel: numba turns every array expression of a parallel function
    # into a parfor of its own, each costing compile time.
    nblocks = (n + block - 1) // block
    stop, counts, scratch = _census_alloc(nblocks, nthreads, block if tk != rk else 1)
    for s in prange(nblocks):
        _census_one(np.int64(s), numba.get_thread_id(), raw_t, raw_r, tk, rk, n, block, stop, counts, scratch)
    return _census_total(stop, counts)


@njit(**JIT_OPTIONS)
def bitwise_census_serial(raw_t, raw_r, tk, rk, n, block):
    """`bitwise_census` on the calling thread (small tensors: no thread pool to wake)."""
    nblocks = (n + block - 1) // block
    # int64 thread count and id, not the literals 1 and 0: the parallel pass's types, so one compile each
    stop, counts, scratch = _census_alloc(nblocks, np.int64(1), min(block, n) if tk != rk else 1)
    for s in range(nblocks):
        _census_one(s, np.int64(0), raw_t, raw_r, tk, rk, n, block, stop, counts, scratch)
        if stop[0] != 0:
            break
    return _census_total(stop, counts)


# ---------------------------------------------------------------- the fused pass


@njit(**JIT_OPTIONS)
def _pass1(t, r, flg, key, nvb, rtol, ulp_floor, p):
    """Everything that vectorises over one staged block; per-element keys into the scratch.

    flg comes in with bit 0 = mismatch and gets bit 1 = finite in both. key: bits of |d| for
    the map/histogram/top-k (|t - r| for non-finite pairs that differ, NaN canonical, 0 where
    equal); nvb: bits of |d| - |rtol r| (for min_atol). The sums are `first_fold`'s and `fold`'s.
    """
    n_same = np.int64(0)
    n_mis = np.int64(0)
    n_fin = np.int64(0)
    t_nz = np.int64(0)
    r_nz = np.int64(0)
    m_d = np.int64(0)
    m_t = np.int64(0)
    m_r = np.int64(0)
    m_u = np.int64(0)
    m_n = np.int64(0)
    for i in range(t.size):
        tt = t[i]
        rr = r[i]
        fin = (abs(tt) < INF) & (abs(rr) < INF)
        same = (tt == rr) | ((tt != tt) & (rr != rr))
        mis = flg[i] & 1
        tf = tt if fin else 0.0
        rf = rr if fin else 0.0
        d = tf - rf
        ad = abs(d)
        ar = abs(rf)
        nv = ad - abs(rf * rtol)
        nb = f64_bits(nv) if nv == nv else np.int64(0)  # inf - inf: passes at any atol
        # ulp of the target's format at |r|: 2^(max(e, e_min) - p), from float64 bits (exact)
        k = (f64_bits(max(ar, ulp_floor)) >> 52) + (1 - p)
        sp = k << 52 if k >= 1 else np.int64(1) << (k + 51)
        u = ad / bits_f64(sp)
        mv = abs(tt - rr)
        kb = f64_bits(ad) if fin else (np.int64(0) if same else (f64_bits(mv) if mv == mv else NAN_BITS))
        key[i] = kb
        nvb[i] = nb
        flg[i] = mis | (np.uint8(fin) << 1)
        n_same += same
        n_mis += mis
        n_fin += fin
        t_nz += tt != 0.0
        r_nz += rr != 0.0
        m_d = max(m_d, f64_bits(ad))
        m_t = max(m_t, f64_bits(abs(tf)))
        m_r = max(m_r, f64_bits(ar))
        m_u = max(m_u, f64_bits(u))
        m_n = max(m_n, nb)
    return n_same, n_mis, n_fin, t_nz, r_nz, m_d, m_t, m_r, m_u, m_n


@njit(**JIT_OPTIONS)
def _pass2(mode, t, r, lo, key, nvb, aux, flg, m_d, m_n, n_mis, rtol, rtol32, out_i, out_f):
    """The rare, index-bearing results of one block, from the scratch of `_pass1`.

    The first index of max |d|; the exact least passing atol over the few candidates whose
    naive need is within rounding of the block's greatest (in the promoted dtype's rule); the
    greatest mismatched abs and rel difference in the promoted dtype.
    """
    n = t.size
    if m_d > 0:
        for j in range(n):
            if (key[j] == m_d) & ((flg[j] & 2) != 0):
                out_i[I_WORST] = lo + j
                break
    max_abs = bits_f64(m_d)
    top = bits_f64(m_n)
    if max_abs == INF:
        out_f[F_MINATOL] = INF
    elif mode != KIND_F64:
        out_f[F_MINATOL] = least_atol_block_narrow(mode, t, r, key, nvb, flg, max_abs, top, rtol, rtol32)
    elif top > 0.0:
        # Candidates: naive need within 8 ulps of any |d| here of the block's greatest (one
        # predictable comparison per element; non-positive needs have non-positive bits).
        thr = top - 16.0 * (max_abs * 2.0**-52 + 2.0**-1074)
        thr_bits = f64_bits(thr) if thr > 0.0 else np.int64(1)
        best = 0.0
        for j in range(n):
            if nvb[j] < thr_bits:
                continue
            nv = bits_f64(nvb[j])
            ad = bits_f64(key[j])
            if nv + (ad * 2.0**-50 + 2.0**-1070) < best:
                continue  # its exact need is within a few ulps of nv: it cannot win
            best = max(best, least_atol(ad, abs(r[j] * rtol)))
        out_f[F_MINATOL] = best
    if n_mis > 0:
        # The greatest mismatched difference, as torch.max finds it in assert_close's message:
        # a NaN wins, then the greatest value, ties to the first index (nvb is free by now).
        mismatch_bits(mode, t, r, flg, nvb, aux)
        ma, ia = first_max(nvb[:n])
        mr, ir_ = first_max(aux[:n])
        out_f[F_MISABS] = bits_f64(ma)
        out_i[I_MISABS_IDX] = lo + ia
        out_f[F_MISREL] = bits_f64(mr)
        out_i[I_MISREL_IDX] = lo + ir_


@njit(**JIT_OPTIONS)
def _block(raw_t, raw_r, tk, rk, mode, lo, hi, tv, rv, terms, key, nvb, aux, flg, rtol, atol, rtol32, atol32, atolh,
           tol_on, ulp_floor, p, out_i, out_f):  # fmt: skip
    """All per-block work of `fused` for elements lo..hi-1."""
    n = hi - lo
    stage64(raw_t, tk, lo, hi, tv)
    stage64(raw_r, rk, lo, hi, rv)
    t = tv[:n]
    r = rv[:n]
    mismatch_flags(mode, t, r, rtol, atol, rtol32, atol32, atolh, tol_on, flg)
    n_same, n_mis, n_fin, t_nz, r_nz, m_d, m_t, m_r, m_u, m_n = _pass1(
        t, r, flg, key, nvb, rtol, ulp_floor, p
    )
    out_i[I_SAME] = n_same
    out_i[I_MIS] = n_mis
    out_i[I_FIN] = n_fin
    out_i[I_TNZ] = t_nz
    out_i[I_RNZ] = r_nz
    if n_fin < n:
        t_nan, t_inf, r_nan, r_inf, new, t_nzf, r_nzf = nonfinite_counts(t, r)
        out_i[I_TNAN] = t_nan
        out_i[I_TINF] = t_inf
        out_i[I_RNAN] = r_nan
        out_i[I_RINF] = r_inf
        out_i[I_NEW] = new
        out_i[I_TNZF] = t_nzf
        out_i[I_RNZF] = r_nzf
    else:
        out_i[I_TNZF] = t_nz
        out_i[I_RNZF] = r_nz
    unsafe = False
    for m in (m_d, m_t, m_r):
        unsafe |= (m > 0) & ((m < SAFE_LO_BITS) | (m > SAFE_HI_BITS))
    if unsafe:
        e_d, e_t, e_r = scaled_terms(t, r, m_d, m_t, m_r, terms)
        out_f[F_SA_E] = e_d
        out_f[F_QD_E] = e_d
        out_f[F_QT_E] = e_t
        out_f[F_QR_E] = e_r
        out_f[F_DOT_E] = e_t + e_r
        width = n
    else:
        width = first_fold(t, r, n, terms)
    out_f[F_SA] = fold(terms[0], width)
    out_f[F_QD] = fold(terms[1], width)
    out_f[F_QT] = fold(terms[2], width)
    out_f[F_QR] = fold(terms[3], width)
    out_f[F_DOT] = fold(terms[4], width)
    out_f[F_MAXABS] = bits_f64(m_d)
    out_f[F_MAXULP] = bits_f64(m_u)
    if n_same < n:
        _pass2(mode, t, r, lo, key, nvb, aux, flg, m_d, m_n, n_mis, rtol, rtol32, out_i, out_f)


@njit(**JIT_OPTIONS)
def _sketch(lo, hi, key, flg, hist, pmap, pcnt, tk_key, tk_idx, cols, rb, cb, gc):
    """Fold one block into this thread's sketch: histogram, pooled map and mismatches, top-k."""
    n = hi - lo
    for j in range(n):
        kb = key[j]
        if kb > 0:
            hist[kb >> 50] += 1
    k = tk_key.size
    th_k = tk_key[k - 1]
    th_i = tk_idx[k - 1]
    for j in range(n):
        kb = key[j]
        if kb <= 0 or kb < th_k or (kb == th_k and lo + j > th_i):
            continue
        # Insert (kb, lo + j): key descending, then index ascending (a total order).
        pos = k - 1
        while pos > 0 and (tk_key[pos - 1] < kb or (tk_key[pos - 1] == kb and tk_idx[pos - 1] > lo + j)):
            tk_key[pos] = tk_key[pos - 1]
            tk_idx[pos] = tk_idx[pos - 1]
            pos -= 1
        tk_key[pos] = kb
        tk_idx[pos] = lo + j
        th_k = tk_key[k - 1]
        th_i = tk_idx[k - 1]
    i = lo
    while i < hi:
        row = i // cols
        row_start = row * cols
        row_end = min(hi, row_start + cols)
        cell_row = (row // rb) * gc
        c = i - row_start
        c_end = row_end - row_start
        if cb < 8:  # narrow cells: one pass over the row piece, flushing at each cell edge
            cc = c // cb
            edge = (cc + 1) * cb
            m = np.int64(0)
            cnt = np.int64(0)
            off = row_start - lo
            for x in range(c, c_end):
                u = np.uint64(off + x)  # unsigned: no negative-index wraparound
                m = max(m, key[u])
                cnt += flg[u] & 1
                if x + 1 == edge or x + 1 == c_end:
                    cell = cell_row + cc
                    pmap[cell] = max(pmap[cell], m)
                    pcnt[cell] += cnt
                    m = np.int64(0)
                    cnt = np.int64(0)
                    cc += 1
                    edge += cb
            c = c_end
        while c < c_end:
            cc = c // cb
            run_end = min(c_end, (cc + 1) * cb)
            m = np.int64(0)
            cnt = np.int64(0)
            # Unsigned indices: no negative-index wraparound in the loop, and no slice objects.
            for x in range(np.uint64(row_start + c - lo), np.uint64(row_start + run_end - lo)):
                m = max(m, key[x])
                cnt += flg[x] & 1
            cell = cell_row + cc
            pmap[cell] = max(pmap[cell], m)
            pcnt[cell] += cnt
            c = run_end
        i = row_end


@njit(**JIT_OPTIONS)
def _fused_alloc(nseg, nthreads, block, sketch, cells, k):
    out_i = np.zeros((nseg, N_I), np.int64)
    out_f = np.zeros((nseg, N_F), np.float64)
    for s in range(nseg):
        out_i[s, I_WORST] = -1
        out_i[s, I_MISABS_IDX] = -1
        out_i[s, I_MISREL_IDX] = -1
    fscr = np.empty((nthreads, 2, block), np.float64)  # staged target and reference
    tscr = np.empty((nthreads, 5, fold_width(block)), np.float64)  # per-element terms of the sums
    iscr = np.empty((nthreads, 3, block), np.int64)  # key, nvb, aux
    flg = np.empty((nthreads, block), np.uint8)
    ns = nthreads if sketch else 1
    hist = np.zeros((ns, HIST_BINS if sketch else 1), np.int64)
    pmap = np.zeros((ns, cells if sketch else 1), np.int64)
    pcnt = np.zeros((ns, cells if sketch else 1), np.int64)
    tk_key = np.full((ns, k if sketch else 1), -1, np.int64)
    tk_idx = np.full((ns, k if sketch else 1), -1, np.int64)
    return out_i, out_f, fscr, iscr, flg, hist, pmap, pcnt, tk_key, tk_idx, tscr


@njit(**JIT_OPTIONS)
def _fused_one(s, tid, raw_t, raw_r, kinds, n, block, par, sk, bufs):
    """Block s of `fused` on thread tid."""
    tk, rk, mode = kinds
    rtol, atol, rtol32, atol32, atolh, tol_on, ulp_floor, p = par
    sketch, cols, rb, cb, gc = sk
    out_i, out_f, fscr, iscr, flg, hist, pmap, pcnt, tk_key, tk_idx, tscr = bufs
    lo = s * block
    hi = min(n, lo + block)
    _block(raw_t, raw_r, tk, rk, mode, lo, hi, fscr[tid, 0], fscr[tid, 1], tscr[tid], iscr[tid, 0], iscr[tid, 1],
           iscr[tid, 2], flg[tid], rtol, atol, rtol32, atol32, atolh, tol_on, ulp_floor, p, out_i[s],
           out_f[s])  # fmt: skip
    if sketch and out_i[s, I_SAME] < hi - lo:
        _sketch(lo, hi, iscr[tid, 0], flg[tid], hist[tid], pmap[tid], pcnt[tid], tk_key[tid], tk_idx[tid],
                cols, rb, cb, gc)  # fmt: skip


@njit(parallel=True, **JIT_OPTIONS)
def fused(raw_t, raw_r, kinds, n, block, par, sk, grid_k, nthreads):
    """One pass over both inputs in fixed blocks; per-block partials (fold them with `combine`).

    kinds = (target kind, reference kind, promoted kind); par = (rtol, atol, rtol as float32,
    atol as float32, atol as the promoted bf16/f16, tolerance nonzero, ulp floor, p);
    sk = (sketch, fold cols, cell rows, cell cols, grid cols); grid_k = (grid cells, top-k k).
    Returns (I, F, hist, pmap, pcnt, tk_key, tk_idx): per-block int and float partials (columns
    I_* / F_*) and, with the sketch, per-thread histograms, pooled |d| bits and mismatch counts
    per cell, and top-k lists. Per-thread sketch parts are order-free (max, sums, a total
    order), so they too are independent of the scheduling.
    """
    nseg = (n + block - 1) // block
    bufs = _fused_alloc(nseg, nthreads, block, sk[0], grid_k[0], grid_k[1])
    for s in prange(nseg):
        _fused_one(np.int64(s), numba.get_thread_id(), raw_t, raw_r, kinds, n, block, par, sk, bufs)
    return bufs[0], bufs[1], bufs[5], bufs[6], bufs[7], bufs[8], bufs[9]


@njit(**JIT_OPTIONS)
def fused_serial(raw_t, raw_r, kinds, n, block, par, sk, grid_k):
    """`fused` on the calling thread (small tensors: no thread pool to wake). Same results."""
    nseg = (n + block - 1) // block
    # int64 thread count and id, not the literals 1 and 0: the parallel pass's types, so one compile each
    bufs = _fused_alloc(nseg, np.int64(1), block, sk[0], grid_k[0], grid_k[1])
    for s in range(nseg):
        _fused_one(s, np.int64(0), raw_t, raw_r, kinds, n, block, par, sk, bufs)
    return bufs[0], bufs[1], bufs[5], bufs[6], bufs[7], bufs[8], bufs[9]


# ---------------------------------------------------------------- combining


@njit(**JIT_OPTIONS)
def _lin_add(e1, s1, e2, s2):
    """2^e1 s1 + 2^e2 s2 as (e, s), |s| kept within [2^-600, 2^600]."""
    if s2 == 0.0:
        return e1, s1
    if s1 == 0.0:
        return e2, s2
    e = max(e1, e2)
    s = ldexp(s1, e1 - e) + ldexp(s2, e2 - e)
    if abs(s) > 2.0**600 and abs(s) < INF:
        s *= 2.0**-600
        e += 600
    elif s != 0.0 and abs(s) < 2.0**-600:
        s *= 2.0**600
        e -= 600
    return e, s


@njit(**JIT_OPTIONS)
def _sq_add(e1, q1, e2, q2):
    """4^e1 q1 + 4^e2 q2 as (e, q)."""
    if q2 == 0.0:
        return e1, q1
    if q1 == 0.0:
        return e2, q2
    e = max(e1, e2)
    q = ldexp(q1, 2 * (e1 - e)) + ldexp(q2, 2 * (e2 - e))
    if q > 2.0**600 and q < INF:
        q *= 2.0**-600
        e += 300
    elif q != 0.0 and q < 2.0**-600:
        q *= 2.0**600
        e -= 300
    return e, q


@njit(**JIT_OPTIONS)
def _nan_first_max(cur, cur_i, cur_nan, v, i):
    """torch.max's rule folded in index order: a NaN wins (the first one), else strictly greater."""
    if v != v:
        if not cur_nan:
            return v, i, True
    elif (not cur_nan) and (cur_i < 0 or v > cur):
        return v, i, False
    return cur, cur_i, cur_nan


@njit(**JIT_OPTIONS)
def combine(out_i, out_f):
    """Fold the per-block partials, so the result does not depend on threads.

    Counts add up, maxima and first indices are taken in block order, and the blocks' sums are
    added as a pairwise tree (`fold`'s order over the blocks, padded with zeros), as torch adds
    them too. Returns (ints, floats) laid out like one block's partials.
    """
    ints = np.zeros(N_I, np.int64)
    fl = np.zeros(N_F, np.float64)
    ints[I_WORST] = -1
    nseg = out_i.shape[0]
    w = fold_width(nseg)
    cols = (F_SA, F_QD, F_QT, F_QR, F_DOT)
    sums = np.zeros((5, w), np.float64)  # zero padding: the right operand's zero leaves the left
    exps = np.zeros((5, w), np.int64)
    for s in range(nseg):
        for c in range(5):
            sums[c, s] = out_f[s, cols[c]]
            exps[c, s] = np.int64(out_f[s, cols[c] - 1])  # each sum's exponent column precedes it
    h = w >> 1
    while h >= 1:
        for i in range(h):
            for c in range(5):
                if c == 0 or c == 4:
                    exps[c, i], sums[c, i] = _lin_add(exps[c, i], sums[c, i], exps[c, i + h], sums[c, i + h])
                else:
                    exps[c, i], sums[c, i] = _sq_add(exps[c, i], sums[c, i], exps[c, i + h], sums[c, i + h])
        h >>= 1
    ea, ed, et, er, ep = exps[0, 0], exps[1, 0], exps[2, 0], exps[3, 0], exps[4, 0]
    sa, qd, qt, qr, p = sums[0, 0], sums[1, 0], sums[2, 0], sums[3, 0], sums[4, 0]
    max_abs = max_ulp = min_atol = 0.0
    ma = mr = 0.0
    ma_i = mr_i = -1
    ma_nan = mr_nan = False
    for s in range(nseg):
        oi = out_i[s]
        of = out_f[s]
        for c in range(I_WORST):
            ints[c] += oi[c]
        if oi[I_WORST] >= 0 and of[F_MAXABS] > max_abs:  # strict: the earlier block wins ties
            max_abs = of[F_MAXABS]
            ints[I_WORST] = oi[I_WORST]
        max_ulp = max(max_ulp, of[F_MAXULP])
        min_atol = max(min_atol, of[F_MINATOL])
        if oi[I_MISABS_IDX] >= 0:
            ma, ma_i, ma_nan = _nan_first_max(ma, ma_i, ma_nan, of[F_MISABS], oi[I_MISABS_IDX])
        if oi[I_MISREL_IDX] >= 0:
            mr, mr_i, mr_nan = _nan_first_max(mr, mr_i, mr_nan, of[F_MISREL], oi[I_MISREL_IDX])
    ints[I_MISABS_IDX] = ma_i
    ints[I_MISREL_IDX] = mr_i
    fl[F_SA_E] = ea
    fl[F_SA] = sa
    fl[F_QD_E] = ed
    fl[F_QD] = qd
    fl[F_QT_E] = et
    fl[F_QT] = qt
    fl[F_QR_E] = er
    fl[F_QR] = qr
    fl[F_DOT_E] = ep
    fl[F_DOT] = p
    fl[F_MAXABS] = max_abs
    fl[F_MAXULP] = max_ulp
    fl[F_MINATOL] = min_atol
    fl[F_MISABS] = ma
    fl[F_MISREL] = mr
    return ints, fl
