"""`deltas`: per adapted module, ΔW on the target (PEFT's own code, in the dtype PEFT computes
the adapter in) against ΔW computed in float64 on the CPU from the checkpoint with the method's
formula."""

from __future__ import annotations

from typing import Any

import torch

from core import formulas
from core.capture import Capture, TensorKey
from core.checkpoint import Checkpoint
from core.checks.base import CaptureContext, Check, Reference, add_note, layer_of
from core.conversion import read_loaded
from core.loading import Loaded, read_adapter_config, read_checkpoint
from core.spec import ProbeSpec, Target

# Methods whose ΔW depends on W itself (rotations, scalings, DoRA's norm).
MULTIPLICATIVE = ("dora", "boft", "oft", "ia3")


class DeltasCheck(Check):
    name = "deltas"
    description = "per-module ΔW on the target against the float64 formula from the checkpoint"
    compares_in_worker = True

    def capture(self, ctx: CaptureContext, loaded: Loaded, out: Capture) -> None:
        if loaded.adapter is None:
            return
        adapter = loaded.adapter.name
        config = read_adapter_config(loaded.adapter)
        kind = formulas.adapter_type(config)
        if kind not in formulas.ADAPTER_TYPES:
            out.notes.append(
                f"deltas: {adapter} is a {kind} adapter; its ΔW is not covered "
                f"(supported: {', '.join(formulas.ADAPTER_TYPES)}); its weights and outputs are"
            )
            return
        sources: dict[str, str] = {}
        with torch.no_grad():
            for module, (layer, names) in formulas.adapted_modules(loaded.model).items():
                if adapter not in names:
                    continue
                out.add(TensorKey(self.name, adapter, module), formulas.peft_delta(layer, adapter))
                sources[module] = formulas.peft_delta_source(layer, adapter)
        # AdaLoRA modules its budget pruned: PEFT rebuilds them on load (see `rows`)
        resized = (
            [k.split(".lora_E")[0] for k in (config.get("rank_pattern") or {})] if kind == "adalora" else []
        )
        out.meta.setdefault(self.name, {})[adapter] = {"kind": kind, "sources": sources, "resized": resized}

    def reference(
        self, spec: ProbeSpec, keys: list[TensorKey], reference_capture: Capture | None
    ) -> Reference:
        return self._reference(spec, keys)

    def reference_for(self, spec: ProbeSpec, key: TensorKey, reference_capture: Capture | None) -> Reference:
        # One module (the worker measures ΔW module by module, the drill-down one module).
        return self._reference(spec, [key])

    def _reference(self, spec: ProbeSpec, keys: list[TensorKey]) -> Reference:
        """The float64 ΔW of the modules `keys` name, reading only their base weights and adapter tensors."""
        base = {
            k: v.to(torch.float64)
            # by the names the loaded model has (transformers may rename checkpoint keys on load)
            for k, v in read_loaded(spec.base.path, {f"{k.name}.weight" for k in keys}).items()
        }
        tensors: dict[str, torch.Tensor] = {}
        notes: dict[str, str] = {}
        for adapter in spec.adapters:
            wanted = [k for k in keys if k.adapter == adapter.name]
            if not wanted:
                continue
            config = read_adapter_config(adapter)
            kind = formulas.adapter_type(config)
            if kind not in formulas.ADAPTER_TYPES:
                continue
            # The adapter's tensor names from its index; only those of the wanted modules are read.
            modules = formulas.adapter_module_keys(
                dict.fromkeys(Checkpoint.open(adapter.path, prefix="adapter_model").names())
            )
            names = {t for k in wanted if k.name in modules for t in modules[k.name].keys.values()}
            if not names:
                continue
            adapter_tensors = read_checkpoint(adapter.path, prefix="adapter_model", names=names)
            deltas = formulas.reference_deltas(config, adapter_tensors, base)
            for key in wanted:
                if key.name in deltas:
                    tensors[key.encode()] = deltas[key.name]
                    notes[key.encode()] = f"{kind} ΔW, float64 formula from the checkpoint"
        return Reference(label="fp64 formula", tensors=tensors, notes=notes)

    def describe(self, key: TensorKey) -> dict[str, Any]:
        return {"layer": layer_of(key.name), "module": key.name.rsplit(".", 1)[-1], "role": "delta"}

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
            if adapter.get("kind") in MULTIPLICATIVE and target_dtype in ("bfloat16", "float16"):
                add_note(
                    row,
                    f"{adapter['kind']} applies the adapter to W, which is {target_dtype} on this "
                    "target: W's rounding carries into ΔW",
                )
        return rows
