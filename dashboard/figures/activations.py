"""Figures for the Activations page, built from the `activations` check's rows.

Pure functions (no Streamlit): DataFrames in, Plotly figures or DataFrames out. The heatmap is
depth (block) × module role, one panel per target, coloured by log₁₀ of a metric, for accumulated
or local drift; the line chart is the metric over depth, one line per target; both mark each
target's first divergence (`core.checks.activations.first_divergences`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from core.checks.activations import ACCUMULATED, Divergence
from dashboard.figures.common import (
    COLORSCALE,
    MARK_SEVERITY,
    category_axis,
    cell_text,
    empty_figure,
    log10_positive,
    metric_label,
    numeric_values,
    tensor_hover,
    title_top,
    verdict_color,
    verdict_symbol,
)
from dashboard.text import plot_text

BEFORE, AFTER = "in", "out"  # the depth of modules before the first block (embeddings) and after the last
DIVERGENCE_COLOR = "#e03131"
LINE_COLORS = ("#4c78a8", "#f58518", "#54a24b", "#b279a2", "#9c755f", "#e45756", "#72b7b2", "#eeca3b")


def depth_labels(rows: pd.DataFrame) -> pd.Series:
    """Each row's depth: its block index as text, `in` before the first block, `out` after the last
    (per target and adapter: a module without a block is placed by its execution order)."""
    layer = pd.to_numeric(rows["layer"], errors="coerce")
    order = pd.to_numeric(rows["order"], errors="coerce")
    key = rows["target"].astype(str) + "|" + rows["adapter"].astype(object).fillna("").astype(str)
    first_block = order.where(layer.notna()).groupby(key).transform("min")
    labels = [
        str(int(ly)) if pd.notna(ly) else (BEFORE if pd.notna(fb) and o < fb else AFTER)
        for ly, o, fb in zip(layer, order, first_block, strict=True)
    ]
    return pd.Series(labels, index=rows.index, dtype=object)


def depth_order(labels: Sequence[str]) -> list[str]:
    """Depths top to bottom: `in`, blocks ascending, `out` (those present)."""
    present = set(labels)
    blocks = sorted(int(x) for x in present if x not in (BEFORE, AFTER))
    return (
        ([BEFORE] if BEFORE in present else [])
        + [str(b) for b in blocks]
        + ([AFTER] if AFTER in present else [])
    )


def role_order(rows: pd.DataFrame) -> list[str]:
    """Module roles in the order the forward pass first produces them."""
    ranked = rows.assign(_o=pd.to_numeric(rows["order"], errors="coerce")).sort_values("_o", kind="stable")
    return list(dict.fromkeys(ranked["role"].astype(str)))


def activation_grid(rows: pd.DataFrame, metric: str) -> pd.DataFrame:
    """ONE target's rows (one drift kind) as a depth × role grid of `metric` (NaN where no module;
    the max where a shared module's calls land in one cell)."""
    if not len(rows):
        return pd.DataFrame(dtype=float)
    cells = pd.DataFrame(
        {"depth": depth_labels(rows), "role": rows["role"].astype(str), "_v": numeric_values(rows[metric])},
        index=rows.index,
    )
    grid = cells.groupby(["depth", "role"], sort=False)["_v"].max().unstack("role")
    return grid.reindex(index=depth_order(cells["depth"]), columns=role_order(rows)).astype(float)


def _marked(divergences: Sequence[Divergence], target: str) -> Divergence | None:
    return next((d for d in divergences if d.target == target), None)


def activations_heatmap(
    rows: pd.DataFrame,
    metric: str,
    drift: str = ACCUMULATED,
    divergences: Sequence[Divergence] = (),
    *,
    title: str | None = None,
) -> go.Figure:
    """Depth × role heatmap of log₁₀ `metric`, one panel per target, for `drift` (accumulated or local).

    `rows` are one adapter selection's activations rows. Every cell carries a nearly transparent
    point whose `customdata` is ``[target, adapter or "", tensor, check]`` (a click names the module
    output); each target's first divergence is ringed in red.
    """
    part = rows[rows["drift"] == drift] if len(rows) else rows
    label = metric_label(metric)
    if not len(part):
        return empty_figure(f"no {drift} rows", title=title)
    targets = [t for t in dict.fromkeys(part["target"].astype(str))]
    depth = depth_labels(part)
    depths, roles = depth_order(depth), role_order(part)
    fig = make_subplots(
        rows=1,
        cols=len(targets),
        shared_yaxes=True,
        subplot_titles=[plot_text(t) for t in targets],
        horizontal_spacing=min(0.03, 0.5 / len(targets)),
    )
    logs = log10_positive(numeric_values(part[metric]))
    for i, target in enumerate(targets, start=1):
        mine = part[part["target"] == target]
        grid = activation_grid(mine, metric).reindex(index=depths, columns=roles)
        fig.add_trace(
            go.Heatmap(
                z=log10_positive(grid.to_numpy()),
                x=roles,
                y=depths,
                coloraxis="coloraxis",
                hoverinfo="skip",
                xgap=1,
                ygap=1,
                name=target,
            ),
            row=1,
            col=i,
        )
        cells = mine.assign(
            _depth=depth[mine.index],
            _sev=mine["verdict"].map(MARK_SEVERITY).fillna(len(MARK_SEVERITY)),
            _v=numeric_values(mine[metric]),
        ).sort_values(["_sev", "_v"], ascending=False, na_position="last", kind="stable")
        cells = cells.drop_duplicates(["_depth", "role"])
        fig.add_trace(
            go.Scatter(
                x=cells["role"].astype(str).tolist(),
                y=cells["_depth"].tolist(),
                mode="markers+text",
                text=[verdict_symbol(v) for v in cells["verdict"]],
                textfont={"color": [verdict_color(v) for v in cells["verdict"]], "size": 13},
                marker={"symbol": "square", "size": 22, "color": "#888888", "opacity": 0.03},
                selected={"marker": {"opacity": 0.45}},
                unselected={"marker": {"opacity": 0.03}},
                customdata=[
                    [
                        cell_text(r["target"]),
                        cell_text(r["adapter"]),
                        cell_text(r["tensor"]),
                        cell_text(r["check"]),
                    ]
                    for _, r in cells.iterrows()
                ],
                hovertext=[tensor_hover(r) for _, r in cells.iterrows()],
                hovertemplate="%{hovertext}<extra></extra>",
                showlegend=False,
                name=target,
            ),
            row=1,
            col=i,
        )
        mark = _marked(divergences, target)
        hit = (
            mine[(mine["module_path"] + _call_suffix(mine)) == mark.module] if mark is not None else mine[:0]
        )
        if len(hit):
            r = hit.iloc[0]
            fig.add_trace(
                go.Scatter(
                    x=[str(r["role"])],
                    y=[depth[hit.index[0]]],
                    mode="markers",
                    marker={
                        "symbol": "square-open",
                        "size": 26,
                        "color": DIVERGENCE_COLOR,
                        "line": {"width": 3},
                    },
                    name="first divergence",
                    hovertext=[plot_text(mark.sentence())],
                    hovertemplate="%{hovertext}<extra></extra>",
                    showlegend=i == 1,
                ),
                row=1,
                col=i,
            )
        fig.update_xaxes(**category_axis(roles), tickangle=-60, row=1, col=i)
        fig.update_yaxes(**category_axis(depths), autorange="reversed", showticklabels=i == 1, row=1, col=i)
    fig.update_yaxes(title_text="block", row=1, col=1)
    coloraxis: dict[str, Any] = {"colorscale": COLORSCALE, "colorbar": {"title": {"text": f"log₁₀ {label}"}}}
    finite = logs[np.isfinite(logs)]
    if finite.size:
        lo, hi = float(finite.min()), float(finite.max())
        if hi - lo < 1.0:  # at least a decade: values that agree to 3 digits should look alike
            lo, hi = (hi + lo) / 2 - 0.5, (hi + lo) / 2 + 0.5
        coloraxis.update(cmin=lo, cmax=hi)
    height = max(340, 160 + 30 * len(depths) + 6 * max((len(r) for r in roles), default=0))
    fig.update_layout(
        title=title_top(title or f"activations · {drift} drift · log₁₀ {label}", height),
        coloraxis=coloraxis,
        height=height,
        margin={"t": 100},
        hovermode="closest",
    )
    return fig


def _call_suffix(rows: pd.DataFrame) -> pd.Series:
    calls = pd.to_numeric(rows["call"], errors="coerce").fillna(0).astype(int)
    return pd.Series([f"@{c}" if c else "" for c in calls], index=rows.index, dtype=object)


def depth_profile(rows: pd.DataFrame, metric: str, drift: str = ACCUMULATED) -> pd.DataFrame:
    """Per target and depth, the largest `metric` of that drift kind: columns target, depth, value."""
    part = rows[rows["drift"] == drift] if len(rows) else rows
    if not len(part):
        return pd.DataFrame(columns=["target", "depth", "value"])
    frame = pd.DataFrame(
        {
            "target": part["target"].astype(str),
            "depth": depth_labels(part),
            "value": numeric_values(part[metric]),
        }
    )
    out = frame.groupby(["target", "depth"], sort=False)["value"].max().reset_index()
    # targets in the order the rows name them, depths top to bottom within each
    ranks = {d: i for i, d in enumerate(depth_order(out["depth"]))}
    targets = {t: i for i, t in enumerate(dict.fromkeys(out["target"]))}
    out = out.assign(_t=out["target"].map(targets), _d=out["depth"].map(ranks))
    return out.sort_values(["_t", "_d"]).drop(columns=["_t", "_d"]).reset_index(drop=True)


def depth_line_chart(
    rows: pd.DataFrame,
    metric: str,
    drift: str = ACCUMULATED,
    divergences: Sequence[Divergence] = (),
    *,
    title: str | None = None,
) -> go.Figure:
    """The largest `metric` at each depth, one line per target, log scale: how error grows through the
    network. A target's first divergence is a red ring at its depth."""
    profile = depth_profile(rows, metric, drift)
    label = metric_label(metric)
    if not len(profile):
        return empty_figure(f"no {drift} rows", title=title)
    depths = depth_order(profile["depth"])
    part = rows[rows["drift"] == drift]
    depth_of = depth_labels(part)
    fig = go.Figure()
    for i, (target, line) in enumerate(profile.groupby("target", sort=False)):
        # a zero cannot be drawn on a log axis: a gap says "exactly equal" there
        y = [float(v) if v > 0 else None for v in line["value"]]
        color = LINE_COLORS[i % len(LINE_COLORS)]
        fig.add_trace(
            go.Scatter(
                x=line["depth"].tolist(),
                y=y,
                mode="lines+markers",
                name=plot_text(target),
                line={"color": color},
                hovertemplate=f"{plot_text(target)} · block %{{x}} · {label} %{{y:.3g}}<extra></extra>",
            )
        )
        mark = _marked(divergences, str(target))
        if mark is None:
            continue
        mine = part[part["target"] == target]
        hit = mine[(mine["module_path"] + _call_suffix(mine)) == mark.module]
        if len(hit):
            at = depth_of[hit.index[0]]
            value = line.loc[line["depth"] == at, "value"]
            fig.add_trace(
                go.Scatter(
                    x=[at],
                    y=[float(value.iloc[0]) if len(value) and value.iloc[0] > 0 else None],
                    mode="markers",
                    marker={
                        "symbol": "circle-open",
                        "size": 16,
                        "color": DIVERGENCE_COLOR,
                        "line": {"width": 3},
                    },
                    name=plot_text(f"{target}: first divergence"),
                    hovertext=[plot_text(mark.sentence())],
                    hovertemplate="%{hovertext}<extra></extra>",
                )
            )
    fig.update_xaxes(**category_axis(depths), title_text="block")
    fig.update_yaxes(type="log", title_text=label, exponentformat="power")
    fig.update_layout(
        title=title_top(title or f"{label} over depth · {drift} drift", 380),
        height=380,
        margin={"t": 80},
        hovermode="closest",
    )
    return fig
