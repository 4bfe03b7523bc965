"""The CLI's progress while a job runs: a live bar per task on a terminal (rich), plain lines
elsewhere (CI logs, a pipe), one per progress event; and stdout kept for the answer alone while a
command runs (`stdout_for_the_answer`). Reads a job through `wait`, `events_since` and `snapshot`
(core.engine.jobs.Job); imports nothing from core."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
from collections.abc import Iterator
from typing import TextIO

WIDTH = 20  # the plain lines' bar


def watch(job, stream: TextIO = sys.stderr, interval: float = 0.25, live: bool | None = None) -> None:
    """Show the job's progress on `stream` until it ends: live bars if `live` (default: whether
    `stream` is a terminal), else a line per progress event and one per task that did not succeed."""
    if live is None:
        live = stream.isatty()
    (_bars if live else _lines)(job, stream, interval)


def _lines(job, stream: TextIO, interval: float) -> None:
    seen = 0
    started = time.time()
    while True:
        done = job.wait(interval)
        events = job.events_since(seen)
        seen += len(events)
        for e in events:
            filled = int(WIDTH * e["step"] / e["of"]) if e["of"] else 0
            bar = "#" * filled + "." * (WIDTH - filled)
            elapsed = e["time"] - started
            print(
                f"{e['task']:28s} [{bar}] {e['step']:>2d}/{e['of']:<2d} {e['stage']} ({elapsed:.1f} s)",
                file=stream,
                flush=True,
            )
        if done:
            for name, t in job.snapshot()["tasks"].items():
                if t["state"] != "succeeded":
                    print(f"{name:28s} {t['state']}", file=stream, flush=True)
            return


def _bars(job, stream: TextIO, interval: float) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bars = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stage]}"),
        TimeElapsedColumn(),
        # a terminal by the caller's word (`live`), whatever rich would guess from `stream`
        console=Console(file=stream, force_terminal=True),
        refresh_per_second=8,
    )
    ids: dict[str, int] = {}
    running: set[str] = set()
    ended: set[str] = set()
    with bars:
        while True:
            done = job.wait(interval)
            for name, t in job.snapshot()["tasks"].items():
                if name not in ids:  # every task has its bar from the start, queued ones too
                    ids[name] = bars.add_task(name, start=False, total=None, stage="")
                if t["state"] != "queued" and name not in running:
                    bars.start_task(ids[name])
                    running.add(name)
                stage = t["stage"] if t["state"] == "running" else t["state"]
                bars.update(ids[name], total=t["of"] or None, completed=t["step"], stage=stage)
                if t["state"] not in ("queued", "running") and name not in ended:
                    bars.stop_task(ids[name])  # its clock stops where it ended
                    ended.add(name)
            if done:
                return


@contextlib.contextmanager
def stdout_for_the_answer() -> Iterator[TextIO]:
    """Within the block, what is written to stdout goes to stderr: a library's print(), its writes to file
    descriptor 1, and the output of the processes it starts (nvcc building PEFT's BOFT kernel on a GPU
    machine writes to descriptor 1 directly, two processes down). The caller writes its answer to the
    stream this yields; it reaches stdout alone once the block ends, so `--json` is one JSON document."""
    stdout = sys.stdout
    _flush(stdout, sys.stderr)
    saved: int | None = None
    with contextlib.suppress(OSError):  # a closed descriptor 1 or 2: nothing to divert
        saved = os.dup(1)
        os.dup2(2, 1)
    answer = io.StringIO()
    sys.stdout = sys.stderr
    try:
        yield answer
    finally:
        _flush(
            stdout, sys.__stdout__, sys.stderr
        )  # a library's buffered chatter: to stderr, before restoring
        sys.stdout = stdout
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)
        stdout.write(answer.getvalue())  # a closed pipe raises here, for the caller (`| head`)
        stdout.flush()


def _flush(*streams) -> None:
    for stream in streams:
        with contextlib.suppress(OSError, ValueError, AttributeError):  # closed, or None
            stream.flush()
