"""Figures and display tables for the Merge residuals page, built from the `merge` check's rows.

Pure functions (no Streamlit): DataFrames in, Plotly figures or DataFrames out. The weight residual
heatmap is the Drift page's `drift_heatmap` on the `merged` rows; this module adds the output
residual bars per stage and the tables the page lays out.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from core.models.merging import OUTPUT_STAGES, STAGES, SUBSET_STAGE_TEXT, SUBSET_STAGES
from core.report import SEVERITY
from dashboard.figures.common import METRICS, VERDICT_COLORS, VERDICT_SYMBOLS, empty_figure
from dashboard.text import plot_text

# ulps at the tensor's scale first: ≤ 1 reads as rounding, where max_ulp explodes on cancelling sums.
MERGE_METRICS = ("scale_ulp", *METRICS)

# Runs stored before the stages were told apart merged with safe_merge=True throughout and ran
# merge_and_unload on weights already merged and unmerged: their stages, named for what they ran
# (their merge_adapter is exactly today's safe_merge: layer.merge(safe_merge=True) on the loaded W).
LEGACY_STAGES = {
    "merge_adapter": "safe_merge",
    "unmerge_adapter": "unmerge after safe_merge",
    "merge_and_unload": "merge_and_unload(safe_merge=True) after merge + unmerge",
    "subset sequential": "subset safe_merge sequential",
    "subset together": "subset safe_merge combined",
}
STAGE_ORDER = (*OUTPUT_STAGES, *SUBSET_STAGES)
# A legacy stage sorts right after the stage of today it stands beside.
_LEGACY_AFTER = {
    LEGACY_STAGES["unmerge_adapter"]: "safe_merge",
    LEGACY_STAGES["merge_and_unload"]: "merge_and_unload",
    LEGACY_STAGES["subset sequential"]: "subset merge_adapter sequential",
    LEGACY_STAGES["subset together"]: "subset merge_adapter combined",
}
# One colour per comparison; the verdict is the symbol above each bar.
AGAINST_COLORS = {"unmerged": "#4c78a8", "cpu/float64": "#9c755f", "merged before save": "#59a14f"}


def _against_kind(label: str) -> str:
    return "unmerged" if str(label).startswith("unmerged") else str(label)


def relabel_legacy(table: pd.DataFrame) -> tuple[pd.DataFrame, bool]:
    """The merge rows with a run stored before `safe_merge` was a stage of its own relabelled, and whether it was.

    Such a run has merge stages but no ``safe_merge`` one; its stages are renamed (`LEGACY_STAGES`)
    for what they ran. The ``tensor`` column keeps the stored names, which the drill-down reads.
    """
    stages = set(table["stage"].dropna()) if "stage" in table else set()
    if "safe_merge" in stages or not stages & set(LEGACY_STAGES):
        return table, False
    return table.assign(stage=table["stage"].replace(LEGACY_STAGES)), True


def ordered_stages(stages) -> list[str]:
    """`stages` (any iterable, duplicates allowed) in the order the check runs them; unknown ones last."""
    present = list(dict.fromkeys(s for s in stages if isinstance(s, str)))
    rank = {s: float(i) for i, s in enumerate(STAGE_ORDER)}
    rank.update({s: rank[after] + 0.5 for s, after in _LEGACY_AFTER.items()})
    return sorted(present, key=lambda s: (rank.get(s, len(rank)), present.index(s)))


def stage_legend(stages) -> pd.DataFrame:
    """One row per stage present (in run order): its name and exactly what it runs."""
    text = {**STAGES, **SUBSET_STAGE_TEXT}
    return pd.DataFrame(
        [{"stage": s, "runs": text.get(s, "")} for s in ordered_stages(stages)], columns=["stage", "runs"]
    )


def weight_rows(
    table: pd.DataFrame, adapter: str | None = None, role: str = "merged", stage: str | None = None
) -> pd.DataFrame:
    """The merge check's weight rows of one role (merged, tied, delta, roundtrip), for one adapter and stage if given."""
    rows = table[(table["check"] == "merge") & (table["role"] == role)]
    if adapter is not None:
        rows = rows[rows["adapter"] == adapter]
    if stage is not None:
        rows = rows[rows["stage"] == stage]
    return rows


def output_rows(table: pd.DataFrame, adapter: str | None = None) -> pd.DataFrame:
    """The merge check's output rows (one per stage and comparison), for one adapter if given."""
    rows = table[(table["check"] == "merge") & (table["role"] == "output")]
    if adapter is not None:
        rows = rows[rows["adapter"] == adapter]
    return rows


def stage_bars(table: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """Output residual max |Δ| per stage on a log axis, one panel per target, a bar per comparison.

    Bars are grouped by what the stage is compared with (the unmerged output on the same target,
    the cpu/float64 model, the merged model before saving); the symbol above a bar is the verdict at
    the dtype default and, after a slash, at PEFT's own test tolerance. Exactly 0 is drawn as a stub.
    """
    if not len(table):
        return empty_figure("no output rows", title=title)
    data = table.assign(
        _against=[_against_kind(a) for a in table.get("against", table["reference"])],
        _value=pd.to_numeric(table["max_abs"], errors="coerce").to_numpy(dtype=float),
    )
    targets = [t for t in pd.unique(data["target"].astype(object)) if isinstance(t, str)]
    stages = ordered_stages(data["stage"])
    positive = data["_value"][np.isfinite(data["_value"]) & (data["_value"] > 0)]
    floor = float(positive.min()) / 10 if len(positive) else 1e-12
    fig = make_subplots(
        rows=1, cols=len(targets), shared_yaxes=True, subplot_titles=[plot_text(t) for t in targets]
    )
    shown: set[str] = set()
    for col, target in enumerate(targets, start=1):
        part = data[data["target"] == target]
        for against in dict.fromkeys(part["_against"]):
            bars = part[part["_against"] == against].set_index("stage")
            bars = bars[~bars.index.duplicated()]
            xs = [s for s in stages if s in bars.index]
            values = [bars.loc[s, "_value"] for s in xs]
            heights = [v if np.isfinite(v) and v > 0 else floor for v in values]
            symbols = [
                VERDICT_SYMBOLS.get(str(bars.loc[s, "verdict"]), "?")
                + (
                    "/" + VERDICT_SYMBOLS.get(str(bars.loc[s, "peft_verdict"]), "?")
                    if "peft_verdict" in bars and isinstance(bars.loc[s, "peft_verdict"], str)
                    else ""
                )
                for s in xs
            ]
            hover = [
                plot_text(f"{target} · {s} vs {bars.loc[s, 'against'] if 'against' in bars else against}")
                + "<br>"
                f"max |Δ| {values[i]:.4g} · rel L2 {float(bars.loc[s, 'rel_l2']):.3g}<br>"
                f"verdict {bars.loc[s, 'verdict']}"
                + (
                    f" · PEFT tol {float(bars.loc[s, 'peft_tol']):g}: {bars.loc[s, 'peft_verdict']}"
                    if "peft_tol" in bars and pd.notna(bars.loc[s, "peft_tol"])
                    else ""
                )
                for i, s in enumerate(xs)
            ]
            fig.add_trace(
                go.Bar(
                    x=xs,
                    y=heights,
                    name=against,
                    legendgroup=against,
                    showlegend=against not in shown,
                    offsetgroup=against,
                    marker={"color": AGAINST_COLORS.get(against, "#888888")},
                    text=symbols,
                    textposition="outside",
                    hovertext=hover,
                    hovertemplate="%{hovertext}<extra></extra>",
                ),
                row=1,
                col=col,
            )
            shown.add(against)
        fig.update_xaxes(type="category", categoryorder="array", categoryarray=stages, row=1, col=col)
    # Every panel on the same log axis, so targets compare by bar height (bfloat16 sits decades above).
    fig.update_yaxes(type="log", exponentformat="power")
    fig.update_yaxes(title_text="max |Δ| of outputs (log)", row=1, col=1)
    fig.update_layout(
        barmode="group",
        height=440,
        title=title or "output residual per stage (symbols: dtype default / PEFT's test tolerance)",
        legend={"orientation": "h", "y": -0.25},
    )
    return fig


def verdict_legend() -> str:
    """The symbol key used above the bars."""
    return " ".join(f"{s} {v}" for v, s in VERDICT_SYMBOLS.items() if v in VERDICT_COLORS)


def stage_table(table: pd.DataFrame) -> pd.DataFrame:
    """Output rows as the page lists them: stage order, both verdicts side by side."""
    cols = [
        "target",
        "adapter",
        "stage",
        "against",
        "max_abs",
        "rel_l2",
        "max_ulp",
        "verdict",
        "peft_tol",
        "peft_verdict",
        "explanation",
        "note",
    ]
    out = table[[c for c in cols if c in table.columns]].copy()
    rank = {s: i for i, s in enumerate(ordered_stages(out["stage"]))}
    out["_order"] = out["stage"].map(rank)
    return out.sort_values(["target", "adapter", "_order"]).drop(columns="_order").reset_index(drop=True)


def worst_modules(table: pd.DataFrame, metric: str, n: int = 10) -> pd.DataFrame:
    """The ``n`` weight rows with the largest ``metric`` (broken first): which method and module is worst."""
    if not len(table):
        return table
    sev = table["verdict"].map(SEVERITY).fillna(0)
    val = pd.to_numeric(table[metric], errors="coerce").fillna(-1.0)
    ranked = table.assign(_sev=sev, _val=val).sort_values(["_sev", "_val"], ascending=False).head(n)
    cols = [
        "target",
        "adapter",
        "tensor",
        "stage",
        "dtype",
        "max_abs",
        "rel_l2",
        "scale_ulp",
        "max_ulp",
        "verdict",
        "note",
    ]
    return ranked[[c for c in cols if c in ranked.columns]].reset_index(drop=True)


def method_summary(table: pd.DataFrame, save: pd.DataFrame) -> pd.DataFrame:
    """One row per adapter and target: the figures a user compares across methods, worst first.

    From the merge rows: the worst weight merged by PEFT's default path, ``merge_adapter`` (ulps at the
    tensor's scale and max |Δ|), the worst by ``safe_merge`` (max |Δ|), the merged-vs-unmerged output
    residual of ``merge_and_unload`` (PEFT's defaults), its output against cpu/float64, the unmerge round
    trip on W, whether the reloaded model is identical, which save paths worked, and the worst verdict
    with its PEFT-tolerance counterpart (of merge_and_unload).
    """
    columns = [
        "adapter",
        "target",
        "verdict",
        "weights_scale_ulp",
        "weights_max_abs",
        "safe_merge_max_abs",
        "merged_vs_unmerged",
        "merged_vs_fp64",
        "peft_verdict",
        "roundtrip_max_abs",
        "reload_identical",
        "saves_with",
    ]
    if not len(table):
        return pd.DataFrame(columns=columns)

    def worst(rows: pd.DataFrame, col: str) -> float:
        values = pd.to_numeric(rows[col], errors="coerce") if col in rows else pd.Series(dtype=float)
        return float(values.max()) if values.notna().any() else float("nan")

    out = []
    for (adapter, target), rows in table.groupby(["adapter", "target"], sort=False):
        merged = rows[(rows["role"] == "merged") & (rows["stage"] == "merge_adapter")]
        safe = rows[(rows["role"] == "merged") & (rows["stage"] == "safe_merge")]
        outputs = rows[rows["role"] == "output"]
        final = outputs[outputs["stage"] == "merge_and_unload"]
        reload = outputs[(outputs["stage"] == "reload") & (outputs["against"] == "merged before save")]
        saved = save[(save["adapter"] == adapter) & (save["target"] == target)] if len(save) else save
        peft = final["peft_verdict"].dropna() if "peft_verdict" in final else pd.Series(dtype=str)
        out.append(
            {
                "adapter": adapter,
                "target": target,
                "verdict": max(rows["verdict"], key=lambda v: SEVERITY.get(v, -1)),
                "weights_scale_ulp": worst(merged, "scale_ulp"),
                "weights_max_abs": worst(merged, "max_abs"),
                "safe_merge_max_abs": worst(safe, "max_abs"),
                "merged_vs_unmerged": worst(final[final["against"].str.startswith("unmerged")], "max_abs"),
                "merged_vs_fp64": worst(final[final["against"] == "cpu/float64"], "max_abs"),
                "peft_verdict": max(peft, key=lambda v: SEVERITY.get(v, -1)) if len(peft) else None,
                "roundtrip_max_abs": worst(rows[rows["role"] == "roundtrip"], "max_abs"),
                "reload_identical": bool((reload["verdict"] == "identical").all()) if len(reload) else None,
                "saves_with": ", ".join(saved.loc[saved["ok"].astype(bool), "method"]) if len(saved) else "",
            }
        )
    summary = pd.DataFrame(out, columns=columns)
    rank = summary["verdict"].map(SEVERITY).fillna(-1)
    return (
        summary.assign(_rank=rank, _ulp=summary["weights_scale_ulp"].fillna(-1))
        .sort_values(["_rank", "_ulp"], ascending=False)
        .drop(columns=["_rank", "_ulp"])
        .reset_index(drop=True)
    )
