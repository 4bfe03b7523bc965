"""Materialise a base model and its adapters on one target, by a named load strategy.

Safetensors first; `.bin` checkpoints only through `torch.load(weights_only=True)`;
`trust_remote_code` only when the ModelRef asks for it.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

import torch

from core.methods import adapter_keys
from core.models.checkpoint import (
    NOT_IN_CHECKPOINT,
    LoadError,
    adapters_task_type,
    exception_gist,
    float32_only_init,
    float64_offload_dtype,
    load_config,
    read_adapter_config,
    saved_head_labels,
)
from core.models.targets import cpu_4bit_path, quantization_config
from core.spec import AdapterRef, ModelRef, Target

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


# The head a PEFT `task_type` trains, as transformers' Auto classes; several where one task has
# several families (Whisper's seq2seq head is a speech one).
TASK_HEADS: dict[str, tuple[str, ...]] = {
    "CAUSAL_LM": ("AutoModelForCausalLM",),
    "SEQ_2_SEQ_LM": ("AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq"),
    "SEQ_CLS": ("AutoModelForSequenceClassification",),
    "TOKEN_CLS": ("AutoModelForTokenClassification",),
    "QUESTION_ANS": ("AutoModelForQuestionAnswering",),
    "FEATURE_EXTRACTION": ("AutoModel",),
}
# Generating models outside a task's own mapping: a vision-language (Llava-style) or other multimodal model
# whose adapter PEFT saves as CAUSAL_LM (it has no task type of its own for them) is loaded with the generating
# class its checkpoint names (`architectures`), else the first of these that knows its config.
GENERATING_HEADS: dict[str, tuple[str, ...]] = {
    "CAUSAL_LM": ("AutoModelForImageTextToText", "AutoModelForMultimodalLM"),
}


def _head_for(config, autos: tuple[str, ...]) -> type | None:
    """The concrete class the first of `autos` that knows this config maps it to; None when none does."""
    import transformers

    for name in autos:
        if not hasattr(transformers, name):  # a mapping this transformers lacks
            continue
        mapping = getattr(transformers, name)._model_mapping
        if type(config) in mapping:
            return mapping[type(config)]
    return None


def model_class(config, task_type: str | None = None) -> type:
    """The transformers class to load a checkpoint with, from its config and the adapter's task head.

    An adapter's PEFT `task_type` names the head it was trained with, so it decides (a CAUSAL_LM adapter on
    a model that task's mapping lacks, a Llava-style vision-language model: the generating class the
    checkpoint names, else `GENERATING_HEADS`); without one,
    the checkpoint's own class (`architectures`) where it has a head, else the LM head of an
    encoder-decoder, else the class it names, else the bare model. LoadError when the task's head
    does not exist for this family.
    """
    import transformers

    archs = [getattr(transformers, a, None) for a in getattr(config, "architectures", None) or []]
    named = [c for c in archs if isinstance(c, type)]
    if task_type in TASK_HEADS:
        cls = _head_for(config, TASK_HEADS[task_type])
        if cls is None and task_type in GENERATING_HEADS:
            generating = [c for c in named if issubclass(c, transformers.GenerationMixin)]
            cls = generating[0] if generating else _head_for(config, GENERATING_HEADS[task_type])
        if cls is None:
            more = GENERATING_HEADS.get(task_type, ())
            also = f", a generating class its config.json names or {', '.join(more)}" if more else ""
            raise LoadError(
                f"the adapter was trained for {task_type}, but transformers has no such head for "
                f"{type(config).__name__} (expected one of {', '.join(TASK_HEADS[task_type])}{also})"
            )
        return cls
    bare = _head_for(config, ("AutoModel",))
    headed = [c for c in named if c is not bare]
    if headed:
        return headed[0]
    if getattr(config, "is_encoder_decoder", False):
        cls = _head_for(config, ("AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq"))
        if cls is not None:
            return cls
    if named:
        return named[0]
    return bare or transformers.AutoModel


def load_base(
    model: ModelRef,
    target: Target,
    dtype: torch.dtype | None = None,
    device_map: str | None = None,
    task_type: str | None = None,
    adapters: Collection[AdapterRef] = (),
):
    """Load the base model in the target's dtype directly onto the target's device, in eval mode.

    `device_map` replaces the target's device (e.g. "auto": accelerate spreads it over every GPU).
    `task_type` is the adapters' PEFT task head (`adapters_task_type`), which picks the class;
    `adapters`, where given, size a head the checkpoint lacks as their saved copies of it are sized.
    Anything about how it was loaded that a reader of its rows must know is in `load_notes(model)`.
    """
    config = load_config(model)
    cls = model_class(config, task_type)
    quantized = target.quantized and dtype is None
    dtype = dtype or (None if quantized else torch_dtype(target.dtype))
    stored = None
    if dtype == torch.float64 and device_map is None:
        stored = float64_offload_dtype(model)
    extra, notes = {}, []
    if quantized:  # bitsandbytes' defaults, transformers' default dtype for the layers it leaves alone
        extra["quantization_config"] = quantization_config(target)
    else:
        extra["dtype"] = stored or dtype
    labels = saved_head_labels(config, cls, adapters) if adapters else None
    if labels is not None:
        # The head the adapters replace must have their head's shape, or PEFT cannot load their copy.
        extra["num_labels"] = labels
        notes.append(
            f"num_labels {labels}, from the classifier head the adapters save (modules_to_save); "
            f"the checkpoint's config says {config.num_labels}"
        )
    if dtype == torch.float64 and _has_experts_implementation(cls):
        # Mixture-of-experts layers default to a grouped matmul that has no float64 kernel; the
        # per-expert loop computes the same sums with float64 matmuls.
        extra["experts_implementation"] = "eager"
        notes.append(EAGER_EXPERTS_NOTE)
    try:
        m, info = cls.from_pretrained(
            model.path,
            revision=model.revision,
            device_map=device_map or target.device,
            trust_remote_code=model.trust_remote_code,
            output_loading_info=True,
            **extra,
        )
    except Exception as e:
        how = f" with device_map={device_map!r}" if device_map else ""
        raise LoadError(f"{model.path}: the model did not load{how} ({exception_gist(e)})") from e
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        # A task head the checkpoint lacks (an encoder saved bare, loaded for SEQ_CLS) is random; drawn
        # anew on each load, the bare base's outputs would differ between targets by more than numerics.
        _seeded_fill(m, missing, config)
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        notes.append(
            f"{cls.__name__} has tensors the checkpoint lacks, initialised at random from a fixed seed "
            f"(the same values on every target): {', '.join(missing[:3])}{more}"
        )
    m.eval()
    if quantized:
        notes += cpu_4bit_path(m, target)
    if stored is not None:
        setattr(m, FLOAT64_FORWARD, True)
    setattr(m, LOAD_NOTES, notes)
    setattr(m, NOT_IN_CHECKPOINT, missing)
    return m


def _seeded_fill(model: torch.nn.Module, names: list[str], config) -> None:
    """Replace the random values transformers gave tensors the checkpoint lacks with ones from a fixed
    seed per name: normal(0, `initializer_range`) drawn in float32, then cast, so every target (and the
    float64 reference) holds the same head up to its dtype's rounding. A tensor initialised to one
    constant (a zero bias, a LayerNorm's ones) is the same on every load already and is kept."""
    import zlib

    std = float(getattr(config, "initializer_range", None) or 0.02)
    state = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name in names:
            t = state.get(name)
            if t is None or t.is_meta or not t.is_floating_point() or t.numel() == 0:
                continue
            flat = t.detach().reshape(-1)
            if bool((flat == flat[0]).all()):
                continue
            generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            values = torch.randn(tuple(t.shape), generator=generator, dtype=torch.float32) * std
            t.copy_(values.to(device=t.device, dtype=t.dtype))


def fresh_build(model: torch.nn.Module, name: str) -> torch.Tensor | None:
    """Tensor `name` of `model` as a fresh build of the model makes it, in float64 on the CPU: its module
    copied and initialised anew by the model's own `_init_weights` (what transformers runs for a tensor
    the checkpoint does not hold, Marian's sinusoidal position embeddings). None where that build is
    not deterministic (two builds from different seeds differ) or cannot be made."""
    import copy

    owner_name, _, leaf = name.rpartition(".")
    try:
        owner = model.get_submodule(owner_name)
        builds = []
        for seed in (0, 1):
            fresh = copy.deepcopy(owner).to(device="cpu", dtype=torch.float64)
            for t in [*fresh.parameters(recurse=False), *fresh.buffers(recurse=False)]:
                t.__dict__.pop("_is_hf_initialized", None)  # transformers skips tensors it marked done
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(seed)
                model._init_weights(fresh)
            builds.append(getattr(fresh, leaf).detach())
    except Exception:  # a model without transformers' init, a module that cannot be copied
        return None
    same = builds[0].shape == builds[1].shape and torch.equal(builds[0], builds[1])
    return builds[0] if same else None


# Set by `load_base` on the model: its notes (`load_notes`).
LOAD_NOTES = "weightdrift_load_notes"
EAGER_EXPERTS_NOTE = (
    "mixture-of-experts layers ran transformers' per-expert loop (experts_implementation='eager') "
    "in float64: its grouped matmul has no float64 kernel"
)


def _has_experts_implementation(cls: type) -> bool:
    """Whether the class has mixture-of-experts layers whose implementation a load can choose."""
    can = getattr(cls, "_can_set_experts_implementation", None)
    return bool(can and can())


def load_notes(model) -> list[str]:
    """What `load_base` noted about how this model (or the base under a PeftModel) was loaded."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return list(getattr(inner, LOAD_NOTES, []))


# Set on a model held in its checkpoint's dtype whose forward runs in float64 block by block.
FLOAT64_FORWARD = "weightdrift_float64_forward"


def forward_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules a float64 forward upcasts one at a time: each block of the model's layer lists,
    and each other top-level piece holding parameters (embeddings, final norm, head).

    A block is upcast whole, adapter layers inside it included: PEFT casts a layer's input to its
    adapter's dtype before the adapter's own modules run, so upcasting leaf by leaf would not do.
    """
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
    holders = {id(m) for m in lists}
    # every ancestor of a layer list is opened up; everything else with parameters is one unit
    ancestors: set[int] = set()
    for name, m in model.named_modules():
        if id(m) in holders:
            parts = name.split(".") if name else []
            for i in range(len(parts) + 1):
                ancestors.add(id(model.get_submodule(".".join(parts[:i]))))
    units: list[torch.nn.Module] = []
    seen: set[int] = set()

    def visit(m: torch.nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        if id(m) in holders:
            units.extend(c for c in m.children() if next(c.parameters(), None) is not None)
            return
        if id(m) in ancestors:
            if next(m.parameters(recurse=False), None) is not None:
                units.append(m)  # parameters of its own beside the layer lists (rare): upcast with it
            for c in m.children():
                visit(c)
            return
        if next(m.parameters(), None) is not None:
            units.append(m)

    visit(model)
    return units


@contextlib.contextmanager
def float64_forward(model: torch.nn.Module) -> Iterator[None]:
    """Run forwards inside in float64 one unit at a time, when `model` is held for that (FLOAT64_FORWARD).

    Each unit's floating parameters are widened to float64 just before it runs (exact) and given
    their narrow storage back right after, so peak memory is the model in its checkpoint's dtype
    plus one block in float64. A model not marked runs as it is.
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(inner, FLOAT64_FORWARD, False):
        yield
        return
    handles = []

    held: dict[int, dict[int, torch.Tensor]] = {}  # unit → parameter → its narrow storage
    # Float64 buffers given back by earlier units, by shape, kept on the model for its next forward:
    # widening into memory already touched costs no page faults. Only Linear layers' parameters on
    # the CPU (their outputs are never views of them) of shapes more than one unit has (decoder
    # blocks), so the pool holds about one block.
    pool: dict[tuple[int, ...], list[torch.Tensor]] = inner.__dict__.setdefault(_FLOAT64_POOL, {})
    pooled: dict[int, set[int]] = {}  # unit → its parameters whose float64 buffer returns to the pool
    units = forward_units(model)
    unit_shapes = [
        {tuple(p.shape) for m in u.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters(False)}
        for u in units
    ]
    shared = {shape for shape in set().union(*unit_shapes) if sum(shape in u for u in unit_shapes) > 1}

    def widen(unit, args):
        narrow_of = held.setdefault(id(unit), {})
        returning = pooled.setdefault(id(unit), set())
        for owner in unit.modules():
            linear = isinstance(owner, torch.nn.Linear)
            for p in owner.parameters(recurse=False):
                if not p.is_floating_point() or p.dtype == torch.float64 or id(p) in narrow_of:
                    continue
                narrow_of[id(p)] = p.data
                if linear and p.device.type == "cpu" and tuple(p.shape) in shared:
                    free = pool.get(tuple(p.shape))
                    p.data = free.pop().copy_(p.data) if free else p.data.to(torch.float64)
                    returning.add(id(p))
                else:
                    p.data = p.data.to(torch.float64)

    def narrow(unit, args, output):
        # the narrow storage itself comes back: no conversion, and bit for bit what was held
        narrow_of = held.pop(id(unit), {})
        returning = pooled.pop(id(unit), set())
        for p in unit.parameters():
            if id(p) in narrow_of:
                if id(p) in returning:
                    pool.setdefault(tuple(p.shape), []).append(p.data)
                p.data = narrow_of[id(p)]

    for unit in units:
        handles.append(unit.register_forward_pre_hook(widen))
        handles.append(unit.register_forward_hook(narrow))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


_FLOAT64_POOL = "_weightdrift_float64_pool"

# Set on a model by `float32_fallbacks`: the names of the ops that ran in float32 in its float64 forward.
FLOAT32_FALLBACKS = "weightdrift_float32_fallbacks"


class _Float32Fallback(torch.overrides.TorchFunctionMode):
    """Runs an op that fails on float64 inputs (no float64 kernel) in float32 from those inputs and
    widens its result back, recording the op's name; any other failure is raised as it was."""

    def __init__(self, used: set[str]):
        super().__init__()
        self.used = used

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as e:
            from torch.utils._pytree import tree_flatten, tree_map

            floating = [
                t
                for t in tree_flatten((args, kwargs))[0]
                if isinstance(t, torch.Tensor) and t.is_floating_point()
            ]
            # only where every float input is float64: a float64 tensor meeting a float32 one is a bug to show
            if not floating or any(t.dtype != torch.float64 for t in floating):
                raise
            narrow_args, narrow_kwargs = tree_map(
                lambda t: (
                    t.to(torch.float32) if isinstance(t, torch.Tensor) and t.dtype == torch.float64 else t
                ),
                (args, kwargs),
            )
            try:
                out = func(*narrow_args, **narrow_kwargs)
            except Exception:
                raise e from None  # not a float64 matter: the op's own error
            self.used.add(getattr(func, "__name__", str(func)))
            return tree_map(
                lambda t: (
                    t.to(torch.float64) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t
                ),
                out,
            )


@contextlib.contextmanager
def float32_fallbacks(model: torch.nn.Module) -> Iterator[None]:
    """Inside, an op of a float64 forward that has no float64 kernel runs in float32 from its float64
    inputs instead of failing the reference; `float32_fallback_notes(model)` names those ops after."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    used = getattr(inner, FLOAT32_FALLBACKS, None)
    if used is None:
        used = set()
        setattr(inner, FLOAT32_FALLBACKS, used)
    with _Float32Fallback(used):
        yield


def float32_fallback_notes(model) -> list[str]:
    """A note per op that `float32_fallbacks` ran in float32 in this model's forwards."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return [
        f"{op} has no float64 kernel here: computed in float32 from float64 inputs, its result widened to float64"
        for op in sorted(getattr(inner, FLOAT32_FALLBACKS, ()))
    ]


def attach_adapter(model, adapter: AdapterRef, target: Target):
    """`PeftModel.from_pretrained` onto a bare base, or `load_adapter` onto a PeftModel."""
    from peft import PeftModel

    try:
        if isinstance(model, PeftModel):
            model.load_adapter(adapter.path, adapter_name=adapter.name, torch_device=target.device)
            model.set_adapter(adapter.name)
            return model
        return PeftModel.from_pretrained(
            model, adapter.path, adapter_name=adapter.name, torch_device=target.device, is_trainable=False
        )
    except LoadError:
        raise
    except Exception as e:
        raise LoadError(f"adapter {adapter.name} ({adapter.path}) did not load: {exception_gist(e)}") from e


@dataclass
class Loaded:
    """One materialised model: the bare base (adapter None) or base + one adapter."""

    adapter: AdapterRef | None
    model: object  # None where PEFT refused the adapter on this target (`refused` says why)
    notes: list[str]  # how this model was materialised, where it differs from what was asked
    refused: str | None = None


def load_isolated(
    base: ModelRef,
    adapters: tuple[AdapterRef, ...],
    target: Target,
    stage: Callable[[str], None] = lambda s: None,
) -> Iterator[Loaded]:
    """The `isolated` strategy: the bare base first, then each adapter on a fresh base.

    PEFT refuses to initialise PiSSA in float64 (it takes an SVD of W and rewrites it), so a
    PiSSA adapter on a float64 target is loaded in float32 and the whole model upcast; the
    note says so.

    On a quantized target an adapter PEFT will not load there (PiSSA cannot be initialised on a
    4-bit base) is a finding about that target, not bad input: it is yielded with no model and
    PEFT's reason (`Loaded.refused`), and the adapters after it load as usual, each on a fresh base.
    Elsewhere a load that fails ends the run (the adapter is broken, or for another base).
    """
    stage("load base")
    task_type = adapters_task_type(adapters)
    model = load_base(base, target, task_type=task_type, adapters=adapters)
    yield Loaded(adapter=None, model=model, notes=load_notes(model))
    for i, adapter in enumerate(adapters):
        notes: list[str] = []
        upcast = _pissa_upcast(adapter, target)
        if i > 0 or upcast:
            stage(f"load base for {adapter.name}")
            del model
            model = load_base(
                base, target, dtype=torch.float32 if upcast else None, task_type=task_type, adapters=adapters
            )
        notes.extend(load_notes(model))
        stage(f"load adapter {adapter.name}")
        try:
            peft_model = attach_adapter(model, adapter, target)
        except LoadError as e:
            if not target.quantized:
                raise
            model = None
            yield Loaded(adapter=adapter, model=None, notes=notes, refused=str(e))
            continue
        notes.extend(adapter_keys.expansion_notes(read_adapter_config(adapter)))
        init = float32_only_init(read_adapter_config(adapter)) if upcast else None
        if upcast and float64_offload_dtype(base) is not None:
            # too large for float64 whole: it stays float32 and runs its forward in float64 block by block
            setattr(model, FLOAT64_FORWARD, True)
            notes.append(f"{init} cannot be initialised in float64; loaded in float32, forward in float64")
        elif upcast:
            peft_model = peft_model.to(torch.float64)
            notes.append(f"{init} cannot be initialised in float64; loaded in float32 and upcast to float64")
        yield Loaded(adapter=adapter, model=peft_model, notes=notes)
        model = None
        del peft_model


def _pissa_upcast(adapter: AdapterRef, target: Target) -> bool:
    return target.dtype == "float64" and float32_only_init(read_adapter_config(adapter)) is not None


def isolated_stages(adapters: tuple[AdapterRef, ...], target: Target) -> int:
    """How many stages `load_isolated` reports, so progress reads step k of a true n."""
    fresh_bases = sum(1 for i, a in enumerate(adapters) if i > 0 or _pissa_upcast(a, target))
    return 1 + fresh_bases + len(adapters)


@dataclass(frozen=True)
class Strategy:
    """A named way of loading base and adapters: the loader and its stage count."""

    load: Callable[..., Iterator[Loaded]]
    stages: Callable[[tuple[AdapterRef, ...], Target], int]


STRATEGIES: dict[str, Strategy] = {"isolated": Strategy(load=load_isolated, stages=isolated_stages)}


# --- strategies that load several adapters onto one base object (issue 6) ----------------------
#
# Users load adapters in a loop on the same base model; these strategies do exactly that, so the
# `adapters` check can show where their predictions part from `isolated`. Each adapter is attached
# with `torch_device=target.device` (as `isolated` does), so that the strategies differ only in how
# adapters share the base, not in where PEFT puts them.


# Every note made from a library warning says so (after the adapter's name): pages fold them away.
PEFT_WARNED = "PEFT warned"


def _peft_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    """PEFT's own warnings from one load, first sentence each: they name stacking and missing keys."""
    notes = []
    for w in caught:
        if issubclass(w.category, (DeprecationWarning, FutureWarning)):
            continue  # library deprecations say nothing about this load
        message = str(w.message).strip()
        keys = re.findall(r"'([^']+)'", message.partition("missing adapter keys")[2])
        if keys:
            # PEFT names the keys of every adapter the modules hold; usually an earlier, stacked one
            note = f"{PEFT_WARNED} of {len(keys)} missing adapter keys while loading (e.g. {keys[0]})"
        else:
            note = f"{PEFT_WARNED}: " + message.split(". ")[0].rstrip(".")[:300]
        if note not in notes:
            notes.append(note)
    return notes


def load_onto(
    attach: Callable[[], object], adapter: AdapterRef, model, target: Target
) -> tuple[object, list[str]]:
    """Run one `attach()` (a PEFT load call on `model`) and return (PeftModel, notes).

    PEFT refuses to initialise PiSSA in float64 (it takes an SVD of W and rewrites it): on a float64
    target the whole model is cast to float32 for that load and back. That round trip is exact for
    weights that were float32 values to begin with (a float32 checkpoint upcast); the note says so.
    """
    notes: list[str] = []
    # a model held narrow for a float64 forward (FLOAT64_FORWARD) needs no round trip
    downcast = _pissa_upcast(adapter, target) and not getattr(model, FLOAT64_FORWARD, False)
    if downcast:
        model.to(torch.float32)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            peft_model = attach()
    except LoadError:
        raise
    except Exception as e:
        raise LoadError(f"adapter {adapter.name} ({adapter.path}) did not load: {exception_gist(e)}") from e
    finally:
        if downcast:
            model.to(torch.float64)
    if downcast:
        peft_model.to(torch.float64)
        notes.append(
            "PiSSA cannot be initialised in float64; the model was cast to float32 for this load and "
            "back to float64 (exact for weights stored in float32)"
        )
    return peft_model, load_notes(model) + notes + _peft_warnings(caught)


def load_from_pretrained_loop(
    base: ModelRef,
    adapters: tuple[AdapterRef, ...],
    target: Target,
    stage: Callable[[str], None] = lambda s: None,
) -> Iterator[Loaded]:
    """`from_pretrained_loop`: one base object; `PeftModel.from_pretrained(base, path, adapter_name=name)`
    for each adapter in turn on that same object, as users write it.

    Each call injects into the modules the previous calls already wrapped, so the adapters stack
    (a module holds all of them, the last one active), and whatever an adapter does to the base
    weights on load (PiSSA replaces W by its residual) stays for the adapters after it. Each Loaded
    holds the PeftModel that call returned.
    """
    from peft import PeftModel

    stage("load base")
    model = load_base(base, target, task_type=adapters_task_type(adapters), adapters=adapters)
    yield Loaded(adapter=None, model=model, notes=load_notes(model))
    for adapter in adapters:
        stage(f"load adapter {adapter.name}")

        def attach(adapter=adapter):
            return PeftModel.from_pretrained(
                model, adapter.path, adapter_name=adapter.name, torch_device=target.device, is_trainable=False
            )

        peft_model, notes = load_onto(attach, adapter, model, target)
        yield Loaded(adapter=adapter, model=peft_model, notes=notes)


def _load_adapter_strategy(low_cpu_mem_usage: bool) -> Callable[..., Iterator[Loaded]]:
    def load(
        base: ModelRef,
        adapters: tuple[AdapterRef, ...],
        target: Target,
        stage: Callable[[str], None] = lambda s: None,
    ) -> Iterator[Loaded]:
        from peft import PeftModel

        stage("load base")
        model = load_base(base, target, task_type=adapters_task_type(adapters), adapters=adapters)
        yield Loaded(adapter=None, model=model, notes=load_notes(model))
        peft_model = None
        for adapter in adapters:
            stage(f"load adapter {adapter.name}")
            if peft_model is None:

                def attach(adapter=adapter):
                    return PeftModel.from_pretrained(
                        model,
                        adapter.path,
                        adapter_name=adapter.name,
                        torch_device=target.device,
                        is_trainable=False,
                        low_cpu_mem_usage=low_cpu_mem_usage,
                    )

                peft_model, notes = load_onto(attach, adapter, model, target)
            else:

                def attach(adapter=adapter, pm=peft_model):
                    pm.load_adapter(
                        adapter.path,
                        adapter_name=adapter.name,
                        torch_device=target.device,
                        is_trainable=False,
                        low_cpu_mem_usage=low_cpu_mem_usage,
                    )
                    pm.set_adapter(adapter.name)
                    return pm

                peft_model, notes = load_onto(attach, adapter, peft_model, target)
            yield Loaded(adapter=adapter, model=peft_model, notes=notes)

    return load


load_adapter_loop = _load_adapter_strategy(low_cpu_mem_usage=False)
load_adapter_loop.__name__ = "load_adapter_loop"
load_adapter_loop.__doc__ = """`load_adapter`: `PeftModel.from_pretrained` for the first adapter, then
`load_adapter(path, adapter_name=name)` + `set_adapter(name)` for each later one, on that PeftModel."""
load_adapter_low_mem = _load_adapter_strategy(low_cpu_mem_usage=True)
load_adapter_low_mem.__name__ = "load_adapter_low_mem"
load_adapter_low_mem.__doc__ = """`load_adapter_low_mem`: as `load_adapter`, every call with
`low_cpu_mem_usage=True` (adapter weights created empty on the meta device, then filled from the file)."""


def shared_base_stages(adapters: tuple[AdapterRef, ...], target: Target) -> int:
    """Stages of the strategies that keep one base object: load base, then one per adapter."""
    return 1 + len(adapters)


STRATEGIES["from_pretrained_loop"] = Strategy(load=load_from_pretrained_loop, stages=shared_base_stages)
STRATEGIES["load_adapter"] = Strategy(load=load_adapter_loop, stages=shared_base_stages)
STRATEGIES["load_adapter_low_mem"] = Strategy(load=load_adapter_low_mem, stages=shared_base_stages)
