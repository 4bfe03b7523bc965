"""Summaries of a metrics table: verdict counts and the worst rows, for the CLI and the dashboard."""

from __future__ import annotations

from typing import Any

import pandas as pd

VERDICT_ORDER = ("identical", "within tolerance", "drift", "broken")
SEVERITY = {v: i for i, v in enumerate(VERDICT_ORDER)}
WORST_COLUMNS = (
    "verdict",
    "check",
    "target",
    "reference",
    "adapter",
    "tensor",
    "role",
    "dtype",
    "max_abs",
    "rel_l2",
    "max_ulp",
    "min_atol",
    "explanation",
    "note",
)


def verdict_counts(table: pd.DataFrame) -> dict[str, int]:
    """Rows per verdict, every verdict present (0 where none)."""
    counts = table["verdict"].value_counts() if len(table) else pd.Series(dtype=int)
    return {v: int(counts.get(v, 0)) for v in VERDICT_ORDER}


def verdicts_by_check_target(table: pd.DataFrame) -> pd.DataFrame:
    """A check × target table of verdict counts (columns in severity order)."""
    if not len(table):
        return pd.DataFrame(columns=["check", "target", *VERDICT_ORDER])
    pivot = table.pivot_table(index=["check", "target"], columns="verdict", aggfunc="size", fill_value=0)
    for v in VERDICT_ORDER:
        if v not in pivot.columns:
            pivot[v] = 0
    return pivot[list(VERDICT_ORDER)].reset_index()


def worst_rows(table: pd.DataFrame, n: int = 10) -> pd.DataFrame:
    """The n rows furthest from their reference: by verdict severity, then relative error.

    Relative error ranks better than ulps: near-zero reference elements have tiny ulps, so
    max_ulp is large wherever values cross zero and says little about which tensor is worst.
    """
    if not len(table):
        return pd.DataFrame(columns=list(WORST_COLUMNS))
    ranked = table.assign(
        _sev=table["verdict"].map(SEVERITY).fillna(len(SEVERITY)),
        _rel=pd.to_numeric(table["rel_l2"], errors="coerce").fillna(float("inf")),
    )
    ranked = ranked[ranked["verdict"] != "identical"]
    ranked = ranked.sort_values(["_sev", "_rel"], ascending=False).head(n)
    return ranked[[c for c in WORST_COLUMNS if c in ranked.columns]].reset_index(drop=True)


def exit_code(table: pd.DataFrame) -> int:
    """0 when every row is identical or within tolerance, 1 when any is drift or broken."""
    return 1 if table["verdict"].isin(["drift", "broken"]).any() else 0


def records(table: pd.DataFrame) -> list[dict[str, Any]]:
    """JSON-safe row dicts (NaN → None)."""
    clean = table.astype(object).where(pd.notna(table), None)
    return clean.to_dict(orient="records")


# bitsandbytes formats as a target string names them (`core.spec.QUANTIZED_FORMATS`; this module imports
# nothing from core)
_QUANTIZED = ("nf4", "fp4", "int8")


def _format(target: str) -> str:
    """The dtype part of a target string: `cpu/nf4+compute=bfloat16` → `nf4`."""
    return target.split("+")[0].rsplit("/", 1)[-1]


def served_elsewhere(pairwise: pd.DataFrame) -> list[str]:
    """A sentence per adapter, quantized target and float target of a run's pairwise table (`pairwise.parquet`):
    how far the adapter's outputs on the float base move from what the quantized model gives (an adapter
    trained on a 4-bit base and served on a bfloat16 one). Empty when the run has no such pair."""
    if pairwise.empty:
        return []
    rows = pairwise[(pairwise["check"] == "outputs") & pairwise["adapter"].notna()]
    sentences = []
    for r in rows.to_dict(orient="records"):
        a, b = r["target"], r["other"]
        if (_format(a) in _QUANTIZED) == (_format(b) in _QUANTIZED):
            continue
        quantized, served = (a, b) if _format(a) in _QUANTIZED else (b, a)
        sentences.append(
            f"{r['adapter']} served on {served} instead of {quantized}: its {r['tensor']} move by "
            f"{r['max_abs']:.3g} (max |Δ|, relative L2 {r['rel_l2']:.3g}) from what the {_format(quantized)} "
            "model gives"
        )
    return sentences


def summary_lines(
    run_id: str, run_dir: Any, duration: float | None, table: pd.DataFrame, top: int, answer: list[str] = ()
) -> list[str]:
    """The CLI's human summary: the answer first (agreement groups, anomalies, the drift each dtype's
    rounding explains, where targets part: the caller's `answer` lines), then verdict counts per check
    and target and each check's worst rows."""
    lines = [f"\nrun {run_id} succeeded in {duration:.1f} s — {run_dir}", *answer]
    counts = verdict_counts(table)
    lines.append("rows: " + " · ".join(f"{n} {v}" for v, n in counts.items()))
    by = verdicts_by_check_target(table)
    lines.append("\nverdicts per check and target:")
    lines.append(f"  {'check':8s} {'target':28s} " + " ".join(f"{v:>16s}" for v in VERDICT_ORDER))
    for row in by.to_dict(orient="records"):
        counted = " ".join(f"{int(row[v]):>16d}" for v in VERDICT_ORDER)
        lines.append(f"  {row['check']:8s} {row['target']:28s} {counted}")
    for check in dict.fromkeys(table["check"]):
        worst = worst_rows(table[table["check"] == check], top)
        if not len(worst):
            # what "identical" means is the check's own word (bitwise equal, every byte where asked, …)
            said = table.loc[table["check"] == check, "explanation"].dropna().unique()
            lines.append(
                f"\n{check}: every row is identical to its reference"
                + (f": {said[0]}" if len(said) == 1 else ".")
            )
            continue
        lines.append(f"\n{check}: {len(worst)} row(s) furthest from their reference")
        for r in records(worst):
            who = r.get("adapter") or "base"
            # a refused adapter's row has no reference and no dtype
            against = f" vs {r['reference']}" if r.get("reference") else ""
            dtype = f" ({r['dtype']})" if r.get("dtype") else ""
            lines.append(f"  [{r['verdict']}] {r['target']}{against} · {who} · {r['tensor']}{dtype}")
            lines.append(f"      {r['explanation']}")
            if r.get("note"):
                lines.append(f"      why: {r['note']}")
    return lines
