"""`weights`: every tensor loaded on a target, base and adapter, against the checkpoint file."""

from __future__ import annotations

from typing import Any

import torch

from core.capture import BASE, Capture, TensorKey
from core.checks.base import CaptureContext, Check, Reference, add_note, layer_of, missing_reference_row
from core.formulas import split_adapter_key
from core.loading import Loaded, read_checkpoint
from core.spec import ProbeSpec


class WeightsCheck(Check):
    name = "weights"
    description = "loaded tensors (base and adapter) against the checkpoint file"

    def capture(self, ctx: CaptureContext, loaded: Loaded, out: Capture) -> None:
        if loaded.adapter is None:
            seen: dict[int, str] = {}
            tied: dict[str, str] = {}
            for name, tensor in loaded.model.state_dict().items():
                ptr = tensor.data_ptr()
                if ptr in seen and tensor.numel() > 0:
                    # Tied weights (lm_head ↔ embed_tokens) are one storage, stored once in the file.
                    tied[name] = seen[ptr]
                    continue
                seen[ptr] = name
                out.add(TensorKey(self.name, BASE, name), tensor)
            out.meta.setdefault(self.name, {})["tied"] = tied
        else:
            from peft import get_peft_model_state_dict

            state = get_peft_model_state_dict(loaded.model, adapter_name=loaded.adapter.name)
            for name, tensor in state.items():
                out.add(TensorKey(self.name, loaded.adapter.name, name), tensor)

    def reference(
        self, spec: ProbeSpec, keys: list[TensorKey], reference_capture: Capture | None
    ) -> Reference:
        # Every tensor of each checkpoint involved, so that rows can also name what was not loaded.
        paths = {a.name: a.path for a in spec.adapters}
        tensors: dict[str, torch.Tensor] = {}
        for source in sorted({k.adapter for k in keys}):
            if source == BASE:
                file = read_checkpoint(spec.base.path)
            else:
                file = read_checkpoint(paths[source], prefix="adapter_model")
            tensors.update({TensorKey(self.name, source, name).encode(): t for name, t in file.items()})
        return Reference(label="checkpoint", tensors=tensors, notes={})

    def reference_for(self, spec: ProbeSpec, key: TensorKey, reference_capture: Capture | None) -> Reference:
        # One tensor read lazily from the checkpoint, not the whole file (GBs for a real base).
        path = spec.base.path if key.adapter == BASE else {a.name: a.path for a in spec.adapters}[key.adapter]
        prefix = "" if key.adapter == BASE else "adapter_model"
        file = read_checkpoint(path, prefix=prefix, names={key.name})
        return Reference(label="checkpoint", tensors={key.encode(): t for name, t in file.items()}, notes={})

    def rows(self, spec: ProbeSpec, capture: Capture, reference: Reference) -> list[dict[str, Any]]:
        rows = super().rows(spec, capture, reference)
        tied = capture.meta.get(self.name, {}).get("tied", {})
        for row in rows:
            if row["adapter"] is None:
                partners = [k for k, v in tied.items() if v == row["tensor"]]
                if partners:
                    add_note(row, f"shares storage with {', '.join(partners)} (tied weights)")
            ref_dtype = row.get("reference_dtype")
            if ref_dtype and ref_dtype != row["dtype"] and row["verdict"] != "identical":
                add_note(row, f"cast {ref_dtype} → {row['dtype']} on load")
        captured = set(capture.tensors)
        sources = {k.adapter for k in capture.keys(self.name)}
        for encoded, tensor in reference.tensors.items():
            key = TensorKey.decode(encoded)
            if key.adapter in sources and encoded not in captured and key.name not in tied:
                rows.append(
                    {
                        **self.row_labels(key, capture.target, reference),
                        "dtype": None,
                        **missing_reference_row(tensor),
                        "explanation": "key mismatch: in the checkpoint but not loaded on the target",
                    }
                )
        return rows

    def describe(self, key: TensorKey) -> dict[str, Any]:
        if key.adapter == BASE:
            module_path = key.name.rsplit(".", 1)[0]
            role = "base"
        else:
            split = split_adapter_key(key.name)
            if split is None:  # a method formulas does not know (LoHa, VeRA, …): last part names the role
                split = key.name.removeprefix("base_model.model.").removesuffix(".weight").rsplit(".", 1)
            module_path, role = split[0], split[1].split(".")[0]
        return {"layer": layer_of(module_path), "module": module_path.rsplit(".", 1)[-1], "role": role}
