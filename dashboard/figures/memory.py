"""Figures and tables of the Memory placement page, from the `memory_timeline` and `placement`
tables and the metrics rows of the `memory` check.

Pure functions (DataFrames in, Plotly figures or DataFrames out); nothing here imports Streamlit.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from core.models.memory import LEAK_COLUMNS, device_sort_key, leak_figures, module_device_bytes
from dashboard.figures.common import COLORSCALE, category_axis, empty_figure, title_top
from dashboard.text import plot_text

MIB = 2**20
# What a CUDA cell shows: the driver's figure counts the context PyTorch's allocator cannot see.
CUDA_METRICS: dict[str, str] = {
    "driver_used": "driver (this process, context included)",
    "reserved": "reserved by PyTorch's allocator",
    "allocated": "allocated by tensors",
}
# The column beside a CUDA device's for its library workspaces (cuBLAS's and cuBLASLt's).
WORKSPACE_LABEL = "{device} workspaces"
STRAY_COLOR = "#e03131"
FLAG_COLUMNS = ["rule", "variant", "stage", "device", "module", "explanation", "target", "adapter", "tensor"]


def panel_label(target: str, variant: str, several_targets: bool) -> str:
    """A panel's title: the load strategy, with the target when a run has several."""
    name = variant or "base only"
    return f"{target} · {name}" if several_targets else name


def panels(table: pd.DataFrame) -> list[tuple[str, str, str]]:
    """(target, variant, label) of each panel, in table order."""
    if table.empty:
        return []
    target = table["target"] if "target" in table else pd.Series("", index=table.index)
    variant = table["variant"].fillna("") if "variant" in table else pd.Series("", index=table.index)
    pairs = list(dict.fromkeys(zip(target, variant, strict=True)))
    several = len({t for t, _ in pairs}) > 1
    return [(t, v, panel_label(t, v, several)) for t, v in pairs]


def _panel_rows(table: pd.DataFrame, target: str, variant: str) -> pd.DataFrame:
    rows = table
    if "target" in table:
        rows = rows[rows["target"] == target]
    if "variant" in table:
        rows = rows[rows["variant"].fillna("") == variant]
    return rows


def cell_bytes(row: pd.Series | dict, metric: str) -> float:
    """The figure a timeline cell shows: RSS for the CPU, `metric` for a CUDA device.

    Where the driver's figure is unknown (no NVML, a container), the allocator's reserved bytes
    stand in for it.
    """
    if row["device"] == "cpu":
        value = row.get("rss")
    else:
        value = row.get(metric)
        if _missing(value) and metric == "driver_used":
            value = row.get("reserved")
    return math.nan if _missing(value) else float(value)


def _missing(value: Any) -> bool:
    return value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value))


def timeline_grid(timeline: pd.DataFrame, metric: str = "driver_used") -> pd.DataFrame:
    """Stage (rows, in load order) × device (columns) in MiB for ONE panel; NaN where not sampled."""
    if timeline.empty:
        return pd.DataFrame()
    values = timeline.assign(_mib=[cell_bytes(r, metric) / MIB for _, r in timeline.iterrows()])
    stages = list(values.sort_values("order").drop_duplicates("order")["stage"])
    devices = sorted(values["device"].unique(), key=device_sort_key)
    grid = values.pivot_table(index="stage", columns="device", values="_mib", aggfunc="max", dropna=False)
    grid = grid.reindex(index=stages, columns=devices).astype(float)
    grid.index.name, grid.columns.name = "stage", "device"
    return grid


def workspace_devices(timeline: pd.DataFrame) -> list[str]:
    """The CUDA devices where library workspaces held memory at some sample, in device order (none in a
    run recorded before workspaces had a column of their own)."""
    if timeline.empty or "workspace" not in timeline:
        return []
    held = timeline[(timeline["device"] != "cpu") & (timeline["workspace"].fillna(0) > 0)]
    return sorted(held["device"].unique(), key=device_sort_key)


def _uses(row: pd.Series) -> bool:
    for col in ("allocated", "reserved", "driver_used"):
        v = row.get(col)
        if not _missing(v) and v > 0:
            return True
    v = row.get("context")
    return not _missing(v) and bool(v)


def _hover(row: pd.Series) -> str:
    def mib(col: str) -> str:
        v = row.get(col)
        return "—" if _missing(v) else f"{v / MIB:,.2f} MiB"

    lines = [f"<b>{plot_text(row['stage'])}</b> · {plot_text(row['device'])}"]
    if row["device"] == "cpu":
        lines.append(f"RSS {mib('rss')}")
    else:
        ctx = row.get("context")
        held = row.get("workspace")
        lines += [
            f"allocated {mib('allocated')}"
            + ("" if _missing(held) or not held else f", of which library workspaces {mib('workspace')}"),
            f"reserved {mib('reserved')}",
            f"driver (this process) {mib('driver_used')}",
            f"CUDA context: {'unknown' if _missing(ctx) else 'yes' if ctx else 'no'}",
        ]
        requested = row.get("requested")
        if not _missing(requested) and not requested and _uses(row):
            lines.append("<b>✗ not asked for by any target</b>")
    return "<br>".join(lines)


def _workspace_hover(row: pd.Series) -> str:
    value = row.get("workspace")
    held = "unknown" if _missing(value) else f"{value / MIB:,.2f} MiB"
    return (
        f"<b>{plot_text(row['stage'])}</b> · {plot_text(row['device'])}<br>library workspaces (cuBLAS, "
        f"cuBLASLt) {held}<br>part of allocated, made by this stage's matmuls; released after each sample "
        "and by cleanup: no leak"
    )


def timeline_heatmap(
    timeline: pd.DataFrame, metric: str = "driver_used", *, title: str | None = None
) -> go.Figure:
    """Memory in MiB: rows = load stages, columns = device index, one panel per load strategy.

    The CPU column is the process's RSS; CUDA columns show `metric` (the driver's figure by
    default). Where library workspaces held memory on a CUDA device, a column beside it shows them
    (part of its allocated bytes) at the stages that made them. A cell on a device no target asked
    for that holds memory or a context is marked ✗. Every panel shares the stages, devices and
    colour scale.
    """
    if timeline.empty:
        return empty_figure("no memory timeline in this run", title=title)
    parts = panels(timeline)
    stages = list(timeline.sort_values("order").drop_duplicates("stage")["stage"])
    devices = sorted(timeline["device"].unique(), key=device_sort_key)
    with_workspace = set(workspace_devices(timeline))
    # (device, whether the column is its library workspaces), each workspace column after its device's
    columns = [(d, w) for d in devices for w in (False, True) if not w or d in with_workspace]
    cols = [WORKSPACE_LABEL.format(device=d) if w else "cpu (RSS)" if d == "cpu" else d for d, w in columns]
    fig = make_subplots(
        rows=1,
        cols=len(parts),
        shared_yaxes=True,
        subplot_titles=[plot_text(p[2]) for p in parts],
        horizontal_spacing=min(0.04, 0.5 / max(len(parts), 1)),
    )
    zmax = 0.0
    for i, (target, variant, label) in enumerate(parts, start=1):
        rows = _panel_rows(timeline, target, variant)
        z = np.full((len(stages), len(columns)), np.nan)
        text = [["" for _ in columns] for _ in stages]
        hover = [["not sampled" for _ in columns] for _ in stages]
        for _, row in rows.iterrows():
            r, c = stages.index(row["stage"]), columns.index((row["device"], False))
            if row["device"] in with_workspace and not _missing(row.get("workspace")):
                held = float(row["workspace"]) / MIB
                z[r, c + 1], text[r][c + 1] = held, f"{held:,.1f}"
                hover[r][c + 1] = _workspace_hover(row)
            value = cell_bytes(row, metric) / MIB
            z[r, c] = value
            requested = row.get("requested")
            stray = row["device"] != "cpu" and not _missing(requested) and not requested and _uses(row)
            shown = "" if math.isnan(value) else f"{value:,.1f}"
            if stray:
                shown = f"✗ {shown}" if shown else "✗ context"
            text[r][c] = shown
            hover[r][c] = _hover(row)
        if np.isfinite(z).any():
            zmax = max(zmax, float(np.nanmax(z)))
        fig.add_trace(
            go.Heatmap(
                z=z,
                x=cols,
                y=stages,
                text=text,
                texttemplate="%{text}",
                hovertext=hover,
                hovertemplate="%{hovertext}<extra></extra>",
                coloraxis="coloraxis",
                name=label,
                xgap=1,
                ygap=1,
            ),
            row=1,
            col=i,
        )
        _panel_axes(fig, i, cols, stages)
    what = "RSS (cpu), " + CUDA_METRICS.get(metric, metric) + " (cuda)" if len(devices) > 1 else "RSS"
    if with_workspace:
        what += ", library workspaces"
    coloraxis = {
        "colorscale": COLORSCALE,
        "cmin": 0,
        "cmax": zmax or 1,
        "colorbar": {"title": {"text": "MiB", "side": "right"}},
    }
    _finish_panels(
        fig, title or f"Memory per load stage and device, MiB — {what}", 150 + 30 * len(stages), coloraxis
    )
    return fig


def _panel_axes(fig: go.Figure, col: int, devices: list[str], rows: list[str]) -> None:
    """Panel `col`: every device on top, every row label in order, row labels on the first panel only."""
    fig.update_xaxes(**category_axis(devices), side="top", row=1, col=col)
    fig.update_yaxes(
        **category_axis(rows), autorange="reversed", showticklabels=col == 1, ticks="", row=1, col=col
    )


def _finish_panels(fig: go.Figure, title: str, height: int, coloraxis: dict) -> None:
    """Title, shared colour axis and height (at least 320 px) of a figure of side-by-side panels."""
    height = max(320, height)
    fig.update_layout(title=title_top(title, height), coloraxis=coloraxis, height=height, margin={"t": 110})
    # Subplot titles sit above the top-side device labels.
    for annotation in fig.layout.annotations:
        annotation.update(yshift=30)


def _human_bytes(n: float) -> str:
    if n <= 0 or math.isnan(n):
        return ""
    for unit, size in (("GiB", 2**30), ("MiB", MIB), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{int(n)} B"


def module_grid(placement: pd.DataFrame, target: str, variant: str, by: str = "module") -> pd.DataFrame:
    """Bytes per module × device for one panel (see `core.models.memory.module_device_bytes`)."""
    return module_device_bytes(_panel_rows(placement, target, variant), by=by)


def module_device_heatmap(
    placement: pd.DataFrame, by: str = "module", *, title: str | None = None
) -> go.Figure:
    """Module (rows, in model order) × device (columns), colour log₁₀ bytes, one panel per load strategy.

    Cells show the bytes in readable units; a blank cell holds nothing. Adapter and base tensors
    of a module are summed (the placement table has them one by one).
    """
    if placement.empty:
        return empty_figure("no placement map in this run", title=title)
    parts = panels(placement)
    grids = [module_grid(placement, t, v, by) for t, v, _ in parts]
    modules = list(dict.fromkeys(m for g in grids for m in g.index))
    devices = sorted({d for g in grids for d in g.columns}, key=device_sort_key)
    fig = make_subplots(
        rows=1,
        cols=len(parts),
        shared_yaxes=True,
        subplot_titles=[plot_text(p[2]) for p in parts],
        horizontal_spacing=min(0.04, 0.5 / max(len(parts), 1)),
    )
    for i, ((_, _, label), grid) in enumerate(zip(parts, grids, strict=True), start=1):
        values = grid.reindex(index=modules, columns=devices).fillna(0).to_numpy(dtype=float)
        with np.errstate(divide="ignore"):
            z = np.where(values > 0, np.log10(np.where(values > 0, values, 1)), np.nan)
        fig.add_trace(
            go.Heatmap(
                z=z,
                x=devices,
                y=modules,
                text=[[_human_bytes(v) for v in row] for row in values],
                texttemplate="%{text}",
                customdata=values,
                hovertemplate="%{y} on %{x}: %{customdata:,.0f} bytes<extra>" + label + "</extra>",
                coloraxis="coloraxis",
                name=label,
                xgap=1,
                ygap=1,
            ),
            row=1,
            col=i,
        )
        _panel_axes(fig, i, devices, modules)
    _finish_panels(
        fig,
        title or "Bytes per module and device (parameters and buffers)",
        150 + 22 * len(modules),
        {"colorscale": COLORSCALE, "colorbar": {"title": {"text": "log₁₀ bytes", "side": "right"}}},
    )
    return fig


def flags_table(metrics: pd.DataFrame) -> pd.DataFrame:
    """The `memory` check's findings (verdict broken): rule, where (stage, device, module) and why."""
    if metrics.empty or "check" not in metrics:
        return pd.DataFrame(columns=FLAG_COLUMNS)
    rows = metrics[(metrics["check"] == "memory") & (metrics["verdict"] == "broken")]
    out = pd.DataFrame({c: rows.get(c) for c in FLAG_COLUMNS})
    return out.reset_index(drop=True)


def flag_summary(flags: pd.DataFrame) -> list[str]:
    """One line per (strategy, rule): where it first appeared and how many layers or devices.

    `flags` is `flags_table(...)`; lines follow its order.
    """
    lines = []
    if flags.empty:
        return lines
    keyed = flags.assign(
        _variant=flags["variant"].fillna("").replace("", "base only"), _rule=flags["rule"].fillna("?")
    )
    several_targets = keyed["target"].nunique() > 1
    for (target, variant, rule), group in keyed.groupby(["target", "_variant", "_rule"], sort=False):
        where = f"{target} · {variant}" if several_targets else variant
        first = group.iloc[0]
        devices = ", ".join(dict.fromkeys(d for d in group["device"].dropna() if d))
        modules = group["module"].dropna()
        what = f"{rule} on {devices}" if devices else rule
        if len(modules):
            what += f" in {len(modules)} layer{'s' if len(modules) != 1 else ''}"
        lines.append(f"{where}: {what}, from stage '{first['stage']}'")
    return lines


def leak_table(timeline: pd.DataFrame) -> pd.DataFrame:
    """Per panel and device: bytes still held after cleanup against the sample before the base load."""
    frames = []
    for target, variant, label in panels(timeline):
        rows = _panel_rows(timeline, target, variant)
        records = rows.astype(object).where(rows.notna(), None).to_dict(orient="records")
        leaks = leak_figures(records)
        if not leaks.empty:
            frames.append(leaks.assign(panel=label))
    if not frames:
        return pd.DataFrame(columns=["panel", *LEAK_COLUMNS])
    out = pd.concat(frames, ignore_index=True)
    return out[["panel", *[c for c in out.columns if c != "panel"]]]
