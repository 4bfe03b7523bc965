"""core.numerics.sketch: the bounded drill-down of one tensor's difference, against full computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from core.numerics.sketch import MAX_SIDE, TOP_K, Sketch, content_hash, make_sketch
from dashboard.figures.diffs import block_max_pool


def _rule(t: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    # any elementwise rule will do: the sketch must add its blocks up exactly
    return ~torch.isclose(t.double(), r.double(), rtol=1e-3, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("shape", [(700, 530), (3, 4, 300), (1000,), (), (257, 1), (0, 5)])
@pytest.mark.parametrize("chunk", [1 << 22, 997])
def test_sketch_matches_full_computation(shape, chunk):
    g = torch.Generator().manual_seed(3)
    r = torch.randn(shape, generator=g, dtype=torch.float64)
    t = (r + torch.randn(shape, generator=g, dtype=torch.float64) * 1e-4).to(torch.float32)
    if t.numel() > 10:
        flat = t.view(-1)
        flat[5] = float("nan")
        flat[7] = r.view(-1)[7].item()  # exactly equal after the cast back? not guaranteed; set both
        r.view(-1)[7] = flat[7].item()
    s = make_sketch(t, r, _rule, chunk_elems=chunk)
    d = t.double() - r
    same = (t.double() == r) | (t.isnan() & r.isnan())
    ad = torch.where(same, torch.zeros((), dtype=torch.float64), d.abs())
    rows, cols = s.rows, s.cols
    full = ad.reshape(rows, cols).numpy()
    if full.size:
        pooled, rs, cs = block_max_pool(full, max_side=MAX_SIDE)
        np.testing.assert_array_equal(s.pooled, pooled)
        np.testing.assert_array_equal(s.row_starts, rs)
        np.testing.assert_array_equal(s.col_starts, cs)
    assert int(s.failing.sum()) == int(_rule(t, r).sum())
    finite = torch.isfinite(ad)
    assert s.n_zero == int(same.sum())
    assert s.n_nonfinite == int((~finite).sum())
    assert int(s.hist_counts.sum()) == int((finite & (ad > 0)).sum())
    # the worst elements, worst first; NaN first of all
    key = torch.where(ad.isnan(), torch.full_like(ad, math.inf), ad).reshape(-1)
    expect = torch.sort(key, descending=True, stable=True)
    n = int(min(TOP_K, int((key > 0).sum())))
    flat_idx = [int(np.ravel_multi_index(i, shape)) if shape else 0 for i in s.top_index]
    assert flat_idx == expect.indices[:n].tolist()
    np.testing.assert_array_equal(s.top_target, [float(t.reshape(-1)[i]) for i in flat_idx])


def test_histogram_bins_hold_their_values():
    t = torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    r = torch.tensor([1.0, 1.0 - 2.0**-20, 1.0 - 3 * 2.0**-30, 1.0], dtype=torch.float64)
    s = make_sketch(t, r, _rule)
    low, high, counts = s.histogram()
    for v in (2.0**-20, 3 * 2.0**-30):
        hit = [(lo, hi) for lo, hi in zip(low, high, strict=True) if lo <= math.log10(v) < hi]
        assert len(hit) == 1
    assert counts.tolist() == [1, 1] and s.n_zero == 2


def test_round_trip_and_hash():
    t = torch.randn(40, 40)
    s = make_sketch(t, t.double(), _rule)
    again = Sketch.from_parts(s.meta(), s.arrays())
    assert again.meta() == s.meta()
    # stored at float32 (drawn, not measured: the row holds the exact max), failing counts exact
    np.testing.assert_array_equal(again.pooled, s.pooled.astype(np.float32))
    np.testing.assert_array_equal(again.failing, s.failing)
    assert content_hash(t) == content_hash(t.clone()) != content_hash(t.double())
    assert content_hash(t) != content_hash(t.reshape(1600))  # shape is part of the content
    u = t.clone()
    u[3, 3] = torch.nextafter(u[3, 3], torch.tensor(2.0))
    assert content_hash(u) != content_hash(t)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float64), (torch.bfloat16, torch.float32)])
def test_kernel_sketch_equals_the_torch_sketch(dtypes):
    """metrics.measure's one-pass sketch (the CPU kernel) and make_sketch (any device) agree exactly."""
    from core.numerics import metrics

    g = torch.Generator().manual_seed(11)
    r = torch.randn(300, 700, generator=g, dtype=torch.float64).to(dtypes[1])
    t = (r.double() * (1 + torch.randn(300, 700, generator=g, dtype=torch.float64) * 1e-2)).to(dtypes[0])
    t.view(-1)[[5, 9000]] = float("nan")
    t.view(-1)[77] = r.view(-1)[77].to(dtypes[0])
    tol = metrics.default_tolerance(dtypes[0])
    stats, fast = metrics.measure(t, r, tol)
    slow = make_sketch(t, r, lambda a, b: ~metrics.close_mask(a, b, tol))
    assert fast is not None and stats.n_mismatch == int(fast.failing.sum()) == int(slow.failing.sum())
    np.testing.assert_array_equal(fast.pooled, slow.pooled)
    np.testing.assert_array_equal(fast.failing, slow.failing)
    np.testing.assert_array_equal(fast.hist_bins, slow.hist_bins)
    np.testing.assert_array_equal(fast.hist_counts, slow.hist_counts)
    assert (fast.n_zero, fast.n_nonfinite) == (slow.n_zero, slow.n_nonfinite)
    assert fast.top_index == slow.top_index
