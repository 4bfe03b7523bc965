"""`weights`: every tensor loaded on a target, base and adapter, against the checkpoint file."""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from core.capture import BASE, Capture, TensorKey
from core.checks.base import (
    LOADED,
    CaptureContext,
    Check,
    Reference,
    add_note,
    measure_against,
    missing_reference_row,
    row_labels,
)
from core.methods.adapter_keys import (
    PROMPT_KEY,
    SAVED_MODULE,
    saved_module_names,
    split_adapter_key,
    split_saved_module_key,
)
from core.methods.families.lora import base_rewrite, rewritten_base
from core.methods.reading import BIAS_PARAMS
from core.models.checkpoint import (
    NOT_IN_CHECKPOINT,
    Checkpoint,
    CheckpointError,
    LoadError,
    read_adapter_config,
)
from core.models.conversion import KeyConversion, for_folder, layer_of, remember
from core.models.loading import Loaded, fresh_build
from core.models.targets import dequantized_state
from core.spec import ProbeSpec

# The reference of a tensor the model computes when built and the checkpoint does not hold.
FRESH_BUILD = "fresh build (float64)"
# The role of a base weight an adapter rewrote when it loaded (PiSSA, OLoRA): captured under the adapter
# as `<module>.base_layer.weight` (no `base_model.` prefix, so no saved key can share the name).
REWRITTEN = "rewritten base"
_REWRITTEN_SUFFIX = ".base_layer.weight"
# Its reference: the rewrite recomputed in float64 from the checkpoint's weight (`families.lora.rewritten_base`).
REWRITE_REFERENCE = "float64 rewrite of the checkpoint"


def rewritten_module(name: str) -> str | None:
    """The module path of a rewritten base weight's key name (`REWRITTEN`), else None."""
    if name.endswith(_REWRITTEN_SUFFIX) and not name.startswith("base_model."):
        return name.removesuffix(_REWRITTEN_SUFFIX)
    return None


class WeightsCheck(Check):
    name = "weights"
    judged = LOADED
    description = "loaded tensors (base and adapter) against the checkpoint file"
    compares_in_worker = True
    redraws_rounding = True

    def capture(self, ctx: CaptureContext, loaded: Loaded, out: Capture) -> None:
        if loaded.adapter is None:
            self._capture_base(ctx, loaded.model, out)
        else:
            from peft import get_peft_model_state_dict

            adapter = loaded.adapter.name
            state = get_peft_model_state_dict(loaded.model, adapter_name=adapter)
            for name, tensor in state.items():
                out.add(TensorKey(self.name, adapter, name), tensor)
            self._capture_rewritten(loaded, out)

    def _capture_rewritten(self, loaded: Loaded, out: Capture) -> None:
        """The base weights the adapter rewrote when it loaded (PiSSA, OLoRA: PEFT runs their SVD or
        QR on the load device and writes the residual into the base layer), each under the adapter.
        An adapter whose init rewrites nothing adds none."""
        how = base_rewrite(read_adapter_config(loaded.adapter))
        if how is None:
            return
        adapter = loaded.adapter.name
        # kept with the capture: a snapshot compared where the adapter's files are not still says it
        out.meta.setdefault(self.name, {}).setdefault("rewrites", {})[adapter] = how
        for name, module in loaded.model.named_modules():
            lora_a = getattr(module, "lora_A", None)
            base_layer = getattr(module, "base_layer", None)
            if not isinstance(lora_a, torch.nn.ModuleDict) or adapter not in lora_a or base_layer is None:
                continue
            weight = base_layer.weight
            if weight.is_floating_point():  # a quantized base is refused by these inits (PEFT's words)
                path = name.removeprefix("base_model.model.")
                out.add(TensorKey(self.name, adapter, path + _REWRITTEN_SUFFIX), weight)

    def _capture_base(self, ctx: CaptureContext, model: torch.nn.Module, out: Capture) -> None:
        """The state dict (tied tensors once), plus the non-persistent buffers the checkpoint holds.

        Meta says which tensors are tied, which are non-persistent buffers, which loaded tensors
        transformers renamed or built from other checkpoint tensors on load, which checkpoint
        tensors the model has no parameter or buffer for (it does not use them), and which tensors the
        model computes when built and the checkpoint does not hold (`built`: compared here, with a fresh
        build of them).
        """
        from core.models.checkpoint import keeps_tensors

        # The conversion first: the comparator measures each tensor as it is added, against the file
        # tensors transformers made it from.
        path = ctx.spec.base.path
        checkpoint = Checkpoint.open(path)
        conversion = KeyConversion.of(model, checkpoint.names())
        remember(path, checkpoint, conversion)
        # a quantized layer's weight as the float tensor it stands for (its quantization error is the row)
        state, dequantized = dequantized_state(model)
        seen: dict[int, str] = {}
        tied: dict[str, str] = {}
        random = set(getattr(model, NOT_IN_CHECKPOINT, []))
        built: dict[str, str] = {}  # name -> the class of the module that computes it
        for name, tensor in state.items():
            ptr = tensor.data_ptr()
            if ptr in seen and tensor.numel() > 0:
                # Tied weights (lm_head ↔ embed_tokens) are one storage, stored once in the file.
                tied[name] = seen[ptr]
                continue
            seen[ptr] = name
            key = TensorKey(self.name, BASE, name)
            fresh = None if conversion.sources(name) or name in random else fresh_build(model, name)
            if fresh is None:
                out.add(key, tensor)
                continue
            # Computed when the model is built and never saved (Marian's sinusoidal position embeddings):
            # the file has nothing to say about it, a fresh build of it has.
            built[name] = type(model.get_submodule(name.rpartition(".")[0])).__name__
            measured = measure_against(self, ctx.spec, ctx.target, key, tensor, fresh, FRESH_BUILD)
            out.results[key.encode()] = measured.as_dict()
            if measured.sketch is not None:
                out.sketches[key.encode()] = measured.sketch
            if keeps_tensors(ctx.spec):
                out.keep(key, tensor)
        # A buffer registered with persistent=False is outside the state dict, yet a checkpoint saved
        # before it became one (BERT's `position_ids`) still holds it: the model uses its own values,
        # so those are what the file is compared with.
        buffers = dict(model.named_buffers())
        non_persistent = sorted(n for n in buffers if n not in state and conversion.sources(n))
        for name in non_persistent:
            out.add(TensorKey(self.name, BASE, name), buffers[name])
        converted = conversion.converted()
        used = {k for n in [*state, *buffers] for k in conversion.sources(n)}
        ignore = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
        unused = {
            name: any(re.search(pattern, name) for pattern in ignore)
            for name in sorted(set(checkpoint.names()) - used)
        }
        out.meta.setdefault(self.name, {}).update(
            tied=tied,
            buffers=non_persistent,
            converted={n: list(keys) for n, keys in converted.items()},  # loaded name -> its file keys
            unused=unused,  # name -> listed in the model's _keys_to_ignore_on_load_unexpected
            model_class=type(model).__name__,
            # loaded names the checkpoint has no tensor for (a task head it lacks): random on load
            not_in_checkpoint=list(getattr(model, NOT_IN_CHECKPOINT, [])),
            dequantized=dequantized,  # name -> format note (`core.models.targets.format_note`)
            built=built,
        )

    def _checkpoint(self, spec: ProbeSpec, source: str) -> Checkpoint:
        """The checkpoint a tensor of `source` (BASE or an adapter name) was loaded from, indexed."""
        if source == BASE:
            return Checkpoint.open(spec.base.path)
        return Checkpoint.open({a.name: a.path for a in spec.adapters}[source], prefix="adapter_model")

    def reference(
        self, spec: ProbeSpec, keys: list[TensorKey], reference_capture: Capture | None
    ) -> Reference:
        # The tensors of `keys` only (those the worker did not compare itself: captures made before
        # it did), each read from its checkpoint; never a whole checkpoint.
        reference = Reference(label="checkpoint", tensors={}, notes={})
        for source in sorted({k.adapter for k in keys}):
            checkpoint = self._checkpoint(spec, source)
            for key in keys:
                if key.adapter == source:
                    self._read(spec, checkpoint, key, reference)
        return reference

    def reference_for(
        self, spec: ProbeSpec, key: TensorKey, reference_capture: Capture | None, scratch: bool = False
    ) -> Reference:
        # One tensor read lazily from the checkpoint (or the few a fused tensor is built from), not
        # the whole file (GBs for a real base).
        try:
            checkpoint = self._checkpoint(spec, key.adapter)
        except CheckpointError as e:
            raise LoadError(str(e)) from e
        if key.adapter != BASE and rewritten_module(key.name) is not None:
            return self._rewrite_reference(spec, key)
        reference = Reference(label="checkpoint", tensors={}, notes={})
        self._read(spec, checkpoint, key, reference, scratch)
        return reference

    def _rewrite_reference(self, spec: ProbeSpec, key: TensorKey) -> Reference:
        """A rewritten base weight's reference: the rewrite in float64 from the checkpoint's weight."""
        module = rewritten_module(key.name)
        adapter = next(a for a in spec.adapters if a.name == key.adapter)
        config = read_adapter_config(adapter)
        base = Checkpoint.open(spec.base.path)
        conversion = for_folder(spec.base.path, base)
        reference = Reference(label=REWRITE_REFERENCE, tensors={}, notes={})
        if conversion.sources(f"{module}.weight"):
            weight = conversion.read(base, f"{module}.weight")
            reference.tensors[key.encode()] = rewritten_base(config, module, weight)
            reference.notes[key.encode()] = (
                f"rewritten by {key.adapter} at load ({base_rewrite(config)}): PEFT writes W − scale·B·A "
                "into the base layer; compared with the same rewrite of the checkpoint's W in float64"
            )
        return reference

    def _read(
        self, spec: ProbeSpec, checkpoint: Checkpoint, key: TensorKey, into: Reference, scratch: bool = False
    ) -> None:
        """Put the checkpoint's tensor for `key` into `into`, when the checkpoint has one.

        A base tensor is read as transformers loads it: through the model's key conversion, under
        its loaded name (renamed, or built from several file tensors), with a note naming the file keys.
        """
        if key.adapter != BASE:
            if rewritten_module(key.name) is not None:  # no file holds it: its float64 rewrite does
                rewrite = self._rewrite_reference(spec, key)
                into.tensors.update(rewrite.tensors)
                into.notes.update(rewrite.notes)
            elif key.name in checkpoint:
                into.tensors[key.encode()] = checkpoint.read(key.name, scratch=scratch)
            return
        conversion = for_folder(spec.base.path, checkpoint)
        if conversion.sources(key.name):
            into.tensors[key.encode()] = conversion.read(checkpoint, key.name, scratch=scratch)
            if how := conversion.how(key.name):
                into.notes[key.encode()] = how

    def rows(self, spec: ProbeSpec, capture: Capture, reference: Reference) -> list[dict[str, Any]]:
        rows = super().rows(spec, capture, reference)
        meta = capture.meta.get(self.name, {})
        tied = meta.get("tied", {})
        buffers = set(meta.get("buffers", []))
        unused = meta.get("unused", {})
        not_in_checkpoint = set(meta.get("not_in_checkpoint", []))
        dequantized = meta.get("dequantized", {})
        built = meta.get("built", {})
        rewrites = meta.get("rewrites", {})
        for row in rows:
            if row["role"] == REWRITTEN:  # the judgement names what ran on the load device
                row["rewrite"] = rewrites.get(row["adapter"])
            if row["adapter"] is None and row["tensor"] in dequantized:
                add_note(row, f"quantized: {dequantized[row['tensor']]}")
            saved = self._saved_module(spec, TensorKey(self.name, row["adapter"] or BASE, row["tensor"]))
            if saved is not None:
                self._saved_module_labels(row, saved)
            if row["adapter"] is None and row["tensor"] in not_in_checkpoint:
                self._not_in_checkpoint(spec, row, meta.get("model_class", "the model"))
            if row["adapter"] is None and row["tensor"] in built:
                add_note(
                    row,
                    f"computed by {built[row['tensor']]} when the model is built and not saved in the "
                    "checkpoint: compared with a fresh float64 build of it",
                )
            if row["adapter"] is None:
                partners = [k for k, v in tied.items() if v == row["tensor"]]
                if partners:
                    add_note(row, f"shares storage with {', '.join(partners)} (tied weights)")
                if row["tensor"] in buffers:
                    add_note(row, "non-persistent buffer (not in the state dict): the model's own values")
            ref_dtype = row.get("reference_dtype")
            # a fresh build and a float64 rewrite were not cast: they are computed, not loaded
            cast = (row["adapter"] is not None or row["tensor"] not in built) and row["role"] != REWRITTEN
            if cast and ref_dtype and ref_dtype != row["dtype"] and row["verdict"] != "identical":
                add_note(row, f"cast {ref_dtype} → {row['dtype']} on load")
        # What the checkpoints hold and the target did not load: the reference's tensors (when it
        # holds any) and the checkpoints' indexes (nothing read). A base tensor accounts for the file
        # keys transformers built it from (its own name, unless it was converted on load).
        converted = meta.get("converted", {})
        keys = capture.keys(self.name)
        captured = {k.encode() for k in keys}
        accounted = {
            TensorKey(self.name, k.adapter, name).encode()
            for k in keys
            for name in (converted.get(k.name, [k.name]) if k.adapter == BASE else [k.name])
        }
        sources = {k.adapter for k in keys}
        absent = {e: tuple(t.shape) for e, t in reference.tensors.items() if e not in captured}
        for source in sorted(sources):
            try:
                checkpoint = self._checkpoint(spec, source)
            except (CheckpointError, KeyError):  # moved or gone since the capture: measured rows stand alone
                continue
            for name in checkpoint.names():
                encoded = TensorKey(self.name, source, name).encode()
                if encoded not in accounted:
                    absent.setdefault(encoded, checkpoint.info(name).shape)
        tied_sources = {k for name in tied for k in converted.get(name, [name])}
        label = Reference(label="checkpoint", tensors={}, notes={})
        for encoded, shape in absent.items():
            key = TensorKey.decode(encoded)
            if key.adapter not in sources or key.name in tied_sources:
                continue
            if key.adapter == BASE and key.name in unused:
                rows.append(self._unused_row(key, shape, capture, label, meta))
            else:
                row = {
                    **row_labels(self, key, capture.target, label),
                    "dtype": None,
                    **missing_reference_row(shape),
                    "explanation": "key mismatch: in the checkpoint but not loaded on the target",
                }
                saved = self._saved_module(spec, key)
                if saved is not None:
                    self._saved_module_labels(row, saved)
                rows.append(row)
        return rows

    @staticmethod
    def _not_in_checkpoint(spec: ProbeSpec, row: dict[str, Any], model_class: str) -> None:
        """A base tensor the checkpoint lacks (a task head loaded onto an encoder saved bare).

        Where an adapter saves that module whole (a SEQ_CLS adapter's classifier, modules_to_save),
        the adapter's copy replaces it and is compared with the adapter file: nothing to compare here,
        so the row passes with a note. Where none does, the model runs with a random head: broken."""
        module = row["tensor"].rsplit(".", 1)[0]
        savers = []
        for adapter in spec.adapters:
            try:
                names = saved_module_names(read_adapter_config(adapter))
            except LoadError:  # moved or gone since the capture
                continue
            # PEFT matches a modules_to_save name to a module path or its end: here, to an ancestor's
            if any(f".{n}." in f".{module}." for n in names):
                savers.append(adapter.name)
        why = f"{model_class} initialises it at random on load (from a fixed seed, the same on every target)"
        if savers:
            row.update(
                verdict="within tolerance", explanation="not compared: the checkpoint has no such tensor"
            )
            add_note(row, f"{why}; {', '.join(savers)} replace it with their saved copy (modules_to_save)")
        else:
            row["explanation"] = "key mismatch: the checkpoint has no such tensor"
            add_note(row, f"{why}, and no adapter saves it (modules_to_save)")

    def role_of(self, spec: ProbeSpec, key: TensorKey) -> str:
        # A tensor of a module the adapter saves whole is judged by that role's tolerance, as its row
        # is labelled (`rows`).
        return SAVED_MODULE if self._saved_module(spec, key) is not None else super().role_of(spec, key)

    @staticmethod
    def _saved_module(spec: ProbeSpec, key: TensorKey) -> tuple[str, str] | None:
        """(saved module path, parameter path) when `key` is a tensor of a module its adapter saves whole
        (``modules_to_save``). The key alone does not say it (PEFT strips the wrapper's part from it);
        the adapter's config lists the modules."""
        adapter = next((a for a in spec.adapters if a.name == key.adapter), None)
        if key.adapter == BASE or adapter is None:
            return None
        try:
            config = read_adapter_config(adapter, known_to_peft=False)
        except LoadError:  # moved or gone since the capture: its rows keep the roles their keys give
            return None
        return split_saved_module_key(key.name, saved_module_names(config))

    @staticmethod
    def _saved_module_labels(row: dict[str, Any], saved: tuple[str, str]) -> None:
        """Label a tensor of a module the adapter saves whole (``modules_to_save``) as such.

        `saved` is what `_saved_module` found. `module` is the tensor's own module, as on every other row.
        """
        module_path = f"{saved[0]}.{saved[1]}".rsplit(".", 1)[0]
        row.update(layer=layer_of(module_path), module=module_path.rsplit(".", 1)[-1], role=SAVED_MODULE)
        add_note(row, f"modules_to_save: the adapter's own copy of {saved[0]}, which replaces the base's")

    def _unused_row(
        self, key: TensorKey, shape: tuple[int, ...], capture: Capture, reference: Reference, meta: dict
    ) -> dict[str, Any]:
        """A checkpoint tensor the model has no parameter or buffer for: loading leaves it out.

        Nothing on the target can drift from it, so the row passes ("within tolerance": not
        "identical", which would claim a bitwise comparison that never happened).
        """
        row = {
            **row_labels(self, key, capture.target, reference),
            "dtype": None,
            "shape": "x".join(map(str, shape)),
            "numel": math.prod(shape),
            "bitwise_equal": False,
            "verdict": "within tolerance",
            "explanation": "not compared: the model does not use this checkpoint tensor",
        }
        why = (
            f"not used by {meta.get('model_class', 'the model')}: it has no parameter or buffer of this name"
        )
        if meta["unused"][key.name]:
            why += " (its _keys_to_ignore_on_load_unexpected lists it)"
        add_note(row, why)
        return row

    def describe(self, key: TensorKey) -> dict[str, Any]:
        if key.adapter == BASE:
            module_path = key.name.rsplit(".", 1)[0]
            role = "base"
        elif (rewritten := rewritten_module(key.name)) is not None:
            module_path, role = rewritten, REWRITTEN
        else:
            if key.name == PROMPT_KEY:  # prompt learning's virtual tokens: no module path
                return {"layer": None, "module": "prompt_encoder", "role": PROMPT_KEY}
            split = split_adapter_key(key.name)
            if split is None:  # a method formulas does not know (HRA, …): last part names the role
                path = key.name.removeprefix("base_model.model.").removesuffix(".weight")
                split = tuple(path.rsplit(".", 1)) if "." in path else (path, path)
            # a trained bias is a bias, wherever PEFT keeps it (an adapted module's `base_layer.bias`)
            module_path, role = split[0], "bias" if split[1] in BIAS_PARAMS else split[1].split(".")[0]
        return {"layer": layer_of(module_path), "module": module_path.rsplit(".", 1)[-1], "role": role}
