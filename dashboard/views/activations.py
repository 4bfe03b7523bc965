"""Activations: where in the forward pass each target parts from the float64 reference.

Depth × module-role heatmaps per target (accumulated or local drift), the metric over depth, the
first divergence named and marked; click a cell for that module output's |Δ| map and histogram.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from core.checks.activations import ACCUMULATED, LOCAL_DRIFT, NAME, first_divergences
from dashboard.figures.activations import activations_heatmap, depth_line_chart
from dashboard.figures.common import (
    BASE,
    MARKS,
    METRIC_LABELS,
    VERDICT_SYMBOLS,
    colourable,
    mark_legend,
    metric_choices,
    with_judgement,
)
from dashboard.pages import page
from dashboard.state import bound_select, metrics_table, set_view, view
from dashboard.text import inert, literal, trusted
from dashboard.ui import (
    check_not_run,
    clickable_heatmap,
    downloads,
    element_diff_view,
    finished_run,
    scenario_buttons,
    verdict_box,
)

DRIFTS = {
    ACCUMULATED: "accumulated (the target's own forward)",
    LOCAL_DRIFT: "local (each module alone, on the reference's input)",
}

st.title(trusted(page("activations").title))
record = finished_run(NAME, "activations")
table = metrics_table(record)
rows = table[table["check"] == NAME] if len(table) else table
if rows.empty:
    check_not_run(record, NAME, "activations", "This run did not run the `activations` check.")
scenario_buttons("activations")

adapters = [a for a in dict.fromkeys(rows["adapter"].dropna())]
choices = ([BASE] if rows["adapter"].isna().any() else []) + adapters
c1, c3 = st.columns(2)
adapter = bound_select("Adapter", "adapter", choices, default=choices[0], container=c1)
metric = bound_select(
    "Colour by",
    "metric",
    metric_choices(table),
    default="rel_l2",
    container=c3,
    format_func=lambda m: METRIC_LABELS[m],
)
# a row of its own: in a column beside the others, its options' labels were cut at 1280 px
drift = bound_select(
    "Drift", "drift", list(DRIFTS), default=ACCUMULATED, format_func=DRIFTS.get, horizontal=True
)
marks = bound_select(
    "Cells say", "marks", list(MARKS), default="judgement", format_func=MARKS.get, horizontal=True
)
shown = rows[rows["adapter"].isna()] if adapter == BASE else rows[rows["adapter"] == adapter]

# Lead with the finding: where each target first parts from the reference.
divergences = first_divergences(shown)
parted = {d.target for d in divergences}
for d in divergences:
    st.warning(literal(d.sentence()), icon=":material/call_split:")
for target in dict.fromkeys(shown["target"]):
    if target not in parted:
        st.success(literal(f"{target} stays within tolerance of the reference at every module."))
st.caption(
    f"{literal(shown['module_path'].nunique())} module outputs on the probe against "
    f"**{literal(', '.join(dict.fromkeys(shown['reference'])))}** · colour: log₁₀ {literal(METRIC_LABELS[metric])}"
    " · red ring: first divergence · symbols: "
    + literal(mark_legend(marks))
    + " · blank cells: exactly 0 or no such module. Click a cell to inspect it."
)

fig = activations_heatmap(
    colourable(with_judgement(shown) if marks == "judgement" else shown, metric),
    metric,
    drift,
    divergences,
    title=f"{adapter} · {drift} drift · {metric}",
)
clickable_heatmap(fig, key="activations.heatmap")
part = shown[shown["drift"] == drift].sort_values(["target", "order"])
downloads(fig, part, f"{record.run_id}-activations-{adapter}-{drift}-{metric}", key="activations.heatmap")

line = depth_line_chart(shown, metric, drift, divergences)
st.plotly_chart(inert(line), key="activations.depth")
downloads(line, part, f"{record.run_id}-activations-depth-{drift}-{metric}", key="activations.depth")

st.subheader("Inspect one module output")
targets = list(dict.fromkeys(part["target"]))
p1, p2 = st.columns([1, 3])
first_parted = next((d.target for d in divergences), targets[0] if targets else None)
target = bound_select("Target", "target", targets, default=first_parted, container=p1)
mine = part[part["target"] == target]
by_name = {r["tensor"]: r for r in mine.to_dict(orient="records")}
mark = next((d for d in divergences if d.target == target), None)
default_tensor = None
if mark is not None:
    default_tensor = next((n for n, r in by_name.items() if r["order"] == mark.order), None)
tensor = bound_select(
    "Module output (execution order)",
    "tensor",
    list(by_name),
    default=default_tensor,
    container=p2,
    format_func=lambda n: (
        f"{VERDICT_SYMBOLS.get(by_name[n]['verdict'], '?')} {int(by_name[n]['order'])}. {n}"
        + (f" · {metric} {by_name[n][metric]:.3g}" if pd.notna(by_name[n][metric]) else "")
    ),
)
if tensor is None:
    st.stop()
row = by_name[tensor]
if view("tensor") != tensor:
    set_view("tensor", tensor)
verdict_box(
    row["verdict"],
    f"{tensor} on {target} vs {row['reference']} · {row['drift']} · {row['dtype']} {row['shape']}\n"
    f"{row['explanation']}" + (f"\nWhy: {row['note']}" if row.get("note") else ""),
)
m = st.columns(4)
m[0].metric("max |Δ|", f"{row['max_abs']:.4e}" if pd.notna(row["max_abs"]) else "—")
m[1].metric("relative L2", f"{row['rel_l2']:.4e}" if pd.notna(row["rel_l2"]) else "—")
m[2].metric("cos sim", f"{row['cos_sim']:.8f}" if pd.notna(row.get("cos_sim")) else "—")
m[3].metric("mismatched", f"{int(row['n_mismatch'] or 0)} / {int(row['numel'])}")
element_diff_view(
    record,
    NAME,
    target,
    row["adapter"] if isinstance(row["adapter"], str) else None,
    tensor,
    title=f"|Δ| element-wise · {tensor} · {target}",
    exact=f"Every element of {tensor} on {target} equals the reference's exactly: nothing to map.",
    key="activations",
)
