"""Merge residuals: merged weights against W + ΔW in float64, outputs per merge stage, save round trip."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from core import report
from dashboard.figures.common import METRIC_LABELS, VERDICT_SYMBOLS, drift_heatmap, severity
from dashboard.figures.merge import (
    LEGACY_STAGES,
    MERGE_METRICS,
    method_summary,
    output_rows,
    relabel_legacy,
    stage_bars,
    stage_legend,
    stage_table,
    weight_rows,
    worst_modules,
)
from dashboard.pages import page
from dashboard.state import bound_select, metrics_table, run_table
from dashboard.text import inert, literal, trusted
from dashboard.ui import (
    METRIC_COLUMN_CONFIG,
    check_not_run,
    csv_download,
    downloads,
    element_diff_view,
    finished_run,
    scenario_buttons,
    verdict_box,
)

st.title(trusted(page("merge").title))
record = finished_run("merge", "merge")
table = metrics_table(record)
rows = table[table["check"] == "merge"] if len(table) else table
# An adapter whose merge rule the check does not cover, or that merging does not apply to (prompt
# learning), has no rows to pick: said first, once per adapter.
NO_MERGE = {"not covered": "Merge not covered", "does not apply": "Merge does not apply"}
all_findings = run_table(record, "merge_findings")
no_merge = all_findings[all_findings["finding"].isin(list(NO_MERGE))] if len(all_findings) else all_findings
pairs = zip(no_merge["finding"], no_merge["detail"], strict=True) if len(no_merge) else ()
for finding, detail in dict.fromkeys(pairs):
    st.info(f"**{trusted(NO_MERGE[finding])}**: {literal(detail)}", icon=":material/block:")
if rows.empty and not len(no_merge):
    check_not_run(record, "merge", "merge", "This run did not run the `merge` check (CLI: `--check merge`).")
scenario_buttons("merge")
for sentence in report.served_elsewhere(run_table(record, "pairwise")):  # the QLoRA served-elsewhere finding
    st.info(literal(sentence), icon=":material/compare_arrows:")
if rows.empty:
    st.stop()
rows, legacy = relabel_legacy(rows)
if legacy:
    st.info(
        "This run was stored before PEFT's default merge and safe_merge were measured apart: all its merges "
        "used safe_merge=True, and its merge_and_unload ran on weights already merged and unmerged. Its "
        "stages are shown under what they ran: "
        + literal(" · ".join(f"{old} → {new}" for old, new in LEGACY_STAGES.items())),
        icon=":material/history:",
    )


st.subheader("Every adapter and target at a glance")
save = run_table(record, "merge_save")
summary = method_summary(rows[rows["adapter"].isin([a.name for a in record.spec.adapters])], save)
st.caption(
    "Worst first. **weights**: the worst module merged by merge_adapter(), PEFT's default path "
    "(safe_merge=False), against W + ΔW in float64 (ulps at the tensor's scale, and max |Δ|) · "
    "**safe_merge weights**: the same for layer.merge(safe_merge=True) · **merged vs unmerged / vs fp64**: "
    "max |Δ| of the outputs of merge_and_unload() with PEFT's defaults, on the loaded weights · "
    "**roundtrip**: what unmerge_adapter() left on W · **reload identical**: the model saved and loaded "
    "again gives bitwise the same outputs."
)
st.dataframe(
    summary,
    hide_index=True,
    column_config={
        "weights_scale_ulp": st.column_config.NumberColumn("weights (ulps at scale)", format="%.3g"),
        "weights_max_abs": st.column_config.NumberColumn("weights max |Δ|", format="%.3e"),
        "safe_merge_max_abs": st.column_config.NumberColumn("safe_merge weights max |Δ|", format="%.3e"),
        "merged_vs_unmerged": st.column_config.NumberColumn("merged vs unmerged", format="%.3e"),
        "merged_vs_fp64": st.column_config.NumberColumn("merged vs fp64", format="%.3e"),
        "peft_verdict": st.column_config.TextColumn("at PEFT's tolerance"),
        "roundtrip_max_abs": st.column_config.NumberColumn("roundtrip max |Δ|", format="%.3e"),
        "reload_identical": st.column_config.CheckboxColumn("reload identical"),
    },
)
csv_download(summary, f"{record.run_id}-merge-summary", key="merge.summary.csv")
with st.expander("What each stage runs", expanded=False):
    st.caption(
        "Each stage starts from the state its name says: the loaded weights are cloned first and restored "
        "bit for bit (verified) before safe_merge and before merge_and_unload."
    )
    st.dataframe(stage_legend(output_rows(rows)["stage"]), hide_index=True)

# The run's own adapters (several merged together are shown in their own section below).
names = [a.name for a in record.spec.adapters] if record.spec else []
adapters = [a for a in dict.fromkeys(rows["adapter"].dropna()) if a in names]
c1, c2 = st.columns([2, 3])
adapter = bound_select(
    "Adapter",
    "adapter",
    adapters,
    default=max(adapters, key=lambda a: severity(rows[rows["adapter"] == a])),
    container=c1,
)
metric = bound_select(
    "Colour by",
    "metric",
    MERGE_METRICS,
    default="scale_ulp",
    container=c2,
    format_func=lambda m: METRIC_LABELS[m],
    help="**ulps at the tensor's scale**: max |merged − exact| in ulps (target dtype) of the tensor's "
    "largest magnitude max(|W|, |W + ΔW|); about 1 (a few where ΔW is a matmul) is rounding, tens "
    "or more an error beyond rounding. "
    "**max ulp** counts ulps of each exact element, huge wherever W + ΔW nearly cancels.",
)
mine = rows[rows["adapter"] == adapter]

# Findings first: what is broken and what to do.
findings = run_table(record, "merge_findings")
findings = findings[findings["adapter"] == adapter] if len(findings) else findings
# The detail is the library's own text (an exception message): shown as text, never as Markdown.
FINDING_TITLES = {
    "tied": "Tied weights",
    "nonfinite_merge": "NaN/Inf merged into W by PEFT's default merge",
    "safe_merge": "safe_merge refused",
    "merge_adapter": "merge_adapter() refused",
    "merge_and_unload": "merge_and_unload() refused",
    "restore": "Weights not restored bit for bit",
    "repacked": "Merged into 4-bit weights bitsandbytes had repacked for its fused CPU kernel",
}
for _, f in findings.iterrows():
    title = FINDING_TITLES.get(f["finding"])
    if title is None:
        st.info(f"{literal(f['finding'])} on {literal(f['target'])}:", icon=":material/info:")
    else:
        where = f" in {f['module']}" if f["module"] else ""
        icon = ":material/link:" if f["finding"] == "tied" else ":material/error:"
        st.error(f"**{literal(title)}**{literal(where)} on {literal(f['target'])}:", icon=icon)
    st.text(f["detail"])

st.subheader("Weight residual: merged W against W + ΔW (float64, from the checkpoints)")
paths = [s for s in ("merge_adapter", "safe_merge") if s in set(weight_rows(mine)["stage"])]
path = bound_select(
    "Merge path",
    "stage",
    paths,
    default=paths[0] if paths else None,
    help="**merge_adapter**: PEFT's default (safe_merge=False), what merge_adapter() and merge_and_unload() "
    "do · **safe_merge**: layer.merge(safe_merge=True), which refuses NaN/Inf. For LoRA on a bfloat16 or "
    "float16 base, whose adapter PEFT keeps in float32, safe_merge rounds ΔW to W's dtype before adding "
    "it; the default path adds the float32 ΔW and rounds once.",
)
merged = weight_rows(mine, stage=path)
tied = weight_rows(mine, role="tied", stage=path)
shown = pd.concat([merged, tied]) if len(tied) else merged
st.caption(
    f"{merged['tensor'].nunique():d} modules merged by {literal(path)} · colour: log₁₀ "
    f"{literal(METRIC_LABELS[metric])} in the target dtype (ulps at the tensor's scale: up to a few is the "
    "rounding of the merge's own sums and products, tens or more an error) · symbols: "
    + literal(" ".join(f"{VERDICT_SYMBOLS[v]} {v}" for v in report.VERDICT_ORDER))
)
fig = drift_heatmap(shown, metric, title=f"{path} · {adapter} · {METRIC_LABELS[metric]}")
st.plotly_chart(inert(fig), key="merge.heatmap")
downloads(fig, shown, f"{record.run_id}-merge-{adapter}-{path}-{metric}", key="merge.heatmap")

with st.expander("Worst modules, PEFT ΔW against the float64 formula, unmerge round trip", expanded=False):
    st.markdown("**Worst merged modules**")
    st.dataframe(worst_modules(shown, metric), column_config=METRIC_COLUMN_CONFIG, hide_index=True)
    for role, text in (
        (
            "delta",
            "PEFT's ΔW (get_delta_weight) against the float64 formula: a mismatch is a PEFT-level finding",
        ),
        (
            "roundtrip",
            "W after merge_adapter() + unmerge_adapter() (PEFT's default path) against W before: the round "
            "trip residual",
        ),
        (
            "modules_to_save",
            "The modules the adapter saves whole (modules_to_save), as merge_and_unload() puts them in place "
            "of the base's, against the adapter file: replaced, not merged",
        ),
    ):
        part = weight_rows(mine, role=role)
        if len(part):
            st.markdown(f"**{literal(text)}**")
            st.dataframe(worst_modules(part, metric), column_config=METRIC_COLUMN_CONFIG, hide_index=True)

st.subheader("Output residual per stage")
outs = output_rows(mine)
bars = stage_bars(outs, title=f"{adapter}: max |Δ| of outputs per stage (symbols: dtype default / PEFT tol)")
st.plotly_chart(inert(bars), key="merge.stages")
listed = stage_table(outs)
st.dataframe(listed, column_config=METRIC_COLUMN_CONFIG, hide_index=True)
downloads(bars, listed, f"{record.run_id}-merge-{adapter}-stages", key="merge.stages")

subset = rows[rows["stage"].astype(str).str.startswith("subset")]
if len(subset):
    st.subheader("Several adapters: one after another against all at once")
    st.dataframe(stage_legend(subset["stage"]), hide_index=True)
    st.dataframe(stage_table(subset), column_config=METRIC_COLUMN_CONFIG, hide_index=True)
    csv_download(stage_table(subset), f"{record.run_id}-merge-subset", key="merge.subset.csv")

st.subheader("Save round trip")
mine_saved = save[save["adapter"] == adapter] if len(save) else save
if mine_saved.empty:
    st.info("No save round trip for this adapter (merge_and_unload was refused, or only cpu/float64 ran).")
else:
    st.caption(
        "The model merge_and_unload() returned (PEFT's defaults), saved, then loaded again on its target."
    )
    for _, s in mine_saved.iterrows():
        # Library errors, file and tensor names are shown as text, never as Markdown.
        if s["ok"]:
            st.success(
                f"**{literal(s['method'])}** on {literal(s['target'])}: saved", icon=":material/check:"
            )
        else:
            st.warning(
                f"**{literal(s['method'])}** on {literal(s['target'])}: failed", icon=":material/warning:"
            )
        lines = [s["error"]] if not s["ok"] else ([f"files: {s['files']}"] if s.get("files") else [])
        if s.get("reload_error"):
            lines.append(f"reload failed: {s['reload_error']}")
        if s["shared_tensors"]:
            lines.append(f"shared tensors: {s['shared_tensors']}")
        if s["fix"]:
            lines.append(f"fix: {s['fix']}")
        if lines:
            st.text("\n".join(lines))
    csv_download(mine_saved, f"{record.run_id}-merge-save", key="merge.save.csv")

st.subheader("Inspect one module's residual")
targets = list(dict.fromkeys(shown["target"]))
if not targets:
    st.stop()
p1, p2 = st.columns([1, 3])
target = bound_select("Target", "target", targets, container=p1)
cands = shown[shown["target"] == target].assign(
    _sev=lambda t: t["verdict"].map(report.SEVERITY), _val=lambda t: pd.to_numeric(t[metric], errors="coerce")
)
by_name = {
    r["tensor"]: r for r in cands.sort_values(["_sev", "_val"], ascending=False).to_dict(orient="records")
}
tensor = bound_select("Module (worst first)", "tensor", list(by_name), container=p2)
if tensor is None or tensor not in by_name:
    st.stop()
row = by_name[tensor]
verdict_box(row["verdict"], f"{tensor} on {target} vs {row['reference']} · {row['dtype']} {row['shape']}")
st.text(f"{row['explanation']}" + (f"\nWhy: {row['note']}" if row.get("note") else ""))


element_diff_view(
    record,
    "merge",
    target,
    adapter,
    tensor,
    title=f"|W_merged − (W + ΔW)| · {tensor} · {target}",
    exact=f"{tensor} on {target} equals its float64 reference exactly.",
    key="merge",
)
