"""``python -m bench``: the kernel and end-to-end benchmark of issue 13, the dashboard's
click on Run → first heatmap / last page, and the CLI's demo against a bare import, in one run.

Prints one Markdown table per part, with the date and the machine, and writes everything
measured (every repeat's summary, RSS timelines, where the run's time went) to a JSON file.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import cli_demo, dashboard, e2e, kernel
from bench.checkpoints import SIZES, STORAGE_DTYPES, cache_dir

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Environment variables that change numerics or speed; recorded so a figure can be explained.
RECORDED_ENV = (
    "OPENBLAS_CORETYPE",
    "OPENBLAS_L2_SIZE",
    "OPENBLAS_NUM_THREADS",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "ATEN_CPU_CAPABILITY",
    "WEIGHTDRIFT_HOME",
    "WEIGHTDRIFT_BENCH_CACHE",
)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench``."""
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="WeightDrift benchmark (issue 13): compare() against torch.equal / copy / naive "
        "float64 / allclose, and `core run` against plain load-plus-forward on synthetic Llamas.",
    )
    p.add_argument("--sizes", nargs="+", default=["100m", "400m", "1b"], choices=list(SIZES))
    p.add_argument(
        "--kernel-sizes",
        nargs="+",
        default=["64MiB", "256MiB", "1GiB"],
        help="float32 reference sizes for the kernel part (e.g. 64MiB 1GiB)",
    )
    p.add_argument("--cases", nargs="+", default=list(kernel.CASES), choices=list(kernel.CASES))
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per kernel method (median)")
    p.add_argument("--skip-kernel", action="store_true")
    p.add_argument("--skip-e2e", action="store_true")
    _repeated_part(
        p, "dashboard", "clicks on Run (demo workspace, real server, workers and headless Chromium)"
    )
    p.add_argument(
        "--dashboard-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="dashboard part: the longest wait for one run's heatmap, and for its end, seconds",
    )
    _repeated_part(
        p, "cli", "pairs of a bare `import torch, transformers, peft` and the demo with every check"
    )
    p.add_argument("--targets", nargs="+", default=list(e2e.DEFAULT_TARGETS), metavar="SPEC")
    p.add_argument("--storage-dtype", default="float32", choices=list(STORAGE_DTYPES))
    p.add_argument(
        "--extra-run-args",
        default="",
        metavar="ARGS",
        help='extra arguments for `core run`, one string: --extra-run-args="--keep-tensors"',
    )
    p.add_argument(
        "--cache", help="checkpoint cache (default $WEIGHTDRIFT_BENCH_CACHE or ~/.cache/weightdrift-bench)"
    )
    p.add_argument("--interval", type=float, default=0.1, help="RSS sampling interval, seconds")
    p.add_argument("--timeout", type=float, default=3600.0, help="per process, seconds")
    p.add_argument("--keep-homes", action="store_true", help="keep each run's temporary WEIGHTDRIFT_HOME")
    p.add_argument("--out", type=Path, help="JSON file (default bench/results/<date>.json)")
    return p


def _repeated_part(p: argparse.ArgumentParser, name: str, what: str) -> None:
    """`--NAME-runs N` (how many repetitions, 5 by default) and `--skip-NAME` for a part of the bench."""
    p.add_argument(f"--{name}-runs", type=int, default=5, metavar="N", help=f"{name} part: {what}")
    p.add_argument(f"--skip-{name}", action="store_true")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=e2e.REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def machine_info() -> dict[str, Any]:
    """CPU, cores, memory, library versions, thread settings, relevant env vars, git commit."""
    import peft
    import psutil
    import torch
    import transformers

    vm = psutil.virtual_memory()
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "hostname": platform.node(),
        "cpu_model": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "ram_bytes": vm.total,
        "ram_available_bytes_at_start": vm.available,
        "load_average_at_start": list(os.getloadavg()),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "env": {k: os.environ.get(k) for k in RECORDED_ENV},
        "git_commit": _git("rev-parse", "HEAD"),
        "git_branch": _git("rev-parse", "--abbrev-ref", "HEAD"),
        "git_dirty": bool(dirty) if dirty is not None else None,
    }


def machine_line(m: dict[str, Any]) -> str:
    """One line for the tables' heading."""
    env = ", ".join(
        f"{k}={v}" for k, v in m["env"].items() if v is not None and k.startswith(("OPENBLAS", "OMP", "MKL"))
    )
    return (
        f"{m['cpu_model']}, {m['usable_cores']} cores, {m['ram_bytes'] / 2**30:.1f} GiB RAM, "
        f"torch {m['torch']} ({m['torch_threads']} threads, {m['torch_cpu_capability']}), "
        f"transformers {m['transformers']}, peft {m['peft']}; load average at start "
        f"{m['load_average_at_start'][0]:.2f}; BLAS env: {env or 'none set'}; "
        f"commit {(m['git_commit'] or '?')[:10]}{' (dirty)' if m['git_dirty'] else ''}"
    )


def _ok(flag: bool | None) -> str:
    return "n/a" if flag is None else ("✓" if flag else "✗")


def kernel_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one row per (size, case), GB/s per method side by side, the done-when ratios."""
    head = "| size | case | " + " | ".join(f"{m} GB/s" for m in kernel.METHODS) + " | done-when ratios |"
    lines = [head, "|" + "---|" * (3 + len(kernel.METHODS))]
    for r in rows:
        if "skipped" in r:
            lines.append(
                f"| {r['size']} | all | "
                + " | ".join("–" for _ in kernel.METHODS)
                + f" | skipped: {r['skipped']} |"
            )
            continue
        rates = " | ".join(f"{r['timings'][m]['gbps']:.2f}" for m in kernel.METHODS)
        q = r["ratios"]
        if r["case"].startswith("identical"):
            (met,) = r["targets"].values()
            ratio = f"compare/equal throughput {q['compare_vs_equal_throughput']:.2f} (≥ {kernel.TARGET_IDENTICAL_VS_EQUAL:g}) {_ok(met)}"
        else:
            m1, m2 = r["targets"].values()
            ratio = (
                f"naive/compare {q['naive_over_compare']:.2f} (≥ {kernel.TARGET_NAIVE_SPEEDUP:g}) {_ok(m1)} · "
                f"compare/allclose {q['compare_over_allclose']:.2f} (≤ {kernel.TARGET_VS_ALLCLOSE:g}) {_ok(m2)}"
            )
        if not r["agreement_with_naive"]["agree"]:
            off = [k for k, v in r["agreement_with_naive"]["fields"].items() if not v]
            ratio += f" · differs from naive in {', '.join(off)}"
        lines.append(f"| {r['size']} | {r['case']} | {rates} | {ratio} |")
    return "\n".join(lines)


def _gb(n: float | None) -> str:
    return "–" if n is None else f"{n / 1e9:.2f}"


def _x(v: float | None, digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def e2e_table(results: list[dict[str, Any]]) -> str:
    """Markdown: one row per checkpoint size, baseline and run side by side with the ratios."""
    lines = [
        "| size | params | checkpoint GB | baseline load+fwd s (per dtype) | imports s | "
        "run wall s | run / baseline | run / baseline processes | peak RSS GB (tree, sampled) | "
        "largest process peak GB | RSS / ckpt | peak PSS GB (tree) / ckpt | run folder MB | folder / ckpt | exit |",
        "|" + "---|" * 15,
    ]
    for r in results:
        c, run, q = r["checkpoint"], r["run"], r["ratios"]
        per = " + ".join(
            f"{b['dtype']} {b['load_forward_s']:.1f}" for b in r["baselines"] if "load_forward_s" in b
        )
        imports = " / ".join(f"{b['import_s']:.1f}" for b in r["baselines"] if "import_s" in b)
        lines.append(
            f"| {r['size']} | {c['n_params'] / 1e6:.3g}M | {_gb(c['model_bytes'])} ({r['storage_dtype']}, "
            f"{c['shards']} shard{'s' if c['shards'] > 1 else ''}) | {per} = {_x(r['baseline_load_forward_sum_s'], 1)} | "
            f"{imports} | {run['wall_s']:.1f} | {_x(q['run_over_baseline'])} | "
            f"{_x(q.get('run_over_baseline_processes'))} | {_gb(run['peak_rss_tree'])} | "
            f"{_gb(run['max_process_hwm'])}{' (sampler missed it)' if run['sampler_missed_peak'] else ''} | "
            f"{_x(q['peak_rss_over_checkpoint'])} | "
            f"{_gb(run.get('peak_pss_tree'))} / {_x(q.get('peak_pss_over_checkpoint'))} | "
            f"{_x(run['run_bytes'] / 1e6 if 'run_bytes' in run else None, 1)} | "
            f"{_x(q['run_size_over_checkpoint'], 4)} | {run['returncode']}{' (timeout)' if run['timed_out'] else ''} |"
        )
    return "\n".join(lines)


def e2e_notes(results: list[dict[str, Any]]) -> str:
    """Per size: the done-when targets, and where the run's time went (engine tasks, slowest stages)."""
    out = []
    for r in results:
        marks = []
        for name, t in r["done_when"].items():
            where = "" if t["issue_sets_it_here"] else " (issue sets it at another size)"
            marks.append(f"{name}: {_x(t['value'], 3)} {_ok(t['met'])}{where}")
        out.append(f"- **{r['size']}**: " + " · ".join(marks))
        base_peaks = ", ".join(
            f"{b['dtype']} {_gb(b.get('peak_rss_bytes'))} GB"
            for b in r["baselines"]
            if b.get("peak_rss_bytes")
        )
        if base_peaks:
            out.append(f"  - baseline peak RSS (VmHWM): {base_peaks}")
        procs = sorted(r["run"].get("processes") or [], key=lambda p: -p["hwm"])[:4]
        if procs:
            out.append(
                "  - run's process peaks (VmHWM / anonymous, sampled): "
                + ", ".join(
                    f"`{p['cmd']}` ({p['first_s']:.0f}–{p['last_s']:.0f} s) {_gb(p['hwm'])} / "
                    f"{_gb(p.get('anon_peak'))} GB"
                    for p in procs
                )
            )
        tasks = r["run"].get("task_durations_s") or {}
        if tasks:
            out.append("  - engine tasks (s): " + ", ".join(f"{k} {v:.1f}" for k, v in tasks.items()))
        stages = r["run"].get("slowest_stages") or []
        if stages:
            out.append(
                "  - slowest stages: "
                + ", ".join(f"{s['task']} · {s['stage']} {s['duration_s']:.1f} s" for s in stages[:6])
            )
        if not r["run"]["ok"]:
            last = r["run"]["stderr_tail"].strip().splitlines()[-1:]
            out.append("  - run failed" + (f": {last[0]}" if last else ""))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Run the selected parts, print the tables, write the JSON file; 0 when every measurement ran."""
    args = build_parser().parse_args(argv)
    sizes_bytes = [kernel.parse_size(s) for s in args.kernel_sizes]
    extra = shlex.split(args.extra_run_args)
    now = dt.datetime.now().astimezone()
    out_path = args.out or RESULTS_DIR / f"{now:%Y-%m-%d_%H%M%S}.json"

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    machine = machine_info()
    result: dict[str, Any] = {
        "date": now.isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine,
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "cache": str(cache_dir(args.cache)),
    }
    started = time.perf_counter()
    failed = False
    if not args.skip_kernel:
        result["kernel"] = kernel.run_kernel(sizes_bytes, args.repeats, tuple(args.cases), say=say)
    if not args.skip_e2e:
        result["e2e"] = []
        for size in args.sizes:
            r = e2e.run_e2e_size(
                size,
                storage_dtype=args.storage_dtype,
                targets=tuple(args.targets),
                extra_args=extra,
                cache=args.cache,
                interval=args.interval,
                timeout=args.timeout,
                keep_home=args.keep_homes,
                say=say,
            )
            result["e2e"].append(r)
            failed = failed or not r["run"]["ok"]
    if not args.skip_dashboard and args.dashboard_runs > 0:
        result["dashboard"] = dashboard.measure_dashboard(
            args.dashboard_runs, timeout_s=args.dashboard_timeout, keep_home=args.keep_homes, say=say
        )
        d = result["dashboard"]
        failed = failed or bool(d.get("error")) or d["summary"]["failed"] > 0 or not d["runs"]
    if not args.skip_cli and args.cli_runs > 0:
        result["cli_demo"] = cli_demo.measure_cli_demo(
            args.cli_runs, timeout=args.timeout, keep_home=args.keep_homes, say=say
        )
        paths = result["cli_demo"]["paths"].values()
        failed = failed or any(p["summary"]["failed"] > 0 for p in paths) or "error" in result["cli_demo"]
    result["machine"]["load_average_at_end"] = list(os.getloadavg())
    result["total_s"] = time.perf_counter() - started

    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2, default=str) + "\n")

    print(f"## WeightDrift benchmark — {now:%Y-%m-%d %H:%M %Z}\n")
    print(f"Machine: {machine_line(machine)}; load average at end {machine['load_average_at_end'][0]:.2f}.\n")
    if "kernel" in result:
        print(f"### Kernel (median of {args.repeats} repeats; GB/s over both inputs' bytes)\n")
        print(kernel_table(result["kernel"]) + "\n")
    if "e2e" in result:
        print(
            f"### End to end: `core run --target {' '.join(args.targets)}` (+ cpu/float64 reference)"
            f"{' ' + ' '.join(extra) if extra else ''} against plain load + PEFT + forward per target dtype\n"
        )
        print(e2e_table(result["e2e"]) + "\n")
        print(e2e_notes(result["e2e"]) + "\n")
    if "dashboard" in result:
        d = result["dashboard"]
        print(
            f"### Dashboard: click on Run → first heatmap and → last page ({len(d['runs'])} runs, "
            "demo workspace, default form, `python -m dashboard` + headless Chromium)\n"
        )
        if d.get("error"):
            print(f"Failed: {d['error']}\n")
        print(dashboard.dashboard_table(d) + "\n")
        print(dashboard.dashboard_notes(d) + "\n")
    if "cli_demo" in result:
        print(
            f'### CLI: `{result["cli_demo"]["command"]}` against `python -c "{cli_demo.BARE_IMPORT}"` '
            f"({args.cli_runs} repetitions, medians), per worker path\n"
        )
        for path, runs in result["cli_demo"]["paths"].items():
            print(f"`WEIGHTDRIFT_WORKERS={path}`:\n\n" + cli_demo.cli_demo_table(runs) + "\n")
    print(f"Everything measured: {out_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
