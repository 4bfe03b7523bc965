"""A bounded sketch of one tensor's difference to its reference, kept instead of the tensors.

A real model's captured tensors weigh as much as the model; what the drill-down draws does not:
the block-max-pooled |Δ| map (at most 256×256 cells), how many elements fail the tolerance in
each block, a histogram of log₂|Δ| and the worst elements with their indices and values. The
sketch is made where the tensors are (on the target's device), row block by row block, so it
costs a few chunks of memory whatever the tensor's size, and a content hash of the target's raw
bytes lets two machines say "identical" without moving the tensor.

Pure tensor math (plus hashing): no I/O, no Streamlit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

__all__ = [
    "HIST_BINS_PER_OCTAVE",
    "MAX_SIDE",
    "TOP_K",
    "Sketch",
    "as_2d",
    "block_starts",
    "content_hash",
    "hist_bin_index",
    "hist_edges_log10",
    "make_sketch",
]

MAX_SIDE = 256  # the pooled map's largest side, as the drill-down draws it
TOP_K = 16
HIST_BINS_PER_OCTAVE = 4
# log₂|d| of any finite nonzero float64 lies in [-1074, 1024): bins from 2^-1075 up
_HIST_E0 = -1075
_HIST_BINS = (1024 - _HIST_E0) * HIST_BINS_PER_OCTAVE

MismatchRule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def as_2d(shape: tuple[int, ...]) -> tuple[int, int]:
    """The 2-D shape a tensor is drawn as: 0-D → (1, 1), 1-D → (1, n), N-D → (∏ leading dims, last)."""
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (1, shape[0])
    return (math.prod(shape[:-1]), shape[-1])


def block_starts(n: int, max_side: int = MAX_SIDE) -> np.ndarray:
    """First index of each block when a side of length n is cut into blocks of ceil(n / max_side)."""
    b = max(1, math.ceil(n / max_side))
    return np.arange(0, n, b, dtype=np.int64)


def content_hash(t: torch.Tensor, chunk_bytes: int = 1 << 26) -> str:
    """xxh3-128 of the tensor's raw bytes in row-major order, prefixed by dtype and shape.

    Two tensors with the same hash hold the same bits (to the odds of a 128-bit collision), so
    captures made on machines that never meet compare "identical" by hash alone. Chunked, so a
    GPU tensor crosses to the host a chunk at a time.
    """
    import xxhash

    h = xxhash.xxh3_128()
    h.update(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}".encode())
    flat = t.detach().reshape(-1)
    per = max(1, chunk_bytes // max(1, t.element_size()))
    for start in range(0, flat.numel(), per):
        piece = flat[start : start + per].to("cpu").contiguous()
        h.update(memoryview(piece.view(torch.uint8).numpy()))
    return h.hexdigest()


def hist_bin_index(values: np.ndarray) -> np.ndarray:
    """The histogram bin of each positive finite float64 value (HIST_BINS_PER_OCTAVE per octave)."""
    mant, exp = np.frexp(np.asarray(values, dtype=np.float64))
    sub = np.clip(((mant - 0.5) * (2 * HIST_BINS_PER_OCTAVE)).astype(np.int64), 0, HIST_BINS_PER_OCTAVE - 1)
    return (exp.astype(np.int64) - 1 - _HIST_E0) * HIST_BINS_PER_OCTAVE + sub


def hist_edges_log10(bins: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) log₁₀ edges of histogram bins given by index (the sketch's fixed log₂ bins)."""
    e = _HIST_E0 + np.asarray(bins, dtype=np.float64) / HIST_BINS_PER_OCTAVE
    return e * math.log10(2.0), (e + 1.0 / HIST_BINS_PER_OCTAVE) * math.log10(2.0)


@dataclass
class Sketch:
    """What is kept of one compared tensor when the tensors are not: enough to draw its drill-down."""

    ARRAY_PARTS: ClassVar[tuple[str, ...]] = (
        "row_starts",
        "col_starts",
        "pooled",
        "failing",
        "hist_bins",
        "hist_counts",
    )

    shape: tuple[int, ...]
    rows: int  # the 2-D fold (`as_2d`)
    cols: int
    row_starts: np.ndarray  # int64, first row of each pooled block
    col_starts: np.ndarray
    pooled: np.ndarray  # float64 [len(row_starts), len(col_starts)]: max |Δ| per block (NaN propagates)
    failing: np.ndarray  # int64, same shape: elements beyond tolerance per block
    hist_bins: np.ndarray  # int64 bin indices (log₂|Δ|, HIST_BINS_PER_OCTAVE per octave) with counts > 0
    hist_counts: np.ndarray  # int64
    n_zero: int  # elements exactly equal (NaN == NaN)
    n_nonfinite: int  # elements whose difference is NaN or ±Inf
    top_index: list[tuple[int, ...]] = field(default_factory=list)  # worst |Δ| first (NaN first of all)
    top_target: list[float] = field(default_factory=list)
    top_reference: list[float] = field(default_factory=list)

    def arrays(self) -> dict[str, np.ndarray]:
        """The array parts, to be stored in a safetensors file, at half the size in memory.

        The map is stored as float32 (it is drawn; the row holds the exact maximum) and the failing
        counts as int32, as an empty array when no element fails (the common case for a whole model).
        """
        out = {part: getattr(self, part) for part in self.ARRAY_PARTS}
        out["pooled"] = self.pooled.astype(np.float32)
        out["failing"] = self.failing.astype(np.int32) if self.failing.any() else np.zeros((0, 0), np.int32)
        return out

    def meta(self) -> dict[str, Any]:
        """The JSON parts."""
        return {
            "shape": list(self.shape),
            "rows": self.rows,
            "cols": self.cols,
            "n_zero": self.n_zero,
            "n_nonfinite": self.n_nonfinite,
            "top_index": [list(i) for i in self.top_index],
            "top_target": self.top_target,
            "top_reference": self.top_reference,
        }

    @staticmethod
    def from_parts(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> Sketch:
        """Rebuild a sketch from `meta()` and `arrays()` (stored sizes widened back)."""
        arrays = dict(arrays)
        arrays["pooled"] = np.asarray(arrays["pooled"], dtype=np.float64)
        failing = np.asarray(arrays["failing"], dtype=np.int64)
        arrays["failing"] = failing if failing.size else np.zeros(arrays["pooled"].shape, np.int64)
        return Sketch(
            shape=tuple(meta["shape"]),
            rows=int(meta["rows"]),
            cols=int(meta["cols"]),
            n_zero=int(meta["n_zero"]),
            n_nonfinite=int(meta["n_nonfinite"]),
            top_index=[tuple(i) for i in meta.get("top_index", [])],
            top_target=list(meta.get("top_target", [])),
            top_reference=list(meta.get("top_reference", [])),
            **{k: np.asarray(v) for k, v in arrays.items()},
        )

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    def histogram(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(low, high, count) of the nonzero bins, in log₁₀ |Δ|."""
        low, high = hist_edges_log10(self.hist_bins)
        return low, high, self.hist_counts


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        flat, rest = divmod(flat, size)
        out.append(rest)
    return tuple(reversed(out))


def make_sketch(
    target: torch.Tensor,
    reference: torch.Tensor,
    mismatch: MismatchRule,
    chunk_elems: int = 1 << 22,
    max_side: int = MAX_SIDE,
) -> Sketch:
    """The sketch of ``target − reference`` (same shape), row block by row block on target's device.

    `mismatch(t, r)` gives the elements beyond tolerance of two chunks (the metrics' rule, so the
    per-block counts add up to the row's n_mismatch). Differences are exact float64 ``t − r``;
    equal elements (NaN with NaN included) count as 0.
    """
    if tuple(target.shape) != tuple(reference.shape):
        raise ValueError(f"shapes differ: {tuple(target.shape)} vs {tuple(reference.shape)}")
    shape = tuple(target.shape)
    rows, cols = as_2d(shape)
    row_starts, col_starts = block_starts(rows, max_side), block_starts(cols, max_side)
    rb = int(row_starts[1] - row_starts[0]) if len(row_starts) > 1 else max(rows, 1)
    cb = int(col_starts[1] - col_starts[0]) if len(col_starts) > 1 else max(cols, 1)
    n_cb = len(col_starts)
    device = target.device
    t2 = target.detach().reshape(rows, cols)
    r2 = reference.detach().to(device).reshape(rows, cols)
    pooled = np.zeros((len(row_starts), n_cb), dtype=np.float64)
    failing = np.zeros((len(row_starts), n_cb), dtype=np.int64)
    hist = torch.zeros(_HIST_BINS, dtype=torch.int64, device=device)
    n_zero = n_nonfinite = 0
    top_val = torch.empty(0, dtype=torch.float64, device=device)
    top_idx = torch.empty(0, dtype=torch.int64, device=device)
    # Whole row blocks per chunk, so a pooled cell never straddles two chunks.
    step = max(1, chunk_elems // max(1, cols * rb)) * rb
    zero = torch.zeros((), dtype=torch.float64, device=device)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        t = t2[r0:r1].to(torch.float64)
        r = r2[r0:r1].to(torch.float64)
        same = (t == r) | (t.isnan() & r.isnan())
        ad = torch.where(same, zero, (t - r).abs())  # NaN/Inf where they differ
        fails = mismatch(t2[r0:r1], r2[r0:r1])
        n_zero += int(same.sum())
        finite = ad.isfinite()
        n_nonfinite += int((~finite).sum())
        # Pad to whole blocks with zeros (|Δ| ≥ 0, so padding never wins a max), then pool.
        nr, pad_c = r1 - r0, n_cb * cb - cols
        padded = torch.nn.functional.pad(ad, (0, pad_c))
        nrb = math.ceil(nr / rb)
        if nrb * rb != nr:
            padded = torch.nn.functional.pad(padded, (0, 0, 0, nrb * rb - nr))
        blocks = padded.reshape(nrb, -1, n_cb, cb)
        # amax propagates NaN (a block holding a NaN is NaN): a NaN is never hidden.
        pooled[r0 // rb : r0 // rb + nrb] = blocks.amax(dim=(1, 3)).cpu().numpy()
        f = torch.nn.functional.pad(fails.to(torch.int64), (0, pad_c))
        if nrb * rb != nr:
            f = torch.nn.functional.pad(f, (0, 0, 0, nrb * rb - nr))
        failing[r0 // rb : r0 // rb + nrb] = f.reshape(nrb, -1, n_cb, cb).sum(dim=(1, 3)).cpu().numpy()
        nz = ad[finite & (ad > 0)]
        if nz.numel():
            mant, exp = torch.frexp(nz)  # nz = mant · 2^exp, mant in [0.5, 1)
            sub = (
                ((mant - 0.5) * (2 * HIST_BINS_PER_OCTAVE)).to(torch.int64).clamp(0, HIST_BINS_PER_OCTAVE - 1)
            )
            idx = (exp.to(torch.int64) - 1 - _HIST_E0) * HIST_BINS_PER_OCTAVE + sub
            hist += torch.bincount(idx, minlength=_HIST_BINS)
        # Worst elements: NaN counts as the worst of all (as the pooled map shows it).
        flat = ad.reshape(-1)
        key = torch.where(flat.isnan(), torch.full_like(flat, math.inf), flat)
        # a stable sort, not topk: ties go to the earlier element, as the kernel orders them
        vals, idx = torch.sort(key, descending=True, stable=True)
        keep = vals[:TOP_K] > 0
        top_val = torch.cat([top_val, vals[:TOP_K][keep]])
        top_idx = torch.cat([top_idx, idx[:TOP_K][keep] + r0 * cols])
        if top_val.numel() > TOP_K:  # chunks come in index order, so stable keeps ties earliest-first
            order = torch.argsort(-top_val, stable=True)[:TOP_K]
            top_val, top_idx = top_val[order], top_idx[order]
    order = torch.argsort(-top_val, stable=True)
    flat_idx = top_idx[order].cpu().tolist()
    t_flat, r_flat = target.detach().reshape(-1), reference.detach().reshape(-1)
    bins = torch.nonzero(hist).reshape(-1)
    return Sketch(
        shape=shape,
        rows=rows,
        cols=cols,
        row_starts=row_starts,
        col_starts=col_starts,
        pooled=pooled,
        failing=failing,
        hist_bins=bins.cpu().numpy(),
        hist_counts=hist[bins].cpu().numpy(),
        n_zero=n_zero,
        n_nonfinite=n_nonfinite,
        top_index=[_unravel(i, shape) for i in flat_idx],
        top_target=[float(t_flat[i]) for i in flat_idx],
        top_reference=[float(r_flat[i]) for i in flat_idx],
    )
