"""The PEFT methods with a float64 ΔW formula here, one module per family in `core.methods.families`, and what
the generic code (`adapter_keys`, `formulas`, `peft_path`) reads from them: each adapter type's formula and
family, the checkpoint parameter names, the shared tensors, the additive layer kinds, a loaded layer's kind.
Adding a method: its family module (the contract is `core.methods.families`'s docstring) and its name here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from torch import nn

from core.methods.families import (
    adalora,
    delora,
    fourierft,
    hra,
    ia3,
    lora,
    lycoris,
    miss,
    orthogonal,
    randlora,
    shira,
    vera,
)

FAMILIES: tuple[ModuleType, ...] = (
    lora,
    orthogonal,
    ia3,
    lycoris,
    vera,
    adalora,
    fourierft,
    shira,
    hra,
    miss,
    randlora,
    delora,
)
"""The family modules, in the order messages list their adapter types."""
FORMULAS: dict[str, Callable[..., Any]] = {
    kind: formula for family in FAMILIES for kind, formula in family.FORMULAS.items()
}
"""Adapter type → its float64 ΔW formula."""
ADAPTER_TYPES = tuple(FORMULAS)
"""Adapter types `formulas` knows the merge rule of."""
FAMILY: dict[str, ModuleType] = {kind: family for family in FAMILIES for kind in family.FORMULAS}
"""Adapter type (and loaded layer kind) → its family module."""
PARAMS = tuple(param for family in FAMILIES for param in family.PARAMS)
"""The parameter names the methods save per module in an adapter file."""
SHARED_KEYS: dict[str, str] = {key: param for family in FAMILIES for key, param in family.SHARED_KEYS.items()}
"""Top-level checkpoint key of a tensor every module shares (VeRA's projections, RandLoRA's bases) → its
parameter name in each module's keys."""
ADDITIVE = tuple(kind for family in FAMILIES for kind in family.ADDITIVE)
"""Layer kinds whose merge adds PEFT's ``get_delta_weight`` to W as it is (ΔW does not depend on W)."""
VARIANTS: dict[str, Callable[[Mapping[str, Any]], str]] = {
    family.PEFT_TYPE: family.variant for family in FAMILIES if hasattr(family, "variant")
}
"""PEFT type (``LORA``) → the family's rule for which of its adapter types a config is (``dora``, ``pissa``)."""


def layer_kind(layer: nn.Module, adapter: str) -> str:
    """Which merge rule a loaded PEFT tuner layer uses for ``adapter`` (an adapter type of a family here, or
    ``dora`` for LoRA's DoRA variant); a ValueError where no family holds it."""
    for family in FAMILIES:
        kind = family.layer_kind(layer, adapter)
        if kind is not None:
            return kind
    raise ValueError(f"layer {type(layer).__name__} has no supported adapter '{adapter}'")
