"""AdaLoRA (PEFT's ``peft/tuners/adalora/``): LoRA in SVD form, ``B(A ⊙ E)``, whose rank a budget prunes, as
float64 ΔW (Linear layers), the checkpoint parameters it saves, and which of PEFT's layers hold it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from core.methods.reading import AdapterModule, check_shape, holds, need, transpose_if

PARAMS = ("lora_A", "lora_B", "lora_E")
"""The parameter names AdaLoRA saves per module (in ParameterDicts: no ``.weight`` suffix)."""
SHARED_KEYS: dict[str, str] = {}
ADDITIVE = ("adalora",)
"""AdaLoRA merges by adding PEFT's ``get_delta_weight`` to W."""


def _adalora_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """AdaLoRA: ``B @ (A ⊙ E) · s / (init_r + 1e-5)``, transposed for fan_in_fan_out.

    ``s`` is ``lora_alpha`` (the stored rank where lora_alpha ≤ 0). The divisor is PEFT's ``ranknum``,
    which it never saves: it is ``init_r`` whatever rank the budget left the module (PEFT copies the old
    ranknum over when it prunes to ``rank_pattern``), plus PEFT's 1e-5.
    """
    a, b, e = need(mod, "lora_A", tensors), need(mod, "lora_B", tensors), need(mod, "lora_E", tensors)
    fifo = bool(config.get("fan_in_fan_out"))
    out_f, in_f = transpose_if(weight, fifo).shape
    r = a.shape[0]
    check_shape(mod, "lora_A", a.shape, (r, in_f))
    check_shape(mod, "lora_B", b.shape, (out_f, r))
    check_shape(mod, "lora_E", e.shape, (r, 1))
    alpha = float(config.get("lora_alpha", 8))
    scaling = alpha if alpha > 0 else float(r)
    ranknum = float(config.get("init_r", 12))
    return transpose_if(b @ (a * e), fifo) * scaling / (ranknum + 1e-5)


FORMULAS = {"adalora": _adalora_delta}
"""Adapter type → its float64 ΔW."""


def layer_kind(layer: nn.Module, adapter: str) -> str | None:
    """``adalora`` where ``layer`` is PEFT's AdaLoRA layer holding ``adapter``, else None."""
    return "adalora" if holds(layer, adapter, "adalora.layer.AdaLoraLayer", "lora_A") else None
