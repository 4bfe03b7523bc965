"""Checks on a spec's inputs that need no model load: paths, file integrity, adapter ↔ base fit.

They run before a job is submitted, so the commonest mistakes (wrong path, a folder that is not
a model, a truncated file, an adapter made for another base) give a one-line message at once.
Workers still report anything these miss as a failed job with its reason.
"""

from __future__ import annotations

import json
from pathlib import Path

from core.spec import AdapterRef, ModelRef, ProbeSpec, SpecError


class InputError(SpecError):
    """An input file or folder that cannot be used, with the reason."""


# Input embeddings that a tied `lm_head` shares its storage with (Llama/Mistral, GPT-2, BERT, GPT-NeoX).
TIED_EMBEDDING_NAMES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")


def weight_shapes(folder: Path, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """Tensor name → shape from the checkpoint's headers (`core.checkpoint`); InputError when unreadable."""
    from core.checkpoint import Checkpoint, CheckpointError

    try:
        checkpoint = Checkpoint.open(folder, prefix=prefix)
    except CheckpointError as e:
        raise InputError(str(e)) from e
    return {name: checkpoint.info(name).shape for name in checkpoint.names()}


def validate_model(model: ModelRef) -> dict[str, tuple[int, ...]] | None:
    """A local base model folder must exist, have config.json and intact weights."""
    path = Path(model.path).expanduser()
    if not path.exists():
        if model.path.startswith(("/", ".", "~")) or model.path.count("/") != 1:
            raise InputError(f"base model {model.path}: no such folder")
        return None  # a hub id: resolved by the worker, where the hub or its cache is reachable
    if not path.is_dir():
        raise InputError(f"base model {model.path}: not a folder")
    if not (path / "config.json").exists():
        raise InputError(f"base model {model.path}: not a model folder (no config.json)")
    try:
        config = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"base model {model.path}: config.json is not valid JSON ({e})") from e
    shapes = weight_shapes(path)
    if shapes is not None and "lm_head.weight" not in shapes and config.get("tie_word_embeddings", True):
        # A tied output head is stored once, as the input embedding; adapters may still target it.
        embedding = next((k for k in shapes if k.endswith(TIED_EMBEDDING_NAMES)), None)
        if embedding is not None:
            shapes["lm_head.weight"] = shapes[embedding]
    return shapes


def validate_adapter(adapter: AdapterRef, base_shapes: dict[str, tuple[int, ...]] | None, base: str) -> None:
    """The adapter folder is intact and its modules exist in the base with fitting shapes."""
    from core.formulas import split_adapter_key

    path = Path(adapter.path).expanduser()
    if not path.is_dir():
        raise InputError(f"adapter {adapter.name}: no such folder {adapter.path}")
    config_path = path / "adapter_config.json"
    if not config_path.exists():
        raise InputError(
            f"adapter {adapter.name}: not an adapter folder (no adapter_config.json in {adapter.path})"
        )
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"adapter {adapter.name}: adapter_config.json is not valid JSON ({e})") from e
    shapes = weight_shapes(path, prefix="adapter_model")
    if shapes is None or base_shapes is None:
        return
    fan_in_fan_out = bool(config.get("fan_in_fan_out"))
    modules = {}
    for key, shape in shapes.items():
        split = split_adapter_key(key)
        if split is None:
            continue  # modules_to_save copies and the like: nothing to match against the base
        module, param = split
        modules.setdefault(module, {})[param.split(".")[0]] = shape
    missing = [m for m in modules if f"{m}.weight" not in base_shapes]
    if missing and len(missing) == len(modules):
        raise InputError(
            f"adapter {adapter.name} was made for a different base model: none of its modules "
            f"(e.g. {missing[0]}) exist in {base}"
        )
    if missing:
        raise InputError(
            f"adapter {adapter.name} does not fit {base}: modules {', '.join(missing[:3])} do not exist"
        )
    for module, roles in modules.items():
        w = base_shapes[f"{module}.weight"]
        if len(w) != 2:
            continue
        out_f, in_f = (w[1], w[0]) if fan_in_fan_out else (w[0], w[1])
        a, b = roles.get("lora_A"), roles.get("lora_B")
        if a is not None and len(a) == 2 and a[1] != in_f:
            raise InputError(
                f"adapter {adapter.name} was made for a different base model: lora_A of {module} expects "
                f"{a[1]} input features, {base} has {in_f}"
            )
        if b is not None and len(b) == 2 and b[0] != out_f:
            raise InputError(
                f"adapter {adapter.name} was made for a different base model: lora_B of {module} has "
                f"{b[0]} output features, {base} has {out_f}"
            )


def validate_inputs(spec: ProbeSpec) -> None:
    """All the cheap input checks for a spec; raises InputError with a one-line message."""
    base_shapes = validate_model(spec.base)
    names = [a.name for a in spec.adapters]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise InputError(f"adapter name {', '.join(dupes)} is used twice; name them with PATH=NAME")
    for adapter in spec.adapters:
        validate_adapter(adapter, base_shapes, spec.base.path)
