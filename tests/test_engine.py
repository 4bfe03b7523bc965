"""The engine: scheduling per device, cancel, crashed workers, refused targets."""

import contextlib
import os
import signal
import threading
import time

import psutil
import pytest

from core.engine.jobs import Engine
from core.engine.runners import InProcessRunner, Outcome, ProcessRunner, Runner
from core.engine.worker import FORK_SERVER_ARG, FORKED_NAME
from core.models.targets import Device
from core.spec import AdapterRef, ModelRef, ProbeSpec, SpecError, Target

FAKE_DEVICES = [
    Device("cpu", "cpu", "fake cpu"),
    Device("cuda:0", "cuda", "fake gpu"),
    Device("cuda:1", "cuda", "fake"),
]


class RecordingRunner(Runner):
    """Sleeps instead of working and records when each task ran."""

    def __init__(self, seconds=0.4):
        self.seconds = seconds
        self.spans = {}
        self.lock = threading.Lock()

    def run(self, task, on_event, cancel, log_path):
        start = time.monotonic()
        on_event({"type": "progress", "stage": "sleep", "step": 1, "of": 1})
        while time.monotonic() - start < self.seconds:
            if cancel.is_set():
                return Outcome(ok=False, cancelled=True)
            time.sleep(0.01)
        with self.lock:
            self.spans[task.label] = (start, time.monotonic())
        return Outcome(ok=True)


def _spec(base, targets, checks=("weights",), adapters=()):
    return ProbeSpec(
        base=ModelRef(base),
        adapters=tuple(adapters),
        targets=tuple(map(Target.parse, targets)),
        checks=checks,
    )


def _overlap(a, b):
    return a[0] < b[1] and b[0] < a[1]


@pytest.mark.parametrize("small", [False, True])
def test_devices_run_in_parallel_and_one_device_is_serialised(tmp_path, demo_workspace, monkeypatch, small):
    """Devices run at once; a device's targets one after the other, but a small model's CPU targets, each
    in a process of its own, at once."""
    monkeypatch.setattr("core.engine.schedule.small_base", lambda spec: small)
    runner = RecordingRunner()
    engine = Engine(tmp_path, runner=runner, devices=FAKE_DEVICES)
    base = demo_workspace["models"]["tiny-llama"]
    job = engine.submit(_spec(base, ["cpu/float32", "cpu/bfloat16", "cuda:0/float32", "cuda:0/bfloat16"]))
    assert job.wait(20)
    s = runner.spans
    assert _overlap(s["cuda:0/float32"], s["cpu/float32"]) or _overlap(s["cuda:0/float32"], s["cpu/bfloat16"])
    assert not _overlap(s["cuda:0/float32"], s["cuda:0/bfloat16"])  # a GPU's targets: always in turn
    assert _overlap(s["cpu/float32"], s["cpu/bfloat16"]) == small
    # compare starts after every capture ended
    assert s["compare"][0] >= max(v[1] for k, v in s.items() if k != "compare")


def test_a_small_models_lanes(demo_workspace):
    """Per target on the CPU, the reference after the first pass, a target's own-worker tasks between its
    first pass and the passes that wait for the reference, memory timelines in lanes of their own (each
    lane's first after the first pass too);
    on a GPU, one lane; not small: one lane per device."""
    from core.engine.schedule import task_lanes
    from core.engine.tasks import Task

    spec = _spec(demo_workspace["models"]["tiny-llama"], ["cpu/float32", "cpu/bfloat16"])

    def task(target, checks, variant=None, part=False):
        return Task(
            kind="capture", run_dir="x", spec={}, target=target, checks=checks, variant=variant, part=part
        )

    tasks = [
        task("cpu/float32", ("weights",), part=True),
        task("cpu/bfloat16", ("weights",), part=True),
        task("cpu/float64", ("outputs",)),
        task("cpu/float32", ("outputs",), part=True),
        task("cpu/bfloat16", ("outputs",), part=True),
        *(task(t, ("memory",), v) for t in ("cpu/float32", "cpu/bfloat16") for v in ("a", "b")),
        task("cpu/float32", ("adapters",), "isolated"),
    ]
    lanes, after = task_lanes(tasks, spec, small=True, cpus=2, first_compare="compare · weights")
    assert {lane: [t.label for t in ts] for lane, ts in lanes.items()} == {
        "cpu · cpu/float32": [
            "cpu/float32 · weights",
            "cpu/float32 · adapters:isolated",
            "cpu/float32 · outputs",
        ],
        "cpu · cpu/bfloat16": ["cpu/bfloat16 · weights", "cpu/bfloat16 · outputs"],
        "cpu · cpu/float64": ["cpu/float64"],
        "cpu · fresh 0": ["cpu/float32 · memory:a", "cpu/bfloat16 · memory:a"],
        "cpu · fresh 1": ["cpu/float32 · memory:b", "cpu/bfloat16 · memory:b"],
    }
    first = ["cpu/float32 · weights", "cpu/bfloat16 · weights"]
    # the first page's captures first; the rest in the background (memory timelines: their runner's)
    niceness = {t.label: t.niceness for ts in lanes.values() for t in ts}
    assert niceness == {
        **{label: 0 for label in first},
        **{label: 0 for label in niceness if "memory" in label},
        **{label: 5 for label in niceness if label not in first and "memory" not in label},
    }
    # the reference waits for the first pass, each memory lane's first timeline and a target's own-worker
    # tasks for its compare too (the first page's rows)
    assert after == {
        "cpu/float64": first,
        "cpu/float32 · memory:a": [*first, "compare · weights"],
        "cpu/float32 · memory:b": [*first, "compare · weights"],
        "cpu/float32 · adapters:isolated": ["compare · weights"],
    }
    lanes, after = task_lanes(tasks, spec, small=False, cpus=2)
    assert list(lanes) == ["cpu"] and lanes["cpu"] == tasks and after == {}


def test_missing_device_is_refused(tmp_path, demo_workspace):
    engine = Engine(tmp_path, runner=RecordingRunner(), devices=[Device("cpu", "cpu", "x")])
    with pytest.raises(SpecError, match=r"cuda:1 does not exist on this machine; available: cpu"):
        engine.submit(_spec(demo_workspace["models"]["tiny-llama"], ["cuda:1/float32"]))
    assert engine.store.list_runs() == []  # nothing stored for a refused spec


def test_cancel_with_fake_runner(tmp_path, demo_workspace):
    engine = Engine(tmp_path, runner=RecordingRunner(seconds=30), devices=FAKE_DEVICES)
    job = engine.submit(_spec(demo_workspace["models"]["tiny-llama"], ["cpu/float32", "cpu/bfloat16"]))
    time.sleep(0.3)
    job.cancel()
    assert job.wait(10)
    assert job.state == "cancelled"
    assert engine.store.open(job.run_id).status == "cancelled"


def test_in_process_run_succeeds(tmp_path, demo_workspace):
    engine = Engine(tmp_path, runner=InProcessRunner())
    spec = _spec(
        demo_workspace["models"]["tiny-llama"],
        ["cpu/float32"],
        checks=("weights", "outputs"),
        adapters=[AdapterRef(demo_workspace["adapters"]["lora"]["path"], "lora")],
    )
    job = engine.submit(spec)
    assert job.wait(120)
    assert job.state == "succeeded", job.error
    # progress counts true steps: every task ends on step n of n, each step once
    for name, task in job.snapshot()["tasks"].items():
        assert task["state"] == "succeeded" and task["step"] == task["of"] > 0, (name, task)
        steps = [e["step"] for e in job.events if e["task"] == name]
        assert steps == list(range(1, task["of"] + 1))
    table = engine.store.open(job.run_id).metrics()
    assert set(table["check"]) == {"weights", "outputs"}
    assert set(table["target"]) == {"cpu/float32"}


class PreparingRunner(RecordingRunner):
    """Keeps what the engine makes ready ahead (`prepare`) until the task runs or is given up (`discard`),
    as the process runner keeps its workers: `waiting` is what would be left waiting for a task. The task
    labelled `fail` waits until the task labelled `after` has started, then fails as a killed worker's
    would once at work."""

    def __init__(self, fail: str, after: str | None = None):
        super().__init__(seconds=0.05)
        self.fail, self.after = fail, after
        self.made_ready: set[str] = set()
        self.waiting: set[str] = set()
        self.after_started = threading.Event()

    def prepare(self, task, log_path):
        with self.lock:
            self.made_ready.add(task.label)
            self.waiting.add(task.label)

    def discard(self, task):
        with self.lock:
            self.waiting.discard(task.label)

    def run(self, task, on_event, cancel, log_path):
        with self.lock:
            self.waiting.discard(task.label)
        if task.label == self.after:
            self.after_started.set()
        if task.label == self.fail:
            if self.after is not None:
                assert self.after_started.wait(30), f"{self.after} did not start"
            return self.failed(on_event)
        return super().run(task, on_event, cancel, log_path)

    def failed(self, on_event) -> Outcome:
        on_event({"type": "progress", "stage": "load", "step": 1, "of": 2})  # at work, then gone
        return Outcome(ok=False, error="killed by SIGKILL")


class LateReaderRunner(PreparingRunner):
    """The failing task returns while its first event is still being handled in another thread (the
    process runner's event reader, which it joins for 5 s only): what that event makes ready comes late,
    after any `discard` called meanwhile (each `prepare` waits for one, up to a second)."""

    def __init__(self, fail: str):
        super().__init__(fail)
        self.preparing = threading.Event()
        self.discarded = threading.Event()

    def prepare(self, task, log_path):
        self.preparing.set()
        self.discarded.wait(1.0)
        super().prepare(task, log_path)

    def discard(self, task):
        self.discarded.set()
        super().discard(task)

    def failed(self, on_event) -> Outcome:
        reader = threading.Thread(
            target=on_event, args=({"type": "progress", "stage": "load", "step": 1, "of": 2},)
        )
        reader.start()
        assert self.preparing.wait(30), "the first event made nothing ready"
        return Outcome(ok=False, error="killed by SIGKILL")


def _two_targets(demo_workspace):
    lora = AdapterRef(demo_workspace["adapters"]["lora"]["path"], "lora")
    return _spec(
        demo_workspace["models"]["tiny-llama"],
        ["cpu/float32", "cpu/bfloat16"],
        checks=("weights", "deltas", "outputs"),
        adapters=[lora],
    )


@pytest.mark.parametrize("failing, other", [("cpu/float32", "cpu/bfloat16"), ("cpu/bfloat16", "cpu/float32")])
def test_what_the_engine_gets_ready_ahead_is_run_or_given_up_when_a_capture_fails(
    tmp_path, demo_workspace, failing, other
):
    """A worker made ready while the task before it runs is never left waiting: a partial compare's, made
    ready when the last capture it needs starts, is given up when that capture fails."""
    # the other target's lane has gone past its first pass (its next task started): the partial compare
    # of the first pass waits for the failing capture alone when that one starts
    runner = PreparingRunner(fail=f"{failing} · weights, deltas", after=f"{other} · outputs")
    job = Engine(tmp_path, runner=runner).submit(_two_targets(demo_workspace))
    assert job.wait(60) and job.state == "failed", job.error
    assert runner.fail in job.error and "SIGKILL" in job.error
    assert "compare · weights, deltas" in runner.made_ready  # made ready when its last capture started
    assert not runner.waiting


def test_what_a_failed_tasks_first_event_makes_ready_late_is_given_up_too(tmp_path, demo_workspace):
    """A runner that returns before its task's first event is handled (a killed worker's reader still at
    it): the lane waits for that event's work before it gives up the next task's worker."""
    runner = LateReaderRunner(fail="cpu/float32 · weights, deltas")
    job = Engine(tmp_path, runner=runner).submit(_two_targets(demo_workspace))
    assert job.wait(60) and job.state == "failed", job.error
    assert "cpu/float32 · outputs" in runner.made_ready  # the lane's next task, made ready by the event
    assert not runner.waiting


def _worker_pids():
    """Task processes: spawned workers and the fork server's children (named FORKED_NAME), not the server."""
    me = psutil.Process(os.getpid())
    pids = []
    for p in me.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            cmdline = " ".join(p.cmdline())
            if "core.engine.worker" in cmdline and (
                FORK_SERVER_ARG not in cmdline or p.name() == FORKED_NAME
            ):
                pids.append(p.pid)
    return pids


@pytest.mark.e2e
def test_killed_worker_fails_the_job_the_engine_goes_on_and_a_cancel_stops_real_workers(
    tmp_path, demo_workspace
):
    """One engine on real workers (one fork server for its three jobs): a task's process killed fails
    its job, the next job succeeds, and a job cancelled mid-run stops its workers at once."""
    engine = Engine(tmp_path, runner=ProcessRunner(grace_s=5))
    base = demo_workspace["models"]["tiny-llama"]
    lora = AdapterRef(demo_workspace["adapters"]["lora"]["path"], "lora")
    # every demo adapter: a forked task starts at once and runs for seconds, not a fraction of one
    every = [
        AdapterRef(a["path"], n) for n, a in demo_workspace["adapters"].items() if a["base"] == "tiny-llama"
    ]
    job = engine.submit(_spec(base, ["cpu/float32"], adapters=every))
    deadline = time.monotonic() + 60
    killed = False
    while not killed and not job.done_event.is_set() and time.monotonic() < deadline:
        for pid in _worker_pids():
            with contextlib.suppress(ProcessLookupError):  # a task that ended between the two
                os.kill(pid, signal.SIGKILL)
                killed = True
                break
        time.sleep(0.05)
    assert killed, "no worker process appeared while the job ran"
    assert job.wait(60)
    assert job.state == "failed"
    assert "SIGKILL" in job.error and "cpu/float32" in job.error
    assert engine.store.open(job.run_id).status == "failed"
    assert not _worker_pids()  # nor a process made ready for a task after it (a partial compare's)
    # the next job on the same engine still succeeds
    job2 = engine.submit(_spec(base, ["cpu/float32"], adapters=[lora]))
    assert job2.wait(120)
    assert job2.state == "succeeded", job2.error

    # a cancel mid-run stops the real workers
    adapters = [AdapterRef(demo_workspace["adapters"][n]["path"], n) for n in ("lora", "dora", "boft")]
    job3 = engine.submit(_spec(base, ["cpu/float32", "cpu/bfloat16"], adapters=adapters))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(t["state"] == "running" and t["step"] >= 2 for t in job3.snapshot()["tasks"].values()):
            break
        time.sleep(0.05)
    started = time.monotonic()
    job3.cancel()
    assert job3.wait(30)
    assert job3.state == "cancelled"
    assert time.monotonic() - started < 15
    assert not _worker_pids()
    assert not (job3.run_dir / "metrics.parquet").exists()


@pytest.mark.e2e
def test_the_fork_server_serves_a_job_and_a_shutdown_cancels_the_next_and_leaves_no_worker(
    tmp_path, demo_workspace
):
    # Started with the engine, before the run existed: its forked task learns its log with its task.
    engine = Engine(tmp_path, runner=ProcessRunner(grace_s=5), warm=True)
    server = engine.runner._server
    assert server is not None and server.alive()
    base = demo_workspace["models"]["tiny-llama"]
    job = engine.submit(_spec(base, ["cpu/float32"], checks=("weights",)))
    assert job.wait(240) and job.state == "succeeded", job.error
    log = (job.run_dir / "logs" / "cpu_float32.log").read_text()
    assert "spawned instead" not in log  # forked, not spawned
    assert engine.runner._server is server and server.alive()  # kept for the next job

    # What the dashboard server does when it stops (atexit) and the CLI on a signal: the running job is
    # cancelled and marked, its workers and the fork server stop.
    adapters = [AdapterRef(demo_workspace["adapters"][n]["path"], n) for n in ("lora", "dora")]
    running = engine.submit(_spec(base, ["cpu/float32", "cpu/bfloat16"], adapters=adapters))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not _worker_pids():
        time.sleep(0.05)
    assert _worker_pids(), "no worker process appeared"
    engine.shutdown("cancelled: the dashboard server stopped")
    assert running.done_event.is_set()
    assert running.state == "cancelled" and running.error == "cancelled: the dashboard server stopped"
    assert server.proc.poll() is not None and engine.runner._server is None
    assert not _worker_pids()
    record = engine.store.open(running.run_id)
    assert record.status == "cancelled" and record.error == "cancelled: the dashboard server stopped"
    engine.store.delete(running.run_id)  # ownership given up with the job
