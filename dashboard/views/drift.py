"""Drift: layer × module heatmaps per target, coloured by log₁₀ of a metric; drill into one tensor."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from core import report
from dashboard.figures.common import (
    BASE,
    DRIFT_CHECKS,
    MARKS,
    METRIC_LABELS,
    VERDICT_SYMBOLS,
    colourable,
    drift_checks,
    drift_heatmap,
    mark_legend,
    metric_choices,
    selection_rows,
    severity,
    with_judgement,
)
from dashboard.pages import page
from dashboard.state import bound_select, metrics_table, set_view, view
from dashboard.text import literal, trusted
from dashboard.ui import (
    clickable_heatmap,
    downloads,
    element_diff_view,
    finished_run,
    still_running,
    verdict_box,
)

st.title(trusted(page("drift").title))
record = finished_run()
table = metrics_table(record)
per_tensor = drift_checks(table)
if not per_tensor:
    if record.status in ("queued", "running") and record.spec is not None:
        coming = [c for c in DRIFT_CHECKS if c in record.spec.checks]
        if coming:
            still_running(record, coming[0])
    st.info("This run has no per-tensor checks (weights, deltas); its other checks have their own pages.")
    st.stop()


c1, c2, c3 = st.columns([2, 2, 2])
worst_check = max(per_tensor, key=lambda c: severity(table[table["check"] == c]))
check = bound_select("Check", "check", per_tensor, default=worst_check, container=c1, horizontal=True)
rows = table[table["check"] == check]
adapters = [a for a in dict.fromkeys(rows["adapter"].dropna())]
choices = adapters + ([BASE] if rows["adapter"].isna().any() else [])
# Open on the selection that is furthest from its reference: that is what the user came for.
worst_choice = max(choices, key=lambda a: severity(selection_rows(rows, a)))
adapter = bound_select(
    "Adapter",
    "adapter",
    choices,
    default=worst_choice,
    container=c2,
    format_func=lambda a: a if a == BASE else f"{a} (with the base weights)" if check == "weights" else a,
)
metric = bound_select(
    "Colour by",
    "metric",
    metric_choices(rows),
    default="max_ulp" if check == "weights" else "rel_l2",
    container=c3,
    format_func=lambda m: METRIC_LABELS[m],
)
marks = bound_select(
    "Cells say", "marks", list(MARKS), default="judgement", format_func=MARKS.get, horizontal=True
)
shown = selection_rows(rows, adapter)
# a refused adapter's rows have no reference (`core.checks.base.refused_rows`)
reference = ", ".join(r for r in dict.fromkeys(shown["reference"]) if isinstance(r, str) and r)
st.caption(
    f"{len(shown)} tensors"
    + (f" against **{literal(reference)}**" if reference else "")
    + f" · colour: log₁₀ {literal(METRIC_LABELS[metric])} · "
    "symbols: "
    + literal(mark_legend(marks))
    + " · blank cells: exactly 0 or no such tensor. Click a cell to inspect it."
)

marked = with_judgement(shown) if marks == "judgement" else shown
fig = drift_heatmap(
    colourable(marked, metric), metric, title=f"{check} · {adapter} · {METRIC_LABELS[metric]}"
)
clickable_heatmap(fig, key="drift.heatmap")
downloads(fig, shown, f"{record.run_id}-{check}-{adapter}-{metric}", key="drift.heatmap")

st.subheader("Inspect one tensor")
targets = list(dict.fromkeys(shown["target"]))
p1, p2 = st.columns([1, 3])
worst_target = max(targets, key=lambda t: severity(shown[shown["target"] == t]))
target = bound_select("Target", "target", targets, default=worst_target, container=p1)
candidates = shown[shown["target"] == target].assign(
    _sev=lambda t: t["verdict"].map(report.SEVERITY),
    _val=lambda t: pd.to_numeric(t[metric], errors="coerce").fillna(-1.0),
)
candidates = candidates.sort_values(["_sev", "_val"], ascending=False)
by_name = {r["tensor"]: r for r in candidates.to_dict(orient="records")}
tensor = bound_select(
    "Tensor (worst first)",
    "tensor",
    list(by_name),
    container=p2,
    format_func=lambda n: (
        f"{VERDICT_SYMBOLS[by_name[n]['verdict']]} {n} · {metric} {by_name[n][metric]:.4g}"
        if pd.notna(by_name[n][metric])
        else f"{VERDICT_SYMBOLS[by_name[n]['verdict']]} {n}"
    ),
)
if tensor is None:
    st.stop()
row = by_name[tensor]
if view("tensor") != tensor:
    set_view("tensor", tensor)

# a row of an adapter PEFT refused on the target has no reference, dtype or shape
against = f" vs {row['reference']}" if row.get("reference") else ""
what = " ".join(str(row[c]) for c in ("dtype", "shape") if pd.notna(row.get(c)) and row.get(c))
verdict_box(
    row["verdict"],
    f"{tensor} on {target}{against}"
    + (f" · {what}" if what else "")
    + f"\n{row['explanation']}"
    + (f"\nWhy: {row['note']}" if row.get("note") else ""),
)
if not row["numel"]:  # nothing of it was measured (`core.checks.base.refused_rows`)
    st.stop()
m = st.columns(5)
m[0].metric("max |Δ|", f"{row['max_abs']:.4e}" if pd.notna(row["max_abs"]) else "—")
m[1].metric("relative L2", f"{row['rel_l2']:.4e}" if pd.notna(row["rel_l2"]) else "—")
m[2].metric("max ulp", f"{row['max_ulp']:.4g}" if pd.notna(row["max_ulp"]) else "—")
m[3].metric(
    f"atol needed at rtol {row['rtol']:g}",
    f"{row['min_atol']:.3e}" if pd.notna(row["min_atol"]) else "—",
    help="The smallest atol with which this tensor passes at the row's rtol (0: rtol alone covers it).",
)
mismatched = int(row["n_mismatch"]) if pd.notna(row["n_mismatch"]) else "—"
m[4].metric("mismatched", f"{mismatched} / {int(row['numel'])}")


adapter_of_row = row["adapter"] if isinstance(row["adapter"], str) else None
element_diff_view(
    record,
    check,
    target,
    adapter_of_row,
    tensor,
    title=f"|Δ| element-wise · {tensor} · {target}",
    exact=f"Every element of {tensor} on {target} equals its reference exactly: nothing to map.",
    key="drift",
)
