"""VeRA (PEFT's ``peft/tuners/vera/``): a pair of random projections every module shares, scaled by each
module's trained vectors, as float64 ΔW, the checkpoint parameters it saves (the shared pair once, at the
top level), and which of PEFT's layers hold it. Regenerating the pair where it was not saved is
`core.methods.projections`'.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from core.methods.reading import AdapterModule, check_shape, holds, need, need_projections, transpose_if

PARAMS = ("vera_lambda_b", "vera_lambda_d")
"""The parameter names VeRA saves per module (in ParameterDicts: no ``.weight`` suffix)."""
SHARED_KEYS = {"base_model.vera_A": "vera_A", "base_model.vera_B": "vera_B"}
"""Its random projections, one pair shared by every adapted module, saved once at the top level (with
save_projection=True, PEFT's default): checkpoint key → parameter name in each module's keys."""
ADDITIVE = ("vera",)
"""VeRA merges by adding PEFT's ``get_delta_weight`` to W."""


def _vera_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """VeRA: ``(λb · B[:out]) @ (λd · A[:, :in])``, transposed for fan_in_fan_out.

    A (r, ≥in) and B (≥out, r) are the random projections all modules share, sliced to this module;
    λb (out) and λd (r) are its own trained vectors, scaling B's rows and A's rows.
    """
    need_projections(mod, "vera")
    proj_a, proj_b = need(mod, "vera_A", tensors), need(mod, "vera_B", tensors)
    lambda_b, lambda_d = need(mod, "vera_lambda_b", tensors), need(mod, "vera_lambda_d", tensors)
    fifo = bool(config.get("fan_in_fan_out"))
    out_f, in_f = transpose_if(weight, fifo).shape
    r = lambda_d.shape[0]
    if proj_a.ndim != 2 or proj_a.shape[0] != r or proj_a.shape[1] < in_f:
        raise ValueError(
            f"module {mod.module}: vera_A has shape {tuple(proj_a.shape)}, expected ({r}, ≥{in_f}); "
            "was this adapter made for a different base model?"
        )
    if proj_b.ndim != 2 or proj_b.shape[1] != r or proj_b.shape[0] < out_f:
        raise ValueError(
            f"module {mod.module}: vera_B has shape {tuple(proj_b.shape)}, expected (≥{out_f}, {r}); "
            "was this adapter made for a different base model?"
        )
    check_shape(mod, "vera_lambda_b", lambda_b.shape, (out_f,))
    delta = (lambda_b[:, None] * proj_b[:out_f]) @ (lambda_d[:, None] * proj_a[:, :in_f])
    return transpose_if(delta, fifo)


FORMULAS = {"vera": _vera_delta}
"""Adapter type → its float64 ΔW."""


def layer_kind(layer: nn.Module, adapter: str) -> str | None:
    """``vera`` where ``layer`` is PEFT's VeRA layer holding ``adapter``, else None."""
    return "vera" if holds(layer, adapter, "vera.layer.VeraLayer", "vera_lambda_b") else None
