"""The work done for one target (capture) or for a whole run (compare).

Both runners call `run_task`: the in-process runner directly (unit tests), the process runner
in a fresh `python -m core.engine.worker` process that reads the task as JSON on stdin and writes
events as JSON lines on its original stdout (library prints go to stderr, the log).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TextIO

from core.engine.tasks import (
    MEMORY_TIMELINE_NICENESS,
    Cancelled,
    Event,
    Task,
    run_task,
)
from core.models.memory import sample_process

# Set by the process runner for a worker started ahead of its task: import the libraries before
# waiting for the task, so that the import overlaps the task before it. PREIMPORT_FRESH: a memory
# timeline's fresh interpreter, which imports only what its task would before its next sample.
# PREIMPORT_COMPARE: a compare task's, which needs neither transformers nor PEFT (`Task.needs_libraries`).
PREIMPORT_ENV = "WEIGHTDRIFT_PREIMPORT"
PREIMPORT_FRESH = "fresh"
PREIMPORT_COMPARE = "compare"

# `python -m core.engine.worker --fork-server FD`: the fork server, on the UNIX socket FD.
FORK_SERVER_ARG = "--fork-server"
# Set ("CONTROL_FD,ERRORS_FD") for a memory timeline's fresh interpreter that also gives the run its
# fork server: once it has imported, it forks the server (`fork_server_here`), so the libraries are
# imported once for both.
HOSTS_FORK_SERVER_ENV = "WEIGHTDRIFT_HOSTS_FORK_SERVER"
# Set ("1") for the GPU machines' fork server: it imports PEFT and transformers as if bitsandbytes were
# not installed, since importing bitsandbytes initialises CUDA, which a forked task could then not use.
# Its tasks load no quantized model (the runner spawns those); `serve_forks` still checks CUDA is untouched.
WITHOUT_BITSANDBYTES_ENV = "WEIGHTDRIFT_FORK_WITHOUT_BITSANDBYTES"
REPO_ROOT = Path(__file__).resolve().parents[2]
# What a forked task's process calls itself (/proc/PID/comm, 15 bytes at most): its command line is the server's.
FORKED_NAME = "wd-task"

EXIT_OK = 0
EXIT_CRASH = 1
EXIT_USER_ERROR = 3
EXIT_CANCELLED = 4


def worker_env(preimport: bool, fresh: bool = False, libraries: bool = True) -> dict[str, str]:
    """The environment of a worker process: this one's, the package on its path, output unbuffered.
    `preimport`: it imports what every task needs before its task comes (`libraries=False`: what a
    compare needs, `preimport_compare`); `fresh`: what a memory timeline's task imports
    (`core.engine.worker.preimport_fresh`)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    ahead = "1" if libraries else PREIMPORT_COMPARE
    env[PREIMPORT_ENV] = PREIMPORT_FRESH if fresh else ahead if preimport else ""
    # OpenMP's threads spin between parallel regions by default; when other processes hold the cores
    # (a small model's tasks run beside each other), a small model's every region then waits a
    # scheduler slice for its descheduled thread. `python -m bench.wait_policy` (docs/workers.md): a
    # tiny Llama forward with two busy processes beside it, mean 75 ms by default, 7.7 ms sleeping;
    # alone, 2.5 ms and 5.0 ms. Sleeping changes no number, only who waits; a value set is kept.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def main() -> int:
    """Entry point of a worker process: task JSON on stdin, events as JSON lines on stdout (or, with
    `--fork-server FD`, the fork server: see `serve_forks`)."""
    if sys.argv[1:2] == [FORK_SERVER_ARG]:
        return serve_forks(int(sys.argv[2]))
    events = stdout_as_events()  # before the imports: what they print goes to the log too
    sample_process("process start")
    import torch  # noqa: F401  (imported here so the memory timeline can say what importing it costs)

    sample_process("import torch")
    ahead = os.environ.get(PREIMPORT_ENV)
    if ahead == PREIMPORT_FRESH:
        preimport_fresh()
        hosted = os.environ.pop(HOSTS_FORK_SERVER_ENV, "")
        if hosted:
            fork_server_here(*map(int, hosted.split(",")), events=events)
    elif ahead == PREIMPORT_COMPARE:
        preimport_compare()
    elif ahead:
        preimport()
    return serve_task(events)


def stdout_as_events() -> TextIO:
    """This process's stdout (the runner's pipe) as the event stream, descriptor 1 pointed at stderr (the
    log): what a library or a process it starts prints (nvcc on a GPU machine) never enters the events."""
    events = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return events


def serve_task(events: TextIO) -> int:
    """Read one task on stdin, run it, write its events to `events`; the exit code says how it ended."""
    cancel = {"requested": False}

    def on_term(signum, frame):
        cancel["requested"] = True

    signal.signal(signal.SIGTERM, on_term)

    def emit(event: Event) -> None:
        events.write(json.dumps(event, default=str) + "\n")

    message = sys.stdin.read()
    if not message.strip():
        return EXIT_OK  # a spare worker whose runner went away before giving it a task
    fields = json.loads(message)
    log_path = fields.pop("log_path", None)
    if log_path:
        # A spare worker learns its log with its task: from here on, what libraries print goes there.
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        carry_spare_output(fd)
        os.dup2(fd, 2)
        os.dup2(fd, 1)
        os.close(fd)
    task = Task(**fields)
    lower_priority(task.niceness)  # before the task starts a thread: threads take it from this one
    from core.models.checkpoint import LoadError
    from core.spec import SpecError

    # The runner knows the stage from the progress events: final events carry only the message.
    try:
        run_task(task, emit, lambda: cancel["requested"])
    except Cancelled as e:
        emit({"type": "cancelled", "message": str(e)})
        return EXIT_CANCELLED
    except (LoadError, SpecError, ValueError) as e:
        emit({"type": "error", "message": str(e), "error_type": type(e).__name__})
        traceback.print_exc()
        return EXIT_USER_ERROR
    except BaseException as e:
        emit({"type": "error", "message": f"{type(e).__name__}: {e}", "crash": True})
        traceback.print_exc()
        return EXIT_CRASH
    emit({"type": "done"})
    return EXIT_OK


# The name a spare's own output file starts with (`ProcessRunner`): what it printed while it imported,
# before it knew its task, moves into the task's log when the task comes (`carry_spare_output`).
SPARE_OUTPUT_PREFIX = "weightdrift-spare-"


def carry_spare_output(log_fd: int) -> None:
    """Copy what this spare printed before its task (its imports: a library's chatter, nvcc's output)
    from its own output file into the task's log `log_fd`, then remove that file; nothing where this
    process's stderr is no such file."""
    with contextlib.suppress(OSError):
        path = os.readlink("/proc/self/fd/2")
        if not os.path.basename(path).startswith(SPARE_OUTPUT_PREFIX):
            return
        with open(path, "rb") as earlier:
            os.write(log_fd, earlier.read())
        os.unlink(path)


def preimport_fresh() -> None:
    """What a memory timeline's task imports between its `import torch` sample and its `import libs`
    one (`run_capture`'s modules, the memory check's libraries), done while its fresh interpreter waits
    for its task: the same imports in the same process, so the same samples, the import sooner. Not
    `preimport`'s kernel call, which the task does not make."""
    import peft  # noqa: F401
    import transformers  # noqa: F401

    import core.capture  # noqa: F401
    import core.checks  # noqa: F401
    import core.models.checkpoint  # noqa: F401
    import core.models.loading  # noqa: F401
    import core.models.probes  # noqa: F401
    import core.models.targets  # noqa: F401


def preimport(fork_safe: bool = False) -> None:
    """What every task needs before its first stage, done while the worker waits for its task:
    the libraries, this package's task modules, and the compiled comparison kernel (loaded from
    numba's cache by a first tiny call). Each second here overlaps the task before it.

    `fork_safe` (the fork server): start no thread pool, so that the process can fork: only the
    serial passes run (numba's OpenMP layer, once launched, stops a forked process at its first
    parallel pass; a task loads the parallel passes from numba's cache itself, ~0.1 s), and torch
    sees only tensors too small for its OpenMP pool."""
    preimport_fresh()  # the libraries and the capture's modules
    preimport_compare(fork_safe)


def preimport_compare(fork_safe: bool = False) -> None:
    """What a compare task needs before its first stage (`preimport`'s, less transformers and PEFT): the
    checks, the capture and store modules, and the compiled comparison kernel."""
    import core.capture  # noqa: F401
    import core.checks  # noqa: F401
    import core.engine.store  # noqa: F401

    load_kernels("serial")
    if not fork_safe:
        load_kernels("parallel")


def load_kernels(passes: str) -> None:
    """Load the comparison kernel's compiled passes from numba's disk cache, compiling (and caching)
    the ones it lacks (from an empty cache ~17 CPU-s for the serial ones, ~21 for the parallel ones, ~9
    once the serial ones' shared helpers are cached): "serial", the passes on the calling thread, plain
    and with the sketch (all a fork server may load: it must start no thread pool), or "parallel", the
    passes large tensors take, compiled functions of their own."""
    from core.numerics import kernel, metrics

    if not kernel.available():
        return
    import torch

    a = torch.arange(8, dtype=torch.float32)
    if passes == "serial":
        metrics.measure(a.to(torch.bfloat16), a, metrics.Tolerance(1e-2, 1e-5))  # the bitwise pass
        kernel.compare_cpu(a + 0.5, a, 0.0, 0.0, parallel=False, sketch=True)
    elif passes == "parallel":
        kernel.compare_cpu(a, a, 0.0, 0.0, parallel=True)
        kernel.compare_cpu(a + 0.5, a, 0.0, 0.0, parallel=True, sketch=True)
    else:
        raise ValueError(f"passes {passes!r}: give serial or parallel")


def lower_priority(niceness: int, pid: int = 0) -> None:
    """Run process `pid` (0: this one) at `niceness` (nice(2)), never raising its priority: its own nice
    value and its session's. Linux schedules each session as a group (autogroup, on by default) and
    every worker has a session of its own, so a nice value alone only ranks a process among its own
    session's, not against other tasks, the dashboard or the browser: the session's nice value does
    (/proc/PID/autogroup). Either is left as it is where the system refuses. The session's goes first,
    so whoever sees the process at `niceness` sees its session there too."""
    group = f"/proc/{pid or 'self'}/autogroup"
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open(group) as f:
            current = int(f.read().split("nice")[1])
        if niceness > current:
            with open(group, "w") as f:
                f.write(str(niceness))
    with contextlib.suppress(OSError):
        if niceness > os.getpriority(os.PRIO_PROCESS, pid):
            os.setpriority(os.PRIO_PROCESS, pid, niceness)


def threads(settle_s: float = 0.0) -> int:
    """How many threads this process has (Linux: /proc/self/task), waiting up to `settle_s` for just one:
    a thread an import leaves running a moment (CI met 2 at a first request) ends, and the task forks."""
    deadline = time.monotonic() + settle_s
    while (count := len(os.listdir("/proc/self/task"))) != 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    return count


def _stop_blas_pools() -> None:
    """Stop the OpenBLAS thread pools numpy and scipy start when they load, as OpenBLAS's own fork
    handler does at every fork: a pool restarts, the same size, on a forked task's first BLAS call."""
    import ctypes

    with open("/proc/self/maps") as maps:
        libs = {line.split()[-1] for line in maps if "openblas" in line.rsplit("/", 1)[-1]}
    for lib in sorted(libs):
        shutdown = getattr(ctypes.CDLL(lib), "blas_thread_shutdown_", None)
        if shutdown is not None:
            shutdown()


def serve_forks(fd: int) -> int:
    """The fork server: import what tasks need once (never CUDA), then fork a process per request.

    A request on the UNIX socket `fd` (SOCK_SEQPACKET) is the task's environment as JSON with three
    file descriptors: the task's stdin and stdout, and a socket for the answers: `pid PID THREADS`
    once forked (THREADS: this process's thread count just before the fork, always 1), `exit CODE`
    once reaped (as `Popen.returncode`), or `refused REASON`. The server forks only while it has one
    thread (fork copies only the calling thread, leaving other threads' locks held for good). When
    the socket closes (the runner's process is gone) it kills its tasks and exits.
    """
    import gc
    import select

    # arrow's jemalloc starts a background thread when it loads (pandas imports pyarrow) unless told not to
    os.environ.setdefault("JE_ARROW_MALLOC_CONF", "background_thread:false")
    control = socket.socket(fileno=fd)
    if os.environ.get(WITHOUT_BITSANDBYTES_ENV):
        # None in sys.modules: `import bitsandbytes` raises ImportError and find_spec says it is absent,
        # which is how PEFT (peft.helpers, is_bnb_available) and transformers take a missing package
        sys.modules.setdefault("bitsandbytes", None)
    preimport(fork_safe=True)
    import torch

    if torch.cuda.is_initialized():
        # an import made a CUDA context (bitsandbytes does, where it sees a GPU): a forked task could
        # not use CUDA, and this process would hold GPU memory no task asked for. The runner spawns.
        print("the fork server found CUDA initialised by its imports: no task is forked", file=sys.stderr)
        return EXIT_CRASH
    _stop_blas_pools()
    gc.freeze()  # what is imported stays in pages the forked tasks share (no collection touches them)
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, answer socket)
    server_pid = os.getpid()
    settle_s = 2.0
    while True:
        ready, _, _ = select.select([control, *children], [], [])
        for pidfd in [r for r in ready if r is not control]:
            pid, answers = children.pop(pidfd)
            _, status = os.waitpid(pid, 0)
            os.close(pidfd)
            with answers:
                _answer(answers, f"exit {os.waitstatus_to_exitcode(status)}")
        if control not in ready:
            continue
        message, fds, _, _ = socket.recv_fds(control, 1 << 20, 3)
        if not message:  # the runner's process is gone: so are its tasks
            for pid, _ in children.values():
                _kill_group(pid)
            return EXIT_OK
        if len(fds) != 3:
            for f in fds:
                os.close(f)
            continue
        stdin, stdout, answer_fd = fds
        answers = socket.socket(fileno=answer_fd)
        count = threads(settle_s)
        if count != 1:
            settle_s = 0.0  # a thread that stays: later requests are refused at once (the runner spawns)
            _answer(answers, f"refused the fork server has {count} threads")
            answers.close()
        else:
            try:
                pid = os.fork()
            except OSError as e:  # out of memory or processes: the runner spawns this one
                _answer(answers, f"refused fork failed: {e}")
                answers.close()
                os.close(stdin)
                os.close(stdout)
                continue
            if pid == 0:
                _forked(
                    json.loads(message),
                    stdin,
                    stdout,
                    [control, answers, *(a for _, a in children.values())],
                    list(children),
                    server_pid,
                )
            children[os.pidfd_open(pid)] = (pid, answers)
            _answer(answers, f"pid {pid} {count}")
        os.close(stdin)
        os.close(stdout)


def fork_server_here(control_fd: int, errors_fd: int, events: TextIO | None = None) -> None:
    """Fork the fork server from this memory timeline's fresh interpreter, now that it has imported
    torch, transformers and PEFT (`preimport_fresh`): the server starts with those imports done and
    does the rest of `preimport` itself, instead of importing them all a second time.

    What it inherits and why that is safe: docs/workers.md, "Forked from a spare memory interpreter". This
    process then lowers its own CPU priority as a memory timeline's (`MEMORY_TIMELINE_NICENESS`)."""

    def server() -> int:
        from core.models import memory

        os.setsid()  # apart from the interpreter's session: killing it does not kill the server
        memory.PROCESS_SAMPLES.clear()  # a task forked from the server is no fresh interpreter
        os.environ.pop(PREIMPORT_ENV, None)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(errors_fd, 1)
        os.dup2(errors_fd, 2)
        os.close(errors_fd)
        if events is not None:  # the runner reads the interpreter's events until every end is closed
            events.close()
        control = socket.socket(fileno=control_fd)
        control.send(f"pid {os.getpid()}".encode())  # so the runner can kill the server it did not start
        control.detach()
        return serve_forks(control_fd)

    if os.fork() == 0:
        _end_child(server)
    os.close(control_fd)
    os.close(errors_fd)
    lower_priority(MEMORY_TIMELINE_NICENESS)


def _answer(sock, text: str) -> None:
    with contextlib.suppress(OSError):  # the runner gave up on this task: nothing to tell
        sock.sendall(text.encode() + b"\n")


def _kill_group(pid: int) -> None:
    with contextlib.suppress(OSError):  # gone already
        os.killpg(pid, signal.SIGKILL)


def _end_child(body: Callable[[], int]) -> NoReturn:
    """A forked child's life: `body()`, then its exit code (EXIT_CRASH, its traceback on stderr, if it
    raised) once its output is flushed, without the interpreter's teardown; never returns."""
    code = EXIT_CRASH
    try:
        code = body()
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _forked(
    env: dict, stdin: int, stdout: int, sockets: list, pidfds: list[int], server_pid: int
) -> NoReturn:
    """The forked task's process: made like a spawned worker's, then `serve_task`; never returns."""

    def task() -> int:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no task outlives the server
        if os.getppid() != server_pid:  # it died before that took hold
            os._exit(EXIT_CRASH)
        libc.prctl(15, FORKED_NAME.encode())  # PR_SET_NAME
        os.setsid()  # its own session, as a spawned worker's: a Ctrl-C in the terminal is not for it
        # Signal handlers are the server's, which sets none: Python's, as in a spawned worker.
        for sock in sockets:
            sock.close()
        for pidfd in pidfds:
            os.close(pidfd)
        os.dup2(stdin, 0)
        os.close(stdin)
        os.environ.clear()
        os.environ.update(env)  # the runner's environment now, as a spawned worker would get it
        os.set_inheritable(stdout, False)  # events only, held by no process the task starts (as os.dup's)
        return serve_task(os.fdopen(stdout, "w", buffering=1))

    _end_child(task)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown (seconds of freeing a loaded model object by object): the
    # capture is written and the events are flushed; the runner starts the next task on exit.
    os._exit(code)
