"""HRA (PEFT's ``peft/tuners/hra/``): W times a product of Householder reflections of its input space, as
float64 ΔW (written out from PEFT 0.21.2's ``layer.py``, not taken from it), the checkpoint parameter it
saves, and how PEFT's layers give the reflections.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from core.methods.reading import AdapterModule, check_shape, config_rank, holds, need, require_linear

PARAMS = ("hra_u",)
"""The parameter name HRA saves per module."""
SHARED_KEYS: dict[str, str] = {}
ADDITIVE = ()
"""None: HRA multiplies W (its ΔW depends on it)."""


def hra_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """HRA: ``W' = W·H`` with H a product of r Householder reflections of the input space, so ΔW = W·H − W.

    ``hra_u`` (in, r) holds the r vectors. Without ``apply_GS``, H = (I − 2û₁û₁ᵀ)(I − 2û₂û₂ᵀ)…(I − 2û_rû_rᵀ)
    with ûᵢ = uᵢ/‖uᵢ‖, applied here to W one reflection at a time (never forming H): W ← W − 2(Wûᵢ)ûᵢᵀ.
    With ``apply_GS`` the vectors are orthonormalised first (PEFT: Gram–Schmidt; here the Q of a float64
    QR, the same basis up to signs, which ``QQᵀ`` does not see), and H = I − 2QQᵀ, i.e. ΔW = −2(WQ)Qᵀ.
    """
    u = need(mod, "hra_u", tensors)
    out_f, in_f = weight.shape
    check_shape(mod, "hra_u", u.shape, (in_f, config_rank(config, mod.module)))
    if config.get("apply_GS"):
        q, _ = torch.linalg.qr(u)
        return -2.0 * (weight @ q) @ q.T
    merged = weight.clone()
    for i in range(u.shape[1]):
        unit = u[:, i] / torch.linalg.vector_norm(u[:, i])
        merged = merged - 2.0 * torch.outer(merged @ unit, unit)
    return merged - weight


FORMULAS = {"hra": hra_delta}
"""Adapter type → its float64 ΔW."""


def layer_kind(layer: nn.Module, adapter: str) -> str | None:
    """``hra`` where ``layer`` is PEFT's HRA layer holding ``adapter``, else None; a ValueError for one that is
    not Linear."""
    from peft.tuners.hra import layer as hra

    if not holds(layer, adapter, "hra.layer.HRALayer", "hra_u"):
        return None
    return require_linear(layer, "hra", (hra.HRALinear,))


def peft_delta(layer: nn.Module, adapter_name: str, kind: str, weight: torch.Tensor) -> torch.Tensor:
    """``W·H − W`` with H PEFT's ``get_delta_weight`` (the reflections), W upcast exactly to its dtype."""
    reflections = layer.get_delta_weight(adapter_name)
    w = weight.to(reflections.dtype)
    return torch.mm(w, reflections) - w


def peft_source(layer: nn.Module, adapter: str, kind: str) -> str:
    """Which PEFT functions :func:`peft_delta` uses for this layer and adapter, in words."""
    how = "Gram–Schmidt, I − 2QQᵀ" if layer.hra_apply_GS[adapter] else "a product of reflections"
    return f"hra.get_delta_weight H ({how}) applied to W: W·H − W"
