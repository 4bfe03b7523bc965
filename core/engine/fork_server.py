"""The fork server: a process that has imported what tasks need once (never CUDA) and forks one process
per task (docs/workers.md). `python -m core.engine.worker --fork-server FD` runs `serve_forks`; a memory
timeline's fresh interpreter can fork it once it has imported the libraries (`fork_server_here`)."""

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
from typing import NoReturn, TextIO

from core.engine.worker import (
    EXIT_CRASH,
    EXIT_OK,
    FORKED_NAME,
    MEMORY_TIMELINE_NICENESS,
    PREIMPORT_ENV,
    lower_priority,
    preimport,
    serve_task,
)


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
