"""Quantized bases (`DEVICE/nf4`, `DEVICE/fp4`, `DEVICE/int8`): bitsandbytes' config for a target, and
the quantized layers' weights dequantized, so they compare with the checkpoint like any other tensor.

A target means bitsandbytes' call with its defaults; only what the target's flags name departs from them
(`+compute=`, `+double_quant`). Dequantization is PEFT's own (`dequantize_bnb_weight`), the one its merge
runs, so a weight row reads what merging starts from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from core.spec import Target


def quantization_config(target: Target):
    """`BitsAndBytesConfig` for a quantized target: `load_in_4bit` with its `bnb_4bit_quant_type`, or
    `load_in_8bit`, everything else at bitsandbytes' default unless a flag names it."""
    from transformers import BitsAndBytesConfig

    if target.dtype == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    kwargs = {"load_in_4bit": True, "bnb_4bit_quant_type": target.dtype}
    if target.compute is not None:
        kwargs["bnb_4bit_compute_dtype"] = getattr(torch, target.compute)
    if target.double_quant:
        kwargs["bnb_4bit_use_double_quant"] = True
    return BitsAndBytesConfig(**kwargs)


def _quantized_weight(module: torch.nn.Module) -> bool:
    return type(getattr(module, "weight", None)).__name__ in ("Params4bit", "Int8Params")


def quantized_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Module path → each bitsandbytes layer holding a quantized weight (`Linear4bit`, `Linear8bitLt`)."""
    return {name: m for name, m in model.named_modules() if _quantized_weight(m)}


def dequantize(module: torch.nn.Module) -> torch.Tensor:
    """The float weight a bitsandbytes layer holds, as PEFT dequantizes it to merge (`dequantize_bnb_weight`)."""
    from peft.utils.integrations import dequantize_bnb_weight

    return dequantize_bnb_weight(module.weight, state=getattr(module, "state", None))


def format_note(module: torch.nn.Module) -> str:
    """What a dequantized weight is: its format and block size (4-bit), or LLM.int8's per-row scale."""
    quant_state = getattr(module.weight, "quant_state", None)
    if quant_state is None:
        return "int8 (LLM.int8), one absmax scale per output row; dequantized by PEFT's dequantize_bnb_weight"
    nested = ", double-quantized absmax" if getattr(quant_state, "nested", False) else ""
    return (
        f"{quant_state.quant_type} (bitsandbytes), block size {quant_state.blocksize}{nested}; dequantized "
        f"to {str(quant_state.dtype).removeprefix('torch.')} by PEFT's dequantize_bnb_weight"
    )


def dequantized_state(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The model's state dict with each quantized weight dequantized under its own name, and the
    entries that only hold quantization state (absmax, quant_map, SCB, …) left out; with a note per
    dequantized weight (`format_note`). A model without bitsandbytes layers: its state dict, no notes."""
    state = model.state_dict()
    modules = quantized_modules(model)
    if not modules:
        return state, {}
    out: dict[str, torch.Tensor] = {}
    notes: dict[str, str] = {}
    for name, tensor in state.items():
        owner, _, leaf = name.rpartition(".")
        prefix = next((p for p in modules if name.startswith(f"{p}.")), None)
        if prefix is None:
            out[name] = tensor
        elif owner == prefix and leaf == "weight":
            out[name] = dequantize(modules[prefix])
            notes[name] = format_note(modules[prefix])
        elif owner == prefix and leaf == "bias":
            out[name] = tensor
        # anything else under a quantized layer is its quantization state: part of the weight above
    return out, notes


HELD = "_weightdrift_held"  # `base_state` key of a layer's Held


def is_quantized_layer(layer: torch.nn.Module) -> bool:
    """Whether `layer` (a tuner layer's base layer) holds a bitsandbytes weight."""
    return _quantized_weight(layer)


@dataclass
class Held:
    """A quantized layer's weight as loaded, to put back after a merge: the Parameter itself (PEFT's merge
    into a bitsandbytes layer builds a new one and never writes into the old) and LLM.int8's layer state
    (merging resets it; it holds the int8 weight's row scales once the layer has run)."""

    weight: torch.nn.Parameter
    state: dict[str, Any] | None


def hold(layer: torch.nn.Module) -> Held:
    """What `put_back` needs to give `layer` its loaded quantized weight again."""
    state = getattr(layer, "state", None)
    return Held(weight=layer.weight, state=None if state is None else dict(vars(state)))


def put_back(layer: torch.nn.Module, held: Held) -> None:
    """Give `layer` the weight (and int8 state) `hold` took, whatever merges did since."""
    layer.weight = held.weight
    if held.state is not None:
        vars(layer.state).update(held.state)
