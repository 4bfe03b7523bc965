"""The runner's side of the fork server (`core.engine.worker.serve_forks` is the server's): `ForkServer`
starts one and asks it for a process per task, `ForkedProcess` is such a process as the runner sees it
(docs/workers.md, "The fork server")."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from core.engine.worker import (
    FORK_SERVER_ARG,
    HOSTS_FORK_SERVER_ENV,
    REPO_ROOT,
    WITHOUT_BITSANDBYTES_ENV,
    worker_env,
)

# fork needs Linux here: pidfds to reap, /proc to count threads, SCM_RIGHTS to hand a task its pipes
FORKS = sys.platform == "linux" and hasattr(os, "pidfd_open") and hasattr(socket, "send_fds")


def signal_name(code: int) -> str:
    """The name of the signal a negative `Popen.returncode` says killed a process (SIGKILL, …)."""
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class ForkedProcess:
    """A task's process forked by a `ForkServer`, with what the runner uses of `subprocess.Popen`.

    Its pid and exit status come from the server (it is the server's child): `started` waits for
    the pid, or for the reason there is none (`refused`: the server refused or stopped)."""

    def __init__(self, answers: socket.socket, stdin, stdout, server: ForkServer):
        self.stdin, self.stdout, self._answers, self._server = stdin, stdout, answers, server
        self._buffer = b""
        self._lock = threading.Lock()
        self.pid: int | None = None
        self.threads: int | None = None  # the server's thread count just before it forked this one
        self.returncode: int | None = None
        self.refused: str | None = None
        self.server_lost = False  # the server stopped before it could say how this one ended

    def _read(self, timeout: float | None) -> bool:
        """Take in what the server said, waiting up to `timeout` seconds for something; False: nothing came."""
        try:
            if not select.select([self._answers], [], [], timeout)[0]:
                return False
        except (ValueError, OSError):  # closed: everything it will say was said
            return False
        with self._lock:  # the task's thread and kill_all's may both be reading
            try:
                data = self._answers.recv(4096, socket.MSG_DONTWAIT)
            except OSError:  # another thread took it, or closed the socket
                return False
            return self._take(data)

    def _take(self, data: bytes) -> bool:
        if not data:
            self._answers.close()
            if self.pid is None:
                self._server.wait(1)  # to say how it ended
                self.refused = f"the fork server stopped{self._server.exit_text()}"
            elif self.returncode is None:  # a forked task dies with its server (PR_SET_PDEATHSIG)
                self.returncode, self.server_lost = -signal.SIGKILL, True
            return True
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            word, _, rest = line.decode().partition(" ")
            if word == "pid":
                pid, threads = rest.split()
                self.pid, self.threads = int(pid), int(threads)
            elif word == "exit":
                self.returncode = int(rest)
            elif word == "refused":
                self.refused = rest
        return True

    def started(self, timeout: float | None = None) -> bool:
        """Whether it was forked (its pid is known), waiting up to `timeout` seconds to know."""
        if self.pid is None and self.refused is None:
            self._read(timeout)
        return self.pid is not None

    def poll(self) -> int | None:
        while self.returncode is None and self._read(0):
            pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            if self.refused is not None:
                self.returncode = -signal.SIGKILL  # never forked, never will be
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired("forked task", timeout or 0)
            self._read(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.pid is not None and self.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # exited; the server's answer is on its way
                os.kill(self.pid, sig)

    def kill(self) -> None:
        if self.pid is None:
            self.stdin.close()  # forked later, it reads no task and exits
            self._answers.close()
            self.refused = self.refused or "given up before it was forked"
            return
        if self.returncode is None:
            # the process (its group may not exist yet: it makes it first thing), then its group
            for kill in (os.kill, os.killpg):
                with contextlib.suppress(ProcessLookupError):
                    kill(self.pid, signal.SIGKILL)


class ForkServer:
    """The fork server: a process that imported torch, transformers, PEFT, the task code and the
    compiled kernel once (never CUDA) and forks a process per task (`core.engine.worker.serve_forks`),
    so no task waits for its imports.

    Its own `python -m core.engine.worker --fork-server` process, or (`host`) forked from a memory
    timeline's fresh interpreter once that has imported the libraries (`core.engine.worker.fork_server_here`):
    `host(fds, env)` spawns that interpreter with the server's socket and error file among `fds` and
    `env`. A hosted server is not this process's child: it says its pid on the socket, and is alive
    while the socket is open at its end. `without_bitsandbytes`: a server that imports PEFT and
    transformers as if bitsandbytes were absent: the GPU machines' (its import initialises CUDA), and one
    whose tasks load no quantized target (its import takes ~2 CPU-s, inductor's among them)."""

    def __init__(
        self,
        python: str,
        host: Callable[[list[int], dict[str, str]], subprocess.Popen] | None = None,
        without_bitsandbytes: bool = False,
    ):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # what it prints (an import error) stays readable for the log of the task it fails
        self.errors = tempfile.TemporaryFile()  # noqa: SIM115  (closed by `stop`)
        self.proc: subprocess.Popen | None = None
        self.host: subprocess.Popen | None = None
        self._pid: int | None = None
        self._closed = False  # a hosted server's socket was closed at its end
        with theirs:
            if host is None:
                self.proc = subprocess.Popen(
                    [python, "-m", "core.engine.worker", FORK_SERVER_ARG, str(theirs.fileno())],
                    pass_fds=[theirs.fileno()],
                    stdin=subprocess.DEVNULL,
                    stdout=self.errors,
                    stderr=self.errors,
                    cwd=str(REPO_ROOT),
                    env={**worker_env(False), WITHOUT_BITSANDBYTES_ENV: "1" if without_bitsandbytes else ""},
                    start_new_session=True,
                )
                self._pid = self.proc.pid
            else:
                fds = [theirs.fileno(), self.errors.fileno()]
                self.host = host(fds, {HOSTS_FORK_SERVER_ENV: ",".join(map(str, fds))})
        self.control = mine
        self.without_bitsandbytes = without_bitsandbytes
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The server's pid (None while a hosted one is not forked yet)."""
        self._hear()
        return self._pid

    def _hear(self) -> None:
        """Take what a hosted server said on its socket (its pid), or that the socket closed."""
        if self.proc is not None:
            return
        with self._lock:
            while not self._closed:
                try:
                    data = self.control.recv(64, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    return
                except OSError:  # closed here (`stop`)
                    self._closed = True
                    return
                if not data:
                    self._closed = True
                elif data.startswith(b"pid "):
                    self._pid = int(data.split()[1])

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        self._hear()
        return not self._closed

    def wait(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the server to end (no error if it does not)."""
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
            return
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.02)

    def exit_text(self) -> str:
        """How the server ended, and the end of what it printed ('' while it runs)."""
        if self.alive():
            return ""
        if self.proc is not None:
            code = self.proc.returncode
            how = f"was killed by {signal_name(code)}" if code < 0 else f"exited with code {code}"
        else:
            how = "stopped"  # not this process's child: its exit status is its host's to see
        printed = os.pread(self.errors.fileno(), 2000, max(0, os.fstat(self.errors.fileno()).st_size - 2000))
        text = printed.decode(errors="replace").strip()
        return f" (it {how})" + (f": …{text}" if text else "")

    def fork(self, env: dict[str, str]) -> ForkedProcess | None:
        """Ask for a task's process (answered while the server imports, if it still does); None
        when the server cannot take the request."""
        if not self.alive():
            return None
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        answers, theirs = socket.socketpair()
        try:
            with self._lock:
                socket.send_fds(
                    self.control, [json.dumps(env).encode()], [stdin_r, stdout_w, theirs.fileno()]
                )
        except OSError:
            for fd in (stdin_w, stdout_r):
                os.close(fd)
            answers.close()
            return None
        finally:  # the server holds its own copies now
            os.close(stdin_r)
            os.close(stdout_w)
            theirs.close()
        return ForkedProcess(answers, open(stdin_w, "wb"), open(stdout_r, "rb"), self)

    def stop(self) -> None:
        """Kill the server (its tasks die with it) and wait for it."""
        pid = self.pid
        self.control.close()  # a hosted server not forked yet exits on it once it is
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
        elif pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self._wait_gone(pid, 10)
        self.errors.close()

    @staticmethod
    def _wait_gone(pid: int, timeout: float) -> None:
        """Wait until process `pid` (not this one's child) has exited."""
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:  # gone already
            return
        try:
            select.select([pidfd], [], [], timeout)
        finally:
            os.close(pidfd)
