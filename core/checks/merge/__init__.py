"""`merge`: merged weights against W + ΔW in float64, merged against unmerged outputs, save round trip.

Per adapter and target, on the loaded PeftModel (this check mutates it, so it runs last). Every stage
is named for exactly what it runs (`STAGES`), and each starts from the state its name says: the
loaded weights are cloned first and restored bit for bit (verified) before the next merge.

1. ``unmerged``: outputs of the loaded model; PEFT's ΔW (`delta` rows, against the float64 formula);
   tied storage among the adapted modules, found before merging (`tied` findings);
2. ``merge_adapter``: PEFT's default merge (``safe_merge=False``): merged weights (`merged` rows,
   against ``formulas.merged_weights`` in float64 from the checkpoints), the tied partners' weights
   (`tied` rows), outputs; a NaN/Inf it writes into W is named (`nonfinite_merge`);
3. ``unmerge_adapter``: weight round trip (`roundtrip` rows, against W before the merge), outputs;
4. W restored; ``safe_merge``: ``layer.merge(safe_merge=True)`` module by module, so a refusal
   (NaN/Inf) names its module while the others merge: its own `merged`, `tied` and output rows;
5. W restored; ``merge_and_unload`` with PEFT's defaults: outputs; then the save round trip (which
   save paths work, shared tensors, ``reload`` on the same target, outputs against the pre-save ones);
6. with several adapters (``spec.merge_subset``, else the run's first two plain LoRA adapters), on a
   fresh base: PEFT's default merge of one after another against all at once (one ``cat`` adapter).

A module the adapter saves whole (``modules_to_save``: a classifier head) is not merged but replaced:
``merge_and_unload`` puts the adapter's copy in place of the base's, so its `modules_to_save` rows
compare the merged model's tensors with the adapter file (there is no W + ΔW for it). Prompt learning
(virtual tokens) changes no weight: merge does not apply, said in a note and a finding row.

Tensor names in the capture are ``<role>:<stage>:<name>`` (see `key_name`); every output stage is
compared with the unmerged output on the same target and with the cpu/float64 capture's unmerged
output (the exact model), and a second verdict (`peft_verdict`) applies PEFT's own test tolerance.

Outputs are kept and compared at compare time. The weights (every other role) are kept whole only where
the run keeps tensors (`keeps_tensors`: small models, for the element-wise drill-down), and the compare
task measures them; otherwise each is measured in the worker as it is produced (`_add`: its module's
float64 reference alone, the round trip against the restore clone), by the same rule, and only its row,
sketch and hash are kept, so the worker holds the model, the restore state and one module's reference.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import torch

from core.capture import Capture, TensorKey
from core.checks.base import (
    REFERENCE_TARGET,
    SHARED_LAST,
    CaptureContext,
    Check,
    Measured,
    Reference,
    add_note,
    measure_against,
    measured_row,
    row_labels,
    tolerance,
)
from core.checks.merge.keys import (
    ROUNDTRIP_NOTE,
    SAVED_NOTE,
    broken,
    dtype_of,
    exact_stage,
    key_name,
    no_reference,
    parse_name,
    trained_biases,
)
from core.checks.merge.tables import (
    REPACKED_MERGE,
    REPACKED_SAVE,
    REPACKED_STAGES,
    SUBSET_SEP,
    UNTIE,
    findings_table,
    save_table,
    subset_label,
)
from core.checks.outputs import forward_output, nonfinite_output
from core.methods import adapter_keys, formulas, peft_path, projections, registry
from core.models import merging
from core.models.checkpoint import keeps_tensors, read_adapter_config, read_checkpoint
from core.models.conversion import layer_of
from core.models.loading import Loaded
from core.models.merging import ROUNDING_ULPS, scale_ulp
from core.models.targets import repacked
from core.numerics import metrics
from core.numerics.sketch import content_hash
from core.spec import AdapterRef, ProbeSpec, Target


class MergeCheck(Check):
    name = "merge"
    description = "merged weights vs W + ΔW in float64, merged vs unmerged outputs, save round trip"
    against = REFERENCE_TARGET
    loads = SHARED_LAST
    reads_loaded_names = True

    # ------------------------------------------------------------------------------------------
    # capture
    # ------------------------------------------------------------------------------------------

    def capture(self, ctx: CaptureContext, loaded: Loaded, out: Capture) -> None:
        if loaded.adapter is None:
            return
        adapter = loaded.adapter.name
        meta = out.meta.setdefault(self.name, {}).setdefault("adapters", {}).setdefault(adapter, {})
        config = read_adapter_config(loaded.adapter)
        kind = adapter_keys.adapter_type(config)
        meta["kind"] = kind
        mismatch = None
        # the reference's regenerated shared projections must be this target's, or its merge is not compared
        if projections.regenerated(kind, config):
            layers = adapter_keys.adapted_modules(loaded.model)
            mismatch = projections.loaded_mismatch(kind, config, layers, adapter, subject="merge")
        with torch.no_grad():
            if mismatch:  # said in a note and a finding row (`findings_table`)
                meta["not_covered"] = mismatch
                out.notes.append(f"merge: {meta['not_covered']}")
            elif config.get("layer_replication"):  # said in a note and a finding row (`findings_table`)
                meta["does_not_apply"] = (
                    f"{adapter} replicates the base's layers (layer_replication {config['layer_replication']}), "
                    "whose copies share the originals' weights: PEFT refuses to merge it (\"Cannot merge LORA "
                    'layers when base model layers are replicated"); its ΔW is compared (deltas check)'
                )
                out.notes.append(f"merge: {meta['does_not_apply']}")
            elif kind in registry.ADAPTER_TYPES or kind in peft_path.PEFT_ADDITIVE:
                self._capture_adapter(ctx, loaded, out, meta)
            elif kind in adapter_keys.PROMPT_LEARNING:  # said in a note and a finding row (`findings_table`)
                meta["does_not_apply"] = (
                    f"{adapter} is a {kind} adapter: {adapter_keys.VIRTUAL_TOKENS}, so merging does not apply"
                )
                out.notes.append(f"merge: {meta['does_not_apply']}")
            else:  # said in a note and a finding row (`findings_table`)
                meta["not_covered"] = (
                    f"{adapter} is a {kind} adapter; its merge rule is not covered "
                    f"(supported: {', '.join(registry.ADAPTER_TYPES)})"
                )
                out.notes.append(f"merge: {meta['not_covered']}")
            # the adapters merged together are the run's, whatever kind the last one is
            if adapter == ctx.spec.adapters[-1].name:
                self._capture_subset(ctx, out)

    def _add(
        self,
        ctx: CaptureContext,
        out: Capture,
        adapter: str,
        role: str,
        stage: str,
        name: str,
        t,
        before=None,
        own: tuple[torch.Tensor, str] | None = None,
    ) -> None:
        """Keep an output (compared across targets later); a weight (every other role) too where the run
        keeps tensors (`keeps_tensors`: the compare task measures it), else measure it here and now, as
        the compare task would (`before`: W before the merge), and keep its row, sketch and hash. `own`: a
        reference made here from the loaded layer (PEFT's own ΔW in float64, and its note), measured here
        always (the compare task has no model to make it from)."""
        key = TensorKey(self.name, adapter, key_name(role, stage, name))
        if role == "output" or (keeps_tensors(ctx.spec) and own is None):
            out.add(key, t)
            return
        if own is not None:
            if keeps_tensors(ctx.spec):
                out.keep(key, t)
            ref, note = own
            label = "W + " + peft_path.PEFT_OWN if role == "merged" else peft_path.PEFT_OWN
        elif role == "roundtrip":
            ref, label, note = before, "W before merge (same target)", ""
        else:
            reference = self.reference_for(ctx.spec, key, None)
            ref, note = reference.tensors.get(key.encode()), reference.notes.get(key.encode(), "")
            label = {"tied": "base weight (checkpoint)", adapter_keys.SAVED_MODULE: "checkpoint"}.get(
                role, "fp64 formula"
            )
        if ref is None:
            dtype = str(t.dtype).removeprefix("torch.")
            measured = Measured(label, note, dtype, no_reference(t, label, note), None, content_hash(t))
        else:
            measured = measure_against(self, ctx.spec, ctx.target, key, t, ref, label, note)
            if role == "merged":
                before = None if before is None else before.detach().cpu()
                measured.row["scale_ulp"] = scale_ulp(t.detach().cpu(), ref, before, dtype_of(ctx.target))
        out.results[key.encode()] = measured.as_dict()
        if measured.sketch is not None:
            out.sketches[key.encode()] = measured.sketch

    def _capture_adapter(self, ctx: CaptureContext, loaded: Loaded, out: Capture, meta: dict) -> None:
        adapter, model = loaded.adapter.name, loaded.model
        layers = {
            m: lay for m, (lay, names) in adapter_keys.adapted_modules(model).items() if adapter in names
        }

        def output(stage: str, m) -> torch.Tensor:
            # Named for what the model returns: logits, or an encoder's last_hidden_state.
            kind, t = forward_output(m, ctx.probe)
            self._add(ctx, out, adapter, "output", stage, kind, t)
            return t

        unmerged = output("unmerged", model)
        if any(isinstance(layer.get_base_layer(), torch.nn.MultiheadAttention) for layer in layers.values()):
            out.notes.append(f"merge: {adapter}: {adapter_keys.OUT_PROJ_TWICE}")
        sources = {}
        own = {}
        if (
            meta["kind"] in peft_path.PEFT_ADDITIVE
        ):  # no formula here: PEFT's own ΔW in float64, W from the file
            base = merging.reference_base(ctx.spec, {f"{m}.weight" for m in layers})
            own = peft_path.own_references(layers, adapter, meta["kind"], base)
        for module, layer in layers.items():
            if module in own:  # no formula here: PEFT's own get_delta_weight, the reference its float64 twin
                delta, merged_ref, note = own[module]
                self._add(
                    ctx,
                    out,
                    adapter,
                    "delta",
                    "peft",
                    module,
                    layer.get_delta_weight(adapter),
                    own=(delta, note),
                )
                sources[module] = f"{meta['kind']}.get_delta_weight"
                continue
            try:
                self._add(ctx, out, adapter, "delta", "peft", module, peft_path.peft_delta(layer, adapter))
                sources[module] = peft_path.peft_delta_source(layer, adapter)
            except ValueError as e:  # a layer type peft_delta does not cover: said, not fatal
                sources[module] = f"not compared: {e}"
        meta["delta_sources"] = sources

        # Tied storage, found before anything is merged; the loaded state, to restore between stages.
        tied = merging.tied_adapted_modules(model, adapter)
        meta["tied"] = [f.as_dict() for f in tied]
        state = merging.base_state(layers)
        # bitsandbytes' fused CPU kernel repacked these 4-bit weights at the forward above (its default on a
        # CPU with AVX512-BF16); PEFT's merge reads them as the plain layout: a finding, said on every stage
        on_repacked = sorted(m for m, lay in layers.items() if repacked(lay.get_base_layer()))
        if on_repacked:
            meta["repacked"] = on_repacked
        if keeps_tensors(ctx.spec):  # for the compare task's roundtrip rows and scale_ulp
            for module, params in state.items():
                self._add(ctx, out, adapter, "before", "", module, params["weight"])
        before = {module: params["weight"] for module, params in state.items()}
        biases = trained_biases(loaded.adapter)  # loaded over the base's: the merged model keeps them

        def restore() -> None:
            # The next stage must start from the loaded W, not from what a merge round trip left.
            mismatched = merging.restore_base(model, layers, state)
            if mismatched:
                meta["restore_mismatch"] = sorted({*meta.get("restore_mismatch", []), *mismatched})

        # PEFT's default merge, as users call it (a NaN in the adapter goes into W: measured, named).
        try:
            model.merge_adapter(adapter_names=[adapter])
        except ValueError as e:  # PEFT refuses some models (gptq, replicated layers): a finding
            meta["merge_adapter_error"] = merging.error_text(e)
        else:
            meta["nonfinite_merged"] = merging.nonfinite_written(layers, state)
            self._merged_stage(
                ctx, out, adapter, model, layers, tied, "merge_adapter", output, before, biases, own
            )
            model.unmerge_adapter()
            for module, layer in layers.items():
                roundtrip = merging.base_weight(layer)
                self._add(
                    ctx, out, adapter, "roundtrip", "unmerge_adapter", module, roundtrip, before[module]
                )
            output("unmerge_adapter", model)
            restore()

        # safe_merge, module by module so that every refused module is named.
        meta["safe_merge_errors"] = merging.merge_modules(model, [adapter], safe=True)
        self._merged_stage(ctx, out, adapter, model, layers, tied, "safe_merge", output, before, biases, own)
        restore()

        try:
            merged = model.merge_and_unload(adapter_names=[adapter])
        except Exception as e:
            # PEFT refusing (ValueError) or failing inside itself is this stage's finding, not the run's
            # failure: PEFT 0.21's merge_and_unload for IA3, LoHa, LoKr, VeRA, BOFT and OFT raises
            # AttributeError on a SEQ_CLS RoBERTa, whose saved classifier head has no `.weight`; the
            # earlier stages' rows stand.
            meta["merge_and_unload_error"] = merging.error_text(e)
            out.notes.append(
                f"merge: {adapter}: merge_and_unload() failed ({meta['merge_and_unload_error']})"
            )
            return
        moved = output("merge_and_unload", merged)
        if on_repacked:
            meta["repacked_moved"] = float((moved.double() - unmerged.double()).abs().max())  # as its rows
        self._saved_modules_stage(ctx, out, loaded, merged)
        if ctx.target == ctx.spec.reference:
            return  # the exact model's save round trip is nobody's question: saves a second model
        meta["save"] = merging.save_round_trip(
            merged, ctx.run_dir, ctx.target, adapter, lambda m: output("reload", m)
        )

    def _saved_modules_stage(self, ctx: CaptureContext, out: Capture, loaded: Loaded, merged) -> None:
        """The tensors of the modules the adapter saves whole, as ``merge_and_unload`` left them in the
        merged model (the adapter's copies, in place of the base's), under their adapter-file keys."""
        for key, tensor in merging.saved_module_tensors(merged, loaded.adapter).items():
            self._add(
                ctx, out, loaded.adapter.name, adapter_keys.SAVED_MODULE, "merge_and_unload", key, tensor
            )

    def _merged_stage(
        self,
        ctx,
        out: Capture,
        adapter: str,
        model,
        layers: dict,
        tied: list,
        stage: str,
        output,
        before,
        biases: list[str],
        own: dict,
    ) -> None:
        """The merged weights, the biases the adapter trained (`biases`, ``<module>.bias``), the tied partners'
        weights and the outputs of a model just merged by `stage`."""
        for module, layer in layers.items():
            ref = (own[module][1], own[module][2]) if module in own else None
            weight = merging.base_weight(layer)
            self._add(ctx, out, adapter, "merged", stage, module, weight, before[module], own=ref)
        for name, bias in adapter_keys.loaded_parameters(model, biases).items():
            self._add(ctx, out, adapter, "merged", stage, name, bias)
        params = {
            merging.base_parameter_name(n): p for n, p in model.named_parameters(remove_duplicate=False)
        }
        for finding in tied:
            for partner in merging.tied_partner_modules(finding):
                weight = params.get(partner + ".weight")
                if weight is not None:
                    self._add(ctx, out, adapter, "tied", stage, partner, weight)
        output(stage, model)

    def subset(self, spec: ProbeSpec) -> tuple[list[AdapterRef], str]:
        """The adapters merged together, and why (or a note saying why none are)."""
        return merging.merge_subset(spec)

    def _capture_subset(self, ctx: CaptureContext, out: Capture) -> None:
        chosen, why = self.subset(ctx.spec)
        meta = out.meta.setdefault(self.name, {})
        if not chosen:
            meta["subset_note"] = why
            return
        names = [a.name for a in chosen]
        label = subset_label(names)
        meta["subset"] = names
        model = merging.load_with_adapters(ctx.spec, ctx.target, chosen)
        layers = {m: lay for m, (lay, _) in adapter_keys.adapted_modules(model).items()}
        state = merging.base_state(layers)

        def output(stage: str) -> None:
            self._add(ctx, out, label, "output", stage, *forward_output(model, ctx.probe))

        def merged_stage(stage: str) -> None:
            for module, layer in layers.items():
                self._add(ctx, out, label, "merged", stage, module, merging.base_weight(layer))
            output(stage)

        model.base_model.set_adapter(names)  # all active: the unmerged sum
        output("subset unmerged")
        on_repacked = sorted(m for m, lay in layers.items() if repacked(lay.get_base_layer()))
        if on_repacked:  # as for one adapter (`_capture_adapter`)
            meta["subset_repacked"] = on_repacked
        for a in names:  # one after another: W is rounded to its dtype after each adapter
            model.merge_adapter(adapter_names=[a])
        merged_stage("subset merge_adapter sequential")
        # Back to the loaded W (unmerge would leave its own round-trip residual), then all at once.
        mismatched = merging.restore_base(model, layers, state)
        if mismatched:
            meta["subset_restore_mismatch"] = mismatched
        try:
            model.add_weighted_adapter(names, [1.0] * len(names), "combined", combination_type="cat")
            model.base_model.set_adapter(["combined"])
            model.merge_adapter(adapter_names=["combined"])
            merged_stage("subset merge_adapter combined")
        except (ValueError, TypeError, RuntimeError) as e:
            meta["subset_together_error"] = merging.error_text(e)

    # ------------------------------------------------------------------------------------------
    # reference
    # ------------------------------------------------------------------------------------------

    def reference(
        self, spec: ProbeSpec, keys: list[TensorKey], reference_capture: Capture | None
    ) -> Reference:
        return self._reference(spec, keys, reference_capture, only_keys=False)

    def reference_for(
        self, spec: ProbeSpec, key: TensorKey, reference_capture: Capture | None, scratch: bool = False
    ) -> Reference:
        # The drill-down: one module's adapter tensors and base weight, read lazily.
        return self._reference(spec, [key], reference_capture, only_keys=True)

    def _reference(
        self, spec: ProbeSpec, keys: list[TensorKey], reference_capture: Capture | None, only_keys: bool
    ) -> Reference:
        tensors: dict[str, torch.Tensor] = {}
        notes: dict[str, str] = {}
        parsed = [(k, *parse_name(k.name)) for k in keys]
        by_adapter = {a.name: a for a in spec.adapters}
        for adapter in sorted({p[0].adapter for p in parsed if p[1] == adapter_keys.SAVED_MODULE}):
            saved = {
                p[3]: p[0] for p in parsed if p[1] == adapter_keys.SAVED_MODULE and p[0].adapter == adapter
            }
            file = read_checkpoint(by_adapter[adapter].path, prefix="adapter_model", names=set(saved))
            for name, tensor in file.items():
                tensors[saved[name].encode()] = tensor
                notes[saved[name].encode()] = SAVED_NOTE
        weight_keys = [p for p in parsed if p[1] in ("merged", "delta", "tied")]
        for key, role, _stage, name in weight_keys if only_keys else ():  # one module's tensors, read lazily
            adapters = [key.adapter] if key.adapter in by_adapter else key.adapter.split(SUBSET_SEP)
            ref, note = merging.module_reference(spec, adapters, role, name)
            if ref is not None:
                tensors[key.encode()] = ref
            if note:
                notes[key.encode()] = note
        if weight_keys and not only_keys:
            # the adapted modules' base weights and the embedding a tied head shares, never the whole base
            base = merging.reference_base(spec, adapter_keys.base_tensor_names(p[3] for p in weight_keys))
            by_name = {a.name: a for a in spec.adapters}
            cache: dict[str, tuple[dict, dict]] = {}

            def adapter_files(name: str) -> tuple[dict, dict]:
                if name not in cache:
                    a = by_name[name]
                    # with VeRA's and RandLoRA's shared pair regenerated where it was not saved
                    cache[name] = merging.adapter_files(a, spec.base.path)
                return cache[name]

            merged_cache: dict[str, dict[str, torch.Tensor]] = {}
            for key, role, _stage, name in weight_keys:
                try:
                    if role == "tied":
                        w = base.get(f"{name}.weight")
                        if w is not None:
                            tensors[key.encode()] = w.to(torch.float64)
                            notes[key.encode()] = "its own base weight: no adapter targets it"
                        continue
                    if key.adapter not in merged_cache:
                        if SUBSET_SEP in key.adapter and key.adapter not in by_name:
                            files = [adapter_files(n) for n in key.adapter.split(SUBSET_SEP)]
                            merged_cache[key.adapter] = formulas.sequential_merged_weights(files, base)
                            merged_cache[key.adapter + "/delta"] = {}
                        else:
                            config, tensors_ = adapter_files(key.adapter)
                            deltas = formulas.reference_deltas(config, tensors_, base)
                            merged_cache[key.adapter] = formulas.merged_weights(
                                config, tensors_, base, deltas=deltas
                            )
                            merged_cache[key.adapter + "/delta"] = deltas
                    source = merged_cache[key.adapter + ("/delta" if role == "delta" else "")]
                    if name in source:
                        tensors[key.encode()] = source[name]
                        notes[key.encode()] = (
                            "ΔW, float64 formula from the checkpoint"
                            if role == "delta"
                            else "W + ΔW, float64 formula from the checkpoint"
                            + (" (adapters merged in order)" if SUBSET_SEP in key.adapter else "")
                        )
                except (ValueError, KeyError) as e:
                    notes[key.encode()] = f"no float64 reference: {e}"
        if reference_capture is not None:
            for key, role, stage, name in parsed:
                if role != "output":
                    continue
                exact = TensorKey(self.name, key.adapter, key_name("output", exact_stage(stage), name))
                t = reference_capture.get(exact)
                if t is not None:
                    tensors[key.encode()] = t
                    load_notes = reference_capture.meta.get("load_notes", {}).get(key.adapter)
                    if load_notes:
                        notes[key.encode()] = "reference: " + "; ".join(load_notes)
        return Reference(label="fp64 formula", tensors=tensors, notes=notes)

    # ------------------------------------------------------------------------------------------
    # rows
    # ------------------------------------------------------------------------------------------

    def describe(self, key: TensorKey) -> dict[str, Any]:
        role, stage, name = parse_name(key.name)
        if role == "output":
            return {"layer": None, "module": name, "role": "output", "stage": stage}
        if role == adapter_keys.SAVED_MODULE:  # `name` is the adapter file's key: module path, then parameter
            module = name.rsplit(".", 1)[0]
            return {
                "layer": layer_of(module),
                "module": module.rsplit(".", 1)[-1],
                "role": role,
                "stage": stage,
            }
        return {"layer": layer_of(name), "module": name.rsplit(".", 1)[-1], "role": role, "stage": stage}

    def rows(self, spec: ProbeSpec, capture: Capture, reference: Reference) -> list[dict[str, Any]]:
        target = Target.parse(capture.target)
        dtype = dtype_of(target)
        meta = capture.meta.get(self.name, {})
        adapters_meta = meta.get("adapters", {})
        rows: list[dict[str, Any]] = []
        for key in capture.keys(self.name):
            role, stage, name = parse_name(key.name)
            if role == "before":
                continue
            info = adapters_meta.get(key.adapter, {})
            if SUBSET_SEP in key.adapter and key.adapter not in adapters_meta:
                info = {"repacked": meta.get("subset_repacked", [])}
            kind = info.get("kind", "lora")
            measured = capture.result(key)
            if measured is not None and role != "output":  # measured in the worker (`_add`): its row
                row = measured_row(self, key, capture.target, measured)
                if role == "roundtrip":
                    add_note(row, ROUNDTRIP_NOTE)
                self._weight_findings(row, role, stage, name, info, target)
                rows.append(row)
                continue
            tensor = capture.get(key)
            if role in ("merged", "delta", "tied", adapter_keys.SAVED_MODULE):
                ref = reference.tensors.get(key.encode())
                label = {"tied": "base weight (checkpoint)", adapter_keys.SAVED_MODULE: "checkpoint"}.get(
                    role, "fp64 formula"
                )
                row = self._row(
                    spec, capture, key, tensor, ref, label, reference.notes.get(key.encode(), ""), dtype
                )
                if role == "merged" and ref is not None:
                    before = capture.get(TensorKey(self.name, key.adapter, key_name("before", "", name)))
                    row["scale_ulp"] = scale_ulp(tensor, ref, before, dtype)
                self._weight_findings(row, role, stage, name, info, target)
                rows.append(row)
            elif role == "roundtrip":
                before = capture.get(TensorKey(self.name, key.adapter, key_name("before", "", name)))
                row = self._row(spec, capture, key, tensor, before, "W before merge (same target)", "", dtype)
                add_note(row, ROUNDTRIP_NOTE)
                self._weight_findings(row, role, stage, name, info, target)
                rows.append(row)
            elif role == "output":
                rows.extend(self._output_rows(spec, capture, key, tensor, reference, kind, info, dtype))
        return rows

    def _row(
        self,
        spec: ProbeSpec,
        capture: Capture,
        key: TensorKey,
        tensor: torch.Tensor,
        ref: torch.Tensor | None,
        label: str,
        note: str,
        dtype: torch.dtype,
    ) -> dict[str, Any]:
        row = row_labels(self, key, capture.target, Reference(label=label, tensors={}, notes={}))
        row["note"] = note
        row["dtype"] = str(tensor.dtype).removeprefix("torch.")
        if ref is None:
            row.update(no_reference(tensor, label, note))
            return row
        stats = metrics.compare(tensor, ref, tolerance(spec, row["role"], dtype))
        row.update(metrics.stats_to_row(stats))
        return row

    def _weight_findings(
        self, row: dict, role: str, stage: str, name: str, info: dict, target: Target
    ) -> None:
        errors = info.get("safe_merge_errors", {})
        if role == "merged" and stage == "safe_merge" and name in errors:
            row["verdict"] = "broken"
            row["explanation"] = f"safe_merge refused to merge {name}: {errors[name]}"
            add_note(row, "the module stayed unmerged; fix or retrain the adapter tensor holding NaN/Inf")
        nonfinite = info.get("nonfinite_merged", {})
        if role == "merged" and stage == "merge_adapter" and name in nonfinite:
            row["verdict"] = "broken"
            prefix = row["explanation"] + " · " if row.get("explanation") else ""
            row["explanation"] = (
                f"{prefix}merge_adapter() (safe_merge=False) wrote {nonfinite[name]} NaN/Inf into W of {name}"
            )
            add_note(row, "PEFT's default merge does not look; safe_merge=True refuses this module")
        for finding in info.get("tied", []):
            partners = merging.tied_partner_modules(
                merging.TiedFinding(finding["module"], tuple(finding["tied_to"]))
            )
            if (role == "merged" and name == finding["module"]) or (role == "tied" and name in partners):
                row["verdict"] = "broken"
                prefix = row["explanation"] + " · " if row.get("explanation") else ""
                row["explanation"] = (
                    f"{prefix}tied weights {finding['pair']}: merging writes ΔW into the shared storage"
                )
                add_note(row, f"{UNTIE} (clone {finding['module']}.weight into its own parameter)")
        if role == "delta":
            source = info.get("delta_sources", {}).get(name)
            if source:
                add_note(row, f"target ΔW via {source}")
        if role in ("merged", "roundtrip") and name in info.get("repacked", []):
            broken(row, f"{name}: {REPACKED_MERGE}")
        if role == "merged" and info.get("kind") == "pissa":
            add_note(
                row,
                "W here is PiSSA's residual W − U·S·Vᵀ (rank r), which PEFT takes with an SVD in float32 "
                "when it loads the adapter and the reference takes in float64: that SVD difference, not "
                "the merge, sets this residual",
            )
        if role == "merged" and target.dtype != "float64" and row["verdict"] == "drift":
            ulps = row.get("scale_ulp", math.nan)
            if ulps <= ROUNDING_ULPS:
                add_note(
                    row,
                    f"merged in {target.dtype}: beyond the element-wise tolerance only where W + ΔW nearly "
                    f"cancels; at the tensor's scale the residual is {ulps:.2g} ulp, i.e. rounding",
                )
            else:
                add_note(
                    row,
                    f"merged in {target.dtype}: {ulps:.3g} ulp at the tensor's scale is more than the "
                    "rounding of the merge's sums and products: look for a wrong scaling or a changed W",
                )

    def _output_rows(
        self,
        spec: ProbeSpec,
        capture: Capture,
        key: TensorKey,
        tensor: torch.Tensor,
        reference: Reference,
        kind: str,
        info: dict,
        dtype: torch.dtype,
    ) -> list[dict[str, Any]]:
        role, stage, name = parse_name(key.name)
        out = []
        comparisons: list[tuple[str, torch.Tensor | None, str]] = []
        if stage not in ("unmerged", "subset unmerged"):
            unmerged_stage = "subset unmerged" if stage.startswith("subset") else "unmerged"
            unmerged = capture.get(
                TensorKey(self.name, key.adapter, key_name("output", unmerged_stage, name))
            )
            comparisons.append((f"unmerged ({capture.target})", unmerged, ""))
        if stage == "reload":
            pre = capture.get(TensorKey(self.name, key.adapter, key_name("output", "merge_and_unload", name)))
            comparisons.append(("merged before save", pre, "must be identical: same weights, same target"))
        exact = str(spec.reference)
        comparisons.append((exact, reference.tensors.get(key.encode()), ""))
        for label, ref, note in comparisons:
            if ref is None and label == exact and capture.target == exact:
                continue
            row = self._row(
                spec, capture, key, tensor, ref, label, note or reference.notes.get(key.encode(), ""), dtype
            )
            row["against"] = label
            if ref is not None:
                peft_tol = merging.peft_tolerance(kind, stage)
                row["peft_tol"] = peft_tol
                peft_stats = metrics.compare(tensor, ref, metrics.Tolerance(rtol=peft_tol, atol=peft_tol))
                row["peft_verdict"] = metrics.verdict(peft_stats)
            row.update(nonfinite_output(metrics.health(tensor)))
            if label == "merged before save" and ref is not None and not row["bitwise_equal"]:
                row["verdict"] = "broken" if row["verdict"] == "drift" else row["verdict"]
                add_note(row, "the reloaded merged model's outputs differ from the pre-save ones")
            self._output_findings(row, stage, info)
            out.append(row)
        return out

    def _output_findings(self, row: dict, stage: str, info: dict) -> None:
        if row["against"] == "merged before save":
            if info.get("repacked") and row["verdict"] == "broken":
                add_note(row, REPACKED_SAVE)
            return
        if info.get("repacked") and stage in REPACKED_STAGES:
            broken(row, REPACKED_MERGE)
        if stage in ("merge_adapter", "safe_merge", "merge_and_unload", "reload"):
            tied = info.get("tied", [])
            if tied:
                pairs = "; ".join(f["pair"] for f in tied)
                row["verdict"] = "broken"
                row["explanation"] = (
                    f"tied weights {pairs} changed by the merge · {row.get('explanation', '')}"
                )
                add_note(row, UNTIE)
        errors = info.get("safe_merge_errors", {})
        if stage == "safe_merge" and errors:
            row["verdict"] = "broken"
            add_note(row, f"safe_merge refused: {', '.join(errors)} (NaN/Inf); those modules stayed unmerged")
        nonfinite = info.get("nonfinite_merged", {})
        if stage in ("merge_adapter", "unmerge_adapter", "merge_and_unload", "reload") and nonfinite:
            row["verdict"] = "broken"
            add_note(
                row,
                f"PEFT's default merge (safe_merge=False) wrote NaN/Inf into W of {', '.join(nonfinite)}"
                + ("; unmerge_adapter() cannot take it out again" if stage == "unmerge_adapter" else ""),
            )
        if stage == "merge_and_unload" and info.get("merge_and_unload_error"):
            add_note(row, f"merge_and_unload() refused: {info['merge_and_unload_error']}")

    # ------------------------------------------------------------------------------------------
    # extra tables
    # ------------------------------------------------------------------------------------------

    def tables(
        self, spec: ProbeSpec, captures: list[Capture], reference_capture: Capture | None = None
    ) -> dict[str, pd.DataFrame]:
        """`merge_save`: one row per (target, adapter, save path); `merge_findings`: tied/NaN/notes."""
        return {"merge_save": save_table(captures), "merge_findings": findings_table(captures)}
