"""Adapter math, path (b) of `core.methods.formulas`: ``ΔW`` on a loaded PEFT layer, in the layer's
dtype and on its device, with PEFT's own functions, exactly as PEFT's (unsafe, default) merge would,
without touching the layer. Comparing it with the float64 formulas of path (a) measures how far a
device/dtype drifts from the exact math.
"""

from __future__ import annotations

import torch
from torch import nn

from core.methods.formulas import ADDITIVE


def _kind_of_layer(layer: nn.Module, adapter: str) -> str:
    """Which merge rule a PEFT tuner layer uses for ``adapter`` (lora, dora, boft, oft, ia3, loha, lokr,
    vera, adalora, fourierft, shira, hra, miss, randlora, delora)."""
    from peft.tuners.adalora import layer as adalora
    from peft.tuners.boft import layer as boft
    from peft.tuners.delora import layer as delora
    from peft.tuners.fourierft import layer as fourierft
    from peft.tuners.hra import layer as hra
    from peft.tuners.ia3 import layer as ia3
    from peft.tuners.loha import layer as loha
    from peft.tuners.lokr import layer as lokr
    from peft.tuners.lora import layer as lora
    from peft.tuners.miss import layer as miss
    from peft.tuners.oft import layer as oft
    from peft.tuners.randlora import layer as randlora
    from peft.tuners.shira import layer as shira
    from peft.tuners.vera import layer as vera

    # (layer class, the dict of its adapters, kind), first match wins: AdaLoRA's layers are LoraLayers too,
    # so they are asked first; LoRA's dict is either of two, and DoRA is one of its variants (below)
    by_class = (
        (adalora.AdaLoraLayer, "lora_A", "adalora"),
        (loha.LoHaLayer, "_available_adapters", "loha"),
        (lokr.LoKrLayer, "_available_adapters", "lokr"),
        (vera.VeraLayer, "vera_lambda_b", "vera"),
        (lora.LoraLayer, "", "lora"),
        (boft.BOFTLayer, "boft_R", "boft"),
        (oft.OFTLayer, "oft_R", "oft"),
        (ia3.IA3Layer, "ia3_l", "ia3"),
        (fourierft.FourierFTLayer, "fourierft_spectrum", "fourierft"),
        (shira.ShiraLayer, "shira_weight", "shira"),
        (hra.HRALayer, "hra_u", "hra"),
        (miss.MissLayer, "miss_block", "miss"),
        (randlora.RandLoraLayer, "randlora_lambda", "randlora"),
        (delora.DeloraLayer, "delora_A", "delora"),
    )
    kind = None
    for cls, holder, name in by_class:
        if not isinstance(layer, cls):
            continue
        if name != "lora" and adapter in getattr(layer, holder):
            kind = name
            break
        if name == "lora" and (adapter in layer.lora_A or adapter in layer.lora_embedding_A):
            variant = layer.lora_variant.get(adapter)
            if variant is not None and type(variant).__name__ != "DoraLinearVariant":
                raise ValueError(f"LoRA variant {type(variant).__name__} is not supported by peft_delta")
            kind = "lora" if variant is None else "dora"
            break
    if kind is None:
        raise ValueError(f"layer {type(layer).__name__} has no supported adapter '{adapter}'")
    # The additive methods merge by adding get_delta_weight for every layer type; the other rules
    # below are written for Linear layers (conv and embedding variants reshape or transpose differently).
    # PEFT's bitsandbytes layers (QLoRA's QDoRA, IA3 on a 4- or 8-bit base) are Linear layers over a
    # quantized W, which `peft_delta` dequantizes as their merge and forward do.
    linear = {
        "dora": (lora.Linear, *_bnb_layers("lora")),
        "boft": (boft.Linear,),
        "oft": (oft.Linear,),
        "ia3": (ia3.Linear, *_bnb_layers("ia3")),
        "hra": (hra.HRALinear,),
        "miss": (miss.MissLinear,),
    }.get(kind)
    if linear is not None and not isinstance(layer, linear):
        raise ValueError(f"peft_delta supports {kind} on Linear layers only, not {type(layer).__name__}")
    return kind


def _bnb_layers(tuner: str) -> tuple[type, ...]:
    """PEFT's bitsandbytes Linear layers of `tuner` (lora, ia3): those this install has."""
    import importlib

    module = importlib.import_module(f"peft.tuners.{tuner}.bnb")
    return tuple(getattr(module, name) for name in ("Linear8bitLt", "Linear4bit") if hasattr(module, name))


def peft_delta(layer: nn.Module, adapter_name: str) -> torch.Tensor:
    """``ΔW`` of ``adapter_name`` on a loaded PEFT layer, as PEFT computes it, before it meets ``W``.

    Runs on the layer's device with PEFT's own functions, in the dtype PEFT computes the adapter in
    (PEFT keeps adapters in float32 on a bfloat16 model by default): LoRA/PiSSA, LoHa, LoKr, VeRA and
    AdaLoRA, FourierFT, SHiRA, RandLoRA and DeLoRA ``get_delta_weight`` as is (their merge adds it to W);
    HRA ``W·H − W`` with its ``get_delta_weight`` H (the reflections); MiSS its ``get_delta_weight_miss``
    of a zero W (its block laid over W's inputs, what its merge adds), with ``init_weights="bat"`` its
    ``get_delta_weight`` of W; DoRA ``m/‖W+ΔW‖ ⊙ (W+ΔW) − W``
    with the DoRA module's ``get_weight_norm``; BOFT ``get_delta_weight`` → (rotation, scale) applied
    to ``W``; OFT ``get_delta_weight`` → rotation
    applied to ``W``; IA3 ``W * ia3_l − W``. The multiplicative methods need ``W``: it is upcast
    exactly to the adapter's dtype. Rounding the merged weight back into ``W``'s dtype is the merge
    check's concern, not this one's.

    The layer is never modified (weights stay bitwise equal). Raises ``ValueError`` if an adapter is
    already merged into the layer, since ``W`` is then no longer the base weight.
    """
    from peft.utils.other import transpose

    kind = _kind_of_layer(layer, adapter_name)
    if layer.merged_adapters:
        raise ValueError(f"layer has merged adapters {layer.merged_adapters}; unmerge before peft_delta")
    with torch.no_grad():
        if kind in ADDITIVE:
            delta = layer.get_delta_weight(adapter_name)
            return delta.to_dense() if delta.is_sparse else delta  # SHiRA's is a sparse tensor
        weight = _base_weight(layer.get_base_layer()).detach()
        if kind == "dora":
            delta = layer.get_delta_weight(adapter_name)
            w = weight.to(delta.dtype)
            dora = layer.lora_magnitude_vector[adapter_name]
            # __wrapped__ skips PEFT's cache decorator, which would clear the DoRA module's cache
            norm = type(dora).get_weight_norm.__wrapped__(
                dora, w, transpose(delta, layer.fan_in_fan_out), scaling=1
            )
            factor = transpose((dora.weight / norm).view(-1, 1), layer.fan_in_fan_out)
            return factor * (w + delta) - w
        if kind == "boft":
            rotation, scale = layer.get_delta_weight(adapter_name)
            w = weight.to(rotation.dtype)
            return torch.mm(rotation, w.t()).t() * scale - w
        if kind == "oft":
            module = layer.oft_R[adapter_name]
            # with coft, get_weight writes the projected parameters back: restore them afterwards
            saved = module.weight.detach().clone() if module.coft else None
            try:
                rotation = layer.get_delta_weight(adapter_name)
            finally:
                if saved is not None:
                    module.weight.copy_(saved)
            w = weight.to(rotation.dtype)
            return torch.mm(rotation, w.t()).t() - w
        if kind == "hra":
            reflections = layer.get_delta_weight(adapter_name)
            w = weight.to(reflections.dtype)
            return torch.mm(w, reflections) - w
        if kind == "miss":
            return _miss_delta(layer, adapter_name, weight)
        # IA3's bitsandbytes layers have no fan_in_fan_out: W is stored (out, in) there
        scale = transpose(layer.ia3_l[adapter_name].detach(), getattr(layer, "fan_in_fan_out", False))
        w = weight.to(scale.dtype)
        return w * scale - w


def _base_weight(base: nn.Module) -> torch.Tensor:
    """W of a tuner layer's base layer, a bitsandbytes weight dequantized by PEFT's `dequantize_bnb_weight`.

    Not PEFT's `dequantize_module_weight`: on the CPU it puts an 8-bit weight back with `.to()`, a new
    Int8Params whose scales are gone once the layer has run a forward, and that layer's next forward then
    fails (bitsandbytes 0.50.2); measuring must leave the model as it was."""
    from peft.utils.integrations import dequantize_bnb_weight, dequantize_module_weight

    if type(base.weight).__name__ in ("Params4bit", "Int8Params"):
        return dequantize_bnb_weight(base.weight, state=getattr(base, "state", None))
    return dequantize_module_weight(base)


def _miss_delta(layer: nn.Module, adapter: str, weight: torch.Tensor) -> torch.Tensor:
    """MiSS's ΔW with PEFT's own functions: ``get_delta_weight(W)`` for ``bat`` (it returns ΔW); otherwise
    its merge function on a zero W, which returns exactly what the merge adds to W."""
    block = layer.miss_block[adapter]
    saved = block.data
    try:
        if layer.miss_fn == "bat":
            return layer.get_delta_weight(adapter, weight)
        return layer.get_delta_weight_miss(adapter, torch.zeros_like(weight, dtype=block.dtype))
    finally:
        # a half-precision block on the CPU is written back by both (with "mini": repeated, a new shape)
        block.data = saved


def peft_delta_source(layer: nn.Module, adapter: str) -> str:
    """Which PEFT functions :func:`peft_delta` uses for this layer and adapter, in words."""
    kind = _kind_of_layer(layer, adapter)
    if kind in ADDITIVE:
        return f"{kind}.get_delta_weight"
    if kind == "dora":
        return "lora.get_delta_weight + DoraLinearLayer.get_weight_norm: m/‖W+ΔW‖ ⊙ (W+ΔW)"
    if kind == "boft":
        how = "fbd_cuda" if getattr(layer, "fbd_cuda_available", False) else "torch.block_diag"
        return f"boft.get_delta_weight (rotation, scale) applied to W, block diagonal via {how}"
    if kind == "oft":
        module = layer.oft_R[adapter]
        if module.use_cayley_neumann:
            how = f"Cayley-Neumann series, {module.num_cayley_neumann_terms} terms"
        else:
            how = "exact Cayley (linalg.solve)"
        coft = ", coft projection" if module.coft else ""
        return f"oft.get_delta_weight rotation ({how}{coft}) applied to W"
    if kind == "hra":
        how = "Gram–Schmidt, I − 2QQᵀ" if layer.hra_apply_GS[adapter] else "a product of reflections"
        return f"hra.get_delta_weight H ({how}) applied to W: W·H − W"
    if kind == "miss":
        if layer.miss_fn == "bat":
            return "miss.get_delta_weight of W (W_ac·B_a + B_a per block)"
        return "miss.get_delta_weight_miss of a zero W (its block laid over W's input slices)"
    dim = "input dim (feedforward)" if layer.is_feedforward else "output dim"
    return f"ia3_l scaling W along the {dim}"


PEFT_ADDITIVE = ("vblora", "c3a", "gralora", "waveft")
"""Methods with no float64 formula here whose PEFT merge adds the layer's ``get_delta_weight`` to W (PEFT
0.21.2's ``<method>/layer.py``; WaveFT's transposed for fan_in_fan_out): their ΔW is PEFT's own function, its
reference the same function on a float64 copy of the layer (:func:`float64_peft_delta`)."""
PEFT_OWN = "PEFT's own get_delta_weight in float64"
"""The reference label of those methods' ΔW (W + it for their merged weights)."""


def float64_peft_delta(layer: nn.Module, adapter_name: str) -> torch.Tensor:
    """``get_delta_weight(adapter_name)`` of a float64 copy of ``layer`` on the CPU: PEFT's own ΔW computed in
    float64 from the tensors the layer holds (the adapter file's values, which the weights check compares
    bit for bit: PEFT keeps a float32 adapter float32 on a half-precision model). The layer is not touched."""
    import copy

    with torch.no_grad():
        twin = copy.deepcopy(layer).to(device="cpu", dtype=torch.float64)
        delta = twin.get_delta_weight(adapter_name)
    return delta.to_dense() if delta.is_sparse else delta


def own_references(
    layers: dict[str, nn.Module], adapter: str, kind: str, base: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor, str]]:
    """module → (ΔW, W + ΔW, note) in float64 by :func:`float64_peft_delta`, for a method of
    :data:`PEFT_ADDITIVE` (its merge adds ΔW to W), W from ``base`` (the checkpoint's weights by module)."""
    note = f"{kind}: {PEFT_OWN} (no float64 formula of the method here)"
    out = {}
    for module, layer in layers.items():
        weight = base.get(f"{module}.weight")
        if weight is not None:
            delta = float64_peft_delta(layer, adapter)
            out[module] = (delta, weight.to(torch.float64) + delta, note)
    return out
