"""Outputs: each target's logits against the float64 reference, with health flags."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard.figures.outputs import generations_side_by_side, kl_position_figure, outputs_figure
from dashboard.pages import page
from dashboard.state import metrics_table, run_table
from dashboard.text import inert, literal, trusted
from dashboard.ui import (
    METRIC_COLUMN_CONFIG,
    check_not_run,
    csv_download,
    figure_download,
    finished_run,
    scenario_buttons,
)

HEALTH = {
    "health_nan": "NaN",
    "health_inf": "Inf",
    "health_all_zero": "all zero",
    "health_identical_rows": "identical rows",
}

st.title(trusted(page("outputs").title))
record = finished_run("outputs", "outputs")
table = metrics_table(record)
rows = table[table["check"] == "outputs"] if len(table) else table
if rows.empty:
    check_not_run(record, "outputs", "outputs", "This run did not run the `outputs` check.")
scenario_buttons("outputs")  # e.g. generation-parts: where a target's generated text parts
rows = rows.assign(adapter=rows["adapter"].fillna("base model"))

st.caption(
    f"Logits on the run's fixed probe inputs (seed {literal(record.spec.seed if record.spec else '?')}) against "
    f"{literal(', '.join(dict.fromkeys(rows['reference'])))}, per target and adapter."
)
present = [c for c in HEALTH if c in rows.columns]


def flags(row: pd.Series) -> str:
    """The health problems of one output, in words."""
    found = [label for col, label in HEALTH.items() if col in row and bool(row[col]) and row[col] == row[col]]
    return ", ".join(found) or "healthy"


health = rows.assign(health=rows.apply(flags, axis=1))
unhealthy = health[health["health"] != "healthy"]
if len(unhealthy):
    st.error(
        "Unhealthy outputs: "
        + "; ".join(
            literal(f"{r['target']} · {r['adapter']}: {r['health']}")
            for r in unhealthy.to_dict(orient="records")
        ),
        icon=":material/heart_broken:",
    )
else:
    st.success("No NaN/Inf, no all-zero output, no identical rows on any target.", icon=":material/favorite:")

fig = outputs_figure(table[table["check"] == "outputs"])
st.plotly_chart(inert(fig), key="outputs.figure")
figure_download(fig, f"{record.run_id}-outputs", key="outputs.figure.html")

columns = [
    "target",
    "adapter",
    "verdict",
    "health",
    "max_abs",
    "rel_l2",
    "max_ulp",
    "min_atol",
    "cos_sim",
    "kl_mean",
    "kl_max",
    "top1_agree",
    "top5_overlap",
    "n_mismatch",
    "numel",
    "explanation",
    "note",
    *present,
]
view_rows = health[[c for c in columns if c in health.columns]]
st.dataframe(
    view_rows,
    hide_index=True,
    key="outputs.table",
    column_config={
        **METRIC_COLUMN_CONFIG,
        "cos_sim": st.column_config.NumberColumn(format="%.9f"),
        "explanation": st.column_config.TextColumn(width="large"),
    },
)
csv_download(view_rows, f"{record.run_id}-outputs", key="outputs.table.csv")

kl = run_table(record, "kl_positions")
if len(kl):
    st.subheader("Next-token distributions")
    st.caption(
        "KL(p_ref ‖ p_target) in float64 per position (padding excluded), for the target whose mean KL is the "
        "largest; kl_mean, kl_max, top1_agree and top5_overlap per target and adapter are in the table above."
    )
    kl_fig = kl_position_figure(kl)
    st.plotly_chart(inert(kl_fig), key="outputs.kl")

generations = run_table(record, "generations")
if len(generations):
    st.subheader("Generated text")
    st.caption(
        "Greedy decoding per target and adapter; ⟦ marks the first generated token that differs from the "
        "reference's. Texts are shown as text."
    )
    side = generations_side_by_side(generations)
    st.dataframe(side, hide_index=True, key="outputs.generations")
    csv_download(side, f"{record.run_id}-generations", key="outputs.generations.csv")
