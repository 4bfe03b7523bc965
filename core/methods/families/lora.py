"""LoRA and its variants as PEFT's ``peft/tuners/lora/`` keeps them: plain LoRA (rsLoRA's scaling, rank and
alpha patterns, on Linear, embedding, convolution layers and on parameters with ``target_parameters``), DoRA
(``use_dora``), and the inits that rewrite the base weight at load (PiSSA, OLoRA), each as its float64 ΔW,
the checkpoint parameters it saves, and how its tensors are read from PEFT's layers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from core.methods.reading import (
    AdapterModule,
    bnb_layers,
    check_shape,
    need,
    pattern_value,
    require_linear,
    transpose_if,
)

PARAMS = (
    "lora_magnitude_vector",
    "lora_embedding_A",
    "lora_embedding_B",
    "lora_A.weight",
    "lora_B.weight",
    "lora_B.bias",
)
"""The parameter names LoRA saves per module (DoRA's magnitude too)."""
SHARED_KEYS: dict[str, str] = {}
ADDITIVE = ("lora",)
"""The layer kinds whose merge adds PEFT's ``get_delta_weight`` to W as it is (DoRA's depends on W)."""
PEFT_TYPE = "LORA"

PARAMETER_LAYOUT = "weightdrift:target_parameters"
"""The key under which `core.models.merging.adapter_files` adds to a ``target_parameters`` LoRA's config
dict the parameters it adapts: parameter path → whether PEFT reads a 3-d one as (experts, out, in), the
layout of `core.models.conversion.targeted_parameters` (its file's keys renamed to those paths)."""


def variant(adapter_config: Mapping[str, Any]) -> str:
    """The adapter type of a LoRA config: ``dora`` with ``use_dora``, ``pissa`` where ``init_lora_weights`` is
    a string starting with ``pissa``, else ``lora``."""
    if adapter_config.get("use_dora"):
        return "dora"
    init = adapter_config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith("pissa"):
        return "pissa"
    return "lora"


def rank_and_scaling(config: Mapping[str, Any], module: str) -> tuple[int, float]:
    """LoRA rank and scaling for one module: ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA)."""
    r = int(pattern_value(config.get("rank_pattern"), module, config.get("r", 8)))
    alpha = float(pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", 8)))
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return r, scaling


# --------------------------------------------------------------------------------------------------
# Float64 ΔW from the adapter file
# --------------------------------------------------------------------------------------------------


def _lora_embedding_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """LoRA on ``nn.Embedding``: ``(B@A)ᵀ·s`` with A ``(r, num_embeddings)`` and B ``(dim, r)``.

    Same as PEFT's ``lora.Embedding.get_delta_weight`` (which transposes unconditionally:
    fan_in_fan_out plays no part for embeddings).
    """
    a = need(mod, "lora_embedding_A", tensors)
    b = need(mod, "lora_embedding_B", tensors)
    r, scaling = rank_and_scaling(config, mod.module)
    num_embeddings, dim = weight.shape
    check_shape(mod, "lora_embedding_A", a.shape, (r, num_embeddings))
    check_shape(mod, "lora_embedding_B", b.shape, (dim, r))
    return (b @ a).T * scaling


def _lora_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """``s·B@A``, transposed for fan_in_fan_out; shapes checked against the config rank and the base."""
    if "lora_embedding_A" in mod.keys or "lora_embedding_B" in mod.keys:
        return _lora_embedding_delta(config, mod, tensors, weight)
    if "lora_B.bias" in mod.keys:
        raise ValueError(
            f"module {mod.module}: lora_bias changes the bias, which reference_deltas does not cover"
        )
    a = need(mod, "lora_A.weight", tensors)
    b = need(mod, "lora_B.weight", tensors)
    r, scaling = rank_and_scaling(config, mod.module)
    layout = config.get(PARAMETER_LAYOUT) or {}
    if mod.module in layout and weight.ndim == 3:
        return _lora_experts_delta(mod, a, b, r, scaling, weight, layout[mod.module])
    if weight.ndim > 2:
        return _lora_conv_delta(mod, a, b, r, scaling, weight)
    fifo = bool(config.get("fan_in_fan_out"))
    out_f, in_f = transpose_if(weight, fifo).shape
    check_shape(mod, "lora_A.weight", a.shape, (r, in_f))
    check_shape(mod, "lora_B.weight", b.shape, (out_f, r))
    return transpose_if(scaling * (b @ a), fifo)


def _lora_conv_delta(
    mod: AdapterModule, a: torch.Tensor, b: torch.Tensor, r: int, scaling: float, weight: torch.Tensor
) -> torch.Tensor:
    """LoRA on a convolution: A is a convolution with W's kernel (r, in, *k), B a 1×1 one (out, r, 1…), so
    ``ΔW[o, i, …] = s·Σ_r B[o, r]·A[r, i, …]`` (PEFT's Conv get_delta_weight, a convolution of A by B)."""
    out_f, in_f, *kernel = weight.shape
    check_shape(mod, "lora_A.weight", a.shape, (r, in_f, *kernel))
    check_shape(mod, "lora_B.weight", b.shape, (out_f, r, *[1] * len(kernel)))
    return scaling * torch.einsum("or,ri...->oi...", b.reshape(out_f, r), a)


def _lora_experts_delta(
    mod: AdapterModule,
    a: torch.Tensor,
    b: torch.Tensor,
    r: int,
    scaling: float,
    weight: torch.Tensor,
    out_in: bool,
) -> torch.Tensor:
    """LoRA on a 3-d parameter (``target_parameters``: a stack of E experts' weights): one rank-r pair per
    expert, A (E·r, in) read expert-major (row e·r + k) and B (out, r·E) rank-major (column k·E + e), as
    PEFT's ``ParamWrapper`` reshapes them: ``ΔW[e] = s·Σ_k B[:, k·E + e] ⊗ A[e·r + k]``, laid out (E, out, in)
    where PEFT reads the parameter so (``out_in``), else (E, in, out)."""
    experts = weight.shape[0]
    in_f, out_f = (weight.shape[2], weight.shape[1]) if out_in else (weight.shape[1], weight.shape[2])
    check_shape(mod, "lora_A.weight", a.shape, (r * experts, in_f))
    check_shape(mod, "lora_B.weight", b.shape, (out_f, r * experts))
    per_a = a.reshape(experts, r, in_f)  # [e, k, i]
    per_b = b.reshape(out_f, r, experts)  # [o, k, e]
    return scaling * torch.einsum("oke,eki->eoi" if out_in else "oke,eki->eio", per_b, per_a)


def _dora_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """``m ⊙ (W + sBA) / ‖W + sBA‖_row − W`` (the norm of each output row over the input dim).

    Same as PEFT's DoRA merge for Linear: the norm is taken of the unmerged weight plus the LoRA
    delta and is a constant there (detached), which changes nothing for the value.
    """
    if "lora_embedding_A" in mod.keys:
        raise ValueError(f"module {mod.module}: DoRA on embeddings is not supported by reference_deltas")
    fifo = bool(config.get("fan_in_fan_out"))
    lora = transpose_if(_lora_delta(config, mod, tensors, weight), fifo)  # (out, in)
    w = transpose_if(weight, fifo)
    magnitude = need(mod, "lora_magnitude_vector", tensors)
    check_shape(mod, "lora_magnitude_vector", magnitude.shape, (w.shape[0],))
    v = w + lora
    norm = torch.linalg.vector_norm(v, dim=1)
    merged = (magnitude / norm).unsqueeze(1) * v
    return transpose_if(merged - w, fifo)


FORMULAS = {"lora": _lora_delta, "dora": _dora_delta, "pissa": _lora_delta}
"""Adapter type → its float64 ΔW (PiSSA's relative to the residual base PEFT computes at load)."""


# --------------------------------------------------------------------------------------------------
# Inits that rewrite the base weight at load (PiSSA, OLoRA)
# --------------------------------------------------------------------------------------------------


def pissa_residual(weight: torch.Tensor, r: int) -> torch.Tensor:
    """``W`` minus its best rank-``r`` approximation (exact SVD, float64): PiSSA's residual base weight.

    PEFT computes the same in float32 (``init_lora_weights="pissa"``) or with a randomized
    ``svd_lowrank`` (``"pissa_niter_K"``), so its residual differs from this at float32 level or by
    the randomized approximation error. Sign ambiguities of singular vectors cancel in the product.
    """
    w = weight.detach().to(device="cpu", dtype=torch.float64)
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    return w - u[:, :r] @ torch.diag(s[:r]) @ vh[:r]


def olora_residual(weight: torch.Tensor, r: int, scaling: float) -> torch.Tensor:
    """``W − scaling·Q_r R_r`` from the QR decomposition ``W = QR`` (float64): OLoRA's residual base weight.

    PEFT (``init_lora_weights="olora"``) computes the same in float32. A sign flip of a column of Q
    comes with the same flip of that row of R, so the product does not depend on it.
    """
    w = weight.detach().to(device="cpu", dtype=torch.float64)
    q, rr = torch.linalg.qr(w)
    return w - scaling * (q[:, :r] @ rr[:r])


def base_rewriting_init(adapter_config: Mapping[str, Any]) -> str | None:
    """``pissa`` or ``olora`` for a LoRA whose init rewrites the base weight on load, else None."""
    init = adapter_config.get("init_lora_weights")
    if not isinstance(init, str):
        return None
    init = init.lower()
    return "pissa" if init.startswith("pissa") else "olora" if init == "olora" else None


# What a base-rewriting init computes on the load device when PEFT loads the adapter, in words
_REWRITES = {"pissa": "SVD on the load device", "olora": "QR on the load device"}


def base_rewrite(adapter_config: Mapping[str, Any]) -> str | None:
    """How a LoRA whose init rewrites the base weight at load computes the new one, in words
    (``SVD on the load device``); None for an adapter that leaves the base as the checkpoint has it."""
    init = base_rewriting_init(adapter_config)
    if init is None:
        return None
    if "_niter_" in str(adapter_config.get("init_lora_weights")):
        return "randomised SVD on the load device"
    return _REWRITES[init]


def rewritten_base(adapter_config: Mapping[str, Any], module: str, weight: torch.Tensor) -> torch.Tensor:
    """The weight PEFT writes into ``module``'s base layer when it loads the adapter, in float64 from
    the checkpoint's ``weight``: PiSSA's residual (exact SVD; ``pissa_niter_K``'s randomised SVD
    differs from it by its approximation error) or OLoRA's. ValueError for an init that rewrites none."""
    init = base_rewriting_init(adapter_config)
    fifo = bool(adapter_config.get("fan_in_fan_out"))
    r, scaling = rank_and_scaling(adapter_config, module)
    w = transpose_if(weight.to(torch.float64), fifo)
    if init == "pissa":
        return transpose_if(pissa_residual(w, r), fifo)
    if init == "olora":
        return transpose_if(olora_residual(w, r, scaling), fifo)
    raise ValueError(
        f"the adapter's init ({adapter_config.get('init_lora_weights')!r}) rewrites no base weight"
    )


# --------------------------------------------------------------------------------------------------
# PEFT's layers
# --------------------------------------------------------------------------------------------------


def layer_kind(layer: nn.Module, adapter: str) -> str | None:
    """``lora`` or ``dora`` where ``layer`` is PEFT's LoRA layer holding ``adapter``, else None (AdaLoRA's layers
    are LoRA layers too: they are AdaLoRA's); a ValueError for another LoRA variant, or DoRA on a layer that
    is not Linear."""
    from peft.tuners.adalora.layer import AdaLoraLayer
    from peft.tuners.lora import layer as lora

    if not isinstance(layer, lora.LoraLayer) or isinstance(layer, AdaLoraLayer):
        return None
    if adapter not in layer.lora_A and adapter not in layer.lora_embedding_A:
        return None
    used = layer.lora_variant.get(adapter)
    if used is not None and type(used).__name__ != "DoraLinearVariant":
        raise ValueError(f"LoRA variant {type(used).__name__} is not supported by peft_delta")
    if used is None:
        return "lora"
    # PEFT's bitsandbytes layers (QLoRA's QDoRA) are Linear layers over a quantized W, which `peft_delta`
    # dequantizes as their merge and forward do
    return require_linear(layer, "dora", (lora.Linear, *bnb_layers("lora")))


def peft_delta(layer: nn.Module, adapter_name: str, kind: str, weight: torch.Tensor) -> torch.Tensor:
    """DoRA's ΔW with PEFT's functions: ``m/‖W+ΔW‖ ⊙ (W+ΔW) − W``, the norm by the DoRA module's
    ``get_weight_norm``, W upcast exactly to the adapter's dtype."""
    from peft.utils.other import transpose

    delta = layer.get_delta_weight(adapter_name)
    w = weight.to(delta.dtype)
    dora = layer.lora_magnitude_vector[adapter_name]
    # __wrapped__ skips PEFT's cache decorator, which would clear the DoRA module's cache
    norm = type(dora).get_weight_norm.__wrapped__(dora, w, transpose(delta, layer.fan_in_fan_out), scaling=1)
    factor = transpose((dora.weight / norm).view(-1, 1), layer.fan_in_fan_out)
    return factor * (w + delta) - w


def peft_source(layer: nn.Module, adapter: str, kind: str) -> str:
    """Which PEFT functions :func:`peft_delta` uses, in words."""
    return "lora.get_delta_weight + DoraLinearLayer.get_weight_norm: m/‖W+ΔW‖ ⊙ (W+ΔW)"
