"""Jobs: background threads that drive worker processes, with progress and cancel.

A job is one run. Its driver thread runs its capture tasks (one per target and pass, plus the
cpu/float64 reference where a check needs it, `Captures`), then one compare task that writes the
metrics table. Which tasks run at once, in which order and which waits for which is the run's
`core.engine.schedule.Schedule`; work on one device is serialised by a lock per device that all jobs
share. Each group of checks is compared as soon as its captures are in (partial compares), so pages
fill while the run goes on. The runner (`core.engine.runners`) decides where a task runs.

Worker threads never touch a UI: the dashboard polls `Job.snapshot()` or the store.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from core.engine.runners import Outcome, ProcessRunner, Runner
from core.engine.schedule import CompareGroup, Schedule, capture_tasks, plan
from core.engine.store import Store, StoreError, write_reference_fallback, write_timed_out
from core.engine.tasks import Task
from core.spec import ProbeSpec, SpecError, Target, input_folders, next_best_reference


def task_time_limit(spec: ProbeSpec) -> float:
    """How long one task of the run may take, in seconds: `spec.task_timeout_s`, else 10 minutes plus 2
    per GiB of the base checkpoint (32 GiB where unknown) per check: far above what a task takes (the
    demo's: seconds; an 8B model's load and compare: minutes), so it ends a task that hangs, not a slow one."""
    from core.models.checkpoint import base_bytes

    if spec.task_timeout_s is not None:
        return spec.task_timeout_s
    gib = (base_bytes(spec) or 32 * 2**30) / 2**30
    return round(600 + 120 * gib * max(1, len(spec.checks)))


def log_path(job: Job, task: Task) -> Path:
    """Where `task`'s worker writes its stderr: `logs/<capture folder or compare>.log` in the run folder."""
    # core.capture imports torch: not when this module is imported (the CLI starts a worker first)
    from core.capture import capture_folder_name

    if task.target:
        folder = capture_folder_name(Target.parse(task.target).slug, task.own_check or "", task.variant or "")
        folder += f"-{'+'.join(task.checks)}" if task.part else ""
    else:
        folder = "compare" + (f"-{'+'.join(task.checks)}" if task.checks else "")
    return job.run_dir / "logs" / f"{folder}.log"


def fails_run(spec: ProbeSpec, task: Task, outcome: Outcome) -> bool:
    """Whether a capture task's outcome fails the run: not the reference's alone nor an `is_finding`."""
    harmless = outcome.ok or outcome.cancelled or reference_only(spec, task)
    return not harmless and not is_finding(spec, task, outcome)


def is_finding(spec: ProbeSpec, task: Task, outcome: Outcome) -> bool:
    """Whether `outcome` is a finding about `task`'s target, its rows `broken`, while the run goes on:
    a capture task killed at its time limit, but the reference's where other targets need it."""
    from core.checks import get_checks

    if not outcome.timed_out or task.kind != "capture" or task.target != str(spec.reference):
        return outcome.timed_out and task.kind == "capture"
    return not any(c.needs_reference_target for c in get_checks(task.checks))


def reference_only(spec: ProbeSpec, task: Task) -> bool:
    """Whether `task` captures only the reference (a target the user did not ask for)."""
    return task.variant is None and task.target == str(spec.reference) and spec.reference not in spec.targets


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


class TaskEvents:
    """What a runner calls with each event of one task: the first calls `on_start` (its worker is at
    work), a progress event updates the task's progress and joins the job's events."""

    def __init__(self, job: Job, label: str, progress: TaskProgress, on_start: Callable[[], None] | None):
        self.job, self.label, self.progress, self.on_start = job, label, progress, on_start
        self.started = threading.Event()
        self.start_done = threading.Event()  # `on_start` has returned

    def __call__(self, event: dict) -> None:
        if self.on_start is not None and not self.started.is_set():
            self.started.set()
            try:
                self.on_start()
            finally:
                self.start_done.set()
        if event.get("type") == "progress":
            job, progress = self.job, self.progress
            with job.lock:
                progress.stage, progress.step, progress.of = event["stage"], event["step"], event["of"]
                job.events.append({**event, "task": self.label, "time": time.time()})

    def settle(self, timeout_s: float = 60.0) -> None:
        """Wait for what the first event set going (`on_start`) to end. A runner may return while its
        reader of events still works (a killed worker's: `ProcessRunner.run` joins it for 5 s), and a
        worker made ready after its lane gave it up would wait for a task until the engine stops."""
        if self.started.is_set():
            self.start_done.wait(timeout_s)


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
        if any(t.machine is None for t in spec.targets):
            # a wrong path is said at once, not after the worker's imports (7 s here) that the rest needs
            input_folders(spec)
            if not runner.validate_inputs(spec):
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
        for task in capture_tasks(spec, str(job.run_dir)):
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
        on_event = TaskEvents(job, task.label, progress, on_start)
        with job.lock:
            progress.state, progress.started = "running", time.time()
        task = replace(task, timeout_s=job.time_limit_s)
        outcome = job.runner.run(task, on_event, job.cancel_event, log_path(job, task))
        on_event.settle()  # the next tasks' workers made ready, before the outcome is acted on
        with job.lock:
            progress.finished = time.time()
            progress.state = "succeeded" if outcome.ok else "cancelled" if outcome.cancelled else "failed"
            if outcome.timed_out:  # "timed out after N s in stage S": its rows' finding, or the run's end
                outcome.error = f"{outcome.error} in stage {progress.stage or 'start'!r}"
                if is_finding(job.spec, task, outcome):
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

    def _drive(self, job: Job) -> None:
        try:
            with job.lock:
                job.state, job.started = "running", time.time()
            self._persist(job)
            compare = Task(kind="compare", run_dir=str(job.run_dir), spec=job.spec.to_dict())
            schedule = plan(job.spec, str(job.run_dir), job.runner.concurrent, os.cpu_count() or 1)
            captures = Captures(self, job, schedule, compare)
            captures.run()
            ran, partial = captures.outcomes, captures.partial_outcomes
            outcomes = [o for _, o in ran] + partial
            failed = [o for t, o in ran if fails_run(job.spec, t, o)]
            failed += [o for o in partial if not o.ok and not o.cancelled]
            reference_failed = [
                o for t, o in ran if not (o.ok or o.cancelled) and reference_only(job.spec, t)
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


class Captures:
    """One job's capture tasks at work, as its `Schedule` says: a thread per lane, each task once those
    it waits for have ended, and each group's partial compare as soon as its captures are in while others
    still run (in a thread of its own; in the lane's, before its next task, on a runner of one task at
    a time). `run` returns once all have ended, their outcomes in `outcomes` (capture tasks) and
    `partial_outcomes`."""

    def __init__(self, engine: Engine, job: Job, schedule: Schedule, compare: Task):
        """`compare`: the run's final compare task, whose worker the last task of a lane gets ready."""
        self.engine, self.job, self.schedule, self.compare = engine, job, schedule, compare
        self.outcomes: list[tuple[Task, Outcome]] = []
        self.partial_outcomes: list[Outcome] = []
        self.ended: dict[str, threading.Event] = {t.label: threading.Event() for t in schedule.tasks}
        # a partial compare's end (run, or given up), which a task may wait for (`first_compare`)
        self.compared: dict[str, threading.Event] = {g.task.label: threading.Event() for g in schedule.groups}
        self.succeeded: set[str] = set()
        self.started: set[str] = set()  # the partial compares started (or given up), by label
        self.partial_threads: list[threading.Thread] = []
        self.lock = threading.Lock()  # guards `succeeded` and `started`

    def run(self) -> None:
        """Run every lane at once, and wait for them and for the partial compares they started."""
        job = self.job
        threads = [
            threading.Thread(target=self._lane, args=(d, ts), daemon=True, name=f"{job.run_id}-{d}")
            for d, ts in self.schedule.lanes.items()
            if ts
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for t in list(self.partial_threads):
            t.join()
        # a partial compare whose worker `_at_work` got ready and whose captures then failed never ran:
        # its process would wait for a task until the engine stops
        for group in self.schedule.groups:
            if group.task.label not in self.started:
                job.runner.discard(group.task)

    def _ready(self, group: CompareGroup, also: str | None = None) -> bool:
        return all(label in self.succeeded or label == also for label in group.needs)

    def _lane(self, device: str, tasks: list[Task]) -> None:
        """One lane's tasks in order, each under its device's lock once what it waits for has ended."""
        job, engine = self.job, self.engine
        for i, task in enumerate(tasks):
            for label in self.schedule.waits_for(task.label):
                event = self.ended.get(label) or self.compared[label]
                while not event.wait(0.1) and not job.cancel_event.is_set():
                    pass
            with engine._device_lock(device):
                if job.cancel_event.is_set():
                    with job.lock:
                        job.tasks[task.label].state = "cancelled"
                    self.outcomes.append((task, Outcome(ok=False, cancelled=True)))
                    self.ended[task.label].set()
                    continue
                # Once this task's worker is at work, the next one (or, after the last, the compare
                # task's) is started, so its imports overlap this task (a memory timeline's fresh
                # interpreter imports what its task would before its samples: `preimport_fresh`).
                following = tasks[i + 1] if i + 1 < len(tasks) else self.compare
                outcome = engine._run_task(
                    job, task, on_start=functools.partial(self._at_work, task, following)
                )
            self.outcomes.append((task, outcome))
            if outcome.ok:
                self._ended_ok(task)
            elif fails_run(job.spec, task, outcome):
                job.cancel_event.set()  # one failed target fails the job: stop the others early
            self.ended[task.label].set()
            if job.cancel_event.is_set():
                job.runner.discard(following)

    def _at_work(self, task: Task, following: Task) -> None:
        """`task` is at work: a partial compare that waits for it alone gets its worker ready (first: it
        brings a page its rows), then the task after it in its lane (`following`)."""
        job = self.job
        with self.lock:
            due = [
                g
                for g in self.schedule.groups
                if g.task.label not in self.started and task.label in g.needs and self._ready(g, task.label)
            ]
        for group in due:
            if not job.cancel_event.is_set():
                job.runner.prepare(group.task, log_path(job, group.task))
        if not job.cancel_event.is_set():
            job.runner.prepare(following, log_path(job, following))

    def _ended_ok(self, task: Task) -> None:
        """After a capture task succeeded: start the partial compares now due, each in a thread of its own
        (in this lane's thread, before its next task, on a runner of one task at a time), unless no
        capture task is left (the final compare then does their checks)."""
        job = self.job
        with self.lock:
            self.succeeded.add(task.label)
            left = any(not e.is_set() for label, e in self.ended.items() if label != task.label)
            due = [g for g in self.schedule.groups if g.task.label not in self.started and self._ready(g)]
            self.started.update(g.task.label for g in due)
        for group in due:
            if not left or job.cancel_event.is_set():
                job.runner.discard(group.task)
                self.compared[group.task.label].set()
                continue
            if not job.runner.concurrent:
                # a runner of one task at a time (in-process): the compare before this lane's next task,
                # so the first page's rows come before the reference's capture, not racing it
                self._partial(group.task)
                continue
            thread = threading.Thread(
                target=self._partial, args=(group.task,), daemon=True, name=f"{job.run_id}-{group.task.label}"
            )
            self.partial_threads.append(thread)
            thread.start()

    def _partial(self, task: Task) -> None:
        """One group's partial compare (its thread); its end is told to the tasks that wait for it."""
        try:
            self.partial_outcomes.append(self._run_partial(task))
        finally:
            self.compared[task.label].set()

    def _run_partial(self, task: Task) -> Outcome:
        """One group's partial compare; its checks join `job.compared` when it succeeds."""
        job = self.job
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
        outcome = self.engine._run_task(job, task)
        if outcome.ok:
            with job.lock:
                job.compared.extend(c for c in task.checks if c not in job.compared)
            job.rows_stored()
        elif not outcome.cancelled:
            job.cancel_event.set()  # a compare that fails now would fail at the end too: stop early
        return outcome
