"""Checks on a spec's inputs that need no model load: paths, file integrity, adapter ↔ base fit.

They run before a job is submitted, so the commonest mistakes (wrong path, a folder that is not
a model, a truncated file, an adapter made for another base) give a one-line message at once.
Workers still report anything these miss as a failed job with its reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from core.models.checkpoint import (
    Checkpoint,
    CheckpointError,
    InputError,
    LoadError,
    adapters_task_type,
    check_adapter_config,
    load_config,
    read_json_object,
)
from core.spec import AdapterRef, ModelRef, ProbeSpec, ToleranceOverride, model_folder

# Input embeddings that a tied `lm_head` shares its storage with (Llama/Mistral, GPT-2, BERT, GPT-NeoX).
TIED_EMBEDDING_NAMES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")


def weight_shapes(folder: Path, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """Tensor name → shape from the checkpoint's headers (`core.models.checkpoint`); InputError when unreadable."""

    try:
        checkpoint = Checkpoint.open(folder, prefix=prefix)
    except CheckpointError as e:
        raise InputError(str(e)) from e
    return {name: checkpoint.info(name).shape for name in checkpoint.names()}


def loaded_shapes(folder: Path, file_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The base's tensors under the names the loaded model gives them (`core.models.conversion`), with its shapes.

    transformers renames and fuses checkpoint keys on load (ViT's `encoder.layer.0.attention.attention.query`
    is the model's `layers.0.attention.q_proj`), and PEFT names an adapter's modules as the loaded model has
    them. Worked out from a model built on the meta device from the config (no weights read); where
    transformers cannot build one here (an architecture it does not know, remote code), the file's own names.
    """
    from core.models.conversion import for_folder

    shapes = for_folder(folder, Checkpoint.open(folder)).loaded_shapes()
    return shapes or file_shapes  # none: no model was built (the identity conversion knows no shapes)


def validate_model(model: ModelRef) -> dict[str, tuple[int, ...]] | None:
    """A local base model folder must exist, have config.json and intact weights."""
    path = model_folder(model)
    if path is None:
        return None  # a hub id: resolved by the worker, where the hub or its cache is reachable
    config = read_json_object(
        path / "config.json", f"base model {model.path}", "the model's settings, as transformers saves them"
    )
    shapes = loaded_shapes(path, weight_shapes(path))
    if shapes is not None and "lm_head.weight" not in shapes and config.get("tie_word_embeddings", True):
        # A tied output head is stored once, as the input embedding; adapters may still target it.
        embedding = next((k for k in shapes if k.endswith(TIED_EMBEDDING_NAMES)), None)
        if embedding is not None:
            shapes["lm_head.weight"] = shapes[embedding]
    return shapes


def validate_adapter(adapter: AdapterRef, base_shapes: dict[str, tuple[int, ...]] | None, base: str) -> None:
    """The adapter folder is intact and its modules exist in the base with fitting shapes."""
    from core.methods.adapter_keys import (
        attention_renames,
        replicated_layers,
        split_adapter_key,
        unreplicated,
    )
    from core.methods.reading import BIAS_PARAMS

    config = check_adapter_config(adapter)
    shapes = weight_shapes(Path(adapter.path).expanduser(), prefix="adapter_model")
    if shapes is None or base_shapes is None:
        return
    fan_in_fan_out = bool(config.get("fan_in_fan_out"))
    order = replicated_layers(config)  # layer_replication: PEFT expands the base's layers before loading
    modules = {}
    for key, shape in shapes.items():
        split = split_adapter_key(key)
        if split is None or split[1] in BIAS_PARAMS:
            # modules_to_save copies and the like, trained biases: nothing to match against the base's weights
            continue
        module, param = unreplicated(split[0], order), split[1]
        modules.setdefault(module, {})[param.split(".")[0]] = shape
    # LoRA on nn.MultiheadAttention: its in_proj's and out_proj's modules by the tensors they adapt
    renames = attention_renames(modules, base_shapes)
    modules = {renames.get(m, m): roles for m, roles in modules.items()}
    # LoRA on parameters (target_parameters) keeps a module's tensors under `<module>(.base_layer)*`, one
    # nesting per parameter it targets there: the module must hold one of the parameters the config names
    targeted = [str(t).rpartition(".")[2] for t in config.get("target_parameters") or ()]
    missing = [
        m
        for m in modules
        if f"{m}.weight" not in base_shapes
        and m not in base_shapes
        and not any(f"{m.replace('.base_layer', '')}.{p}" in base_shapes for p in targeted)
    ]
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
        w = base_shapes.get(f"{module}.weight")
        if w is None or len(w) != 2:  # a parameter LoRA targets: the formulas check its shapes
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


def validate_trained_biases(adapters: Sequence[AdapterRef]) -> None:
    """At most one adapter of a run trains biases: PEFT refuses to hold two on one model ("supports only 1
    adapter with bias"), and the run loads its adapters together for the outputs, merge and other checks."""
    biased = [
        f"{a.name} (bias={c['bias']!r})"
        for a in adapters
        if (c := check_adapter_config(a)).get("bias") not in (None, "none")
    ]
    if len(biased) > 1:
        raise InputError(
            f"adapters {', '.join(biased)} each train biases, and PEFT holds only one adapter with bias on a "
            "model (the run loads its adapters together): run them in separate runs"
        )


def validate_merge_subset(subset: Sequence[str], adapters: Sequence[str], checks: Sequence[str]) -> None:
    """The adapters the merge check merges together: two or more of the run's adapters, each once.

    Refused up front: otherwise the run would end without having merged them, and say so in a note only.
    """
    if not subset:
        return
    named = ", ".join(subset)
    if "merge" not in checks:
        raise InputError(
            f"merge subset {named} is given, but the merge check that merges it is not run; "
            "add merge to the checks"
        )
    dupes = sorted({n for n in subset if subset.count(n) > 1})
    if dupes:
        raise InputError(f"merge subset names {', '.join(dupes)} twice; name each adapter once")
    unknown = [n for n in subset if n not in adapters]
    if unknown:
        which = f"its adapters are {', '.join(adapters)}" if adapters else "it has no adapters"
        raise InputError(
            f"merge subset: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not an adapter "
            f"of this run; {which}"
        )
    if len(subset) < 2:
        raise InputError(f"merge subset names {named} alone; name two or more adapters to merge together")


# The seeds `torch.Generator.manual_seed` takes (the probe inputs are drawn from one).
SEED_RANGE = (-(2**63), 2**64 - 1)


def validate_tolerance(role: str, tolerance: ToleranceOverride) -> None:
    """A user's rtol and atol must be numbers ≥ 0 (NaN is refused too: nothing would ever pass)."""
    where = "every row" if role == "*" else f"role {role}"
    for name, value in (("rtol", tolerance.rtol), ("atol", tolerance.atol)):
        if value is not None and not value >= 0:
            raise InputError(f"tolerance {name}={value} for {where}: expected a number ≥ 0")


def validate_inputs(spec: ProbeSpec) -> None:
    """All the cheap input checks for a spec; raises InputError with a one-line message."""
    if not SEED_RANGE[0] <= spec.seed <= SEED_RANGE[1]:
        raise InputError(f"seed {spec.seed}: expected a whole number from {SEED_RANGE[0]} to {SEED_RANGE[1]}")
    for role, tolerance in spec.tolerances.items():
        validate_tolerance(role, tolerance)
    base_shapes = validate_model(spec.base)
    names = [a.name for a in spec.adapters]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise InputError(f"adapter name {', '.join(dupes)} is used twice; name them with PATH=NAME")
    validate_merge_subset(spec.merge_subset, names, spec.checks)
    for adapter in spec.adapters:
        validate_adapter(adapter, base_shapes, spec.base.path)
    validate_trained_biases(spec.adapters)
    if base_shapes is not None:  # a local folder (a hub id's config is fetched by the worker)
        validate_family(spec)


def validate_family(spec: ProbeSpec) -> None:
    """The model's class (from its config and the adapters' task head) and its probe input, from the
    config alone: a model the tool cannot run is refused here, not after loading it."""
    from core.models.loading import model_class
    from core.models.probes import probe_inputs

    try:
        config = load_config(spec.base)
    except LoadError as e:
        raise InputError(str(e)) from e  # it names the folder
    try:
        cls = model_class(config, adapters_task_type(spec.adapters))
        probe_inputs(config, cls, spec.probe, spec.seed, spec.base)
    except LoadError as e:
        raise InputError(f"base model {spec.base.path}: {e}") from e
