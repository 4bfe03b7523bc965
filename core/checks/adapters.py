"""`adapters`: the ways people load several adapters, side by side against `isolated`.

Each load strategy of the run (`spec.strategies`, with `isolated` always added as the ground
truth) runs in a worker of its own on each target. Per adapter it captures the predictions on the
probe inputs, the predictions with the adapter disabled, a fingerprint of the base weights (the
tensors that changed are kept) and the module structure (which adapters each adapted module holds,
which are active).

Rows (all with a `strategy` column; `target` is the target string):

- role `prediction`: each strategy's predictions per adapter against `isolated`'s on the same
  target, all metric columns plus argmax/top-k agreement, and the `reason` (base mutated, stacked,
  not applied, did not load). Stacking that leaves predictions bitwise equal is said not to be the
  cause.
- role `disabled`: outputs with the adapter disabled (`disable_adapter()`) against the base model
  alone, same worker: anything but identical means the base weights were mutated.
- role `applied`: only for adapters that change nothing (outputs bitwise equal to the base model's:
  `broken`) or less than the tolerance (`drift`).
- role `base weight`: a base tensor a load changed, against the checkpoint, once per change.
- role `pissa conversion`: a converted PiSSA LoRA on the original base against the PiSSA model
  (`isolated`), for each pair `core.methods.consistency.conversion_pairs` finds among the run's adapters:
  a plain LoRA with the same base and target modules and `r`, `lora_alpha` twice a PiSSA
  adapter's (what `path_initial_model_for_weight_conversion` writes); ambiguous fits pair only a
  LoRA named `<pissa>_lora`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pandas as pd
import torch

from core.capture import BASE, Capture, TensorKey
from core.checks.base import (
    OWN_WORKER,
    CaptureContext,
    Check,
    Reference,
    adapter_finding,
    add_note,
    missing_reference_row,
    tolerance,
)
from core.checks.outputs import forward_output
from core.methods import consistency
from core.models.checkpoint import CheckpointError, LoadError, exception_gist, read_adapter_config
from core.models.conversion import layer_of, read_loaded
from core.models.loading import STRATEGIES
from core.numerics import metrics
from core.spec import ProbeSpec, Target

GROUND_TRUTH = "isolated"
DISABLED = "disabled/"  # tensor-name prefix: outputs with the adapter disabled
BASE_WEIGHT = "base/"  # tensor-name prefix: a base tensor that differs from the base as first loaded
EXTRA_COLUMNS = ("strategy", "reason", "argmax_agree", "topk_agree", "stacked", "base_changed", "applied")


class AdaptersCheck(Check):
    name = "adapters"
    judged = None
    description = "load strategies side by side against isolated: predictions, base mutation, structure"
    loads = OWN_WORKER
    reads_loaded_names = True

    # --- capture (own worker) -------------------------------------------------------------------

    def variants(self, spec: ProbeSpec, target: Target) -> tuple[str, ...]:
        """`isolated` (the ground truth) first, then the run's other strategies in their order."""
        return tuple(dict.fromkeys((GROUND_TRUTH, *spec.strategies)))

    def run_stages(self, spec: ProbeSpec, target: Target, variant: str) -> int:
        # the strategy's load stages, then one capture stage per loaded model (the base, each adapter)
        return STRATEGIES[variant].stages(spec.adapters, target) + 1 + len(spec.adapters)

    def capture(self, ctx: CaptureContext, loaded, out: Capture) -> None:
        """Never called: this check loads its models itself (`run`)."""

    def run(self, ctx: CaptureContext, variant: str, stage: Callable[[str], None], out: Capture) -> None:
        """Load by strategy `variant` and capture predictions, fingerprints and structure per step.

        A load that fails ends the strategy there (as it would end the user's script): the
        adapter is recorded with the reason, the ones after it as not loaded.
        """
        spec = ctx.spec
        strategy = STRATEGIES[variant]
        meta: dict[str, Any] = {"strategy": variant, "output": None, "steps": []}
        out.meta[self.name] = meta
        pristine: dict[str, str] = {}
        kept: set[tuple[str, str]] = set()  # (tensor, hash) of base tensors already stored
        first_changed: dict[str, str] = {}  # base tensor -> the adapter whose load changed it first
        loads = strategy.load(spec.base, spec.adapters, ctx.target, stage=stage)
        done = 0
        while True:
            try:
                loaded = next(loads)
            except StopIteration:
                break
            except LoadError as e:
                if done == 0:
                    raise  # the base itself did not load: nothing to compare
                failed = spec.adapters[done - 1]
                meta["steps"].append({"adapter": failed.name, "error": str(e)})
                for later in spec.adapters[done:]:
                    meta["steps"].append(
                        {"adapter": later.name, "error": f"not loaded: {failed.name} failed before it"}
                    )
                out.notes.append(f"{variant}: {e}")
                break
            done += 1
            model = loaded.model
            name = BASE if loaded.adapter is None else loaded.adapter.name
            stage(f"capture {'base' if loaded.adapter is None else name}")
            if loaded.refused is not None:  # on a quantized target (`load_isolated`): the others go on
                meta["steps"].append({"adapter": name, "error": loaded.refused})
                out.notes.append(f"{variant}: {loaded.refused}")
                continue
            try:
                kind, logits = forward_output(model, ctx.probe)
            except Exception as e:
                if not adapter_finding(ctx.target, loaded, e):
                    raise
                # PEFT's layer failing on a quantized base (QDoRA on int8 on the CPU once the layer has run):
                # a finding about this adapter there, as in the shared checks (`core.checks.base.FAILED`)
                error = f"its forward failed: {type(e).__name__}: {exception_gist(e)}"
                meta["steps"].append({"adapter": name, "error": error, "failed": True})
                out.notes.append(f"{variant} · {name}: {error}")
                continue
            meta["output"] = kind
            out.add(TensorKey(self.name, name, kind), logits)
            fp = consistency.fingerprint(model)
            if loaded.adapter is None:
                pristine = fp
                continue
            step: dict[str, Any] = {"adapter": name, "error": None, "notes": list(loaded.notes)}
            try:
                with model.disable_adapter():
                    out.add(TensorKey(self.name, name, DISABLED + kind), forward_output(model, ctx.probe)[1])
            except Exception as e:  # a PEFT model kind without disable_adapter(): say so (a row), go on
                # e.g. PEFT 0.21 on prompt learning for a classifier, which has no prepare_inputs_for_generation
                step["disable_error"] = f"disable_adapter() failed: {type(e).__name__}: {exception_gist(e)}"
                step["notes"].append(step["disable_error"])
                out.notes.append(f"{variant} · {name}: {step['disable_error']}")
            changed = consistency.changed_tensors(pristine, fp)
            tensors = dict(consistency.base_parameters(model)) if changed else {}
            for tensor_name in changed:
                first_changed.setdefault(tensor_name, name)
                if tensor_name in tensors and (tensor_name, fp[tensor_name]) not in kept:
                    kept.add((tensor_name, fp[tensor_name]))
                    out.add(TensorKey(self.name, name, BASE_WEIGHT + tensor_name), tensors[tensor_name])
            structure = consistency.module_structure(model)
            status = consistency.model_status(model)
            step.update(
                {
                    "changed": changed,
                    "changed_by": {t: first_changed[t] for t in changed},
                    "stacked": consistency.is_stacked(structure),
                    "structure": consistency.structure_groups(structure),
                    "modules": [{k: s[k] for k in ("module", "available", "active")} for s in structure],
                    "model_status": {
                        k: status.get(k)
                        for k in (
                            "active_adapters",
                            "available_adapters",
                            "peft_types",
                            "enabled",
                            "merged_adapters",
                        )
                    },
                }
            )
            meta["steps"].append(step)
            out.notes.extend(f"{variant} · {name}: {note}" for note in loaded.notes)
            del loaded, model

    def reference(
        self, spec: ProbeSpec, keys: list[TensorKey], reference_capture: Capture | None
    ) -> Reference:
        """Base weights from the checkpoint (the other references are captures of the same run)."""
        names = {k.name.removeprefix(BASE_WEIGHT) for k in keys if k.name.startswith(BASE_WEIGHT)}
        if not names:
            return Reference(label="checkpoint", tensors={}, notes={})
        try:
            # Under the loaded names: transformers renames (and fuses) checkpoint keys on load.
            file = read_loaded(spec.base.path, names)
        except CheckpointError as e:
            return Reference(label="checkpoint", tensors={}, notes={k.encode(): str(e) for k in keys})
        tensors = {
            k.encode(): file[k.name.removeprefix(BASE_WEIGHT)]
            for k in keys
            if k.name.removeprefix(BASE_WEIGHT) in file
        }
        return Reference(label="checkpoint", tensors=tensors, notes={})

    # --- compare ----------------------------------------------------------------------------------

    def compare(
        self,
        spec: ProbeSpec,
        captures: list[Capture],
        reference_capture: Capture | None,
        progress: Callable[[str], None],
    ) -> list[dict[str, Any]]:
        """Per target: every strategy against `isolated`, the applied?/disabled rows, base weights
        against the checkpoint, and the PiSSA conversion pairs."""
        keys = [k for c in captures for k in c.keys(self.name) if k.name.startswith(BASE_WEIGHT)]
        checkpoint = self.reference(spec, keys, None)
        pairs = consistency.conversion_pairs(_configs(spec))
        rows: list[dict[str, Any]] = []
        for capture in captures:
            progress(f"compare {self.name} on {capture.label}")
            iso = next(
                (c for c in captures if c.target == capture.target and c.variant == GROUND_TRUTH), None
            )
            rows.extend(self._strategy_rows(spec, capture, iso, checkpoint))
            if capture.variant == GROUND_TRUTH:
                rows.extend(self._conversion_rows(spec, capture, pairs))
        return rows

    def _strategy_rows(
        self, spec: ProbeSpec, capture: Capture, iso: Capture | None, checkpoint: Reference
    ) -> list[dict[str, Any]]:
        strategy = capture.variant
        meta = capture.meta.get(self.name, {})
        kind = meta.get("output") or "logits"
        target_dtype = getattr(torch, Target.parse(capture.target).float_dtype)
        steps = {s["adapter"]: s for s in meta.get("steps", [])}
        base = capture.get(TensorKey(self.name, BASE, kind))
        iso_steps = {s["adapter"]: s for s in (iso.meta.get(self.name, {}).get("steps", []) if iso else [])}
        pissa = {a.name for a in spec.adapters if consistency.is_pissa_config(_config(a))}
        causes = {a.name: cause for a in spec.adapters if (cause := _mutation_cause(_config(a)))}
        rows: list[dict[str, Any]] = []
        for adapter in spec.adapters:
            name = adapter.name
            step = steps.get(name, {"error": "not captured"})
            labels = {
                "check": self.name,
                "target": capture.target,
                "adapter": name,
                "layer": None,
                "module": kind,
                "strategy": strategy,
                "note": "; ".join(step.get("notes") or []),
            }
            out = capture.get(TensorKey(self.name, name, kind))
            if step.get("error") or out is None:
                if strategy != GROUND_TRUTH:
                    rows.append(
                        {
                            **labels,
                            "reference": GROUND_TRUTH,
                            "tensor": kind,
                            "role": "prediction",
                            "shape": "",
                            "numel": 0,
                            "bitwise_equal": False,
                            "verdict": "broken",
                            "explanation": step["error"]
                            if step.get("failed")
                            else f"did not load: {step.get('error')}",
                            "reason": "did not load",
                        }
                    )
                continue
            tol = tolerance(spec, "output", target_dtype)
            applied_stats = metrics.compare(out, base, tol) if base is not None else None
            applied = None if applied_stats is None else not applied_stats.bitwise_equal
            changed = step.get("changed", [])
            state = {"stacked": bool(step.get("stacked")), "base_changed": len(changed), "applied": applied}
            # applied? — only when the adapter changes nothing, or less than the tolerance
            if applied_stats is not None and applied_stats.n_mismatch == 0:
                row = {**labels, **state, "reference": "base model", "tensor": kind, "role": "applied"}
                row.update(metrics.stats_to_row(applied_stats))
                row["dtype"] = str(out.dtype).removeprefix("torch.")
                if applied_stats.bitwise_equal:
                    row["verdict"], row["reason"] = "broken", "not applied"
                    row["explanation"] = "not applied: the outputs are bitwise equal to the base model's"
                else:
                    row["verdict"], row["reason"] = "drift", "barely applied"
                    row["explanation"] = (
                        f"barely applied: it changes the outputs by at most {applied_stats.max_abs:.3g}, "
                        "within the tolerance against the base model"
                    )
                rows.append(row)
            # disabled vs the base model alone: must be identical
            disabled = capture.get(TensorKey(self.name, name, DISABLED + kind))
            if disabled is not None and base is not None:
                row = {
                    **labels,
                    **state,
                    "reference": "base model",
                    "tensor": DISABLED + kind,
                    "role": "disabled",
                }
                stats = metrics.compare(disabled, base, tol)
                row.update(metrics.stats_to_row(stats))
                row["dtype"] = str(disabled.dtype).removeprefix("torch.")
                row["reason"] = "" if stats.bitwise_equal else "base mutated"
                if not stats.bitwise_equal:
                    add_note(
                        row,
                        _mutation_text(step, causes)
                        + "; disable_adapter() does not give the base model back",
                    )
                rows.append(row)
            elif step.get("disable_error"):
                rows.append(
                    {
                        **labels,
                        **state,
                        "reference": "base model",
                        "tensor": DISABLED + kind,
                        "role": "disabled",
                        "shape": "",
                        "numel": 0,
                        "bitwise_equal": False,
                        "verdict": "within tolerance",
                        "explanation": f"not compared: {step['disable_error']}",
                        "reason": "",
                    }
                )
            # prediction vs isolated
            if strategy != GROUND_TRUTH:
                ref = iso.get(TensorKey(self.name, name, kind)) if iso is not None else None
                row = {**labels, **state, "reference": GROUND_TRUTH, "tensor": kind, "role": "prediction"}
                row["dtype"] = str(out.dtype).removeprefix("torch.")
                if ref is None:
                    row.update(missing_reference_row(out))
                    why = iso_steps.get(name, {}).get("error") or "not captured"
                    row["explanation"] = f"isolated has no prediction for {name}: {why}"
                    row["reason"] = "isolated did not load"
                else:
                    row.update(metrics.stats_to_row(metrics.compare(out, ref, tol)))
                    row.update(consistency.agreement(out, ref) if kind == "logits" else {})
                    row["reason"] = _reason(row, step, iso_steps.get(name, {}), applied, pissa)
                rows.append(row)
            # base weights this load changed, against the checkpoint
            for key in capture.keys(self.name):
                if key.adapter != name or not key.name.startswith(BASE_WEIGHT):
                    continue
                tensor_name = key.name.removeprefix(BASE_WEIGHT)
                tensor = capture.get(key)
                row = {
                    **labels,
                    **state,
                    "reference": checkpoint.label,
                    "tensor": tensor_name,
                    "layer": layer_of(tensor_name),
                    "module": _module(tensor_name),
                    "role": "base weight",
                    "dtype": str(tensor.dtype).removeprefix("torch."),
                    "reason": "base mutated",
                    "note": f"changed when {name} was loaded ({strategy})"
                    + (f" — {causes[name]}" if name in causes else ""),
                }
                ref = checkpoint.tensors.get(TensorKey(self.name, key.adapter, key.name).encode())
                if ref is None:
                    row.update(missing_reference_row(tensor))
                    row["explanation"] = (
                        checkpoint.notes.get(key.encode()) or "the checkpoint has no such tensor"
                    )
                else:
                    row.update(
                        metrics.stats_to_row(
                            metrics.compare(tensor, ref, tolerance(spec, "base", target_dtype))
                        )
                    )
                rows.append(row)
        return rows

    def _conversion_rows(
        self, spec: ProbeSpec, capture: Capture, pairs: list[tuple[str, str]]
    ) -> list[dict[str, Any]]:
        kind = capture.meta.get(self.name, {}).get("output") or "logits"
        target_dtype = getattr(torch, Target.parse(capture.target).float_dtype)
        rows = []
        for pissa, lora in pairs:
            out = capture.get(TensorKey(self.name, lora, kind))
            ref = capture.get(TensorKey(self.name, pissa, kind))
            row: dict[str, Any] = {
                "check": self.name,
                "target": capture.target,
                "reference": f"{pissa} (PiSSA)",
                "adapter": lora,
                "tensor": kind,
                "layer": None,
                "module": kind,
                "role": "pissa conversion",
                "strategy": GROUND_TRUTH,
                "note": f"{lora} (converted from {pissa}, rank doubled) on the original base against {pissa} "
                "on its residual base; what is left is rounding",
                "reason": "",
            }
            if out is None or ref is None:
                row.update(
                    {
                        "verdict": "broken",
                        "explanation": "one of the pair did not load",
                        "bitwise_equal": False,
                    }
                )
            else:
                row["dtype"] = str(out.dtype).removeprefix("torch.")
                row.update(
                    metrics.stats_to_row(metrics.compare(out, ref, tolerance(spec, "output", target_dtype)))
                )
                row.update(consistency.agreement(out, ref) if kind == "logits" else {})
            rows.append(row)
        return rows

    def tables(
        self, spec: ProbeSpec, captures: list[Capture], reference_capture: Capture | None = None
    ) -> dict[str, pd.DataFrame]:
        """`adapters_structure`: per target, strategy and load step, the module groups (what each
        holds, what is active) and what the step changed in the base."""
        records = []
        for capture in captures:
            for step in capture.meta.get(self.name, {}).get("steps", []):
                base = {
                    "target": capture.target,
                    "strategy": capture.variant,
                    "step": step["adapter"],
                    "base_changed": len(step.get("changed") or []),
                    "error": step.get("error") or "",
                    "notes": "; ".join(step.get("notes") or []),
                }
                groups = step.get("structure") or [{}]
                for g in groups:
                    records.append(
                        {
                            **base,
                            "holds": ", ".join(g.get("holds", [])),
                            "active": ", ".join(g.get("active", [])),
                            "modules": g.get("modules", 0),
                            "example": g.get("example", ""),
                            "structure": g.get("text", ""),
                        }
                    )
        return {"adapters_structure": pd.DataFrame(records)}


def _configs(spec: ProbeSpec) -> dict[str, dict]:
    return {a.name: _config(a) for a in spec.adapters}


def _config(adapter) -> dict:
    try:
        return read_adapter_config(adapter)
    except LoadError:
        return {}


def _module(tensor_name: str) -> str:
    parts = tensor_name.split(".")
    return parts[-2] if len(parts) > 1 else parts[0]


def _mutation_cause(config: dict) -> str | None:
    """Why an adapter changes the base by design when it loads, in words (None: it should not)."""
    if consistency.is_pissa_config(config):
        return "PiSSA replaces W by its residual"
    if config.get("bias") not in (None, "none"):
        return f"it trained biases (bias={config['bias']!r}), which PEFT loads over the base's"
    if config.get("layer_replication"):
        return "PEFT expanded the base's layers for it (layer_replication), which disabling it does not undo"
    return None


def _mutation_text(step: dict, causes: dict[str, str]) -> str:
    """ "3 base weights differ from the base as loaded, changed by pissa (PiSSA replaces W by its residual)" """
    changed_by = step.get("changed_by") or {}
    if not changed_by:
        return "the base weights differ from the base as loaded"
    by = sorted(set(changed_by.values()))
    why = [f"{b} ({causes[b]})" if b in causes else b for b in by]
    return f"{len(changed_by)} base weights differ from the base as loaded, changed by {', '.join(why)}"


def _reason(row: dict, step: dict, iso_step: dict, applied: bool | None, pissa: set[str]) -> str:
    """Why a strategy's prediction is what it is: base mutated, stacked, not applied."""
    name = step.get("adapter", "")
    parts = []
    others = sorted({b for b in (step.get("changed_by") or {}).values() if b != name})
    if applied is False:
        parts.append("not applied")
    if others:
        by = ", ".join(f"{b} (PiSSA)" if b in pissa else b for b in others)
        parts.append(f"base mutated by {by}")
    elif step.get("changed") and iso_step.get("changed"):
        parts.append("rewrites the base itself, as in isolated")
    if step.get("stacked"):
        groups = step.get("structure") or []
        stacked = next((g["text"] for g in groups if len(g.get("holds", [])) > 1), "")
        parts.append(f"stacked ({stacked})" if stacked else "stacked")
        if row.get("bitwise_equal"):
            parts.append("stacking is not the cause: predictions are bitwise equal to isolated")
    if not parts and not row.get("bitwise_equal"):
        parts.append("differs from isolated without base mutation or stacking")
    return "; ".join(parts)
