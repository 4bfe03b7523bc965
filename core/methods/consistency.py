"""Pure pieces of the adapter-consistency check: base-weight fingerprints, module structure,
prediction agreement, and which PiSSA adapter a converted LoRA belongs to.

Nothing here loads a model or knows about runs; the `adapters` check composes these.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

TOP_K = 5  # the k of the top-k agreement columns


# --- base-weight fingerprints ------------------------------------------------------------------


def _unwrap_base(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PeftModel (or the model itself when it is a bare base)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def base_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's own tensors under their checkpoint names, adapter tensors left out.

    Walks the module tree; inside a PEFT tuner layer only its base layer is visited (named as the
    tuner layer, so `….q_proj.base_layer.weight` reads `….q_proj.weight`), inside a
    modules-to-save wrapper only the original module. A tensor shared by several names (tied
    embeddings) is listed once, under its first name, as `named_parameters()` does.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    seen: set[int] = set()

    def walk(module: torch.nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        if isinstance(module, BaseTunerLayer):
            module = module.get_base_layer()
        elif hasattr(module, "original_module") and isinstance(module.original_module, torch.nn.Module):
            module = module.original_module  # ModulesToSaveWrapper and other auxiliary wrappers
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                yield prefix + name, param
        for name, buf in module.named_buffers(recurse=False):
            if id(buf) not in seen and name not in module._non_persistent_buffers_set:
                seen.add(id(buf))
                yield prefix + name, buf
        for name, child in module.named_children():
            yield from walk(child, f"{prefix}{name}.")

    yield from walk(_unwrap_base(model), "")


def tensor_hash(tensor: torch.Tensor) -> str:
    """A digest of a tensor's dtype, shape and exact bytes (any two differing bits differ)."""
    t = tensor.detach()
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def fingerprint(model: torch.nn.Module) -> dict[str, str]:
    """Per base tensor (checkpoint name) its hash: compare two to see which base weights changed."""
    return {name: tensor_hash(t) for name, t in base_parameters(model)}


def changed_tensors(before: Mapping[str, str], after: Mapping[str, str]) -> list[str]:
    """Names whose hash differs between two fingerprints, or that only one of them has (sorted)."""
    return sorted(n for n in set(before) | set(after) if before.get(n) != after.get(n))


# --- module structure ---------------------------------------------------------------------------


def module_structure(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Per adapted module: which adapters it holds and which are active, from `get_layer_status()`.

    Works on a PeftModel or on a base object PEFT injected into; [] when nothing is adapted.
    """
    from peft import PeftModel, get_layer_status

    try:
        status = get_layer_status(model)
    except (ValueError, TypeError):
        return []  # no adapter layers, or a PEFT model kind without layer status
    # On a PeftModel the names start at the tuner (`model.` + the base's own module names).
    strip = "model." if isinstance(model, PeftModel) else ""
    return [
        {
            "module": s.name.removeprefix(strip),
            "type": s.module_type,
            "available": list(s.available_adapters),
            "active": list(s.active_adapters),
            "merged": list(s.merged_adapters),
            "enabled": bool(s.enabled),
        }
        for s in status
    ]


def model_status(model: torch.nn.Module) -> dict[str, Any]:
    """`get_model_status()` as plain JSON-able data ({} where PEFT cannot give it)."""
    from dataclasses import asdict

    from peft import get_model_status

    try:
        return {k: v for k, v in asdict(get_model_status(model)).items()}
    except (ValueError, TypeError, AttributeError):
        return {}


def structure_groups(structure: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Modules grouped by what they hold and what is active, e.g. 12 modules "hold lora, lora_b;
    active lora_b"; largest groups first."""
    groups: dict[tuple[tuple[str, ...], tuple[str, ...]], list[str]] = {}
    for s in structure:
        key = (tuple(s["available"]), tuple(s["active"]))
        groups.setdefault(key, []).append(s["module"])
    out = [
        {
            "holds": list(holds),
            "active": list(active),
            "modules": len(modules),
            "example": modules[0],
            "text": describe_holding(holds, active),
        }
        for (holds, active), modules in groups.items()
    ]
    return sorted(out, key=lambda g: (-len(g["holds"]), -g["modules"], g["text"]))


def describe_holding(holds: Sequence[str], active: Sequence[str]) -> str:
    """ "holds m1, m2; active m2" """
    return f"holds {', '.join(holds) or 'nothing'}; active {', '.join(active) or 'none'}"


def is_stacked(structure: Sequence[Mapping[str, Any]]) -> bool:
    """True when some module holds more than one adapter."""
    return any(len(s["available"]) > 1 for s in structure)


# --- prediction agreement -----------------------------------------------------------------------


def agreement(target: torch.Tensor, reference: torch.Tensor, k: int = TOP_K) -> dict[str, float]:
    """Argmax and top-k agreement of two logits tensors (…, vocab), over the positions.

    `argmax_agree`: fraction of positions whose top token is the same. `topk_agree`: mean
    fraction of the reference's top-k tokens that are also in the target's top-k. NaN when the
    shapes differ or there is no vocabulary axis to rank.
    """
    if target.shape != reference.shape or target.dim() < 2 or target.shape[-1] < 1:
        return {"argmax_agree": float("nan"), "topk_agree": float("nan")}
    t = target.detach().to("cpu", torch.float64).reshape(-1, target.shape[-1])
    r = reference.detach().to("cpu", torch.float64).reshape(-1, reference.shape[-1])
    argmax = (t.argmax(-1) == r.argmax(-1)).double().mean().item()
    k = min(k, t.shape[-1])
    tk, rk = t.topk(k, dim=-1).indices, r.topk(k, dim=-1).indices
    overlap = (tk.unsqueeze(-1) == rk.unsqueeze(-2)).any(-1).double().sum(-1) / k
    return {"argmax_agree": argmax, "topk_agree": overlap.mean().item()}


# --- PiSSA and its converted LoRA -----------------------------------------------------------------


def is_pissa_config(config: Mapping[str, Any]) -> bool:
    init = config.get("init_lora_weights")
    return isinstance(init, str) and init.lower().startswith("pissa")


def conversion_pairs(configs: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(pissa adapter, its converted LoRA) pairs among the run's adapters, by their configs.

    PEFT's conversion (`save_pretrained(path_initial_model_for_weight_conversion=…)`) saves a plain
    LoRA that records nothing about where it came from, but its shape is fixed: same base, same
    target modules, `r` and `lora_alpha` both doubled, plain init. A LoRA and a PiSSA adapter that
    fit only each other are paired; where either fits several (a PiSSA's saved initial state fits
    as well as the trained one), only a LoRA named `<pissa>_lora` is paired, nothing is guessed.
    """

    def modules(c: Mapping[str, Any]) -> Any:
        m = c.get("target_modules")
        return sorted(m) if isinstance(m, list) else m

    fits = [
        (pissa, name)
        for pissa, pc in configs.items()
        if is_pissa_config(pc)
        for name, c in configs.items()
        if name != pissa
        and c.get("peft_type", "LORA") == "LORA"
        and not is_pissa_config(c)
        and c.get("r") == 2 * (pc.get("r") or 0)
        and c.get("lora_alpha") == 2 * (pc.get("lora_alpha") or 0)
        and modules(c) == modules(pc)
        and c.get("base_model_name_or_path") == pc.get("base_model_name_or_path")
    ]

    def unique(pair: tuple[str, str]) -> bool:
        # ambiguous on either side (a PiSSA with two fitting LoRAs, or a LoRA fitting two PiSSA
        # adapters, e.g. the trained one and its saved initial state): only the `<pissa>_lora` name pairs
        pissa, lora = pair
        n = sum(1 for p, q in fits if p == pissa or q == lora)
        return n == 1 or lora == f"{pissa}_lora"

    return [pair for pair in fits if unique(pair)]
