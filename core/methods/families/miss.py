"""MiSS (PEFT's ``peft/tuners/miss/``): a trained block laid over W's input slices (``bat``: added per block
of W, times it), as float64 ΔW (written out from PEFT 0.21.2's ``layer.py``, not taken from it), the
checkpoint parameter it saves, and how PEFT's layers give its ΔW.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from core.methods.reading import AdapterModule, check_shape, config_rank, holds, need, require_linear

PARAMS = ("miss_block",)
"""The parameter name MiSS saves per module."""
SHARED_KEYS: dict[str, str] = {}
ADDITIVE = ()
"""None: its ``bat`` form depends on W, and the others' ΔW comes from its merge function."""


def miss_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """MiSS, by its ``init_weights``:

    * default (True/False): ``miss_block`` B (r, out) is added to every r-wide slice of W's inputs,
      ``ΔW[o, j] = B[j mod r, o]`` (the last, narrower slice takes B's first rows): ΔW does not depend on W;
    * ``"mini"``: B (r, mini_r) repeated along the outputs, ``ΔW[o, j] = B[j mod r, o mod mini_r]``;
    * ``"bat"``: B (out/r, r, r), one r×r block per block row of W: each r×r block W_ac of W (block row a,
      block column c) becomes ``W_ac + W_ac·B_a + B_a``, so ΔW_ac = W_ac·B_a + B_a depends on W.
    """
    block = need(mod, "miss_block", tensors)
    out_f, in_f = weight.shape
    r = config_rank(config, mod.module)
    init = config.get("init_weights", True)
    if init == "bat":
        if out_f % r or in_f % r:
            raise ValueError(
                f"module {mod.module}: MiSS 'bat' needs W {tuple(weight.shape)} in {r}×{r} blocks"
            )
        check_shape(mod, "miss_block", block.shape, (out_f // r, r, r))
        blocks = weight.reshape(out_f // r, r, in_f // r, r)  # [a, i, c, k] = W[a·r + i, c·r + k]
        delta = torch.einsum("aick,akl->aicl", blocks, block) + block[:, :, None, :]
        return delta.reshape(out_f, in_f)
    rows = torch.arange(in_f) % r
    if init == "mini":
        mini_r = int(config.get("mini_r", 1))
        if out_f % mini_r:
            raise ValueError(
                f"module {mod.module}: MiSS 'mini' needs out_features {out_f} divisible by {mini_r}"
            )
        check_shape(mod, "miss_block", block.shape, (r, mini_r))
        cols = torch.arange(out_f) % mini_r
        return block[rows][:, cols].T
    check_shape(mod, "miss_block", block.shape, (r, out_f))
    return block[rows].T


FORMULAS = {"miss": miss_delta}
"""Adapter type → its float64 ΔW."""


def layer_kind(layer: nn.Module, adapter: str) -> str | None:
    """``miss`` where ``layer`` is PEFT's MiSS layer holding ``adapter``, else None; a ValueError for one that is
    not Linear."""
    from peft.tuners.miss import layer as miss

    if not holds(layer, adapter, "miss.layer.MissLayer", "miss_block"):
        return None
    return require_linear(layer, "miss", (miss.MissLinear,))


def peft_delta(layer: nn.Module, adapter_name: str, kind: str, weight: torch.Tensor) -> torch.Tensor:
    """MiSS's ΔW with PEFT's own functions: ``get_delta_weight(W)`` for ``bat`` (it returns ΔW); otherwise
    its merge function on a zero W, which returns exactly what the merge adds to W."""
    block = layer.miss_block[adapter_name]
    saved = block.data
    try:
        if layer.miss_fn == "bat":
            return layer.get_delta_weight(adapter_name, weight)
        return layer.get_delta_weight_miss(adapter_name, torch.zeros_like(weight, dtype=block.dtype))
    finally:
        # a half-precision block on the CPU is written back by both (with "mini": repeated, a new shape)
        block.data = saved


def peft_source(layer: nn.Module, adapter: str, kind: str) -> str:
    """Which PEFT functions :func:`peft_delta` uses for this layer, in words."""
    if layer.miss_fn == "bat":
        return "miss.get_delta_weight of W (W_ac·B_a + B_a per block)"
    return "miss.get_delta_weight_miss of a zero W (its block laid over W's input slices)"
