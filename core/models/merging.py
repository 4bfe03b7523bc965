"""Merging adapters into base weights, measured: tied storage, safe merge per module, the loaded base
weights restored bit for bit between merges, NaN/Inf a merge wrote into W, save round trip.

Pure helpers on a loaded model (no metrics, no Streamlit): the `merge` check calls them on each
target and turns what they return into metric rows and report tables. Everything reported is
what the libraries did on this model, never a hard-coded expectation. Also here: what each merge
stage runs (`STAGES`, the page's texts), the error at the tensor's scale (`scale_ulp`), which adapters
merge together (`merge_subset`) and the base weights a float64 reference merges into (`reference_base`).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from core.methods import adapter_keys, formulas, projections
from core.methods.families import lora
from core.models import targets
from core.models.checkpoint import Checkpoint, adapters_task_type, read_adapter_config, read_checkpoint
from core.models.conversion import attention_modules, loaded_shapes, targeted_parameters
from core.models.validate import TIED_EMBEDDING_NAMES
from core.numerics.tolerance import ulp
from core.spec import AdapterRef, ProbeSpec, Target

# PEFT's own test tolerances (tests/testing_common.py, PEFT 0.21): `_test_merge_layers` compares
# unmerged, merge_adapter, unmerge_adapter, merge_and_unload and the save/reload logits with
# atol = rtol = 1e-4 (AdaLoRA 1e-2); `_test_safe_merge` compares merge_and_unload(safe_merge=True)
# with 1e-6. PEFT's merge test skips OFT and BOFT (their multi-adapter merge test uses 1e-3); we use
# 1e-2 for the rotation methods, the bound the issue quotes for OFT. IA3, DoRA and PiSSA run
# PEFT's LoRA-path assertions: 1e-4.
PEFT_MERGE_TOL: dict[str, float] = {
    "lora": 1e-4,
    "pissa": 1e-4,
    "dora": 1e-4,
    "ia3": 1e-4,
    "oft": 1e-2,
    "boft": 1e-2,
    "adalora": 1e-2,
}
PEFT_SAFE_MERGE_TOL = 1e-6
PEFT_TOL_SOURCE = {
    "merge": "PEFT tests/testing_common.py _test_merge_layers (atol = rtol)",
    "safe_merge": "PEFT tests/testing_common.py _test_safe_merge (atol = rtol = 1e-6)",
}
# The stages that merge with safe_merge=True (the `merge` check's names): PEFT tests those at 1e-6.
SAFE_MERGE_STAGES = ("safe_merge",)

# What each stage runs, in order; the page lists these texts beside its numbers. For LoRA, PEFT's
# default path adds ΔW as computed (float32 where PEFT upcast a bfloat16/float16 adapter) and rounds
# once to W's dtype; safe_merge rounds ΔW to W's dtype first, then adds: two roundings.
STAGES: dict[str, str] = {
    "unmerged": "the loaded PeftModel's forward, adapter active, nothing merged",
    "merge_adapter": "model.merge_adapter(adapter_names=[adapter]): PEFT's default path (safe_merge=False), "
    "W += ΔW in place, on the loaded W",
    "unmerge_adapter": "model.unmerge_adapter() right after merge_adapter: W −= ΔW; what it leaves is the "
    "round trip",
    "safe_merge": "layer.merge(safe_merge=True, adapter_names=[adapter]) module by module, on the loaded W "
    "restored bit for bit: W + ΔW in a copy, refused (module named) where it holds NaN/Inf",
    "merge_and_unload": "model.merge_and_unload(adapter_names=[adapter]) with PEFT's defaults "
    "(safe_merge=False), on the loaded W restored bit for bit",
    "reload": "the merge_and_unload() model saved with save_pretrained and loaded again on the same target",
}
SUBSET_STAGE_TEXT: dict[str, str] = {
    "subset unmerged": "a fresh base with the adapters loaded, all active: the unmerged sum",
    "subset merge_adapter sequential": "merge_adapter(adapter_names=[a]) for each adapter in turn (PEFT's "
    "default path): W rounded to its dtype after each",
    "subset merge_adapter combined": "add_weighted_adapter(adapters, combination_type='cat') into one "
    "adapter, then merge_adapter(adapter_names=['combined']), on the loaded W restored bit for bit",
}
OUTPUT_STAGES = tuple(STAGES)
SUBSET_STAGES = tuple(SUBSET_STAGE_TEXT)

# Up to this many ulps at the tensor's scale is what rounding a merge's sums and products leaves
# (measured on the demo: LoRA 1.9 in float32; in bfloat16 0.63 by PEFT's default merge, 1.1 by
# safe_merge, which rounds ΔW to bfloat16 before adding it; BOFT 2.8 in float32).
ROUNDING_ULPS = 4.0


def peft_tolerance(kind: str, stage: str) -> float:
    """The atol (= rtol) PEFT's own tests allow for ``kind`` at ``stage``.

    A stage that merges with ``safe_merge=True`` gets the safe-merge test's 1e-6 where the method's
    merge tolerance is not looser than that test's (the rotation methods keep theirs: PEFT does not
    tighten them); every other stage, PEFT's default path included, the method's merge tolerance.
    Unknown methods get the LoRA value.
    """
    merge = PEFT_MERGE_TOL.get(kind, PEFT_MERGE_TOL["lora"])
    if stage in SAFE_MERGE_STAGES and merge <= PEFT_MERGE_TOL["lora"]:
        return PEFT_SAFE_MERGE_TOL
    return merge


# --------------------------------------------------------------------------------------------------
# Tied / shared storage
# --------------------------------------------------------------------------------------------------


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def shared_groups(tensors: dict[str, torch.Tensor]) -> list[list[str]]:
    """Names that share one storage, per group (sorted), for groups of two or more.

    This is what `safetensors.torch.save_file` refuses ("Some tensors share memory").
    """
    groups: dict[tuple[str, int], list[str]] = {}
    for name, t in tensors.items():
        if t.numel() == 0:
            continue
        groups.setdefault(_storage_key(t), []).append(name)
    return sorted(sorted(g) for g in groups.values() if len(g) > 1)


def model_tied_groups(model: nn.Module) -> list[list[str]]:
    """Parameter names of `model` that share storage (tied weights), duplicates included."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return shared_groups(params)


def base_parameter_name(name: str) -> str:
    """Parameter path as in the base state dict: PEFT's prefix and `base_layer.` removed."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


@dataclass(frozen=True)
class TiedFinding:
    """An adapted module whose weight shares storage with other parameters."""

    module: str  # base-model module path, e.g. "lm_head"
    tied_to: tuple[str, ...]  # the other parameters (base state-dict names) on the same storage

    @property
    def pair(self) -> str:
        return " ↔ ".join([f"{self.module}.weight", *self.tied_to])

    def as_dict(self) -> dict[str, Any]:
        return {"module": self.module, "tied_to": list(self.tied_to), "pair": self.pair}


def tied_adapted_modules(peft_model: nn.Module, adapter: str) -> list[TiedFinding]:
    """Modules `adapter` changes whose weight is tied to another parameter (found before merging).

    Merging writes ΔW into the shared storage, so the partner (e.g. embed_tokens for lm_head)
    silently changes as well.
    """
    groups = model_tied_groups(peft_model)
    findings = []
    for module, (layer, names) in adapter_keys.adapted_modules(peft_model).items():
        if adapter not in names:
            continue
        key = _storage_key(base_weight(layer))
        for group in groups:
            members = {base_parameter_name(n) for n in group}
            if f"{module}.weight" not in members:
                continue
            params = dict(peft_model.named_parameters(remove_duplicate=False))
            if _storage_key(params[group[0]]) != key:
                continue
            others = tuple(sorted(m for m in members if m != f"{module}.weight"))
            if others:
                findings.append(TiedFinding(module=module, tied_to=others))
    return findings


def tied_partner_modules(finding: TiedFinding) -> list[str]:
    """Module paths (without `.weight`) of the partners of a tied finding."""
    return [n.removesuffix(".weight") for n in finding.tied_to]


# --------------------------------------------------------------------------------------------------
# Merging layer by layer, so that failures name the module
# --------------------------------------------------------------------------------------------------


def merge_modules(peft_model: nn.Module, adapters: list[str], safe: bool = True) -> dict[str, str]:
    """`layer.merge(safe_merge=safe, adapter_names=[a])` for each adapted module and adapter, in order.

    Returns module → the library's error for modules whose merge was refused (safe_merge found
    NaN/Inf); those modules stay unmerged. Merging module by module, rather than through
    `merge_adapter(safe_merge=True)`, which stops at the first refusal, is what lets the report name
    every broken module while the others merge.
    """
    errors: dict[str, str] = {}
    for module, (layer, names) in adapter_keys.adapted_modules(peft_model).items():
        for adapter in adapters:
            if adapter not in names:
                continue
            try:
                layer.merge(safe_merge=safe, adapter_names=[adapter])
            except ValueError as e:
                errors[module] = f"{type(e).__name__}: {e}"
    return errors


def unmerge_modules(peft_model: nn.Module) -> None:
    """`unmerge()` on every merged tuner layer (PEFT's `unmerge_adapter`)."""
    for _, (layer, _) in adapter_keys.adapted_modules(peft_model).items():
        if layer.merged:
            layer.unmerge()


def base_weight(layer: nn.Module) -> torch.Tensor:
    """The base weight a tuner layer merges into (a bitsandbytes weight dequantized, as PEFT merges it; the
    parameter a LoRA on parameters targets)."""
    if type(layer).__name__ == "ParamWrapper":
        return layer.get_param()
    base = layer.get_base_layer()
    if isinstance(base, nn.MultiheadAttention):  # PEFT's LoRA on it merges into in_proj_weight
        return base.in_proj_weight
    return targets.dequantize(base) if targets.is_quantized_layer(base) else base.weight


def base_state(layers: dict[str, nn.Module]) -> dict[str, dict[str, Any]]:
    """module → {parameter name: clone} of each tuner layer's base layer (weight, bias): the state to restore.

    A merge can write into the bias too (LoRA with ``lora_bias``), so every base parameter is kept. A
    bitsandbytes layer's weight is kept dequantized (what rows compare), with the quantized weight
    itself under `targets.HELD` (what `restore_base` puts back).
    """
    state: dict[str, dict[str, Any]] = {}
    for module, layer in layers.items():
        if type(layer).__name__ == "ParamWrapper":  # its one parameter (`base_weight`), as "weight"
            state[module] = {"weight": layer.get_param().detach().clone()}
            continue
        base = layer.get_base_layer()
        state[module] = {n: p.detach().clone() for n, p in base.named_parameters()}
        if "weight" not in state[module]:  # nn.MultiheadAttention's: its in_proj_weight
            state[module]["weight"] = base_weight(layer).detach().clone()
        if targets.is_quantized_layer(base):
            state[module].update(
                weight=targets.dequantize(base).clone(), **{targets.HELD: targets.hold(base)}
            )
    return state


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: same dtype, shape and bytes (a NaN equals the same NaN, −0.0 differs from 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


def restore_base(
    peft_model: nn.Module, layers: dict[str, nn.Module], state: dict[str, dict[str, torch.Tensor]]
) -> list[str]:
    """Put every adapted module back to the unmerged state `state` was taken in (`base_state`), bit for bit.

    `unmerge()` on merged layers first, so PEFT's own bookkeeping (which adapters are merged, cached
    norms) is its own again; then the clones are copied over what that round trip left in the base
    parameters (the storage stays, so tied partners are restored with it). Returns the modules whose
    parameters still differ bitwise from `state` (none, unless a parameter was replaced by another
    of a different shape or dtype).
    """
    unmerge_modules(peft_model)
    broken = []
    for module, layer in layers.items():
        base = layer.get_base_layer()
        saved_state = dict(state[module])
        held = saved_state.pop(targets.HELD, None)
        if held is not None:  # the quantized weight object as loaded; its float form is checked below
            targets.put_back(base, held)
        params = {**dict(base.named_parameters()), "weight": base_weight(layer)}
        for name, saved in saved_state.items():
            if held is None or name != "weight":
                params[name].data.copy_(saved)
        if any(not same_bits(params[n], saved) for n, saved in saved_state.items()):
            broken.append(module)
    return broken


def nonfinite_written(
    layers: dict[str, nn.Module], state: dict[str, dict[str, torch.Tensor]]
) -> dict[str, int]:
    """module → how many elements of its base weight are NaN/Inf now and were finite in `state`.

    PEFT's default merge (``safe_merge=False``) adds ΔW without looking: a NaN in the adapter lands
    in W. This names the modules where it did.
    """
    out = {}
    for module, layer in layers.items():
        now, was = base_weight(layer).detach(), state[module]["weight"]
        n = int((~torch.isfinite(now) & torch.isfinite(was.to(now.device))).sum())
        if n:
            out[module] = n
    return out


# --------------------------------------------------------------------------------------------------
# Save round trip
# --------------------------------------------------------------------------------------------------


@dataclass
class SaveAttempt:
    """One way of saving the merged model and what happened."""

    method: str  # "save_pretrained" | "safetensors.save_file(state_dict)"
    ok: bool
    error: str = ""
    folder: str = ""  # where it was kept (save_pretrained only), "" if not kept
    files: list[str] | None = None
    seconds: float = 0.0


def error_text(e: BaseException) -> str:
    """The exception's type and its whole message on one line (a save error names every shared tensor)."""
    text = " ".join(ln.strip() for ln in str(e).strip().splitlines() if ln.strip())
    return f"{type(e).__name__}: {text[:500]}"


def try_save_file(model: nn.Module) -> SaveAttempt:
    """`safetensors.torch.save_file(model.state_dict())` into a scratch folder that is always removed."""
    import time

    from safetensors.torch import save_file

    started = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="wd-save-file-"))
    try:
        save_file(model.state_dict(), str(scratch / "model.safetensors"))
        return SaveAttempt("safetensors.save_file(state_dict)", True, seconds=time.perf_counter() - started)
    except Exception as e:  # the library's own refusal is the finding
        return SaveAttempt(
            "safetensors.save_file(state_dict)", False, error_text(e), seconds=time.perf_counter() - started
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def save_pretrained_atomic(model: nn.Module, folder: Path) -> SaveAttempt:
    """`save_pretrained(safe_serialization=True)` into a temporary sibling, renamed into `folder`.

    A failure leaves nothing behind (the sibling is removed); an existing `folder` is replaced
    only once the new one is complete.
    """
    import time

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.{secrets.token_hex(4)}.tmp")
    started = time.perf_counter()
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        return SaveAttempt("save_pretrained", False, error_text(e), seconds=time.perf_counter() - started)
    files = sorted(p.name for p in folder.iterdir())
    return SaveAttempt(
        "save_pretrained", True, folder=str(folder), files=files, seconds=time.perf_counter() - started
    )


def save_fix(groups: list[list[str]], attempts: list[SaveAttempt]) -> str:
    """What the user can do, from what was measured (shared groups, which save paths worked)."""
    worked = [a.method for a in attempts if a.ok]
    failed = [a.method for a in attempts if not a.ok]
    if not failed:
        return ""
    names = "; ".join(" ↔ ".join(g) for g in groups)
    if groups and "save_pretrained" in worked:
        return (
            f"use save_pretrained (or safetensors.torch.save_model), which store shared tensors ({names}) "
            "once; to save a plain state_dict, clone one side first, e.g. "
            "model.lm_head.weight = nn.Parameter(model.lm_head.weight.clone()), and set "
            "config.tie_word_embeddings = False"
        )
    if groups:
        return (
            f"untie the shared tensors ({names}) before saving: clone one side into its own "
            "nn.Parameter and set config.tie_word_embeddings = False"
        )
    return "see the library's error above"


def reload_forward(folder: str, target: Target, forward: Callable[[nn.Module], torch.Tensor]) -> torch.Tensor:
    """Load a saved merged model on `target`'s device and dtype and run `forward` on it; a quantized target
    as the folder's config says (saved with its quantization config, it reloads quantized), on the CPU
    path the target names (`cpu_4bit_path`), as the model it was saved from ran."""
    import transformers

    from core.models.loading import model_class, torch_dtype

    config = transformers.AutoConfig.from_pretrained(folder)
    kwargs = {} if target.quantized else {"dtype": torch_dtype(target.dtype)}
    model = model_class(config).from_pretrained(folder, device_map=target.device, **kwargs)
    model.eval()
    targets.cpu_4bit_path(model, target)
    try:
        return forward(model)
    finally:
        del model


def save_round_trip(
    merged: nn.Module,
    run_dir: str | Path | None,
    target: Target,
    adapter: str,
    on_reload: Callable[[nn.Module], Any],
) -> dict:
    """The save report of a merged model: shared tensors, which save paths work (`try_save_file`, then
    `save_pretrained_atomic` into ``run_dir/merged/<target>/<adapter>``, or a scratch folder removed
    afterwards without a run folder) and a reload on the same target, whose model `on_reload` gets."""
    groups = shared_groups(merged.state_dict())
    attempts = [try_save_file(merged)]
    scratch = None
    if run_dir is not None:
        folder = Path(run_dir) / "merged" / target.slug / adapter
    else:  # no run folder (a direct call): save into a scratch folder removed afterwards
        scratch = Path(tempfile.mkdtemp(prefix="wd-merged-"))
        folder = scratch / adapter
    try:
        saved = save_pretrained_atomic(merged, folder)
        attempts.append(saved)
        reload_error = ""
        if saved.ok:
            try:
                reload_forward(saved.folder, target, on_reload)
            except Exception as e:  # a reload failure is a finding of the save report
                reload_error = error_text(e)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
            for a in attempts:
                a.folder = ""
    return {
        "shared": groups,
        "attempts": [a.__dict__ for a in attempts],
        "reload_error": reload_error,
        "fix": save_fix(groups, attempts),
    }


# --------------------------------------------------------------------------------------------------
# Measuring a merge, and which adapters merge together
# --------------------------------------------------------------------------------------------------


def scale_ulp(
    merged: torch.Tensor, exact: torch.Tensor, before: torch.Tensor | None, dtype: torch.dtype
) -> float:
    """max |merged − exact| in ulps (of `dtype`) of the tensor's scale, max(|W|, |W + ΔW|) over all elements.

    `max_ulp` counts ulps of each exact element, which explodes where W + ΔW (or the products inside
    ΔW) nearly cancel to 0. A merge computed in `dtype` carries rounding errors at the size of the
    numbers it adds and multiplies, so measured at the tensor's scale about 1 ulp (a few where ΔW is a
    matmul: 1.9 for the demo LoRA in float32, 2.8 for BOFT) reads as rounding, and tens or more as an
    error (a wrong scaling, a missing term, a changed W). NaN when shapes differ.
    """
    exact = exact.to(torch.float64)
    if merged.shape != exact.shape:
        return math.nan
    diff = (merged.to(torch.float64) - exact).abs()
    finite = torch.isfinite(diff) & torch.isfinite(exact)
    if not finite.any():
        return math.nan
    scale = exact[finite].abs().max()
    if before is not None and before.shape == exact.shape:
        w = before.to(torch.float64)
        scale = torch.maximum(scale, w[torch.isfinite(w)].abs().max())
    return float(diff[finite].max() / ulp(scale.reshape(1), dtype)[0])


def saved_module_tensors(merged: nn.Module, adapter: AdapterRef) -> dict[str, torch.Tensor]:
    """The tensors of the modules `adapter` saves whole (``modules_to_save``) as the merged model holds them,
    by their adapter-file keys; a key the model lacks is left out (the weights check names it)."""
    names = adapter_keys.saved_module_names(read_adapter_config(adapter))
    if not names:
        return {}
    params = merged.state_dict()
    found = {}
    for key in Checkpoint.open(adapter.path, prefix="adapter_model").names():
        saved = adapter_keys.split_saved_module_key(key, names)
        if saved is None:
            continue
        tensor = params.get(f"{saved[0]}.{saved[1]}")
        if tensor is not None:
            found[key] = tensor
    return found


def load_with_adapters(spec: ProbeSpec, target: Target, adapters: list[AdapterRef]) -> nn.Module:
    """A fresh base of the run on `target` with `adapters` loaded onto it, one PeftModel."""
    from core.models.loading import attach_adapter, load_base

    model = load_base(
        spec.base,
        target,
        task_type=adapters_task_type(spec.adapters),
        adapters=spec.adapters,
    )
    for a in adapters:
        model = attach_adapter(model, a, target)
    return model


def reference_base(spec: ProbeSpec, names: set[str]) -> dict[str, torch.Tensor]:
    """The base weights `names` (the adapted modules' weights) by the loaded model's names, read from the
    checkpoint, with the embedding a tied head shares: never the whole base."""
    from core.models.conversion import read_loaded

    if "lm_head.weight" in names:  # a tied head is stored once, as the input embedding
        names = names | {
            n for n in Checkpoint.open(spec.base.path).names() if n.endswith(TIED_EMBEDDING_NAMES)
        }
    # an adapter that replicates layers names the copies: the layers they copy are read
    orders = [adapter_keys.replicated_layers(read_adapter_config(a)) for a in spec.adapters]
    names = names | {adapter_keys.unreplicated(n, order) for order in orders if order for n in names}
    base = read_loaded(spec.base.path, names)  # by the loaded model's names
    return with_tied_aliases(spec, base)


def module_reference(
    spec: ProbeSpec, adapters: list[str], role: str, name: str
) -> tuple[torch.Tensor | None, str]:
    """The float64 reference of one weight the merge check measures, and its note, from module `name`'s
    tensors alone: ``merged`` W + ΔW, ``delta`` ΔW (`adapters`: one adapter, or a subset merged in order,
    ``merged`` only), ``tied`` a partner's own base weight. (None, "") where the module is not adapted;
    (None, why) where the formula fails. What the merge check computes for the whole adapter at once, for
    this module: a worker measures one tensor at a time, the drill-down one module."""
    base = reference_base(spec, adapter_keys.base_tensor_names([name]))
    if role == "tied":
        w = base.get(f"{name}.weight")
        return (
            (None, "") if w is None else (w.to(torch.float64), "its own base weight: no adapter targets it")
        )
    by_name = {a.name: a for a in spec.adapters}
    try:
        module = adapter_keys.bias_module(name) or name  # a bias change is read with its module's tensors
        files = [_module_files(by_name[a], module, spec.base.path) for a in adapters]
        files = [f for f in files if f[1]]  # an adapter of a subset that leaves this module alone
        if not files:
            return None, ""
        if len(adapters) > 1:
            source = formulas.sequential_merged_weights(files, base) if role == "merged" else {}
        else:
            ((config, tensors),) = files
            deltas = formulas.reference_deltas(config, tensors, base)
            if role == "delta":
                source = deltas
            else:
                source = formulas.merged_weights(config, tensors, base, deltas=deltas)
    except (ValueError, KeyError) as e:
        return None, f"no float64 reference: {e}"
    if name not in source:
        return None, ""
    if role == "delta":
        return source[name], "ΔW, float64 formula from the checkpoint"
    return source[name], "W + ΔW, float64 formula from the checkpoint" + (
        " (adapters merged in order)" if len(adapters) > 1 else ""
    )


def _module_files(adapter: AdapterRef, module: str, base: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """The adapter's config and the tensors of `module` in its file (the shared ones included), by the
    file's index: only their bytes are read (`adapter_files`)."""
    return adapter_files(adapter, base, {module})


def adapter_files(
    adapter: AdapterRef, base: str, modules: Collection[str] | None = None
) -> tuple[dict, dict[str, torch.Tensor]]:
    """The adapter's config and its file's tensors (those of `modules` alone, shared ones included, where
    given), as the float64 formulas read them: with VeRA's or RandLoRA's shared pair regenerated from the
    config where the file lacks it (``save_projection=False``), sized by the shapes of the base weights
    (folder `base`, headers only) of every module the adapter adapts, as PEFT sizes it; LoRA on parameters'
    and on nn.MultiheadAttention's tensors by what they adapt (the file's key kept as the index's value)."""
    config = read_adapter_config(adapter)
    layout = targeted_parameters(base, config)
    paths = {module: path for module, (path, _) in layout.items()}
    names = Checkpoint.open(adapter.path, prefix="adapter_model").names()
    attention = attention_modules(base, config, names, set(paths))
    index = adapter_keys.rename_modules(names, {**paths, **attention})
    twice = [new for old, new in attention.items() if ".base_layer.out_proj" in old]
    extra = {lora.PARAMETER_LAYOUT: dict(layout.values()), adapter_keys.MERGED_TWICE: twice}
    config = {**config, **{k: v for k, v in extra.items() if v}}
    kind = adapter_keys.adapter_type(config)
    shared: dict[str, torch.Tensor] = {}
    if projections.unsaved(kind, config, index):
        by_module = adapter_keys.adapter_module_keys(index, adapter_keys.saved_module_names(config))
        # the modules PEFT sizes them by: those it adapts, not those whose bias alone it trains
        adapted = [m for m, mod in by_module.items() if mod.changes_weight]
        shapes = loaded_shapes(base, {f"{m}.weight" for m in adapted})
        missing = sorted(m for m in adapted if f"{m}.weight" not in shapes)
        if missing:  # a size from a subset of the modules would draw other numbers, not fewer
            raise ValueError(f"{kind}: the base has no weight for {', '.join(missing[:3])}")
        shared = projections.regenerate(kind, config, shapes.values())
        index.update({k: k for k in shared})
    if modules is None:
        names = set(index)
    else:
        by_module = adapter_keys.adapter_module_keys(index, adapter_keys.saved_module_names(config))
        wanted = {adapter_keys.bias_module(m) or m for m in modules}  # a bias change: its module's tensors
        names = {t for m in wanted if m in by_module for t in by_module[m].keys.values()}
    names -= set(shared)
    file_names = {index[n]: n for n in names}
    read = read_checkpoint(adapter.path, prefix="adapter_model", names=set(file_names)) if names else {}
    tensors = {file_names[k]: t for k, t in read.items()}
    if tensors:
        tensors.update(shared)
    return config, tensors


def with_tied_aliases(spec: ProbeSpec, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Base weights plus the tied ones the checkpoint stores once (lm_head.weight → embeddings)."""
    try:
        config = json.loads((Path(spec.base.path) / "config.json").read_text())
    except (OSError, ValueError):
        return base
    tie = config.get("tie_word_embeddings")
    if tie is None:
        text = config.get("text_config") or {}
        tie = text.get("tie_word_embeddings", False)
    if not tie or "lm_head.weight" in base:
        return base
    embed = next((k for k in base if k.endswith(TIED_EMBEDDING_NAMES)), None)
    if embed is None:
        return base
    return {**base, "lm_head.weight": base[embed]}


def not_for_subset(adapter: AdapterRef) -> str:
    """Why `adapter` cannot be merged together with others here, in words; "" when it can.

    A plain LoRA only: the others have no `cat` combination. A LoRA that saves modules whole
    (modules_to_save, a classifier head) neither: all adapters of the subset are active at once, and
    PEFT keeps one saved copy of a module active at a time (it refuses to activate several); nor one that
    trains biases (PEFT holds one such adapter on a model) or replicates layers (PEFT merges none).
    """
    config = read_adapter_config(adapter)
    kind = adapter_keys.adapter_type(config)
    if kind != "lora":
        return kind
    if lora.base_rewriting_init(config) == "olora":  # its merge starts from its own residual of W
        return "olora (init_lora_weights='olora' rewrites the base weight on load)"
    saved = adapter_keys.saved_module_names(config)
    if saved:
        return (
            f"saves {', '.join(saved)} whole (modules_to_save), and PEFT activates one saved copy at a time"
        )
    if config.get("bias") not in (None, "none"):
        return f"trains biases (bias={config['bias']!r}), and PEFT holds one adapter with bias on a model"
    if config.get("layer_replication"):
        return "replicates the base's layers (layer_replication), which PEFT refuses to merge"
    return ""


def merge_subset(spec: ProbeSpec) -> tuple[list[AdapterRef], str]:
    """The adapters merged together, and why (or a note saying why none are)."""
    by_name = {a.name: a for a in spec.adapters}
    if spec.merge_subset:
        unknown = [n for n in spec.merge_subset if n not in by_name]
        if unknown:
            return [], f"merge subset names adapters not in the run: {', '.join(unknown)}"
        chosen = [by_name[n] for n in spec.merge_subset]
        bad = [f"{a.name} ({why})" for a in chosen if (why := not_for_subset(a))]
        if bad:
            return [], (
                "merge subset: only plain LoRA adapters can share one PeftModel and be combined "
                f"into one adapter here; not {', '.join(bad)}"
            )
        if len(chosen) < 2:  # `validate_merge_subset` refuses this up front; a stored spec may hold it
            return (
                [],
                "merge subset: fewer than two plain LoRA adapters in the run, nothing merged together",
            )
        return chosen, ""
    # Default: the run's first two plain LoRA adapters (name others with merge_subset).
    why = {a.name: not_for_subset(a) for a in spec.adapters}
    chosen = [a for a in spec.adapters if not why[a.name]][:2]
    if len(chosen) < 2:
        # LoRAs left out for their saved modules are named: the user may expect them merged together
        saving = [f"{n} ({w})" for n, w in why.items() if w.startswith("saves")]
        return (
            [],
            "merge subset: fewer than two plain LoRA adapters in the run, nothing merged together"
            + (f"; left out: {', '.join(saving)}" if saving else ""),
        )
    return chosen, ""
