"""`memory`: memory per device index at every load stage, and where each parameter lives.

Runs in a fresh worker process of its own per target and load variant (`Check.loads`:
`FRESH_INTERPRETER`), so that what it sees is caused by the load itself. Variants (load strategies for
the adapters):

- `torch_device`: `PeftModel.from_pretrained(..., torch_device=target.device)`, then
  `load_adapter(..., torch_device=target.device)` for each later adapter;
- `no_torch_device`: the same calls without `torch_device` (PEFT then infers a bare `"cuda"`,
  i.e. cuda:0, wherever CUDA exists), each followed by `.to(target.device)` as users write it;
- `device_map_auto`: the base with `device_map="auto"` over every GPU, adapters without
  `torch_device` (only on a CUDA target of a machine with more than one GPU).

A run without adapters has a single unnamed variant (the base load alone).

Stages (timeline rows): process start and import torch (taken by the worker process itself),
import transformers/peft, base loaded, each adapter loaded, first forward, merged, unloaded and
cleaned up; library workspaces (cuBLAS's) are released at each sample and by cleanup, and have a
column of their own, so that a leak is tensor memory only. The tables `memory_timeline` and `placement` hold every capture's records; each flag
(stray device, leak, mixed placement, merge failed) is a metrics row with verdict `broken`, and a
capture without flags gets one `identical` row that says its placement was as asked.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from typing import Any

import pandas as pd

from core.capture import Capture, TensorKey
from core.checks.base import FRESH_INTERPRETER, CaptureContext, Check, Reference
from core.methods import adapter_keys
from core.models import memory
from core.models.conversion import layer_of
from core.models.loading import Loaded
from core.spec import AdapterRef, ProbeSpec, Target

TORCH_DEVICE = "torch_device"
NO_TORCH_DEVICE = "no_torch_device"
DEVICE_MAP_AUTO = "device_map_auto"
VARIANTS = {
    TORCH_DEVICE: "PeftModel.from_pretrained(…, torch_device=target)",
    NO_TORCH_DEVICE: "PeftModel.from_pretrained(…) without torch_device, then .to(target)",
    DEVICE_MAP_AUTO: "base with device_map='auto', adapters without torch_device",
    "": "base model only",
}


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def requested_devices(target: Target, variant: str) -> list[str]:
    """The devices this load asked for: the target's, or every GPU for `device_map_auto`."""
    if variant == DEVICE_MAP_AUTO:
        return [f"cuda:{i}" for i in range(_cuda_count())]
    return [target.device]


class MemoryCheck(Check):
    name = "memory"
    judged = None
    description = "memory per device index at each load stage; where every parameter and buffer lives"
    loads = FRESH_INTERPRETER

    def variants(self, spec: ProbeSpec, target: Target) -> tuple[str, ...]:
        if not spec.adapters:
            return ("",)
        out = (TORCH_DEVICE, NO_TORCH_DEVICE)
        if target.device_type == "cuda" and _cuda_count() > 1:
            out += (DEVICE_MAP_AUTO,)
        return out

    def run_stages(self, spec: ProbeSpec, target: Target, variant: str) -> int:
        # a base per group of stackable adapters, each adapter, first forward, merge, clean up
        return len(adapter_groups(spec.adapters)) + len(spec.adapters) + 3

    def capture(self, ctx: CaptureContext, loaded: Loaded, out: Capture) -> None:
        """Never called: this check loads models itself, in its own worker (`run`)."""

    def run(self, ctx: CaptureContext, variant: str, stage: Callable[[str], None], out: Capture) -> None:
        probe = memory.CudaProbe()
        sampler = memory.StageSampler(probe=probe if probe.indices else None)
        notes = list(probe.notes)
        samples = process_samples()
        if samples:
            sampler.add_process_samples(samples)
        else:
            notes.append(
                "not a fresh worker process (in-process runner): the process start and import torch "
                "stages are missing and RSS includes whatever this process held before"
            )
        import peft  # noqa: F401  (what the load needs, imported before the base-load sample)
        import transformers  # noqa: F401

        sampler.sample(memory.IMPORT_LIBS)
        # What exists now (a fresh worker's imports; in-process, the caller's objects) is left out of this
        # task's collections: they need not walk those half a million objects again (0.23-0.3 s each), and
        # in-process an earlier task's garbage (a model in a reference cycle) is not freed by this task's
        # cleanup, where it would offset what the task leaves.
        gc.freeze()
        try:
            self._timeline(ctx, variant, stage, out, sampler, notes, samples)
        finally:
            if not samples:
                gc.unfreeze()  # the caller's objects may be collected again once the task is over

    def _timeline(
        self,
        ctx: CaptureContext,
        variant: str,
        stage: Callable[[str], None],
        out: Capture,
        sampler: memory.StageSampler,
        notes: list[str],
        samples: list[dict[str, Any]],
    ) -> None:
        """`run`'s stages from the base's load to the cleanup, sampled, into `out.meta`."""
        from core.checks.outputs import forward_output

        spec, target = ctx.spec, ctx.target
        requested = requested_devices(target, variant)
        groups = adapter_groups(spec.adapters)
        placement: list[dict[str, Any]] = []
        first_seen: dict[tuple, memory.Flag] = {}
        layer_status: dict[tuple[str, str], list[str]] = {}
        model = None
        for i, group in enumerate(groups):
            if i == 0:
                stage("load base")
            else:
                stage(f"load base again for {group[0].name}")
                model = None  # PEFT cannot stack this type on the last model: give it back first
                cleanup()
            model = self._load_base(spec, target, variant)
            when = memory.BASE_LOADED if i == 0 else memory.base_again_stage(group[0].name)
            sampler.sample(when)
            names: list[str] = []
            first_seen.update(
                _new_flags(first_seen, memory.placement_flags(memory.placement_map(model), requested, when))
            )
            for adapter in group:
                stage(f"load adapter {adapter.name}")
                model, load_notes = self._attach(model, adapter, target, variant)
                notes.extend(
                    f"{adapter.name}: {n}" for n in load_notes if f"{adapter.name}: {n}" not in notes
                )
                when = memory.adapter_stage(adapter.name)
                sampler.sample(when)
                names.append(adapter.name)
                # a placement snapshot per stage, so each finding carries the stage it first appeared at
                snapshot = memory.placement_map(model, names)
                first_seen.update(_new_flags(first_seen, memory.placement_flags(snapshot, requested, when)))
            status = memory.peft_layer_devices(model) if names else None
            layer_status.update(status or {})
            records = memory.placement_map(model, names, status)
            # the base's tensors once (from the first base); a later base only for its adapters' layers
            placement += records if i == 0 else [r for r in records if r["adapter"] is not None]

        if len(groups) > 1:
            notes.append(
                "PEFT cannot stack adapters of different types: each type got a fresh base "
                f"({' | '.join(', '.join(a.name for a in g) for g in groups)}); forward and merge ran on "
                f"the last ({', '.join(a.name for a in groups[-1])})"
            )
        stage("first forward")
        forward_error = None
        try:
            forward_output(model, ctx.probe)
        except Exception as e:  # tensors on different devices: a finding, not a crash of the run
            forward_error = _one_line(e)
        sampler.sample(memory.FIRST_FORWARD)

        stage("merge")
        merge_error = None
        names = [a.name for a in groups[-1]]
        virtual = _prompt_learning(groups[-1])
        if virtual:  # no weight to merge into, nothing to unload: the PEFT model wraps the base as it is
            notes.append(
                f"{', '.join(virtual)}: {adapter_keys.VIRTUAL_TOKENS}: the merge and unload stages do not apply"
            )
            names = []
        if names:
            try:
                model.base_model.merge_adapter(adapter_names=names)
            except Exception as e:
                merge_error = _one_line(e)
        sampler.sample(memory.MERGED)

        stage("unload and clean up")
        if names:
            try:
                model = model.unload()  # as users do before dropping a merged model
            except Exception as e:
                notes.append(f"unload() failed ({_one_line(e)}); the model was deleted as it was")
        del model
        cleanup()
        sampler.sample(memory.CLEANED_UP)

        out.meta[self.name] = {
            "variant": variant,
            "how": VARIANTS.get(variant, variant),
            "requested": requested,
            "timeline": sampler.records,
            "stages": sampler.stages,
            "placement": placement,
            "placement_flags": [f.as_dict() for f in first_seen.values()],
            "groups": [[a.name for a in g] for g in groups],
            "peft_devices": memory.peft_devices_from(layer_status) if spec.adapters else None,
            "fresh_process": bool(samples),
            "forward_error": forward_error,
            "merge_error": merge_error,
            "notes": notes,
        }
        out.notes.extend(notes)

    def _load_base(self, spec: ProbeSpec, target: Target, variant: str):
        from core.models.checkpoint import adapters_task_type
        from core.models.loading import load_base

        # device_map="auto": accelerate spreads the base over every GPU, in the target's dtype
        device_map = "auto" if variant == DEVICE_MAP_AUTO else None
        return load_base(
            spec.base,
            target,
            device_map=device_map,
            task_type=adapters_task_type(spec.adapters),
            adapters=spec.adapters,
        )

    def _attach(self, model, adapter: AdapterRef, target: Target, variant: str) -> tuple[Any, list[str]]:
        """The model with `adapter` loaded the variant's way, and how the load went (notes)."""
        from peft import PeftModel

        from core.models.loading import attach_adapter, load_onto

        def attach():
            if variant in (TORCH_DEVICE, ""):
                return attach_adapter(model, adapter, target)
            if isinstance(model, PeftModel):
                model.load_adapter(adapter.path, adapter_name=adapter.name)
                model.set_adapter(adapter.name)
                return model
            return PeftModel.from_pretrained(model, adapter.path, adapter_name=adapter.name)

        # load_onto: PiSSA on a float64 target goes through float32 (PEFT refuses float64), as elsewhere
        loaded, notes = load_onto(attach, adapter, model, target)
        if variant == NO_TORCH_DEVICE:
            loaded = loaded.to(target.device)  # what users add, believing it puts everything there
        return loaded, notes

    def reference(
        self, spec: ProbeSpec, keys: list[TensorKey], reference_capture: Capture | None
    ) -> Reference:
        return Reference(label="requested placement", tensors={}, notes={})

    def rows(self, spec: ProbeSpec, capture: Capture, reference: Reference) -> list[dict[str, Any]]:
        return self.flag_rows(capture)

    def flags(self, capture: Capture) -> list[memory.Flag]:
        """Every finding of one capture, from its stored timeline and placement map."""
        meta = capture.meta.get(self.name, {})
        requested = meta.get("requested") or [Target.parse(capture.target).device]
        timeline = meta.get("timeline", [])
        found = [
            _why_stray(f, meta.get("variant", capture.variant))
            for f in memory.stray_devices(timeline, requested)
        ]
        found += [memory.Flag(**f) for f in meta.get("placement_flags", [])]
        found += memory.leak_flags(memory.leak_figures(timeline))
        for key, when in (("forward_error", memory.FIRST_FORWARD), ("merge_error", memory.MERGED)):
            if meta.get(key):
                found.append(
                    memory.Flag(
                        rule="merge failed" if key == "merge_error" else "forward failed",
                        device=None,
                        stage=when,
                        explanation=meta[key],
                    )
                )
        return found

    def flag_rows(self, capture: Capture) -> list[dict[str, Any]]:
        """One `broken` metrics row per flag; one `identical` row when there is none."""
        meta = capture.meta.get(self.name, {})
        variant = meta.get("variant", capture.variant)
        requested = meta.get("requested") or [Target.parse(capture.target).device]
        base = {
            "check": self.name,
            "target": capture.target,
            "reference": f"requested placement ({', '.join(requested)})",
            "variant": variant,
            "note": "; ".join([VARIANTS.get(variant, variant), *meta.get("notes", [])]),
        }
        rows = []
        for flag in self.flags(capture):
            rows.append(
                {
                    **base,
                    "adapter": flag.adapter,
                    "tensor": flag.tensor,
                    "layer": layer_of(flag.module) if flag.module else None,
                    "module": flag.module,
                    "role": "placement" if flag.module else "memory",
                    "verdict": "broken",
                    "explanation": flag.explanation,
                    "rule": flag.rule,
                    "stage": flag.stage,
                    "device": flag.device,
                }
            )
        if not rows:
            rows.append(
                {
                    **base,
                    "role": "memory",
                    "verdict": "identical",
                    "explanation": (
                        f"every tensor and every byte on {', '.join(requested)} as asked; no layer on two "
                        "devices; no tensor memory left after cleanup"
                    ),
                    "rule": "as asked",
                    "stage": None,
                    "device": ", ".join(requested),
                }
            )
        return rows

    def tables(
        self, spec: ProbeSpec, captures: list[Capture], reference_capture: Capture | None = None
    ) -> dict[str, pd.DataFrame]:
        timeline, placement = [], []
        for capture in captures:
            meta = capture.meta.get(self.name, {})
            variant = meta.get("variant", capture.variant)
            requested = {memory.normalize_device(d) for d in meta.get("requested", [])}
            extra = {"variant": variant, "target": capture.target}
            timeline += [
                {**r, **extra, "requested": r["device"] in requested} for r in meta.get("timeline", [])
            ]
            placement += [{**r, **extra} for r in meta.get("placement", [])]
        timeline_columns = [
            *memory.TIMELINE_COLUMNS,
            *memory.TIMELINE_EXTRA,
            "variant",
            "target",
            "requested",
        ]
        placement_columns = [*memory.PLACEMENT_COLUMNS, *memory.PLACEMENT_EXTRA, "variant", "target"]
        timeline_table = pd.DataFrame(timeline, columns=timeline_columns)
        for col in ("allocated", "reserved", "driver_used", "rss", "workspace"):
            timeline_table[col] = timeline_table[col].astype("Int64")
        timeline_table["context"] = timeline_table["context"].astype("boolean")
        placement_table = pd.DataFrame(placement, columns=placement_columns)
        placement_table["layer"] = placement_table["layer"].astype("Int64")
        return {"memory_timeline": timeline_table, "placement": placement_table}


def _why_stray(flag: memory.Flag, variant: str) -> memory.Flag:
    """A stray cuda:0 at an adapter's load without torch_device, with its cause: PEFT reads the adapter
    file onto the device it infers (bare `cuda`, the current device) and only then copies it into the model."""
    if variant != NO_TORCH_DEVICE or flag.device != "cuda:0" or not flag.stage.startswith("adapter "):
        return flag
    why = (
        "; PEFT, given no torch_device, loads the adapter file onto the device it infers (`cuda`, i.e. "
        "cuda:0, wherever CUDA exists) before copying it into the model: pass torch_device to keep it off"
    )
    return dataclasses.replace(flag, explanation=flag.explanation + why)


def _new_flags(seen: dict[tuple, memory.Flag], flags: list[memory.Flag]) -> dict[tuple, memory.Flag]:
    """The flags not seen at an earlier stage, keyed by what they are about (rule, layer, device)."""
    return {k: f for f in flags if (k := (f.rule, f.module, f.device)) not in seen}


def process_samples() -> list[dict[str, Any]]:
    """The worker process's samples of itself (process start, import torch); empty in-process."""
    return list(memory.PROCESS_SAMPLES)


def cleanup() -> None:
    """What a user does to give memory back: collect garbage, then empty PyTorch's CUDA cache; and, before
    that, release the library workspaces torch keeps (cuBLAS's), so that what allocated still holds
    after cleanup is tensors the code kept alive, not a workspace torch would keep to the process's end."""
    gc.collect()
    try:
        import torch

        # No synchronize(): it acts on the current device (cuda:0) and would create a context
        # there for a run on cuda:1. empty_cache frees cached blocks only where there are some.
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            memory.clear_library_workspaces()
            torch.cuda.empty_cache()
    except Exception:  # cleanup is best effort; what remains is what the next sample measures
        pass


def adapter_groups(adapters: tuple[AdapterRef, ...]) -> list[list[AdapterRef]]:
    """Consecutive adapters PEFT can stack on one base (same PEFT type); each group gets a fresh base.

    PEFT refuses to combine adapters of different types in one model (LoRA then BOFT), so a later
    type starts over on a new base. No adapters: one empty group (the base alone).
    """
    from core.models.checkpoint import LoadError, read_adapter_config

    groups: list[list[AdapterRef]] = []
    last = None
    for adapter in adapters:
        try:
            kind = read_adapter_config(adapter).get("peft_type")
        except LoadError:
            kind = None  # the load itself reports the problem
        if not groups or kind != last:
            groups.append([])
        groups[-1].append(adapter)
        last = kind
    return groups or [[]]


def _prompt_learning(group: list[AdapterRef]) -> list[str]:
    """The adapters of `group` that are prompt learning (virtual tokens: nothing to merge)."""
    from core.models.checkpoint import LoadError, read_adapter_config

    out = []
    for adapter in group:
        try:
            kind = adapter_keys.adapter_type(read_adapter_config(adapter))
        except (LoadError, ValueError):
            continue
        if kind in adapter_keys.PROMPT_LEARNING:
            out.append(adapter.name)
    return out


def _one_line(e: BaseException) -> str:
    from core.models.checkpoint import exception_gist

    return f"{type(e).__name__}: {exception_gist(e)}"
