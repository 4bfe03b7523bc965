"""Adapter math, path (b) of `core.methods.formulas`: ``ΔW`` on a loaded PEFT layer, in the layer's
dtype and on its device, with PEFT's own functions, exactly as PEFT's (unsafe, default) merge would,
without touching the layer. Comparing it with the float64 formulas of path (a) measures how far a
device/dtype drifts from the exact math.
"""

from __future__ import annotations

import torch
from torch import nn

from core.methods.registry import ADDITIVE, FAMILY, layer_kind


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
    kind = layer_kind(layer, adapter_name)
    if layer.merged_adapters:
        raise ValueError(f"layer has merged adapters {layer.merged_adapters}; unmerge before peft_delta")
    with torch.no_grad():
        if kind in ADDITIVE:
            delta = layer.get_delta_weight(adapter_name)
            return delta.to_dense() if delta.is_sparse else delta  # SHiRA's is a sparse tensor
        weight = _base_weight(layer.get_base_layer()).detach()
        return FAMILY[kind].peft_delta(layer, adapter_name, kind, weight)


def _base_weight(base: nn.Module) -> torch.Tensor:
    """W of a tuner layer's base layer, a bitsandbytes weight dequantized by PEFT's `dequantize_bnb_weight`.

    Not PEFT's `dequantize_module_weight`: on the CPU it puts an 8-bit weight back with `.to()`, a new
    Int8Params whose scales are gone once the layer has run a forward, and that layer's next forward then
    fails (bitsandbytes 0.50.2); measuring must leave the model as it was."""
    from peft.utils.integrations import dequantize_bnb_weight, dequantize_module_weight

    if type(base.weight).__name__ in ("Params4bit", "Int8Params"):
        return dequantize_bnb_weight(base.weight, state=getattr(base, "state", None))
    return dequantize_module_weight(base)


def peft_delta_source(layer: nn.Module, adapter: str) -> str:
    """Which PEFT functions :func:`peft_delta` uses for this layer and adapter, in words."""
    kind = layer_kind(layer, adapter)
    if kind in ADDITIVE:
        return f"{kind}.get_delta_weight"
    return FAMILY[kind].peft_source(layer, adapter, kind)


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
