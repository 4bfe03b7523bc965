"""RandLoRA (PEFT's ``peft/tuners/randlora/``): shared random low-rank bases every module scales with its
trained λ and γ, as float64 ΔW (written out from PEFT 0.21.2's ``layer.py``, not taken from it), the
checkpoint parameters it saves (the shared bases once at the top level, and in each module), and which of
PEFT's layers hold it. Regenerating the bases where they were not saved is `core.methods.projections`'.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from core.methods.reading import AdapterModule, check_shape, holds, need, need_projections, transpose_if

# its shared random bases: PEFT saves every module's reference to them as well as the top-level pair
PARAMS = ("randlora_lambda", "randlora_gamma", "randlora_A", "randlora_B")
"""The parameter names RandLoRA saves per module."""
SHARED_KEYS = {"base_model.randlora_A": "randlora_A", "base_model.randlora_B": "randlora_B"}
"""Its random bases, one pair shared by every adapted module, saved once at the top level (with
save_projection=True, PEFT's default): checkpoint key → parameter name in each module's keys."""
ADDITIVE = ("randlora",)
"""RandLoRA merges by adding PEFT's ``get_delta_weight`` to W."""


def randlora_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """RandLoRA: ``ΔW = (alpha/r)·Σ_f B̄[:, f] ⊗ Ā[f, :]`` over f < n·r, oriented (out, in), with n =
    ⌈min(in, out)/r⌉ bases of rank r, transposed for fan_in_fan_out.

    The shared random bases A (r, 1, ≥m) and B (≥M, ≥n, r), m = min(in, out) and M = max(in, out), are
    saved in the adapter file (save_projection=True, PEFT's default; each module's copy and the top-level
    pair) or regenerated as PEFT does (`core.methods.projections`). The trained λ (r, n) and γ (n, m) scale A: Ā[f, j] = λ[k, b]·A[k, 0, j]·γ[b, j] with
    (k, b) = divmod(f, n), while B̄[:, f] = B[:, b', k'] with (b', k') = divmod(f, r): PEFT flattens the
    scaled A rank-major and B basis-major, and pairs them by the flat index f. The product B̄Ā is
    (M, m): ΔW when in ≤ out, its transpose otherwise.
    """
    need_projections(mod, "randlora")
    lam, gamma = need(mod, "randlora_lambda", tensors), need(mod, "randlora_gamma", tensors)
    base_a, base_b = need(mod, "randlora_A", tensors), need(mod, "randlora_B", tensors)
    fifo = bool(config.get("fan_in_fan_out"))
    out_f, in_f = transpose_if(weight, fifo).shape
    r = int(config.get("r", 32))
    small, large = min(in_f, out_f), max(in_f, out_f)
    n = math.ceil(small / r)
    check_shape(mod, "randlora_lambda", lam.shape, (r, n))
    check_shape(mod, "randlora_gamma", gamma.shape, (n, small))
    if base_a.ndim != 3 or base_a.shape[0] != r or base_a.shape[2] < small:
        raise ValueError(
            f"module {mod.module}: randlora_A has shape {tuple(base_a.shape)}, expected ({r}, 1, ≥{small})"
        )
    if base_b.ndim != 3 or base_b.shape[0] < large or base_b.shape[1] < n or base_b.shape[2] != r:
        raise ValueError(
            f"module {mod.module}: randlora_B has shape {tuple(base_b.shape)}, expected (≥{large}, ≥{n}, {r})"
        )
    flat = torch.arange(n * r)
    k, b = flat // n, flat % n  # the scaled A's row f
    a_bar = lam[k, b][:, None] * base_a[k, 0, :small] * gamma[b]  # (n·r, m)
    b_bar = base_b[:large, flat // r, flat % r]  # (M, n·r): column f is B[:, f // r, f % r]
    product = b_bar @ a_bar  # (M, m)
    delta = product if in_f == small else product.T
    return transpose_if(delta, fifo) * float(config.get("randlora_alpha", 640)) / r


FORMULAS = {"randlora": randlora_delta}
"""Adapter type → its float64 ΔW."""


def layer_kind(layer: nn.Module, adapter: str) -> str | None:
    """``randlora`` where ``layer`` is PEFT's RandLoRA layer holding ``adapter``, else None."""
    return "randlora" if holds(layer, adapter, "randlora.layer.RandLoraLayer", "randlora_lambda") else None
