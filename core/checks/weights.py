"""`weights`: every tensor loaded on a target, base and adapter, against the checkpoint file."""

from __future__ import annotations

from typing import Any

import torch

from core.capture import BASE, Capture, TensorKey
from core.checks.base import CaptureContext, Check, Reference, layer_of
from core.loading import Loaded, read_checkpoint
from core.spec import ProbeSpec

# Names PEFT gives adapter parameters inside a tuner layer.
ADAPTER_PARAMS = (
    "lora_A",
    "lora_B",
    "lora_embedding_A",
    "lora_embedding_B",
    "lora_magnitude_vector",
    "boft_R",
    "boft_s",
    "oft_R",
    "ia3_l",
)
PEFT_PREFIX = "base_model.model."


def split_adapter_key(key: str) -> tuple[str, str]:
    """`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` → (module path, role)."""
    name = key.removeprefix(PEFT_PREFIX)
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in ADAPTER_PARAMS:
            return ".".join(parts[:i]), part
    return name.rsplit(".", 1)[0], "adapter"


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
        tensors: dict[str, torch.Tensor] = {}
        files: dict[str, dict[str, torch.Tensor]] = {}
        paths = {a.name: a.path for a in spec.adapters}
        for key in keys:
            if key.adapter == BASE:
                source = files.setdefault(BASE, read_checkpoint(spec.base.path))
            else:
                source = files.setdefault(
                    key.adapter, read_checkpoint(paths[key.adapter], prefix="adapter_model")
                )
            if key.name in source:
                tensors[key.encode()] = source[key.name]
        return Reference(label="checkpoint", tensors=tensors, notes={})

    def rows(self, spec: ProbeSpec, capture: Capture, reference: Reference) -> list[dict[str, Any]]:
        rows = super().rows(spec, capture, reference)
        tied = capture.meta.get(self.name, {}).get("tied", {})
        for row in rows:
            if row["adapter"] is None:
                partners = [k for k, v in tied.items() if v == row["tensor"]]
                if partners:
                    row["note"] = f"shares storage with {', '.join(partners)} (tied weights)"
            ref_dtype = row.get("reference_dtype")
            if ref_dtype and ref_dtype != row["dtype"] and row["verdict"] != "identical":
                cast = f"cast {ref_dtype} → {row['dtype']} on load"
                row["note"] = f"{row['note']}; {cast}" if row["note"] else cast
        return rows

    def describe(self, key: TensorKey) -> dict[str, Any]:
        if key.adapter == BASE:
            module_path = key.name.rsplit(".", 1)[0]
            role = "base"
        else:
            module_path, role = split_adapter_key(key.name)
        return {"layer": layer_of(module_path), "module": module_path.rsplit(".", 1)[-1], "role": role}
