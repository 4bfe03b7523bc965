"""The LyCORIS methods, LoHa and LoKr (PEFT's ``peft/tuners/loha/`` and ``peft/tuners/lokr/``): a Hadamard
product of two low-rank products, a Kronecker product of two factors, as float64 ΔW (Linear layers), the
checkpoint parameters they save, and which of PEFT's layers hold them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from core.methods.reading import AdapterModule, check_shape, holds, need, pattern_value

PARAMS = (
    "hada_w1_a",
    "hada_w1_b",
    "hada_w2_a",
    "hada_w2_b",
    "hada_t1",
    "hada_t2",
    "lokr_w1_a",
    "lokr_w1_b",
    "lokr_w2_a",
    "lokr_w2_b",
    "lokr_t2",
    "lokr_w1",
    "lokr_w2",
)
"""The parameter names LoHa and LoKr save per module (in ParameterDicts: no ``.weight`` suffix)."""
SHARED_KEYS: dict[str, str] = {}
ADDITIVE = ("loha", "lokr")
"""Both merge by adding PEFT's ``get_delta_weight`` to W."""


def _lycoris_scaling(config: Mapping[str, Any], module: str) -> tuple[int, float]:
    """LoHa/LoKr rank and scaling ``alpha / r`` (config keys ``r``, ``alpha``, their patterns honoured)."""
    r = int(pattern_value(config.get("rank_pattern"), module, config.get("r", 8)))
    alpha = float(pattern_value(config.get("alpha_pattern"), module, config.get("alpha", 8)))
    return r, alpha / r


def _no_conv(mod: AdapterModule, params: tuple[str, ...]) -> None:
    """ValueError for the Tucker (conv) tensors of LoHa/LoKr: only Linear layers are covered."""
    found = [p for p in params if p in mod.keys]
    if found:
        raise ValueError(
            f"module {mod.module}: {', '.join(found)} belong to a convolution, "
            "which reference_deltas does not cover"
        )


def _loha_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """LoHa: ``(W1a @ W1b) ⊙ (W2a @ W2b) · alpha/r`` (Hadamard product of two rank-r products)."""
    _no_conv(mod, ("hada_t1", "hada_t2"))
    w1a, w1b = need(mod, "hada_w1_a", tensors), need(mod, "hada_w1_b", tensors)
    w2a, w2b = need(mod, "hada_w2_a", tensors), need(mod, "hada_w2_b", tensors)
    r, scaling = _lycoris_scaling(config, mod.module)
    out_f, in_f = weight.shape
    for name, t, want in (
        ("hada_w1_a", w1a, (out_f, r)),
        ("hada_w1_b", w1b, (r, in_f)),
        ("hada_w2_a", w2a, (out_f, r)),
        ("hada_w2_b", w2b, (r, in_f)),
    ):
        check_shape(mod, name, t.shape, want)
    return (w1a @ w1b) * (w2a @ w2b) * scaling


def _lokr_factor(mod: AdapterModule, tensors: Mapping[str, torch.Tensor], which: str) -> torch.Tensor:
    """LoKr factor ``which`` (``w1``/``w2``): stored whole, or as the product of its two low-rank halves."""
    if f"lokr_{which}" in mod.keys:
        return need(mod, f"lokr_{which}", tensors)
    a, b = need(mod, f"lokr_{which}_a", tensors), need(mod, f"lokr_{which}_b", tensors)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(
            f"module {mod.module}: lokr_{which}_a {tuple(a.shape)} and lokr_{which}_b {tuple(b.shape)} "
            "do not multiply"
        )
    return a @ b


def _lokr_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """LoKr: ``(W1 ⊗ W2) · alpha/r``, each factor stored whole or as a rank-r product.

    The Kronecker product is written out as ``ΔW[i·p + k, j·q + l] = W1[i, j] · W2[k, l]`` for W2 of
    shape (p, q), not taken from ``torch.kron``.
    """
    _no_conv(mod, ("lokr_t2",))
    w1, w2 = _lokr_factor(mod, tensors, "w1"), _lokr_factor(mod, tensors, "w2")
    _, scaling = _lycoris_scaling(config, mod.module)
    (a, c), (p, q) = w1.shape, w2.shape
    check_shape(mod, "lokr_w1 ⊗ lokr_w2", (a * p, c * q), tuple(weight.shape))
    kron = (w1[:, None, :, None] * w2[None, :, None, :]).reshape(a * p, c * q)
    return kron * scaling


FORMULAS = {"loha": _loha_delta, "lokr": _lokr_delta}
"""Adapter type → its float64 ΔW."""


def layer_kind(layer: nn.Module, adapter: str) -> str | None:
    """``loha`` or ``lokr`` where ``layer`` is PEFT's LoHa or LoKr layer holding ``adapter``, else None."""
    if holds(layer, adapter, "loha.layer.LoHaLayer", "_available_adapters"):
        return "loha"
    if holds(layer, adapter, "lokr.layer.LoKrLayer", "_available_adapters"):
        return "lokr"
    return None
