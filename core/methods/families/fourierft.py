"""FourierFT (PEFT's ``peft/tuners/fourierft/``): ΔW as the real inverse DFT of a spectrum trained at a few
frequencies, as float64 ΔW, the checkpoint parameter it saves, and which of PEFT's layers hold it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from core.methods.reading import AdapterModule, check_shape, holds, need, no_fan_in_fan_out, pattern_value

PARAMS = ("fourierft_spectrum",)
"""The parameter name FourierFT saves per module."""
SHARED_KEYS: dict[str, str] = {}
ADDITIVE = ("fourierft",)
"""FourierFT merges by adding PEFT's ``get_delta_weight`` to W."""


def _fourierft_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """FourierFT: the real part of the inverse 2-D DFT of a spectrum that is zero but at n frequencies,
    times ``scaling``: ``ΔW[m, n] = s/(MN)·Σ_k c_k·cos(2π(m·u_k/M + n·v_k/N))``, written as cosines and
    sines (no FFT). The frequencies (u_k, v_k) are not saved: PEFT draws them as the first n of
    ``randperm(M·N)`` from ``random_loc_seed``, which this reproduces."""
    no_fan_in_fan_out(config, mod, "FourierFT")
    spectrum = need(mod, "fourierft_spectrum", tensors)
    rows, cols = weight.shape
    n = int(pattern_value(config.get("n_frequency_pattern"), mod.module, config.get("n_frequency", 1000)))
    check_shape(mod, "fourierft_spectrum", spectrum.shape, (n,))
    generator = torch.Generator().manual_seed(int(config.get("random_loc_seed", 777)))
    flat = torch.randperm(rows * cols, generator=generator)[:n]
    u, v = (flat // cols).double(), (flat % cols).double()
    a = 2 * math.pi * torch.outer(torch.arange(rows, dtype=torch.float64), u) / rows  # (M, n)
    b = 2 * math.pi * torch.outer(torch.arange(cols, dtype=torch.float64), v) / cols  # (N, n)
    # cos(a + b) = cos a cos b − sin a sin b, summed over the frequencies with their coefficients
    total = (torch.cos(a) * spectrum) @ torch.cos(b).T - (torch.sin(a) * spectrum) @ torch.sin(b).T
    return total * float(config.get("scaling", 150.0)) / (rows * cols)


FORMULAS = {"fourierft": _fourierft_delta}
"""Adapter type → its float64 ΔW."""


def layer_kind(layer: nn.Module, adapter: str) -> str | None:
    """``fourierft`` where ``layer`` is PEFT's FourierFT layer holding ``adapter``, else None."""
    return (
        "fourierft" if holds(layer, adapter, "fourierft.layer.FourierFTLayer", "fourierft_spectrum") else None
    )
