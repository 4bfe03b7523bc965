"""Adapter checkpoints and configs by name: which adapter type a config is, how checkpoint keys map to
base-model modules and parameters (PEFT's ``base_model.model.`` prefix, ``modules_to_save`` copies, the
shared tensors saved at the top level, prompt learning's virtual tokens, trained biases, replicated layers),
and which module of a loaded PEFT model holds which adapters: the rules every method shares. Each method's
own parameter names, config values and ΔW are its family's (`core.methods.families`, listed by
`core.methods.registry`); the dispatch is `formulas`.
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from core.methods.reading import BIAS_PARAMS, AdapterModule
from core.methods.registry import ADAPTER_TYPES, PARAMS, SHARED_KEYS, VARIANTS

PROMPT_LEARNING = ("prompt_tuning", "multitask_prompt_tuning", "p_tuning", "prefix_tuning", "cpt")
"""Adapter types whose trained tensors are virtual tokens fed with the input (PEFT's prompt learning):
they change no weight of the base, so there is no ΔW and nothing to merge."""
VIRTUAL_TOKENS = (
    "its trained virtual tokens are prepended to the input (prefix tuning: to every layer's keys and values) "
    "and change no weight of the base"
)
"""What a prompt-learning adapter does, in the words the checks that do not apply to it give."""
PROMPT_KEY = "prompt_embeddings"
"""The one key prompt learning saves its virtual tokens under (no module path: no dot)."""
SAVED_MODULE = "modules_to_save"
"""The role of a module an adapter saves whole (``modules_to_save``: a classifier head, embeddings)."""

# PeftModel.save_pretrained writes keys as "base_model.model.<module path>.<param>"
# (the adapter name is stripped); injected models without the wrapper have no prefix.
_PEFT_PREFIX = "base_model.model."
# Prompt-learning PeftModels hold the transformers model as `base_model` itself: their
# modules_to_save copies are saved as "base_model.<module path>.<param>".
_PROMPT_PREFIX = "base_model."

# Parameter names an adapter checkpoint can hold per module: each method's, then those every method may
# save, the bias last so that "lora_B.bias" is not mistaken for a module named "...lora_B" with a bias.
_PARAM_NAMES = (
    *PARAMS,
    # a copy of the base embedding PEFT saves with LoRA on embeddings (save_embedding_layers); it is
    # the module's base weight, no part of ΔW
    "base_layer.weight",
    # a trained bias (LoraConfig(bias="all"/"lora_only"), the same option on other tuners): PEFT loads it over
    # the base's; an adapted module's is its base layer's, another module's its own
    *BIAS_PARAMS,
)
# The parameter names of the shared tensors each module lists besides its own (VeRA, RandLoRA).
_SHARED_PARAMS = frozenset(SHARED_KEYS.values())
BIAS_SUFFIX = ".bias"
"""What a bias change's name adds to its module's path (``model.layers.0.self_attn.q_proj.bias``): Δb."""

# --------------------------------------------------------------------------------------------------
# Config helpers
# --------------------------------------------------------------------------------------------------


def adapter_type(adapter_config: Mapping[str, Any]) -> str:
    """Classify an ``adapter_config.json`` dict as lora, dora, pissa, boft, oft, ia3, or another peft type.

    LoRA with ``use_dora`` is ``dora``; LoRA whose ``init_lora_weights`` is a string starting with
    ``pissa`` is ``pissa``; other types are the lowercased ``peft_type``.
    """
    peft_type = adapter_config.get("peft_type")
    if not peft_type:
        raise ValueError("adapter config has no 'peft_type'; is this an adapter_config.json?")
    peft_type = str(peft_type).rsplit(".", 1)[-1].upper()  # tolerate "PeftType.LORA"
    variant = VARIANTS.get(peft_type)
    return variant(adapter_config) if variant is not None else peft_type.lower()


# --------------------------------------------------------------------------------------------------
# Checkpoint key mapping
# --------------------------------------------------------------------------------------------------


def split_adapter_key(key: str) -> tuple[str, str] | None:
    """``base_model.model.X.lora_A.weight`` → (``X``, ``lora_A.weight``); None if no adapter parameter (a
    shared projection saved at the top level, ``base_model.vera_A``, belongs to no module)."""
    if key in SHARED_KEYS:
        return None
    path = key[len(_PEFT_PREFIX) :] if key.startswith(_PEFT_PREFIX) else key
    param = next((p for p in _PARAM_NAMES if path.endswith("." + p)), None)
    if param is None:
        return None
    return path[: -len(param) - 1], param


def bias_module(name: str) -> str | None:
    """The module path of a bias change's name (:data:`BIAS_SUFFIX`), else None (a ΔW's module path)."""
    return name.removesuffix(BIAS_SUFFIX) if name.endswith(BIAS_SUFFIX) else None


def base_tensor_names(names: Iterable[str]) -> set[str]:
    """The base tensors the float64 references of ``names`` (modules' ΔW, biases' Δb, targeted parameters' ΔW)
    read: each module's weight and its bias (an adapter that trains biases changes it; a base without one has
    none to read), a targeted parameter itself (a module path names no tensor: the base has none by it)."""
    modules = {bias_module(n) or n for n in names}
    return {f"{m}.{p}" for m in modules for p in ("weight", "bias")} | modules


def attention_renames(modules: Iterable[str], base_names: Container[str]) -> dict[str, str]:
    """LoRA on ``nn.MultiheadAttention``: PEFT wraps the module (its LoRA on ``in_proj_weight`` saved under the
    module's path) and its ``out_proj`` inside it (saved under ``<module>.base_layer.out_proj``). Module path →
    the base tensor or module it adapts (``<module>.in_proj_weight``, ``<module>.out_proj``), for the modules
    of ``modules`` that are such, by the base's tensor names ``base_names``."""
    out = {}
    for module in modules:
        path = re.sub(r"\.base_layer(?=\.)", "", module)  # a wrapped module's own wrapped child
        if f"{path}.weight" not in base_names and f"{path}.in_proj_weight" in base_names:
            path = f"{path}.in_proj_weight"
        if path != module:
            out[module] = path
    return out


MERGED_TWICE = "weightdrift:merged_twice"
"""The key under which `core.models.merging.adapter_files` lists in the config dict the modules whose ΔW
PEFT adds twice (:data:`OUT_PROJ_TWICE`): nn.MultiheadAttention's out_proj."""
OUT_PROJ_TWICE = (
    "PEFT 0.21.2's LoRA on nn.MultiheadAttention adds out_proj's ΔW twice: its merge (and its forward, which "
    "merges for the call) writes W + ΔW into out_proj, then merges out_proj's own LoRA layer, which adds ΔW "
    "again; the merged out_proj is compared with W + 2ΔW, what PEFT computes"
)
"""What the merge check says of such a module."""


def rename_modules(keys: Iterable[str], paths: Mapping[str, str]) -> dict[str, str]:
    """Checkpoint keys with the module path of each renamed by ``paths`` (old module path → new) → the key as
    the file has it; keys of other modules unchanged."""
    out = {}
    for key in keys:
        split = split_adapter_key(key)
        if split is not None and split[0] in paths:
            prefix = _PEFT_PREFIX if key.startswith(_PEFT_PREFIX) else ""
            out[f"{prefix}{paths[split[0]]}.{split[1]}"] = key
        else:
            out[key] = key
    return out


def saved_module_names(adapter_config: Mapping[str, Any]) -> tuple[str, ...]:
    """The ``modules_to_save`` names of an ``adapter_config.json`` dict (PEFT may list one twice)."""
    names = adapter_config.get("modules_to_save") or ()
    if isinstance(names, str):
        names = (names,)
    return tuple(dict.fromkeys(str(n) for n in names))


def split_saved_module_key(key: str, saved_modules: tuple[str, ...] | list[str]) -> tuple[str, str] | None:
    """``base_model.model.classifier.dense.weight`` → (``classifier``, ``dense.weight``) when
    ``classifier`` is one of ``saved_modules`` (PEFT's ``modules_to_save``); None otherwise.

    PEFT saves such a module whole, under its own path with the wrapper's
    ``modules_to_save.<adapter>`` part stripped (kept by older saves: stripped here too). A name matches
    the module path or its end at a dot boundary, as PEFT matches ``modules_to_save``.
    """
    for prefix in (_PEFT_PREFIX, _PROMPT_PREFIX):
        if key.startswith(prefix):
            path = key[len(prefix) :]
            break
    else:
        path = key
    path = re.sub(r"\.modules_to_save\.[^.]+\.", ".", path)
    parts = path.split(".")
    for end in range(1, len(parts)):  # the shortest module path that is a saved module
        module = ".".join(parts[:end])
        if any(module == n or module.endswith("." + n) for n in saved_modules):
            return module, ".".join(parts[end:])
    return None


def adapter_module_keys(
    adapter_tensors: Mapping[str, torch.Tensor], saved_modules: tuple[str, ...] = ()
) -> dict[str, AdapterModule]:
    """Group adapter-checkpoint keys by the base-model module they adapt.

    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` becomes module
    ``model.layers.0.self_attn.q_proj`` with parameter ``lora_A.weight``. Copies of the modules
    ``saved_modules`` names (the config's ``modules_to_save``, see :func:`saved_module_names`) are left
    out: such a module is replaced whole, it has no ΔW formula. Raises ``ValueError`` for other keys
    that are no known adapter parameter (trainable tokens, ...), because silently leaving them out
    would report a partial ΔW as the whole one.
    """
    modules: dict[str, dict[str, str]] = {}
    unknown: list[str] = []
    shared = {SHARED_KEYS[k]: k for k in adapter_tensors if k in SHARED_KEYS}
    for key in adapter_tensors:
        if key in SHARED_KEYS or split_saved_module_key(key, saved_modules) is not None:
            continue
        split = split_adapter_key(key)
        if split is None:
            unknown.append(key)
            continue
        modules.setdefault(split[0], {})[split[1]] = key
    if unknown:
        shown = ", ".join(sorted(unknown)[:5])
        more = f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else ""
        raise ValueError(
            f"adapter checkpoint has tensors that are no {'/'.join(ADAPTER_TYPES)} parameter: {shown}{more}; "
            "trainable tokens and modules_to_save copies the config does not list are not covered "
            "by reference_deltas"
        )
    # every module reads the shared projections (VeRA, RandLoRA), so each lists their keys as its own (a
    # module's own copy of them, which RandLoRA saves too, first)
    return {
        m: AdapterModule(module=m, keys={**shared, **k}, shared=_SHARED_PARAMS)
        for m, k in sorted(modules.items())
    }


# --------------------------------------------------------------------------------------------------
# Loaded PEFT models
# --------------------------------------------------------------------------------------------------


def _adapter_names(layer: nn.Module) -> list[str]:
    """Adapter names a tuner layer holds, in insertion order, across its adapter parameter dicts."""
    names: dict[str, None] = {}
    for attr in layer.adapter_layer_names:
        container = getattr(layer, attr, None)
        if isinstance(container, (nn.ModuleDict, nn.ParameterDict, dict)):
            names.update(dict.fromkeys(container.keys()))
    return list(names)


def adapted_modules(peft_model: nn.Module) -> dict[str, tuple[nn.Module, list[str]]]:
    """Map base-module path (as in :func:`core.methods.formulas.reference_deltas`) to ``(PEFT tuner layer, adapter names)``;
    a LoRA on a parameter (``target_parameters``: PEFT's ``ParamWrapper``) by the parameter's path.

    Works on a ``PeftModel`` (the ``base_model.model.`` prefix is stripped) and on a model with
    adapters injected directly.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    out: dict[str, tuple[nn.Module, list[str]]] = {}
    for name, module in peft_model.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        names = _adapter_names(module)
        if not names:
            continue
        path = name[len(_PEFT_PREFIX) :] if name.startswith(_PEFT_PREFIX) else name
        if type(module).__name__ == "ParamWrapper":  # LoRA on a parameter: named by the parameter's path
            path = f"{path.replace('.base_layer', '')}.{module.parameter_name}"
        elif (
            type(module).__name__ == "MultiheadAttention"
        ):  # its LoRA on in_proj (out_proj's is its own layer)
            path = f"{path}.in_proj_weight"
        path = re.sub(r"\.base_layer(?=\.)", "", path)  # a wrapped module's wrapped child (MHA's out_proj)
        out[path] = (module, names)
    return out


def trained_biases(keys: Iterable[str], adapter_config: Mapping[str, Any]) -> list[str]:
    """The biases an adapter file with checkpoint keys ``keys`` trained (``bias="all"``/``"lora_only"``), as
    ``<module>.bias``; the copies of the modules it saves whole are not among them (they replace their module
    whole); none where its config trains none (another method's ``….bias`` key is its own parameter)."""
    if adapter_config.get("bias") in (None, "none"):
        return []
    saved_modules = saved_module_names(adapter_config)
    out = []
    for key in keys:
        split = None if split_saved_module_key(key, saved_modules) else split_adapter_key(key)
        if split is not None and split[1] in BIAS_PARAMS:
            out.append(split[0] + BIAS_SUFFIX)
    return sorted(out)


def loaded_parameters(model: nn.Module, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The parameters ``names`` (base state-dict names, ``<module>.bias``) of a loaded PEFT model or a merged
    one, where it has them: PEFT's ``base_model.model.`` prefix and its layers' ``base_layer.`` looked through."""
    wanted = set(names)
    out = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        path = name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")
        if path in wanted:
            out[path] = param
    return out


# A layer of the stacks PEFT's `replicate_layers` expands: `model.layers.N.`, BERT's `encoder.layer.N.`, `h.N.`
_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h)\.(\d+)(?=\.|$)")


def replicated_layers(adapter_config: Mapping[str, Any]) -> list[int]:
    """The base layer each layer of the expanded stack is a copy of, for a LoRA with ``layer_replication``
    (PEFT's `replicate_layers`: ``[[0, 2], [1, 3]]`` makes layers 0, 1, 1, 2); [] without it."""
    return [i for start, end in adapter_config.get("layer_replication") or () for i in range(start, end)]


def unreplicated(name: str, order: list[int]) -> str:
    """The base's name of ``name`` (a module or tensor path of the expanded model) where PEFT replicated the
    layers in ``order`` (:func:`replicated_layers`): its layer index mapped to the layer it copies."""
    match = _LAYER.search(name)
    if not order or match is None or int(match.group(1)) >= len(order):
        return name
    return f"{name[: match.start(1)]}{order[int(match.group(1))]}{name[match.end(1) :]}"


class UnreplicatedBase(Mapping):
    """Base weights read by the expanded model's names (a LoRA with ``layer_replication``): each name looked
    up as the layer it copies (PEFT's copies share the originals' weights)."""

    def __init__(self, base: Mapping[str, torch.Tensor], order: list[int]) -> None:
        self._base, self._order = base, order

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._base[unreplicated(name, self._order)]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and unreplicated(name, self._order) in self._base

    def __iter__(self):
        return iter(self._base)

    def __len__(self) -> int:
        return len(self._base)


def expansion_notes(adapter_config: dict) -> list[str]:
    """What PEFT did to the base before loading the adapter, where it expanded it (``layer_replication``:
    its `replicate_layers` stacks copies of the base's layers that share their weights), in words."""
    order = replicated_layers(adapter_config)
    if not order:
        return []
    return [
        f"PEFT expanded the base's layers to {len(order)} before loading the adapter "
        f"(layer_replication {adapter_config['layer_replication']}: layers {', '.join(map(str, order))}; "
        "each copy shares the weights of the layer it copies)"
    ]
