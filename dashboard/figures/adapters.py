"""Figures and display tables of the Adapter consistency page, from the `adapters` check's rows.

Pure functions (DataFrames in, DataFrames or Plotly figures out), tested without Streamlit.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from dashboard.figures.common import VERDICT_SYMBOLS
from dashboard.text import plot_text

GROUND_TRUTH = "isolated"
# Drawn at the bottom of the colour scale: bitwise equal to isolated (log10 of 0 does not exist).
IDENTICAL_FLOOR = -9.0
CELL_COLUMNS = ("target", "adapter", "strategy", "verdict", "max_abs", "argmax_agree", "topk_agree", "reason")


def _ordered(values: pd.Series, first: str | None = None) -> list[str]:
    order = [v for v in dict.fromkeys(values.astype(object)) if isinstance(v, str)]
    if first in order:
        order = [first] + [v for v in order if v != first]
    return order


def _is_true(value) -> bool:
    return isinstance(value, bool | np.bool_) and bool(value)


def consistency_cells(table: pd.DataFrame) -> pd.DataFrame:
    """One cell per (target, adapter, strategy): the prediction verdict against isolated, its max |Δ|,
    agreement and reason. The `isolated` cells are the ground truth (verdict "ground truth", or
    "not applied" when its applied? row flags the adapter)."""
    if table.empty or "strategy" not in table:
        return pd.DataFrame(columns=list(CELL_COLUMNS))
    rows = table[table["check"] == "adapters"]
    cells = []
    for (target, adapter, strategy), part in rows.groupby(["target", "adapter", "strategy"], sort=False):
        pred = part[part["role"] == "prediction"]
        applied = part[part["role"] == "applied"]
        flag = applied["reason"].iloc[0] if len(applied) else ""
        if len(pred):
            r = pred.iloc[0]
            cells.append(
                {
                    "target": target,
                    "adapter": adapter,
                    "strategy": strategy,
                    "verdict": r["verdict"],
                    "max_abs": r["max_abs"],
                    "argmax_agree": r.get("argmax_agree", math.nan),
                    "topk_agree": r.get("topk_agree", math.nan),
                    "reason": r.get("reason") or "",
                }
            )
        elif strategy == GROUND_TRUTH:
            cells.append(
                {
                    "target": target,
                    "adapter": adapter,
                    "strategy": strategy,
                    "verdict": "ground truth",
                    "max_abs": math.nan,
                    "argmax_agree": math.nan,
                    "topk_agree": math.nan,
                    "reason": flag,
                }
            )
    return pd.DataFrame(cells, columns=list(CELL_COLUMNS))


def _cell_text(cell: pd.Series) -> str:
    verdict = str(cell["verdict"])
    if verdict == "ground truth":
        head = "ground truth"
    else:
        head = f"{VERDICT_SYMBOLS.get(verdict, '?')} {verdict}"
        if isinstance(cell["max_abs"], float) and math.isfinite(cell["max_abs"]) and cell["max_abs"] > 0:
            head += f"<br>max |Δ| {cell['max_abs']:.3g}"
    reason = str(cell["reason"] or "")
    short = reason.split(";")[0].strip()
    if "stacking is not the cause" in reason:
        short = "stacked, not the cause"
    return head + (f"<br><i>{plot_text(short)}</i>" if short else "")


def consistency_matrix(cells: pd.DataFrame, target: str) -> go.Figure:
    """Adapters × strategies heatmap for one target: colour = log₁₀ max |Δlogit| against isolated
    (bitwise equal at the bottom of the scale, isolated left blank), text = verdict, max |Δ|, reason."""
    part = cells[cells["target"] == target]
    fig = go.Figure()
    if part.empty:
        fig.add_annotation(text="no adapter rows", showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)
        return fig
    adapters = _ordered(part["adapter"])
    strategies = _ordered(part["strategy"], first=GROUND_TRUTH)
    z = np.full((len(adapters), len(strategies)), np.nan)
    text = [["" for _ in strategies] for _ in adapters]
    hover = [["" for _ in strategies] for _ in adapters]
    for _, cell in part.iterrows():
        i, j = adapters.index(cell["adapter"]), strategies.index(cell["strategy"])
        value = cell["max_abs"]
        if cell["verdict"] == "identical":
            z[i, j] = IDENTICAL_FLOOR
        elif isinstance(value, float) and math.isfinite(value) and value > 0:
            z[i, j] = max(math.log10(value), IDENTICAL_FLOOR)
        elif cell["verdict"] == "broken":
            z[i, j] = 1.0  # did not load: the top of the scale
        text[i][j] = _cell_text(cell)
        agree = cell["argmax_agree"]
        hover[i][j] = (
            f"<b>{plot_text(cell['adapter'])} · {plot_text(cell['strategy'])}</b><br>{plot_text(cell['verdict'])}"
            + (f"<br>max |Δ| {value:.4g}" if isinstance(value, float) and math.isfinite(value) else "")
            + (
                f"<br>argmax agreement {agree:.1%}"
                if isinstance(agree, float) and math.isfinite(agree)
                else ""
            )
            + (f"<br>{plot_text(cell['reason'])}" if cell["reason"] else "")
        )
    fig.add_trace(
        go.Heatmap(
            z=z,
            x=strategies,
            y=adapters,
            text=text,
            texttemplate="%{text}",
            textfont={"size": 13},
            hovertext=hover,
            hovertemplate="%{hovertext}<extra></extra>",
            colorscale="YlOrRd",
            zmin=IDENTICAL_FLOOR,
            zmax=max(0.0, float(np.nanmax(z)) if np.isfinite(z).any() else 0.0),
            colorbar={"title": {"text": "log₁₀ max |Δ|<br>vs isolated"}},
            xgap=3,
            ygap=3,
        )
    )
    height = 160 + 90 * len(adapters)
    fig.update_layout(
        title={"text": f"predictions against isolated — {target}", "x": 0, "xanchor": "left"},
        xaxis={"title": "load strategy", "side": "top", "type": "category"},
        yaxis={"title": "adapter (load order)", "autorange": "reversed", "type": "category"},
        height=height,
        margin={"t": 110},
    )
    return fig


def mutation_table(table: pd.DataFrame) -> pd.DataFrame:
    """The base-mutation list: each base tensor a load changed, against the checkpoint."""
    columns = [
        "target",
        "strategy",
        "adapter",
        "tensor",
        "layer",
        "module",
        "verdict",
        "max_abs",
        "rel_l2",
        "note",
    ]
    if table.empty or "role" not in table:
        return pd.DataFrame(columns=columns)
    rows = table[(table["check"] == "adapters") & (table["role"] == "base weight")]
    return (
        rows[[c for c in columns if c in rows.columns]]
        .rename(columns={"adapter": "changed by"})
        .reset_index(drop=True)
    )


def flag_rows(table: pd.DataFrame) -> pd.DataFrame:
    """Applied? and disabled rows that found a problem: adapters that change nothing, and
    `disable_adapter()` outputs that are not the base model's (a mutated base)."""
    columns = ["target", "strategy", "adapter", "role", "verdict", "max_abs", "reason", "explanation", "note"]
    if table.empty or "role" not in table:
        return pd.DataFrame(columns=columns)
    rows = table[(table["check"] == "adapters") & table["role"].isin(["applied", "disabled"])]
    rows = rows[rows["verdict"] != "identical"]
    return rows[[c for c in columns if c in rows.columns]].reset_index(drop=True)


def conversion_table(table: pd.DataFrame) -> pd.DataFrame:
    """PiSSA conversion rows: the converted LoRA on the original base against the PiSSA model."""
    columns = ["target", "adapter", "reference", "verdict", "max_abs", "rel_l2", "argmax_agree", "note"]
    if table.empty or "role" not in table:
        return pd.DataFrame(columns=columns)
    rows = table[(table["check"] == "adapters") & (table["role"] == "pissa conversion")]
    return rows[[c for c in columns if c in rows.columns]].reset_index(drop=True)


def stacking_summary(cells: pd.DataFrame) -> list[str]:
    """Sentences for the adapters that are stacked yet bitwise equal to isolated (not the cause)."""
    out = []
    for _, c in cells.iterrows():
        if "stacking is not the cause" in str(c["reason"]):
            out.append(f"{c['adapter']} with {c['strategy']} ({c['target']})")
    return out
