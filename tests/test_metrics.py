"""Tests for core.numerics.metrics: hand-computed exact cases and cross-checks against
torch.testing.assert_close and numpy."""

from __future__ import annotations

import ast
import dataclasses
import math
import re
import struct

import numpy as np
import pytest
import torch

from core.numerics import metrics
from core.numerics.metrics import (
    DEFAULT_TOLERANCES,
    VERDICTS,
    DiffStats,
    Tolerance,
    compare,
    default_tolerance,
    explain,
    health,
    rule_dtype,
    stats_to_row,
    ulp,
    verdict,
    worst_verdict,
)

F64 = torch.float64
LOW_PRECISION = [torch.float32, torch.float16, torch.bfloat16]


def t64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def next_up(x: float, dtype: torch.dtype) -> torch.Tensor:
    v = torch.tensor([x], dtype=dtype)
    return torch.nextafter(v, torch.tensor([math.inf], dtype=dtype))


def assert_close_message(
    target: torch.Tensor, reference: torch.Tensor, rtol: float, atol: float
) -> str | None:
    """assert_close's failure message (None when it passes), with the options `compare` follows."""
    try:
        torch.testing.assert_close(target, reference, rtol=rtol, atol=atol, equal_nan=True, check_dtype=False)
    except AssertionError as e:
        return str(e)
    return None


def assert_close_passes(target: torch.Tensor, reference: torch.Tensor, rtol: float, atol: float) -> bool:
    return assert_close_message(target, reference, rtol, atol) is None


# ---------------------------------------------------------------- ULP


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (torch.float64, 2.0**-52),
        (torch.float32, 2.0**-23),
        (torch.float16, 2.0**-10),
        (torch.bfloat16, 2.0**-7),
    ],
)
def test_ulp_at_one(dtype, expected):
    assert ulp(t64([1.0]), dtype).item() == expected
    # Spacing is constant within a binade [2^k, 2^(k+1)).
    assert ulp(t64([1.999]), dtype).item() == expected
    assert ulp(t64([-1.5]), dtype).item() == expected
    assert ulp(t64([2.0]), dtype).item() == 2 * expected


@pytest.mark.parametrize(
    ("dtype", "smallest_subnormal", "smallest_normal"),
    [
        (torch.float64, 2.0**-1074, 2.0**-1022),
        (torch.float32, 2.0**-149, 2.0**-126),
        (torch.float16, 2.0**-24, 2.0**-14),
        (torch.bfloat16, 2.0**-133, 2.0**-126),
    ],
)
def test_ulp_at_zero_and_subnormals(dtype, smallest_subnormal, smallest_normal):
    x = t64([0.0, -0.0, smallest_subnormal, smallest_normal / 4, smallest_normal, 2 * smallest_normal])
    expected = [smallest_subnormal] * 5 + [2 * smallest_subnormal]
    assert ulp(x, dtype).tolist() == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ulp_matches_numpy_spacing(dtype):
    np_dtype = {torch.float32: np.float32, torch.float16: np.float16}[dtype]
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2000, generator=g) * 10.0 ** torch.randint(-6, 4, (2000,), generator=g)).to(dtype)
    expected = np.spacing(np.abs(x.numpy().astype(np_dtype))).astype(np.float64)
    np.testing.assert_array_equal(ulp(x, dtype).numpy(), expected)


def test_ulp_nonfinite_and_integer_dtype():
    assert ulp(t64([math.inf, math.nan]), torch.float32).isnan().all()
    with pytest.raises(TypeError):
        ulp(t64([1.0]), torch.int32)


@pytest.mark.parametrize("dtype", LOW_PRECISION + [torch.float64])
def test_one_ulp_apart(dtype):
    one = torch.tensor([1.0], dtype=dtype)
    assert compare(next_up(1.0, dtype), one).max_ulp == 1.0
    assert compare(one, next_up(1.0, dtype)).max_ulp == 1.0


def test_one_ulp_values_by_hand():
    bf = torch.tensor([1.0], dtype=torch.bfloat16)
    assert compare(torch.tensor([1.0078125], dtype=torch.bfloat16), bf).max_ulp == 1.0
    f16 = torch.tensor([1.0], dtype=torch.float16)
    assert compare(torch.tensor([1.0 + 2**-10], dtype=torch.float16), f16).max_ulp == 1.0
    # The unit is the spacing at the reference, upward: the float below 1.0 is half a unit away.
    below = torch.nextafter(torch.tensor([1.0]), torch.tensor([0.0]))
    assert compare(below, torch.tensor([1.0])).max_ulp == 0.5


def test_fractional_ulp_against_float64_reference():
    stats = compare(torch.tensor([1.0]), t64([1.0 + 2**-25]))
    assert stats.max_ulp == 0.25
    assert stats.max_abs == 2**-25


def test_ulp_of_subnormal_difference():
    tiny = torch.tensor([2.0**-149])  # smallest float32 subnormal
    assert compare(tiny, torch.tensor([0.0])).max_ulp == 1.0
    assert compare(torch.tensor([3 * 2.0**-149]), torch.tensor([2.0**-149])).max_ulp == 2.0


def test_bfloat16_rounding_is_within_half_ulp():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10_000, generator=g) * 10.0 ** torch.randint(-20, 20, (10_000,), generator=g)
    stats = compare(x.to(torch.bfloat16), x)
    assert 0.4 < stats.max_ulp <= 0.5


# ---------------------------------------------------------------- tolerance rule


def test_default_tolerances():
    assert default_tolerance(torch.float32) == Tolerance(rtol=1.3e-6, atol=1e-5)
    assert default_tolerance(torch.float16) == Tolerance(rtol=1e-3, atol=1e-5)
    assert default_tolerance(torch.bfloat16) == Tolerance(rtol=1.6e-2, atol=1e-5)
    assert default_tolerance(torch.float64) == Tolerance(rtol=1e-7, atol=1e-7)
    assert default_tolerance("float16") is DEFAULT_TOLERANCES["float16"]
    with pytest.raises(TypeError):
        default_tolerance(torch.int64)
    with pytest.raises(TypeError):
        DEFAULT_TOLERANCES["float32"] = Tolerance(0.0, 0.0)  # read-only mapping
    with pytest.raises(dataclasses.FrozenInstanceError):
        default_tolerance(torch.float32).rtol = 0.0  # type: ignore[misc]


def _threshold_case(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, Tolerance]:
    """Target in `dtype`, float64 reference, with differences spread around the tolerance."""
    g = torch.Generator().manual_seed(seed)
    tol = default_tolerance(dtype)
    n = 64
    target = (torch.randn(n, generator=g) * 10.0 ** torch.randint(-7, 3, (n,), generator=g)).to(dtype)
    t = target.double()
    # Scale 0 .. 0.99 of the allowance keeps every element inside; odd seeds push a few
    # elements to within ±1% of the threshold, and some seeds well past it.
    scale = torch.rand(n, generator=g, dtype=F64) * 0.99
    if seed % 2:
        k = int(torch.randint(1, 4, (1,), generator=g))
        idx = torch.randperm(n, generator=g)[:k]
        scale[idx] = 0.99 + 0.02 * torch.rand(k, generator=g, dtype=F64)
    if seed % 5 == 0:
        scale[0] = 3.0
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(F64)
    # Allowance measured at |t| approximates the one at |reference| (rtol is small).
    reference = t + sign * scale * (tol.atol + tol.rtol * t.abs())
    return target, reference, tol


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_tolerance_rule_agrees_with_assert_close(dtype):
    outcomes = set()
    for seed in range(60):
        target, reference, tol = _threshold_case(seed, dtype)
        stats = compare(target, reference)
        passes = assert_close_passes(target, reference, tol.rtol, tol.atol)
        assert (stats.n_mismatch == 0) == passes, seed
        assert verdict(stats) == ("within tolerance" if passes else "drift"), seed
        outcomes.add(passes)
    assert outcomes == {True, False}  # the cases really straddle the threshold


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_min_atol_is_tight(dtype):
    n_positive = 0
    for seed in range(60):
        target, reference, tol = _threshold_case(seed, dtype)
        stats = compare(target, reference)
        assert assert_close_passes(target, reference, tol.rtol, stats.min_atol), seed
        if stats.min_atol > 0:
            n_positive += 1
            assert not assert_close_passes(target, reference, tol.rtol, stats.min_atol * 0.99), seed
    assert n_positive > 10


def _step(x: float, k: int) -> float:
    """`x` moved by `k` float64 steps."""
    for _ in range(abs(k)):
        x = math.nextafter(x, math.inf if k > 0 else -math.inf)
    return x


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_tolerance_rule_at_the_exact_boundary(dtype):
    # atol set to within a few float64 steps of what one element needs, so that
    # |d| == atol + rtol·|reference| happens exactly and rounding decides the rest.
    g = torch.Generator().manual_seed(7)
    target = (torch.randn(30, generator=g) * 10.0 ** torch.randint(-4, 3, (30,), generator=g)).to(dtype)
    rtol = default_tolerance(dtype).rtol
    reference = target.double() * (1 + 3 * rtol * torch.randn(30, generator=g, dtype=F64))
    outcomes = set()
    for i in range(30):
        t, r = target[i : i + 1], reference[i : i + 1]
        base = float((t.double() - r).abs() - (r * rtol).abs())
        for k in range(-3, 4):
            atol = max(0.0, _step(base, k))
            passes = assert_close_passes(t, r, rtol, atol)
            assert (compare(t, r, Tolerance(rtol, atol)).n_mismatch == 0) == passes, (i, k)
            outcomes.add(passes)
    assert outcomes == {True, False}


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_min_atol_is_exactly_the_least_passing_atol(dtype):
    g = torch.Generator()
    rtol = default_tolerance(dtype).rtol
    for seed in range(20):
        g.manual_seed(seed)
        target = (torch.randn(40, generator=g) * 10.0 ** torch.randint(-4, 3, (40,), generator=g)).to(dtype)
        reference = target.double() * (1 + 5 * rtol * torch.randn(40, generator=g, dtype=F64))
        min_atol = compare(target, reference, chunk_elems=7).min_atol
        assert min_atol > 0
        assert assert_close_passes(target, reference, rtol, min_atol), seed
        assert not assert_close_passes(target, reference, rtol, math.nextafter(min_atol, 0.0)), seed


def test_min_atol_where_naive_subtraction_rounds_down():
    # Elements where fl(fl(|d| - rel) + rel) < |d|: the naive formula would not pass assert_close.
    rng = np.random.default_rng(9)
    t = rng.standard_normal(20_000)
    r = t + rng.standard_normal(20_000) * 0.1
    rtol = 0.05
    ad, rel = np.abs(t - r), np.abs(r * rtol)
    naive = np.maximum(ad - rel, 0.0)
    bad = np.nonzero(ad > naive + rel)[0]
    assert bad.size > 10
    for i in bad[:10]:
        target, reference = t64([t[i]]), t64([r[i]])
        min_atol = compare(target, reference, Tolerance(rtol, 0.0)).min_atol
        assert min_atol > naive[i]
        assert assert_close_passes(target, reference, rtol, min_atol)
        assert not assert_close_passes(target, reference, rtol, math.nextafter(min_atol, 0.0))


def test_min_atol_under_cancellation():
    # |d| = 0.5 + 7.5·2^-53 and rtol·|r| = 0.5 - 2.5·2^-53: the naive difference 15·2^-53 is
    # exact, but the addition in the rule rounds, so atols many ulps below it still pass.
    tol = Tolerance(rtol=0.5, atol=0.0)
    ta, ra = 1.5, 1 - 5 * 2**-53
    naive = (ta - ra) - 0.5 * ra
    target, reference = t64([ta]), t64([ra])
    min_atol = compare(target, reference, tol).min_atol
    assert min_atol < math.nextafter(naive, 0.0)
    assert assert_close_passes(target, reference, tol.rtol, min_atol)
    assert not assert_close_passes(target, reference, tol.rtol, math.nextafter(min_atol, 0.0))
    # A second element whose naive need is a little smaller than the first's, but whose exact
    # need is larger: it must not be overlooked.
    tb = naive - 16 * 2**-62
    assert compare(t64([ta, tb]), t64([ra, 0.0]), tol, chunk_elems=2).min_atol == tb


def test_mismatch_count_with_explicit_tolerance():
    reference = t64([1.0, 2.0, 3.0, 4.0])
    target = torch.tensor([1.0, 2.1, 3.0, 4.5])
    stats = compare(target, reference, Tolerance(rtol=0.0, atol=0.2))
    assert (stats.n_mismatch, stats.n_diff) == (1, 2)
    assert (stats.rtol, stats.atol) == (0.0, 0.2)
    assert stats.min_atol == pytest.approx(0.5)


# ---------------------------------------------------------------- the rule is assert_close's, in its dtype

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def test_rule_dtype_is_the_promoted_dtype():
    assert rule_dtype(BF16, BF16) == BF16
    assert rule_dtype(F16, BF16) == F32
    assert rule_dtype(BF16, F32) == F32
    assert rule_dtype(F32, F64) == F64
    # No promotion or arithmetic for float8 in torch: float64 holds it exactly.
    assert rule_dtype(torch.float8_e4m3fn, F16) == F64
    assert rule_dtype(torch.float8_e4m3fn, torch.float8_e4m3fn) == F64


@pytest.mark.parametrize(
    ("dtype", "target", "reference"),
    [
        (BF16, -0.2392578125, -0.2431640625),  # the pair from the issue
        (F16, -0.05096435546875, -0.051025390625),
        (F32, 0.7899027466773987, 0.7898917198181152),
    ],
)
def test_same_dtype_pair_is_judged_in_that_dtype(dtype, target, reference):
    t, r = torch.tensor([target], dtype=dtype), torch.tensor([reference], dtype=dtype)
    tol = default_tolerance(dtype)
    # In float64 the difference exceeds the bound; rounded as `dtype` rounds, it does not.
    assert abs(target - reference) > tol.atol + tol.rtol * abs(reference)
    assert assert_close_passes(t, r, tol.rtol, tol.atol)
    stats = compare(t, r)
    assert (stats.n_mismatch, verdict(stats)) == (0, "within tolerance")
    assert stats.max_abs == abs(target - reference)  # the statistics stay float64
    assert stats.min_atol <= tol.atol  # consistent with the verdict
    assert assert_close_passes(t, r, tol.rtol, stats.min_atol)
    assert not assert_close_passes(t, r, tol.rtol, math.nextafter(stats.min_atol, 0.0))


def test_greatest_abs_diff_is_over_mismatched_elements():
    target, reference = torch.tensor([1000.001, 1e-4]), t64([1000.0, 0.0])
    stats = compare(target, reference)
    # Element 0 differs most but passes (|d| ≈ 9.8e-4 <= 1e-5 + 1.3e-6 · 1000); element 1 fails.
    assert (stats.max_abs, stats.worst_index) == (float(target[0]) - 1000.0, (0,))
    assert stats.n_mismatch == 1
    assert (stats.mismatch_max_abs, stats.mismatch_index) == (float(target[1]), (1,))
    assert (stats.mismatch_target, stats.mismatch_reference) == (float(target[1]), 0.0)
    assert explain(stats).startswith(
        "Mismatched elements: 1 / 2 (50.0%) · greatest abs diff 0.0001 at (1) (target 0.0001, reference 0) · "
    )
    message = assert_close_message(target, reference, stats.rtol, stats.atol)
    assert (
        message is not None and f"Greatest absolute difference: {float(target[1])} at index (1,)" in message
    )


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_greatest_mismatch_nan_first_then_first_of_ties(chunk):
    # assert_close's message: NaN beats every number, and the first of equal differences wins.
    nan, inf = math.nan, math.inf
    reference = torch.tensor([[1.0, 2.0, 3.0], [4.0, inf, 6.0], [7.0, 2.0, 9.0]])
    target = torch.tensor([[1.0, 5.0, 3.0], [7.0, 5.0, nan], [7.0, nan, 9.0]])
    stats = compare(target, reference, chunk_elems=chunk)
    assert (stats.n_mismatch, stats.mismatch_index) == (5, (1, 2))
    assert math.isnan(stats.mismatch_max_abs) and stats.mismatch_reference == 6.0
    text = explain(stats)
    assert (
        "Mismatched elements: 5 / 9 (55.6%) · greatest abs diff nan at (1, 2) (target nan, reference 6)"
        in text
    )
    assert "Greatest absolute difference: nan at index (1, 2)" in str(
        assert_close_message(target, reference, 0, 0)
    )
    # Without NaN: the 3s at (0, 1) and (1, 0) tie, the inf at (1, 1) beats them.
    target[1, 2], target[2, 1] = 6.0, 2.0
    stats = compare(target, reference, chunk_elems=chunk)
    assert (stats.mismatch_max_abs, stats.mismatch_index) == (inf, (1, 1))
    target[1, 1] = inf
    stats = compare(target, reference, chunk_elems=chunk)
    assert (stats.mismatch_max_abs, stats.mismatch_index) == (3.0, (0, 1))
    assert stats.worst_index == (0, 1)


@pytest.mark.parametrize(
    ("target_dtype", "reference_dtype"), [(BF16, BF16), (F16, F16), (F32, F32), (F16, BF16), (BF16, F32)]
)
def test_min_atol_is_exact_under_the_promoted_rule(target_dtype, reference_dtype):
    g = torch.Generator()
    rtol = default_tolerance(target_dtype).rtol
    for seed in range(12):
        g.manual_seed(seed)
        values = torch.randn(40, generator=g, dtype=F64) * 10.0 ** torch.randint(-4, 3, (40,), generator=g)
        target = values.to(target_dtype)
        reference = (values * (1 + 5 * rtol * torch.randn(40, generator=g, dtype=F64))).to(reference_dtype)
        min_atol = compare(target, reference, chunk_elems=7).min_atol
        assert min_atol > 0
        assert assert_close_passes(target, reference, rtol, min_atol), seed
        assert not assert_close_passes(target, reference, rtol, math.nextafter(min_atol, 0.0)), seed


def _fuzz_values(rng: np.random.Generator, n: int, dtype: torch.dtype) -> torch.Tensor:
    """n values of `dtype`: ordinary, ±0, subnormal, near the maximum, tiny, NaN, ±Inf, any magnitude."""
    info = torch.finfo(dtype)
    kind = rng.integers(0, 8, n)
    sign = rng.choice([-1.0, 1.0], n)
    v = rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n)
    v = np.where(kind == 1, 0.0 * sign, v)
    v = np.where(kind == 2, sign * info.tiny * rng.uniform(0, 1, n), v)
    v = np.where(kind == 3, sign * info.max * rng.uniform(0.4, 1, n), v)
    v = np.where(kind == 4, sign * info.tiny * rng.uniform(1, 4, n), v)
    v = np.where(kind == 5, np.nan, v)
    v = np.where(kind == 6, sign * np.inf, v)
    v = np.where(kind == 7, sign * 10.0 ** rng.uniform(-45, 45, n), v)
    return torch.from_numpy(v).to(dtype)


@np.errstate(all="ignore")  # inf - inf and the like while building references
def _fuzz_case(
    rng: np.random.Generator, target_dtype: torch.dtype, reference_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, Tolerance]:
    # Half the cases are short and near the tolerance boundary, so that both outcomes occur.
    near = rng.random() < 0.5
    n = int(rng.integers(1, 6 if near else 40))
    target = _fuzz_values(rng, n, target_dtype)
    if near:
        if rng.random() < 0.5:  # values both dtypes hold, so that a coarse reference can pass
            target = target.to(reference_dtype).to(target_dtype)
        target = torch.where(target.isfinite(), target, 1.5)
    tol = default_tolerance(target_dtype)
    if rng.random() < 0.3:
        tol = Tolerance(rtol=float(10 ** rng.uniform(-8, 0)), atol=float(10 ** rng.uniform(-12, 0)))
    elif rng.random() < 0.05:
        tol = Tolerance(rtol=0.0, atol=0.0)
    t = target.double().numpy()
    how = rng.choice([0, 1, 2, 6, 7], n) if near else rng.integers(0, 8, n)
    sign = rng.choice([-1.0, 1.0], n)
    r = np.where(how == 1, t + sign * rng.uniform(0.9, 1.1, n) * (tol.atol + tol.rtol * np.abs(t)), t)
    r = np.where(how == 2, t * (1 + tol.rtol * rng.uniform(-3, 3, n)), r)
    r = np.where(how == 3, _fuzz_values(rng, n, reference_dtype).double().numpy(), r)
    r = np.where(how == 4, -t, r)
    r = np.where(how == 5, np.where(rng.random(n) < 0.5, np.nan, sign * np.inf), r)
    # how == 7: the whole steps of the reference's dtype nearest the allowance, ±1, where the
    # rounding of the rule's dtype decides.
    step = ulp(target, reference_dtype).numpy()
    k = np.round((tol.atol + tol.rtol * np.abs(t)) / step) + rng.integers(-1, 2, n)
    r = np.where(how == 7, t + sign * k * step, r)
    reference = torch.from_numpy(r).to(reference_dtype)
    # how == 6: up to 4 steps of the reference's dtype away from the target's value.
    steps = torch.from_numpy(np.where(how == 6, rng.integers(-4, 5, n), 0))
    for k in range(4):
        up = torch.nextafter(reference, torch.tensor(math.inf, dtype=reference_dtype))
        down = torch.nextafter(reference, torch.tensor(-math.inf, dtype=reference_dtype))
        reference = torch.where(steps > k, up, torch.where(steps < -k, down, reference))
    if rng.random() < 0.3:  # 2-D, for the index format
        target, reference = torch.stack([target, target.flip(0)]), torch.stack([reference, reference])
    return target, reference, tol


def test_pass_fail_and_greatest_difference_equal_assert_close_fuzz():
    """n_mismatch, the verdict and the explanation's greatest difference are assert_close's, for
    every pair of float dtypes, on 1,600 seeded random and adversarial tensor pairs."""
    rng = np.random.default_rng(12)
    for target_dtype in FLOATS:
        for reference_dtype in FLOATS:
            outcomes = set()
            for case in range(100):
                target, reference, tol = _fuzz_case(rng, target_dtype, reference_dtype)
                where = (target_dtype, reference_dtype, case, target, reference, tol)
                stats = compare(target, reference, tol)
                message = assert_close_message(target, reference, tol.rtol, tol.atol)
                passes = message is None
                outcomes.add(passes)
                assert (stats.n_mismatch == 0) == passes, where
                if stats.all_zero:  # broken by design (a dead output), whatever the tolerance
                    assert verdict(stats) == "broken", where
                else:
                    assert (verdict(stats) in ("identical", "within tolerance")) == passes, where
                if target.isfinite().all() and reference.isfinite().all():
                    assert (stats.min_atol <= tol.atol) == passes, where
                if message is None:
                    assert stats.mismatch_index is None, where
                    continue
                count = re.search(r"Mismatched elements: (\d+) /", message)
                greatest = re.search(r"Greatest absolute difference: (\S+) at index (\(.*?\))", message)
                assert count and greatest, message
                value, index = float(greatest[1]), ast.literal_eval(greatest[2])
                assert stats.n_mismatch == int(count[1]), where
                assert stats.mismatch_index == index, where
                assert stats.mismatch_max_abs is not None, where
                assert (
                    stats.mismatch_max_abs == value
                    or math.isnan(stats.mismatch_max_abs)
                    and math.isnan(value)
                )
                if not stats.all_zero:
                    assert f"greatest abs diff {value:.3g} at {metrics._fmt_tuple(index)} (" in explain(stats)
            assert outcomes == {True, False}, (target_dtype, reference_dtype)


# ---------------------------------------------------------------- float64 extremes


def test_differences_that_overflow_float64():
    big = 1.7e308
    stats = compare(t64([big, 1.0]), t64([-big, 1.0]))  # raised RuntimeError before
    assert (stats.max_abs, stats.worst_index, stats.n_mismatch, verdict(stats)) == (
        math.inf,
        (0,),
        1,
        "drift",
    )
    assert stats.mean_abs == big  # (3.4e308 + 0) / 2: finite, though the sum is not
    assert stats.rmse == math.inf  # sqrt(3.4e308² / 2) ≈ 2.4e308 is beyond float64
    assert (stats.rel_l2, stats.cos_sim) == (2.0, -1.0)
    assert stats.max_ulp == math.ldexp(big, 1 - 971)  # |d| / 2^971, the spacing at 1.7e308
    assert stats.min_atol == math.inf
    assert (stats.mismatch_max_abs, stats.mismatch_index) == (math.inf, (0,))
    assert explain(stats).endswith("no atol passes at rtol 1e-07: a difference overflows float64")
    # The same in float16, whose differences overflow from ±65504: no tolerance passes it.
    half = torch.tensor([60000.0, 1.0], dtype=F16)
    stats = compare(half, -half, Tolerance(rtol=10.0, atol=1e6))
    assert (stats.n_mismatch, stats.min_atol, stats.mismatch_index) == (1, math.inf, (0,))
    assert stats.max_abs == 120000.0  # the statistics are float64
    assert not assert_close_passes(half, -half, 10.0, 1e6)


def test_norms_do_not_overflow_or_underflow():
    a, b = 1.0000001e200, 2e200
    stats = compare(t64([1e200, b]), t64([a, b]))
    d = 1e200 - a  # exact (Sterbenz)
    assert stats.rmse == pytest.approx(abs(d) / math.sqrt(2.0), rel=1e-15)
    assert stats.rel_l2 == pytest.approx(abs(d) / math.hypot(a, b), rel=1e-15)
    assert stats.cos_sim == pytest.approx(1.0, abs=1e-14)
    # Subnormals: d = (-3, -4)·s and r = (6, 8)·s, so ‖d‖ = 5s and ‖r‖ = 10s.
    s = 2.0**-1074
    stats = compare(t64([3 * s, 4 * s]), t64([6 * s, 8 * s]))
    assert (stats.rel_l2, stats.cos_sim) == (0.5, 1.0)
    assert stats.rmse == 4 * s  # 5s / sqrt(2) = 3.54s, rounded to the subnormal grid
    assert stats.mean_abs == 4 * s  # 3.5s, rounded to even
    assert (stats.max_ulp, stats.min_atol) == (4.0, 4 * s)


def test_extremes_in_every_dtype_do_not_raise():
    for dtype in FLOATS:
        info = torch.finfo(dtype)
        values = [info.max, -info.max, info.tiny, info.tiny * info.eps, -0.0, math.inf, math.nan, 1.0]
        x = torch.tensor(values, dtype=dtype)
        for other in FLOATS:
            y = torch.tensor(values[::-1], dtype=other)
            for target, reference in ((x, y), (x, -y), (x, y.flip(0)), (x[:4], -y[:4])):
                stats = compare(target, reference, chunk_elems=3)
                assert (stats.n_mismatch == 0) == assert_close_passes(
                    target, reference, stats.rtol, stats.atol
                )


# ---------------------------------------------------------------- metrics vs numpy


def test_metrics_against_numpy():
    g = torch.Generator().manual_seed(3)
    reference = torch.randn(6, 7, generator=g, dtype=F64)
    target = (reference + 1e-3 * torch.randn(6, 7, generator=g, dtype=F64)).float()
    target[4, 2] = float(reference[4, 2]) + 0.5  # a clear worst element

    r = reference.numpy()
    d = target.double().numpy() - r
    stats = compare(target, reference)

    assert stats.max_abs == pytest.approx(np.abs(d).max(), rel=1e-12)
    assert stats.mean_abs == pytest.approx(np.abs(d).mean(), rel=1e-12)
    assert stats.rmse == pytest.approx(np.sqrt((d**2).mean()), rel=1e-12)
    assert stats.rel_l2 == pytest.approx(np.linalg.norm(d) / np.linalg.norm(r), rel=1e-12)
    tn = target.double().numpy().ravel()
    cos = tn @ r.ravel() / (np.linalg.norm(tn) * np.linalg.norm(r))
    assert stats.cos_sim == pytest.approx(cos, rel=1e-12)
    assert stats.worst_index == (4, 2) == np.unravel_index(np.abs(d).argmax(), d.shape)
    assert stats.worst_target == float(target[4, 2])
    assert stats.worst_reference == float(reference[4, 2])
    assert (stats.numel, stats.shape, stats.ref_shape) == (42, (6, 7), (6, 7))
    assert (stats.target_dtype, stats.reference_dtype) == ("float32", "float64")
    assert verdict(stats) == "drift"


def test_metrics_small_exact():
    stats = compare(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), t64([[1.0, 2.0], [3.0, 2.0]]))
    assert stats.max_abs == 2.0
    assert stats.mean_abs == 0.5
    assert stats.rmse == 1.0
    # ‖d‖/‖r‖ = 2/√18: within one ulp of the exact value (the kernel divides two rounded norms)
    assert abs(stats.rel_l2 - math.sqrt(4.0 / 18.0)) <= math.ulp(math.sqrt(4.0 / 18.0))
    assert stats.worst_index == (1, 1)


def test_rel_l2_and_cos_sim_with_zero_reference():
    zeros = torch.zeros(3, dtype=F64)
    stats = compare(torch.tensor([0.0, 1.0, 0.0]), zeros)
    assert stats.rel_l2 == math.inf
    assert math.isnan(stats.cos_sim)
    # Both zero but not bitwise (signed zero): rel_l2 0, cos_sim 1.
    stats = compare(torch.tensor([-0.0, 0.0, 0.0]), zeros)
    assert (stats.rel_l2, stats.cos_sim) == (0.0, 1.0)


def test_cos_sim_is_clamped():
    # Equal values (a signed zero defeats the fast path): s / (sqrt(s)·sqrt(s)) rounds above 1.
    reference = torch.cat([torch.full((10,), 0.1, dtype=F64), t64([0.0])])
    target = reference.clone()
    target[-1] = -0.0
    s = float((reference * reference).sum())
    assert s / (math.sqrt(s) * math.sqrt(s)) > 1.0
    assert compare(target, reference).cos_sim == 1.0
    assert compare(-target, reference).cos_sim == -1.0


# ---------------------------------------------------------------- NaN / Inf


def test_nan_in_target_is_broken():
    reference = t64([1.0, 2.0, 3.0, 4.0])
    target = torch.tensor([1.0, math.nan, 3.0, math.inf])
    stats = compare(target, reference)
    assert (stats.n_nan, stats.n_inf, stats.ref_nan, stats.ref_inf) == (1, 1, 0, 0)
    assert stats.n_nonfinite_new == 2
    assert stats.n_mismatch == 2
    assert stats.max_abs == 0.0 and stats.worst_index is None  # finite elements agree
    assert verdict(stats) == "broken"
    assert explain(stats).startswith(
        "1 NaN / 1 Inf where the reference is finite · Mismatched elements: 2 / 4"
    )


def test_matching_nonfinite_counts_as_equal():
    reference = t64([math.nan, math.inf, -math.inf, 1.0])
    target = torch.tensor([math.nan, math.inf, -math.inf, 1.0 + 2**-20])
    stats = compare(target, reference)
    assert (stats.n_nan, stats.n_inf, stats.ref_nan, stats.ref_inf) == (1, 2, 1, 2)
    assert (stats.n_nonfinite_new, stats.n_mismatch, stats.n_diff) == (0, 0, 1)
    assert stats.max_abs == 2**-20 and stats.worst_index == (3,)
    assert stats.mean_abs == 2**-20  # over the one element finite in both
    assert verdict(stats) == "within tolerance"


def test_differing_nonfinite_is_new():
    reference = t64([math.inf, math.nan, math.inf, 1.0])
    target = torch.tensor([-math.inf, math.inf, 5.0, 1.0])
    stats = compare(target, reference)
    assert stats.n_nonfinite_new == 2  # -inf vs inf, inf vs NaN; finite vs inf is a plain mismatch
    assert stats.n_mismatch == 3
    assert verdict(stats) == "broken"
    assert "2 NaN/Inf where the reference differs" in explain(stats)


def test_finite_target_against_infinite_reference_is_drift():
    stats = compare(torch.tensor([1.0, 2.0]), t64([1.0, math.inf]))
    assert (stats.n_mismatch, stats.n_nonfinite_new) == (1, 0)
    assert verdict(stats) == "drift"


# ---------------------------------------------------------------- bitwise fast path


def test_identical_tensors():
    x = torch.randn(5, 6)
    x[0, 0] = math.nan
    stats = compare(x, x.clone())
    assert stats.bitwise_equal
    assert (stats.max_abs, stats.max_ulp, stats.min_atol, stats.cos_sim) == (0.0, 0.0, 0.0, 1.0)
    assert (stats.n_diff, stats.n_mismatch, stats.n_nan, stats.ref_nan) == (0, 0, 1, 1)
    assert stats.worst_index is None
    assert verdict(stats) == "identical"
    assert explain(stats) == "bitwise identical"


def test_bitwise_fast_path_skips_float64_math(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("slow path used")

    monkeypatch.setattr(metrics.ChunkAccumulator, "add", fail)
    x = torch.randn(100, dtype=torch.float16)
    assert compare(x, x.clone(), chunk_elems=7).bitwise_equal


def test_signed_zero_is_not_bitwise_but_within_tolerance():
    stats = compare(torch.tensor([-0.0, 1.0]), torch.tensor([0.0, 1.0]))
    assert not stats.bitwise_equal
    assert (stats.n_diff, stats.n_mismatch, stats.max_abs) == (0, 0, 0.0)
    assert verdict(stats) == "within tolerance"
    assert explain(stats).startswith("within tolerance")


def test_bitwise_equal_across_dtypes_casts_to_wider():
    values = [1.0, -0.5, 0.25, 3.0, 0.0]  # exactly representable in every format
    assert compare(torch.tensor(values), t64(values)).bitwise_equal
    assert compare(
        torch.tensor(values, dtype=torch.float16), torch.tensor(values, dtype=torch.bfloat16)
    ).bitwise_equal
    assert not compare(torch.tensor([0.1]), t64([0.1])).bitwise_equal


def test_empty_tensors_are_identical():
    stats = compare(torch.empty(0, 3), torch.empty(0, 3, dtype=F64))
    assert verdict(stats) == "identical" and not stats.all_zero


# ---------------------------------------------------------------- chunking


def _assert_same_stats(a: DiffStats, b: DiffStats) -> None:
    for field in dataclasses.fields(DiffStats):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, float) and not math.isnan(x):
            assert x == pytest.approx(y, rel=1e-12, abs=0.0), field.name
        elif isinstance(x, float):
            assert math.isnan(y), field.name
        else:
            assert x == y, field.name


@pytest.mark.parametrize("target_dtype", LOW_PRECISION)
def test_chunking_invariance(target_dtype):
    g = torch.Generator().manual_seed(5)
    reference = torch.randn(13, 17, generator=g, dtype=F64)
    target = (reference + 1e-2 * torch.randn(13, 17, generator=g, dtype=F64)).to(target_dtype)
    # Non-finite values, and a tie for the greatest difference across chunk borders.
    target[0, 1] = math.nan
    reference[2, 3] = math.inf
    target[5, 5] = math.inf
    reference[5, 5] = math.inf
    target[3, 0], reference[3, 0] = 9.0, 1.0
    target[11, 16], reference[11, 16] = 9.0, 1.0
    default = compare(target, reference)
    for chunk in (1, 7, 50, 220, 221, 10_000):
        _assert_same_stats(compare(target, reference, chunk_elems=chunk), default)
    assert default.worst_index == (3, 0)  # the first of the tied elements


# ---------------------------------------------------------------- broken cases


def test_shape_mismatch_does_not_raise():
    stats = compare(torch.zeros(4, 8), torch.ones(8, 4, dtype=F64))
    assert stats.shape_mismatch and not stats.bitwise_equal
    assert math.isnan(stats.max_abs) and math.isnan(stats.cos_sim)
    assert verdict(stats) == "broken"
    assert explain(stats) == "shape mismatch: target (4, 8) vs reference (8, 4)"
    row = stats_to_row(stats)
    assert (row["shape"], row["ref_shape"], row["verdict"]) == ("4x8", "8x4", "broken")


def test_all_zero_target_is_broken():
    stats = compare(torch.zeros(3, 3), torch.ones(3, 3, dtype=F64))
    assert stats.all_zero
    assert verdict(stats) == "broken"
    assert explain(stats) == "target is all zeros, reference is not"
    # Both zero is not "all zero" breakage.
    assert not compare(torch.zeros(3), torch.zeros(3, dtype=F64)).all_zero


def test_integer_and_bool_tensors_compare_exactly():
    ids = torch.arange(512, dtype=torch.int64).reshape(1, 512)
    same = compare(ids, ids.clone())
    assert same.bitwise_equal and verdict(same) == "identical" and same.n_mismatch == 0
    other = ids.clone()
    other[0, 7] = 9
    other[0, 300] = 0
    s = compare(other, ids, Tolerance(rtol=0.5, atol=3.0))  # a float tolerance does not loosen ints
    assert (s.n_mismatch, s.max_abs, s.worst_index) == (2, 300.0, (0, 300))
    assert (s.rtol, s.atol) == (0.0, 0.0) and verdict(s) == "drift"
    mask = torch.tensor([True, False, True])
    assert verdict(compare(mask, mask.clone())) == "identical"
    assert compare(mask, torch.tensor([True, True, True])).n_mismatch == 1
    assert compare(torch.ones(3, dtype=torch.int32), torch.ones(3, dtype=torch.int64)).n_mismatch == 0
    # An integer against a floating tensor is compared as floating, never a TypeError.
    assert compare(torch.ones(3, dtype=torch.int32), torch.ones(3)).n_mismatch == 0
    assert compare(torch.ones(3), torch.ones(3, dtype=torch.int64)).n_mismatch == 0


# ---------------------------------------------------------------- verdicts and text


def test_worst_verdict():
    assert worst_verdict(["identical", "drift", "within tolerance"]) == "drift"
    assert worst_verdict(iter(["identical"])) == "identical"
    assert worst_verdict(VERDICTS) == "broken"
    with pytest.raises(ValueError):
        worst_verdict([])
    with pytest.raises(ValueError):
        worst_verdict(["fine"])


def test_explain_drift_format():
    reference = torch.ones(64, 64, dtype=F64)
    target = torch.ones(64, 64)
    target[3, 17] = 1.0123
    target[10, 10] = 1.001
    target[20, 1] = 1.0001
    stats = compare(target, reference)
    assert verdict(stats) == "drift"
    text = explain(stats)
    assert text.startswith("Mismatched elements: 3 / 4096 (0.1%) · greatest abs diff 0.0123 at (3, 17) ")
    assert "(target 1.01, reference 1)" in text
    assert f"greatest ulp diff {stats.max_ulp:.3g}" in text
    assert "needs atol ≥ 0.0123 at rtol 1.3e-06" in text


def test_explain_within_tolerance():
    stats = compare(torch.tensor([1.0]), t64([1.0 + 2**-25]))
    assert explain(stats) == f"within tolerance (max abs {2**-25:.3g}, 0.25 ulp)"


def test_stats_to_row_is_flat():
    stats = compare(torch.tensor([[1.0, 2.0], [3.0, 5.0]]), t64([[1.0, 2.0], [3.0, 4.0]]))
    row = stats_to_row(stats)
    field_names = {f.name for f in dataclasses.fields(DiffStats)}
    assert set(row) == field_names | {"verdict", "explanation"}
    assert row["worst_index"] == "(1, 1)" and row["shape"] == "2x2"
    assert row["verdict"] == "drift" and row["explanation"] == explain(stats)
    assert all(not isinstance(v, (tuple, list, dict)) for v in row.values())
    assert stats_to_row(compare(torch.ones(2), torch.ones(2)))["worst_index"] is None


# ---------------------------------------------------------------- health


def test_health_counts_and_all_zero():
    x = torch.randn(2, 3, 5)
    x[0, 1, 2] = math.nan
    x[1, 0, 0] = math.inf
    x[1, 2, 4] = math.nan
    h = health(x)
    assert (h.n_nan, h.n_inf, h.all_zero, h.identical_rows) == (2, 1, False, False)
    assert health(torch.zeros(4, 8)).all_zero


def test_health_identical_rows():
    row = torch.randn(16)
    assert health(row.expand(2, 3, 16)).identical_rows
    assert not health(row.unsqueeze(0)).identical_rows  # a single row
    varied = row.repeat(6, 1)
    varied[5, 15] += 1.0
    assert not health(varied).identical_rows
    with_nan = row.clone()
    with_nan[0] = math.nan
    assert health(with_nan.repeat(3, 1)).identical_rows  # NaN counts as equal to NaN


def test_non_contiguous_and_grad_inputs():
    reference = torch.randn(5, 4, dtype=F64)
    target = reference.float().requires_grad_()
    with torch.no_grad():
        target[1, 3] += 1.0
    stats = compare(target.t(), reference.t())  # a transposed view: not contiguous
    assert stats.worst_index == (3, 1) and stats.shape == (4, 5)


def test_tolerance_must_be_non_negative():
    with pytest.raises(ValueError):
        Tolerance(rtol=-1e-3, atol=0.0)
    with pytest.raises(ValueError):
        Tolerance(rtol=0.0, atol=math.nan)


NARROW_RULE_PAIRS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float16),
]


@pytest.mark.parametrize("pair", NARROW_RULE_PAIRS, ids=lambda p: "-".join(str(d)[6:] for d in p))
def test_kernel_min_atol_in_a_narrow_rule_is_the_chunked_paths(pair, monkeypatch):
    # Under a float32/bfloat16/float16 rule, isclose rounds the difference, rtol·|r|, atol and their
    # sum to that dtype: the kernel finds the least passing atol in that same rule, exactly as the
    # chunked path's bisection with torch.isclose itself does.
    t_dtype, r_dtype = pair
    rule = torch.promote_types(t_dtype, r_dtype)
    g = torch.Generator()
    for seed in range(12):
        g.manual_seed(seed)
        n = 3000
        scale = 10.0 ** torch.randint(-6, 4, (n,), generator=g)
        reference = (torch.randn(n, generator=g, dtype=F64) * scale).to(r_dtype)
        tol = default_tolerance(t_dtype)
        # differences around rtol·|r| (a few ulps either side), so rounding in the rule decides
        k = torch.randint(-4, 5, (n,), generator=g).double()
        target = (reference.double() * (1 + tol.rtol * (1 + k * 2.0**-8))).to(t_dtype)
        if seed % 3 == 0:
            target[::97] = math.nan
        kernel_atol = compare(target, reference, tol).min_atol
        monkeypatch.setattr(metrics, "_kernel_applies", lambda t, r: False)
        chunked_atol = compare(target, reference, tol, chunk_elems=1000).min_atol
        monkeypatch.undo()
        assert kernel_atol == chunked_atol, (seed, kernel_atol, chunked_atol)
        a, b = target.to(rule), reference.to(rule)
        finite = a.isfinite() & b.isfinite()
        a, b = a[finite], b[finite]
        assert torch.isclose(a, b, rtol=tol.rtol, atol=kernel_atol, equal_nan=True).all(), seed
        if kernel_atol > 0:
            below = math.nextafter(kernel_atol, 0.0)
            assert not torch.isclose(a, b, rtol=tol.rtol, atol=below, equal_nan=True).all(), seed


def _same_measurement(a: tuple, b: tuple) -> None:
    """Two `measure` results hold the same row (floats bit for bit) and the same sketch."""
    (sa, ka), (sb, kb) = a, b
    for f in dataclasses.fields(sa):
        x, y = getattr(sa, f.name), getattr(sb, f.name)
        if isinstance(x, float) and isinstance(y, float):
            assert (math.isnan(x) and math.isnan(y)) or struct.pack("<d", x) == struct.pack("<d", y), f.name
        else:
            assert x == y, (f.name, x, y)
    assert (ka is None) == (kb is None)
    if ka is not None:
        for f in dataclasses.fields(ka):
            x, y = getattr(ka, f.name), getattr(kb, f.name)
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), f.name


def _measure_cases():
    g = torch.Generator().manual_seed(21)
    for td, rd in [
        (F64, F64),
        (torch.float32, F64),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float16),
    ]:
        r = (
            torch.randn(97, 131, generator=g, dtype=F64)
            * 10.0 ** torch.randint(-3, 3, (97, 131), generator=g)
        ).to(rd)
        t = (
            r.double() * (1 + 4 * default_tolerance(td).rtol * torch.randn(97, 131, generator=g, dtype=F64))
        ).to(td)
        t[3, 4], r[5, 6], t[7, 8], r[7, 8], t[9, 10], r[9, 10] = (
            math.nan,
            math.inf,
            -math.inf,
            -math.inf,
            -0.0,
            0.0,
        )
        yield t, r, default_tolerance(td)
        yield r.to(td), r, default_tolerance(td)  # a rounding (bitwise equal where td is rd)


def test_without_numba_the_torch_pass_gives_the_kernels_numbers(monkeypatch):
    from core.numerics import kernel

    if not kernel.available():
        pytest.skip("numba is not importable")
    for t, r, tol in _measure_cases():
        with_kernel = metrics.measure(t, r, tol)
        monkeypatch.setattr(kernel, "available", lambda: False)
        _same_measurement(metrics.measure(t, r, tol, chunk_elems=1 << 13), with_kernel)
        _same_measurement((compare(t, r, tol), None), (with_kernel[0], None))
        monkeypatch.undo()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_target_is_measured_on_its_device(monkeypatch):
    # The same row and sketch as the host's, and the host kernel never sees the tensor.
    from core.numerics import kernel

    for t, r, tol in _measure_cases():
        on_host = metrics.measure(t, r, tol)
        monkeypatch.setattr(
            kernel, "compare_cpu", lambda *a, **k: pytest.fail("a cuda target reached the host kernel")
        )
        _same_measurement(metrics.measure(t.to("cuda"), r, tol), on_host)
        _same_measurement(metrics.measure(t.to("cuda"), r.to("cuda"), tol), on_host)
        monkeypatch.undo()
