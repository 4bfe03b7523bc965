"""The Ray runner: each task of a run in a fresh Ray worker process, on this or another machine.

What runs where:

- The **driver** (the CLI or the dashboard's server) keeps the engine, the job threads and the run
  folder. Nothing else writes into the run folder.
- Each **capture task** is one Ray task (`max_calls=1`: a fresh worker process per task, because
  numerics flags are process-global and a CUDA error poisons a process; `max_retries=0`: a crash is
  a result, not something to hide by running again). A `cuda:N` target asks Ray for one GPU; a target
  with `node=NAME` is pinned to that node. The task writes its capture into a temporary folder on
  the node it runs on, and sends the folder back in chunks (a zip archive, every member with a CRC);
  the driver unpacks it into the run folder. Remote nodes never see the run folder, but they must
  have the base model and the adapters at the paths the spec names (or a hub id they can reach).
- The **compare task** reads every capture and writes the metrics table into the run folder, so it
  runs where the run folder is: pinned to the driver's own node, or, when the driver is not a node
  of the cluster (a Ray Client `ray://` address), in a local worker process.

Progress events come back through the task's streaming generator, in order. Cancel asks the task
to stop (`ray.cancel`, which interrupts it), and after a grace period kills its worker
(`ray.cancel(force=True)`). A worker that dies (killed, out of memory, a crash in native code) makes
a failed task with a sentence that names the node and the process.

Ray is an optional dependency (`requirements-ray.txt`): it is imported only when this runner is
used, never by the rest of the package.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from core.engine.runners import Outcome, ProcessRunner, Runner
from core.engine.tasks import Cancelled, Task
from core.spec import SpecError, Target

# The archive a task sends back travels in pieces of this size: no single Ray object gets near the
# object store's limits, and the driver writes as it receives.
CHUNK_BYTES = 32 * 1024 * 1024
# Environment variables Ray sets in a worker for its task that a local worker would not have: the
# thread count (Ray forces OMP_NUM_THREADS to the task's CPU count) and the GPUs Ray assigned
# (CUDA_VISIBLE_DEVICES). A target's numerics must not depend on the runner: each task gets back
# what the node's worker process started with (see `restore_process_env`).
RAY_SET_VARS = ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")


class RayUnavailable(SpecError):
    """Ray is not installed, or its cluster cannot be reached; the message says how to fix it."""


def import_ray():
    """The `ray` module, or RayUnavailable saying how to install it (it is optional)."""
    try:
        import ray
    except ImportError as e:
        raise RayUnavailable(
            "the Ray runner needs Ray: pip install -r requirements-ray.txt (or use the local runner)"
        ) from e
    return ray


# --- what runs in the Ray worker -------------------------------------------------------------------


def initial_environ() -> dict[str, str] | None:
    """The environment this process started with (Linux: /proc/self/environ), before Ray set its
    per-task variables; None where it cannot be read."""
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return None
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def restore_process_env(environ: dict[str, str] | os._Environ, initial: dict[str, str] | None) -> dict:
    """Put Ray's per-task variables (`RAY_SET_VARS`) back to what the process started with, in place;
    returns what Ray had set, to be recorded. With `initial` unknown nothing changes.

    Why: Ray sets OMP_NUM_THREADS=1 (torch would then compute with one thread, unlike a local worker
    of the same target) and narrows CUDA_VISIBLE_DEVICES to the GPU it assigned (cuda:1 would then be
    cuda:0 inside the process, and placement by device index would be wrong). Restored, `cuda:N` means
    the node's GPU N exactly as in a local worker; Ray's assignment is kept in the capture.
    """
    ray_set = {k: environ.get(k) for k in RAY_SET_VARS}
    if initial is None:
        return ray_set
    for key in RAY_SET_VARS:
        if key in initial:
            environ[key] = initial[key]
        else:
            environ.pop(key, None)
    return ray_set


def pack_tree(root: Path, out: Path) -> None:
    """Zip every file under `root` into `out` (paths relative to `root`)."""
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            z.write(path, path.relative_to(root).as_posix())


def unpack_tree(archive: Path, dest: Path) -> list[str]:
    """Unpack a task's archive into the run folder `dest`: every member's CRC checked first, no path
    outside `dest`, each file written to a temporary name and renamed into place (the run folder's
    rule). Returns the members written. ValueError for a damaged or unsafe archive."""
    dest = Path(dest)
    with zipfile.ZipFile(archive) as z:
        bad = z.testzip()
        if bad is not None:
            raise ValueError(f"the archive the task sent back is damaged (CRC mismatch in {bad})")
        names = [n for n in z.namelist() if not n.endswith("/")]
        for name in names:
            parts = Path(name).parts
            if Path(name).is_absolute() or ".." in parts or not parts:
                raise ValueError(f"the archive the task sent back holds an unsafe path {name!r}")
        for name in names:
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
            try:
                with z.open(name) as src, open(tmp, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 24)
                os.replace(tmp, target)
            except BaseException:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise
    return names


def _annotate_captures(run_dir: Path, info: dict[str, Any]) -> None:
    """Record in each capture written under `run_dir` where Ray ran it (node, process, Ray's GPUs)."""
    for doc_path in (run_dir / "captures").glob("*/capture.json"):
        doc = json.loads(doc_path.read_text())
        doc.setdefault("meta", {})["ray"] = info
        doc_path.write_text(json.dumps(doc, indent=2, sort_keys=True, default=str))


class Gates:
    """A Ray actor that holds prepared tasks at their start line: a task submitted ahead of its turn
    (`RayRunner.prepare`) imports its libraries, then waits here until the runner says go (its turn
    came) or not (the job ended first). One per runner; it holds no CPU."""

    def __init__(self):
        import asyncio

        self._asyncio = asyncio
        self._events: dict[str, Any] = {}
        self._go: dict[str, bool] = {}

    def _event(self, key: str):
        return self._events.setdefault(key, self._asyncio.Event())

    async def wait(self, key: str) -> bool:
        """Block until `open(key, …)`; whether the task is to run."""
        await self._event(key).wait()
        self._events.pop(key, None)
        return self._go.pop(key, False)

    async def open(self, key: str, go: bool) -> None:
        """Let the task waiting under `key` run (`go`) or end without running."""
        self._go[key] = go
        self._event(key).set()


def remote_task(
    fields: dict[str, Any], log_name: str, ship: bool, gates: Any = None, gate_key: str = ""
) -> Iterator[dict[str, Any]]:
    """The body of a Ray task: run one `Task` and yield its events, then (`ship`) its folder.

    With `gates` (a prepared task) it first imports what every task needs and waits at its gate, so
    that those seconds overlap the task before it on the same device; told not to run, it ends with a
    `discarded` event.

    Yields, in order: a `worker` event (pid, node, Ray's GPU ids), the task's `progress` events,
    `chunk` events carrying the zip archive of what the task wrote (capture folders, merged models,
    its log) when `ship`, and a final `done`, `error` or `cancelled` event. The work runs in a thread
    so that events leave while it works; an interrupt from `ray.cancel` stops it at its next stage.
    """
    ray = import_ray()
    info = _start_worker(ray)
    yield {"type": "worker", **info}
    task = Task(**fields)
    if gates is not None:
        from core.engine.worker import preimport, preimport_compare

        preimport() if task.needs_libraries else preimport_compare()
        if not ray.get(gates.wait.remote(gate_key)):
            yield {"type": "discarded"}
            return
    if ship:
        # the task writes into a folder of its own on this node, named like the run's
        scratch = Path(tempfile.mkdtemp(prefix="weightdrift-ray-"))
        run_dir = scratch / Path(task.run_dir).name
        run_dir.mkdir()
        task = replace(task, run_dir=str(run_dir))
    else:
        scratch, run_dir = None, Path(task.run_dir)
    log_path = run_dir / "logs" / log_name
    log_path.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {}
    yield from _run_logged(task, log_path, result)
    final = result.get("final", {"type": "error", "message": "the task ended without a result"})
    try:
        if scratch is not None:
            yield from _shipped(scratch, run_dir, final, info)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    yield final


def _start_worker(ray: Any) -> dict[str, Any]:
    """Set this Ray worker process up as a local worker starts (its environment restored before torch
    reads it, the memory timeline's first stages) and say where it runs: the `worker` event's fields."""
    ray_set = restore_process_env(os.environ, initial_environ())  # before torch reads them
    from core.models.memory import sample_process

    # the memory timeline's first stages, as a local worker takes them (this process has Ray imported)
    sample_process("process start")
    import torch  # noqa: F401

    sample_process("import torch")
    ctx = ray.get_runtime_context()
    return {
        "node_id": ctx.get_node_id(),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        "ray_env": ray_set,
    }


def _run_logged(task: Task, log_path: Path, result: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Run `task` in a thread with this process's output going to `log_path`, yielding its events as
    they come; its final event is left in `result["final"]`."""
    events: queue.Queue = queue.Queue()
    cancel = threading.Event()
    # What libraries print goes to the task's log (sent back with the capture), as in a local worker;
    # this process serves one task only (max_calls=1), so redirecting its descriptors is harmless.
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    thread = threading.Thread(
        target=_work, args=(task, events, cancel, result), daemon=True, name="weightdrift-task"
    )
    thread.start()
    try:
        while True:
            # Ray delivers its interrupt between bytecodes: a wait without timeout would not see it
            try:
                event = events.get(timeout=0.1)
            except queue.Empty:
                continue
            if event is None:
                break
            yield event
    except KeyboardInterrupt:  # ray.cancel: the work stops at its next stage; Ray ends the task
        cancel.set()
        raise
    thread.join()


def _work(task: Task, events: queue.Queue, cancel: threading.Event, result: dict[str, Any]) -> None:
    """The task's thread: run it, its events into `events` (then None), its final event into `result`."""
    from core.engine.tasks import run_task
    from core.models.checkpoint import LoadError

    try:
        run_task(task, events.put, cancel.is_set)
        result["final"] = {"type": "done"}
    except Cancelled as e:
        result["final"] = {"type": "cancelled", "message": str(e)}
    except (LoadError, SpecError, ValueError) as e:  # the local worker's "user error"
        result["final"] = {"type": "error", "message": str(e), "error_type": type(e).__name__}
    except BaseException as e:
        import traceback

        traceback.print_exc()
        result["final"] = {"type": "error", "message": f"{type(e).__name__}: {e}", "crash": True}
    finally:
        events.put(None)


def _shipped(scratch: Path, run_dir: Path, final: dict[str, Any], info: dict[str, Any]) -> Iterator[dict]:
    """The `chunk` events carrying what the task wrote in `run_dir` (a zip archive made in `scratch`):
    its captures where it succeeded, else its log alone (a capture that did not finish is no capture)."""
    if final["type"] == "done":
        _annotate_captures(run_dir, info)
    else:
        for child in run_dir.iterdir():
            if child.name != "logs":
                shutil.rmtree(child, ignore_errors=True)
    archive = scratch / "task.zip"
    pack_tree(run_dir, archive)
    with open(archive, "rb") as f:
        while data := f.read(CHUNK_BYTES):
            yield {"type": "chunk", "data": data}


# --- the driver side -------------------------------------------------------------------------------


class RayRunner(Runner):
    """Runs each task as a Ray task in a fresh Ray worker process (see the module's docstring).

    `address`: the Ray cluster (`auto`, `HOST:PORT`, `ray://HOST:10001`); None starts a local Ray
    unless one is already initialised in this process (tests start their own). `grace_s`: how long a
    cancelled task may take to stop before its worker is killed.
    """

    places_nodes = True

    def __init__(self, address: str | None = None, grace_s: float = 10.0, init_kwargs: dict | None = None):
        self.address = address
        self.grace_s = grace_s
        self.init_kwargs = init_kwargs or {}
        # "RUN_ID:LABEL" → what the task's `worker` event said (pid, node, GPUs) while it runs: for
        # messages, and for tests that kill a worker
        self.workers: dict[str, dict[str, Any]] = {}
        # "RUN_ID:LABEL" of every task cancelled by killing its worker, past `grace_s` (not by stopping)
        self.forced: set[str] = set()
        self._generators: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._local: ProcessRunner | None = None  # the compare task when the driver is no node
        self._remote = None  # the Ray remote function, made once Ray is up
        self._gates = None  # the Gates actor, made at the first prepare
        self._prepared: dict[str, Any] = {}  # task key → its generator, waiting at its gate

    # -- Ray itself

    def ray(self):
        """The `ray` module, initialised: connected to `address`, or a local Ray started now."""
        ray = import_ray()
        with self._lock:
            if not ray.is_initialized():
                kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
                # Remote nodes have no copy of this package: Ray ships it to them (the `core` folder).
                if self.address:
                    kwargs["runtime_env"] = {"py_modules": [str(Path(__file__).resolve().parents[1])]}
                kwargs.update(self.init_kwargs)
                try:
                    ray.init(address=self.address or None, **kwargs)
                except (ConnectionError, RuntimeError, ValueError) as e:
                    raise RayUnavailable(
                        f"cannot connect to the Ray cluster at {self.address or '(local)'}: {e}"
                    ) from e
        return ray

    def devices(self) -> list:
        """The devices targets may name on this cluster: cpu, and cuda:0 … cuda:K-1 where the node with
        the most GPUs has K (which node has which is checked when a task is placed)."""
        from core.models.targets import Device

        ray = self.ray()
        gpus = 0
        for node in ray.nodes():
            if node.get("Alive"):
                gpus = max(gpus, int(node.get("Resources", {}).get("GPU", 0)))
        return [Device("cpu", "cpu", "CPU of a Ray node")] + [
            Device(f"cuda:{i}", "cuda", "GPU of a Ray node") for i in range(gpus)
        ]

    def resolve_node(self, name: str) -> str:
        """The Ray node id of the node called `name`: its node name (`ray start --node-name`), host
        name (or its first label) or IP address. SpecError listing the nodes when none matches."""
        ray = self.ray()
        alive = [n for n in ray.nodes() if n.get("Alive")]
        for node in alive:
            host = node.get("NodeManagerHostname", "")
            names = {node.get("NodeName"), host, host.split(".")[0], node.get("NodeManagerAddress")}
            if name in names:
                return node["NodeID"]
        known = ", ".join(sorted({n.get("NodeName") or n.get("NodeManagerHostname", "?") for n in alive}))
        raise SpecError(f"no live Ray node is called {name!r}; the cluster's nodes: {known or 'none'}")

    def _driver_node_id(self) -> str | None:
        """This process's Ray node, or None when it is no node of the cluster (Ray Client)."""
        ray = self.ray()
        from ray.util.client import ray as client

        if client.is_connected():
            return None
        return ray.get_runtime_context().get_node_id()

    def _options(self, task: Task) -> dict[str, Any]:
        """Ray options of `task`: a fresh process, no retry, a GPU for a CUDA target, its node."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options: dict[str, Any] = {"num_cpus": 1}
        node = None
        if task.kind == "compare":
            node = self._driver_node_id()
        else:
            target = Target.parse(task.target or "")
            if target.device_type == "cuda":
                options["num_gpus"] = 1
            if target.node is not None:
                node = self.resolve_node(target.node)
        if node is not None:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        return options

    # -- Runner

    def run(self, task, on_event, cancel, log_path) -> Outcome:
        if task.kind == "compare" and self._driver_node_id() is None:
            # Ray Client: no node sees the run folder; the compare step runs here, in a local worker
            if self._local is None:
                self._local = ProcessRunner(grace_s=self.grace_s)
            return self._local.run(task, on_event, cancel, log_path)
        ray = self.ray()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        key = _key(task)
        with self._lock:
            gen = self._prepared.pop(key, None)
        if gen is not None:
            ray.get(self._gates.open.remote(key, True))  # its turn: it has its libraries imported
        else:
            try:
                gen = self._submit(ray, task, log_path)
            except SpecError as e:
                return Outcome(ok=False, error=str(e))
        with self._lock:
            self._generators[key] = gen
        archive = log_path.parent / f".{task.label.replace('/', '_')}.{secrets.token_hex(4)}.zip.tmp"
        try:
            return self._follow(ray, task, gen, on_event, cancel, log_path, archive)
        finally:
            with self._lock:
                self._generators.pop(key, None)
                self.workers.pop(key, None)
            with contextlib.suppress(OSError):
                archive.unlink()

    def _submit(self, ray, task: Task, log_path: Path, gated: bool = False):
        """Start `task` as a Ray task (`gated`: to wait at its gate once its libraries are imported)."""
        options = self._options(task)
        if self._remote is None:
            # max_calls=1: a fresh worker process per task (numerics flags are process-global);
            # max_retries=0: a crashed worker is the task's result, not something to run again
            self._remote = ray.remote(num_returns="streaming", max_calls=1, max_retries=0)(remote_task)
        ship = task.kind != "compare"  # the compare task runs beside the run folder and writes there
        gates = None
        if gated:
            if self._gates is None:
                self._gates = ray.remote(num_cpus=0, max_concurrency=1000)(Gates).remote()
            gates = self._gates
        return self._remote.options(**options).remote(asdict(task), log_path.name, ship, gates, _key(task))

    def prepare(self, task: Task, log_path: Path) -> None:
        """Start `task`'s Ray task now: it imports torch, transformers, PEFT and the kernel, then waits
        for `run`, so that those seconds overlap the task before it (as the process runner's workers)."""
        if task.kind == "compare" and self._driver_node_id() is None:
            if self._local is None:
                self._local = ProcessRunner(grace_s=self.grace_s)
            self._local.prepare(task, log_path)
            return
        ray = self.ray()
        key = _key(task)
        with self._lock:
            if key in self._prepared:
                return
        try:
            gen = self._submit(ray, task, log_path, gated=True)
        except SpecError:
            return  # `run` submits it again and reports why
        with self._lock:
            self._prepared[key] = gen

    def discard(self, task: Task) -> None:
        """Tell a prepared task that its turn will not come: it ends without running."""
        if self._local is not None:
            self._local.discard(task)
        with self._lock:
            gen = self._prepared.pop(_key(task), None)
        if gen is not None:
            self._gates.open.remote(_key(task), False)

    def _follow(self, ray, task, gen, on_event, cancel, log_path, archive) -> Outcome:
        """Read the task's events as they come, cancel it when asked, unpack what it sends back."""
        worker: dict[str, Any] = {}
        final: dict[str, Any] = {}
        cancelled_at = None
        killed = False
        with open(archive, "wb") as sink:
            while True:
                if cancel.is_set():
                    if cancelled_at is None:
                        cancelled_at = time.monotonic()
                        ray.cancel(gen, force=False)  # interrupts the task: it stops at its next stage
                    elif not killed and time.monotonic() - cancelled_at > self.grace_s:
                        killed = True
                        with self._lock:
                            self.forced.add(_key(task))
                        ray.cancel(gen, force=True)  # kills its worker process
                ready, _ = ray.wait([gen], timeout=0.1)
                if not ready:
                    continue
                try:
                    event = ray.get(next(gen))
                except StopIteration:
                    break
                except Exception as e:  # the task's end as Ray reports it (cancelled, worker died)
                    return self._failure(ray, e, task, worker, cancel, log_path)
                kind = event.get("type")
                if kind == "worker":
                    worker = event
                    with self._lock:
                        self.workers[_key(task)] = event
                elif kind == "chunk":
                    sink.write(event["data"])
                elif kind in ("done", "error", "cancelled"):
                    final = event
                else:
                    on_event(event)
        if archive.stat().st_size:
            try:
                unpack_tree(archive, Path(task.run_dir))
            except (ValueError, OSError, zipfile.BadZipFile) as e:
                return Outcome(ok=False, error=f"{_where(worker)}: {e}")
        if final.get("type") == "done":
            return Outcome(ok=True)
        if final.get("type") == "cancelled" or cancel.is_set():
            return Outcome(ok=False, cancelled=True)
        from core.engine.runners import tail

        return Outcome(
            ok=False,
            error=final.get("message", f"{_where(worker)} ended without a result"),
            stderr_tail=tail(log_path) if final.get("crash") else "",
        )

    def _failure(self, ray, e: Exception, task, worker, cancel, log_path) -> Outcome:
        """An Outcome for a task that Ray ended with an exception."""
        from ray import exceptions as rex

        if cancel.is_set() and isinstance(e, rex.TaskCancelledError | rex.WorkerCrashedError):
            return Outcome(ok=False, cancelled=True)
        if isinstance(e, rex.TaskCancelledError):
            return Outcome(ok=False, error=f"{_where(worker)}: the task was cancelled by Ray")
        if isinstance(e, rex.WorkerCrashedError):
            return Outcome(
                ok=False,
                error=f"{_where(worker)} died while running the task (killed, out of memory, or a crash "
                "in native code); Ray's worker logs on that node say more",
            )
        if isinstance(e, rex.NodeDiedError):
            return Outcome(ok=False, error=f"{_where(worker)}: its Ray node died while running the task")
        if isinstance(e, rex.RayTaskError):  # an exception in our own code, outside run_task
            cause = e.cause if getattr(e, "cause", None) is not None else e
            return Outcome(ok=False, error=f"{_where(worker)}: {type(cause).__name__}: {cause}")
        return Outcome(ok=False, error=f"{_where(worker)}: Ray failed the task: {type(e).__name__}: {e}")

    def kill_all(self) -> None:
        """Kill the worker of every task still running (the process is going away)."""
        with self._lock:
            gens = list(self._generators.values()) + list(self._prepared.values())
            self._prepared.clear()
        if gens:
            ray = import_ray()
            for gen in gens:
                with contextlib.suppress(Exception):
                    ray.cancel(gen, force=True)
        if self._local is not None:
            self._local.kill_all()


def _key(task: Task) -> str:
    """A task's key among the runner's tasks (and at its gate): its run and label."""
    return f"{Path(task.run_dir).name}:{task.label}"


def _where(worker: dict[str, Any]) -> str:
    """'the Ray worker (pid N on HOST)', or 'the Ray worker' before it said where it runs."""
    if not worker:
        return "the Ray worker"
    return f"the Ray worker (pid {worker.get('pid')} on {worker.get('hostname')})"


def make_runner(name: str, ray_address: str | None = None) -> Runner:
    """The runner a command line or the dashboard names: `process` (default) or `ray`."""
    if name == "ray":
        import_ray()  # fail now, with how to install it, not at the first task
        return RayRunner(address=ray_address)
    if name == "process":
        if ray_address:
            raise SpecError("--ray-address needs --runner ray")
        return ProcessRunner()
    raise SpecError(f"unknown runner {name!r}; use process or ray")


RUNNERS: tuple[str, ...] = ("process", "ray")
