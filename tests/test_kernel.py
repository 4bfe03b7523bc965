"""Tests for core.numerics.kernel: the fused comparison kernel against an independent plain-torch float64
computation, torch.isclose / assert_close's message element for element, extreme magnitudes,
and independence from threads and block sizes."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import struct
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch

from core.numerics import kernel
from core.numerics.accumulate import compare_torch
from core.numerics.metrics import ulp

pytestmark = pytest.mark.skipif(not kernel.available(), reason="numba is not importable")

F64, F32, BF16, F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
DTYPES = [F64, F32, BF16, F16]
PAIRS = [(t, r) for t in DTYPES for r in DTYPES]
DEFAULT_TOL = {F16: (1e-3, 1e-5), BF16: (1.6e-2, 1e-5), F32: (1.3e-6, 1e-5), F64: (1e-7, 1e-7)}


def pair_id(pair) -> str:
    return "-".join(str(d).removeprefix("torch.") for d in pair)


# ---------------------------------------------------------------- the independent reference


def reference(t: torch.Tensor, r: torch.Tensor, rtol: float, atol: float) -> dict:
    """Everything the kernel reports, the slow and obvious way in torch."""
    t64, r64 = t.reshape(-1).double(), r.reshape(-1).double()
    fin = t64.isfinite() & r64.isfinite()
    same = (t64 == r64) | (t64.isnan() & r64.isnan())
    tf, rf = torch.where(fin, t64, 0.0), torch.where(fin, r64, 0.0)
    d = tf - rf
    ad = d.abs()
    out = {
        "n_diff": int((~same).sum()),
        "n_finite": int(fin.sum()),
        "n_nan": int(t64.isnan().sum()),
        "n_inf": int(t64.isinf().sum()),
        "ref_nan": int(r64.isnan().sum()),
        "ref_inf": int(r64.isinf().sum()),
        "n_nonfinite_new": int((~t64.isfinite() & ~same).sum()),
        "all_zero": t64.numel() > 0 and not bool((t64 != 0).any()) and bool((r64 != 0).any()),
    }
    max_abs = float(ad.max()) if ad.numel() else 0.0
    worst = int(ad.argmax()) if max_abs > 0 else None  # argmax: the first maximal index
    out.update(
        max_abs=max_abs,
        worst_index=worst,
        worst_target=None if worst is None else float(t64[worst]),
        worst_reference=None if worst is None else float(r64[worst]),
        max_ulp=float((ad / ulp(rf, t.dtype)).max()) if ad.numel() else 0.0,
    )
    # assert_close: both promoted, isclose in that dtype, then its message's greatest differences.
    promoted = torch.promote_types(t.dtype, r.dtype)
    a, b = t.reshape(-1).to(promoted), r.reshape(-1).to(promoted)
    matches = torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
    out["mismatch_mask"] = ~matches
    out["n_mismatch"] = int((~matches).sum())
    abs_diff = torch.abs(a - b)
    abs_diff[matches] = 0
    rel_diff = abs_diff / torch.abs(b)
    rel_diff[matches] = 0
    if out["n_mismatch"]:
        (va, ia), (vr, ir) = torch.max(abs_diff, 0), torch.max(rel_diff, 0)
        out.update(mismatch_max_abs=float(va), mismatch_max_abs_index=int(ia))
        out.update(mismatch_max_rel=float(vr), mismatch_max_rel_index=int(ir))
    else:
        out.update(mismatch_max_abs=0.0, mismatch_max_abs_index=None)
        out.update(mismatch_max_rel=0.0, mismatch_max_rel_index=None)
    # Sums, where float64 squares neither overflow nor underflow (extremes are tested exactly).
    n = int(fin.sum())
    out["plain_sums_ok"] = bool(
        (tf.abs() <= 1e150).all() and (rf.abs() <= 1e150).all() and ((ad == 0) | (ad >= 1e-150)).all()
        and ((tf == 0) | (tf.abs() >= 1e-150)).all() and ((rf == 0) | (rf.abs() >= 1e-150)).all()
    )  # fmt: skip
    if n:
        out["mean_abs"] = float(ad.sum()) / n
        out["rmse"] = math.sqrt(float((d * d).sum()) / n)
    t_norm, r_norm = math.sqrt(float((tf * tf).sum())), math.sqrt(float((rf * rf).sum()))
    out["rel_l2"] = math.sqrt(float((d * d).sum())) / r_norm if r_norm else None
    out["cos_sim"] = float((tf * rf).sum()) / (t_norm * r_norm) if t_norm and r_norm else None
    out["_ad"], out["_rel"] = ad, (rf * rtol).abs()
    out["_promoted"] = (a[fin], b[fin], rtol)
    return out


def passes(ad: torch.Tensor, rel: torch.Tensor, atol: float) -> bool:
    """The float64 rule min_atol is defined by: every finite element has |d| <= atol + |rtol r|."""
    return bool((ad <= atol + rel).all())


def passes_promoted(promoted: tuple, atol: float) -> bool:
    """The rule min_atol is defined by in general: torch.isclose in the promoted dtype, at `atol`,
    passes every element finite in both."""
    a, b, rtol = promoted
    return bool(torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True).all())


def same_float(x: float | None, y: float | None) -> bool:
    if x is None or y is None:
        return x is y
    return x == y or (math.isnan(x) and math.isnan(y))


def check_against_reference(t, r, rtol, atol, **kw) -> kernel.KernelStats:
    k = kernel.compare_cpu(t, r, rtol, atol, **kw)
    ref = reference(t, r, rtol, atol)
    ctx = (t.dtype, r.dtype, rtol, atol)
    for name in ("n_diff", "n_finite", "n_nan", "n_inf", "ref_nan", "ref_inf", "n_nonfinite_new", "all_zero",
                 "worst_index", "n_mismatch", "mismatch_max_abs_index", "mismatch_max_rel_index"):  # fmt: skip
        assert getattr(k, name) == ref[name], (name, ctx)
    for name in (
        "max_abs",
        "worst_target",
        "worst_reference",
        "max_ulp",
        "mismatch_max_abs",
        "mismatch_max_rel",
    ):
        assert same_float(getattr(k, name), ref[name]), (name, getattr(k, name), ref[name], ctx)
    assert k.bitwise_equal is False
    # min_atol: the least float64 atol that passes, exactly, under the promoted dtype's rule.
    if torch.promote_types(t.dtype, r.dtype) == F64:
        ad, rel = ref["_ad"], ref["_rel"]
        if k.min_atol == math.inf:
            assert ref["max_abs"] == math.inf, ctx
        else:
            assert passes(ad, rel, k.min_atol), ctx
            if k.min_atol > 0:
                assert not passes(ad, rel, math.nextafter(k.min_atol, 0.0)), ctx
    elif k.min_atol == math.inf:
        assert not passes_promoted(ref["_promoted"], math.inf), ctx
    else:
        assert passes_promoted(ref["_promoted"], k.min_atol), ctx
        if k.min_atol > 0:
            assert not passes_promoted(ref["_promoted"], math.nextafter(k.min_atol, 0.0)), ctx
    if ref["plain_sums_ok"] and ref["n_finite"]:
        for name in ("mean_abs", "rmse"):
            assert getattr(k, name) == pytest.approx(ref[name], rel=1e-12, abs=0.0), (name, ctx)
        if ref["rel_l2"] is not None:
            assert k.rel_l2 == pytest.approx(ref["rel_l2"], rel=1e-12, abs=0.0), ctx
        if ref["cos_sim"] is not None:
            expected = max(-1.0, min(1.0, ref["cos_sim"]))
            assert k.cos_sim == pytest.approx(expected, rel=1e-12, abs=1e-15), ctx
    return k


# ---------------------------------------------------------------- inputs


def specials(dtype: torch.dtype) -> list[float]:
    fi = torch.finfo(dtype)
    return [
        0.0, -0.0, 1.0, -1.0, 1.0 + fi.eps, fi.eps, fi.tiny, -fi.tiny, fi.tiny / 2, fi.tiny * fi.eps,
        -fi.tiny * fi.eps, fi.max, -fi.max, fi.max / 2, math.inf, -math.inf, math.nan,
    ]  # fmt: skip


def nudge(x: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """x moved by `steps` (-1, 0, +1) representable values of its own dtype."""
    up = torch.nextafter(x, torch.full_like(x, math.inf))
    down = torch.nextafter(x, torch.full_like(x, -math.inf))
    return torch.where(steps > 0, up, torch.where(steps < 0, down, x))


def adversarial(td, rd, n, rtol, atol, seed, *, with_specials=True) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs spread around the tolerance boundary (then nudged by an ulp), equal pairs, and
    (optionally) special values of each dtype: ±0, subnormals, extremes, Inf, NaN."""
    g = torch.Generator().manual_seed(seed)
    top = 3 if F16 in (td, rd) else 5  # no overflow to inf unless specials are asked for
    mag = 10.0 ** torch.randint(-6, top, (n,), generator=g).double()
    base = torch.randn(n, generator=g, dtype=F64) * mag
    r = base.to(rd)
    r64 = r.double()
    u = (torch.rand(n, generator=g, dtype=F64) * 2 - 1) * 1.5
    v = (torch.rand(n, generator=g, dtype=F64) * 2 - 1) * 1.5
    t = (r64 + u * rtol * r64.abs() + v * atol).to(td)
    t = nudge(t, torch.randint(-1, 2, (n,), generator=g))
    equal = torch.rand(n, generator=g) < 0.1
    t = torch.where(equal, r.to(td) if td.itemsize >= rd.itemsize else t, t)
    if with_specials:
        pick = torch.rand(n, generator=g) < 0.15
        st, sr = torch.tensor(specials(td), dtype=td), torch.tensor(specials(rd), dtype=rd)
        t = torch.where(pick, st[torch.randint(len(st), (n,), generator=g)], t)
        pick = torch.rand(n, generator=g) < 0.15
        r = torch.where(pick, sr[torch.randint(len(sr), (n,), generator=g)], r)
    return t, r


def tolerances(td, seed) -> list[tuple[float, float]]:
    g = np.random.default_rng(seed)
    return [
        DEFAULT_TOL[td],
        (0.0, 0.0),
        (0.5, 0.0),
        (float(10 ** g.uniform(-8, -1)), float(10 ** g.uniform(-10, -2))),
    ]


# ---------------------------------------------------------------- agreement with the reference


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_random_inputs_agree_with_reference(pair):
    td, rd = pair
    g = torch.Generator().manual_seed(11)
    n = 5000
    base = torch.randn(n, generator=g, dtype=F64) * 10.0 ** torch.randint(-3, 3, (n,), generator=g)
    r = base.to(rd)
    t = (base * (1 + 1e-3 * torch.randn(n, generator=g, dtype=F64))).to(td)
    t[5], r[7], t[9], r[9], t[11] = math.nan, math.inf, -math.inf, -math.inf, math.inf
    check_against_reference(t, r, *DEFAULT_TOL[td], block=512)


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_adversarial_inputs_agree_with_reference(pair):
    td, rd = pair
    for i, (rtol, atol) in enumerate(tolerances(td, seed=3)):
        for with_specials in (False, True):
            t, r = adversarial(
                td, rd, 3000, rtol, atol, seed=100 * i + with_specials, with_specials=with_specials
            )
            check_against_reference(t, r, rtol, atol, block=256)


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_isclose_parity_element_for_element(pair):
    # The sketch's mismatch count per pooled cell is the per-element mask when cells are 1x1.
    td, rd = pair
    for i, (rtol, atol) in enumerate(tolerances(td, seed=5)):
        t, r = adversarial(td, rd, 64 * 64, rtol, atol, seed=1000 + i)
        k = kernel.compare_cpu(t, r, rtol, atol, sketch=True, fold=(64, 64))
        expected = ~torch.isclose(t.to(torch.promote_types(td, rd)), r.to(torch.promote_types(td, rd)),
                                  rtol=rtol, atol=atol, equal_nan=True)  # fmt: skip
        assert k.sketch.cell == (1, 1)
        np.testing.assert_array_equal(
            k.sketch.cell_mismatches, expected.reshape(64, 64).numpy().astype(np.int64)
        )
        assert k.n_mismatch == int(expected.sum())


@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_isclose_at_the_exact_boundary(dtype):
    # Same-dtype pairs exactly at |a - b| == atol + rtol |b| in the dtype's own arithmetic, and
    # one representable value either side; tolerances that are not representable in the dtype.
    g = torch.Generator().manual_seed(2)
    n = 4096
    b = (torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 3, (n,), generator=g)).to(dtype)
    for rtol, atol in [(1.6e-2, 1e-5), (1e-3, 1e-5), (0.013, 3e-3), (0.1, 0.0), (0.0, 1e-3)]:
        allowed = (atol + (rtol * b).abs()).to(dtype)
        a = nudge((b + allowed).to(dtype), torch.randint(-1, 2, (n,), generator=g))
        expected = ~torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
        assert 0 < int(expected.sum()) < n
        k = kernel.compare_cpu(a, b, rtol, atol, sketch=True, fold=(64, 64))
        np.testing.assert_array_equal(k.sketch.cell_mismatches.ravel(), expected.numpy().astype(np.int64))


# ---------------------------------------------------------------- extremes


def exact_norm(xs) -> float:
    s = sum((Fraction(x) ** 2 for x in xs), Fraction(0))
    if s == 0:
        return 0.0
    k = (s.numerator.bit_length() - s.denominator.bit_length()) // 2
    return math.ldexp(math.sqrt(float(s / Fraction(2) ** (2 * k))), k)


def test_norms_of_huge_values():
    t = torch.tensor([1e200, 2e200], dtype=F64)
    r = torch.tensor([1.0000001e200, 2e200], dtype=F64)
    k = kernel.compare_cpu(t, r, 1e-7, 1e-7)
    d = [1e200 - 1.0000001e200, 0.0]
    assert k.rmse == pytest.approx(exact_norm(d) / math.sqrt(2), rel=1e-14)
    assert k.rel_l2 == pytest.approx(exact_norm(d) / exact_norm(r.tolist()), rel=1e-14)
    assert k.norm_reference == pytest.approx(exact_norm(r.tolist()), rel=1e-14)
    assert 1 - 1e-12 < k.cos_sim <= 1.0 and math.isfinite(k.rmse)
    # Huge and tiny magnitudes in one tensor, across blocks.
    g = torch.Generator().manual_seed(4)
    r = (
        torch.randn(1000, generator=g, dtype=F64)
        * 10.0 ** torch.randint(-250, 250, (1000,), generator=g).double()
    )
    t = r * (1 + 1e-9 * torch.randn(1000, generator=g, dtype=F64))
    for block in (7, 64, 4096):
        k = kernel.compare_cpu(t, r, 1e-7, 1e-7, block=block)
        d = (t - r).tolist()
        assert k.rmse == pytest.approx(exact_norm(d) / math.sqrt(1000), rel=1e-12)
        assert k.rel_l2 == pytest.approx(exact_norm(d) / exact_norm(r.tolist()), rel=1e-12)
        dot = sum(Fraction(x) * Fraction(y) for x, y in zip(t.tolist(), r.tolist(), strict=True))
        cos = float(dot / Fraction(exact_norm(t.tolist())) / Fraction(exact_norm(r.tolist())))
        assert k.cos_sim == pytest.approx(min(cos, 1.0), rel=1e-12)


def test_norms_of_subnormal_differences():
    tiny = 2.0**-1074
    t = torch.tensor([3 * tiny, 1e-310, 5e-320, 0.0], dtype=F64)
    r = torch.tensor([tiny, 1e-310 + 7 * tiny, 5e-320, tiny], dtype=F64)
    k = kernel.compare_cpu(t, r, 0.0, 0.0)
    d = [float(Fraction(a) - Fraction(b)) for a, b in zip(t.tolist(), r.tolist(), strict=True)]
    assert k.rmse == pytest.approx(exact_norm(d) / 2, rel=1e-14) and k.rmse > 0
    assert k.rel_l2 == pytest.approx(exact_norm(d) / exact_norm(r.tolist()), rel=1e-14)
    assert k.max_abs == 7 * tiny and k.worst_index == 1
    assert k.max_ulp == 7.0  # float64 ulp at a subnormal is 2^-1074
    assert k.mean_abs == pytest.approx(sum(abs(x) for x in d) / 4, rel=1e-14)


def test_difference_that_overflows_float64():
    t = torch.tensor([1.7e308, 1.0], dtype=F64)
    r = torch.tensor([-1.7e308, 1.0], dtype=F64)
    k = kernel.compare_cpu(t, r, 1e-7, 1e-7)
    assert k.max_abs == math.inf and k.worst_index == 0 and k.min_atol == math.inf
    assert (k.mean_abs, k.rmse, k.rel_l2) == (math.inf, math.inf, math.inf)
    assert k.cos_sim == -1.0
    assert k.n_mismatch == 1 and k.mismatch_max_abs == math.inf and k.mismatch_max_abs_index == 0
    assert k.max_ulp == math.inf


def test_cancellation_in_min_atol():
    # |d| = 0.5 + 7.5·2^-53, rtol·|r| = 0.5 - 2.5·2^-53: the naive difference is exact, but the
    # rule's addition rounds, so atols many ulps below it still pass.
    ta, ra = 1.5, 1 - 5 * 2**-53
    t, r = torch.tensor([ta, 0.3], dtype=F64), torch.tensor([ra, 0.3], dtype=F64)
    k = kernel.compare_cpu(t, r, 0.5, 0.0)
    naive = (ta - ra) - 0.5 * ra
    assert k.min_atol < math.nextafter(naive, 0.0)
    ad, rel = torch.tensor([ta - ra], dtype=F64), torch.tensor([0.5 * ra], dtype=F64)
    assert passes(ad, rel, k.min_atol) and not passes(ad, rel, math.nextafter(k.min_atol, 0.0))


def test_least_atol_per_element_is_exact():
    # The per-element answer behind min_atol, on random pairs, on pairs with rtol|r| a few ulps
    # below |d| (cancellation), and on subnormal and huge magnitudes.
    from core.numerics import kernel_jit

    rng = np.random.default_rng(12)
    n = 6000
    ad = np.abs(rng.standard_normal(n)) * 10.0 ** rng.integers(-300, 300, n).astype(float)
    rel = ad * rng.uniform(0, 1.2, n)
    steps = rng.integers(1, 40, n)
    rel[: n // 3] = ad[: n // 3] - steps[: n // 3] * np.spacing(ad[: n // 3])
    rel[n // 3 : n // 2] = 0.0
    ad[-100:] = rng.integers(1, 1 << 20, 100) * 2.0**-1074
    rel[-100:] = ad[-100:] * rng.uniform(0, 1, 100)
    atol = np.array([kernel_jit.least_atol(a, b) for a, b in zip(ad, rel, strict=True)])
    assert (ad <= atol + rel).all()
    below = np.nextafter(atol, 0.0)
    assert ((atol == 0) | ~(ad <= below + rel)).all()
    assert (atol < ad - rel).sum() > 100  # the naive answer is often wrong


def test_min_atol_many_candidates():
    # Every element needs almost the same atol: all are candidates, the exact answer still wins.
    g = torch.Generator().manual_seed(8)
    r = torch.full((5000,), 1.0, dtype=F64) + torch.randn(5000, generator=g, dtype=F64) * 2**-40
    t = r * (1 + 0.05) + 1e-3
    check_against_reference(t, r, 0.05, 0.0, block=512)


# ---------------------------------------------------------------- NaN / Inf


def test_nan_and_inf_placement():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0, math.inf, math.nan, math.inf, 8.0], dtype=F64)
    t = torch.tensor([1.0, math.nan, 3.0, math.inf, math.inf, math.nan, -math.inf, 8.5])
    k = check_against_reference(t, r, 1.3e-6, 1e-5)
    assert (k.n_nan, k.n_inf, k.ref_nan, k.ref_inf) == (2, 3, 1, 2)
    assert k.n_nonfinite_new == 3  # NaN and inf where r is finite, -inf where r is +inf
    assert (k.n_diff, k.n_mismatch, k.n_finite) == (4, 4, 3)
    assert (k.max_abs, k.worst_index) == (0.5, 7)
    # assert_close's message: a NaN abs diff wins, the first one.
    assert math.isnan(k.mismatch_max_abs) and k.mismatch_max_abs_index == 1


def test_the_sketch_gives_every_nan_value_as_the_canonical_one():
    """A NaN's payload is no number: on an H200 float16's NaN reached the sketch as 0x7FFFFFFFE0000000
    (CUDA converts through float32's 0x7FFFFFFF); here a float32 NaN with that payload stands in."""
    t = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float32)
    t.view(torch.int32)[1] = 0x7FFFFFFF
    r = torch.tensor([1.0, 2.5, 3.0], dtype=F64)
    for stats in (
        kernel.compare_cpu(t, r, 0.0, 0.0, sketch=True),
        compare_torch(t, r, 0.0, 0.0, sketch=True),
    ):
        sk = stats.sketch
        assert sk.topk_index.tolist()[0] == 1
        assert struct.pack("<d", sk.topk_target[0]) == struct.pack("<d", math.nan)
        assert sk.topk_reference[0] == 2.5


def test_matching_nonfinite_and_signed_zero_are_equal():
    r = torch.tensor([math.nan, math.inf, -math.inf, 0.0, 1.0], dtype=F64)
    t = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 1.0 + 2**-20])
    k = check_against_reference(t, r, 1.3e-6, 1e-5)
    assert (k.n_nonfinite_new, k.n_mismatch, k.n_diff) == (0, 0, 1)
    assert k.max_abs == 2**-20 and k.worst_index == 4 and k.mean_abs == 2**-20 / 2


def test_all_zero_and_empty():
    k = kernel.compare_cpu(torch.zeros(3, 3), torch.ones(3, 3, dtype=F64), 1e-5, 1e-5)
    assert k.all_zero and math.isnan(k.cos_sim) and k.rel_l2 == 1.0
    k = kernel.compare_cpu(torch.tensor([-0.0, 0.0]), torch.zeros(2), 1e-5, 1e-5)
    assert k.bitwise_equal is False and not k.all_zero and (k.n_diff, k.rel_l2, k.cos_sim) == (0, 0.0, 1.0)
    k = kernel.compare_cpu(torch.empty(0, 3), torch.empty(0, 3, dtype=F64), 1e-5, 1e-5, sketch=True)
    assert k.bitwise_equal and k.numel == 0


# ---------------------------------------------------------------- bitwise pass


def test_identical_tensors_take_the_bitwise_pass():
    x = torch.randn(1000)
    x[3], x[4], x[5] = math.nan, math.inf, -math.inf
    for t, r in [(x, x.clone()), (x.bfloat16(), x.bfloat16().float()), (x.half(), x.half().double()),
                 (x.bfloat16().float(), x.bfloat16()), (x.half(), x.half().float())]:  # fmt: skip
        k = kernel.compare_cpu(t, r, 1e-5, 1e-5, sketch=True)
        assert k.bitwise_equal and (k.n_nan, k.n_inf, k.ref_nan, k.ref_inf) == (1, 2, 1, 2), (
            t.dtype,
            r.dtype,
        )
        assert (k.n_diff, k.n_mismatch, k.max_abs, k.cos_sim, k.n_finite) == (0, 0, 0.0, 1.0, 997)
        assert k.sketch.n_zero == 1000 and not k.sketch.pooled_abs.any()
    values = torch.tensor([1.0, -0.5, 0.25, 3.0, 0.0])
    assert kernel.compare_cpu(values.half(), values.bfloat16(), 0, 0).bitwise_equal
    assert not kernel.compare_cpu(torch.tensor([0.1]), torch.tensor([0.1], dtype=F64), 0, 0).bitwise_equal
    assert not kernel.bitwise_census(torch.tensor([-0.0]), torch.tensor([0.0]))[0]


def test_bitwise_pass_stops_at_a_difference():
    x = torch.randn(1 << 20)
    y = x.clone()
    y[-1] += 1.0
    assert not kernel.bitwise_census(x, y)[0]
    assert not kernel.bitwise_census(x.half(), y.float())[0]
    assert kernel.bitwise_census(x[:-1].bfloat16(), y[:-1].bfloat16().double())[0]


# ---------------------------------------------------------------- determinism


def _assert_same(a: kernel.KernelStats, b: kernel.KernelStats, sums_exact: bool) -> None:
    for f in dataclasses.fields(kernel.KernelStats):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "sketch":
            for g in dataclasses.fields(kernel.Sketch):
                np.testing.assert_array_equal(getattr(x, g.name), getattr(y, g.name), err_msg=g.name)
        elif f.name in ("sum_abs", "mean_abs", "rmse", "rel_l2", "cos_sim", "norm_diff", "norm_target",
                        "norm_reference") and not sums_exact:  # fmt: skip
            assert x == pytest.approx(y, rel=1e-12), f.name
        else:
            assert same_float(x, y) if isinstance(x, float) else x == y, f.name


@pytest.mark.parametrize("pair", [(BF16, F32), (F32, F64), (F16, F16)], ids=pair_id)
def test_independent_of_threads_and_blocks(pair):
    import numba

    td, rd = pair
    rtol, atol = DEFAULT_TOL[td]
    g = torch.Generator().manual_seed(9)
    base64 = torch.randn(3001, generator=g, dtype=F64)
    r = base64.to(rd)
    t = (base64 + 3 * rtol * torch.randn(3001, generator=g, dtype=F64)).to(td)
    t[[3, 700]], r[[5, 700]], t[1500], r[1500] = math.nan, math.inf, -math.inf, -math.inf
    # Ties for the greatest |d| (and for the greatest mismatch) in different blocks.
    t[[10, 2900]], r[[10, 2900]] = 9.0, 1.0

    def run(block=64, parallel=False):
        return kernel.compare_cpu(
            t, r, rtol, atol, sketch=True, fold=(3001, 1), block=block, parallel=parallel
        )

    base = run()  # on the calling thread
    assert base.worst_index == 10 and base.mismatch_max_abs_index == 3  # the first NaN
    threads = numba.get_num_threads()
    try:
        for n in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS), numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(n)
            _assert_same(run(parallel=True), base, sums_exact=True)
    finally:
        numba.set_num_threads(threads)
    for block in (1, 7, 1000, 4096):
        _assert_same(run(block=block), base, sums_exact=False)
        _assert_same(run(block=block, parallel=True), base, sums_exact=False)


# ---------------------------------------------------------------- sketch


def test_sketch_against_torch():
    g = torch.Generator().manual_seed(6)
    r = torch.randn(300, 517, generator=g, dtype=F64)
    t = (r + 1e-3 * torch.randn(300, 517, generator=g, dtype=F64)).float()
    t[0, 0] = math.nan
    t[299, 516] = math.inf
    r[5, 5] = math.inf
    t[5, 5] = math.inf  # the same infinity: equal, 0 in the map
    t[100, 100] = float(r[100, 100]) + 5.0
    k = kernel.compare_cpu(t, r, 1.3e-6, 1e-5, sketch=True)
    s = k.sketch
    assert s.fold == (300, 517) and s.cell == (2, 3) and s.pooled_abs.shape == (150, 173)
    t64 = t.double()
    same = (t64 == r) | (t64.isnan() & r.isnan())
    dabs = torch.where(same, 0.0, (t64 - r).abs())
    pad = torch.full((300, 519), 0.0, dtype=F64)
    pad[:, :517] = dabs
    cells = pad.reshape(150, 2, 173, 3)
    expected = cells.amax(dim=(1, 3))  # amax propagates NaN
    np.testing.assert_array_equal(s.pooled_abs, expected.numpy())
    assert math.isnan(s.pooled_abs[0, 0]) and s.pooled_abs[149, 172] == math.inf
    mism = ~torch.isclose(t64, r, 1.3e-6, 1e-5, equal_nan=True)
    pad_m = torch.zeros(300, 519, dtype=torch.int64)
    pad_m[:, :517] = mism
    np.testing.assert_array_equal(s.cell_mismatches, pad_m.reshape(150, 2, 173, 3).sum(dim=(1, 3)).numpy())
    # Histogram by the top 13 bits of |d|; zeros and non-finite apart.
    bits = dabs.reshape(-1).numpy().view(np.int64)
    nonzero = bits[(bits != 0) & np.isfinite(dabs.reshape(-1).numpy())]
    assert s.n_zero == int((dabs == 0).sum()) and s.n_nonfinite == 2
    counts = np.bincount(nonzero >> 50, minlength=8192)
    np.testing.assert_array_equal(
        s.hist_counts, counts[s.hist_first_bin : s.hist_first_bin + len(s.hist_counts)]
    )
    assert s.hist_counts.sum() == len(nonzero)
    lo, hi = kernel.hist_bin_edges(s.hist_first_bin), kernel.hist_bin_edges(s.hist_first_bin + 1)
    assert lo <= np.abs(nonzero.view(np.float64)).min() < hi
    # Top-k: NaN first, then inf, then the greatest finite |d|, ties by index.
    flat = dabs.reshape(-1)
    order = sorted(range(flat.numel()), key=lambda i: (not math.isnan(flat[i]), -float(flat[i]), i))
    assert s.topk_index.tolist() == order[:16]
    assert s.topk_index[:3].tolist() == [0, 299 * 517 + 516, 100 * 517 + 100]
    assert s.topk_target[2] == float(t[100, 100]) and s.topk_reference[2] == float(r[100, 100])


def test_default_fold():
    assert kernel.default_fold((4, 5, 6)) == (20, 6)
    assert kernel.default_fold((7,)) == (1, 7)
    assert kernel.default_fold(()) == (1, 1)


# ---------------------------------------------------------------- interface


def test_rejects_what_it_cannot_compare():
    with pytest.raises(TypeError):
        kernel.compare_cpu(torch.ones(3, dtype=torch.int32), torch.ones(3), 0.0, 0.0)
    with pytest.raises(ValueError):
        kernel.compare_cpu(torch.ones(3), torch.ones(4), 0.0, 0.0)
    with pytest.raises(ValueError):
        kernel.compare_cpu(torch.ones(3), torch.ones(3), -1.0, 0.0)
    with pytest.raises(ValueError):
        kernel.compare_cpu(torch.ones(6), torch.ones(6), 0.0, 0.0, fold=(4, 2))


def test_non_contiguous_input():
    r = torch.randn(5, 4, dtype=F64)
    t = r.float()
    t[1, 3] += 1.0
    k = kernel.compare_cpu(t.t(), r.t(), 1.3e-6, 1e-5)
    assert k.worst_index == 3 * 5 + 1  # flat index in the transposed (C-ordered) view


def test_without_numba(monkeypatch):
    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` raises ImportError
    spec = importlib.util.spec_from_file_location("kernel_without_numba", kernel.__file__)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    assert module.available() is False
    with pytest.raises(RuntimeError, match="numba"):
        module.compare_cpu(torch.ones(2), torch.ones(2), 0.0, 0.0)


# ---------------------------------------------------------------- the torch port, on every device

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]


def same_bits(x, y) -> bool:
    """Floats bit for bit (any NaN alike: Python's NaN results carry no payload worth comparing)."""
    if isinstance(x, float) and isinstance(y, float):
        return (math.isnan(x) and math.isnan(y)) or struct.pack("<d", x) == struct.pack("<d", y)
    return type(x) is type(y) and x == y


def assert_port_agrees(t, r, rtol, atol, device, chunk_elems=1 << 13) -> kernel.KernelStats:
    """compare_torch on `device` (the reference moved there by it) gives the kernel's KernelStats exactly."""
    k = kernel.compare_cpu(t, r, rtol, atol, sketch=True)
    p = compare_torch(t.to(device), r, rtol, atol, sketch=True, chunk_elems=chunk_elems)
    ctx = (t.dtype, r.dtype, rtol, atol, device)
    for f in dataclasses.fields(kernel.KernelStats):
        x, y = getattr(k, f.name), getattr(p, f.name)
        if f.name != "sketch":
            assert same_bits(x, y), (f.name, x, y, ctx)
        elif x is not None:
            for g in dataclasses.fields(kernel.Sketch):
                a, b = np.asarray(getattr(x, g.name)), np.asarray(getattr(y, g.name))
                assert a.shape == b.shape and a.tobytes() == b.tobytes(), (g.name, ctx)
    return k


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_torch_port_agrees_on_adversarial_inputs(pair, device):
    td, rd = pair
    for i, (rtol, atol) in enumerate(tolerances(td, seed=3)):
        for with_specials in (False, True):
            t, r = adversarial(
                td, rd, 10000, rtol, atol, seed=100 * i + with_specials, with_specials=with_specials
            )
            assert_port_agrees(t, r, rtol, atol, device)
    # bitwise equal in the promoted dtype, with NaN, Inf and -0.0
    x = torch.tensor(specials(td) * 300, dtype=td)
    assert assert_port_agrees(x, x.to(rd), *DEFAULT_TOL[td], device).bitwise_equal or td != rd


@pytest.mark.parametrize("device", DEVICES)
def test_torch_port_agrees_on_extremes(device):
    tiny = 2.0**-1074
    g = torch.Generator().manual_seed(4)
    wide = (
        torch.randn(9000, generator=g, dtype=F64)
        * 10.0 ** torch.randint(-250, 250, (9000,), generator=g).double()
    )
    near = torch.full((5000,), 1.0, dtype=F64) + torch.randn(5000, generator=g, dtype=F64) * 2**-40
    cases = [
        (wide * (1 + 1e-9 * torch.randn(9000, generator=g, dtype=F64)), wide, 1e-7, 1e-7),  # scaled blocks
        (torch.tensor([3 * tiny, 1e-310, 5e-320, 0.0]), torch.tensor([tiny, 1e-310 + 7 * tiny, 5e-320, tiny]), 0, 0),
        (torch.tensor([1.7e308, 1.0]), torch.tensor([-1.7e308, 1.0]), 1e-7, 1e-7),  # d overflows float64
        (torch.tensor([1.5, 0.3]), torch.tensor([1 - 5 * 2**-53, 0.3]), 0.5, 0.0),  # cancellation in min_atol
        (near * 1.05 + 1e-3, near, 0.05, 0.0),  # every element a min_atol candidate
        (torch.tensor([1.0, math.nan, 3.0, math.inf, math.inf, math.nan, -math.inf, 8.5]),
         torch.tensor([1.0, 2.0, 3.0, 4.0, math.inf, math.nan, math.inf, 8.0]), 1.3e-6, 1e-5),
        (torch.tensor([math.nan, math.inf, -math.inf, -0.0, 1.0 + 2**-20]),
         torch.tensor([math.nan, math.inf, -math.inf, 0.0, 1.0]), 1.3e-6, 1e-5),
        (torch.tensor([-0.0, 0.0]), torch.zeros(2), 1e-5, 1e-5),
        (torch.zeros(3, 3), torch.ones(3, 3), 1e-5, 1e-5),
        (torch.empty(0, 3), torch.empty(0, 3), 1e-5, 1e-5),
    ]  # fmt: skip
    for t, r, rtol, atol in cases:
        for td in (F64, F32):
            if td == F32 and bool(((t.double().abs() > 1e38) & t.isfinite()).any()):
                continue
            assert_port_agrees(t.to(td), r.double(), rtol, atol, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pair", [(BF16, F32), (F32, F64), (F16, F16)], ids=pair_id)
def test_torch_port_agrees_across_chunks(pair, device):
    # Several chunks of whole blocks, a last block cut short, a 2-D fold with ties across chunks.
    td, rd = pair
    g = torch.Generator().manual_seed(13)
    base = torch.randn(523, 517, generator=g, dtype=F64)
    r, t = (
        base.to(rd),
        (base + 3 * DEFAULT_TOL[td][0] * torch.randn(523, 517, generator=g, dtype=F64)).to(td),
    )
    t[0, 5], r[300, 3], t[500, 500] = math.nan, math.inf, 1e4  # fits float16
    t[1, 2], r[1, 2], t[522, 9], r[522, 9] = 9.0, 1.0, 9.0, 1.0
    for chunk in (1 << 15, 1 << 22):
        assert_port_agrees(t, r, *DEFAULT_TOL[td], device, chunk_elems=chunk)
