"""Runners: where a task of a job runs, and how its end is told (`Outcome`).

`ProcessRunner` spawns a fresh `python -m core.engine.worker` per task (numerics flags are
process-global and a CUDA error poisons a process), keeps spare workers with their libraries
imported and gets the next task's worker ready while the one before it works; `InProcessRunner`
runs a task in this process, for unit tests. `core.engine.ray_runner` runs them on a Ray cluster.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.engine.worker import EXIT_CANCELLED, PREIMPORT_ENV, Cancelled, Task, run_task, task_json

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Outcome:
    """How a task ended: ok, cancelled, or failed with a reason (the engine adds where it stopped)."""

    ok: bool
    cancelled: bool = False
    error: str | None = None
    stderr_tail: str = ""


class Runner(ABC):
    """Runs one task; reports events through `on_event` and stops when `cancel` is set."""

    # Whether this runner can place a target on a named machine (`node=NAME`, core.engine.ray_runner).
    places_nodes = False

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

    def warm(self, count: int = 1) -> None:
        """Have `count` workers ready for whatever task comes next (a runner with workers starts them
        now, so that their imports overlap what the caller does before its first task)."""
        return None


class InProcessRunner(Runner):
    """Runs tasks in the calling process (unit tests). Flags it applies stay applied, but for the
    thread count, which each task gets back as it found it."""

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


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def tail(path: Path, lines: int = 12) -> str:
    """The last lines of a log file ('' if it does not exist)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


class ProcessRunner(Runner):
    """Runs each task in a fresh spawned worker process; stderr goes to the run's log."""

    def __init__(self, grace_s: float = 10.0, python: str | None = None):
        self.grace_s = grace_s
        self.python = python or sys.executable
        self._prepared: dict[tuple[str, str], subprocess.Popen] = {}
        # started ahead of any task (`warm`): libraries imported, waiting for a task and its log
        self._spares: list[subprocess.Popen] = []
        self._live: set[subprocess.Popen] = set()  # every worker started and not yet reaped
        self._lock = threading.Lock()
        self._live_lock = threading.Lock()  # apart: _spawn runs under _lock in prepare

    def kill_all(self) -> None:
        with self._lock:
            self._prepared.clear()
            self._spares.clear()
        with self._live_lock:
            procs = list(self._live)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def warm(self, count: int = 1) -> None:
        with self._lock:
            self._spares = [p for p in self._spares if p.poll() is None]
            while len(self._spares) < count:
                self._spares.append(self._spawn_worker(None, preimport=True))

    def _take_spare(self, task: Task) -> subprocess.Popen | None:
        """A live spare worker for `task` (not a memory timeline's: its process must start with its task)."""
        if not task.imports_ahead:
            return None
        while self._spares:
            proc = self._spares.pop(0)
            if proc.poll() is None:
                return proc
        return None

    def prepare(self, task: Task, log_path: Path) -> None:
        """Get `task`'s worker ready now: a spare if there is one, else a new worker that imports
        torch, transformers, PEFT and this package's task code and then waits for its task, so those
        seconds overlap the task before it on the same device."""
        with self._lock:
            if (task.run_dir, task.label) not in self._prepared:
                proc = self._take_spare(task)
                self._prepared[(task.run_dir, task.label)] = proc or self._spawn(task, log_path)

    def discard(self, task: Task) -> None:
        with self._lock:
            proc = self._prepared.pop((task.run_dir, task.label), None)
        if proc is not None:
            proc.kill()
            proc.wait()

    def _spawn(self, task: Task, log_path: Path) -> subprocess.Popen:
        return self._spawn_worker(log_path, preimport=task.imports_ahead)

    def _spawn_worker(self, log_path: Path | None, preimport: bool) -> subprocess.Popen:
        """A worker process; its stderr goes to `log_path` (a spare's: nowhere until its task names its log)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        env[PREIMPORT_ENV] = "1" if preimport else ""
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path if log_path is not None else os.devnull, "ab") as log:
            proc = subprocess.Popen(
                [self.python, "-m", "core.engine.worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                cwd=str(REPO_ROOT),
                env=env,
                start_new_session=True,  # a Ctrl-C in the terminal goes to us, not straight to workers
            )
        with self._live_lock:
            self._live = {p for p in self._live if p.poll() is None} | {proc}
        return proc

    def run(self, task, on_event, cancel, log_path) -> Outcome:
        log_path.parent.mkdir(parents=True, exist_ok=True)  # a spare worker opens it itself
        with self._lock:
            proc = self._prepared.pop((task.run_dir, task.label), None) or self._take_spare(task)
        if proc is None or proc.poll() is not None:
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
        while proc.poll() is None:
            if cancel.is_set():
                if terminated_at is None:
                    proc.send_signal(signal.SIGTERM)  # cooperative: the worker stops at the next stage
                    terminated_at = time.monotonic()
                elif time.monotonic() - terminated_at > self.grace_s:
                    proc.kill()
            time.sleep(0.05)
        reader.join(timeout=5)
        code = proc.returncode
        final = last["final"] or {}
        if code == 0 and final.get("type") == "done":
            return Outcome(ok=True)
        if cancel.is_set() and (code == EXIT_CANCELLED or code < 0):
            return Outcome(ok=False, cancelled=True)
        if final.get("type") == "error":
            return Outcome(ok=False, error=final["message"])
        how = f"was killed by {_signal_name(code)}" if code < 0 else f"exited with code {code}"
        return Outcome(ok=False, error=f"worker process {how}", stderr_tail=tail(log_path))
