"""The comparison kernel (`core.numerics.metrics.compare`) against what it has to be measured by.

For each size and case, the median of N timed repeats (after one untimed warm-up) of:

- ``compare``: ``core.numerics.metrics.compare(t, r)`` with its defaults (the code under test);
- ``torch.equal``: the floor for identical tensors (one read of each, no statistics);
- ``copy``: ``copy_`` of both inputs into preallocated buffers (memory bandwidth: a read and a write);
- ``naive f64``: the same statistics computed the obvious way: both tensors upcast to float64
  whole, then plain torch ops (`naive_stats`);
- ``allclose``: ``torch.allclose`` in the dtype ``assert_close`` compares in (the promoted
  dtype of the pair), at the target dtype's default tolerance;
- ``torch port``: ``core.numerics.accumulate.compare_torch``, the kernel's pass in torch (what a GPU
  target is measured by), here on the CPU, up to `TORCH_PORT_CPU_MAX_BYTES` (NaN above); the row
  says whether its numbers are the kernel's bit for bit (``port_bitwise_kernel``).

Where CUDA is visible the row also times, outside the printed table, ``compare on cuda`` (the
target on ``cuda:0``, the reference on the host: the torch port on the device, as a cuda target is
measured) and ``host copy + kernel`` (the target copied to the host, then the kernel: the path
before), and says whether the device's numbers are the host's (``cuda_bitwise_host``).

Throughput is GB/s (10⁹ bytes) over the input bytes, ``t.nbytes + r.nbytes``. Sizes name the
float32 reference's bytes; a bfloat16 target of the same shape is half that.
"""

from __future__ import annotations

import gc
import math
import re
import statistics
import struct
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

# The design's default tolerances per target dtype (rtol, atol), as torch.testing.assert_close.
# Kept here, not imported, so the benchmark's reference does not move when core is rewritten.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
}

CASES = ("identical-f32", "f32-diff-1pct", "f32-diff-all", "bf16-vs-f32")
CASE_DOC = {
    "identical-f32": "float32 target bitwise equal to its float32 reference (separate storage)",
    "f32-diff-1pct": "float32, 1 % of elements perturbed by ~1e-3 relative (some beyond tolerance)",
    "f32-diff-all": "float32, every element perturbed by ~1e-6 relative (within tolerance)",
    "bf16-vs-f32": "bfloat16 target = the float32 reference rounded (as a bf16 load of an f32 file)",
}
METHODS = ("compare", "torch.equal", "copy", "naive f64", "allclose", "torch port")
# The torch port on the CPU runs at a few MB/s on a small shared machine: larger sizes are not timed.
TORCH_PORT_CPU_MAX_BYTES = 64 << 20

# Done-when targets of issue 13 (ratios of median times).
TARGET_IDENTICAL_VS_EQUAL = 0.5  # compare throughput / torch.equal throughput, identical tensors
TARGET_NAIVE_SPEEDUP = 3.0  # naive f64 time / compare time, differing tensors
TARGET_VS_ALLCLOSE = 3.0  # compare time / allclose time, differing tensors (at most)

_UNITS = {
    "": 1,
    "B": 1,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
}


def parse_size(text: str) -> int:
    """Bytes of a size like ``64MiB``, ``1GiB``, ``500MB`` or ``4096``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 64MiB, 1GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(nbytes: int) -> str:
    """``64MiB``-style label of a byte count."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    return f"{nbytes}B"


def make_case(case: str, numel: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(target, reference) of `case` with `numel` elements; the reference is float32 ~ N(0, 0.02²)."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(numel, generator=g).mul_(0.02)
    if case == "identical-f32":
        return r.clone(), r
    if case == "f32-diff-1pct":
        t = r.clone()
        mask = torch.rand(numel, generator=g) < 0.01
        noise = torch.randn(int(mask.sum()), generator=g)
        t[mask] *= 1 + 1e-3 * noise
        return t, r
    if case == "f32-diff-all":
        return r * (1 + 1e-6 * torch.randn(numel, generator=g)), r
    if case == "bf16-vs-f32":
        return r.to(torch.bfloat16), r
    raise ValueError(f"unknown case {case!r}; choose from {', '.join(CASES)}")


def naive_ulp(abs_ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` at float64 ``abs_ref`` with plain ops: 2^(max(e, e_min) - p) via frexp."""
    info = torch.finfo(dtype)
    p = (
        2 - math.frexp(info.eps)[1]
    )  # eps = 2^(1-p); p = mantissa digits incl. the implicit bit (24 for float32)
    e_min = math.frexp(info.tiny)[1]
    _, e = torch.frexp(abs_ref.clamp(min=2.0 ** (e_min - 1)))
    return torch.ldexp(torch.ones_like(abs_ref), e - p)


def naive_stats(t: torch.Tensor, r: torch.Tensor, rtol: float, atol: float) -> dict[str, float]:
    """The statistics `compare` reports, the obvious way: whole-tensor float64, plain torch ops.

    This is the baseline the kernel must beat, so it is written as someone would write it
    without thinking about memory (about ten float64 copies' worth of temporaries at peak), not
    made deliberately slow: in-place where that is natural, one op per statistic.
    """
    t64, r64 = t.double(), r.double()
    finite = torch.isfinite(t64) & torch.isfinite(r64)
    n_nan, n_inf = int(t64.isnan().sum()), int(t64.isinf().sum())
    n_diff = int((t64 != r64).sum())
    dot, t_norm, r_norm = torch.dot(t64, r64), torch.linalg.vector_norm(t64), torch.linalg.vector_norm(r64)
    ad = (t64 - r64).abs_()
    abs_r = r64.abs()
    del t64, r64
    max_abs, worst = torch.max(ad, dim=0)
    allowed = abs_r * rtol
    n_mismatch = int((ad > allowed + atol).sum())
    min_atol = float((ad - allowed).clamp_(min=0).max())
    max_ulp = float((ad / naive_ulp(abs_r, t.dtype)).max())
    d_norm = torch.linalg.vector_norm(ad)
    return {
        "n_diff": n_diff,
        "n_mismatch": n_mismatch,
        "max_abs": float(max_abs),
        "worst_index": int(worst),
        "mean_abs": float(ad.mean()),
        "rmse": float(d_norm / math.sqrt(ad.numel())),
        "rel_l2": float(d_norm / r_norm),
        "cos_sim": float(dot / (t_norm * r_norm)),
        "max_ulp": max_ulp,
        "min_atol": min_atol,
        "n_nan": n_nan,
        "n_inf": n_inf,
        "n_finite": int(finite.sum()),
    }


def _agreement(stats: Any, naive: dict[str, float], rule: torch.dtype) -> dict[str, Any]:
    """Whether compare's result matches the naive float64 one (the two measure the same thing).

    min_atol is exact in the rule's dtype (`rule`: isclose rounds there), the naive one is
    float64's: they agree to a few units of the rule's dtype.
    """
    checks: dict[str, bool] = {}
    for key in ("n_mismatch", "max_abs", "max_ulp"):
        checks[key] = getattr(stats, key, None) == naive[key]
    for key in ("mean_abs", "rmse", "rel_l2", "cos_sim", "min_atol"):
        got = getattr(stats, key, None)
        rel_tol = 8 * torch.finfo(rule).eps if key == "min_atol" else 1e-9
        checks[key] = got is not None and math.isclose(got, naive[key], rel_tol=rel_tol, abs_tol=1e-300)
    return {"agree": all(checks.values()), "fields": checks}


def _same_fields(a: Any, b: Any) -> bool:
    """Whether two results (dataclasses) hold the same values in every field, floats bit for bit."""
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, float) and isinstance(y, float):
            if not ((math.isnan(x) and math.isnan(y)) or struct.pack("<d", x) == struct.pack("<d", y)):
                return False
        elif name != "sketch" and x != y:
            return False
    return True


@dataclass
class Timing:
    """Median and spread of one method's repeats, with its throughput over the input bytes."""

    method: str
    median_s: float
    min_s: float
    max_s: float
    repeats: int
    gbps: float

    @classmethod
    def of(cls, method: str, times: list[float], input_bytes: int) -> Timing:
        median = statistics.median(times)
        return cls(method, median, min(times), max(times), len(times), input_bytes / median / 1e9)


def time_it(fn: Callable[[], Any], repeats: int) -> tuple[list[float], Any]:
    """One untimed warm-up (its result is returned), then `repeats` timed calls."""
    result = fn()
    times = []
    for _ in range(repeats):
        gc.collect()  # a collection inside a timed call would be charged to the method
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times, result


def estimated_peak_bytes(size_bytes: int) -> int:
    """Rough peak of one size: inputs, copy buffers, and the naive float64 temporaries."""
    # reference + target (4 bytes each per element), then naive: t64, r64, |d|, |r|, a temporary
    numel = size_bytes // 4
    return numel * (4 + 4) + numel * 8 * 6


def bench_case(case: str, size_bytes: int, repeats: int, seed: int = 0) -> dict[str, Any]:
    """Time every method on one (case, size); the result row of the JSON file."""
    from core.numerics.accumulate import compare_torch
    from core.numerics.kernel import compare_cpu
    from core.numerics.metrics import compare

    numel = size_bytes // 4
    t, r = make_case(case, numel, seed)
    input_bytes = t.nbytes + r.nbytes
    rtol, atol = TOLERANCES[t.dtype]
    common = torch.promote_types(t.dtype, r.dtype)  # what assert_close(check_dtype=False) compares in

    timings: dict[str, Timing] = {}
    results: dict[str, Any] = {}

    def run(method: str, fn: Callable[[], Any]) -> None:
        times, results[method] = time_it(fn, repeats)
        timings[method] = Timing.of(method, times, input_bytes)

    run("compare", lambda: compare(t, r))
    run("torch.equal", lambda: torch.equal(t, r))
    buffers = [torch.empty_like(t), torch.empty_like(r)]  # preallocated: copy, not allocation
    run("copy", lambda: (buffers[0].copy_(t), buffers[1].copy_(r)))
    buffers.clear()  # freed before the naive float64 pass needs the memory
    run("naive f64", lambda: naive_stats(t, r, rtol, atol))
    run("allclose", lambda: torch.allclose(t.to(common), r.to(common), rtol=rtol, atol=atol))
    port_same = None
    if size_bytes <= TORCH_PORT_CPU_MAX_BYTES:
        run("torch port", lambda: compare_torch(t, r, rtol, atol))
        port_same = _same_fields(results["torch port"], compare_cpu(t, r, rtol, atol))
    else:
        timings["torch port"] = Timing("torch port", math.nan, math.nan, math.nan, 0, math.nan)
    cuda_same = None
    if torch.cuda.is_available():
        t_dev = t.to("cuda:0")

        def on_device() -> Any:
            stats = compare(t_dev, r)
            torch.cuda.synchronize()
            return stats

        run("compare on cuda", on_device)
        run("host copy + kernel", lambda: compare_cpu(t_dev.cpu(), r, rtol, atol))
        cuda_same = _same_fields(results["compare on cuda"], results["compare"])
        del t_dev

    stats = results["compare"]
    identical = case.startswith("identical")
    c = timings["compare"].median_s
    ratios = {
        "compare_vs_equal_throughput": timings["torch.equal"].median_s / c,
        "naive_over_compare": timings["naive f64"].median_s / c,
        "compare_over_allclose": c / timings["allclose"].median_s,
        "compare_vs_copy_throughput": timings["copy"].median_s / c,
    }
    if identical:
        targets = {
            f"compare ≥ {TARGET_IDENTICAL_VS_EQUAL:g}× torch.equal throughput": ratios[
                "compare_vs_equal_throughput"
            ]
            >= TARGET_IDENTICAL_VS_EQUAL
        }
    else:
        targets = {
            f"compare ≥ {TARGET_NAIVE_SPEEDUP:g}× faster than naive f64": ratios["naive_over_compare"]
            >= TARGET_NAIVE_SPEEDUP,
            f"compare ≤ {TARGET_VS_ALLCLOSE:g}× allclose time": ratios["compare_over_allclose"]
            <= TARGET_VS_ALLCLOSE,
        }
    return {
        "case": case,
        "description": CASE_DOC[case],
        "size": format_size(size_bytes),
        "numel": numel,
        "target_dtype": str(t.dtype).removeprefix("torch."),
        "reference_dtype": str(r.dtype).removeprefix("torch."),
        "input_bytes": input_bytes,
        "rtol": rtol,
        "atol": atol,
        "timings": {m: asdict(x) for m, x in timings.items()},
        "ratios": ratios,
        "targets": targets,
        "compare_verdict_fields": {
            "bitwise_equal": getattr(stats, "bitwise_equal", None),
            "n_mismatch": getattr(stats, "n_mismatch", None),
            "max_abs": getattr(stats, "max_abs", None),
        },
        "allclose": bool(results["allclose"]),
        "port_bitwise_kernel": port_same,
        "cuda_bitwise_host": cuda_same,
        "agreement_with_naive": _agreement(
            stats, results["naive f64"], torch.promote_types(t.dtype, r.dtype)
        ),
    }


def run_kernel(
    sizes: list[int],
    repeats: int,
    cases: tuple[str, ...] = CASES,
    say: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Every (size, case); sizes whose estimated peak exceeds the available memory are skipped."""
    import psutil

    rows: list[dict[str, Any]] = []
    for size in sizes:
        need, have = estimated_peak_bytes(size), psutil.virtual_memory().available
        if need > 0.8 * have:
            say(
                f"kernel {format_size(size)}: skipped, needs ~{need / 2**30:.1f} GiB, {have / 2**30:.1f} free"
            )
            rows.append({"size": format_size(size), "skipped": f"needs ~{need / 2**30:.1f} GiB"})
            continue
        for case in cases:
            say(f"kernel {format_size(size)} {case} ({repeats} repeats)")
            rows.append(bench_case(case, size, repeats))
            gc.collect()
    return rows
