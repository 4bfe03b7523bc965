"""Jobs: background threads that drive worker processes, with progress and cancel.

A job is one run. Its driver thread starts one capture task per target (plus the cpu/float64
reference where a check needs it), then one compare task that writes the metrics table.
Targets on different devices run in parallel; work on one device is serialised by a lock per
device that all jobs share. A small base's checks are captured in passes, and each group of checks
is compared as soon as its captures are in (`capture_passes`, partial compares), so pages fill
while the run goes on. The runner (`core.engine.runners`) decides where a task runs.

Worker threads never touch a UI: the dashboard polls `Job.snapshot()` or the store.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from core.engine.runners import Outcome, ProcessRunner, Runner
from core.engine.store import Store, StoreError, write_reference_fallback, write_timed_out
from core.engine.tasks import BACKGROUND_NICENESS, Task
from core.spec import ProbeSpec, SpecError, Target, next_best_reference


def capture_passes(spec: ProbeSpec, checks: list) -> list[tuple[str, ...]]:
    """The shared load loop's checks, per pass over the loaded models (each pass a worker per target).

    A small base (up to CAPTURE_PASSES_UP_TO) is loaded twice: first for the checks compared against
    the checkpoint files (no forward pass, no reference target), whose rows come first, then for the
    others. A larger one is loaded once, for all of them.
    """
    shared = [c for c in checks if not c.own_worker]
    first = tuple(c.name for c in shared if not c.needs_reference_target)
    rest = tuple(c.name for c in shared if c.needs_reference_target)
    if not first or not rest:
        return [first or rest] if shared else []
    return [first, rest] if small_base(spec) else [first + rest]


def small_base(spec: ProbeSpec) -> bool:
    """Whether the run's base checkpoint holds at most CAPTURE_PASSES_UP_TO bytes (unknown: large)."""
    from core.models.checkpoint import base_bytes
    from core.spec import CAPTURE_PASSES_UP_TO

    size = base_bytes(spec)
    return size is not None and size <= CAPTURE_PASSES_UP_TO


def task_time_limit(spec: ProbeSpec) -> float:
    """How long one task of the run may take, in seconds: `spec.task_timeout_s`, else 10 minutes plus 2
    per GiB of the base checkpoint (32 GiB where unknown) per check: far above what a task takes (the
    demo's: seconds; an 8B model's load and compare: minutes), so it ends a task that hangs, not a slow one."""
    from core.models.checkpoint import base_bytes

    if spec.task_timeout_s is not None:
        return spec.task_timeout_s
    gib = (base_bytes(spec) or 32 * 2**30) / 2**30
    return round(600 + 120 * gib * max(1, len(spec.checks)))


def task_lanes(
    tasks: list[Task], spec: ProbeSpec, small: bool, cpus: int, first_compare: str | None = None
) -> tuple[dict[str, list[Task]], dict[str, list[str]]]:
    """The capture tasks by lane (each lane's in order, the lanes at once), and the labels a task waits
    for before it starts beyond its lane's order (docs/workers.md, "Which tasks run at once").

    A lane is a device (cuda:0 of two Ray nodes are two devices): one model in its memory at a time. A
    small model's (`small`) CPU tasks: a lane per target (its first pass, its own-worker tasks once the
    first pass's compare `first_compare` is in, its later passes), the reference's task after the first
    pass, the memory timelines in `cpus` lanes of their own after the first pass and its compare; all
    but the first pass's at `BACKGROUND_NICENESS` (`Task.niceness`): the first page gets the CPU first.
    """
    lanes: dict[str, list[Task]] = {}
    after: dict[str, list[str]] = {}
    first_pass = [t.label for t in tasks if t.variant is None and t.part and t.checks == tasks[0].checks]
    fresh = 0
    target_lanes: set[str] = set()  # a small model's lanes of one target each, on the CPU
    for task in tasks:
        target = Target.parse(task.target)
        lane = target.device if target.node is None else f"{target.node}/{target.device}"
        if small and target.node is None and target.device == "cpu":
            if task.fresh_process:
                lane, fresh = f"cpu · fresh {fresh % cpus}", fresh + 1
                if fresh <= cpus and first_pass:  # a lane's first: the others follow it
                    after[task.label] = first_pass + ([first_compare] if first_compare else [])
            else:
                lane = f"cpu · {task.target}"
                target_lanes.add(lane)
                if task.target == str(spec.reference) and spec.reference not in spec.targets:
                    after[task.label] = first_pass
                if first_pass and task.label not in first_pass:
                    task = replace(task, niceness=BACKGROUND_NICENESS)
                if first_compare and task.variant is not None:
                    after[task.label] = [first_compare]
        lanes.setdefault(lane, []).append(task)
    for lane in target_lanes:
        lanes[lane].sort(key=lambda t: 0 if t.label in first_pass else 1 if t.variant is not None else 2)
    return lanes, after


@dataclass
class _Group:
    """Checks compared together before the run ends, once every capture task they read has succeeded."""

    needs: frozenset[str]  # labels of those capture tasks
    task: Task  # the partial compare task (`Task.partial`)
    started: bool = False


@dataclass
class TaskProgress:
    """What the UI shows for one target (or the compare step)."""

    name: str
    state: str = "queued"
    stage: str = ""
    step: int = 0
    of: int = 0
    started: float | None = None
    finished: float | None = None
    error: str | None = None

    @property
    def elapsed_s(self) -> float | None:
        if self.started is None:
            return None
        return (self.finished or time.time()) - self.started


@dataclass
class Job:
    """One run being executed: its state, per-target progress and a cancel switch."""

    run_id: str
    run_dir: Path
    spec: ProbeSpec
    state: str = "queued"
    error: str | None = None
    created: float = field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    tasks: dict[str, TaskProgress] = field(default_factory=dict)
    # every progress event in order, so a watcher polling now and then misses no stage
    events: list[dict[str, Any]] = field(default_factory=list)
    cancel_event: threading.Event = field(default_factory=threading.Event)
    done_event: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancel_reason: str = "cancelled by the user"
    # why run.json could not be written (disk full, read-only home); the job's own state stays right
    store_error: str | None = None
    # what runs its tasks: the engine's runner, or the one its submitter chose (the dashboard's Ray choice)
    runner: Runner | None = field(default=None, repr=False)
    # the checks whose rows are stored while the run goes on (`partial/<check>.parquet`), in order
    compared: list[str] = field(default_factory=list)
    time_limit_s: float | None = None  # of each task (`task_time_limit`)
    # called (on the engine's threads) when checks' rows are stored and when the job ends: `on_rows`
    _on_rows: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def on_rows(self, callback: Callable[[], None]) -> None:
        """Call `callback()` whenever more of this job's rows are stored (a partial compare) and once it
        has ended, from the engine's thread: a page drawing the rows can redraw at once instead of at
        its next look. A callback's error is ignored: it must not stop the job."""
        with self.lock:
            self._on_rows.append(callback)

    def rows_stored(self) -> None:
        """Tell the `on_rows` callbacks."""
        with self.lock:
            callbacks = list(self._on_rows)
        for callback in callbacks:
            with contextlib.suppress(Exception):
                callback()

    def cancel(self, reason: str | None = None) -> None:
        """Ask every worker of this job to stop at its next stage boundary (`reason` is stored)."""
        if reason is not None and not self.cancel_event.is_set():
            self.cancel_reason = reason
        self.cancel_event.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job has ended; True if it did within `timeout`."""
        return self.done_event.wait(timeout)

    def events_since(self, index: int) -> list[dict[str, Any]]:
        """Progress events from position `index` on (for watchers that poll)."""
        with self.lock:
            return self.events[index:]

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy of the job's state, safe to read from another thread."""
        with self.lock:
            return {
                "run_id": self.run_id,
                "run_dir": str(self.run_dir),
                "state": self.state,
                "error": self.error,
                "store_error": self.store_error,
                "created": self.created,
                "started": self.started,
                "finished": self.finished,
                "tasks": {k: {**asdict(v), "elapsed_s": v.elapsed_s} for k, v in self.tasks.items()},
                "compared": list(self.compared),
            }


class Engine:
    """Accepts specs, runs them as jobs in background threads, keeps them in the store."""

    def __init__(
        self,
        home: Path,
        runner: Runner | None = None,
        devices: list | None = None,
        warm: bool = False,
        fresh: int = 0,
    ):
        """`warm`: the runner gets ready for the next job now and again after each job ends (the process
        runner's fork server), so that a run's first target starts without waiting for its imports;
        `fresh`: with that many spare interpreters for memory timelines (`FRESH_SPARES`)."""
        from core.models.targets import discover_devices

        self.store = Store(home)
        self.store.sweep()  # what killed processes left behind
        self.runner = runner or ProcessRunner()
        self.warm, self.fresh = warm, fresh
        if warm:
            self.runner.warm(fresh)
        if devices is None:
            devices = self.runner.devices()  # a runner of other machines knows theirs (ray_runner)
        self.devices = devices if devices is not None else discover_devices()
        self._device_locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._jobs: dict[str, Job] = {}

    def validate(self, spec: ProbeSpec, runner: Runner | None = None) -> None:
        """Refuse what cannot run: unknown checks or strategy, targets on devices that do not exist, bad inputs.

        `runner`: the runner the spec would run with, when not the engine's (its devices count then)."""
        from core.checks import get_checks
        from core.models.loading import STRATEGIES
        from core.models.targets import check_targets_exist

        if not spec.targets:
            raise SpecError("no target given; e.g. --target cpu/float32")
        if not spec.checks:
            raise SpecError("no check given")
        if spec.task_timeout_s is not None and not spec.task_timeout_s > 0:
            raise SpecError(f"task timeout {spec.task_timeout_s:g} s: give a number of seconds above 0")
        get_checks(spec.checks)
        unknown = [s for s in spec.strategies if s not in STRATEGIES]
        if unknown or not spec.strategies:
            raise SpecError(
                f"unknown load strategy {', '.join(map(repr, unknown)) or '(none given)'}; "
                f"available: {', '.join(STRATEGIES)}"
            )
        # Targets imported from snapshots (`Target.machine`) ran elsewhere: only local ones must exist here,
        # and a comparison of snapshots alone loads nothing, so it needs no model files here.
        local = [t for t in (*spec.targets, spec.reference) if t.machine is None]
        runner = runner or self.runner
        devices = runner.devices() if runner is not self.runner else None
        check_targets_exist(local, devices if devices is not None else self.devices)
        placed = next((t for t in local if t.node is not None), None)
        if placed is not None and not runner.places_nodes:
            raise SpecError(
                f"target {placed} names node {placed.node}: only the Ray runner places targets on nodes "
                "(--runner ray); the local runner runs every target on this machine"
            )
        if any(t.machine is None for t in spec.targets) and not runner.validate_inputs(spec):
            from core.models.validate import validate_inputs

            validate_inputs(spec)

    def submit(
        self, spec: ProbeSpec, install: Callable[[Path], None] | None = None, runner: Runner | None = None
    ) -> Job:
        """Validate, store and start a run (its spec `spec.with_peers()`, listing the peers it added);
        returns its Job at once. `runner` runs its tasks instead of the engine's own (the user's Ray
        runner). `install` puts captures made elsewhere (snapshots) into the new run folder before the
        job starts; if it fails, the run is stored as failed with the reason and the error is raised."""
        spec = spec.with_peers()  # a peer the run lacks is captured like the reference
        self.validate(spec, runner)
        if install is None and any(t.machine for t in spec.targets):
            named = next(t for t in spec.targets if t.machine)
            raise SpecError(
                f"target {named} names machine {named.machine}: a target of another machine comes from its "
                "snapshot (python -m core compare FILE…); targets run here are DEVICE/DTYPE[+FLAG…]"
            )
        record = self.store.create_run(spec)
        if install is not None:
            try:
                install(record.run_dir)
            except Exception as e:
                now = time.time()
                with contextlib.suppress(StoreError):
                    self.store.update(
                        record.run_id,
                        status="failed",
                        error=str(e),
                        started=now,
                        finished=now,
                        duration_s=0.0,
                    )
                self.store.release(record.run_id)
                raise
        job = Job(record.run_id, record.run_dir, spec, runner=runner or self.runner)
        job.time_limit_s = task_time_limit(spec)
        for task in self._capture_tasks(job):
            job.tasks[task.label] = TaskProgress(name=task.label)
        job.tasks["compare"] = TaskProgress(name="compare")  # a partial compare's is added when it starts
        self._jobs[job.run_id] = job
        threading.Thread(target=self._drive, args=(job,), daemon=True, name=f"job-{job.run_id}").start()
        return job

    def job(self, run_id: str) -> Job | None:
        return self._jobs.get(run_id)

    def jobs(self) -> list[Job]:
        """Jobs started by this engine, newest first."""
        return sorted(self._jobs.values(), key=lambda j: j.created, reverse=True)

    def _capture_tasks(self, job: Job) -> list[Task]:
        """Every capture task of the job, in the order each device runs them: the shared load loop's
        passes (`capture_passes`), each with the reference first where its checks need it, then the
        own-worker checks' tasks."""
        from core.checks import get_checks

        spec = job.spec
        checks = get_checks(spec.checks)

        def task(target: Target, names: tuple[str, ...], variant: str | None = None, part=False) -> Task:
            return Task(
                kind="capture",
                run_dir=str(job.run_dir),
                spec=spec.to_dict(),
                target=str(target),
                checks=names,
                variant=variant,
                part=part,
            )

        by_name = {c.name: c for c in checks}
        passes = capture_passes(spec, checks)
        # a target imported from a snapshot has its captures in the run folder already
        local = [t for t in spec.targets if t.machine is None]
        tasks: list[Task] = []
        for names in passes:
            part = len(passes) > 1
            ref_names = tuple(n for n in names if by_name[n].needs_reference_target)
            ordered = sorted(local, key=lambda t: t != spec.reference)  # the reference first
            if ref_names and spec.reference not in spec.targets and spec.reference.machine is None:
                # the reference (not a target) has one pass only, the one whose checks need it: its
                # label stays `cpu/float64`
                tasks.append(task(spec.reference, ref_names))
            tasks += [task(t, names, part=part) for t in ordered]
        # Checks that load models their own way get a fresh worker per target and variant.
        tasks += [
            task(t, (c.name,), v) for c in checks if c.own_worker for t in local for v in c.variants(spec, t)
        ]
        return tasks

    def _compare_groups(self, job: Job, tasks: list[Task]) -> list[_Group]:
        """The run's checks grouped by the capture tasks their rows need (the reference's too), each
        group compared as soon as those have succeeded."""
        spec = job.spec
        needs = {c: frozenset(t.label for t in tasks if c in t.checks) for c in spec.checks}
        groups: dict[frozenset[str], list[str]] = {}
        for name, labels in needs.items():
            groups.setdefault(labels, []).append(name)
        return [
            _Group(
                needs=labels,
                task=Task(kind="compare", run_dir=str(job.run_dir), spec=spec.to_dict(), checks=tuple(names)),
            )
            for labels, names in groups.items()
            if labels  # imported from snapshots only: nothing to wait for, the final compare has it
        ]

    def _device_lock(self, device: str) -> threading.Lock:
        with self._locks_guard:
            return self._device_locks.setdefault(device, threading.Lock())

    def shutdown(self, reason: str, timeout: float = 15.0) -> None:
        """Cancel every active job with `reason`, wait for them to end (each marked cancelled), then
        kill any worker still alive: no worker outlives this process."""
        active = [j for j in self._jobs.values() if not j.done_event.is_set()]
        for job in active:
            job.cancel(reason)
        deadline = time.monotonic() + timeout
        for job in active:
            job.wait(max(0.0, deadline - time.monotonic()))
        runners = [self.runner] + [j.runner for j in self._jobs.values() if j.runner is not None]
        for runner in {id(r): r for r in runners}.values():  # each once: a job may bring its own
            runner.kill_all()

    def _persist(self, job: Job) -> None:
        """Write the job's state to run.json; a failed write is kept on the job (it ends failed), never raised."""
        snap = job.snapshot()
        try:
            self._write_state(job, snap)
        except StoreError as e:
            with job.lock:
                job.store_error = job.store_error or str(e)
            job.cancel_event.set()  # nothing it computes could be kept: stop its workers early

    def _write_state(self, job: Job, snap: dict[str, Any]) -> None:
        self.store.update(
            job.run_id,
            status=snap["state"],
            error=snap["error"],
            started=snap["started"],
            finished=snap["finished"],
            duration_s=None if not snap["finished"] else round(snap["finished"] - snap["started"], 3),
            workers=job.runner.workers_path,  # how its task processes were made (`runners.worker_path`)
            targets={
                k: {kk: vv for kk, vv in v.items() if kk != "elapsed_s"} for k, v in snap["tasks"].items()
            },
        )

    def _run_task(self, job: Job, task: Task, on_start: Callable[[], None] | None = None) -> Outcome:
        progress = job.tasks[task.label]
        started = threading.Event()

        def on_event(event: dict) -> None:
            if on_start is not None and not started.is_set():
                started.set()
                on_start()
            if event.get("type") == "progress":
                with job.lock:
                    progress.stage, progress.step, progress.of = event["stage"], event["step"], event["of"]
                    job.events.append({**event, "task": task.label, "time": time.time()})

        with job.lock:
            progress.state, progress.started = "running", time.time()
        task = replace(task, timeout_s=job.time_limit_s)
        outcome = job.runner.run(task, on_event, job.cancel_event, self._log_path(job, task))
        with job.lock:
            progress.finished = time.time()
            progress.state = "succeeded" if outcome.ok else "cancelled" if outcome.cancelled else "failed"
            if outcome.timed_out:  # "timed out after N s in stage S": its rows' finding, or the run's end
                outcome.error = f"{outcome.error} in stage {progress.stage or 'start'!r}"
                if self._finding(job, task, outcome):
                    write_timed_out(job.run_dir, task.target or "", task.checks, task.variant, outcome.error)
            if outcome.error is not None:
                # one place words every failure: which task, what, and where it stopped
                where = f"stage {progress.stage or 'start'!r}, step {progress.step} of {progress.of}"
                outcome.error = f"{task.label}: {outcome.error}" + (
                    "" if outcome.timed_out else f" ({where})"
                )
                if outcome.stderr_tail:
                    outcome.error += f"; stderr tail:\n{outcome.stderr_tail}"
            progress.error = outcome.error
        self._persist(job)
        return outcome

    @staticmethod
    def _log_path(job: Job, task: Task) -> Path:
        # core.capture imports torch: not when this module is imported (the CLI starts a worker first)
        from core.capture import capture_folder_name

        if task.target:
            folder = capture_folder_name(
                Target.parse(task.target).slug, task.own_check or "", task.variant or ""
            )
            folder += f"-{'+'.join(task.checks)}" if task.part else ""
        else:
            folder = "compare" + (f"-{'+'.join(task.checks)}" if task.checks else "")
        return job.run_dir / "logs" / f"{folder}.log"

    def _drive(self, job: Job) -> None:
        try:
            with job.lock:
                job.state, job.started = "running", time.time()
            self._persist(job)
            compare = Task(kind="compare", run_dir=str(job.run_dir), spec=job.spec.to_dict())
            ran, partial = self._run_captures(job, compare)
            outcomes = [o for _, o in ran] + partial
            failed = [o for t, o in ran if self._fails_run(job, t, o)]
            failed += [o for o in partial if not o.ok and not o.cancelled]
            reference_failed = [
                o for t, o in ran if not (o.ok or o.cancelled) and self._reference_only(job, t)
            ]
            if reference_failed and not failed:
                # the other targets' captures stand: compare them against the next-best reference
                stand_in = next_best_reference(job.spec)
                if stand_in is None:  # only quantized targets: none can stand in for the reference
                    failed = reference_failed
                else:
                    write_reference_fallback(
                        job.run_dir, str(stand_in), str(job.spec.reference), reference_failed[0].error or ""
                    )
            if failed:
                job.runner.discard(compare)
                self._finish(job, "failed", failed[0].error)
                return
            if job.cancel_event.is_set() or any(o.cancelled for o in outcomes):
                job.runner.discard(compare)
                self._finish(job, "cancelled", job.cancel_reason)
                return
            outcome = self._run_task(job, compare)
            if outcome.ok or outcome.cancelled:
                self._finish(job, *(("succeeded", None) if outcome.ok else ("cancelled", job.cancel_reason)))
            else:
                self._finish(job, "failed", outcome.error)
        except Exception as e:  # the engine must outlive any job
            self._finish(job, "failed", f"engine error: {type(e).__name__}: {e}")

    def _fails_run(self, job: Job, task: Task, outcome: Outcome) -> bool:
        """Whether a capture task's outcome fails the run: not the reference's alone nor a `_finding`."""
        harmless = outcome.ok or outcome.cancelled or self._reference_only(job, task)
        return not harmless and not self._finding(job, task, outcome)

    @staticmethod
    def _finding(job: Job, task: Task, outcome: Outcome) -> bool:
        """Whether `outcome` is a finding about `task`'s target, its rows `broken`, while the run goes on:
        a capture task killed at its time limit, but the reference's where other targets need it."""
        from core.checks import get_checks

        if not outcome.timed_out or task.kind != "capture" or task.target != str(job.spec.reference):
            return outcome.timed_out and task.kind == "capture"
        return not any(c.needs_reference_target for c in get_checks(task.checks))

    @staticmethod
    def _reference_only(job: Job, task: Task) -> bool:
        """Whether `task` captures only the reference (a target the user did not ask for)."""
        spec = job.spec
        return (
            task.variant is None and task.target == str(spec.reference) and spec.reference not in spec.targets
        )

    def _run_captures(self, job: Job, compare: Task) -> tuple[list[tuple[Task, Outcome]], list[Outcome]]:
        """Run every capture task, each device's in order and the devices in parallel, and each group
        of checks' partial compare as soon as its captures are in while others still run; returns the
        capture tasks' outcomes and the partial compares'."""
        from core.checks import get_checks

        tasks = self._capture_tasks(job)
        groups = self._compare_groups(job, tasks)
        reference = str(job.spec.reference)
        small = job.runner.concurrent and small_base(job.spec)
        first_compare = None
        if small and tasks and tasks[0].part:  # as the tasks: the first page's compare first
            for group in groups:
                if set(group.task.checks) == set(tasks[0].checks):
                    first_compare = group.task.label
                else:
                    group.task = replace(group.task, niceness=BACKGROUND_NICENESS)
        by_device, after = task_lanes(tasks, job.spec, small, os.cpu_count() or 1, first_compare)
        outcomes: list[tuple[Task, Outcome]] = []
        ended: dict[str, threading.Event] = {t.label: threading.Event() for t in tasks}
        # a partial compare's end (run, or given up), which a task may wait for (`first_compare`)
        compared: dict[str, threading.Event] = {g.task.label: threading.Event() for g in groups}
        succeeded: set[str] = set()
        partial_outcomes: list[Outcome] = []
        partial_threads: list[threading.Thread] = []
        groups_lock = threading.Lock()
        first_checks = {c.name for c in get_checks(job.spec.checks) if c.reference_first}

        def waits_for(task: Task) -> list[str]:
            """What `task_lanes` says `task` waits for, and the reference's task with a check whose targets
            read the reference's capture while they capture (activations)."""
            wanted = first_checks.intersection(task.checks)
            if not wanted or task.target == reference:
                return after.get(task.label, [])
            return after.get(task.label, []) + [
                t.label for t in tasks if t.target == reference and wanted.intersection(t.checks)
            ]

        def ready(group: _Group, also: str | None = None) -> bool:
            return all(label in succeeded or label == also for label in group.needs)

        def starting(task: Task) -> None:
            """`task` is at work: a partial compare that waits for it alone gets its worker ready."""
            with groups_lock:
                due = [g for g in groups if not g.started and task.label in g.needs and ready(g, task.label)]
            for group in due:
                if not job.cancel_event.is_set():
                    job.runner.prepare(group.task, self._log_path(job, group.task))

        def ended_ok(task: Task) -> None:
            """After a capture task succeeded: start the partial compares now due, unless no capture
            task is left (the final compare then does their checks)."""
            with groups_lock:
                succeeded.add(task.label)
                left = any(not e.is_set() for label, e in ended.items() if label != task.label)
                due = [g for g in groups if not g.started and ready(g)]
                for group in due:
                    group.started = True
            for group in due:
                if not left or job.cancel_event.is_set():
                    job.runner.discard(group.task)
                    compared[group.task.label].set()
                    continue

                def partial(g=group) -> None:
                    try:
                        partial_outcomes.append(self._run_partial(job, g.task))
                    finally:
                        compared[g.task.label].set()

                thread = threading.Thread(
                    target=partial,
                    daemon=True,
                    name=f"{job.run_id}-{group.task.label}",
                )
                partial_threads.append(thread)
                thread.start()

        def device_queue(device: str, tasks: list[Task]) -> None:
            for i, task in enumerate(tasks):
                for label in waits_for(task):
                    event = ended.get(label) or compared[label]
                    while not event.wait(0.1) and not job.cancel_event.is_set():
                        pass
                with self._device_lock(device):
                    if job.cancel_event.is_set():
                        with job.lock:
                            job.tasks[task.label].state = "cancelled"
                        outcomes.append((task, Outcome(ok=False, cancelled=True)))
                        ended[task.label].set()
                        continue
                    # Once this task's worker is at work, the next one (or, after the last, the compare
                    # task's) is started, so its imports overlap this task (a memory timeline's fresh
                    # interpreter imports what its task would before its samples: `preimport_fresh`).
                    following = tasks[i + 1] if i + 1 < len(tasks) else compare

                    def prepare(task=task, following=following) -> None:
                        starting(task)  # first: a partial compare due now brings a page its rows
                        if not job.cancel_event.is_set():
                            job.runner.prepare(following, self._log_path(job, following))

                    outcome = self._run_task(job, task, on_start=prepare)
                outcomes.append((task, outcome))
                if outcome.ok:
                    ended_ok(task)
                elif self._fails_run(job, task, outcome):
                    job.cancel_event.set()  # one failed target fails the job: stop the others early
                ended[task.label].set()
                if job.cancel_event.is_set():
                    job.runner.discard(following)

        threads = [
            threading.Thread(target=device_queue, args=(d, ts), daemon=True, name=f"{job.run_id}-{d}")
            for d, ts in by_device.items()
            if ts
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for t in list(partial_threads):
            t.join()
        return outcomes, partial_outcomes

    def _run_partial(self, job: Job, task: Task) -> Outcome:
        """One group's partial compare; its checks join `job.compared` when it succeeds."""
        with job.lock:
            final = job.tasks.pop("compare", None)
            job.tasks[task.label] = TaskProgress(name=task.label)
            if final is not None:
                job.tasks["compare"] = final  # listed last, as it runs last
        if job.cancel_event.is_set():
            job.runner.discard(task)
            with job.lock:
                job.tasks[task.label].state = "cancelled"
            return Outcome(ok=False, cancelled=True)
        outcome = self._run_task(job, task)
        if outcome.ok:
            with job.lock:
                job.compared.extend(c for c in task.checks if c not in job.compared)
            job.rows_stored()
        elif not outcome.cancelled:
            job.cancel_event.set()  # a compare that fails now would fail at the end too: stop early
        return outcome

    def _finish(self, job: Job, state: str, error: str | None) -> None:
        with job.lock:
            if job.store_error is not None:
                # a run whose record could not be kept is no result, whatever its workers did
                state, error = "failed", job.store_error
            job.state, job.error, job.finished = state, error, time.time()
            if job.started is None:
                job.started = job.finished
            for progress in job.tasks.values():
                if progress.state in ("queued", "running"):
                    progress.state = "cancelled"
        try:
            self._persist(job)
        finally:
            self.store.release(job.run_id)
            others = [j for j in self._jobs.values() if j is not job and not j.done_event.is_set()]
            if self.warm and not others:
                with contextlib.suppress(OSError):  # not ready is no error: the next run starts its own
                    self.runner.warm(self.fresh)  # a fork server that stopped starts again, for the next job
            job.done_event.set()
            job.rows_stored()
