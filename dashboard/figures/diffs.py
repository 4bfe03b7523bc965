"""One tensor's element-wise difference, as every page's drill-down shows it (`dashboard.ui`): the
difference map pooled to at most 256×256 blocks (block max |Δ|), from the arrays or from a capture's
bounded sketch, and the histogram of |Δ|."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from core.numerics.sketch import Sketch, as_2d, block_starts
from dashboard.figures.common import (
    COLORSCALE,
    VERDICT_COLORS,
    empty_figure,
    legend_below_title,
    log10_positive,
    title_top,
)


# --------------------------------------------------------------------------------------------- element diffs
def block_max_pool(matrix: np.ndarray, max_side: int = 256) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Max of |values| over equal blocks so neither side exceeds ``max_side``.

    Returns ``(pooled, row_starts, col_starts)``: a side of length n > max_side is cut into blocks
    of b = ceil(n / max_side) elements (the last may be shorter), ``*_starts`` being each block's
    first index. Max pooling, not averaging, so the worst element is never diluted; NaN propagates
    (a block holding a NaN is NaN) so a NaN is never hidden either. Small matrices come back as
    ``abs`` in float64, unchanged in shape.
    """
    arr = np.abs(np.asarray(matrix, dtype=np.float64))
    if arr.ndim != 2:
        raise ValueError(f"block_max_pool needs a 2-D array, got shape {arr.shape}")
    if max_side < 1:
        raise ValueError("max_side must be at least 1")
    row_starts, col_starts = (block_starts(n, max_side) for n in arr.shape)
    # np.maximum (unlike np.fmax / nanmax) propagates NaN, which is exactly what is wanted here.
    pooled = arr
    if arr.shape[0] > len(row_starts) and len(row_starts):
        pooled = np.maximum.reduceat(pooled, row_starts, axis=0)
    if arr.shape[1] > len(col_starts) and len(col_starts):
        pooled = np.maximum.reduceat(pooled, col_starts, axis=1)
    return pooled, row_starts, col_starts


def _as_2d(values: np.ndarray, shape: tuple[int, ...] | None = None) -> tuple[np.ndarray, str]:
    """`values` as drawn (the fold rule of core.engine.diffmap.as_2d), and a note on how `shape` was folded.

    `shape` is the tensor's own shape when `values` arrive already folded (as ElementDiff's do).
    """
    arr = np.asarray(values, dtype=np.float64)
    shape = tuple(arr.shape) if shape is None else tuple(shape)
    arr = arr.reshape(as_2d(tuple(arr.shape)))
    if len(shape) == 2:
        return arr, ""
    if len(shape) < 2:
        return arr, "shown as 1 row"
    return arr, f"{'×'.join(map(str, shape))} folded to {shape[-1]} columns"


def _block_ends(starts: np.ndarray, n: int) -> np.ndarray:
    return np.append(starts[1:], n) - 1


def diff_heatmap(
    diff: np.ndarray,
    *,
    title: str = "",
    max_side: int = 256,
    failing: np.ndarray | None = None,
    shape: tuple[int, ...] | None = None,
) -> go.Figure:
    """Heatmap of log₁₀ |target − reference| for one tensor, block-max-pooled when large.

    ``shape`` is the tensor's own shape when ``diff`` is already folded to 2-D, for the title.
    ``failing`` (same shape as ``diff``, bool) marks the elements beyond tolerance: the cells (blocks) that
    hold one get an outlined square, so a handful of failures in a large matrix can be found.

    ``diff`` is the signed float64 element-wise difference. Exactly-equal cells (|d| = 0) are NaN in
    z and show the background ("blank = exactly equal"); NaN/Inf cells are marked with a separate
    red × layer since they would otherwise look blank too. Axis values are element indices (block
    starts when pooled); the hover gives the exact max |d| of the cell and the index range it covers.
    """
    arr, folded = _as_2d(diff, shape)
    if arr.size == 0:
        return empty_figure("empty tensor", title=title or None)
    pooled, row_starts, col_starts = block_max_pool(arr, max_side=max_side)
    fail_pooled = None
    if failing is not None:
        fail2d, _ = _as_2d(np.asarray(failing, dtype=float))
        fail_pooled, _, _ = block_max_pool(fail2d, max_side=max_side)
        fail_pooled = fail_pooled if fail2d.sum() else None
        n_failing = int(fail2d.sum())
    else:
        n_failing = 0
    return pooled_diff_heatmap(
        pooled,
        row_starts,
        col_starts,
        arr.shape,
        failing=fail_pooled,
        n_failing=n_failing,
        folded=folded,
        title=title,
    )


def sketch_heatmap(sketch: Sketch, *, title: str = "") -> go.Figure:
    """The drill-down heatmap of a tensor kept only as its sketch (the same picture, from the pooled map)."""
    if sketch.numel == 0:
        return empty_figure("empty tensor", title=title or None)
    _, folded = _as_2d(np.zeros((sketch.rows, sketch.cols)), sketch.shape)
    n_failing = int(sketch.failing.sum())
    return pooled_diff_heatmap(
        sketch.pooled,
        sketch.row_starts,
        sketch.col_starts,
        (sketch.rows, sketch.cols),
        failing=sketch.failing if n_failing else None,
        n_failing=n_failing,
        folded=folded,
        title=title,
    )


def pooled_diff_heatmap(
    pooled: np.ndarray,
    row_starts: np.ndarray,
    col_starts: np.ndarray,
    shape2: tuple[int, int],
    *,
    failing: np.ndarray | None = None,
    n_failing: int = 0,
    folded: str = "",
    title: str = "",
) -> go.Figure:
    """Heatmap of a block-max |Δ| map (``block_max_pool``'s output, or a sketch's).

    ``shape2`` is the 2-D fold pooled from; ``failing`` (pooled shape) is > 0 in blocks holding an
    element beyond tolerance, ``n_failing`` how many elements that is in all.
    """
    pooled = np.asarray(pooled, dtype=np.float64)
    row_starts, col_starts = np.asarray(row_starts), np.asarray(col_starts)
    row_ends = _block_ends(row_starts, shape2[0])
    col_ends = _block_ends(col_starts, shape2[1])
    rb = int(row_starts[1] - row_starts[0]) if len(row_starts) > 1 else 1
    cb = int(col_starts[1] - col_starts[0]) if len(col_starts) > 1 else 1
    is_pooled = pooled.shape != tuple(shape2)

    def span(a: int, b: int) -> str:
        return str(a) if a == b else f"{a}–{b}"

    rows_txt = [span(int(a), int(b)) for a, b in zip(row_starts, row_ends, strict=True)]
    cols_txt = [span(int(a), int(b)) for a, b in zip(col_starts, col_ends, strict=True)]
    what = "block max |d|" if is_pooled else "|d|"
    hover = [
        [
            f"rows {r}, cols {c}<br>{what} = "
            + ("0 (exactly equal)" if v == 0 else ("NaN" if np.isnan(v) else f"{v:.6g}"))
            for c, v in zip(cols_txt, line, strict=True)
        ]
        for r, line in zip(rows_txt, pooled, strict=True)
    ]
    fig = go.Figure(
        go.Heatmap(
            z=log10_positive(pooled),
            x=col_starts,
            y=row_starts,
            text=hover,
            hovertemplate="%{text}<extra></extra>",
            colorscale=COLORSCALE,
            colorbar={"title": {"text": "log₁₀ |Δ|<br>(blank = exactly equal)", "side": "right"}},
            name="log10 |d|",
        )
    )
    bad = ~np.isfinite(pooled)
    if bad.any():
        ri, ci = np.nonzero(bad)
        fig.add_trace(
            go.Scatter(
                x=col_starts[ci],
                y=row_starts[ri],
                mode="markers",
                marker={"symbol": "x", "color": VERDICT_COLORS["broken"], "size": 9},
                name="NaN / Inf",
                text=[hover[a][b] for a, b in zip(ri, ci, strict=True)],
                hovertemplate="%{text}<extra>NaN / Inf</extra>",
            )
        )
    if failing is not None and n_failing:
        ri, ci = np.nonzero(np.asarray(failing) > 0)
        limit = 5000  # beyond this the markers hide the map; the count is in the legend
        fig.add_trace(
            go.Scatter(
                x=col_starts[ci[:limit]],
                y=row_starts[ri[:limit]],
                mode="markers",
                marker={
                    "symbol": "square-open",
                    "color": VERDICT_COLORS["drift"],
                    "size": 9,
                    "line": {"width": 2},
                },
                name=f"beyond tolerance ({n_failing} element{'s' if n_failing != 1 else ''})",
                text=[hover[a][b] for a, b in zip(ri[:limit], ci[:limit], strict=True)],
                hovertemplate="%{text}<extra>beyond tolerance</extra>",
            )
        )
    parts = [title] if title else []
    parts.append(f"{shape2[0]}×{shape2[1]}")
    if folded:
        parts.append(folded)
    if is_pooled:
        parts.append(f"block max over {rb}×{cb} blocks")
    if not np.isfinite(log10_positive(pooled)).any() and not bad.any():
        parts.append("all elements exactly equal")
    aspect = pooled.shape[0] / max(1, pooled.shape[1])
    height = int(min(800, max(320, 160 + 520 * aspect)))
    shows_legend = bool(bad.any() or (failing is not None and n_failing))
    fig.update_layout(
        title=title_top(" · ".join(parts), height),
        xaxis={"title": "column index", "showgrid": False, "zeroline": False},
        yaxis={"title": "row index", "autorange": "reversed", "showgrid": False, "zeroline": False},
        height=height,
        showlegend=shows_legend,
        legend=legend_below_title(height),
        margin={"t": 90 if shows_legend else 60},
    )
    return fig


def diff_histogram(diff: np.ndarray, *, bins: int = 60) -> go.Figure:
    """Histogram of log₁₀ |d| over the nonzero finite elements of a diff.

    Binned here with numpy (not by plotly) so a large tensor does not put millions of values into
    the figure. The title counts what the histogram cannot show: exactly-equal and NaN/Inf elements.
    """
    arr = np.asarray(diff, dtype=np.float64).ravel()
    finite = np.isfinite(arr)
    n_nonfinite = int((~finite).sum())
    n_zero = int((arr[finite] == 0).sum())
    mags = np.abs(arr[finite & (arr != 0)])
    if not mags.size:
        return binned_histogram(np.empty(0), np.empty(0), np.empty(0), n_zero, n_nonfinite, arr.size)
    counts, edges = np.histogram(np.log10(mags), bins=bins)
    return binned_histogram(edges[:-1], edges[1:], counts, n_zero, n_nonfinite, arr.size)


def sketch_histogram(sketch: Sketch) -> go.Figure:
    """The drill-down histogram of a tensor kept only as its sketch (quarter-octave bins of |Δ|)."""
    low, high, counts = sketch.histogram()
    return binned_histogram(low, high, counts, sketch.n_zero, sketch.n_nonfinite, sketch.numel)


def binned_histogram(
    low: np.ndarray, high: np.ndarray, counts: np.ndarray, n_zero: int, n_nonfinite: int, total: int
) -> go.Figure:
    """Bars of element counts over log₁₀ |d| bins ``[low, high)``; the title counts what bars cannot show."""
    n_diff = int(np.sum(counts))
    title = f"{n_diff:,} differing · {n_zero:,} exactly equal · {n_nonfinite:,} NaN/Inf (of {total:,})"
    if not n_diff:
        return empty_figure("no nonzero finite differences", title=title)
    low, high = np.asarray(low, dtype=np.float64), np.asarray(high, dtype=np.float64)
    fig = go.Figure(
        go.Bar(
            x=(low + high) / 2,
            y=counts,
            width=high - low,
            customdata=np.stack([low, high], axis=1),
            hovertemplate="log₁₀ |d| in [%{customdata[0]:.3f}, %{customdata[1]:.3f})<br>"
            "%{y} elements<extra></extra>",
            name="elements",
        )
    )
    fig.update_layout(
        title=title,
        xaxis_title="log₁₀ |target − reference|",
        # Log counts: the few worst elements are the point of this plot and vanish on a linear axis.
        yaxis={"title": "elements (log)", "type": "log"},
        bargap=0,
        height=320,
    )
    return fig
