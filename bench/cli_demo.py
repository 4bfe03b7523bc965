"""The CLI's demo with every check against a bare import of its libraries, in the same run.

Issue 25's done-when: ``python -m core run --demo --target cpu/float32 cpu/bfloat16 --check
<every check>`` takes at most 4× a bare ``python -c "import torch, transformers, peft"``. Per
repetition, one after the other on the same machine: the bare import (wall clock of the whole
process), then the CLI run (wall clock of the whole process, on a home whose demo workspace was
built once beforehand, untimed: building it is not what is measured). Reported: each repetition's
times and ratio, the medians, and the ratio of the medians (the done-when figure).

Issue 36: the same for both worker paths (`core.engine.runners.worker_path`), the run made once per
path in each repetition after the same bare import: `WEIGHTDRIFT_WORKERS=cpu` (tasks forked from the fork
server, as on a machine without a GPU) and `WEIGHTDRIFT_WORKERS=gpu` (spawned spares imported ahead, as
where a GPU is visible); each run's `run.json` says which it took, and the measure checks it.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("cpu/float32", "cpu/bfloat16")
BARE_IMPORT = "import torch, transformers, peft"
TARGET_RATIO = 4.0
WORKER_PATHS = ("cpu", "gpu")


def every_check() -> list[str]:
    """The registry's checks, in its order (a new check is measured without touching this file)."""
    from core.checks import CHECKS

    return list(CHECKS)


def _timed(cmd: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run `cmd` from the repository root; its wall time, exit code and the end of its stderr."""
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {
            "wall_s": time.perf_counter() - started,
            "returncode": None,
            "timed_out": True,
            "stderr_tail": "",
        }
    return {
        "wall_s": time.perf_counter() - started,
        "returncode": proc.returncode,
        "timed_out": False,
        "stderr_tail": "\n".join(proc.stderr.strip().splitlines()[-5:]),
    }


def measure_cli_demo(
    repeats: int,
    timeout: float = 900.0,
    keep_home: bool = False,
    say: Callable[[str], None] = print,
    paths: tuple[str, ...] = WORKER_PATHS,
) -> dict[str, Any]:
    """`repeats` times: a bare import, then the CLI demo run with every check once per worker path in
    `paths`; per path its runs, medians and their ratio (`result["paths"][path]`)."""
    home = Path(tempfile.mkdtemp(prefix="weightdrift-bench-cli-"))
    env = {**os.environ, "WEIGHTDRIFT_HOME": str(home)}
    checks = every_check()
    run_cmd = [sys.executable, "-m", "core", "run", "--demo", "--target", *TARGETS, "--check", *checks]
    result: dict[str, Any] = {
        "command": " ".join(["python", *run_cmd[1:]]),
        "home": str(home),
        "paths": {path: {"runs": []} for path in paths},
    }
    try:
        say("cli demo: building the demo workspace (untimed)")
        built = _timed([sys.executable, "-m", "core", "demo"], env, timeout)
        if built["returncode"] != 0:
            result["error"] = f"demo build failed: {built['stderr_tail']}"
            return result
        for i in range(repeats):
            bare = _timed([sys.executable, "-c", BARE_IMPORT], env, timeout)
            for path in paths:
                runs_before = set((home / "runs").glob("*"))
                run = _timed(run_cmd, {**env, "WEIGHTDRIFT_WORKERS": path}, timeout)
                took = [_workers_of(d) for d in set((home / "runs").glob("*")) - runs_before]
                ok = bare["returncode"] == 0 and run["returncode"] in (0, 1) and took == [path]
                ratio = run["wall_s"] / bare["wall_s"] if ok and bare["wall_s"] > 0 else None
                result["paths"][path]["runs"].append(
                    {"bare_import": bare, "run": run, "ok": ok, "ratio": ratio}
                )
                say(
                    f"cli demo {i + 1}/{repeats}, {path} workers: import {bare['wall_s']:.1f} s, "
                    f"run {run['wall_s']:.1f} s"
                    + (f" ({ratio:.2f}×)" if ratio is not None else f" — failed: {took} {run['stderr_tail']}")
                )
    finally:
        if not keep_home:
            shutil.rmtree(home, ignore_errors=True)
    for runs in result["paths"].values():
        runs["summary"] = summarize(runs["runs"])
    return result


def _workers_of(run_dir: Path) -> str | None:
    """The worker path a run recorded in its run.json (None if unreadable)."""
    import json

    try:
        return json.loads((run_dir / "run.json").read_text()).get("workers")
    except (OSError, ValueError):
        return None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the repetitions that succeeded, the ratio of the medians against the target."""
    good = [r for r in runs if r["ok"]]
    if not good:
        return {"repeats_ok": 0, "failed": len(runs)}
    bare_med = statistics.median(r["bare_import"]["wall_s"] for r in good)
    run_med = statistics.median(r["run"]["wall_s"] for r in good)
    return {
        "repeats_ok": len(good),
        "failed": len(runs) - len(good),
        "bare_import_median_s": bare_med,
        "run_median_s": run_med,
        "ratio_of_medians": run_med / bare_med,
        "ratio_range": [min(r["ratio"] for r in good), max(r["ratio"] for r in good)],
        "target_ratio": TARGET_RATIO,
        "met": run_med / bare_med <= TARGET_RATIO,
    }


def cli_demo_table(result: dict[str, Any]) -> str:
    """Markdown: the medians, their ratio against the target, and each repetition."""
    s = result["summary"]
    if not s.get("repeats_ok"):
        return f"No repetition succeeded{': ' + result['error'] if result.get('error') else ''}."
    lines = [
        "| bare import median s | CLI demo (every check) median s | ratio of medians | per-run ratios | done when |",
        "|---|---|---|---|---|",
        f"| {s['bare_import_median_s']:.2f} | {s['run_median_s']:.2f} | {s['ratio_of_medians']:.2f} | "
        f"{s['ratio_range'][0]:.2f}–{s['ratio_range'][1]:.2f} ({s['repeats_ok']} ok, {s['failed']} failed) | "
        f"≤ {s['target_ratio']:g}× {'✓' if s['met'] else '✗'} |",
    ]
    return "\n".join(lines)
