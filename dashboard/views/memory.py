"""Memory placement: memory per device index at every load stage, stray devices, leaks, and where
every parameter and buffer lives, one panel per load strategy."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from core.checks.memory import VARIANTS
from core.models.loading import PEFT_WARNED
from core.models.memory import PEFT_PREFIX, adapter_device_summary
from dashboard.figures.memory import (
    CUDA_METRICS,
    flag_summary,
    flags_table,
    leak_table,
    module_device_heatmap,
    panels,
    timeline_heatmap,
    workspace_devices,
)
from dashboard.pages import page
from dashboard.state import bound_select, metrics_table, run_table
from dashboard.text import inert, literal, trusted
from dashboard.ui import check_not_run, csv_download, downloads, finished_run, scenario_buttons

st.title(trusted(page("memory").title))
record = finished_run("memory", "memory")
timeline = run_table(record, "memory_timeline")
placement = run_table(record, "placement")
table = metrics_table(record)
rows = table[table["check"] == "memory"] if len(table) else table
if timeline.empty and rows.empty:
    check_not_run(
        record,
        "memory",
        "memory",
        "This run did not run the `memory` check (add it in the sidebar's form, or use a demo scenario).",
    )
scenario_buttons("memory")

cuda = sorted({d for d in timeline["device"] if d != "cpu"}) if len(timeline) else []
st.caption(
    "Each load strategy ran in a fresh worker process, sampled at every stage: process start, after "
    "`import torch`, after the imports, after the base load, after each adapter load, after the first "
    "forward, after merging, and after unloading and cleaning up (`del`, `gc.collect()`, releasing the "
    "library workspaces, `empty_cache()`)."
)
if not cuda:
    st.caption(
        "No CUDA device was sampled (none on the machine that ran it): the timeline is the process's "
        "resident memory (RSS) per stage and every tensor lives on the CPU."
    )
variants = list(dict.fromkeys(rows["variant"].fillna(""))) if "variant" in rows else []
if variants:
    st.caption(
        "Load strategies: "
        + " · ".join(f"**{literal(v or 'base only')}**: {literal(VARIANTS.get(v, v))}" for v in variants)
    )
flags = flags_table(table)
if len(flags):
    st.error(
        f"{len(flags)} finding(s):\n" + "\n".join(f"- {literal(line)}" for line in flag_summary(flags)),
        icon=":material/memory:",
    )
else:
    st.success(
        "Every tensor and every byte on the device asked for, no layer on two devices, no tensor memory "
        "left after cleanup.",
        icon=":material/check_circle:",
    )
# After the finding: the run's own notes, then what the libraries printed while loading, folded away
# (PEFT's "Failed to load the CUDA extension: CUDA_HOME …" says nothing about placement).
notes = [n for n in dict.fromkeys("; ".join(rows["note"].dropna()).split("; ")) if n] if len(rows) else []
notes = [n for n in notes if n not in VARIANTS.values()]
for note in (n for n in notes if PEFT_WARNED not in n):
    st.caption(f"Note: {literal(note)}")
warned = [n for n in notes if PEFT_WARNED in n]
if warned:
    with st.expander(f"warnings while loading ({len(warned)})"):
        for note in warned:
            st.caption(literal(note))

st.subheader("Memory per load stage and device")
metric = "driver_used"
if cuda:
    metric = bound_select(
        "CUDA figure",
        "metric",
        list(CUDA_METRICS),
        default="driver_used",
        format_func=lambda m: CUDA_METRICS[m],
        horizontal=True,
        help="The driver's figure counts the CUDA context, which PyTorch's allocator does not see.",
    )
if workspace_devices(timeline):
    st.caption(
        "**workspaces** columns: what cuBLAS (and cuBLASLt, which shares it) holds on that device, part of "
        "its allocated bytes. Torch makes one at the first matmul and keeps it to the process's end; the "
        "timeline releases it after each sample (the next matmul takes it again) and at cleanup, so it "
        "shows at the stages that ran matmuls and is never counted as a leak."
    )
fig = timeline_heatmap(timeline, metric)
st.plotly_chart(inert(fig), key="memory.timeline")
downloads(fig, timeline, f"{record.run_id}-memory-timeline", key="memory.timeline")

st.subheader("Findings")
if len(flags):
    # columns that say nothing for these findings (no adapter, no single tensor) stay in the CSV only
    shown = flags[[c for c in flags.columns if flags[c].notna().any()]]
    st.dataframe(
        shown,
        hide_index=True,
        key="memory.flags",
        column_config={"explanation": st.column_config.TextColumn(width="large")},
    )
    csv_download(flags, f"{record.run_id}-memory-flags", key="memory.flags.csv")
else:
    st.caption("No stray device, no leak, no mixed placement.")
leaks = leak_table(timeline)
if len(leaks):
    with st.expander("Memory still held after cleanup (bytes, against the sample before the base load)"):
        st.caption(
            "CUDA: tensor memory (`tensors`: `allocated` less the library workspaces) should return to 0; "
            "the driver's figure keeps the context. "
            "CPU: RSS does not return to its baseline even without a leak (the C allocator keeps freed "
            "pages), so it is reported, never flagged."
        )
        st.dataframe(leaks, hide_index=True, key="memory.leaks")

st.subheader("Where each parameter and buffer lives")
by = st.segmented_control(
    "Rows",
    ["module", "kind"],
    default="module",
    key="memory.by",
    format_func=lambda b: "every module" if b == "module" else "module kind (summed over layers)",
)
if "shared_with" in placement and placement["shared_with"].notna().any():
    tied = placement[placement["shared_with"].notna()]
    pairs = dict.fromkeys(
        f"{r['module']} ↔ {r['shared_with'].removeprefix(PEFT_PREFIX).rsplit('.', 1)[0]}"
        for _, r in tied.iterrows()
    )
    st.caption(
        "Tied tensors are counted once, under the first name: "
        + literal(", ".join(pairs))
        + " (a blank row there)."
    )
fig2 = module_device_heatmap(placement, by or "module")
st.plotly_chart(inert(fig2), key="memory.placement")
downloads(fig2, placement, f"{record.run_id}-placement", key="memory.placement")

summaries = []
for target, variant, label in panels(placement):
    part = placement[(placement["target"] == target) & (placement["variant"].fillna("") == variant)]
    asked = timeline[(timeline["target"] == target) & (timeline["variant"].fillna("") == variant)]
    requested = sorted(set(asked[asked["requested"].astype(bool)]["device"])) if len(asked) else None
    summary = adapter_device_summary(part, requested=requested)
    if len(summary):
        summaries.append(summary.assign(strategy=label))
if summaries:
    st.markdown("**Per adapter: what `get_layer_status()` shows, and where the tensors are**")
    summary = pd.concat(summaries, ignore_index=True)
    summary = summary[["strategy", *[c for c in summary.columns if c != "strategy"]]]
    st.dataframe(
        summary,
        hide_index=True,
        key="memory.adapters",
        column_config={
            "hidden": st.column_config.CheckboxColumn(
                "index hidden", help="get_layer_status() shows device types only, so it cannot show this"
            )
        },
    )
