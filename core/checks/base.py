"""The interface every check implements: what to capture on a loaded target, and how to
turn captures into metric rows.

A check module defines one `Check` subclass; adding a check touches nothing else but the
registry in `core/checks/__init__.py`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from core.capture import BASE, Capture, TensorKey
from core.models.conversion import layer_of
from core.models.loading import Loaded
from core.numerics import metrics
from core.numerics.sketch import Sketch, content_hash
from core.spec import ProbeSpec, Target

if TYPE_CHECKING:
    import pandas as pd

# The metrics table's leading columns (DESIGN.md); checks may add more after these.
METRIC_COLUMNS = (
    "check",
    "target",
    "reference",
    "adapter",
    "tensor",
    "layer",
    "module",
    "role",
    "dtype",
    "shape",
    "numel",
    "bitwise_equal",
    "n_mismatch",
    "max_abs",
    "mean_abs",
    "rmse",
    "rel_l2",
    "cos_sim",
    "max_ulp",
    "min_atol",
    "worst_index",
    "verdict",
    "explanation",
    "note",
    "peer",
    "peer_ratio",
)


@dataclass
class CaptureContext:
    """What a check may use while capturing on one target."""

    spec: ProbeSpec
    target: Target
    # the model's forward arguments (`probes.probe_inputs`), on the CPU; `forward_output` moves them
    probe: dict[str, torch.Tensor]
    run_dir: Path | None = None  # the run's folder (e.g. to save a merged model into)


@dataclass
class Measured:
    """A tensor compared in the worker: its reference label and note, its row and its sketch."""

    reference: str
    note: str
    dtype: str
    row: dict[str, Any]  # `metrics.stats_to_row` (or a `missing_reference_row`)
    sketch: Sketch | None  # None when the tensor equals its reference bit for bit (or cannot be drawn)
    hash: str  # `content_hash` of the target tensor: machines compare weights by it
    # the tensor is its reference rounded to its dtype, bit for bit: its sketch is redrawn, not kept
    rounding: bool = False

    def as_dict(self) -> dict[str, Any]:
        """What a capture stores (the sketch's arrays go apart, in sketches.safetensors)."""
        return {
            "reference": self.reference,
            "note": self.note,
            "dtype": self.dtype,
            "row": self.row,
            "sketch": None if self.sketch is None else self.sketch.meta(),
            "hash": self.hash,
            **({"rounding": True} if self.rounding else {}),
        }


@dataclass
class Reference:
    """The tensors a target is compared against, and what they are."""

    label: str  # "checkpoint", "cpu/float64", "fp64 formula (checkpoint)"
    tensors: dict[str, torch.Tensor]  # encoded TensorKey -> tensor
    notes: dict[str, str]  # encoded TensorKey -> note about how this reference was made


def tolerance(spec: ProbeSpec, role: str, dtype: torch.dtype) -> metrics.Tolerance:
    """The target dtype's default, with the user's override for this role (or the run) applied."""
    default = metrics.default_tolerance(dtype)
    override = spec.tolerance_for(role)
    if override is None:
        return default
    return metrics.Tolerance(
        rtol=default.rtol if override.rtol is None else override.rtol,
        atol=default.atol if override.atol is None else override.atol,
    )


# How a check loads its models (`Check.loads`).
SHARED = "shared"  # the shared load loop: each target loaded once for all such checks
SHARED_LAST = "shared, last"  # the shared loop, after the others: its capture changes the model (merging)
OWN_WORKER = "own worker"  # a worker process of its own per target and variant (`variants`, `run`)
# an own worker that measures its process from its start (a memory timeline: what the imports cost): a
# fresh interpreter, never one forked from a process that imported the libraries
FRESH_INTERPRETER = "fresh interpreter"

# What a check's rows are measured against (`Check.against`).
CHECKPOINT = "checkpoint"  # the checkpoint's tensors, or a formula of them (`reference`)
REFERENCE_TARGET = "reference target"  # the capture of the run's reference target (cpu/float64)
# the reference target's capture, read while the other targets capture (activations re-run each module
# on the reference's inputs): the reference target runs first
REFERENCE_TARGET_FIRST = "reference target, first"

# How `core.judgement` sets a check's rows against a peer's on the same tensor (`Check.judged`).
COMPUTED = "computed"  # computed tensors: the peer's error is floored at its dtype's eps
LOADED = "loaded"  # loaded tensors that should be bitwise the file: a peer exact there makes any error ∞


class Check(ABC):
    """One kind of measurement.

    A check sets `name` and `description`, implements `capture` and `reference`, and says in six
    attributes how it runs: `loads`, `against`, `judged`, `compares_in_worker`, `redraws_rounding` and
    `reads_loaded_names`. The
    hooks below have defaults that fit most checks: an own-worker check adds `variants`, `run_stages` and
    `run`; a check labels its rows with `describe` (and `role_of`), adds columns with `extra_columns` or
    rewrites them in `rows`, compares captures together in `compare` (and `compare_steps`), stores
    tables of its own with `tables`, and reads one tensor's reference cheaply with `reference_for`.
    What the engine does with a check (`measure`, `measured_row`, `row_labels`) is in this module's functions.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    loads: ClassVar[str] = SHARED  # SHARED, SHARED_LAST, OWN_WORKER or FRESH_INTERPRETER
    against: ClassVar[str] = CHECKPOINT  # CHECKPOINT, REFERENCE_TARGET or REFERENCE_TARGET_FIRST
    # COMPUTED or LOADED; None: its rows compare a target with itself (load strategies, a timeline), or
    # have no error to set against a peer's (generated tokens)
    judged: ClassVar[str | None] = COMPUTED
    # Its reference (the checkpoint, a formula of it) can be read one tensor at a time: the worker compares
    # each tensor where it is, while it is there (`measure`), and keeps its row and sketch, not the tensor.
    compares_in_worker: ClassVar[bool] = False
    # A `compares_in_worker` check whose tensor, where it is exactly its reference rounded to the
    # target's dtype (a bfloat16 load of a float32 checkpoint), keeps no sketch: the drill-down draws it
    # again from the reference (`redraw_rounding`), and a run folder holds no map of plain rounding.
    redraws_rounding: ClassVar[bool] = False
    # Its compare reads the base checkpoint under the names tensors take on load (`read_loaded`, which asks
    # transformers): its compare task imports transformers and PEFT; any other compare imports neither.
    reads_loaded_names: ClassVar[bool] = False

    # What the engine reads of those attributes.
    @property
    def own_worker(self) -> bool:
        """It loads models its own way in a worker of its own per target and variant (`run`)."""
        return self.loads in (OWN_WORKER, FRESH_INTERPRETER)

    @property
    def fresh_interpreter(self) -> bool:
        """Its worker is a fresh interpreter, never forked from one that imported the libraries."""
        return self.loads == FRESH_INTERPRETER

    @property
    def mutates_model(self) -> bool:
        """Its capture changes the loaded model: it runs after the shared loop's other checks."""
        return self.loads == SHARED_LAST

    @property
    def needs_reference_target(self) -> bool:
        """Its reference is the reference target's capture (cpu/float64), not the checkpoint."""
        return self.against in (REFERENCE_TARGET, REFERENCE_TARGET_FIRST)

    @property
    def reference_first(self) -> bool:
        """Its targets read the reference target's capture while they capture: the reference runs first."""
        return self.against == REFERENCE_TARGET_FIRST

    @property
    def loads_exactly(self) -> bool:
        """Its judged rows are loaded tensors: a peer exact there makes any error infinite."""
        return self.judged == LOADED

    @abstractmethod
    def capture(self, ctx: CaptureContext, loaded: Loaded, out: Capture) -> None:
        """Add this check's tensors for one loaded model (bare base or base + adapter) to `out`."""

    @abstractmethod
    def reference(
        self, spec: ProbeSpec, keys: list[TensorKey], reference_capture: Capture | None
    ) -> Reference:
        """The reference tensors for `keys` (from the checkpoint, or from the cpu/float64 capture)."""

    def variants(self, spec: ProbeSpec, target: Target) -> tuple[str, ...]:
        """The variants an own-worker check runs on `target`, one worker each (e.g. load strategies)."""
        return ("",)

    def run_stages(self, spec: ProbeSpec, target: Target, variant: str) -> int:
        """How many times `run` calls `stage` for this variant, so progress reads step k of a true n."""
        return 0

    def run(self, ctx: CaptureContext, variant: str, stage: Callable[[str], None], out: Capture) -> None:
        """Own-worker checks: load and capture on `ctx.target` for `variant`, calling `stage` before each step."""
        raise NotImplementedError(f"{self.name} runs in the shared load loop")

    def compare(
        self,
        spec: ProbeSpec,
        captures: list[Capture],
        reference_capture: Capture | None,
        progress: Callable[[str], None],
    ) -> list[dict[str, Any]]:
        """Every row of this check for the run: one reference for all captures, then rows per capture.

        Checks whose rows need several captures at once (a variant against another) override this.
        """
        # One reference per check for all targets: it does not depend on the target. Tensors the
        # workers compared themselves need none here.
        keys = sorted(
            {k for c in captures for k in c.keys(self.name) if c.result(k) is None}, key=lambda k: k.encode()
        )
        reference = self.reference(spec, keys, reference_capture)
        rows: list[dict[str, Any]] = []
        for capture in captures:
            progress(f"compare {self.name} on {capture.label}")
            rows.extend(self.rows(spec, capture, reference))
        return rows

    def compare_steps(self, captures: list[Capture]) -> int:
        """How many times `compare` calls `progress`."""
        return len(captures)

    def tables(
        self, spec: ProbeSpec, captures: list[Capture], reference_capture: Capture | None = None
    ) -> dict[str, pd.DataFrame]:
        """Extra tables this check stores in the run folder as `<name>.parquet` (none by default);
        `reference_capture`: the reference target's, for checks that need it (None where they don't)."""
        return {}

    def reference_for(
        self, spec: ProbeSpec, key: TensorKey, reference_capture: Capture | None, scratch: bool = False
    ) -> Reference:
        """The reference of one tensor (the drill-down); checks with a cheaper way override this.

        `scratch`: the caller drops it before asking for the next one, so it may live in a buffer the
        next call reuses (`Checkpoint.read`).
        """
        return self.reference(spec, [key], reference_capture)

    def role_of(self, spec: ProbeSpec, key: TensorKey) -> str:
        """The role a tensor's row has and its tolerance is looked up by: `describe`'s, unless the check
        labels the row from more than the key (the weights check: the adapter's modules_to_save)."""
        return self.describe(key)["role"]

    def describe(self, key: TensorKey) -> dict[str, Any]:
        """Row labels for a tensor: layer, module, role (checks refine this)."""
        return {"layer": layer_of(key.name), "module": key.name.rsplit(".", 1)[-1], "role": key.check}

    def rows(self, spec: ProbeSpec, capture: Capture, reference: Reference) -> list[dict[str, Any]]:
        """One metric row per captured tensor of this check, against its reference."""
        rows = []
        # Tolerances follow the target's dtype: an adapter PEFT keeps in float32 on a bfloat16
        # target is judged by what the user asked for, bfloat16.
        target_dtype = getattr(torch, Target.parse(capture.target).float_dtype)
        for key in capture.keys(self.name):
            measured = capture.result(key)
            if measured is not None:  # compared in the worker: its row as measured there
                rows.append(measured_row(self, key, capture.target, measured))
                continue
            tensor = capture.get(key)
            ref = reference.tensors.get(key.encode())
            row = row_labels(self, key, capture.target, reference)
            row["dtype"] = str(tensor.dtype).removeprefix("torch.")
            if ref is None:
                row.update(missing_reference_row(tensor))
            else:
                stats = metrics.compare(tensor, ref, tolerance(spec, self.role_of(spec, key), target_dtype))
                row.update(metrics.stats_to_row(stats))
            row.update(self.extra_columns(key, tensor, ref))
            rows.append(row)
        return rows

    def extra_columns(self, key: TensorKey, tensor: torch.Tensor, ref: torch.Tensor | None) -> dict[str, Any]:
        """Check-specific columns for one row (none by default)."""
        return {}


def measure(check: Check, spec: ProbeSpec, target: Target, key: TensorKey, tensor: torch.Tensor) -> Measured:
    """Compare one captured tensor with its reference where it is (`compares_in_worker` checks).

    The reference is read lazily (`reference_for`: one tensor of the checkpoint, or one module's
    formula), so a worker holds one tensor's reference at a time.
    """
    reference = check.reference_for(spec, key, None, scratch=True)
    ref = reference.tensors.get(key.encode())
    return measure_against(
        check, spec, target, key, tensor, ref, reference.label, reference.notes.get(key.encode(), "")
    )


def measure_against(
    check: Check,
    spec: ProbeSpec,
    target: Target,
    key: TensorKey,
    tensor: torch.Tensor,
    ref: torch.Tensor | None,
    label: str,
    note: str = "",
) -> Measured:
    """Compare one captured tensor with `ref` (labelled `label`) where it is: its row, sketch and hash;
    a `broken` key-mismatch row where `ref` is None."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    if ref is None:
        return Measured(label, note, dtype, missing_reference_row(tensor), None, content_hash(tensor))
    tol = tolerance(spec, check.role_of(spec, key), getattr(torch, target.float_dtype))
    # compared where the tensor is (a GPU's tensor never crosses to the host): its reference moved there
    ref_there = ref.to(tensor.device)
    stats, sketch = metrics.measure(tensor, ref_there, tol)
    row = metrics.stats_to_row(stats)
    # the same bits hash alike: hash the reference where it is already on the host
    same = stats.bitwise_equal and ref.dtype == tensor.dtype
    digest = content_hash(ref if same else tensor)
    rounding = sketch is not None and check.redraws_rounding and is_rounding_of(tensor, ref_there)
    return Measured(label, note, dtype, row, None if rounding else sketch, digest, rounding)


def measured_row(check: Check, key: TensorKey, target: str, measured: dict[str, Any]) -> dict[str, Any]:
    """The metrics row of a tensor the worker compared itself (`Measured.as_dict`)."""
    reference = Reference(label=measured["reference"], tensors={}, notes={key.encode(): measured["note"]})
    row = row_labels(check, key, target, reference)
    row["dtype"] = measured["dtype"]
    row.update(measured["row"])
    return row


def row_labels(check: Check, key: TensorKey, target: str, reference: Reference) -> dict[str, Any]:
    """The columns that say what a row is about: check, target, reference, tensor, labels, note."""
    return {
        "check": check.name,
        "target": target,
        "reference": reference.label,
        "adapter": None if key.adapter == BASE else key.adapter,
        "tensor": key.name,
        **check.describe(key),
        "note": reference.notes.get(key.encode(), ""),
    }


def is_rounding_of(tensor: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether `tensor` is `ref` rounded to `tensor`'s narrower floating dtype (torch's conversion, round
    to nearest even), bit for bit; both on one device (no copy is made to find out)."""
    return (
        tensor.dtype != ref.dtype
        and tensor.is_floating_point()
        and ref.is_floating_point()
        and tensor.device == ref.device
        and tensor.shape == ref.shape
        and torch.finfo(tensor.dtype).bits < torch.finfo(ref.dtype).bits
        and torch.equal(tensor, ref.to(tensor.dtype))
    )


def redraw_rounding(
    check: Check, spec: ProbeSpec, target: Target, key: TensorKey, dtype: str
) -> Sketch | None:
    """The sketch a `rounding` tensor's worker left out: its reference, read again, rounded to `dtype`
    and measured as the worker measured it (the same inputs, so the same sketch); None where the
    reference is gone."""
    ref = check.reference_for(spec, key, None, scratch=True).tensors.get(key.encode())
    if ref is None:
        return None
    tol = tolerance(spec, check.role_of(spec, key), getattr(torch, target.float_dtype))
    return metrics.measure(ref.to(getattr(torch, dtype)), ref, tol)[1]


def add_note(row: dict[str, Any], text: str) -> None:
    """Append `text` to the row's `note` (the "why" a user reads next to the numbers)."""
    row["note"] = f"{row['note']}; {text}" if row.get("note") else text


# A capture's meta keys, on a quantized target: {adapter: PEFT's reason} for the adapters PEFT refused
# there (`Loaded.refused`), and {check: {adapter: error}} for a check's capture that raised on one.
REFUSED = "refused"
FAILED = "failed"
NOT_LOADED = "(not loaded)"  # the tensor name of a refused adapter's row
CAPTURE_FAILED = "(failed)"  # and of a failed capture's
TIMED_OUT = "(timed out)"  # and of a task killed at its time limit (`timed_out_row`)


def adapter_finding(target: Target, loaded: Loaded, error: Exception) -> bool:
    """Whether `error`, raised while measuring `loaded` on `target`, is a finding about that adapter there
    (a PEFT or bitsandbytes layer failing on a quantized base: a `(failed)` row) rather than the task's
    end (on a float target, for the bare base, or out of memory)."""
    oom = isinstance(error, (MemoryError, torch.OutOfMemoryError))
    return target.quantized and loaded.adapter is not None and not oom


def broken_row(
    check: str, target: str, adapter: str | None, tensor: str, explanation: str, note: str
) -> dict[str, Any]:
    """A `broken` row that stands for what could not be measured on `target` (`tensor` names why, in
    parentheses): the table says so rather than leaving it out unseen."""
    return {
        "check": check,
        "target": target,
        "reference": "",
        "adapter": adapter,
        "tensor": tensor,
        "role": "adapter" if adapter else "",
        "shape": "",
        "numel": 0,
        "bitwise_equal": False,
        "verdict": "broken",
        "explanation": explanation,
        "note": note,
    }


def refused_rows(check: str, captures: list[Capture]) -> list[dict[str, Any]]:
    """One `broken` row of `check` for each adapter PEFT refused on a target, and for each adapter whose
    capture of `check` raised there: the table says so rather than leaving the adapter out unseen."""
    rows = []
    for capture in captures:
        for adapter, reason in capture.meta.get(REFUSED, {}).items():
            note = f"PEFT does not load {adapter} on {capture.target}: nothing of it to compare there"
            rows.append(broken_row(check, capture.target, adapter, NOT_LOADED, reason, note))
        for adapter, error in capture.meta.get(FAILED, {}).get(check, {}).items():
            note = (
                f"{adapter} loaded on {capture.target}, and measuring it for {check} raised there: "
                "what it measured before that is in its other rows"
            )
            rows.append(broken_row(check, capture.target, adapter, CAPTURE_FAILED, error, note))
    return rows


def timed_out_row(check: str, target: str, variant: str | None, finding: str) -> dict[str, Any]:
    """The `broken` row of `check` on `target` whose task was killed at its time limit (`finding`: "timed
    out after N s in stage S"): what the task measured is lost with its process."""
    what = f"{check}:{variant}" if variant else check
    note = f"the task capturing {what} on {target} ran past its time limit (--task-timeout) and was killed"
    return broken_row(check, target, None, TIMED_OUT, finding, note)


def missing_reference_row(tensor: torch.Tensor | tuple[int, ...]) -> dict[str, Any]:
    """A `broken` row for a tensor (or a tensor's shape) the reference does not have (key mismatch)."""
    shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else tuple(tensor)
    return {
        "shape": "x".join(map(str, shape)),
        "numel": math.prod(shape),
        "bitwise_equal": False,
        "verdict": "broken",
        "explanation": "key mismatch: the reference has no such tensor",
    }
