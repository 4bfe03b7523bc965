"""What the dashboard's figures share: labels, colours and symbols, the drift heatmap (Drift, Merge,
Activations), axis and legend helpers, the environment table (Overview, Runs) and HTML export; the
figures of one page are in that page's module here, the drill-down's in `diffs`.

Pure functions: DataFrames / arrays in, ``plotly.graph_objects.Figure`` or DataFrames out. Nothing here
imports Streamlit, so every figure can be built and checked in plain pytest, and the pages only place
them. No template is set: Streamlit themes figures for its light and dark modes, so explicit colours
are used only where they carry meaning (verdicts, the perceptual colourscale).
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from core.judgement import ANOMALY, AS_EXPECTED, judged_verdicts
from core.report import VERDICT_ORDER
from dashboard.text import plot_text

METRICS = ("max_abs", "rel_l2", "max_ulp", "min_atol")
# rel_l2 ÷ the peer's on the same tensor (core.judgement); runs stored before peers have none
PEER_RATIO = "peer_ratio"
METRIC_LABELS: dict[str, str] = {
    PEER_RATIO: "× the peer's relative L2",
    "max_abs": "max |Δ|",
    "rel_l2": "relative L2",
    "max_ulp": "max ulp (target dtype)",
    "scale_ulp": "ulps at the tensor's scale (target dtype)",
    "min_atol": "smallest passing atol",
    "mean_abs": "mean |Δ|",
    "rmse": "RMSE",
}


# The checks whose rows are one tensor each (the Drift page); merge, memory and adapters have their pages.
DRIFT_CHECKS = ("weights", "deltas")
BASE = "base model"  # the selection of the rows without an adapter


def drift_checks(table: pd.DataFrame) -> list[str]:
    """The per-tensor checks (DRIFT_CHECKS) a metrics table has rows of, in the table's order."""
    return [c for c in dict.fromkeys(table["check"]) if c in DRIFT_CHECKS] if len(table) else []


def severity(rows: pd.DataFrame) -> tuple[int, float]:
    """How bad a selection is: worst verdict, then largest relative error (a page opens on the worst)."""
    if rows.empty:
        return (-1, 0.0)
    sev = int(rows["verdict"].map(MARK_SEVERITY).max())
    rel = pd.to_numeric(rows["rel_l2"], errors="coerce").max()
    return (sev, float(rel) if pd.notna(rel) else 0.0)


def selection_rows(rows: pd.DataFrame, adapter: str) -> pd.DataFrame:
    """The rows one drift heatmap shows: an adapter's tensors with the base weights it sits on, or the
    base alone (`BASE`)."""
    base_rows = rows[rows["adapter"].isna()]
    if adapter == BASE:
        return base_rows
    return pd.concat([base_rows, rows[rows["adapter"] == adapter]])


def metric_choices(table: pd.DataFrame, metrics: tuple[str, ...] = METRICS) -> tuple[str, ...]:
    """`metrics`, and the ratio to the peer where the table has one."""
    judged = PEER_RATIO in table and pd.to_numeric(table[PEER_RATIO], errors="coerce").notna().any()
    return (*metrics, PEER_RATIO) if judged else metrics


def colourable(table: pd.DataFrame, metric: str) -> pd.DataFrame:
    """`table` ready to colour by `metric`: an infinite ratio to the peer (the peer bitwise exact, the
    target not) drawn at 10× the largest finite one, so it is the hottest cell, not a blank."""
    if metric != PEER_RATIO or metric not in table:
        return table
    values = pd.to_numeric(table[metric], errors="coerce").astype(float)
    finite = values[np.isfinite(values) & (values > 0)]
    top = 10 * float(finite.max()) if len(finite) else 1e6
    return table.assign(**{metric: values.where(~np.isinf(values), top)})


# Mid-tone colours: dark enough for white backgrounds, light enough for Streamlit's dark theme.
VERDICT_COLORS: dict[str, str] = {
    "identical": "#3aa655",
    "within tolerance": "#1f9bcf",
    "drift": "#f28e2b",
    "broken": "#e03131",
}
VERDICT_SYMBOLS: dict[str, str] = {
    "identical": "≡",
    "within tolerance": "✓",
    "drift": "▲",
    "broken": "✗",
}
# The marks a cell can carry: the verdicts, and the judgement's two words for rows with a peer
# (`with_judgement`), in order of severity.
MARK_ORDER = ("identical", "within tolerance", AS_EXPECTED, "drift", ANOMALY, "broken")
MARK_SEVERITY = {v: i for i, v in enumerate(MARK_ORDER)}
VERDICT_COLORS[AS_EXPECTED] = "#8c7ae6"
VERDICT_COLORS[ANOMALY] = "#d6336c"
VERDICT_SYMBOLS[AS_EXPECTED] = "≈"
VERDICT_SYMBOLS[ANOMALY] = "‼"
# How a page marks its cells: with the judgement (as the Overview answers) or the tolerance verdicts.
MARKS = {"judgement": "as judged (expected for its dtype, or anomaly)", "verdict": "tolerance verdict"}


def with_judgement(table: pd.DataFrame) -> pd.DataFrame:
    """`table` with each row's `verdict` read with the judgement (`core.judgement.judged_verdicts`) and
    the tolerance verdict kept in `tolerance_verdict` for the hover."""
    if table.empty or "verdict" not in table:
        return table
    return table.assign(tolerance_verdict=table["verdict"], verdict=judged_verdicts(table))


def mark_legend(marks: str) -> str:
    """The caption's list of the symbols a page draws under `marks` (a key of `MARKS`)."""
    shown = MARK_ORDER if marks == "judgement" else VERDICT_ORDER
    return " ".join(f"{VERDICT_SYMBOLS[v]} {v}" for v in shown)


UNKNOWN_COLOR = "#888888"
UNKNOWN_SYMBOL = "?"

OTHER_ROW = "other"
COLORSCALE = "Viridis"
# Paints a whole row; translucent so the text stays readable on light and dark themes alike.
DIFFER_BACKGROUND = "background-color: rgba(255,165,0,0.25)"
MISSING = "—"
# Streamlit sizes figures to the container; this is only a guess used to size the verdict squares.
_ASSUMED_PLOT_WIDTH = 1100


# --------------------------------------------------------------------------------------------- helpers
def metric_label(metric: str) -> str:
    """A metric's axis and hover label (`METRIC_LABELS`), its column name when it has none."""
    return METRIC_LABELS.get(metric, metric)


def hover_number(value: Any) -> str:
    """Exact-enough number for hover text (%.6g); NaN/None spelled out rather than hidden."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return "n/a"
    try:
        return f"{float(value):.6g}"
    except (TypeError, ValueError):
        return html.escape(str(value))


def cell_text(value: Any) -> str:
    """A table cell as text: None, NA and NaN give an empty string."""
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return ""
    return str(value)


def _explanation_html(value: Any) -> str:
    # Explanations are one long line joined by " · "; break there so the hover box stays narrow,
    # and escape because plotly renders hover text as pseudo-HTML (a "<" would eat the rest).
    text = cell_text(value)
    return "<br>".join(html.escape(part) for part in text.split(" · ") if part)


def numeric_values(series: pd.Series) -> np.ndarray:
    """A column as float64, NaN where a value is missing or not a number."""
    return pd.to_numeric(series, errors="coerce").to_numpy(dtype=float, na_value=np.nan)


def log10_positive(values: np.ndarray) -> np.ndarray:
    """log10 where finite and > 0, NaN elsewhere (zeros and non-finite values show as background)."""
    values = np.asarray(values, dtype=float)
    out = np.full(values.shape, np.nan)
    ok = np.isfinite(values) & (values > 0)
    out[ok] = np.log10(values[ok])
    return out


def verdict_color(verdict: str) -> str:
    """The colour a verdict is drawn in (`UNKNOWN_COLOR` for one not in `VERDICT_COLORS`)."""
    return VERDICT_COLORS.get(verdict, UNKNOWN_COLOR)


def verdict_symbol(verdict: str) -> str:
    """The symbol a verdict is marked with (`UNKNOWN_SYMBOL` for one not in `VERDICT_SYMBOLS`)."""
    return VERDICT_SYMBOLS.get(verdict, UNKNOWN_SYMBOL)


def verdicts_in_order(present: Any) -> list[str]:
    """The distinct verdicts in `present`, by `MARK_ORDER` (severity), unknown ones after in their order."""
    present = [v for v in pd.unique(pd.Series(list(present), dtype=object)) if isinstance(v, str)]
    return [v for v in MARK_ORDER if v in present] + [v for v in present if v not in MARK_ORDER]


def empty_figure(message: str = "no rows", *, title: str | None = None) -> go.Figure:
    """A blank figure that says why it is blank (no rows for this selection)."""
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)
    fig.update_layout(title=title, height=320, xaxis={"visible": False}, yaxis={"visible": False})
    return fig


def legend_below_title(height: int) -> dict[str, Any]:
    """A horizontal legend on its own line under the title, placed in container pixels.

    Paper coordinates would depend on the plot area, which automargin changes, and the legend then
    lands on top of the title or the panel titles.
    """
    return {
        "orientation": "h",
        "yref": "container",
        "y": 1 - 44 / height,
        "yanchor": "top",
        "xanchor": "left",
        "x": 0,
        "title": None,
        "traceorder": "normal",
    }


def title_top(text: str | None, height: int) -> dict[str, Any]:
    """A figure title pinned to the top edge, whatever the figure's height."""
    return {"text": text, "yref": "container", "y": 1 - 12 / height, "yanchor": "top"}


# Forward order of the usual Llama / BERT / GPT module names, for the heatmap's columns.
MODULE_ORDER = (
    "embed_tokens",
    "word_embeddings",
    "wte",
    "input_layernorm",
    "ln_1",
    "q_proj",
    "query",
    "k_proj",
    "key",
    "v_proj",
    "value",
    "c_attn",
    "o_proj",
    "dense",
    "c_proj",
    "post_attention_layernorm",
    "ln_2",
    "gate_proj",
    "up_proj",
    "fc1",
    "c_fc",
    "down_proj",
    "fc2",
    "norm",
    "final_layernorm",
    "ln_f",
    "lm_head",
)


def category_axis(labels: list[str]) -> dict[str, Any]:
    """A categorical axis in the given order that shows every label.

    An explicit tick list keeps every label; plotly otherwise thins crowded category axes.
    """
    return {
        "type": "category",
        "categoryorder": "array",
        "categoryarray": labels,
        "tickmode": "array",
        "tickvals": labels,
        "ticktext": labels,
        "showgrid": False,
        "zeroline": False,
    }


def _row_labels(table: pd.DataFrame) -> pd.Series:
    """Layer as a string label; rows without a layer (embeddings, final norm, logits) are "other"."""
    if "layer" not in table.columns:
        return pd.Series(OTHER_ROW, index=table.index, dtype=object)
    layer = pd.to_numeric(table["layer"], errors="coerce")
    return pd.Series(
        [OTHER_ROW if pd.isna(v) else str(int(v)) for v in layer], index=table.index, dtype=object
    )


def _col_labels(table: pd.DataFrame) -> pd.Series:
    module = table["module"] if "module" in table.columns else pd.Series("?", index=table.index)
    role = table["role"] if "role" in table.columns else pd.Series("", index=table.index)
    return pd.Series(
        [f"{cell_text(m) or '?'} · {cell_text(r)}" for m, r in zip(module, role, strict=True)],
        index=table.index,
        dtype=object,
    )


def _axis_order(table: pd.DataFrame) -> tuple[list[str], list[str]]:
    """Row labels (ascending layers, then "other") and column labels (module, then role) of a grid.

    Modules follow the forward order of a transformer block (MODULE_ORDER), others their first
    appearance in the table; within a module the base weight comes first so adapter roles sit
    right of the weight they modify.
    """
    rows = _row_labels(table)
    layers = sorted({int(r) for r in rows if r != OTHER_ROW})
    row_order = [str(v) for v in layers] + ([OTHER_ROW] if (rows == OTHER_ROW).any() else [])

    modules: dict[str, list[str]] = {}
    module = table["module"] if "module" in table.columns else pd.Series("?", index=table.index)
    role = table["role"] if "role" in table.columns else pd.Series("", index=table.index)
    for m, r in zip(module, role, strict=True):
        roles = modules.setdefault(cell_text(m) or "?", [])
        if cell_text(r) not in roles:
            roles.append(cell_text(r))
    col_order = []
    known = {name: i for i, name in enumerate(MODULE_ORDER)}
    first = {m: i for i, m in enumerate(modules)}
    # A block reads in forward order (attention, then MLP); unknown modules keep table order after.
    for m in sorted(modules, key=lambda m: (known.get(m, len(known)), first[m])):
        roles = modules[m]
        ordered = (["base"] if "base" in roles else []) + [r for r in roles if r != "base"]
        col_order += [f"{m} · {r}" for r in ordered]
    return row_order, col_order


def _grid(table: pd.DataFrame, metric: str, rows: list[str], cols: list[str]) -> pd.DataFrame:
    cells = pd.DataFrame(
        {"_row": _row_labels(table), "_col": _col_labels(table), "_value": numeric_values(table[metric])},
        index=table.index,
    )
    # max() skips NaN, so a duplicate with a real value wins over one without.
    pooled = cells.groupby(["_row", "_col"], sort=False)["_value"].max()
    grid = pooled.unstack("_col") if len(pooled) else pd.DataFrame()
    grid = grid.reindex(index=rows, columns=cols).astype(float)
    grid.index.name = "layer"
    grid.columns.name = "module · role"
    return grid


# --------------------------------------------------------------------------------------------- heatmaps
def heatmap_grid(table: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Pivot ONE target's rows into a layer × "module · role" grid of ``metric``.

    Index: layers as strings in ascending numeric order ("0", "1", …, "10"), then "other" for rows
    without a layer. Columns: "module · role" by module first appearance, "base" role first.
    Values are floats, NaN where no row exists; if several rows land in one cell the max is kept.
    """
    if not len(table):
        return pd.DataFrame(dtype=float)
    rows, cols = _axis_order(table)
    return _grid(table, metric, rows, cols)


def _representatives(table: pd.DataFrame, metric: str) -> pd.DataFrame:
    """One row per cell for the verdict layer: the worst verdict, then the largest metric."""
    cells = table.assign(
        _row=_row_labels(table),
        _col=_col_labels(table),
        _sev=table["verdict"].map(MARK_SEVERITY).fillna(len(MARK_SEVERITY)) if "verdict" in table else 0,
        _value=numeric_values(table[metric]),
    )
    cells = cells.sort_values(["_sev", "_value"], ascending=False, na_position="last", kind="stable")
    return cells.drop_duplicates(["_row", "_col"], keep="first")


def tensor_hover(row: pd.Series) -> str:
    """The hover text of one metric row: tensor, target and reference, verdicts, metrics, explanation."""
    adapter = cell_text(row.get("adapter")) or "— (base model)"
    lines = [
        f"<b>{html.escape(cell_text(row.get('tensor')))}</b>",
        f"target: {html.escape(cell_text(row.get('target')))}"
        + (f" vs {html.escape(cell_text(row.get('reference')))}" if cell_text(row.get("reference")) else ""),
        f"adapter: {html.escape(adapter)} · role: {html.escape(cell_text(row.get('role')))}",
    ]
    if cell_text(row.get("dtype")) or cell_text(row.get("shape")):
        lines.append(
            f"dtype {html.escape(cell_text(row.get('dtype')))} · shape {html.escape(cell_text(row.get('shape')))}"
        )
    verdict = cell_text(row.get("verdict"))
    lines.append(f"verdict: <b>{verdict_symbol(verdict)} {html.escape(verdict)}</b>")
    tolerance = cell_text(row.get("tolerance_verdict"))
    if tolerance and tolerance != verdict:
        lines.append(f"tolerance verdict: {verdict_symbol(tolerance)} {html.escape(tolerance)}")
    for m in METRICS:
        lines.append(f"{metric_label(m)}: {hover_number(row.get(m))}")
    if cell_text(row.get("peer")) and cell_text(row.get("peer")) != cell_text(row.get("target")):
        lines.append(
            f"× the error of its peer {html.escape(cell_text(row.get('peer')))}: {hover_number(row.get(PEER_RATIO))}"
        )
    if cell_text(row.get("explanation")):
        lines.append(_explanation_html(row.get("explanation")))
    if cell_text(row.get("note")):
        lines.append("note: " + html.escape(cell_text(row.get("note"))))
    return "<br>".join(lines)


def drift_heatmap(table: pd.DataFrame, metric: str, *, title: str | None = None) -> go.Figure:
    """Layer × module heatmap of log₁₀ ``metric``, one panel per target, with a clickable verdict layer.

    ``table`` holds the rows of one check (already narrowed to one adapter selection, base rows
    included if wanted) for any number of targets. Every panel uses the same rows, columns and
    colour axis so panels compare by eye. Cells with metric 0 (identical tensors) or no row are NaN
    in z and show the background; the verdict layer (one scatter trace per verdict and panel, a
    symbol per existing cell) still marks them, carries the exact values in its hover, and its
    ``customdata`` is ``[target, adapter or "", tensor, check]`` so a selection identifies the tensor.
    """
    if not len(table):
        return empty_figure("no rows", title=title)
    label = metric_label(metric)
    targets = [t for t in pd.unique(table["target"].astype(object)) if isinstance(t, str)]
    rows, cols = _axis_order(table)
    n_panels = len(targets)

    fig = make_subplots(
        rows=1,
        cols=n_panels,
        shared_yaxes=True,
        subplot_titles=[plot_text(t) for t in targets],
        horizontal_spacing=min(0.03, 0.5 / max(n_panels, 1)),
    )
    # Squares as large as a cell is likely to be, so a click anywhere in the cell hits the point.
    cell_px = min(38.0, _ASSUMED_PLOT_WIDTH / max(1, n_panels * len(cols)))
    marker_size = max(8.0, 0.9 * cell_px)

    for i, target in enumerate(targets, start=1):
        part = table[table["target"] == target]
        grid = _grid(part, metric, rows, cols)
        z = log10_positive(grid.to_numpy())
        fig.add_trace(
            go.Heatmap(
                z=z,
                x=cols,
                y=rows,
                coloraxis="coloraxis",
                # Hover lives on the verdict points (exact values); the heatmap would only repeat a log.
                hoverinfo="skip",
                name=target,
                xgap=1,
                ygap=1,
            ),
            row=1,
            col=i,
        )
        reps = _representatives(part, metric)
        for verdict in verdicts_in_order(reps["verdict"]):
            sub = reps[reps["verdict"] == verdict]
            color = verdict_color(verdict)
            fig.add_trace(
                go.Scatter(
                    x=sub["_col"].tolist(),
                    y=sub["_row"].tolist(),
                    mode="markers+text",
                    text=[verdict_symbol(verdict)] * len(sub),
                    textposition="middle center",
                    textfont={"color": color, "size": 14, "shadow": "auto"},
                    # Nearly transparent: the point only catches clicks; the cell's colour is the heatmap's.
                    marker={"symbol": "square", "size": marker_size, "color": color, "opacity": 0.03},
                    # Make the picked cell stand out while keeping the others legible.
                    selected={"marker": {"opacity": 0.45}},
                    unselected={"marker": {"opacity": 0.03}, "textfont": {"color": color}},
                    customdata=[
                        [
                            cell_text(r.get("target")),
                            cell_text(r.get("adapter")),
                            cell_text(r.get("tensor")),
                            cell_text(r.get("check")),
                        ]
                        for _, r in sub.iterrows()
                    ],
                    hovertext=[tensor_hover(r) for _, r in sub.iterrows()],
                    hovertemplate="%{hovertext}<extra></extra>",
                    name=f"{verdict_symbol(verdict)} {verdict}",
                    legendgroup=verdict,
                    # The legend gets opaque swatches below; these points are nearly transparent.
                    showlegend=False,
                ),
                row=1,
                col=i,
            )
        fig.update_xaxes(**category_axis(cols), tickangle=-60, row=1, col=i)
        # Layer 0 on top; only the first panel labels the layers (shared axis).
        fig.update_yaxes(
            **category_axis(rows), autorange="reversed", showticklabels=i == 1, ticks="", row=1, col=i
        )
    for verdict in verdicts_in_order(table["verdict"]):
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                marker={"symbol": "square", "size": 12, "color": verdict_color(verdict)},
                name=f"{verdict_symbol(verdict)} {verdict}",
                legendgroup=verdict,  # clicking it hides that verdict's symbols in every panel
                hoverinfo="skip",
            ),
            row=1,
            col=1,
        )
    fig.update_yaxes(title_text="layer", row=1, col=1)

    values = numeric_values(table[metric])
    checks = (
        [c for c in pd.unique(table["check"].astype(object)) if isinstance(c, str)]
        if "check" in table
        else []
    )
    if title is None:
        title = f"{' / '.join(checks) or 'drift'} — log₁₀ {label}"
    if not np.isfinite(log10_positive(values)).any():
        fig.add_annotation(
            text=f"no nonzero {label} values (blank cells = exactly 0 or missing)",
            showarrow=False,
            xref="paper",
            yref="paper",
            x=0.5,
            y=1.0,
            yanchor="bottom",
            yshift=24,
        )
    coloraxis: dict[str, Any] = {}
    logs = log10_positive(values)
    if np.isfinite(logs).any():
        # At least one decade of colour: values that agree to 3 digits should not look different.
        lo, hi = float(np.nanmin(logs[np.isfinite(logs)])), float(np.nanmax(logs[np.isfinite(logs)]))
        if hi - lo < 1.0:
            mid = (hi + lo) / 2
            lo, hi = mid - 0.5, mid + 0.5
        coloraxis.update(cmin=lo, cmax=hi)
    longest = max((len(c) for c in cols), default=0)
    height = max(320, 140 + 38 * len(rows) + int(5.5 * longest))
    fig.update_layout(
        title=title_top(title, height),
        coloraxis={
            **coloraxis,
            "colorscale": COLORSCALE,
            "colorbar": {"title": {"text": f"log₁₀ {label}", "side": "right"}},
        },
        height=height,
        legend=legend_below_title(height),
        margin={"t": 110},
        hovermode="closest",
    )
    return fig


# --------------------------------------------------------------------------------------------- summaries
# --------------------------------------------------------------------------------------------- environment
def _env_str(value: Any) -> str:
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return MISSING
    return str(value)


def environment_table(envs: Mapping[str, Mapping[str, Any]]) -> pd.DataFrame:
    """Environment side by side: a row per key (sorted union), a column per target, plus ``differs``.

    Values are strings, "—" where a target lacks the key or has None; ``differs`` is True when the
    targets do not all show the same string (so absent vs present counts as a difference).
    """
    targets = list(envs)
    keys = sorted({k for env in envs.values() for k in (env or {})})
    data = {t: [_env_str((envs[t] or {}).get(k)) for k in keys] for t in targets}
    df = pd.DataFrame(data, index=pd.Index(keys, name="key"), columns=targets, dtype=object)
    df["differs"] = [len({data[t][i] for t in targets}) > 1 for i in range(len(keys))]
    df["differs"] = df["differs"].astype(bool)
    return df


def highlight_differences(df: pd.DataFrame) -> Any:
    """A pandas Styler: the rows whose ``differs`` is True first and painted, without the ``differs`` column.

    The column is dropped rather than hidden: st.dataframe ignores a Styler's hidden columns.
    """
    differs = df["differs"].astype(bool) if "differs" in df.columns else pd.Series(False, index=df.index)
    order = list(differs[differs].index) + list(differs[~differs].index)
    shown = df.drop(columns=["differs"], errors="ignore").loc[order]

    def paint(row: pd.Series) -> list[str]:
        return [DIFFER_BACKGROUND if differs.loc[row.name] else ""] * len(row)

    return shown.style.apply(paint, axis=1)


# --------------------------------------------------------------------------------------------- export
def figure_html(fig: go.Figure) -> str:
    """Self-contained HTML for "download figure": plotly.js is inlined, so it opens offline."""
    return fig.to_html(include_plotlyjs=True, full_html=True)
