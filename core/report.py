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
