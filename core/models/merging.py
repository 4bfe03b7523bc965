"""Merging adapters into base weights, measured: tied storage, safe merge per module, the loaded base
weights restored bit for bit between merges, NaN/Inf a merge wrote into W, save round trip.

Pure helpers on a loaded model (no metrics, no Streamlit): the `merge` check calls them on each
target and turns what they return into metric rows and report tables. Everything reported is
what the libraries did on this model, never a hard-coded expectation.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from core.methods import formulas

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


def _strip(name: str) -> str:
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
    for module, (layer, names) in formulas.adapted_modules(peft_model).items():
        if adapter not in names:
            continue
        weight = layer.get_base_layer().weight
        key = _storage_key(weight)
        for group in groups:
            members = {_strip(n) for n in group}
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
    for module, (layer, names) in formulas.adapted_modules(peft_model).items():
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
    for _, (layer, _) in formulas.adapted_modules(peft_model).items():
        if layer.merged:
            layer.unmerge()


def base_weight(layer: nn.Module) -> torch.Tensor:
    """The base weight a tuner layer merges into."""
    return layer.get_base_layer().weight


def base_state(layers: dict[str, nn.Module]) -> dict[str, dict[str, torch.Tensor]]:
    """module → {parameter name: clone} of each tuner layer's base layer (weight, bias): the state to restore.

    A merge can write into the bias too (LoRA with ``lora_bias``), so every base parameter is kept.
    """
    return {
        module: {n: p.detach().clone() for n, p in layer.get_base_layer().named_parameters()}
        for module, layer in layers.items()
    }


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
        params = dict(layer.get_base_layer().named_parameters())
        for name, saved in state[module].items():
            params[name].data.copy_(saved)
        if any(not same_bits(params[n], saved) for n, saved in state[module].items()):
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


def reload_forward(
    folder: str, device: str, dtype: torch.dtype, forward: Callable[[nn.Module], torch.Tensor]
) -> torch.Tensor:
    """Load a saved merged model on the same device and dtype and run `forward` on it."""
    import transformers

    from core.models.loading import model_class

    config = transformers.AutoConfig.from_pretrained(folder)
    model = model_class(config).from_pretrained(folder, dtype=dtype, device_map=device)
    model.eval()
    try:
        return forward(model)
    finally:
        del model
