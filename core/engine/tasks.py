"""What a task does: the capture of one target, or the compare of a whole run (`run_task`). The
process that runs it — spawned, forked from the fork server, or a spare — is `core.engine.worker`'s;
the in-process runner calls `run_task` directly (unit tests)."""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

Event = dict[str, Any]
Emit = Callable[[Event], None]
# How much lower a memory timeline's CPU priority is than other tasks' (nice(2) steps: 10 of 19)
MEMORY_TIMELINE_NICENESS = 10
# A small model's tasks that do not fill the first page (`core.engine.schedule.task_lanes`): below the
# first page's tasks and the dashboard that draws it, above the memory timelines
BACKGROUND_NICENESS = 5


class Cancelled(Exception):
    """Raised at a stage boundary once cancellation was requested."""


@dataclass(frozen=True)
class Task:
    """One unit of work for a runner: capture one target, or compare a run's captures."""

    kind: str  # "capture" | "compare" | "validate" (the spec's inputs, `Runner.validate_inputs`)
    run_dir: str
    spec: dict[str, Any]
    target: str | None = None
    checks: tuple[str, ...] = ()
    variant: str | None = None  # set for an own-worker check's task (then `checks` is that one check)
    # A shared-loop task that captures part of the run's checks (a small model's are captured in
    # passes, `core.engine.schedule.capture_passes`): its checks, named in its label. A compare task with
    # `checks` compares those alone, before the run ends (`partial`).
    part: bool = False
    # Its process's niceness (nice(2); raised to it, never lowered), where the engine runs tasks beside
    # each other (`task_lanes`): who gets the CPU first, never what is computed.
    niceness: int = 0
    # Seconds it may take once its process has it; past them the runner kills the process (None: no limit)
    timeout_s: float | None = None

    @property
    def own_check(self) -> str | None:
        """The check this task runs in its own worker, or None for the shared load loop."""
        return self.checks[0] if self.variant is not None else None

    @property
    def fresh_process(self) -> bool:
        """Whether it runs in a fresh interpreter of its own, not forked from one that imported the
        libraries: its check's `fresh_interpreter` (a memory timeline's, which measures what those imports
        cost from its process's start)."""
        if self.own_check is None:
            return False
        from core.checks import CHECKS  # imports torch: only for an own-worker check's task

        return CHECKS[self.own_check].fresh_interpreter

    @property
    def needs_libraries(self) -> bool:
        """Whether its process imports transformers and PEFT (~4 CPU-s a fresh interpreter): every task
        but a compare whose checks read no base tensor under its loaded name (`reads_loaded_names`), which
        reads captures and checkpoints with torch alone."""
        if self.kind != "compare":
            return True
        from core.checks import get_checks

        return any(c.reads_loaded_names for c in get_checks(self.checks or self.spec.get("checks") or ()))

    @property
    def partial(self) -> bool:
        """A compare task for some checks only, while the run goes on (`metrics.parquet` comes later)."""
        return self.kind == "compare" and bool(self.checks)

    @property
    def label(self) -> str:
        if self.kind == "validate":
            return "validate"
        if self.target is None:
            return "compare" + (f" · {', '.join(self.checks)}" if self.checks else "")
        if self.variant is None:
            return self.target + (f" · {', '.join(self.checks)}" if self.part else "")
        return f"{self.target} · {self.checks[0]}" + (f":{self.variant}" if self.variant else "")


class Progress:
    """Emits `progress` events (stage, step k of n) and checks for cancellation between stages."""

    def __init__(self, emit: Emit, should_cancel: Callable[[], bool], total: int, target: str | None):
        self.emit, self.should_cancel, self.total, self.target = emit, should_cancel, total, target
        self.step = 0
        self.stage = "start"

    def __call__(self, stage: str) -> None:
        if self.should_cancel():
            raise Cancelled(f"cancelled before {stage!r}")
        self.step += 1
        self.stage = stage
        self.emit(
            {"type": "progress", "target": self.target, "stage": stage, "step": self.step, "of": self.total}
        )


def run_task(task: Task, emit: Emit, should_cancel: Callable[[], bool] = lambda: False) -> None:
    """Run a task to completion; errors propagate to the runner, which reports them."""
    if task.kind == "capture":
        run_capture(task, emit, should_cancel)
    elif task.kind == "compare":
        run_compare(task, emit, should_cancel)
    elif task.kind == "validate":
        from core.models.validate import validate_inputs
        from core.spec import ProbeSpec

        validate_inputs(ProbeSpec.from_dict(task.spec))  # InputError: the event names its type
    else:
        raise ValueError(f"unknown task kind {task.kind!r}")


def run_capture(task: Task, emit: Emit, should_cancel: Callable[[], bool]) -> None:
    """Load base and adapters on the task's target and write its capture into the run folder.

    The shared load loop (strategy `isolated`) serves every check that does not run in its own
    worker; a task with a `variant` runs that one own-worker check's `run` instead.
    """
    from core.capture import BASE, Capture, capture_folder_name
    from core.checks import get_checks
    from core.checks.base import FAILED, REFUSED, CaptureContext, adapter_finding
    from core.methods.families.orthogonal import remember_fbd_cuda_failure
    from core.models.checkpoint import adapters_task_type, load_config, release_scratch
    from core.models.loading import STRATEGIES, float32_fallback_notes, model_class
    from core.models.probes import probe_inputs
    from core.models.targets import apply_flags, environment
    from core.spec import ProbeSpec, Target

    spec = ProbeSpec.from_dict(task.spec)
    target = Target.parse(task.target or "")
    checks = get_checks(task.checks)
    run_dir = Path(task.run_dir)
    own = checks[0] if task.own_check is not None else None
    variant = task.variant or ""
    strategy = STRATEGIES["isolated"]
    if own is not None:
        # apply flags, the check's own stages, write
        total = 1 + own.run_stages(spec, target, variant) + 1
    else:
        # apply flags, the strategy's load stages, one capture per loaded model, write
        total = 1 + strategy.stages(spec.adapters, target) + (1 + len(spec.adapters)) + 1
    progress = Progress(emit, should_cancel, total=total, target=task.label)

    progress("apply flags")
    apply_flags(target)
    remember_fbd_cuda_failure()  # else each BOFT layer retries PEFT's failing nvcc build (~1 s on a GPU)
    capture = Capture(
        target=str(target),
        environment=environment(target.device),
        check=own.name if own is not None else "",
        variant=variant,
    )
    started = time.time()
    config = load_config(spec.base)
    probe = probe_inputs(
        config, model_class(config, adapters_task_type(spec.adapters)), spec.probe, spec.seed, spec.base
    )
    ctx = CaptureContext(spec=spec, target=target, probe=probe, run_dir=run_dir)
    if own is not None:
        own.run(ctx, variant, progress, capture)
    else:
        capture.comparator = _comparator(spec, target, checks)
        # Checks that change the loaded model (merging) see it after the others have taken theirs.
        checks = sorted(checks, key=lambda c: c.mutates_model)
        for loaded in strategy.load(spec.base, spec.adapters, target, stage=progress):
            progress("capture " + ("base" if loaded.adapter is None else loaded.adapter.name))
            if loaded.refused is not None:  # each check's comparison says so (`refused_rows`)
                capture.meta.setdefault(REFUSED, {})[loaded.adapter.name] = loaded.refused
                capture.notes.append(loaded.refused)
                continue
            for check in checks:
                try:
                    check.capture(ctx, loaded, capture)
                except Exception as e:
                    if isinstance(e, Cancelled) or not adapter_finding(target, loaded, e):
                        raise
                    # a PEFT or bitsandbytes layer that fails on a quantized base is a finding about that
                    # adapter there (QDoRA on int8 on the CPU: its second forward raises), not the run's end
                    error = f"{type(e).__name__}: {e} (raised in {_raised_in(e)})"
                    failed = capture.meta.setdefault(FAILED, {}).setdefault(check.name, {})
                    failed[loaded.adapter.name] = error
                    capture.notes.append(f"{loaded.adapter.name}: {check.name} failed: {error}")
            release_scratch()  # this model's references are read: the next model's load needs the room
            # how it was loaded, and the ops its forwards computed in float32 (a float64 reference's)
            fallbacks = [n for n in float32_fallback_notes(loaded.model) if n not in loaded.notes]
            notes = loaded.notes + fallbacks
            if notes:
                # per model (the bare base too) for the rows that need them, and as text for the run's notes
                name = BASE if loaded.adapter is None else loaded.adapter.name
                capture.meta.setdefault("load_notes", {})[name] = notes
                capture.notes.extend(f"{name}: {note}" for note in notes)
    capture.meta["timings"] = {"load_and_capture_s": round(time.time() - started, 3)}
    capture.meta["probe"] = {name: list(t.shape) for name, t in probe.items()}
    if "input_ids" in probe:
        capture.meta["input_ids"] = probe["input_ids"].tolist()
    progress("write capture")
    folder = run_dir / "captures" / capture_folder_name(target.slug, own.name if own else "", variant)
    if task.part and (folder / "capture.json").exists():
        capture.join(Capture.load(folder))  # an earlier pass's checks on this target: one capture
    capture.save(folder)


def _raised_in(e: BaseException) -> str:
    """Where `e` was raised: the innermost frame's file (from its package down) and line, so a row can say
    whether PEFT, bitsandbytes or WeightDrift raised it."""

    frame = traceback.extract_tb(e.__traceback__)[-1]
    parts = Path(frame.filename).parts
    cut = parts.index("site-packages") + 1 if "site-packages" in parts else max(len(parts) - 3, 0)
    return f"{'/'.join(parts[cut:])}:{frame.lineno}"


def _comparator(spec, target, checks) -> Callable:
    """`Capture.comparator` for the shared load loop: `compares_in_worker` checks measure each tensor now."""
    from core.checks.base import measure
    from core.models.checkpoint import keeps_tensors

    by_name = {c.name: c for c in checks if c.compares_in_worker}
    keep = keeps_tensors(spec)

    def compare(key, tensor, capture) -> bool | None:
        check = by_name.get(key.check)
        if check is None:
            return None
        measured = measure(check, spec, target, key, tensor)
        capture.results[key.encode()] = measured.as_dict()
        if measured.sketch is not None:
            capture.sketches[key.encode()] = measured.sketch
        return keep

    return compare


def run_compare(task: Task, emit: Emit, should_cancel: Callable[[], bool]) -> None:
    """Turn the run's captures into the metrics table (`metrics.parquet`) and the checks' own tables.

    A partial task (`task.checks`) compares those checks alone as soon as their captures are in,
    and writes their rows to `partial/<check>.parquet` and their own tables, for the pages to show
    while the run goes on; the final task takes those rows as they are and compares the rest.
    """
    import pandas as pd

    from core.capture import Capture, capture_folder_name
    from core.checks import get_checks
    from core.checks.base import add_note, refused_rows, timed_out_row
    from core.engine.store import (
        Store,
        metrics_table,
        read_reference_fallback,
        read_timed_out,
        reference_fallback_note,
    )
    from core.judgement import add_peer_columns
    from core.spec import ProbeSpec, Target

    run_dir = Path(task.run_dir)
    store = Store(run_dir.parent.parent)
    spec = ProbeSpec.from_dict(task.spec)
    done = {} if task.partial else {c: store.read_partial(run_dir.name, c) for c in spec.checks}
    checks = get_checks(task.checks or spec.checks)
    todo = [c for c in checks if done.get(c.name) is None]
    captures_dir = run_dir / "captures"
    shared = [c for c in checks if not c.own_worker]
    # the final task reads them for the pairwise table even when every check's rows are in
    loads_shared = bool(shared) and (
        any(not c.own_worker for c in todo) or (not task.partial and len(spec.targets) > 1)
    )
    lost = read_timed_out(run_dir)  # tasks killed at their time limit: (target, check, variant) -> finding
    lost_folders = {capture_folder_name(Target.parse(t).slug, c, v) for t, c, v in lost if v is not None}
    shared_captures = [
        Capture.load(captures_dir / t.slug)
        for t in (spec.targets if loads_shared else ())
        if (captures_dir / t.slug).exists() or not any((str(t), c.name, None) in lost for c in shared)
    ]
    by_check: dict[str, list[Capture]] = {}
    for check in todo:
        if not check.own_worker:
            by_check[check.name] = [c for c in shared_captures if (c.target, check.name, None) not in lost]
            continue
        by_check[check.name] = [
            Capture.load(folder)
            for t in spec.targets
            for folder in _own_folders(captures_dir, spec, check, t)
            if folder.name not in lost_folders
        ]
    total = sum(c.compare_steps(by_check[c.name]) for c in todo) + 1
    progress = Progress(emit, should_cancel, total=total, target=None)
    fallback = read_reference_fallback(run_dir)
    if fallback is not None:  # the reference did not run: another target stands in (the engine chose it)
        spec = replace(spec, reference=Target.parse(fallback["reference"]))
    ref_folder = captures_dir / spec.reference.slug
    needs_reference = any(c.needs_reference_target for c in todo)
    reference_capture = Capture.load(ref_folder) if needs_reference and ref_folder.exists() else None
    peers = {str(t): None if p is None else str(p) for t, p in spec.peer_map().items()}
    frames: list[pd.DataFrame] = []
    tables = {}
    for check in checks:
        if done.get(check.name) is not None:  # compared while the run went on; its tables are written
            frames.append(done[check.name])
            continue
        rows = check.compare(spec, by_check[check.name], reference_capture, progress)
        if not check.own_worker:
            rows.extend(refused_rows(check.name, by_check[check.name]))
        rows.extend(
            timed_out_row(check.name, t, v, finding) for (t, c, v), finding in lost.items() if c == check.name
        )
        tables.update(check.tables(spec, by_check[check.name], reference_capture))
        if fallback is not None:
            for row in rows:
                if row.get("reference") == fallback["reference"]:
                    add_note(row, reference_fallback_note(fallback))
        frame = metrics_table(rows)
        if check.judged and peers:  # a check's rows hold every target's: its peers' too
            frame = add_peer_columns(
                frame, peers, {check.name}, frozenset({check.name}) if check.loads_exactly else frozenset()
            )
        frames.append(frame)
    whole = [c for c in shared_captures if not any((c.target, s.name, None) in lost for s in shared)]
    if not task.partial and len(whole) > 1:  # every target against every other (core.engine.pairwise)
        from core.engine.pairwise import pairwise_table

        tables["pairwise"] = pairwise_table(spec, shared, whole)
    progress("write metrics")
    for name, table in tables.items():
        store.write_table(run_dir.name, name, table)
    if task.partial:
        for check, frame in zip(checks, frames, strict=True):
            store.write_partial(run_dir.name, check.name, frame)
        return
    store.write_metrics(run_dir.name, metrics_table(frames))
    store.drop_partials(run_dir.name)


def _own_folders(captures_dir: Path, spec, check, target) -> list[Path]:
    """The capture folders of an own-worker check on `target`: one per variant it runs here, or, for a
    target imported from a snapshot, those its machine ran (its variants may depend on its GPUs)."""
    from core.capture import capture_folder_name

    if target.machine is None:
        return [
            captures_dir / capture_folder_name(target.slug, check.name, v)
            for v in check.variants(spec, target)
        ]
    prefix = capture_folder_name(target.slug, check.name)
    found = [p for p in captures_dir.iterdir() if p.name == prefix or p.name.startswith(prefix + "-")]
    order = [capture_folder_name(target.slug, check.name, v) for v in check.variants(spec, target.local)]
    return sorted(found, key=lambda p: (order.index(p.name) if p.name in order else len(order), p.name))


def task_json(task: Task, log_path: str | None = None) -> str:
    """The message a worker reads on stdin: the task, and the log its output goes to."""
    fields = asdict(task)
    if log_path is not None:
        fields["log_path"] = log_path
    return json.dumps(fields)
