"""`deltas`: per adapted module, ΔW on the target (PEFT's own code, in the dtype PEFT computes
the adapter in) against ΔW computed in float64 on the CPU from the checkpoint with the method's
formula.

A module the adapter saves whole (``modules_to_save``: a classifier head) replaces the base's: its
new W is the saved tensor, not W + ΔW by a formula. Its rows (role ``modules_to_save``) compare the
copy the target uses with the adapter file. Adapters with no ΔW (prompt learning: virtual tokens) or
no formula here get a note and a row of the `deltas_findings` table.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import torch

from core.capture import Capture, TensorKey
from core.checks.base import CaptureContext, Check, Reference, add_note, measure_against
from core.methods import adapter_keys, formulas, peft_path, projections, registry
from core.models import merging
from core.models.checkpoint import Checkpoint, read_adapter_config, read_checkpoint
from core.models.conversion import layer_of, read_loaded
from core.models.loading import Loaded
from core.spec import ProbeSpec, Target

# Methods whose ΔW depends on W itself (rotations, reflections, scalings, DoRA's norm); MiSS's does with
# init_weights="bat" (`applies_to_w`).
MULTIPLICATIVE = ("dora", "boft", "oft", "ia3", "hra")


def applies_to_w(kind: str, config: dict) -> bool:
    """Whether the method's ΔW depends on the W it is loaded onto."""
    return kind in MULTIPLICATIVE or (kind == "miss" and config.get("init_weights") == "bat")


# Capture names of a saved module's tensors: this prefix, then the tensor's key in the adapter file.
SAVED_PREFIX = adapter_keys.SAVED_MODULE + ":"
# The deltas meta is keyed by adapter name; the findings sit beside under a key no adapter name can be
# (a colon is not allowed in one: `core.spec`).
FINDINGS = ":findings"
# The role of a bias change's rows (a trained bias: bias="all"/"lora_only").
BIAS_ROLE = "bias delta"
# How a target's Δb is taken: PEFT has no function for it (it loads the trained bias over the base's).
BIAS_SOURCE = (
    "the bias as loaded less the base checkpoint's bias in the loaded dtype (subtracted in float32 or wider)"
)
REPLACED = (
    "modules_to_save: the adapter replaces this module whole, so its new W is the saved tensor, not W + ΔW "
    "by a formula; compared with the adapter file"
)


class DeltasCheck(Check):
    name = "deltas"
    description = "per-module ΔW on the target against the float64 formula from the checkpoint"
    compares_in_worker = True

    def capture(self, ctx: CaptureContext, loaded: Loaded, out: Capture) -> None:
        if loaded.adapter is None:
            return
        adapter = loaded.adapter.name
        config = read_adapter_config(loaded.adapter)
        kind = adapter_keys.adapter_type(config)
        meta = out.meta.setdefault(self.name, {})
        if kind in peft_path.PEFT_ADDITIVE:
            self._capture_saved_modules(loaded, config, out)
            self._capture_peft_own(ctx, loaded, out, kind)
            return
        if kind not in registry.ADAPTER_TYPES:
            if kind in adapter_keys.PROMPT_LEARNING:
                finding = "does not apply"
                why = (
                    f"{adapter} is a {kind} adapter: {adapter_keys.VIRTUAL_TOKENS}, so there is no ΔW; "
                    "its virtual tokens (weights check) and outputs are compared"
                )
            else:
                finding = "not covered"
                why = (
                    f"{adapter} is a {kind} adapter; its ΔW is not covered "
                    f"(supported: {', '.join(registry.ADAPTER_TYPES)}); its weights and outputs are"
                )
            meta.setdefault(FINDINGS, []).append({"adapter": adapter, "finding": finding, "detail": why})
            out.notes.append(f"deltas: {why}")
            self._capture_saved_modules(loaded, config, out)
            return
        self._capture_saved_modules(loaded, config, out)
        layers = adapter_keys.adapted_modules(loaded.model)
        mismatch = (
            projections.loaded_mismatch(kind, config, layers, adapter)
            if projections.regenerated(kind, config)
            else None
        )
        if mismatch:  # the reference's projections would not be the ones this target uses
            meta.setdefault(FINDINGS, []).append(
                {"adapter": adapter, "finding": "not covered", "detail": mismatch}
            )
            out.notes.append(f"deltas: {mismatch}")
            return
        sources: dict[str, str] = {}
        with torch.no_grad():
            for module, (layer, names) in layers.items():
                if adapter not in names:
                    continue
                out.add(TensorKey(self.name, adapter, module), peft_path.peft_delta(layer, adapter))
                sources[module] = peft_path.peft_delta_source(layer, adapter)
            for name, delta in _bias_deltas(loaded, ctx.spec.base.path).items():
                out.add(TensorKey(self.name, adapter, name), delta)
                sources[name] = BIAS_SOURCE
        # AdaLoRA modules its budget pruned: PEFT rebuilds them on load (see `rows`)
        resized = (
            [k.split(".lora_E")[0] for k in (config.get("rank_pattern") or {})] if kind == "adalora" else []
        )
        meta[adapter] = {
            "kind": kind,
            "applies_to_w": applies_to_w(kind, config),
            "sources": sources,
            "resized": resized,
        }

    def _capture_peft_own(self, ctx: CaptureContext, loaded: Loaded, out: Capture, kind: str) -> None:
        """ΔW of a method with no float64 formula here but a merge that adds PEFT's get_delta_weight: each
        module's on the target against the same function on a float64 copy of the layer, measured here."""
        adapter = loaded.adapter.name
        sources = {}
        with torch.no_grad():
            for module, (layer, names) in adapter_keys.adapted_modules(loaded.model).items():
                if adapter not in names:
                    continue
                key = TensorKey(self.name, adapter, module)
                delta = layer.get_delta_weight(adapter)
                ref = peft_path.float64_peft_delta(layer, adapter)
                note = f"{kind} ΔW: {peft_path.PEFT_OWN} (no float64 formula of the method here)"
                measured = measure_against(
                    self, ctx.spec, ctx.target, key, delta, ref, peft_path.PEFT_OWN, note
                )
                out.results[key.encode()] = measured.as_dict()
                if measured.sketch is not None:
                    out.sketches[key.encode()] = measured.sketch
                sources[module] = f"{kind}.get_delta_weight"
        out.meta[self.name][adapter] = {
            "kind": kind,
            "applies_to_w": False,
            "sources": sources,
            "resized": [],
        }

    def _capture_saved_modules(self, loaded: Loaded, config: dict, out: Capture) -> None:
        """The target's copies of the modules the adapter saves whole, under `SAVED_PREFIX` + file key."""
        from peft import get_peft_model_state_dict

        names = adapter_keys.saved_module_names(config)
        if not names:
            return
        adapter = loaded.adapter.name
        state = get_peft_model_state_dict(loaded.model, adapter_name=adapter)
        for key, tensor in state.items():
            if adapter_keys.split_saved_module_key(key, names) is not None:
                out.add(TensorKey(self.name, adapter, SAVED_PREFIX + key), tensor)

    def reference(
        self, spec: ProbeSpec, keys: list[TensorKey], reference_capture: Capture | None
    ) -> Reference:
        return self._reference(spec, keys)

    def reference_for(
        self, spec: ProbeSpec, key: TensorKey, reference_capture: Capture | None, scratch: bool = False
    ) -> Reference:
        # One module (the worker measures ΔW module by module, the drill-down one module).
        return self._reference(spec, [key])

    def _reference(self, spec: ProbeSpec, keys: list[TensorKey]) -> Reference:
        """The float64 ΔW of the modules `keys` name, reading only their base weights and adapter tensors;
        for a saved module's tensor, the tensor as the adapter file holds it."""
        if not keys:
            # every ΔW was measured in its worker (e.g. on another machine, compared from a snapshot):
            # nothing to read, and the checkpoint need not be here
            return Reference(label="fp64 formula", tensors={}, notes={})
        saved = [k for k in keys if k.name.startswith(SAVED_PREFIX)]
        keys = [k for k in keys if not k.name.startswith(SAVED_PREFIX)]
        base = {
            k: v.to(torch.float64)
            # by the names the loaded model has (transformers may rename checkpoint keys on load; the layers an
            # adapter's layer_replication copies are read for its copies)
            for k, v in merging.reference_base(
                spec, adapter_keys.base_tensor_names(k.name for k in keys)
            ).items()
        }
        tensors: dict[str, torch.Tensor] = {}
        notes: dict[str, str] = {}
        for adapter in spec.adapters:
            wanted_saved = {k.name.removeprefix(SAVED_PREFIX): k for k in saved if k.adapter == adapter.name}
            if wanted_saved:
                file = read_checkpoint(adapter.path, prefix="adapter_model", names=set(wanted_saved))
                for name, tensor in file.items():
                    tensors[wanted_saved[name].encode()] = tensor
                    notes[wanted_saved[name].encode()] = REPLACED
            wanted = [k for k in keys if k.adapter == adapter.name]
            if not wanted:
                continue
            config = read_adapter_config(adapter)
            kind = adapter_keys.adapter_type(config)
            if kind not in registry.ADAPTER_TYPES:
                continue
            # Only the wanted modules' tensors are read (and the shared ones, regenerated where unsaved).
            config, adapter_tensors = merging.adapter_files(adapter, spec.base.path, {k.name for k in wanted})
            if not adapter_tensors:
                continue
            deltas = formulas.reference_deltas(config, adapter_tensors, base)
            for key in wanted:
                if key.name in deltas:
                    tensors[key.encode()] = deltas[key.name]
                    what = (
                        "Δb, the trained bias less the base's"
                        if key.name.endswith(adapter_keys.BIAS_SUFFIX)
                        else "ΔW"
                    )
                    notes[key.encode()] = f"{kind} {what}, float64 formula from the checkpoint" + (
                        f" ({projections.REGENERATED})" if projections.regenerated(kind, config) else ""
                    )
        return Reference(label="fp64 formula", tensors=tensors, notes=notes)

    def describe(self, key: TensorKey) -> dict[str, Any]:
        if key.name.startswith(SAVED_PREFIX):
            # the key is the file's; the module path is what follows PEFT's prefix, up to the parameter
            path = key.name.removeprefix(SAVED_PREFIX).removeprefix("base_model.").removeprefix("model.")
            module = path.rsplit(".", 1)[0]
            return {
                "layer": layer_of(module),
                "module": module.rsplit(".", 1)[-1],
                "role": adapter_keys.SAVED_MODULE,
            }
        module = adapter_keys.bias_module(key.name)
        if module is not None:  # a trained bias's change, Δb
            return {"layer": layer_of(module), "module": module.rsplit(".", 1)[-1], "role": BIAS_ROLE}
        return {"layer": layer_of(key.name), "module": key.name.rsplit(".", 1)[-1], "role": "delta"}

    def tables(
        self, spec: ProbeSpec, captures: list[Capture], reference_capture: Capture | None = None
    ) -> dict[str, pd.DataFrame]:
        """`deltas_findings`: per target, the adapters this check has no ΔW for, and why."""
        rows = [
            {"target": c.target, **f} for c in captures for f in c.meta.get(self.name, {}).get(FINDINGS, [])
        ]
        return {"deltas_findings": pd.DataFrame(rows, columns=["target", "adapter", "finding", "detail"])}

    def rows(self, spec: ProbeSpec, capture: Capture, reference: Reference) -> list[dict[str, Any]]:
        rows = super().rows(spec, capture, reference)
        meta = capture.meta.get(self.name, {})
        target_dtype = Target.parse(capture.target).dtype
        for row in rows:
            adapter = meta.get(row["adapter"], {})
            source = adapter.get("sources", {}).get(row["tensor"])
            if source:
                add_note(row, f"target ΔW via {source}")
            if row["tensor"] in adapter.get("resized", []) and target_dtype in ("bfloat16", "float16"):
                add_note(
                    row,
                    "PEFT resizes this AdaLoRA module to its rank_pattern on load and rounds its lora_A, "
                    f"lora_B and lora_E to {target_dtype} doing so (modules it does not resize keep the "
                    "file's float32)",
                )
            uses_w = adapter.get(
                "applies_to_w", adapter.get("kind") in MULTIPLICATIVE
            )  # older captures: by kind
            if uses_w and target_dtype in ("bfloat16", "float16"):
                add_note(
                    row,
                    f"{adapter['kind']} applies the adapter to W, which is {target_dtype} on this "
                    "target: W's rounding carries into ΔW",
                )
        return rows


def _bias_deltas(loaded: Loaded, base: str) -> dict[str, torch.Tensor]:
    """Per bias the adapter trained, ``Δb`` on the target: the bias as loaded less the base checkpoint's
    (folder `base`) in the loaded dtype, on the bias's device, subtracted in float32 (or the bias's wider
    dtype): what the load changed, as the target holds it. Empty for an adapter that trains no bias."""
    config = read_adapter_config(loaded.adapter)
    names = Checkpoint.open(loaded.adapter.path, prefix="adapter_model").names()
    biases = adapter_keys.trained_biases(names, config)
    if not biases:
        return {}
    params = adapter_keys.loaded_parameters(loaded.model, biases)
    file = read_loaded(base, params)
    out = {}
    with torch.no_grad():
        for name, bias in params.items():
            if name in file:
                wide = torch.promote_types(bias.dtype, torch.float32)
                before = file[name].to(device=bias.device, dtype=bias.dtype)
                out[name] = bias.detach().to(wide) - before.to(wide)
    return out
