"""The Outputs page's figure: each target's output metrics per adapter, against the reference."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from dashboard.figures.common import (
    cell_text,
    empty_figure,
    legend_below_title,
    numeric_values,
    tensor_hover,
    title_top,
    verdict_color,
    verdict_symbol,
    verdicts_in_order,
)
from dashboard.text import plot_text

_TARGET_PATTERNS = ("", "/", ".", "x", "\\", "+", "-", "|")


def outputs_figure(table: pd.DataFrame) -> go.Figure:
    """Grouped bars of output (logits) max |Δ| on a log axis: a group per adapter, a bar per target.

    Bar colour is the verdict; the fill pattern tells targets apart (and carries the target legend).
    ``adapter`` null means the base model and is shown as "base". A log axis cannot draw 0, so
    bitwise-identical (or NaN) outputs are drawn as a short stub at the bottom, labelled with the
    verdict symbol; the hover always shows the exact values.
    """
    if not len(table):
        return empty_figure("no output rows")
    adapters = (
        [cell_text(a) or "base" for a in table["adapter"]] if "adapter" in table else ["base"] * len(table)
    )
    if "module" in table:
        # A bare encoder's second output (its pooled output) gets a group of its own beside the adapter's.
        adapters = [
            a if cell_text(m) in ("", "logits", "last_hidden_state") else f"{a} · {cell_text(m)}"
            for a, m in zip(adapters, table["module"], strict=True)
        ]
    data = table.assign(_adapter=adapters, _value=numeric_values(table["max_abs"]))
    order = list(dict.fromkeys(data["_adapter"]))
    if "base" in order:  # the base model is the baseline every adapter group is read against
        order = ["base"] + [a for a in order if a != "base"]

    positive = data["_value"][np.isfinite(data["_value"]) & (data["_value"] > 0)]
    floor = float(positive.min()) / 10 if len(positive) else 1e-12
    ceiling = float(positive.max()) * 10 if len(positive) else 1.0

    fig = go.Figure()
    targets = [t for t in pd.unique(data["target"].astype(object)) if isinstance(t, str)]
    for i, target in enumerate(targets):
        part = data[data["target"] == target]
        heights = [
            v if np.isfinite(v) and v > 0 else (ceiling if v == np.inf else floor) for v in part["_value"]
        ]
        fig.add_trace(
            go.Bar(
                x=part["_adapter"].tolist(),
                y=heights,
                name=target,
                offsetgroup=target,
                marker={
                    "color": [verdict_color(cell_text(v)) for v in part["verdict"]],
                    "pattern": {"shape": _TARGET_PATTERNS[i % len(_TARGET_PATTERNS)], "fillmode": "overlay"},
                    "line": {"width": 0},
                },
                text=[verdict_symbol(cell_text(v)) for v in part["verdict"]],
                textposition="outside",
                hovertext=[tensor_hover(r) for _, r in part.iterrows()],
                hovertemplate="%{hovertext}<extra></extra>",
                showlegend=False,  # its legend swatch would take the first bar's verdict colour
            )
        )
        # The target's legend entry: its pattern on a neutral grey, so it is not read as a verdict.
        fig.add_trace(
            go.Bar(
                x=[None],
                y=[None],
                name=target,
                marker={
                    "color": "#9ca3af",
                    "pattern": {"shape": _TARGET_PATTERNS[i % len(_TARGET_PATTERNS)], "fillmode": "overlay"},
                },
                legendgroup="targets",
                hoverinfo="skip",
            )
        )
    # Legend-only swatches so the colour key is visible next to the pattern (target) key.
    for verdict in verdicts_in_order(data["verdict"]):
        fig.add_trace(
            go.Bar(
                x=[None],
                y=[None],
                name=f"{verdict_symbol(verdict)} {verdict}",
                marker={"color": verdict_color(verdict)},
                legendgroup="verdicts",
                hoverinfo="skip",
            )
        )
    fig.update_layout(
        barmode="group",
        title=title_top("outputs — max |Δ| of logits vs reference", 440),
        xaxis={"type": "category", "categoryorder": "array", "categoryarray": order, "title": "adapter"},
        yaxis={"type": "log", "title": "max |Δ| (log)", "exponentformat": "power"},
        height=440,
        legend=legend_below_title(440),
        margin={"t": 110},
    )
    return fig


def worst_kl_target(kl: pd.DataFrame) -> str | None:
    """The target whose mean KL over every kept position (all its models) is the largest; None when none."""
    if not len(kl):
        return None
    means = kl.groupby("target", sort=False)["kl"].mean()
    return str(means.idxmax())


def kl_position_figure(kl: pd.DataFrame, target: str | None = None) -> go.Figure:
    """KL(p_ref ‖ p_target) over position for one target (default the worst, `worst_kl_target`): a line per
    adapter and probe row, the position on x, KL on a log axis (a KL of exactly 0 cannot be drawn on it)."""
    target = target or worst_kl_target(kl)
    if target is None:
        return empty_figure("no next-token distributions (the model has no LM head, or no outputs check)")
    rows = kl[kl["target"] == target]
    fig = go.Figure()
    for (adapter, row), part in rows.groupby([rows["adapter"].fillna("base"), "row"], sort=False):
        part = part.sort_values("position")
        name = f"{cell_text(adapter)} · row {int(row)}"
        fig.add_trace(
            go.Scatter(
                x=part["position"],
                y=part["kl"].where(part["kl"] > 0),
                mode="lines+markers",
                name=plot_text(name),
                hovertemplate="position %{x}<br>KL %{y:.3e}<extra>" + plot_text(name) + "</extra>",
            )
        )
    height = 360
    fig.update_layout(
        height=height,
        title=title_top(plot_text(f"KL(p_ref ‖ p_target) over position · {target}"), height),
        xaxis_title="position (padding excluded)",
        yaxis={"type": "log", "title": "KL (nats)"},
        legend=legend_below_title(height),
    )
    return fig


def generations_side_by_side(generations: pd.DataFrame) -> pd.DataFrame:
    """One row per adapter and prompt, one text column per target (the reference's first where it is
    there), and each target's first divergence; a target's tokens get a `⟦` before the first one that
    differs from the reference's, so the place is marked without rendering anything."""
    if not len(generations):
        return pd.DataFrame(columns=["adapter", "prompt"])
    g = generations.assign(adapter=generations["adapter"].fillna("base"))
    out = []
    for (adapter, prompt), part in g.groupby(["adapter", "prompt"], sort=False):
        row: dict[str, object] = {"adapter": adapter, "prompt": prompt}
        for r in part.to_dict(orient="records"):
            tokens = [str(t) for t in r["tokens"]]
            at = None if pd.isna(r["first_divergence"]) else int(r["first_divergence"])
            if at is not None:
                tokens.insert(at, "⟦")
            row[f"{r['target']} text"] = r["text"]
            row[f"{r['target']} tokens"] = " ".join(tokens)
            row[f"{r['target']} parts at"] = at
        out.append(row)
    table = pd.DataFrame(out)
    # the texts side by side first, then where each target parts, then the tokens that show where
    order = [c for kind in (" text", " parts at", " tokens") for c in table.columns if c.endswith(kind)]
    return table[["adapter", "prompt", *order]]
