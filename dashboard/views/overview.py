"""Overview: verdict counts per check and target, the worst rows explained, environments side by side."""

from __future__ import annotations

import streamlit as st

from core import report
from core.engine.pairwise import pair_matrix
from core.engine.store import ACTIVE_STATES
from dashboard.figures.common import environment_table, highlight_differences
from dashboard.figures.overview import groups_table, pairwise_figure, snapshot_sources, verdict_counts_figure
from dashboard.pages import page, result_pages
from dashboard.report import report_html
from dashboard.state import metrics_table, run_table, view_query
from dashboard.text import inert, literal, trusted
from dashboard.ui import METRIC_COLUMN_CONFIG, csv_download, downloads, finished_run

st.title(trusted(page("overview").title))
record = finished_run()
table = metrics_table(record)
if table.empty:
    st.warning("This run has no metric rows.")
    st.stop()

counts = report.verdict_counts(table)
bad = counts["drift"] + counts["broken"]
running = record.status in ACTIVE_STATES
judgement = None if running else record.judgement(table)
if judgement is not None:
    # the answer first: which targets agree, which are more than their dtype's rounding
    st.subheader("Which targets agree")
    gtable = groups_table(judgement.groups)
    st.dataframe(
        gtable,
        hide_index=True,
        key="overview.groups",
        column_config={
            "check": st.column_config.TextColumn("check", width="small"),
            "group": st.column_config.NumberColumn("group", width="small"),
            "targets": st.column_config.TextColumn("targets", width="medium"),
            "how it differs": st.column_config.TextColumn("how it differs", width="large"),
        },
    )
    csv_download(gtable, f"{record.run_id}-groups", key="overview.groups.csv")
    for rewrite in judgement.rewrites:  # base weights an adapter computed on the load device
        if rewrite.differing:
            st.warning(literal(rewrite.sentence()), icon=":material/call_split:")
        else:
            st.info(literal(rewrite.sentence()), icon=":material/info:")
    if record.spec is not None and record.spec.added_peers:
        st.caption(
            f"Added to this run as peers: {literal(', '.join(map(str, record.spec.added_peers)))} "
            "(the CPU target of a dtype, without flags, that its other targets are judged against)."
        )
    if judgement.unjudged:
        st.warning(f"No anomaly judgement: {literal(judgement.unjudged)}.", icon=":material/info:")
    elif judgement.anomalies:
        st.error(
            f"**{len(judgement.anomalies)} anomal{'y' if len(judgement.anomalies) == 1 else 'ies'}**: error over "
            f"{judgement.k:g}× the peer's on the same tensor\n\n"
            + "\n".join(f"- {literal(a.sentence())}" for a in judgement.anomalies),
            icon=":material/warning:",
        )
    else:
        st.success(
            f"**No anomaly**: every target's error is within {judgement.k:g}× its peer's on every tensor.",
            icon=":material/check_circle:",
        )
    for dtype, line in judgement.expected_lines().items():
        st.info(f"Drift as expected for {literal(dtype)}: {literal(line)}.", icon=":material/info:")
    if counts["broken"]:
        st.error(
            f"**{counts['broken']:d} rows broken** (NaN/Inf the reference lacks, all-zero, shape or key "
            "mismatch, an adapter PEFT would not load or run on a quantized base, a task past its time limit): "
            "the worst are explained below.",
            icon=":material/error:",
        )
if judgement is None or judgement.unjudged:
    if bad:
        st.error(
            f"**{bad:d} of {len(table)} rows are beyond tolerance** ({counts['drift']:d} drift, "
            f"{counts['broken']:d} broken). The worst are explained below; the result pages show where.",
            icon=":material/warning:",
        )
    else:
        st.success(
            f"All {len(table)} rows are identical or within tolerance.", icon=":material/check_circle:"
        )
cols = st.columns(4)
for col, verdict in zip(cols, report.VERDICT_ORDER, strict=True):
    col.metric(trusted(verdict.capitalize()), counts[verdict])
if not running:
    # the whole run in one file to attach to a bug: made only when clicked (`weightdrift report` writes the same)
    st.download_button(
        "Download the report (one HTML file)",
        data=lambda: report_html(record).encode(),
        file_name=f"weightdrift-{record.run_id}.html",
        mime="text/html",
        key="overview.report",
        icon=":material/download:",
        on_click="ignore",
    )

pages = result_pages(list(dict.fromkeys(table["check"])))
# one row that wraps, each link as wide as its label: equal columns cut "Open Adapter consistency" at 1280 px
links = st.container(horizontal=True)
for p in pages:
    links.page_link(p.script, label=f"Open {trusted(p.title)}", icon=p.icon, query_params=view_query())

st.subheader("Verdicts per check and target")
by = report.verdicts_by_check_target(table)
fig = verdict_counts_figure(by)
st.plotly_chart(inert(fig), key="overview.verdicts")
downloads(fig, by, f"{record.run_id}-verdicts", key="overview.verdicts")

pairs = run_table(record, "pairwise")
if not pairs.empty:
    st.subheader("Every target against every other")
    matrix = pair_matrix(pairs)
    st.caption(
        "Each cell: the worst verdict over the tensors and outputs both targets hold, and the largest max |Δ|. "
        "Weights are compared by content hash (≡ bitwise equal), so snapshots of machines that never meet "
        "compare without moving a tensor; ≠ marks tensors whose hashes differ where the values were not kept."
    )
    fig = pairwise_figure(matrix)
    st.plotly_chart(inert(fig), key="overview.pairwise")
    downloads(fig, pairs, f"{record.run_id}-pairwise", key="overview.pairwise")

st.subheader("Furthest from their reference")
worst = report.worst_rows(table, 20)
worst = worst.assign(adapter=worst["adapter"].fillna("base model")) if len(worst) else worst
if worst.empty:
    st.success("Every row is bitwise identical to its reference.")
else:
    st.dataframe(
        worst,
        hide_index=True,
        column_config={
            "explanation": st.column_config.TextColumn("explanation", width="large"),
            "note": st.column_config.TextColumn("why", width="large"),
            **METRIC_COLUMN_CONFIG,
        },
        key="overview.worst",
    )
    csv_download(worst, f"{record.run_id}-worst", key="overview.worst.csv")

notes = record.notes()
if notes:
    st.subheader("Notes from the workers")
    for note in notes:
        st.markdown(f"- {literal(note)}")

imported = record.imported()
if imported:
    st.subheader("Imported from snapshots")
    st.dataframe(snapshot_sources(imported), hide_index=True, key="overview.imported")
st.subheader("Environment per target")
envs = record.environments()
env = environment_table(envs)
n_diff = int(env["differs"].sum()) if len(env) else 0
st.caption(
    f"{n_diff:d} setting(s) differ between targets (highlighted). The reference "
    f"{literal(record.spec.reference if record.spec else 'cpu/float64')} is listed too."
    if n_diff
    else "Every target ran with the same environment."
)
st.dataframe(highlight_differences(env), key="overview.env")
csv_download(env.reset_index(), f"{record.run_id}-environment", key="overview.env.csv")
