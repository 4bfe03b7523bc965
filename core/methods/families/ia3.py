"""IA3 (PEFT's ``peft/tuners/ia3/``): W scaled by a trained vector along its input dim (feedforward modules)
or its output dim, as float64 ΔW, the checkpoint parameter it saves, and how PEFT's layers give it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from core.methods.reading import (
    AdapterModule,
    bnb_layers,
    check_shape,
    holds,
    need,
    require_linear,
    transpose_if,
)

PARAMS = ("ia3_l",)
"""The parameter name IA3 saves per module."""
SHARED_KEYS: dict[str, str] = {}
ADDITIVE = ()
"""None: IA3 scales W (its ΔW depends on it)."""


def is_feedforward(config: Mapping[str, Any], module: str) -> bool:
    """Whether IA3 treats ``module`` as feedforward (scales the input), as PEFT's IA3 model decides."""
    ff = config.get("feedforward_modules") or []
    if isinstance(ff, str):
        return re.fullmatch(ff, module) is not None
    return any(module.endswith(name) for name in ff)


def _ia3_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """IA3: ``W' = W ⊙ l``, ``l`` broadcast over the input dim for feedforward modules, else the output dim."""
    vec = need(mod, "ia3_l", tensors)
    fifo = bool(config.get("fan_in_fan_out"))
    out_f, in_f = transpose_if(weight, fifo).shape
    want = (1, in_f) if is_feedforward(config, mod.module) else (out_f, 1)
    check_shape(mod, "ia3_l", vec.shape, want)
    return weight * transpose_if(vec, fifo) - weight


FORMULAS = {"ia3": _ia3_delta}
"""Adapter type → its float64 ΔW."""


def layer_kind(layer: nn.Module, adapter: str) -> str | None:
    """``ia3`` where ``layer`` is PEFT's IA3 layer holding ``adapter``, else None; a ValueError for one that is
    not Linear (PEFT's bitsandbytes layers, IA3 on a 4- or 8-bit base, are Linear layers over a quantized W,
    which `peft_delta` dequantizes as their merge and forward do)."""
    from peft.tuners.ia3 import layer as ia3

    if not holds(layer, adapter, "ia3.layer.IA3Layer", "ia3_l"):
        return None
    return require_linear(layer, "ia3", (ia3.Linear, *bnb_layers("ia3")))


def peft_delta(layer: nn.Module, adapter_name: str, kind: str, weight: torch.Tensor) -> torch.Tensor:
    """``W * ia3_l − W`` with the layer's own vector, W upcast exactly to the adapter's dtype."""
    from peft.utils.other import transpose

    # IA3's bitsandbytes layers have no fan_in_fan_out: W is stored (out, in) there
    scale = transpose(layer.ia3_l[adapter_name].detach(), getattr(layer, "fan_in_fan_out", False))
    w = weight.to(scale.dtype)
    return w * scale - w


def peft_source(layer: nn.Module, adapter: str, kind: str) -> str:
    """Which PEFT tensors :func:`peft_delta` uses for this layer, in words."""
    dim = "input dim (feedforward)" if layer.is_feedforward else "output dim"
    return f"ia3_l scaling W along the {dim}"
