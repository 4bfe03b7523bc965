"""Runners: where a task of a job runs, and how its end is told (`Outcome`).

`ProcessRunner` runs each task in a fresh process (numerics flags are process-global and a CUDA
error poisons a process): forked by its fork server, which imported the libraries once (`ForkServer`,
docs/workers.md), or spawned as `python -m core.engine.worker` where the task measures its own
process's start (a memory timeline) or no fork server can serve; it gets the next task's process
ready while the one before it works. `InProcessRunner` runs a task in this process, for unit tests.
`core.engine.ray_runner` runs them on a Ray cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.engine.fork_server import FORKS, ForkedProcess, ForkServer, signal_name
from core.engine.tasks import Cancelled, Task, run_task, task_json
from core.engine.worker import (
    EXIT_CANCELLED,
    MEMORY_TIMELINE_NICENESS,
    REPO_ROOT,
    SPARE_OUTPUT_PREFIX,
    lower_priority,
    worker_env,
)
from core.spec import SpecError, Target

# Fresh interpreters a warm runner keeps for a run's memory timelines (`warm(fresh=...)`): a run's
# first two (the demo's two CPU targets, or two lanes of a 2-core machine) start imported; others
# start their own, ahead of their task. Each idle one holds its imports' memory (0.54 GB RSS here).
FRESH_SPARES = 2
# The checks that run in a fresh interpreter (`Check.loads` FRESH_INTERPRETER), by name: the CLI and the API
# warm their runner before they import the checks (core.checks imports torch, 3-4 s), and a test holds
# this equal to the classes' attribute.
FRESH_INTERPRETER_CHECKS = ("memory",)


def fresh_spares(checks: Iterable[str] | None) -> int:
    """How many fresh interpreters to start ahead for a run of the checks named `checks`."""
    return FRESH_SPARES if any(c in FRESH_INTERPRETER_CHECKS for c in checks or ()) else 0


# `gpu` or `cpu`: makes the process runner act as where a GPU is visible, or as where none is (`worker_path`)
WORKERS_ENV = "WEIGHTDRIFT_WORKERS"
# Spawned spares the GPU path keeps importing ahead of its tasks (`ProcessRunner`): a few cores' worth
WARM_SPARES = max(1, min(4, (os.cpu_count() or 1) // 2))


def worker_path() -> str:
    """How the process runner makes task processes here: "cpu", forked from a fork server, or "gpu", as
    where a GPU is visible (`gpu_visible`): forked from a fork server that imported no bitsandbytes,
    quantized targets' tasks spawned (spare interpreters imported ahead, never forked);
    `WEIGHTDRIFT_WORKERS=gpu|cpu` chooses (a CPU machine measures the GPU machines' path)."""
    chosen = os.environ.get(WORKERS_ENV, "").strip().lower()
    if chosen and chosen not in ("gpu", "cpu"):
        raise SpecError(f"{WORKERS_ENV}={os.environ[WORKERS_ENV]!r}: give gpu or cpu (or leave it unset)")
    return chosen or ("gpu" if gpu_visible() else "cpu")


def gpu_visible(dev: Path = Path("/dev"), env: dict[str, str] | None = None) -> bool:
    """Whether a GPU that torch.cuda would use is visible here, told without touching CUDA: an NVIDIA
    device node (`/dev/nvidia0`, …) or ROCm's `/dev/kfd`, unless CUDA_VISIBLE_DEVICES hides them all.

    Where one is, the fork server imports no bitsandbytes and quantized targets' tasks are spawned:
    bitsandbytes, which PEFT imports, creates a CUDA context when it is imported (it asks each GPU's
    compute capability), and CUDA does not survive a fork (seen on an H200: every task forked from a
    server that had imported it failed with "Cannot re-initialize CUDA in forked subprocess", and the
    server's context alone would put memory on cuda:0 that no task asked for)."""
    env = os.environ if env is None else env
    if env.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return False
    with contextlib.suppress(OSError):
        if (dev / "kfd").exists() or any(p.name[6:].isdigit() for p in dev.glob("nvidia[0-9]*")):
            return True
    return False


@dataclass
class Outcome:
    """How a task ended: ok, cancelled, or failed with a reason (the engine adds where it stopped)."""

    ok: bool
    cancelled: bool = False
    error: str | None = None
    stderr_tail: str = ""
    timed_out: bool = False  # killed at its time limit (`Task.timeout_s`): the engine says in which stage


class Runner(ABC):
    """Runs one task; reports events through `on_event` and stops when `cancel` is set."""

    # Whether this runner can place a target on a named machine (`node=NAME`, core.engine.ray_runner).
    places_nodes = False
    # Whether tasks may run at once on one device: each in a process of its own (not `InProcessRunner`).
    concurrent = True

    @property
    def workers_path(self) -> str:
        """The worker path a run records (`run.json`'s "workers"): `worker_path`."""
        return worker_path()

    @abstractmethod
    def run(
        self, task: Task, on_event: Callable[[dict], None], cancel: threading.Event, log_path: Path
    ) -> Outcome: ...

    def prepare(self, task: Task, log_path: Path) -> None:
        """Get ready for `task` while another task still runs (a runner with workers starts one)."""
        return None

    def discard(self, task: Task) -> None:
        """Give up what `prepare` got ready for `task`, which will not run."""
        return None

    def kill_all(self) -> None:
        """Kill every worker this runner started that is still alive (the process is going away)."""
        return None

    def devices(self) -> list | None:
        """The devices targets may name where this runner runs them; None: this machine's."""
        return None

    def warm(self, fresh: int = 0, quantized: bool = True) -> None:
        """Get ready for whatever task comes next (the process runner starts its fork server now, so
        that its imports overlap what the caller does before its first task, and up to `fresh` spare
        interpreters for memory timelines: `FRESH_SPARES`). `quantized=False`: the caller knows no task
        to come loads a quantized target (`ProbeSpec.loads_quantized`)."""
        return None

    def validate_inputs(self, spec) -> bool:
        """Check the spec's input files (`core.models.validate.validate_inputs`) in a worker that has
        the libraries imported, where this process has not. True when it did (InputError or SpecError
        raised as the worker found it); False: the caller checks them itself."""
        return False


class InProcessRunner(Runner):
    """Runs tasks in the calling process (unit tests), one at a time. Flags it applies stay applied,
    but for the thread count, which each task gets back as it found it."""

    concurrent = False

    def run(self, task, on_event, cancel, log_path) -> Outcome:
        import torch

        # A `threads=N` target would leave N threads to every later task in this process (the
        # float64 reference, PiSSA's SVD): give each task the count a fresh worker would start with.
        threads = torch.get_num_threads()
        try:
            run_task(task, on_event, cancel.is_set)
        except Cancelled:
            return Outcome(ok=False, cancelled=True)
        except Exception as e:
            return Outcome(ok=False, error=str(e))
        finally:
            torch.set_num_threads(threads)
        return Outcome(ok=True)


def tail(path: Path, lines: int = 12) -> str:
    """The last lines of a log file ('' if it does not exist)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


class ProcessRunner(Runner):
    """Runs each task in a fresh process: forked by its fork server (started by `warm`, or with the
    first task that may fork), else spawned; a process's stderr goes to its task's log.

    `fork=False`: spawn every task's process (what the fork server's processes are compared with). On the
    GPU path (`worker_path`) the fork server imports no bitsandbytes (its import initialises CUDA, which a
    forked task could then not use) and refuses to serve if CUDA is initialised all the same; a task that
    loads a quantized target is spawned, and once one is, `WARM_SPARES` interpreters importing everything
    (bitsandbytes included) wait for the next: one task per process, CUDA contexts their own. On the CPU,
    a server `warm` starts for tasks that load no quantized target imports no bitsandbytes either."""

    def __init__(self, grace_s: float = 10.0, python: str | None = None, fork: bool = True):
        self.grace_s = grace_s
        self.python = python or sys.executable
        self._workers = worker_path()
        self.forks = fork and FORKS
        self._ready: list[subprocess.Popen] = []  # the GPU path's spares, imported or importing
        self._server: ForkServer | None = None
        self._prepared: dict[tuple[str, str], subprocess.Popen | ForkedProcess] = {}
        self._live: set = set()  # every task's process started and not yet reaped
        # fresh interpreters started by `warm` for memory timelines to come, importing meanwhile
        self._spares: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._live_lock = threading.Lock()  # apart: _start runs under _lock in prepare

    @property
    def workers_path(self) -> str:
        return self._workers

    def kill_all(self) -> None:
        with self._lock:
            self._prepared.clear()
            self._spares.clear()  # tracked: killed below
            self._ready.clear()
            server, self._server = self._server, None
        with self._live_lock:
            procs = list(self._live)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):  # the server's stop settles the rest
                proc.wait(timeout=10)
        if server is not None:
            server.stop()

    def warm(self, fresh: int = 0, quantized: bool = True) -> None:
        with self._lock:
            self._spares = [p for p in self._spares if p.poll() is None]
            # a spare to come imports the libraries anyway: a server started now is forked from it
            before = self._server
            # (never on the GPU path: a memory timeline's interpreter has imported bitsandbytes)
            hosted = fresh > len(self._spares) and self._workers == "cpu"
            # a server started now imports no bitsandbytes where no task needs it (~2 CPU-s of its imports)
            server = self._fork_server(
                restart=True, host=self._spawn_host if hosted else None, bitsandbytes=quantized
            )
            if server is not None and server is not before and server.host is not None:
                self._spares.append(server.host)
            while len(self._spares) < fresh:
                self._spares.append(self._spawn_worker(subprocess.DEVNULL, fresh=True))

    def _top_up(self) -> None:
        """Start spares until `WARM_SPARES` are alive (the GPU path's, for tasks the fork server cannot
        take: once one came, more may follow); under _lock."""
        if self._workers == "gpu":
            self._ready = [p for p in self._ready if p.poll() is None]
            while len(self._ready) < WARM_SPARES:
                # what it prints before its task: a file of its own, carried into the task's log
                with tempfile.NamedTemporaryFile(prefix=SPARE_OUTPUT_PREFIX, delete=False) as out:
                    self._ready.append(self._spawn_worker(out, fresh=False))

    def _spawn_host(self, fds: list[int], env: dict[str, str]) -> subprocess.Popen:
        """A spare memory timeline's interpreter that forks the fork server (`ForkServer`'s `host`)."""
        return self._spawn_worker(subprocess.DEVNULL, fresh=True, fds=fds, env=env)

    def validate_inputs(self, spec) -> bool:
        # The checks build the model's class from its config and read the adapters' configs: transformers
        # and PEFT, 3.5 s of imports (the CLI's process has neither) that the warm fork server has done.
        if "transformers" in sys.modules and "peft" in sys.modules:
            return False  # imported here already: quicker than a fork
        # in a fork server's child, or a GPU path's spare: imported there, and no CUDA context made here
        with self._lock:
            if (self._server is None or not self._server.alive()) and not self._ready:
                return False
        from core.models.checkpoint import InputError

        errors: list[dict[str, Any]] = []
        task = Task(kind="validate", run_dir="", spec=spec.to_dict())
        with tempfile.TemporaryDirectory(prefix="weightdrift-validate-") as tmp:
            outcome = self.run(
                task,
                lambda e: errors.append(e) if e.get("type") == "error" else None,
                threading.Event(),
                Path(tmp) / "validate.log",
            )
        if outcome.ok:
            return True
        raised = (
            {"InputError": InputError, "SpecError": SpecError}.get(errors[-1].get("error_type", ""))
            if errors
            else None
        )
        if raised is not None:
            raise raised(errors[-1]["message"])
        return False  # the worker failed another way: the caller checks here, and says what it finds

    def _fork_server(self, restart: bool, host=None, bitsandbytes: bool = True) -> ForkServer | None:
        """The live fork server, started if there is none yet (or, `restart`, if it stopped), forked from
        the spare `host` spawns if given (`ForkServer`), importing bitsandbytes where `bitsandbytes` and
        the CPU path ask for it; under _lock."""
        if not self.forks:
            return None
        if self._server is None or (restart and not self._server.alive()):
            if self._server is not None:
                self._server.stop()
            # a host (a memory timeline's interpreter, never on the GPU path) imports bitsandbytes
            without = host is None and (self._workers == "gpu" or not bitsandbytes)
            self._server = ForkServer(self.python, host=host, without_bitsandbytes=without)
        return self._server

    def prepare(self, task: Task, log_path: Path) -> None:
        """Get `task`'s process ready now, waiting for its task (forked, or spawned importing torch,
        transformers, PEFT and this package's task code), so that its start overlaps the task before it."""
        with self._lock:
            if (task.run_dir, task.label) not in self._prepared:
                self._prepared[(task.run_dir, task.label)] = self._start(task, log_path)

    def discard(self, task: Task) -> None:
        with self._lock:
            proc = self._prepared.pop((task.run_dir, task.label), None)
        if proc is not None:
            proc.kill()
            proc.wait()

    def _start(self, task: Task, log_path: Path) -> subprocess.Popen | ForkedProcess:
        """`task`'s process: forked where it may be (not a memory timeline's: its process must start with
        its task), else spawned (and its log says why when the fork server could not serve); under _lock."""
        if task.fresh_process:
            while self._spares:  # one `warm` started, if it is still alive
                spare = self._spares.pop(0)
                if spare.poll() is None:
                    return spare
            return self._spawn(task, log_path)
        if self.forks and not self._needs_bitsandbytes(task):
            server = self._fork_server(restart=False)
            proc = server.fork(worker_env(False)) if server is not None else None
            if proc is not None:
                self._track(proc)
                return proc
            _note(log_path, f"the fork server cannot serve{server.exit_text() if server else ''}")
        while self._ready:  # the GPU path: a spare, replaced at once for the tasks after it
            spare = self._ready.pop(0)
            if spare.poll() is None:
                self._top_up()
                return spare
        proc = self._spawn(task, log_path)
        self._top_up()
        return proc

    def _needs_bitsandbytes(self, task: Task) -> bool:
        """Whether a fork server that imported no bitsandbytes (the GPU path's; on the CPU, one warmed
        for tasks that load none) cannot take `task`: it loads a quantized target; under _lock."""
        if task.target is None or not Target.parse(task.target).quantized:
            return False
        return self._workers == "gpu" or (self._server is not None and self._server.without_bitsandbytes)

    def _spawn(self, task: Task, log_path: Path) -> subprocess.Popen:
        """A fresh `python -m core.engine.worker` for `task`; its stderr goes to `log_path`."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            return self._spawn_worker(log, fresh=task.fresh_process, libraries=task.needs_libraries)

    def _spawn_worker(
        self,
        stderr,
        fresh: bool,
        fds: Sequence[int] = (),
        env: dict[str, str] | None = None,
        libraries: bool = True,
    ) -> subprocess.Popen:
        """A fresh `python -m core.engine.worker`, importing ahead what its task will need (`libraries=False`:
        a compare's, without transformers and PEFT). `fresh`: a memory timeline's interpreter, which samples
        itself at its start and after importing torch, imports what its task will (`preimport_fresh`) and
        waits for it (a spare learns its log with it). `fds` and `env`: what it gets besides (the fork
        server it hosts, `ForkServer`)."""
        proc = subprocess.Popen(
            [self.python, "-m", "core.engine.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            pass_fds=fds,
            cwd=str(REPO_ROOT),
            env={**worker_env(not fresh, fresh=fresh, libraries=libraries), **(env or {})},
            start_new_session=True,  # a Ctrl-C in the terminal goes to us, not straight to workers
        )
        if fresh and not fds:
            # A memory timeline measures memory, not time, and may run beside other tasks (the engine's
            # lanes): those keep the CPU first. Its samples do not depend on it. (One that hosts the fork
            # server lowers its own, once the server is forked: the server's tasks must not inherit it.)
            lower_priority(MEMORY_TIMELINE_NICENESS, proc.pid)
        self._track(proc)
        return proc

    def _track(self, proc) -> None:
        with self._live_lock:
            self._live = {p for p in self._live if p.poll() is None} | {proc}

    def run(self, task, on_event, cancel, log_path) -> Outcome:
        log_path.parent.mkdir(parents=True, exist_ok=True)  # a forked task opens it itself
        with self._lock:
            proc = self._prepared.pop((task.run_dir, task.label), None)
            if proc is None or proc.poll() is not None:
                proc = self._start(task, log_path)
        while isinstance(proc, ForkedProcess) and not proc.started(timeout=0.1):
            if cancel.is_set():
                proc.kill()
                return Outcome(ok=False, cancelled=True)
            if proc.refused is not None:  # the server stopped or refused: this task spawns
                _note(log_path, f"the fork server did not fork this task: {proc.refused}")
                proc = self._spawn(task, log_path)
        last: dict[str, Any] = {"final": None}

        def read_events():
            assert proc.stdout is not None
            for raw in proc.stdout:
                try:
                    event = json.loads(raw)
                except json.JSONDecodeError:
                    continue
                if event.get("type") in ("error", "cancelled", "done"):
                    last["final"] = event
                on_event(event)

        reader = threading.Thread(target=read_events, daemon=True, name=f"events-{task.label}")
        reader.start()
        assert proc.stdin is not None
        try:
            proc.stdin.write(task_json(task, str(log_path)).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        terminated_at = None
        deadline = None if task.timeout_s is None else time.monotonic() + task.timeout_s
        timed_out = False
        while proc.poll() is None:
            if deadline is not None and time.monotonic() > deadline and not timed_out:
                timed_out = True  # no stage boundary may come: the process and whatever it started go
                _kill_session(proc)
            elif cancel.is_set():
                if terminated_at is None:
                    proc.send_signal(signal.SIGTERM)  # cooperative: the worker stops at the next stage
                    terminated_at = time.monotonic()
                elif time.monotonic() - terminated_at > self.grace_s:
                    proc.kill()
            time.sleep(0.05)
        reader.join(timeout=5)
        code = proc.returncode
        if timed_out:
            return Outcome(ok=False, error=f"timed out after {task.timeout_s:g} s", timed_out=True)
        final = last["final"] or {}
        if code == 0 and final.get("type") == "done":
            return Outcome(ok=True)
        if cancel.is_set() and (code == EXIT_CANCELLED or code < 0):
            return Outcome(ok=False, cancelled=True)
        if final.get("type") == "error":
            return Outcome(ok=False, error=final["message"])
        how = f"was killed by {signal_name(code)}" if code < 0 else f"exited with code {code}"
        if getattr(proc, "server_lost", False):
            how += " (its fork server stopped)"
        return Outcome(ok=False, error=f"worker process {how}", stderr_tail=tail(log_path))


def _kill_session(proc: subprocess.Popen | ForkedProcess) -> None:
    """Kill a task's process and its session's other processes (each task makes its own session)."""
    proc.kill()
    if proc.pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


def _note(log_path: Path, text: str) -> None:
    """A line of the runner's own in a task's log."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:
        log.write(f"weightdrift: {text}; this task's process is spawned instead\n")
