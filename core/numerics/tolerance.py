"""The pass/fail rule of `metrics.compare` and the float formats it is decided in.

An element passes where ``|target − reference| <= atol + rtol·|reference|`` (``torch.isclose``, with
``equal_nan=True``), both promoted to `rule_dtype` as ``torch.testing.assert_close`` promotes them;
`default_tolerance` gives assert_close's rtol/atol per dtype, `ulp` the spacing of a float format at a
value (the unit of ``max_ulp``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

_RULE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Tolerance:
    """Element-wise tolerance: an element passes where ``|d| <= atol + rtol * |reference|``."""

    rtol: float
    atol: float

    def __post_init__(self) -> None:
        # Negative or NaN tolerances would make equal elements fail and min_atol meaningless.
        if not (self.rtol >= 0 and self.atol >= 0):
            raise ValueError(f"rtol and atol must be non-negative, not rtol={self.rtol}, atol={self.atol}")


# Read-only so that no caller can change the defaults for everybody else.
DEFAULT_TOLERANCES: Mapping[str, Tolerance] = MappingProxyType(
    {
        "float16": Tolerance(rtol=1e-3, atol=1e-5),
        "bfloat16": Tolerance(rtol=1.6e-2, atol=1e-5),
        "float32": Tolerance(rtol=1.3e-6, atol=1e-5),
        "float64": Tolerance(rtol=1e-7, atol=1e-7),
    }
)


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype's name without the `torch.` prefix (`float32`), as rows and tolerances spell it."""
    return str(dtype).removeprefix("torch.")


def rule_dtype(target_dtype: torch.dtype, reference_dtype: torch.dtype) -> torch.dtype:
    """The dtype the tolerance rule is evaluated in: ``torch.promote_types`` of the two, as in assert_close.

    Formats without promotion or arithmetic in torch (float8) fall back to float64, which holds
    them exactly.
    """
    try:
        dtype = torch.promote_types(target_dtype, reference_dtype)
    except RuntimeError:
        return torch.float64
    return dtype if dtype in _RULE_DTYPES else torch.float64


def rule_isclose(t: torch.Tensor, r: torch.Tensor, rtol: float, atol: float) -> torch.Tensor:
    """Where `t` passes against `r` (both already in `rule_dtype`): ``torch.isclose`` with ``equal_nan``.

    The one place pass/fail is decided: exactly what assert_close(equal_nan=True) computes after
    promoting, so the two agree bit for bit.
    """
    return torch.isclose(t, r, rtol=rtol, atol=atol, equal_nan=True)


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 `x` rounded to `dtype` (nearest, ties to even), as float32: the kernel's round_bf16/round_f16."""
    return x if dtype == torch.float32 else x.to(dtype).to(torch.float32)


def narrow_tolerance_scalars(mode: torch.dtype, rtol: float, atol: float, device: torch.device):
    """rtol and atol as the kernel's narrow rule sees them: float32, and atol rounded to bf16/f16."""
    rtol32 = torch.tensor(rtol, dtype=torch.float32, device=device)
    atol32 = round_to(torch.tensor(atol, dtype=torch.float32, device=device), mode)
    return rtol32, atol32


def rule_fails(mode, a, b, rtol, atol, tol_on: bool | torch.Tensor) -> torch.Tensor:
    """not isclose(a, b, rtol, atol, equal_nan=True) in the promoted `mode`, rounding as torch's CPU
    kernels do, on any device (`kernel_arith.mis*`, the numba kernel's emulation of them).

    float64: a, b float64 and rtol, atol floats; narrow modes: a, b float32 holding `mode` values and
    rtol, atol float32 tensors (atol per element or a scalar), each result rounded to `mode`.
    """
    eq = (a == b) | (a.isnan() & b.isnan())
    if mode == torch.float64:
        actual = (a - b).abs()
        allowed = atol + (rtol * b).abs()
    else:
        actual = round_to(a - b, mode).abs()
        allowed = round_to(atol + round_to(rtol * b, mode).abs(), mode)
    close = (actual < math.inf) & (actual <= allowed)
    if isinstance(tol_on, torch.Tensor):
        close &= tol_on
    elif not tol_on:
        close = torch.zeros_like(close)
    return ~(eq | close)


def close_mask(target: torch.Tensor, reference: torch.Tensor, tolerance: Tolerance) -> torch.Tensor:
    """Where `target` passes the tolerance rule against `reference`, element-wise, on the CPU.

    The rule of `compare`: both promoted to `rule_dtype`, then ``torch.isclose`` with
    ``equal_nan=True``. Integer and bool tensors are compared exactly, as `compare` does.
    """
    target, reference = target.detach().to("cpu"), reference.detach().to("cpu")
    if not (target.is_floating_point() or reference.is_floating_point()):
        return target.to(torch.int64) == reference.to(torch.int64)
    dtype = rule_dtype(target.dtype, reference.dtype)
    return rule_isclose(target.to(dtype), reference.to(dtype), tolerance.rtol, tolerance.atol)


def default_tolerance(dtype: torch.dtype | str) -> Tolerance:
    """The default tolerance for a TARGET dtype (a ``torch.dtype`` or its name, e.g. ``"float32"``).

    Raises TypeError for non-floating dtypes and ValueError for floating dtypes without a default
    (e.g. float8): pass an explicit `Tolerance` for those.
    """
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise TypeError(f"no tolerance for non-floating dtype {dtype}")
        name = dtype_name(dtype)
    else:
        name = dtype.removeprefix("torch.")
    try:
        return DEFAULT_TOLERANCES[name]
    except KeyError:
        raise ValueError(f"no default tolerance for dtype {name!r}; pass a Tolerance") from None


def float_format(dtype: torch.dtype) -> tuple[int, int]:
    """(p, e_min): mantissa digits incl. the implicit bit, and frexp's exponent of the smallest normal."""
    if not dtype.is_floating_point:
        raise TypeError(f"ULP is defined for floating dtypes only, not {dtype}")
    info = torch.finfo(dtype)
    # Derived from finfo (exact powers of two) so float8 formats work too: eps = 2^(1-p).
    _, eps_exp = math.frexp(info.eps)
    _, e_min = math.frexp(info.tiny)
    return 2 - eps_exp, e_min


def format_spacing(abs_x: torch.Tensor, p: int, e_min: int) -> torch.Tensor:
    """ulp for finite, non-negative float64 `abs_x`, built from float64 bit patterns.

    Exact (no exp2/ldexp, which are not guaranteed exact for subnormal results) and cheap:
    the clamp to the dtype's smallest normal turns frexp's exponent e into max(e, e_min).
    """
    a = abs_x.clamp(min=2.0 ** (e_min - 1))
    # For a normal float64 a with biased exponent b, frexp's e is b - 1022, so 2^(e - p)
    # has biased exponent b + 1 - p.
    k = (a.view(torch.int64) >> 52) + (1 - p)
    if e_min - p >= -1022:  # every format but float64: the spacing is a normal float64
        return (k << 52).view(torch.float64)
    # float64 targets: spacings below 2^-1022 are float64 subnormals, 2^(k - 1023) = bit k + 51.
    subnormal = torch.bitwise_left_shift(torch.ones_like(k), (k + 51).clamp(0, 62))
    return torch.where(k >= 1, k << 52, subnormal).view(torch.float64)


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at ``|x|``, element-wise, as float64 on x's device.

    With ``x = m·2^e`` (``m`` in [0.5, 1)), the spacing is ``2^(max(e, e_min) - p)``; zero and
    subnormals get the subnormal spacing, e.g. ``ulp(1.0, float32) = 2^-23`` and
    ``ulp(0, float32) = 2^-149``. Non-finite x gives NaN. Raises TypeError for non-floating dtypes.
    """
    p, e_min = float_format(dtype)
    x64 = x.detach().to(torch.float64)
    finite = torch.isfinite(x64)
    spacing = format_spacing(torch.where(finite, x64, 0.0).abs(), p, e_min)
    return torch.where(finite, spacing, math.nan)
