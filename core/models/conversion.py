"""Checkpoint keys as transformers converts them on load: renamed, fused or split.

transformers 5 does not load a checkpoint's tensors under their file names. `from_pretrained` passes
every key through the model's conversion mapping (`transformers.conversion_mapping`): renamings such as
GPT-NeoX's `embed_out` → `lm_head`, BERT's legacy `LayerNorm.gamma` → `LayerNorm.weight`, ViT's
`encoder.layer.N.attention.attention.query` → `layers.N.attention.q_proj`, and converters that build one
loaded tensor from several file tensors, such as Mixtral's per-expert `w1`/`w3` stacked and concatenated
into one `gate_up_proj`. `save_pretrained` reverts them, so a file transformers writes today still holds
the old names.

`KeyConversion` replays that mapping, transformers' own transforms matched by its own
`rename_source_key` the way its loader matches them, on the checkpoint's key names alone: each loaded
tensor knows the file tensors it came from, and `read` rebuilds it from them (one loaded tensor at a time,
its file tensors read lazily from a `core.models.checkpoint.Checkpoint`).
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Collection, Iterable
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.models.checkpoint import Checkpoint

# A transformer block's index in a parameter or module name (`….layers.3.…`, `….h.3.…`).
LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)")


def layer_of(name: str) -> int | None:
    """The transformer block index in a parameter or module name, if any."""
    m = LAYER_RE.search(name)
    return int(m.group(1)) if m else None


__all__ = ["KeyConversion", "for_folder", "read_loaded", "remember"]


@dataclass(frozen=True)
class _Group:
    """The file tensors the loader gathers under one loaded name, and the converter (if any) it runs on them."""

    first: str  # the loaded name the loader keys the group by (a converter's first target)
    # (file key, converter source pattern or None): in load order, grouped by pattern for a converter
    members: tuple[tuple[str, str | None], ...]
    converter: Any  # a transformers WeightConverter, or None for a plain renaming
    targets: tuple[str, ...]  # every loaded name the group produces (several where a converter splits)


class KeyConversion:
    """Which checkpoint tensors each loaded tensor comes from, per transformers' conversion of the model."""

    def __init__(self, groups: list[_Group], config: Any, shapes: dict[str, tuple[int, ...]]):
        self._config = config
        self._groups = {target: group for group in groups for target in group.targets}
        self._shapes = shapes  # loaded name -> shape, as the model has it

    def loaded_shapes(self) -> dict[str, tuple[int, ...]]:
        """Loaded name → shape, for every loaded tensor the checkpoint provides (names as the model has them)."""
        return {name: self._shapes[name] for name in self._groups if name in self._shapes}

    @classmethod
    def of(cls, model: torch.nn.Module, names: Iterable[str]) -> KeyConversion:
        """The conversion `from_pretrained` applies to the checkpoint keys `names` when it loads `model`.

        `model` may live on the meta device: only its module tree, config and parameter names are used.
        Non-persistent buffers count as loaded names too, so a file tensor of a buffer's (converted) name
        is matched with it.
        """
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )

        from core.models.targets import quantized_modules

        # The call `from_pretrained` makes (no user key_mapping, no quantizer): legacy renamings included.
        mapping = get_model_conversion_mapping(model)
        renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
        converters = [t for t in mapping if isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        # `rename_source_key` asks only whether a name exists (`.get(name) is not None`).
        shapes = {n: tuple(t.shape) for n, t in [*model.state_dict().items(), *model.named_buffers()]}
        # a bitsandbytes 4-bit weight is held packed, two values a byte: the shape it stands for is its
        # quant state's (a conversion `remember`ed from a quantized target sizes the adapters' validation)
        for module_name, module in quantized_modules(model).items():
            quant_state = getattr(module.weight, "quant_state", None)
            if quant_state is not None:
                shapes[f"{module_name}.weight"] = tuple(quant_state.shape)
        loaded = dict.fromkeys(shapes, True)
        # A plain torch module (not a transformers model) has neither: only the legacy renamings apply.
        prefix = getattr(model, "base_model_prefix", None)
        members: dict[str, list[tuple[str, str | None]]] = {}
        converter_of: dict[str, Any] = {}
        # The loader's order: a converter stacks experts in the order their keys arrive.
        for key in sorted(names, key=dot_natural_key):
            renamed, pattern = rename_source_key(key, renamings, converters, prefix, loaded)
            if renamed not in loaded and key in loaded:
                # As the loader does: a key the model already has is not renamed (only re-prefixed).
                renamed, pattern = rename_source_key(key, [], [], prefix, loaded)
            if renamed not in loaded:
                continue  # the loader leaves it out as unexpected: the model has nothing of this name
            members.setdefault(renamed, []).append((key, pattern))
            if pattern is not None:
                converter_of[renamed] = by_pattern[pattern]
        groups = []
        for first, group in members.items():
            converter = converter_of.get(first)
            targets = (first,)
            if converter is not None and len(converter.target_patterns) > 1:
                # A split (qkv → q, k, v): the loader keys the group by the first target, the others
                # are named the same way (as its "unexpected keys" bookkeeping names them).
                head = converter.target_patterns[0]
                targets = tuple(first.replace(head, t) for t in converter.target_patterns)
            if converter is not None:
                # Shown and read in the converter's own order of patterns (w1s, then w3s: as concatenated).
                order = {p: i for i, p in enumerate(converter.source_patterns)}
                group = sorted(group, key=lambda member: order[member[1]])  # stable: load order within
            groups.append(_Group(first, tuple(group), converter, targets))
        return cls(groups, getattr(model, "config", None), shapes)

    @classmethod
    def identity(cls, names: Iterable[str]) -> KeyConversion:
        """No conversion: every checkpoint key is loaded under its own name (shapes unknown: left out)."""
        return cls([_Group(n, ((n, None),), None, (n,)) for n in names], None, {})

    def sources(self, name: str) -> tuple[str, ...]:
        """The checkpoint keys the loaded tensor `name` is built from; () when the file has none for it."""
        group = self._groups.get(name)
        return () if group is None else tuple(key for key, _ in group.members)

    def converted(self) -> dict[str, tuple[str, ...]]:
        """Loaded name → its checkpoint keys, for every loaded tensor whose keys are not just its own name."""
        return {n: s for n in self._groups if (s := self.sources(n)) != (n,)}

    def how(self, name: str) -> str:
        """How the loaded tensor `name` was made from its file tensors, for a row's note ("" when unchanged)."""
        keys = self.sources(name)
        if keys == (name,) or not keys:
            return ""
        group = self._groups[name]
        if group.converter is None:
            return f"renamed on load from the checkpoint's {keys[0]}"
        ops = ", ".join(map(repr, group.converter.operations))
        shown = ", ".join(keys) if len(keys) <= 4 else f"{', '.join(keys[:3])}, … {keys[-1]}"
        return f"built on load from the checkpoint's {len(keys)} tensors {shown} (transformers: {ops})"

    def read(self, checkpoint: Checkpoint, name: str, scratch: bool = False) -> torch.Tensor:
        """The loaded tensor `name` as transformers builds it from `checkpoint`, in the file's dtype.

        `scratch`: a tensor read as it is stored comes in `checkpoint`'s scratch buffer (`Checkpoint.read`).

        A renamed tensor is the file tensor itself; a converted one runs the converter's own operations
        (stack, concatenate, chunk, …) on its file tensors, read one by one as it asks for them. Those
        operations move no values, so building in the file's dtype and casting afterwards (as the row
        notes) gives what the loader's cast-then-build gives.
        """
        group = self._groups.get(name)
        if group is None:
            raise KeyError(f"{checkpoint.folder}: no checkpoint tensor is loaded as {name!r}")
        if group.converter is None:
            return checkpoint.read(group.members[0][0], scratch=scratch)
        converter = deepcopy(
            group.converter
        )  # a transform collects tensors as it goes: a fresh one each time
        for key, pattern in group.members:
            # A callable is what the loader's synchronous path hands over: read only when converted.
            converter.add_tensor(group.first, key, pattern, functools.partial(checkpoint.read, key))
        built = converter.convert(group.first, config=self._config)[name]
        return built[0] if isinstance(built, list) else built


_lock = threading.Lock()
# (folder, its checkpoint's key names) → conversion: a folder whose files change is worked out anew.
_known: dict[tuple[str, tuple[str, ...]], KeyConversion] = {}


def remember(folder: str | Path, checkpoint: Checkpoint, conversion: KeyConversion) -> None:
    """Keep the conversion of the model loaded from `folder` (a worker's live model), for `for_folder`.

    The live model's is the one to use: its class (a task head, a base-model prefix) decides the
    loaded names, and a model rebuilt from the config alone may be of another class.
    """
    with _lock:
        _known[(str(folder), tuple(checkpoint.names()))] = conversion


def for_folder(folder: str | Path, checkpoint: Checkpoint) -> KeyConversion:
    """The conversion of `checkpoint` (opened from `folder`): the one a loaded model left (`remember`),
    else one worked out from a model built on the meta device from the folder's config (no weights read)."""
    key = (str(folder), tuple(checkpoint.names()))
    with _lock:
        known = _known.get(key)
    if known is not None:
        return known
    try:
        conversion = KeyConversion.of(_meta_model(str(folder)), key[1])
    except Exception:  # any reason transformers cannot build it here
        # An architecture this transformers does not know, or remote code (whose keys transformers does
        # not convert either): the file's names are the loaded ones.
        conversion = KeyConversion.identity(key[1])
    with _lock:
        _known[key] = conversion
    return conversion


def _meta_model(folder: str) -> torch.nn.Module:
    """The model class `core.models.loading` loads `folder` with, built on the meta device (no memory, no weights)."""
    import transformers

    from core.models.loading import model_class

    config = transformers.AutoConfig.from_pretrained(folder)
    cls = model_class(config)
    with torch.device("meta"):
        if hasattr(cls, "from_config"):  # an Auto class
            return cls.from_config(config)
        return cls(config)


def read_loaded(folder: str | Path, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The base checkpoint's tensors for the loaded names `names` (those it provides), as transformers
    builds them on load; CheckpointError naming the file when it is missing or corrupt."""
    checkpoint = Checkpoint.open(folder)
    conversion = for_folder(folder, checkpoint)
    return {name: conversion.read(checkpoint, name) for name in names if conversion.sources(name)}


def loaded_shapes(folder: str | Path, names: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """The shapes of the base checkpoint's tensors for the loaded names `names` (those it provides), as
    transformers builds them on load, from the files' headers: no tensor is read."""
    checkpoint = Checkpoint.open(folder)
    shapes = for_folder(folder, checkpoint).loaded_shapes()
    # a conversion that knows no shapes (an architecture built without transformers): the file's own
    return {
        n: shapes[n] if n in shapes else checkpoint.info(n).shape
        for n in names
        if n in shapes or n in checkpoint
    }


def targeted_parameters(folder: str | Path, adapter_config: dict) -> dict[str, tuple[str, bool]]:
    """Where a LoRA with ``target_parameters`` keeps each targeted parameter's tensors: the module path its
    file names them under (PEFT wraps every targeted parameter of a module in a ``ParamWrapper``, nested in
    the order the module registers them, the first innermost: ``experts.base_layer`` then ``experts``) →
    (the parameter's path, whether PEFT reads a 3-d one as (experts, out, in)). Worked out as PEFT does it, by
    injecting the adapter's config into the base model built on the meta device (no weights read); {} for
    an adapter without ``target_parameters``."""
    if not adapter_config.get("target_parameters"):
        return {}
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora.layer import ParamWrapper

    fields = set(LoraConfig.__dataclass_fields__)
    config = LoraConfig(**{k: v for k, v in adapter_config.items() if k in fields and k != "peft_type"})
    model = inject_adapter_in_model(config, _meta_model(str(folder)))
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, ParamWrapper):
            owner = name.replace(".base_layer", "")
            out[name] = (f"{owner}.{module.parameter_name}", bool(module._did_swap_in_out_features))
    return out


def attention_modules(
    base: str | Path, config: dict, names: Collection[str], done: set[str]
) -> dict[str, str]:
    """`adapter_keys.attention_renames` of the modules an adapter file with checkpoint keys `names` adapts
    (those not in `done`), by the base folder's tensor names (headers only)."""
    from core.methods import adapter_keys

    saved = adapter_keys.saved_module_names(config)
    split = (
        adapter_keys.split_adapter_key(n) for n in names if not adapter_keys.split_saved_module_key(n, saved)
    )
    modules = {s[0] for s in split if s is not None} - done
    paths = {m.replace(".base_layer.", ".") for m in modules}
    present = loaded_shapes(base, {f"{p}.{t}" for p in paths for t in ("weight", "in_proj_weight")})
    return adapter_keys.attention_renames(modules, set(present))
