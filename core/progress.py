"""The CLI's progress while a job runs: a live bar per task on a terminal (rich), plain lines
elsewhere (CI logs, a pipe), one per progress event. Reads a job through `wait`, `events_since`
and `snapshot` (core.engine.jobs.Job); imports nothing from core."""

from __future__ import annotations

import sys
import time
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
