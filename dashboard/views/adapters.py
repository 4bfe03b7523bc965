"""Adapter consistency: load strategies side by side against `isolated`, why they differ (base
mutated, stacked, not applied), each strategy's module structure and the base-mutation list."""

from __future__ import annotations

import streamlit as st

from dashboard.figures.adapters import (
    GROUND_TRUTH,
    consistency_cells,
    consistency_matrix,
    conversion_table,
    flag_rows,
    mutation_table,
    stacking_summary,
)
from dashboard.pages import page
from dashboard.state import bound_select, metrics_table, run_table
from dashboard.text import inert, literal, trusted
from dashboard.ui import (
    METRIC_COLUMN_CONFIG,
    check_not_run,
    csv_download,
    downloads,
    finished_run,
    scenario_buttons,
)

st.title(trusted(page("adapters").title))
record = finished_run("adapters", "adapters")
table = metrics_table(record)
rows = table[table["check"] == "adapters"] if len(table) else table
if rows.empty:
    check_not_run(
        record,
        "adapters",
        "adapters",
        "This run did not run the `adapters` check. Choose it in the sidebar with the load strategies "
        "to compare, or start one of the demo scenarios below.",
    )
scenario_buttons("adapters")

spec = record.spec
strategies = list(dict.fromkeys([GROUND_TRUTH, *(spec.strategies if spec else [])]))
st.caption(
    "Each strategy loads the run's adapters in order "
    f"({literal(', '.join(a.name for a in spec.adapters) if spec else '?')}) in a worker of its own; "
    f"{literal(GROUND_TRUTH)} (a fresh base per adapter) is the ground truth. "
    f"Strategies: {literal(', '.join(strategies))}."
)
targets = list(dict.fromkeys(rows["target"]))
target = bound_select("Target", "target", targets) if len(targets) > 1 else targets[0]
rows = rows[rows["target"] == target]
cells = consistency_cells(rows)

# --- the verdict in words --------------------------------------------------------------------
drifting = cells[(cells["strategy"] != GROUND_TRUTH) & ~cells["verdict"].isin(["identical", "ground truth"])]
if len(drifting):
    st.error(
        "**Predictions differ from isolated:** "
        + "; ".join(
            f"{literal(c['adapter'])} with {literal(c['strategy'])} (max |Δ| {c['max_abs']:.3g}: "
            f"{literal(c['reason'] or 'no reason found')})"
            for c in drifting.to_dict(orient="records")
        ),
        icon=":material/warning:",
    )
else:
    st.success(
        "Every strategy predicts bitwise like isolated for every adapter.", icon=":material/check_circle:"
    )
stacked_ok = stacking_summary(cells)
if stacked_ok:
    st.info(
        "**Stacking is not the cause.** These adapters are stacked (their modules hold earlier "
        "adapters too), yet their predictions are bitwise equal to isolated: "
        + literal(", ".join(stacked_ok))
        + ".",
        icon=":material/layers:",
    )
flags = flag_rows(rows)
not_applied = flags[flags["role"] == "applied"]
if len(not_applied):
    by_adapter: dict[str, list[str]] = {}
    for r in not_applied.to_dict(orient="records"):
        by_adapter.setdefault(r["adapter"], []).append(f"{r['strategy']}: {r['reason']}")
    st.warning(
        "**Not applied:** "
        + "; ".join(f"{literal(a)} ({literal(', '.join(where))})" for a, where in by_adapter.items())
        + '. Its outputs equal the base model\'s (bitwise when "not applied").',
        icon=":material/block:",
    )

# --- the matrix --------------------------------------------------------------------------------
st.subheader("Predictions: adapters × strategies")
fig = consistency_matrix(cells, target)
st.plotly_chart(inert(fig), key="adapters.matrix")
downloads(fig, cells, f"{record.run_id}-adapters-matrix", key="adapters.matrix")
pred_columns = [
    "strategy",
    "adapter",
    "role",
    "verdict",
    "reason",
    "max_abs",
    "rel_l2",
    "max_ulp",
    "argmax_agree",
    "topk_agree",
    "stacked",
    "base_changed",
    "applied",
    "explanation",
    "note",
]
pred = rows[rows["role"].isin(["prediction", "applied", "disabled"])]
pred = pred[[c for c in pred_columns if c in pred.columns]]
with st.expander(f"All prediction, applied? and disabled rows ({len(pred)})"):
    st.dataframe(
        pred,
        hide_index=True,
        key="adapters.rows",
        column_config={
            **METRIC_COLUMN_CONFIG,
            "argmax_agree": st.column_config.NumberColumn("argmax agree", format="percent"),
            "topk_agree": st.column_config.NumberColumn("top-5 agree", format="percent"),
            "reason": st.column_config.TextColumn(width="large"),
            "explanation": st.column_config.TextColumn(width="large"),
        },
    )
    csv_download(pred, f"{record.run_id}-adapters-rows", key="adapters.rows.csv")

disabled = flags[flags["role"] == "disabled"]
if len(disabled):
    st.warning(
        "**`disable_adapter()` does not give the base model back** (the base weights were mutated): "
        + literal(
            ", ".join(
                sorted({f"{r['adapter']} ({r['strategy']})" for r in disabled.to_dict(orient="records")})
            )
        ),
        icon=":material/toggle_off:",
    )

# --- PiSSA conversion --------------------------------------------------------------------------
conversion = conversion_table(rows)
if len(conversion):
    st.subheader("PiSSA converted to LoRA")
    st.caption(
        "The converted LoRA (saved with `path_initial_model_for_weight_conversion`, rank doubled) on "
        "the original base against the PiSSA model on its residual base. Paired by configuration: a "
        "plain LoRA with the same base and target modules and twice the PiSSA adapter's r and alpha."
    )
    st.dataframe(conversion, hide_index=True, key="adapters.pissa", column_config=METRIC_COLUMN_CONFIG)
    csv_download(conversion, f"{record.run_id}-adapters-pissa", key="adapters.pissa.csv")

# --- structure -----------------------------------------------------------------------------------
st.subheader("Module structure per strategy")
st.caption(
    "After each load step, from PEFT's `get_layer_status()`: what the adapted modules hold and which "
    'adapter is active. "holds a, b; active b" is stacking.'
)
structure = run_table(record, "adapters_structure")
if len(structure):
    structure = structure[structure["target"] == target].drop(columns=["target"])
    columns = st.columns(min(len(strategies), 3))
    for i, strategy in enumerate(strategies):
        part = structure[structure["strategy"] == strategy]
        with columns[i % len(columns)]:
            st.markdown(f"**{literal(strategy)}**")
            for step, steps in part.groupby("step", sort=False):
                error = steps["error"].iloc[0]
                if error:
                    st.markdown(f"- after **{literal(step)}**: :red[{literal(error)}]")
                    continue
                groups = "; ".join(
                    f"{g['modules']} module(s) {g['structure']}" for g in steps.to_dict(orient="records")
                )
                changed = int(steps["base_changed"].iloc[0])
                extra = f" · :orange[{changed:d} base tensor(s) changed]" if changed else ""
                st.markdown(f"- after **{literal(step)}**: {literal(groups)}" + (trusted(extra)))
    with st.expander("Structure table"):
        st.dataframe(structure, hide_index=True, key="adapters.structure")
        csv_download(structure, f"{record.run_id}-adapters-structure", key="adapters.structure.csv")
else:
    st.info("This run stored no structure table.")

# --- base mutation -------------------------------------------------------------------------------
st.subheader("Base-model mutation")
mutation = mutation_table(rows)
if mutation.empty:
    st.success("No load changed any base weight (fingerprints before and after each step are equal).")
else:
    st.caption(
        "Base tensors whose per-tensor fingerprint changed during a load, each listed at the step that "
        "changed it, against the checkpoint."
    )
    st.dataframe(
        mutation,
        hide_index=True,
        key="adapters.mutation",
        column_config={**METRIC_COLUMN_CONFIG, "note": st.column_config.TextColumn(width="large")},
    )
    csv_download(mutation, f"{record.run_id}-adapters-base-mutation", key="adapters.mutation.csv")
