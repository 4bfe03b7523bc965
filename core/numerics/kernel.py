"""The comparison kernel: every statistic of `metrics.compare` in one fused pass (CPU, numba).

`compare_cpu(target, reference, rtol, atol)` first checks bitwise equality (after widening
both to the promoted dtype; one vectorised pass that stops at the first differing block and
also counts NaN/Inf), and only if the tensors differ runs one fused pass that reads each
element once, in fixed blocks processed in parallel, and computes:

- counts: elements not equal by value (NaN == NaN, +0 == -0), NaN/Inf on each side,
  NaN/Inf new in the target, elements finite in both, all-zero;
- over elements finite in both, with d = target - reference in float64: max |d| and the
  first index holding it, sum |d|, ||d||, ||t||, ||r|| and t.r with power-of-two scaling
  (so 1e±200 magnitudes and float64 subnormals give correct rmse / rel_l2 / cos_sim),
  max ULP distance in the target's format (as `metrics.ulp`), and min_atol: the least
  float64 atol with every element passing ``|d| <= atol + |rtol * r|`` in float64
  (exact: candidates near the block's naive maximum are settled per element);
- the tolerance rule of ``torch.testing.assert_close``: both promoted to
  ``torch.promote_types`` and ``torch.isclose(a, b, rtol, atol, equal_nan=True)`` evaluated
  in that dtype, rounding as torch's CPU kernels do (rtol as float32, atol as float32 and
  then rounded to bfloat16/float16 for those pairs, each intermediate result rounded to the
  dtype); plus the greatest mismatched abs and rel difference as assert_close reports them
  (computed in the promoted dtype, NaN wins, first index of the maximum);
- optionally a sketch: block-max-pooled |d| over a 2-D fold of the tensor, mismatches per
  pooled cell, a histogram of |d| by float64 exponent and quarter significand, the top-k |d|.

Each block (`DEFAULT_BLOCK` elements) is widened into a thread-local float64 staging buffer,
so one compiled kernel serves every dtype pair (compiled once, cached on disk: NUMBA_CACHE_DIR,
else ~/.cache/weightdrift/numba). Tensors under `PARALLEL_MIN` elements run on the calling
thread. Results do not depend on the thread count: each block's sums add its per-element terms as
a pairwise tree (`kernel_arith.fold`), and the blocks' partials are combined by the same tree in
block order. Maxima, indices, counts, ULPs and min_atol do not depend on the block size either;
sums do only through rounding. Float arithmetic is float64 per element, float64 accumulation, and
no float64 copy of a tensor is made. That order is one torch reproduces with whole-tensor ops:
`core.numerics.accumulate.compare_torch` gives this module's results bit for bit on any device.

CPU tensors only; where numba cannot be imported `available()` is False and callers use
`compare_torch`.
"""

from __future__ import annotations

import math
import os
import tempfile
import threading
from dataclasses import dataclass

import numpy as np
import torch

from core.numerics.sketch import as_2d

__all__ = [
    "DEFAULT_BLOCK",
    "PARALLEL_MIN",
    "KernelStats",
    "Sketch",
    "SUPPORTED_DTYPES",
    "available",
    "bitwise_census",
    "bitwise_census_torch",
    "compare_cpu",
    "default_fold",
    "hist_bin_edges",
    "to_kernel_array",
]

DEFAULT_BLOCK = 1 << 12  # elements per block: the scratch of one block stays in L2
BITWISE_BLOCK = 1 << 16
# Below this many elements the kernel runs on the calling thread: waking a thread pool costs
# more than it saves, and two OpenMP pools (torch's and numba's) spinning on a small machine
# slow each other down.
PARALLEL_MIN = 1 << 17
SUPPORTED_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
MAX_CELLS = 256  # pooled map: at most this many cells per side
HIST_FINITE_BINS = 8188  # bins 8188.. hold inf and NaN


def _cache_dir() -> str | None:
    """NUMBA_CACHE_DIR if set, else ~/.cache/weightdrift/numba, else a temp dir; None: none writable."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return None  # numba reads it itself
    for path in (
        os.path.join(os.path.expanduser("~"), ".cache", "weightdrift", "numba"),
        os.path.join(
            tempfile.gettempdir(), f"weightdrift-numba-{os.getuid() if hasattr(os, 'getuid') else 0}"
        ),
    ):
        try:
            os.makedirs(path, exist_ok=True)
            if os.access(path, os.W_OK):
                return path
        except OSError:
            continue
    return None


try:
    import numba
    from numba.core import config as _numba_config

    _dir = _cache_dir()
    if _dir is not None:
        # Read when each function is decorated, so this must come before importing kernel_jit.
        _numba_config.CACHE_DIR = _dir
    from core.numerics import kernel_jit as _jit
except ImportError as _exc:  # numba missing or broken: callers use their torch path
    _jit = None
    _IMPORT_ERROR: ImportError | None = _exc
else:
    _IMPORT_ERROR = None

# numba's workqueue threading layer aborts on concurrent parallel calls; serialise them.
_LOCK = threading.Lock()


def available() -> bool:
    """Whether the compiled kernel can be used (numba importable)."""
    return _jit is not None


def _require() -> None:
    if _jit is None:
        raise RuntimeError(f"the comparison kernel needs numba: {_IMPORT_ERROR}")


@dataclass(frozen=True)
class Sketch:
    """A bounded summary of where and how much a tensor differs, kept instead of the tensor.

    ``pooled_abs[i, j]`` is max |d| over fold rows ``i*cell[0] ... (i+1)*cell[0]-1`` and columns
    ``j*cell[1] ...``: |d| is |t - r| in float64 (inf or NaN where a non-finite element differs;
    0 where equal, including NaN == NaN), and a NaN in a cell makes the cell NaN.
    ``cell_mismatches`` counts elements failing the tolerance rule per cell.
    The histogram counts differing elements by the top 13 bits of |d| as a float64 (exponent and
    two significand bits): bin b covers ``[hist_bin_edges(b), hist_bin_edges(b + 1))``; equal
    elements (``n_zero``) and non-finite |d| (``n_nonfinite``) are counted apart.
    ``topk_*``: the differing elements with the greatest |d| (NaN first), ties by flat index.
    """

    fold: tuple[int, int]
    cell: tuple[int, int]
    pooled_abs: np.ndarray
    cell_mismatches: np.ndarray
    hist_first_bin: int
    hist_counts: np.ndarray
    n_zero: int
    n_nonfinite: int
    topk_index: np.ndarray
    topk_abs: np.ndarray
    topk_target: np.ndarray
    topk_reference: np.ndarray


@dataclass(frozen=True)
class KernelStats:
    """What the kernel measures about one (target, reference) pair; flat indices, float64 values.

    Statistics over d are over the ``n_finite`` elements finite in both (0 when there are none);
    ``worst_index`` is None when no such element differs. ``mismatch_*`` follow assert_close's
    message: the greatest |a - b| (and |a - b| / |b|) among mismatched elements, computed in the
    promoted dtype, NaN first; indices None when nothing mismatches. A float64 d that overflows
    (e.g. 1.7e308 - -1.7e308) is inf, and so are max_abs, mean_abs, rmse, rel_l2 and min_atol.
    ``min_atol`` is exact (the least float64 atol that passes every finite element): callers need
    no refinement. The degenerate cases follow `metrics.compare`: with nothing finite, means are 0;
    rel_l2 is 0 or inf against a zero reference; cos_sim is 1 for two zero tensors, NaN for one.
    Bitwise-equal inputs stop after the first pass: ``norm_target`` and ``norm_reference`` are then
    NaN (not computed) and everything else is zero, with cos_sim 1.
    """

    numel: int
    bitwise_equal: bool
    n_diff: int
    n_mismatch: int
    n_finite: int
    n_nan: int
    n_inf: int
    ref_nan: int
    ref_inf: int
    n_nonfinite_new: int
    all_zero: bool
    max_abs: float
    worst_index: int | None
    worst_target: float | None
    worst_reference: float | None
    sum_abs: float
    mean_abs: float
    rmse: float
    rel_l2: float
    cos_sim: float
    norm_diff: float
    norm_target: float
    norm_reference: float
    max_ulp: float
    min_atol: float
    mismatch_max_abs: float
    mismatch_max_abs_index: int | None
    mismatch_max_rel: float
    mismatch_max_rel_index: int | None
    sketch: Sketch | None


_KIND = {torch.float64: 0, torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
# (p, e_min) of each format, as tolerance.float_format derives them from torch.finfo.
FLOAT_FORMATS = {
    torch.float64: (53, -1021),
    torch.float32: (24, -125),
    torch.bfloat16: (8, -125),
    torch.float16: (11, -13),
}


def to_kernel_array(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a CPU tensor, flat and C-ordered, as a uint8 numpy view.

    Copies only when `t` is not contiguous (in its own dtype, never to float64).
    """
    if t.device.type != "cpu":
        raise ValueError(f"the kernel runs on CPU tensors, not {t.device}")
    if t.dtype not in _KIND:
        raise TypeError(f"the kernel compares {', '.join(map(str, SUPPORTED_DTYPES))}, not {t.dtype}")
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8).numpy()


# The 2-D reading of a tensor for its pooled map: the drill-down's own fold (`core.numerics.sketch.as_2d`).
default_fold = as_2d


def hist_bin_edges(bins: np.ndarray | int) -> np.ndarray:
    """Lower edges of histogram bins (float64): the float whose top 13 bits are the bin number."""
    b = np.asarray(bins, dtype=np.int64)
    return (b << 50).view(np.float64)


def _ldexp(x: float, e: int) -> float:
    try:
        return math.ldexp(x, e)
    except OverflowError:
        return math.copysign(math.inf, x)


def _scalar_in(dtype: torch.dtype, x: float) -> float:
    """A float64 scalar as torch's CPU kernels see it for a `dtype` tensor: via float32, then dtype."""
    return torch.tensor(x, dtype=torch.float64).to(torch.float32).to(dtype).item()


def bitwise_census(target: torch.Tensor, reference: torch.Tensor) -> tuple[bool, int, int]:
    """(bitwise equal after widening both to the promoted dtype, target NaN count, target Inf count).

    Equal dtypes compare raw bits. The pass stops at the first differing block; the counts are
    valid only when equal. NaN payloads widen as the hardware does (payload kept, quiet bit set).
    """
    _require()
    if target.numel() != reference.numel():
        raise ValueError(f"sizes differ: {target.numel()} vs {reference.numel()}")
    ta, ra = to_kernel_array(target), to_kernel_array(reference)
    return _census(ta, ra, _KIND[target.dtype], _KIND[reference.dtype], target.numel(), None)


def _widened_bits(x: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    """Bits of x widened to `wide` as the kernel's census widens them (a NaN keeps its payload, quiet)."""
    if x.dtype == wide:
        if wide == torch.float64:
            return x.view(torch.int64)
        return x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    if x.dtype == torch.bfloat16:
        b32 = (x.view(torch.int16).to(torch.int64) & 0xFFFF) << 16
    elif x.dtype == torch.float16:
        u = x.view(torch.int16).to(torch.int64) & 0xFFFF
        e, m = (u >> 10) & 0x1F, u & 0x3FF
        normal = ((e + 112) << 23) | (m << 13)
        sub = (m.to(torch.float32) * 2.0**-24).view(torch.int32).to(torch.int64)  # exact: m < 2^10
        b32 = torch.where(e == 0, torch.where(m == 0, 0, sub), normal)
        b32 = torch.where(e == 31, 0x7F800000 | (m << 13) | ((m != 0).to(torch.int64) << 22), b32)
        b32 = b32 | ((u & 0x8000) << 16)
    else:
        b32 = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    if wide == torch.float32:
        return b32
    # to float64: finite values convert exactly; a NaN keeps its payload and gets the quiet bit
    f32 = (b32 & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    nan = ((b32 & 0x7FFFFFFF) | (1 << 22)) << 29 | (0x7FF << 52)
    nan = torch.where((b32 & 0x80000000) != 0, nan | (-(2**63)), nan)
    return torch.where(f32.isnan(), nan, f32.to(torch.float64).view(torch.int64))


def bitwise_census_torch(t_flat, r_flat, chunk: int) -> tuple[bool, int, int]:
    """`bitwise_census` in torch, on the tensors' device, `chunk` elements at a time (for `compare_torch`):
    (bitwise equal after widening both to the promoted dtype, target NaN count, target Inf count)."""
    wide = t_flat.dtype if t_flat.dtype == r_flat.dtype else torch.promote_types(t_flat.dtype, r_flat.dtype)
    n_nan = n_inf = 0
    for start in range(0, t_flat.numel(), chunk):
        stop = start + chunk
        t, r = t_flat[start:stop], r_flat[start:stop]
        if t.dtype == r.dtype:  # raw bits
            as_int = {8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()]
            differ = not torch.equal(t.view(as_int), r.view(as_int))
        else:
            differ = not torch.equal(_widened_bits(t, wide), _widened_bits(r, wide))
        if differ:
            return False, 0, 0
        n_nan += int(t.isnan().sum())
        n_inf += int(t.isinf().sum())
    return True, n_nan, n_inf


def _census(ta, ra, tk, rk, n, parallel) -> tuple[bool, int, int]:
    with _LOCK:
        if parallel or (parallel is None and n >= PARALLEL_MIN):
            # The parallel pass visits every block even once one differs: a pair that differs in its
            # first block (a load in another dtype: nearly every element) is settled before launching it.
            if not _jit.bitwise_census_serial(ta, ra, tk, rk, min(n, BITWISE_BLOCK), BITWISE_BLOCK)[0]:
                return False, 0, 0
            eq, nan, inf = _jit.bitwise_census(ta, ra, tk, rk, n, BITWISE_BLOCK, numba.get_num_threads())
        else:
            eq, nan, inf = _jit.bitwise_census_serial(ta, ra, tk, rk, n, BITWISE_BLOCK)
    return bool(eq), int(nan), int(inf)


def pooled_grid(rows: int, cols: int) -> tuple[int, int, int, int]:
    """The sketch's pooled map of a `rows` × `cols` fold: (cell rows, cell cols, grid rows, grid cols)."""
    rb = max(1, -(-rows // MAX_CELLS))
    cb = max(1, -(-cols // MAX_CELLS))
    return rb, cb, max(1, -(-rows // rb)), max(1, -(-cols // cb))


def identical_stats(numel: int, n_nan: int, n_inf: int, sketch: bool, fold: tuple[int, int]) -> KernelStats:
    """The statistics (and an all-zero sketch) of two bitwise-identical tensors, from their census."""
    sk = None
    if sketch:
        rb, cb, gr, gc = pooled_grid(*fold)
        sk = Sketch(
            fold=fold, cell=(rb, cb), pooled_abs=np.zeros((gr, gc)), cell_mismatches=np.zeros((gr, gc), np.int64),
            hist_first_bin=0, hist_counts=np.zeros(0, np.int64), n_zero=numel, n_nonfinite=0,
            topk_index=np.zeros(0, np.int64), topk_abs=np.zeros(0), topk_target=np.zeros(0),
            topk_reference=np.zeros(0),
        )  # fmt: skip
    return KernelStats(
        numel=numel, bitwise_equal=True, n_diff=0, n_mismatch=0, n_finite=numel - n_nan - n_inf,
        n_nan=n_nan, n_inf=n_inf, ref_nan=n_nan, ref_inf=n_inf, n_nonfinite_new=0, all_zero=False,
        max_abs=0.0, worst_index=None, worst_target=None, worst_reference=None, sum_abs=0.0,
        mean_abs=0.0, rmse=0.0, rel_l2=0.0, cos_sim=1.0, norm_diff=0.0, norm_target=math.nan,
        norm_reference=math.nan, max_ulp=0.0, min_atol=0.0, mismatch_max_abs=0.0,
        mismatch_max_abs_index=None, mismatch_max_rel=0.0, mismatch_max_rel_index=None, sketch=sk,
    )  # fmt: skip


def compare_cpu(
    target: torch.Tensor,
    reference: torch.Tensor,
    rtol: float,
    atol: float,
    *,
    sketch: bool = False,
    fold: tuple[int, int] | None = None,
    topk: int = 16,
    block: int = DEFAULT_BLOCK,
    parallel: bool | None = None,
) -> KernelStats:
    """Compare two CPU tensors of the same number of elements (read flat, in C order).

    `fold` is the (rows, cols) reading for the sketch's map, `default_fold(target.shape)` if
    None. `block` changes only how sums are rounded; `parallel` (default: from
    `PARALLEL_MIN` elements on) changes nothing in the result. Raises TypeError for dtypes outside
    `SUPPORTED_DTYPES`, ValueError for other devices or sizes, RuntimeError without numba.
    """
    _require()
    if target.numel() != reference.numel():
        raise ValueError(f"sizes differ: {target.numel()} vs {reference.numel()}")
    if not (rtol >= 0 and atol >= 0):
        raise ValueError(f"rtol and atol must be non-negative, not rtol={rtol}, atol={atol}")
    if block < 1 or topk < 1:
        raise ValueError("block and topk must be positive")
    ta, ra = to_kernel_array(target), to_kernel_array(reference)
    tk, rk = _KIND[target.dtype], _KIND[reference.dtype]
    numel = target.numel()
    fold = default_fold(tuple(target.shape)) if fold is None else (int(fold[0]), int(fold[1]))
    if fold[0] * fold[1] != numel:
        raise ValueError(f"fold {fold} does not hold {numel} elements")

    eq, n_nan, n_inf = _census(ta, ra, tk, rk, numel, parallel)
    if eq:
        return identical_stats(numel, n_nan, n_inf, sketch, fold)

    promoted = torch.promote_types(target.dtype, reference.dtype)
    atolh = _scalar_in(promoted, atol) if promoted in (torch.bfloat16, torch.float16) else 0.0
    p, e_min = FLOAT_FORMATS[target.dtype]
    rb, cb, gr, gc = pooled_grid(*fold)
    kinds = (tk, rk, _KIND[promoted])
    par = (float(rtol), float(atol), np.float32(rtol), np.float32(atol), np.float32(atolh),
           not (rtol == 0 and atol == 0), 2.0 ** (e_min - 1), p)  # fmt: skip
    sk = (bool(sketch), fold[1], rb, cb, gc)
    grid_k = (gr * gc, int(topk))
    with _LOCK:
        if parallel or (parallel is None and numel >= PARALLEL_MIN):
            parts = _jit.fused(ta, ra, kinds, numel, int(block), par, sk, grid_k, numba.get_num_threads())
        else:
            parts = _jit.fused_serial(ta, ra, kinds, numel, int(block), par, sk, grid_k)
        out_i, out_f, hist, pmap, pcnt, tk_key, tk_idx = parts
        ints, fl = _jit.combine(out_i, out_f)
    return _assemble(target, reference, numel, ints, fl, (hist, pmap, pcnt, tk_key, tk_idx) if sketch else None,
                     fold, (rb, cb, gr, gc))  # fmt: skip


def _assemble(target, reference, numel, ints, fl, sk, fold, grid) -> KernelStats:
    j = _jit
    parts = {name: int(ints[col]) for name, col in (
        ("n_same", j.I_SAME), ("n_mis", j.I_MIS), ("n_fin", j.I_FIN), ("t_nz", j.I_TNZ), ("r_nz", j.I_RNZ),
        ("t_nan", j.I_TNAN), ("t_inf", j.I_TINF), ("r_nan", j.I_RNAN), ("r_inf", j.I_RINF), ("new", j.I_NEW),
        ("t_nzf", j.I_TNZF), ("r_nzf", j.I_RNZF), ("worst", j.I_WORST), ("mis_abs_idx", j.I_MISABS_IDX),
        ("mis_rel_idx", j.I_MISREL_IDX),
    )}  # fmt: skip
    for name, col in (("sum_abs", j.F_SA), ("sum_d2", j.F_QD), ("sum_t2", j.F_QT), ("sum_r2", j.F_QR),
                      ("dot", j.F_DOT)):  # fmt: skip
        parts[name] = (int(fl[col - 1]), float(fl[col]))  # each sum's exponent column precedes it
    for name, col in (("max_abs", j.F_MAXABS), ("max_ulp", j.F_MAXULP), ("min_atol", j.F_MINATOL),
                      ("mis_abs", j.F_MISABS), ("mis_rel", j.F_MISREL)):  # fmt: skip
        parts[name] = float(fl[col])
    return assemble(target, reference, parts, sk, fold, grid)


def assemble(target, reference, parts: dict, sk, fold, grid) -> KernelStats:
    """KernelStats from a pass's combined partials: counts and indices (-1: none) by name, the sums as
    (exponent, sum) pairs (|d| and t·r scaled by 2^e, the squares by 4^e), the maxima; `sk` the
    per-thread sketch arrays or None. Shared by the kernel and its torch port (`accumulate`).
    """
    n_same, n_fin = parts["n_same"], parts["n_fin"]
    t_nzf, r_nzf = parts["t_nzf"], parts["r_nzf"]
    e_a, s_a = parts["sum_abs"]
    e_d, q_d = parts["sum_d2"]
    e_t, q_t = parts["sum_t2"]
    e_r, q_r = parts["sum_r2"]
    e_p, p = parts["dot"]
    max_abs = parts["max_abs"]

    mean_abs = _ldexp(s_a / n_fin, e_a) if n_fin else 0.0
    rmse = _ldexp(math.sqrt(q_d / n_fin), e_d) if n_fin else 0.0
    if r_nzf == 0 or q_r == 0.0:
        rel_l2 = 0.0 if max_abs == 0.0 else math.inf
    else:
        rel_l2 = _ldexp(math.sqrt(q_d) / math.sqrt(q_r), e_d - e_r)
    if t_nzf == 0 and r_nzf == 0:
        cos_sim = 1.0
    elif t_nzf == 0 or r_nzf == 0:
        cos_sim = math.nan
    else:
        c = _ldexp(p / (math.sqrt(q_t) * math.sqrt(q_r)), e_p - e_t - e_r)
        cos_sim = max(-1.0, min(1.0, c))

    t_flat, r_flat = target.detach().reshape(-1), reference.detach().reshape(-1)
    worst = parts["worst"]
    mia, mir = parts["mis_abs_idx"], parts["mis_rel_idx"]
    sketch = None if sk is None else _assemble_sketch(t_flat, r_flat, n_same, sk, fold, grid)
    return KernelStats(
        numel=target.numel(),
        bitwise_equal=False,
        n_diff=target.numel() - n_same,
        n_mismatch=parts["n_mis"],
        n_finite=n_fin,
        n_nan=parts["t_nan"],
        n_inf=parts["t_inf"],
        ref_nan=parts["r_nan"],
        ref_inf=parts["r_inf"],
        n_nonfinite_new=parts["new"],
        all_zero=target.numel() > 0 and parts["t_nz"] == 0 and parts["r_nz"] > 0,
        max_abs=max_abs,
        worst_index=worst if worst >= 0 else None,
        worst_target=float(t_flat[worst]) if worst >= 0 else None,
        worst_reference=float(r_flat[worst]) if worst >= 0 else None,
        sum_abs=_ldexp(s_a, e_a),
        mean_abs=mean_abs,
        rmse=rmse,
        rel_l2=rel_l2,
        cos_sim=cos_sim,
        norm_diff=_ldexp(math.sqrt(q_d), e_d),
        norm_target=_ldexp(math.sqrt(q_t), e_t),
        norm_reference=_ldexp(math.sqrt(q_r), e_r),
        max_ulp=parts["max_ulp"],
        min_atol=parts["min_atol"],
        mismatch_max_abs=parts["mis_abs"],
        mismatch_max_abs_index=mia if mia >= 0 else None,
        mismatch_max_rel=parts["mis_rel"],
        mismatch_max_rel_index=mir if mir >= 0 else None,
        sketch=sketch,
    )


def _assemble_sketch(t_flat, r_flat, n_same, sk, fold, grid) -> Sketch:
    hist, pmap, pcnt, tk_key, tk_idx = sk
    rb, cb, gr, gc = grid
    h = hist.sum(axis=0)
    finite = h[:HIST_FINITE_BINS]
    nz = np.flatnonzero(finite)
    first = int(nz[0]) if nz.size else 0
    counts = finite[first : int(nz[-1]) + 1] if nz.size else np.zeros(0, np.int64)
    keys, idx = tk_key.ravel(), tk_idx.ravel()
    keep = idx >= 0
    keys, idx = keys[keep], idx[keep]
    order = np.lexsort((idx, -keys))[: tk_key.shape[1]]  # |d| descending (NaN bits highest), index ascending
    keys, idx = keys[order], idx[order]
    sel = torch.from_numpy(idx)
    return Sketch(
        fold=fold,
        cell=(rb, cb),
        pooled_abs=pmap.max(axis=0).view(np.float64).reshape(gr, gc).copy(),
        cell_mismatches=pcnt.sum(axis=0).reshape(gr, gc),
        hist_first_bin=first,
        hist_counts=counts,
        n_zero=n_same,
        n_nonfinite=int(h[HIST_FINITE_BINS:].sum()),
        topk_index=idx,
        topk_abs=keys.view(np.float64).copy(),
        topk_target=_values_at(t_flat, sel),
        topk_reference=_values_at(r_flat, sel),
    )


def _values_at(flat: torch.Tensor, sel: torch.Tensor) -> np.ndarray:
    """`flat[sel]` as float64 on the host, every NaN the canonical one: a CUDA conversion keeps a
    payload (float16's NaN arrives as 0x7FFFFFFFE0000000 on an H200) that the CPU's does not."""
    v = flat[sel.to(flat.device)].to(torch.float64).cpu().numpy()
    v[np.isnan(v)] = np.nan
    return v
