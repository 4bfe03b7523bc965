"""The Overview page's figures: verdict counts per check and target, and the target × target matrix of a
run's pairwise rows (`core.engine.pairwise`). Pure DataFrame → Plotly builders."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from core.engine.pairwise import DIFFERS, PAIR_SEVERITY
from core.judgement import Groups
from core.report import VERDICT_ORDER
from dashboard.figures.common import (
    UNKNOWN_COLOR,
    VERDICT_COLORS,
    VERDICT_SYMBOLS,
    empty_figure,
    hover_number,
    verdict_color,
    verdict_symbol,
)
from dashboard.text import plot_text

# `differs` (hashes differ, tensors not kept) is neither a pass nor a measured failure: grey-violet.
PAIR_COLORS = {**VERDICT_COLORS, DIFFERS: "#9c7ccf"}
PAIR_SYMBOLS = {**VERDICT_SYMBOLS, DIFFERS: "≠"}


def pairwise_figure(matrix: pd.DataFrame) -> go.Figure:
    """One cell per pair of targets: coloured by the worst verdict over the pair's rows, with its
    symbol and the largest max |Δ| as text (`core.engine.pairwise.pair_matrix`); the diagonal is empty."""
    if matrix.empty:
        return empty_figure("fewer than two targets: nothing to pair")
    targets = list(dict.fromkeys([*matrix["target"], *matrix["other"]]))
    n = len(targets)
    index = {t: i for i, t in enumerate(targets)}
    z = np.full((n, n), np.nan)
    text = [["" for _ in targets] for _ in targets]
    hover = [["" for _ in targets] for _ in targets]
    for row in matrix.itertuples(index=False):
        i, j = index[row.target], index[row.other]
        z[i, j] = PAIR_SEVERITY.get(row.verdict, max(PAIR_SEVERITY.values()))
        text[i][j] = f"{PAIR_SYMBOLS.get(row.verdict, '?')} {hover_number(row.max_abs)}"
        hover[i][j] = (
            f"{plot_text(row.target)} vs {plot_text(row.other)}<br>worst: {plot_text(row.verdict)}"
            f"<br>max |Δ| {hover_number(row.max_abs)} over {int(row.rows)} rows"
        )
    top = max(PAIR_SEVERITY.values())
    # a discrete scale: each severity gets its verdict's colour
    scale = []
    for verdict, level in sorted(PAIR_SEVERITY.items(), key=lambda kv: kv[1]):
        color = PAIR_COLORS.get(verdict, UNKNOWN_COLOR)
        scale += [[level / (top + 1), color], [(level + 1) / (top + 1), color]]
    labels = [plot_text(t) for t in targets]
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=labels,
            y=labels,
            zmin=-0.5,
            zmax=top + 0.5,
            colorscale=scale,
            showscale=False,
            text=text,
            texttemplate="%{text}",
            hovertext=hover,
            hovertemplate="%{hovertext}<extra></extra>",
            xgap=2,
            ygap=2,
        )
    )
    fig.update_layout(
        height=max(260, 120 + 60 * n),
        xaxis={"type": "category", "side": "top"},
        yaxis={"type": "category", "autorange": "reversed"},
        margin={"l": 10, "r": 10, "t": 60, "b": 10},
    )
    return fig


def snapshot_sources(imported: list[dict]) -> pd.DataFrame:
    """One row per snapshot a run was made from (`RunRecord.imported`): file, machine, label, targets."""
    return pd.DataFrame(
        [
            {
                "snapshot": i.get("snapshot"),
                "machine": i.get("machine"),
                "targets named": i.get("label"),
                "made": pd.Timestamp(i["created"], unit="s").strftime("%Y-%m-%d %H:%M:%S UTC")
                if isinstance(i.get("created"), int | float)
                else None,
                "targets": ", ".join(map(str, i.get("targets") or [])),
            }
            for i in imported
        ]
    )


def verdict_counts_figure(counts: pd.DataFrame) -> go.Figure:
    """Horizontal stacked bars of verdict counts, one bar per "check · target".

    ``counts`` is ``core.report.verdicts_by_check_target(table)``; one trace per verdict, in
    ``VERDICT_ORDER``, coloured by verdict.
    """
    labels = [f"{c} · {t}" for c, t in zip(counts.get("check", []), counts.get("target", []), strict=True)]
    fig = go.Figure()
    for verdict in VERDICT_ORDER:
        n = (
            pd.to_numeric(counts[verdict], errors="coerce").fillna(0).astype(int).tolist()
            if verdict in counts.columns
            else [0] * len(labels)
        )
        fig.add_trace(
            go.Bar(
                y=labels,
                x=n,
                orientation="h",
                name=f"{verdict_symbol(verdict)} {verdict}",
                marker={"color": verdict_color(verdict)},
                # Labels only on non-empty segments; a "0" would float over the neighbouring bar.
                text=[str(v) if v else "" for v in n],
                textposition="inside",
                textangle=0,  # counts in narrow bars stay upright (smaller) rather than turned 90°
                insidetextanchor="middle",
                hovertemplate=f"%{{y}}<br>{verdict}: %{{x}}<extra></extra>",
            )
        )
    height = max(220, 110 + 30 * len(labels))
    fig.update_layout(
        barmode="stack",
        height=height,
        xaxis_title="tensors / outputs",
        yaxis={"autorange": "reversed", "type": "category"},
        # plotly reverses the legend of stacked bars by default; keep it in severity order.
        legend={
            "orientation": "h",
            "yanchor": "bottom",
            "y": 1.02,
            "xanchor": "left",
            "x": 0,
            "traceorder": "normal",
        },
        margin={"t": 60},
    )
    if not labels:
        fig.add_annotation(text="no rows", showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)
    return fig


def groups_table(groups: dict[str, Groups]) -> pd.DataFrame:
    """One row per agreement group: its check, its number within the check, its members and how it
    differs from the check's first group (`core.judgement.agreement_groups`)."""
    rows = [
        {
            "check": check,
            "group": i + 1,
            "targets": ", ".join(g.members),
            "how it differs": g.differs or ("bitwise equal" if len(g.members) > 1 else "—"),
            "tensors differing": g.n_differing,
        }
        for check, gs in groups.items()
        for i, g in enumerate(gs.groups)
    ]
    return pd.DataFrame(rows, columns=["check", "group", "targets", "how it differs", "tensors differing"])
