"""`activations`: every module's output in the forward pass on the probe, each target against the
`cpu/float64` reference, as *accumulated* and *local* drift, and the first module where a target parts.

- **Accumulated**: a module's output in the target's own forward against the reference's output.
- **Local**: a leaf module (a projection, a norm, an embedding, a PEFT adapter layer, the head)
  re-run in the target's device and dtype with exactly the arguments it was called with (positional
  and keyword), each tensor among them the *reference's*, cast to the target's dtype, against the
  reference's output: the error the module adds by itself. Where accumulated
  drift jumps and local drift is small, the error was inherited; where local drift is large, that
  module is the cause.

The reference target runs first (`Check.against`: `REFERENCE_TARGET_FIRST`): it keeps every recorded
output and the tensors among each leaf call's arguments. A target's worker then reads those back one
tensor at a time (`safe_open`) and compares each output as its hook sees it, so no worker ever holds the
whole model's activations: its capture keeps a metric row and a bounded sketch per module output (the
tensors too on a small model, `checkpoint.keeps_tensors`).

Rows carry `order` (execution order of the outputs, per adapter), `drift` (accumulated or local),
`call` (0 for a module's first call, 1 for a second call of a shared module, …), `module_path`,
`layer` and `role` (the module's path inside its block), so a page can draw depth × role.
"""

from __future__ import annotations

import contextlib
import json
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from core.capture import BASE, Capture, TensorKey
from core.checks.base import REFERENCE_TARGET_FIRST, CaptureContext, Check, Reference, tolerance
from core.checks.outputs import forward_output
from core.models.conversion import LAYER_RE, layer_of
from core.models.loading import Loaded
from core.numerics import metrics
from core.numerics.sketch import content_hash
from core.spec import ProbeSpec, Target

NAME = "activations"
LOCAL = "local:"  # a local-drift row's tensor name: LOCAL + the module's
INPUT = "input:"  # a leaf's input, kept by the reference capture only (never a row)
CALL_SEP = "@"  # "model.shared@1": the second call of a module called more than once
INPUT_SEP = "#"  # "input:model.x#1": the second tensor among a leaf call's arguments
ACCUMULATED, LOCAL_DRIFT = "accumulated", "local"
WORSE = ("drift", "broken")
# PEFT's wrapper prefix: module paths read as in the bare base model
_PEFT_PREFIX = "base_model.model."


def first_tensor(value: Any) -> torch.Tensor | None:
    """The tensor a module output stands for: itself, or the first tensor of a tuple, list, dict or
    ModelOutput (attention modules return (hidden, weights, …))."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):  # ModelOutput is a dict as well
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for item in value:
            found = first_tensor(item)
            if found is not None:
                return found
    return None


def module_role(path: str) -> str:
    """The module's place inside its block (`self_attn.q_proj`, `block` for the block itself), or its
    path outside the blocks (`model.embed_tokens`, `lm_head`); `encoder.`/`decoder.` kept for
    encoder-decoders, whose two stacks number their blocks alike."""
    m = LAYER_RE.search(path)
    if m is None:
        return path
    inside = path[m.end() :] or "block"
    stack = path[: m.start()].rsplit(".", 1)[-1]
    return f"{stack}.{inside}" if stack in ("encoder", "decoder") else inside


def split_name(name: str) -> tuple[str, str, int]:
    """(drift kind, module path, call index) of an activations tensor name."""
    drift = ACCUMULATED
    if name.startswith(LOCAL):
        drift, name = LOCAL_DRIFT, name[len(LOCAL) :]
    path, _, call = name.partition(CALL_SEP)
    return drift, path, int(call) if call else 0


def call_name(path: str, call: int) -> str:
    """The tensor name of a module's `call`-th output (the first call bears the bare path)."""
    return path if call == 0 else f"{path}{CALL_SEP}{call}"


def input_name(call: str, n: int) -> str:
    """The name of the `n`-th tensor among a leaf call's arguments (the first bears the call's name)."""
    return call if n == 0 else f"{call}{INPUT_SEP}{n}"


# Where a leaf call's argument was a tensor, in the skeleton a target keeps of the call.
_SLOT = object()


def _with_reference_inputs(
    flat: list[Any], reference: _ReferenceFile, adapter: str, call: str
) -> list[Any] | None:
    """A leaf call's flattened arguments with the reference's tensor in each tensor's place; None where
    the reference kept none for one of them."""
    filled, n = [], 0
    for v in flat:
        if v is _SLOT:
            v = reference.input_of(adapter, input_name(call, n))
            n += 1
            if v is None:
                return None
        filled.append(v)
    return filled


def hooked_modules(model: torch.nn.Module) -> tuple[list[tuple[str, torch.nn.Module]], set[int]]:
    """The modules whose outputs are recorded, with their display paths, and the ids of the leaves
    among them (re-run for local drift).

    Recorded: every block (`layers.N`, `block.N`, …), every module with parameters inside a block
    (attention, MLP, their projections, norms), and leaves with parameters outside the blocks
    (embeddings, final norm, head). A PEFT adapter layer counts as one leaf: its base layer and
    lora_A/B are not recorded apart. Parameterless modules (dropout, activations, rotary
    embeddings) are left out: they are part of the module that calls them.
    """
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # pragma: no cover - PEFT is a dependency; a bare model still works without it
        BaseTunerLayer = ()  # noqa: N806
    chosen: list[tuple[str, torch.nn.Module]] = []
    leaves: set[int] = set()
    inside_adapter: list[str] = []
    for raw, module in model.named_modules():
        if not raw:
            continue
        if any(raw.startswith(p + ".") for p in inside_adapter):
            continue
        path = raw.removeprefix(_PEFT_PREFIX)
        is_adapter = isinstance(module, BaseTunerLayer)
        if is_adapter:
            inside_adapter.append(raw)
        has_params = next(module.parameters(), None) is not None
        is_leaf = is_adapter or next(module.children(), None) is None
        block = LAYER_RE.search(path)
        is_block = block is not None and block.end() == len(path)
        if is_block or (has_params and (block is not None or is_leaf)):
            chosen.append((path, module))
            if is_leaf and has_params:
                leaves.add(id(module))
    return chosen, leaves


class _ReferenceFile:
    """The reference capture's tensors, read one at a time (a missing file reads as no tensors)."""

    def __init__(self, folder: Path | None):
        self.folder = folder
        self._stack = contextlib.ExitStack()
        self._file = None
        self._keys: set[str] = set()
        self.aliases: dict[str, dict[str, str]] = {}  # adapter -> leaf call -> the output its input is
        path = None if folder is None else folder / "tensors.safetensors"
        if path is not None and path.is_file():
            from safetensors import safe_open

            self._file = self._stack.enter_context(safe_open(str(path), framework="pt"))
            self._keys = set(self._file.keys())
            try:
                meta = json.loads((folder / "capture.json").read_text()).get("meta", {})
            except (OSError, ValueError):
                meta = {}
            self.aliases = meta.get(NAME, {}).get("input_alias", {})

    def input_of(self, adapter: str, name: str) -> torch.Tensor | None:
        """The reference's input `name` of a leaf call (`input_name`): kept apart, or the output it is an
        alias of."""
        alias = self.aliases.get(adapter, {}).get(name)
        return self.get(TensorKey(NAME, adapter, alias if alias is not None else INPUT + name))

    @property
    def present(self) -> bool:
        return self._file is not None

    def get(self, key: TensorKey) -> torch.Tensor | None:
        encoded = key.encode()
        if self._file is None or encoded not in self._keys:
            return None
        return self._file.get_tensor(encoded)

    def close(self) -> None:
        self._stack.close()


@dataclass(frozen=True)
class Divergence:
    """Where one target (and adapter) first parts from the reference."""

    target: str
    adapter: str | None
    module: str  # the module path (with `@k` for a later call)
    order: int
    verdict: str
    accumulated: float  # the accumulated row's metric there
    local: float | None  # the local row's, None where the module is not a leaf
    metric: str
    # for a module that is not a leaf (a block, an attention): the leaf inside it, before it, that adds
    # the most error by itself, and that local value
    worst_inside: tuple[str, float] | None = None

    @property
    def share(self) -> float | None:
        """Local over accumulated error at that module (1.0: the module itself explains it all)."""
        if self.local is None or not self.accumulated:
            return None
        return self.local / self.accumulated

    def sentence(self) -> str:
        """`cpu/bfloat16 parts from the reference at layers.0.self_attn.q_proj (local 2.1e-06, 80% of
        the accumulated error there)`."""
        who = self.target + (f" with {self.adapter}" if self.adapter else "")
        if self.local is None and self.worst_inside is not None:
            inside, value = self.worst_inside
            how = (
                f"accumulated {self.metric} {self.accumulated:.2g}; the largest local drift inside it: "
                f"{inside}, {value:.2g}"
            )
        elif self.local is None:
            how = f"accumulated {self.metric} {self.accumulated:.2g}; not a leaf, no local re-run"
        elif self.share is None:
            how = f"local {self.metric} {self.local:.2g}"
        else:
            how = f"local {self.metric} {self.local:.2g}, {100 * self.share:.0f}% of the accumulated error there"
        return f"{who} parts from the reference at {self.module} ({how})"


def first_divergences(table: pd.DataFrame, metric: str = "rel_l2") -> list[Divergence]:
    """Per target and adapter of the activations rows: the first module in execution order whose
    accumulated verdict is drift or broken. Targets that never part have none."""
    rows = table[table["check"] == NAME] if len(table) else table
    if not len(rows) or "drift" not in rows.columns:
        return []
    found = []
    adapters = rows["adapter"].astype(object).where(rows["adapter"].notna(), None)
    for (target, adapter), group in rows.groupby([rows["target"], adapters.fillna(BASE)], sort=False):
        acc = group[(group["drift"] == ACCUMULATED) & group["verdict"].isin(WORSE)]
        if not len(acc):
            continue
        first = acc.sort_values("order").iloc[0]
        local = group[(group["drift"] == LOCAL_DRIFT) & (group["module_path"] == first["module_path"])]
        local = local[local["call"] == first["call"]]
        local_value = float(local[metric].iloc[0]) if len(local) and pd.notna(local[metric].iloc[0]) else None
        value = float(first[metric]) if pd.notna(first[metric]) else float("nan")
        worst_inside = None
        if local_value is None:
            inside = group[
                (group["drift"] == LOCAL_DRIFT)
                & group["module_path"].str.startswith(first["module_path"] + ".")
                & (group["order"] <= first["order"])
            ]
            values = pd.to_numeric(inside[metric], errors="coerce")
            if values.notna().any():
                worst = inside.loc[values.idxmax()]
                worst_inside = (call_name(worst["module_path"], int(worst["call"])), float(values.max()))
        found.append(
            Divergence(
                target=str(target),
                adapter=None if adapter == BASE else str(adapter),
                module=call_name(first["module_path"], int(first["call"])),
                order=int(first["order"]),
                verdict=str(first["verdict"]),
                accumulated=value,
                local=local_value,
                metric=metric,
                worst_inside=worst_inside,
            )
        )
    return found


class ActivationsCheck(Check):
    name = NAME
    description = (
        "every module's output in the forward pass against cpu/float64: accumulated and local drift, "
        "and the first module where a target parts"
    )
    against = REFERENCE_TARGET_FIRST

    def capture(self, ctx: CaptureContext, loaded: Loaded, out: Capture) -> None:
        from core.models.checkpoint import keeps_tensors

        adapter = BASE if loaded.adapter is None else loaded.adapter.name
        is_reference = ctx.target == ctx.spec.reference
        ref_folder = None if ctx.run_dir is None else ctx.run_dir / "captures" / ctx.spec.reference.slug
        reference = _ReferenceFile(None if is_reference else ref_folder)
        # Without a reference capture here (it failed; a stand-in compares later) the outputs are
        # kept whole for the compare task, as for the reference itself.
        compare_now = reference.present
        keep = is_reference or not compare_now or keeps_tensors(ctx.spec)
        modules, leaves = hooked_modules(loaded.model)
        calls: dict[int, int] = {}
        order: dict[str, int] = out.meta.setdefault(NAME, {}).setdefault("order", {}).setdefault(adapter, {})
        # per leaf call: (module, tensor name) in execution order, for the local re-runs after the forward
        leaf_calls: list[tuple[torch.nn.Module, str]] = []
        handles = []

        def name_of(module: torch.nn.Module, path: str) -> str:
            return call_name(path, calls.get(id(module), 0))

        # The reference keeps a leaf's input once: where it is an output recorded already, unchanged
        # (q/k/v_proj take input_layernorm's output, lm_head the final norm's), the input is that
        # output's name (`input_alias`), not a second copy. Tensor id -> (weakref, version, name).
        produced: dict[int, tuple[weakref.ref, int, str]] = {}
        aliases: dict[str, str] = out.meta[NAME].setdefault("input_alias", {}).setdefault(adapter, {})

        # Per leaf call on a target: its arguments, positional and keyword, with each tensor's place left
        # for the reference's tensor (`_local` re-runs the module on exactly those): no tensor is held.
        skeletons: dict[str, tuple[Any, list[Any]]] = {}

        def on_input(path: str):
            def hook(module, args, kwargs):
                if id(module) not in leaves:
                    return
                name = name_of(module, path)
                flat, tree = tree_flatten((args, kwargs))
                if not is_reference:
                    if compare_now:
                        skeletons[name] = (tree, [_SLOT if torch.is_tensor(v) else v for v in flat])
                    return
                for n, x in enumerate(v for v in flat if torch.is_tensor(v)):
                    slot = input_name(name, n)
                    seen = produced.get(id(x))
                    if seen is not None and seen[0]() is x and seen[1] == x._version:
                        aliases[slot] = seen[2]
                    else:
                        out.keep(TensorKey(NAME, adapter, INPUT + slot), x)

            return hook

        def on_output(path: str):
            def hook(module, args, output):
                name = name_of(module, path)
                calls[id(module)] = calls.get(id(module), 0) + 1
                y = first_tensor(output)
                if y is None:
                    return
                order[name] = len(order)
                if is_reference:
                    produced[id(y)] = (weakref.ref(y), y._version, name)
                if id(module) in leaves:
                    leaf_calls.append((module, name))
                self._record(ctx, out, TensorKey(NAME, adapter, name), y, reference, compare_now, keep)

            return hook

        for path, module in modules:
            handles.append(module.register_forward_pre_hook(on_input(path), with_kwargs=True))
            handles.append(module.register_forward_hook(on_output(path)))
        try:
            forward_output(loaded.model, ctx.probe)
        finally:
            for h in handles:
                h.remove()
        try:
            if compare_now:
                self._local(ctx, out, adapter, leaf_calls, skeletons, reference, keep)
        finally:
            reference.close()

    def _record(
        self,
        ctx: CaptureContext,
        out: Capture,
        key: TensorKey,
        tensor: torch.Tensor,
        reference: _ReferenceFile,
        compare_now: bool,
        keep: bool,
    ) -> None:
        """Compare one output with the reference's where it is, keep its row and sketch (and the tensor
        where the run keeps tensors)."""
        if compare_now:
            ref_key = TensorKey(NAME, key.adapter, key.name.removeprefix(LOCAL))
            ref = reference.get(ref_key)
            dtype = str(tensor.dtype).removeprefix("torch.")
            if ref is None:
                from core.checks.base import missing_reference_row

                row = missing_reference_row(tensor)
                out.results[key.encode()] = {
                    "reference": str(ctx.spec.reference),
                    "note": "the reference's forward has no such module output",
                    "dtype": dtype,
                    "row": row,
                    "sketch": None,
                    "hash": content_hash(tensor),
                }
            else:
                tol = tolerance(ctx.spec, self.role_of(ctx.spec, key), getattr(torch, ctx.target.float_dtype))
                stats, sketch = metrics.measure(tensor, ref.to(tensor.device), tol)
                out.results[key.encode()] = {
                    "reference": str(ctx.spec.reference),
                    "note": "",
                    "dtype": dtype,
                    "row": metrics.stats_to_row(stats),
                    "sketch": None if sketch is None else sketch.meta(),
                    "hash": content_hash(tensor),
                }
                if sketch is not None:
                    out.sketches[key.encode()] = sketch
        if keep:
            out.keep(key, tensor)

    def _local(
        self,
        ctx: CaptureContext,
        out: Capture,
        adapter: str,
        leaf_calls: list[tuple[torch.nn.Module, str]],
        skeletons: dict[str, tuple[Any, list[Any]]],
        reference: _ReferenceFile,
        keep: bool,
    ) -> None:
        """Re-run each leaf call alone, one at a time, with exactly the arguments it was called with
        (positional and keyword), each tensor among them the reference's, a floating one cast to the
        target's dtype: Marian's position embedding takes a shape and a past length, not a tensor."""
        order = out.meta[NAME]["order"][adapter]
        dtype = getattr(torch, ctx.target.float_dtype)
        skipped = []
        for module, name in leaf_calls:
            tree, flat = skeletons.get(name, (None, None))
            filled = None if flat is None else _with_reference_inputs(flat, reference, adapter, name)
            if filled is None:
                skipped.append(name)
                continue
            param = next(module.parameters())
            filled = [
                v.to(param.device, dtype=dtype if v.is_floating_point() else v.dtype)
                if torch.is_tensor(v)
                else v
                for v in filled
            ]
            args, kwargs = tree_unflatten(filled, tree)
            try:
                with torch.no_grad():
                    y = first_tensor(module(*args, **kwargs))
            except Exception as e:  # said, not fatal: the module's accumulated rows stand
                skipped.append(f"{name} ({type(e).__name__})")
                continue
            if y is None:
                continue
            local = LOCAL + name
            order[local] = order[name]
            self._record(ctx, out, TensorKey(NAME, adapter, local), y, reference, True, keep)
        if skipped:
            out.notes.append(
                f"activations: no local drift for {len(skipped)} leaf call(s), e.g. {', '.join(skipped[:3])}"
            )

    def reference(
        self, spec: ProbeSpec, keys: list[TensorKey], reference_capture: Capture | None
    ) -> Reference:
        """The reference's outputs, for rows computed in the compare task (the reference itself, or a
        stand-in reference after the reference failed): a local row's reference is the module's output."""
        if reference_capture is None:
            return Reference(label=str(spec.reference), tensors={}, notes={})
        tensors = {}
        for k in keys:
            ref_key = TensorKey(NAME, k.adapter, k.name.removeprefix(LOCAL)).encode()
            if ref_key in reference_capture.tensors:
                tensors[k.encode()] = reference_capture.tensors[ref_key]
            elif reference_capture.folder is not None:  # the drill-down reads only the key it asks for
                one = _ReferenceFile(reference_capture.folder)
                try:
                    found = one.get(TensorKey.decode(ref_key))
                finally:
                    one.close()
                if found is not None:
                    tensors[k.encode()] = found
        return Reference(label=str(spec.reference), tensors=tensors, notes={})

    def describe(self, key: TensorKey) -> dict[str, Any]:
        drift, path, call = split_name(key.name)
        return {
            "layer": layer_of(path),
            "module": path.rsplit(".", 1)[-1],
            "role": module_role(path),
            "drift": drift,
            "module_path": path,
            "call": call,
        }

    def rows(self, spec: ProbeSpec, capture: Capture, reference: Reference) -> list[dict[str, Any]]:
        orders = capture.meta.get(NAME, {}).get("order", {})
        only_rows = Capture(
            target=capture.target,
            tensors={
                k: v for k, v in capture.tensors.items() if not TensorKey.decode(k).name.startswith(INPUT)
            },
            meta=capture.meta,
            results=capture.results,
            sketches=capture.sketches,
            folder=capture.folder,
        )
        rows = super().rows(spec, only_rows, reference)
        for row in rows:
            adapter = BASE if row["adapter"] is None else row["adapter"]
            row["order"] = orders.get(adapter, {}).get(row["tensor"])
            if row["verdict"] in WORSE and row["drift"] == LOCAL_DRIFT:
                row["note"] = (row.get("note") + "; " if row.get("note") else "") + (
                    f"re-run alone in {Target.parse(capture.target).dtype} on the reference's input: "
                    "this module adds the error itself"
                )
        return rows


def divergence_sentences(table: pd.DataFrame) -> dict[str, str]:
    """{target (· adapter): the first module where it parts from the reference} from the metrics table's
    activations rows; a target that never parts says so too."""
    if not len(table) or NAME not in set(table["check"]):
        return {}
    found = {}
    for d in first_divergences(table):
        found[d.target + (f" · {d.adapter}" if d.adapter else "")] = d.sentence()
    for target in dict.fromkeys(table.loc[table["check"] == NAME, "target"]):
        if not any(k == target or k.startswith(target + " · ") for k in found):
            found[target] = f"{target} stays within tolerance of the reference at every module"
    return found
