"""SHiRA (PEFT's ``peft/tuners/shira/``): a sparse ΔW, trained values at saved positions, as float64 ΔW, the
checkpoint parameters it saves, and which of PEFT's layers hold it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from core.methods.reading import AdapterModule, holds, need, no_fan_in_fan_out

PARAMS = ("shira_weight", "shira_indices")
"""The parameter names SHiRA saves per module."""
SHARED_KEYS: dict[str, str] = {}
ADDITIVE = ("shira",)
"""SHiRA merges by adding PEFT's ``get_delta_weight`` (a sparse tensor) to W."""


def _shira_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """SHiRA: a sparse ΔW, ``shira_weight`` at the positions ``shira_indices`` (2, k) lists, zero elsewhere
    (PEFT's scale, 1 on load, is not saved)."""
    no_fan_in_fan_out(config, mod, "SHiRA")
    values = need(mod, "shira_weight", tensors)
    index = tensors[mod.keys["shira_indices"]].long() if "shira_indices" in mod.keys else None
    if index is None or index.shape != (2, values.shape[0]):
        raise ValueError(f"module {mod.module}: shira_indices missing or not (2, {values.shape[0]})")
    delta = torch.zeros(weight.shape, dtype=torch.float64)
    return delta.index_put_((index[0], index[1]), values, accumulate=True)  # repeated positions add up


FORMULAS = {"shira": _shira_delta}
"""Adapter type → its float64 ΔW."""


def layer_kind(layer: nn.Module, adapter: str) -> str | None:
    """``shira`` where ``layer`` is PEFT's SHiRA layer holding ``adapter``, else None."""
    return "shira" if holds(layer, adapter, "shira.layer.ShiraLayer", "shira_weight") else None
