"""Adapter math along two independent paths.

(a) :func:`reference_deltas` computes, per adapted module, the effective weight change
    ``ΔW = W_merged - W`` from the checkpoint tensors alone (adapter file + base weights), in float64
    on the CPU, with each method's merge rule written out in its family's module (`core.methods.families`,
    looked up in `core.methods.registry`) rather than taken from PEFT's layers; this module dispatches to
    them and adds what every method shares (the base weight read, a trained bias, merged weights).
(b) `core.methods.peft_path.peft_delta` computes the same ``ΔW`` on a loaded PEFT layer, in the
    layer's dtype and on its device, with PEFT's own functions, exactly as PEFT's (unsafe, default)
    merge would, without touching the layer.

Comparing the two measures how far a device/dtype drifts from the exact math. Semantics follow the
installed PEFT 0.21.2 (``peft/tuners/<method>/layer.py``). Besides weight
deltas, a bias the adapter trained (``bias="all"``/``"lora_only"``) is a change ``Δb`` under the name
``<module>.bias``; ``lora_bias`` (LoRA's own bias on B) and IA3 scaling the bias of non-feedforward layers are
outside them.

Module names are base-model module paths as they appear in the base state dict without the
``.weight`` suffix, e.g. ``model.layers.0.self_attn.q_proj``; how checkpoint keys map to them is in
`core.methods.adapter_keys`, the config values per module in each family's module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from core.methods.adapter_keys import (
    BIAS_SUFFIX,
    MERGED_TWICE,
    UnreplicatedBase,
    adapter_module_keys,
    adapter_type,
    bias_module,
    replicated_layers,
    saved_module_names,
)
from core.methods.families.lora import base_rewriting_init, olora_residual, pissa_residual, rank_and_scaling
from core.methods.reading import AdapterModule, base_weight, check_shape, need, transpose_if
from core.methods.registry import ADAPTER_TYPES, FORMULAS


def reference_deltas(
    adapter_config: Mapping[str, Any],
    adapter_tensors: Mapping[str, torch.Tensor],
    base_weights: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Per adapted module, ``ΔW = W_merged − W`` in float64 on the CPU, from checkpoint tensors only.

    ``adapter_config`` is the ``adapter_config.json`` dict, ``adapter_tensors`` the adapter file as
    ``safetensors.torch.load_file`` returns it, ``base_weights`` the base model's state dict. Keys of
    the result are module paths (``model.layers.0.self_attn.q_proj``), and ``<module>.bias`` for a bias the
    adapter trained (`bias_delta`: Δb, read against the base's ``<module>.bias``). Rules:

    * LoRA / PiSSA: ``s·B@A``, ``s = alpha/r`` (``alpha/sqrt(r)`` with rsLoRA), rank_pattern and
      alpha_pattern honoured, transposed with fan_in_fan_out; on embeddings ``s·(B@A)ᵀ`` from
      ``lora_embedding_A``/``lora_embedding_B``; on convolutions ``s·Σ_r B[:, r]·A[r]`` over the kernel; on
      a parameter (``target_parameters``, keyed by its path) ``s·B@A``, per expert for a stack of experts.
      For PiSSA this is the change relative to
      the *residual* base PEFT computes in memory when it loads the adapter (``W − top-r SVD``), which
      is what PEFT's ``get_delta_weight`` and merge add; see :func:`merged_weights`.
    * DoRA: ``m ⊙ (W + sBA)/‖W + sBA‖ − W`` with a per-output-row norm.
    * BOFT: ``(R Wᵀ)ᵀ·s − W``; OFT: ``(R Wᵀ)ᵀ − W`` (`families.orthogonal` for the rotations).
    * IA3: ``W ⊙ l − W``.
    * LoHa ``(W1a W1b) ⊙ (W2a W2b)·alpha/r``; LoKr ``(W1 ⊗ W2)·alpha/r``; VeRA ``(λb·B)(λd·A)`` with the
      shared projections sliced to the module; AdaLoRA ``B(A ⊙ E)·alpha/(init_r + 1e-5)`` (Linear only).
    * FourierFT: the real inverse DFT of its sparse spectrum, times ``scaling``; SHiRA: its sparse values.
    * HRA ``W·H − W`` (H: Householder reflections); MiSS its block added to W's input slices (``bat``:
      ``W_ac·B_a + B_a`` per block); RandLoRA the scaled shared random bases' product; DeLoRA
      ``B·diag(λ/(r‖A‖‖B‖))·A`` scaled per input column by the saved norms of W (`core.methods.families`).

    Raises ``ValueError`` naming the module and key when a tensor is missing, a shape does not fit
    the base weight (an adapter made for another base), or the method is not supported.
    """
    kind = adapter_type(adapter_config)
    formula = FORMULAS.get(kind)
    if formula is None:
        raise ValueError(f"adapter type '{kind}' is not supported (supported: {', '.join(ADAPTER_TYPES)})")
    modules = adapter_module_keys(adapter_tensors, saved_module_names(adapter_config))
    if not modules:
        raise ValueError("adapter checkpoint holds no adapter tensors")
    base_weights = _as_loaded(adapter_config, base_weights)
    out = {}
    with torch.no_grad():
        for name, mod in modules.items():
            if mod.bias_key is not None:
                out[name + BIAS_SUFFIX] = bias_delta(mod, adapter_tensors, base_weights)
            if not mod.changes_weight:
                continue
            weight = _module_base_weight(mod, adapter_tensors, base_weights)
            # a convolution's (and a stack of experts') ΔW is written out for plain LoRA; the other rules are for
            # Linear layers
            if weight.ndim != 2 and (kind != "lora" or base_rewriting_init(adapter_config)):
                raise ValueError(
                    f"module {mod.module}: only 2-d (Linear) weights are supported for {kind}, "
                    f"got {tuple(weight.shape)}"
                )
            out[name] = formula(adapter_config, mod, adapter_tensors, weight)
    return out


def _as_loaded(
    adapter_config: Mapping[str, Any], base_weights: Mapping[str, torch.Tensor]
) -> Mapping[str, torch.Tensor]:
    """The base weights by the names the adapter's model has: a LoRA with ``layer_replication`` sees the
    base's layers expanded (each copy reads the layer it copies), any other the base's own names."""
    order = replicated_layers(adapter_config)
    return UnreplicatedBase(base_weights, order) if order else base_weights


def _module_base_weight(
    mod: AdapterModule, adapter_tensors: Mapping[str, torch.Tensor], base_weights: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """The float64 W the adapter is applied to: the adapter's own copy of the base layer when it saved
    one (PEFT loads that copy over the base's), else the base checkpoint's weight."""
    if "base_layer.weight" in mod.keys:
        return need(mod, "base_layer.weight", adapter_tensors)
    return base_weight(mod, base_weights)


def bias_delta(
    mod: AdapterModule, adapter_tensors: Mapping[str, torch.Tensor], base_weights: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """``Δb = b_adapter − b_base`` in float64: the bias an adapter trained (``bias="all"``/``"lora_only"``),
    which PEFT loads over the base's, less the base checkpoint's. Exact: the difference of two float32 (or
    bfloat16, float16) numbers is a float64 number unless their exponents lie more than 29 binades apart."""
    key = mod.module + BIAS_SUFFIX
    if key not in base_weights:
        raise ValueError(
            f"module {mod.module}: the adapter saves a trained bias but the base has no '{key}'; "
            "was this adapter made for a different base model?"
        )
    trained = adapter_tensors[mod.bias_key].detach().to(device="cpu", dtype=torch.float64)
    base = base_weights[key].detach().to(device="cpu", dtype=torch.float64)
    check_shape(mod, "bias", trained.shape, tuple(base.shape))
    return trained - base


def merged_weights(
    adapter_config: Mapping[str, Any],
    adapter_tensors: Mapping[str, torch.Tensor],
    base_weights: Mapping[str, torch.Tensor],
    deltas: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Per adapted module, the merged weight ``W + ΔW`` in float64 (keys as :func:`reference_deltas`).

    For PiSSA, ``W`` is the residual `families.lora.pissa_residual` of the given base weight (what PEFT puts
    in the base layer when it loads a PiSSA adapter), for OLoRA `olora_residual`, so the result
    is what ``merge_and_unload`` gives.
    ``deltas``: :func:`reference_deltas` of the same inputs, where the caller has already computed them.
    """
    if deltas is None:
        deltas = reference_deltas(adapter_config, adapter_tensors, base_weights)
    kind = adapter_type(adapter_config)
    fifo = bool(adapter_config.get("fan_in_fan_out"))
    modules = adapter_module_keys(adapter_tensors, saved_module_names(adapter_config))
    base_weights = _as_loaded(adapter_config, base_weights)
    out: dict[str, torch.Tensor] = {}
    for name, delta in deltas.items():
        module = bias_module(name)
        if module is not None:  # the merged bias is the trained one, which PEFT loaded over the base's
            out[name] = adapter_tensors[modules[module].bias_key].detach().to("cpu", torch.float64)
            continue
        weight = _module_base_weight(modules[name], adapter_tensors, base_weights)
        if kind == "pissa":
            r, _ = rank_and_scaling(adapter_config, name)
            weight = transpose_if(pissa_residual(transpose_if(weight, fifo), r), fifo)
        elif kind == "lora" and base_rewriting_init(adapter_config) == "olora":
            r, scaling = rank_and_scaling(adapter_config, name)
            weight = transpose_if(olora_residual(transpose_if(weight, fifo), r, scaling), fifo)
        # nn.MultiheadAttention's out_proj: PEFT adds its ΔW twice (adapter_keys.OUT_PROJ_TWICE)
        out[name] = weight + 2 * delta if name in adapter_config.get(MERGED_TWICE, ()) else weight + delta
    return out


def sequential_merged_weights(
    adapters: list[tuple[Mapping[str, Any], Mapping[str, torch.Tensor]]],
    base_weights: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Merged weights after merging several adapters one after another, in float64.

    ``adapters`` is a list of ``(adapter_config, adapter_tensors)`` in merge order. Each adapter's
    merge rule is applied to the weight the previous merges left (``W₁ = W₀ + ΔW₁(W₀)``,
    ``W₂ = W₁ + ΔW₂(W₁)``, …), which is what merging them into one model does: the multiplicative
    methods (DoRA, BOFT, OFT, IA3) rotate or scale the already merged weight. Keys are the modules
    any of the adapters adapts; PiSSA is refused because its residual base would have to be taken
    of an already merged weight, which no PEFT load does.
    """
    current = dict(base_weights)
    touched: set[str] = set()
    for config, tensors in adapters:
        if base_rewriting_init(config):
            raise ValueError(
                f"{base_rewriting_init(config)} cannot be merged after another adapter: its base is a residual of W"
            )
        merged = merged_weights(config, tensors, current)
        for name, weight in merged.items():
            current[_base_name(name)] = weight
            touched.add(name)
    return {name: current[_base_name(name)] for name in sorted(touched)}


def _base_name(name: str) -> str:
    """The base tensor a merged name stands for: a bias change's name is the bias, a module's its weight."""
    return name if bias_module(name) is not None else name + ".weight"
