"""What the CLI prints about a run: its progress while it goes, its summary when it ends."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any


def watch(job, stream=sys.stderr, interval: float = 0.25) -> None:
    """Print every progress event (task, step k of n, stage, elapsed) to `stream` until the job ends."""
    seen = 0
    started = time.time()
    width = 20
    while True:
        done = job.wait(interval)
        events = job.events_since(seen)
        seen += len(events)
        for e in events:
            filled = int(width * e["step"] / e["of"]) if e["of"] else 0
            bar = "#" * filled + "." * (width - filled)
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


def print_summary(
    run_id: str, run_dir: Path, duration: float | None, table, top: int, answer: list[str] = ()
) -> None:
    """The human summary: the answer first (agreement groups, anomalies, the drift each dtype's rounding
    explains: `Judgement.lines`), then verdict counts per check and target and each check's worst rows."""
    from core import report

    print(f"\nrun {run_id} succeeded in {duration:.1f} s — {run_dir}")
    for line in answer:
        print(line)
    for sentence in first_divergence(table).get("first_divergence", {}).values():
        print(sentence)
    counts = report.verdict_counts(table)
    print("rows: " + " · ".join(f"{n} {v}" for v, n in counts.items()))
    by = report.verdicts_by_check_target(table)
    print("\nverdicts per check and target:")
    print(f"  {'check':8s} {'target':28s} " + " ".join(f"{v:>16s}" for v in report.VERDICT_ORDER))
    for row in by.to_dict(orient="records"):
        line = " ".join(f"{int(row[v]):>16d}" for v in report.VERDICT_ORDER)
        print(f"  {row['check']:8s} {row['target']:28s} {line}")
    for check in dict.fromkeys(table["check"]):
        worst = report.worst_rows(table[table["check"] == check], top)
        if not len(worst):
            # what "identical" means is the check's own word (bitwise equal, every byte where asked, …)
            said = table.loc[table["check"] == check, "explanation"].dropna().unique()
            print(
                f"\n{check}: every row is identical to its reference"
                + (f": {said[0]}" if len(said) == 1 else ".")
            )
            continue
        print(f"\n{check}: {len(worst)} row(s) furthest from their reference")
        for r in report.records(worst):
            who = r.get("adapter") or "base"
            print(
                f"  [{r['verdict']}] {r['target']} vs {r['reference']} · {who} · {r['tensor']} ({r['dtype']})"
            )
            print(f"      {r['explanation']}")
            if r.get("note"):
                print(f"      why: {r['note']}")


def first_divergence(table) -> dict[str, Any]:
    """{"first_divergence": {target (· adapter): sentence}} for a run with activations rows, else {}."""
    from core.checks.activations import NAME, first_divergences

    if not len(table) or NAME not in set(table["check"]):
        return {}
    found = {}
    for d in first_divergences(table):
        found[d.target + (f" · {d.adapter}" if d.adapter else "")] = d.sentence()
    targets = dict.fromkeys(table.loc[table["check"] == NAME, "target"])
    for target in targets:  # a target that never parts says so too
        if not any(k == target or k.startswith(target + " · ") for k in found):
            found[target] = f"{target} stays within tolerance of the reference at every module"
    return {"first_divergence": found}
