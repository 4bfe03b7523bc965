"""What every PEFT method's module (`core.methods.families`) reads with: one adapted module's tensors in an
adapter file (:class:`AdapterModule`), each as a float64 tensor or a ValueError naming what is missing or
does not fit the base (:func:`need`, :func:`base_weight`, :func:`check_shape`), the config values per module
(:func:`pattern_value`, :func:`config_rank`), and PEFT's layers (:func:`holds`, :func:`require_linear`,
:func:`bnb_layers`).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

BIAS_PARAMS = ("base_layer.bias", "bias")
"""The parameter names of a trained bias in an adapter checkpoint (bias="all" or "lora_only")."""


@dataclass(frozen=True)
class AdapterModule:
    """The tensors one adapted module holds in an adapter checkpoint."""

    module: str
    """Base-model module path, e.g. ``model.layers.0.self_attn.q_proj``."""
    keys: dict[str, str]
    """Parameter name (``lora_A.weight``, ``boft_R``, ...) -> key in the checkpoint."""
    shared: frozenset[str] = field(default=frozenset())
    """The parameter names among ``keys`` that are shared projections every module lists (VeRA's, RandLoRA's)."""

    @property
    def bias_key(self) -> str | None:
        """The checkpoint key of the bias the adapter trained for this module, if it saves one."""
        return next((self.keys[p] for p in BIAS_PARAMS if p in self.keys), None)

    @property
    def changes_weight(self) -> bool:
        """Whether the module has tensors of its own besides a trained bias (a module of bias="all" that
        is not adapted has only its bias; the shared projections every module lists are not its own)."""
        return any(p not in BIAS_PARAMS and p not in self.shared for p in self.keys)


# --------------------------------------------------------------------------------------------------
# Config values per module
# --------------------------------------------------------------------------------------------------


def pattern_value(patterns: Mapping[str, Any] | None, module: str, default: Any) -> Any:
    """Value of the first ``rank_pattern``/``alpha_pattern`` key matching ``module``, else ``default``.

    Same rule as PEFT's ``get_pattern_key``: a key matches when it matches the end of the module
    path at a dot boundary, as a regular expression; the first matching key in dict order wins.
    """
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def config_rank(config: Mapping[str, Any], module: str, default: int = 8) -> int:
    """The rank ``r`` of ``module``: its ``rank_pattern`` value, else the config's ``r`` (``default``)."""
    return int(pattern_value(config.get("rank_pattern"), module, config.get("r", default)))


# --------------------------------------------------------------------------------------------------
# A module's tensors, as the float64 formulas read them
# --------------------------------------------------------------------------------------------------


def need(mod: AdapterModule, param: str, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The float64 tensor of ``param`` of ``mod``, or a ValueError naming what is missing."""
    key = mod.keys.get(param)
    if key is None:
        raise ValueError(
            f"module {mod.module}: adapter checkpoint lacks '{param}' (has: {', '.join(sorted(mod.keys))})"
        )
    return tensors[key].detach().to(device="cpu", dtype=torch.float64)


def need_projections(mod: AdapterModule, method: str) -> None:
    """VeRA's and RandLoRA's shared random pair (`{method}_A`, `{method}_B`) must be among the module's
    tensors: saved in the file, or added by the regeneration."""
    if f"{method}_A" not in mod.keys or f"{method}_B" not in mod.keys:
        raise ValueError(
            f"module {mod.module}: the adapter file holds no {method}_A/{method}_B (saved with "
            "save_projection=False: PEFT regenerates them from projection_prng_key); add them with "
            "core.methods.projections.regenerate (core.models.merging.adapter_files does)"
        )


def base_weight(mod: AdapterModule, base_weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The float64 base weight of ``mod``, or a ValueError saying the adapter does not fit this base."""
    key = mod.module + ".weight"
    if key not in base_weights and mod.module in base_weights:  # a parameter LoRA targets (target_parameters)
        key = mod.module
    if key not in base_weights:
        example = next(iter(base_weights), "<empty>")
        raise ValueError(
            f"module {mod.module}: base weights have no '{key}' (e.g. they have '{example}'); "
            "was this adapter made for a different base model?"
        )
    return base_weights[key].detach().to(device="cpu", dtype=torch.float64)


def check_shape(
    mod: AdapterModule, what: str, got: torch.Size | tuple[int, ...], want: tuple[int, ...]
) -> None:
    """ValueError naming the module when a tensor shape disagrees with the base weight."""
    if tuple(got) != tuple(want):
        raise ValueError(
            f"module {mod.module}: {what} has shape {tuple(got)} but the base weight needs {tuple(want)}; "
            "was this adapter made for a different base model?"
        )


def transpose_if(x: torch.Tensor, fan_in_fan_out: bool) -> torch.Tensor:
    """Transpose when the base stores its weight as (in, out) (GPT-2 style Conv1D)."""
    return x.T if fan_in_fan_out else x


def no_fan_in_fan_out(config: Mapping[str, Any], mod: AdapterModule, kind: str) -> None:
    """ValueError naming the module where the config sets ``fan_in_fan_out`` for a method (``kind``) whose
    formula is written for weights stored (out, in)."""
    if config.get("fan_in_fan_out"):
        raise ValueError(
            f"module {mod.module}: {kind} with fan_in_fan_out is not supported by reference_deltas"
        )


# --------------------------------------------------------------------------------------------------
# PEFT's layers
# --------------------------------------------------------------------------------------------------


def holds(layer: nn.Module, adapter: str, layer_class: str, adapters: str) -> bool:
    """Whether ``layer`` is an instance of PEFT's ``peft.tuners.<layer_class>`` (``"ia3.layer.IA3Layer"``) with
    ``adapter`` among the names of its dict (or set) ``adapters`` (``"ia3_l"``)."""
    module, _, name = f"peft.tuners.{layer_class}".rpartition(".")
    return isinstance(layer, getattr(importlib.import_module(module), name)) and adapter in getattr(
        layer, adapters
    )


def require_linear(layer: nn.Module, kind: str, linear: tuple[type, ...]) -> str:
    """``kind`` where ``layer`` is one of PEFT's Linear layers ``linear``, else a ValueError: `peft_delta`'s
    rules for the methods that apply the adapter to W are written for Linear layers (conv and embedding
    variants reshape or transpose differently)."""
    if not isinstance(layer, linear):
        raise ValueError(f"peft_delta supports {kind} on Linear layers only, not {type(layer).__name__}")
    return kind


def bnb_layers(tuner: str) -> tuple[type, ...]:
    """PEFT's bitsandbytes Linear layers of `tuner` (lora, ia3): those this install has; none where
    bitsandbytes is absent, or hidden (the GPU machines' fork server imports no bitsandbytes)."""
    try:
        module = importlib.import_module(f"peft.tuners.{tuner}.bnb")
    except ImportError:  # its module imports bitsandbytes first thing
        return ()
    return tuple(getattr(module, name) for name in ("Linear8bitLt", "Linear4bit") if hasattr(module, name))
