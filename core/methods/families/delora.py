"""DeLoRA (PEFT's ``peft/tuners/delora/``): a LoRA whose rank-one terms are normalised and scaled by a trained
λ and the saved column norms of W, as float64 ΔW (written out from PEFT 0.21.2's ``layer.py``, not taken from
it), the checkpoint parameters it saves, and which of PEFT's layers hold it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from core.methods.reading import AdapterModule, check_shape, config_rank, holds, need

# the last: the per-input-column norms of W, taken when the adapter was created and saved with it
PARAMS = ("delora_A", "delora_B", "delora_lambda", "delora_w_norm")
"""The parameter names DeLoRA saves per module."""
SHARED_KEYS: dict[str, str] = {}
ADDITIVE = ("delora",)
"""DeLoRA merges by adding PEFT's ``get_delta_weight`` to W."""


def delora_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """DeLoRA: ``ΔW = Σ_i λ/(r·‖Aᵢ‖·‖Bⁱ‖) · Bⁱ ⊗ Aᵢ``, each input column j then scaled by ``w_norm[j]``.

    Aᵢ is row i of ``delora_A`` (r, in), Bⁱ column i of ``delora_B`` (out, r), both norms clamped below at
    1e-4 as PEFT does; λ is the trained ``delora_lambda``; ``delora_w_norm`` (in) is ‖W[:, j]‖ of the W the
    adapter was created on, saved with it: ΔW does not depend on the W it is loaded onto.
    """
    a, b = need(mod, "delora_A", tensors), need(mod, "delora_B", tensors)
    lam, w_norm = need(mod, "delora_lambda", tensors), need(mod, "delora_w_norm", tensors)
    out_f, in_f = weight.shape
    r = config_rank(config, mod.module)
    check_shape(mod, "delora_A", a.shape, (r, in_f))
    check_shape(mod, "delora_B", b.shape, (out_f, r))
    check_shape(mod, "delora_lambda", lam.shape, (1,))
    check_shape(mod, "delora_w_norm", w_norm.shape, (in_f,))
    a_norm = torch.linalg.vector_norm(a, dim=1).clamp(min=1e-4)
    b_norm = torch.linalg.vector_norm(b, dim=0).clamp(min=1e-4)
    per_rank = lam / r / (a_norm * b_norm)  # (r,)
    return ((b * per_rank) @ a) * w_norm


FORMULAS = {"delora": delora_delta}
"""Adapter type → its float64 ΔW."""


def layer_kind(layer: nn.Module, adapter: str) -> str | None:
    """``delora`` where ``layer`` is PEFT's DeLoRA layer holding ``adapter``, else None."""
    return "delora" if holds(layer, adapter, "delora.layer.DeloraLayer", "delora_A") else None
