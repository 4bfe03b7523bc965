"""Tests for dashboard.figures.common: pure figure/table builders, no Streamlit."""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

from core.report import VERDICT_ORDER, verdicts_by_check_target
from dashboard.figures import common as F
from dashboard.figures.diffs import block_max_pool, diff_heatmap, diff_histogram
from dashboard.figures.outputs import outputs_figure
from dashboard.figures.overview import verdict_counts_figure


def _row(target, layer, module, role, max_abs, verdict=None, adapter=None, check="weights", **extra):
    verdict = verdict or ("identical" if max_abs == 0 else "within tolerance")
    tensor = f"model.layers.{layer}.{module}.{role}" if layer is not None else f"model.{module}.{role}"
    row = {
        "check": check,
        "target": target,
        "reference": "checkpoint",
        "adapter": adapter,
        "tensor": tensor,
        "layer": layer,
        "module": module,
        "role": role,
        "max_abs": max_abs,
        "rel_l2": max_abs / 2,
        "max_ulp": max_abs * 1e6,
        "min_atol": max_abs,
        "verdict": verdict,
        "explanation": "bitwise identical" if verdict == "identical" else f"{verdict} · max abs {max_abs:g}",
    }
    row.update(extra)
    return row


def _table(rows):
    df = pd.DataFrame(rows)
    df["layer"] = df["layer"].astype("Int64")
    return df


@pytest.fixture
def table():
    rows = []
    for target, scale in (("cpu/float32", 1.0), ("cpu/bfloat16", 1000.0)):
        rows += [
            _row(target, None, "embed_tokens", "base", 0.0),
            _row(target, 0, "q_proj", "base", 1e-7 * scale),
            _row(target, 0, "q_proj", "lora_A", 2e-7 * scale, adapter="lora"),
            _row(target, 0, "v_proj", "lora_B", 3e-7 * scale, adapter="lora"),
            _row(target, 10, "q_proj", "base", 4e-7 * scale),
            _row(target, 2, "q_proj", "lora_A", 0.0, adapter="lora"),
            _row(target, 2, "v_proj", "lora_B", 5e-3 * scale, verdict="drift", adapter="lora"),
            _row(target, 3, "k_proj", "base", 1.23456789e-3, min_atol=9.87654321e-4),
        ]
    return _table(rows)


# --------------------------------------------------------------------------------------------- heatmap_grid
def test_heatmap_grid_shape_order_and_missing_cells(table):
    one = table[table["target"] == "cpu/float32"]
    grid = F.heatmap_grid(one, "max_abs")
    # Layers sort numerically (10 after 3), null layers go to a last "other" row.
    assert list(grid.index) == ["0", "2", "3", "10", "other"]
    # Modules in a block's forward order (q, k, v), not table order; within a module, base first.
    assert list(grid.columns) == [
        "embed_tokens · base",
        "q_proj · base",
        "q_proj · lora_A",
        "k_proj · base",
        "v_proj · lora_B",
    ]
    assert grid.shape == (5, 5)
    assert grid.loc["0", "q_proj · lora_A"] == 2e-7
    assert grid.loc["other", "embed_tokens · base"] == 0.0
    assert math.isnan(grid.loc["2", "q_proj · base"])  # no row for that cell
    assert math.isnan(grid.loc["other", "q_proj · base"])
    assert grid.dtypes.map(lambda d: d == np.float64).all()


def test_heatmap_grid_base_role_first_even_when_it_appears_later():
    t = _table([_row("t", 0, "q_proj", "lora_A", 1e-6), _row("t", 0, "q_proj", "base", 2e-6)])
    assert list(F.heatmap_grid(t, "max_abs").columns) == ["q_proj · base", "q_proj · lora_A"]


def test_heatmap_grid_keeps_max_of_duplicates():
    t = _table([_row("t", 0, "q_proj", "base", 1e-6), _row("t", 0, "q_proj", "base", 5e-6)])
    grid = F.heatmap_grid(t, "max_abs")
    assert grid.shape == (1, 1)
    assert grid.iloc[0, 0] == 5e-6


# --------------------------------------------------------------------------------------------- drift_heatmap
def _heatmaps(fig):
    return [tr for tr in fig.data if tr.type == "heatmap"]


def _scatters(fig):
    """The verdict layer's points (the legend-only swatches carry no data)."""
    return [tr for tr in fig.data if tr.type == "scatter" and tr.customdata is not None]


def _legend(fig):
    return [tr.name for tr in fig.data if tr.type == "scatter" and tr.showlegend is not False]


def test_drift_heatmap_panels_and_exact_log_values(table):
    fig = F.drift_heatmap(table, "max_abs")
    heat = _heatmaps(fig)
    assert len(heat) == 2  # one per target, in order of first appearance
    assert [h.name for h in heat] == ["cpu/float32", "cpu/bfloat16"]
    assert [a.text for a in fig.layout.annotations[:2]] == ["cpu/float32", "cpu/bfloat16"]
    # Panels side by side with their own x axes, sharing one colour axis.
    assert {h.xaxis for h in heat} == {"x", "x2"}
    assert {h.coloraxis for h in heat} == {"coloraxis"}
    assert "log₁₀ max |Δ|" in fig.layout.coloraxis.colorbar.title.text

    for h, scale in zip(heat, (1.0, 1000.0), strict=True):
        z = np.asarray(h.z, dtype=float)
        rows, cols = list(h.y), list(h.x)
        assert rows == ["0", "2", "3", "10", "other"]
        assert z[rows.index("0"), cols.index("q_proj · lora_A")] == np.log10(2e-7 * scale)
        assert z[rows.index("2"), cols.index("v_proj · lora_B")] == np.log10(5e-3 * scale)
        assert z[rows.index("10"), cols.index("q_proj · base")] == np.log10(4e-7 * scale)
        # metric 0 and missing cells both show the background
        assert np.isnan(z[rows.index("other"), cols.index("embed_tokens · base")])
        assert np.isnan(z[rows.index("2"), cols.index("q_proj · lora_A")])
        assert np.isnan(z[rows.index("other"), cols.index("q_proj · base")])


def test_drift_heatmap_y_reversed_categorical(table):
    fig = F.drift_heatmap(table, "rel_l2")
    assert fig.layout.yaxis.autorange == "reversed"
    assert fig.layout.xaxis.type == "category"
    assert list(fig.layout.yaxis.categoryarray) == ["0", "2", "3", "10", "other"]
    assert fig.layout.height >= 320
    assert "relative L2" in fig.layout.coloraxis.colorbar.title.text


def test_drift_heatmap_verdict_layer_marks_identical_and_identifies_tensors(table):
    fig = F.drift_heatmap(table, "max_abs")
    points = {}
    for tr in _scatters(fig):
        assert tr.mode == "markers+text"
        for x, y, cd, txt in zip(tr.x, tr.y, tr.customdata, tr.text, strict=True):
            points[(cd[0], y, x)] = (tuple(cd), txt, tr.legendgroup)
    # every existing cell of every target has exactly one point
    assert len(points) == len(table)
    cd, symbol, verdict = points[("cpu/float32", "other", "embed_tokens · base")]
    assert verdict == "identical" and symbol == F.VERDICT_SYMBOLS["identical"]
    assert cd == ("cpu/float32", "", "model.embed_tokens.base", "weights")
    cd, symbol, verdict = points[("cpu/bfloat16", "2", "v_proj · lora_B")]
    assert cd == ("cpu/bfloat16", "lora", "model.layers.2.v_proj.lora_B", "weights")
    assert verdict == "drift" and symbol == "▲"
    # the zero-metric lora cell is NaN in z but still has its verdict point
    assert ("cpu/float32", "2", "q_proj · lora_A") in points


def test_drift_heatmap_hover_has_exact_values_and_one_legend_entry_per_verdict(table):
    fig = F.drift_heatmap(table, "max_abs")
    drift = [tr for tr in _scatters(fig) if tr.legendgroup == "drift"]
    assert len(drift) == 2  # one per panel
    assert [tr.showlegend for tr in drift] == [False, False]  # the legend has its own swatches
    legend = _legend(fig)
    assert sorted(legend) == sorted(f"{F.VERDICT_SYMBOLS[v]} {v}" for v in set(table["verdict"]))
    hover = drift[1].hovertext[0]
    assert "model.layers.2.v_proj.lora_B" in hover
    assert "cpu/bfloat16" in hover
    assert "drift" in hover
    assert "5</" not in hover  # no stray markup from the explanation
    for m in F.METRICS:
        assert F.METRIC_LABELS[m] in hover
    assert "max |Δ|: 5<br>" in hover
    assert "relative L2: 2.5<br>" in hover
    assert "max ulp (target dtype): 5e+06<br>" in hover
    assert "max abs 5" in hover  # explanation
    assert drift[0].marker.color == F.VERDICT_COLORS["drift"]
    # heatmaps do not steal the hover from the points
    assert all(h.hoverinfo == "skip" for h in _heatmaps(fig))


def test_drift_heatmap_hover_uses_6_significant_digits(table):
    fig = F.drift_heatmap(table, "max_abs")
    hovers = [h for tr in _scatters(fig) for h in tr.hovertext if "layers.3.k_proj" in h]
    assert len(hovers) == 2
    assert "max |Δ|: 0.00123457<br>" in hovers[0]
    assert "smallest passing atol: 0.000987654<br>" in hovers[0]


def test_drift_heatmap_empty_and_all_nan():
    empty = F.drift_heatmap(pd.DataFrame(columns=["check", "target", "layer", "module", "role"]), "max_abs")
    assert isinstance(empty, go.Figure)
    assert any(a.text == "no rows" for a in empty.layout.annotations)

    t = _table([_row("t", 0, "q_proj", "base", 0.0), _row("t", 1, "q_proj", "base", 1.0, verdict="broken")])
    t.loc[1, "max_abs"] = np.nan
    fig = F.drift_heatmap(t, "max_abs")
    assert np.isnan(np.asarray(_heatmaps(fig)[0].z, dtype=float)).all()
    assert sum(len(s.x) for s in _scatters(fig)) == 2
    F.figure_html(fig)  # serialises without choking on NaN


# --------------------------------------------------------------------------------------------- summaries
def test_verdict_counts_figure_traces_in_verdict_order(table):
    counts = verdicts_by_check_target(table)
    fig = verdict_counts_figure(counts)
    assert len(fig.data) == 4
    assert [tr.name.split(" ", 1)[1] for tr in fig.data] == list(VERDICT_ORDER)
    assert [tr.marker.color for tr in fig.data] == [F.VERDICT_COLORS[v] for v in VERDICT_ORDER]
    assert fig.layout.barmode == "stack"
    assert list(fig.data[0].y) == ["weights · cpu/bfloat16", "weights · cpu/float32"]
    drift = fig.data[VERDICT_ORDER.index("drift")]
    assert list(drift.x) == [1, 1]
    assert len(verdict_counts_figure(verdicts_by_check_target(table.iloc[0:0])).data) == 4


def test_outputs_figure_groups_by_adapter_with_base():
    rows = [
        _row("cpu/float32", None, "logits", "output", 3e-7, check="outputs"),
        _row("cpu/float32", None, "logits", "output", 2e-7, check="outputs", adapter="lora"),
        _row("cpu/bfloat16", None, "logits", "output", 5e-3, verdict="drift", check="outputs"),
        _row("cpu/bfloat16", None, "logits", "output", 0.0, check="outputs", adapter="lora"),
    ]
    fig = outputs_figure(_table(rows))
    bars = [tr for tr in fig.data if tr.type == "bar" and tr.x != (None,)]
    assert [b.name for b in bars] == ["cpu/float32", "cpu/bfloat16"]
    assert list(bars[0].x) == ["base", "lora"]
    assert fig.layout.yaxis.type == "log"
    assert list(bars[1].marker.color) == [F.VERDICT_COLORS["drift"], F.VERDICT_COLORS["identical"]]
    assert bars[1].y[0] == 5e-3
    assert 0 < bars[1].y[1] < 2e-7  # zero is drawn as a stub below the smallest value
    assert "max |Δ|: 0<" in bars[1].hovertext[1]  # hover keeps the exact value
    assert f"{5e-3:.6g}" in bars[1].hovertext[0]


def test_outputs_figure_gives_a_bare_encoders_pooled_output_its_own_group():
    rows = [
        _row("cpu/float32", None, "last_hidden_state", "output", 3e-7, check="outputs"),
        _row("cpu/float32", None, "pooler_output", "output", 2e-7, check="outputs"),
        _row("cpu/float32", None, "last_hidden_state", "output", 4e-7, check="outputs", adapter="lora"),
        _row("cpu/float32", None, "pooler_output", "output", 1e-7, check="outputs", adapter="lora"),
    ]
    bars = [tr for tr in outputs_figure(_table(rows)).data if tr.type == "bar" and tr.x != (None,)]
    assert list(bars[0].x) == ["base", "base · pooler_output", "lora", "lora · pooler_output"]
    assert list(bars[0].y) == [3e-7, 2e-7, 4e-7, 1e-7]


# --------------------------------------------------------------------------------------------- pooling
def test_block_max_pool_large_matrix_keeps_the_max_in_the_right_block():
    rng = np.random.default_rng(0)
    m = rng.standard_normal((1000, 700))
    m[613, 401] = -1e6
    pooled, rs, cs = block_max_pool(m)
    assert pooled.dtype == np.float64
    assert pooled.shape[0] <= 256 and pooled.shape[1] <= 256
    assert pooled.shape == (len(rs), len(cs))
    assert pooled.max() == np.abs(m).max() == 1e6
    i, j = np.unravel_index(np.argmax(pooled), pooled.shape)
    assert rs[i] <= 613 < (rs[i + 1] if i + 1 < len(rs) else 1000)
    assert cs[j] <= 401 < (cs[j + 1] if j + 1 < len(cs) else 700)
    # block size b = ceil(n / 256): 4 rows, 3 cols
    assert list(rs[:3]) == [0, 4, 8] and list(cs[:3]) == [0, 3, 6]
    # each pooled value is exactly the block max
    assert pooled[1, 2] == np.abs(m[4:8, 6:9]).max()
    # the last (short) block covers the tail
    assert pooled[-1, -1] == np.abs(m[rs[-1] :, cs[-1] :]).max()


def test_block_max_pool_preserves_nan_and_small_matrices():
    m = np.ones((600, 600))
    m[5, 5] = np.nan
    pooled, rs, cs = block_max_pool(m)
    assert list(rs[:3]) == [0, 3, 6]  # b = ceil(600 / 256) = 3
    assert np.isnan(pooled[1, 1])  # element (5, 5) lies in block rows 3–5, cols 3–5
    assert np.isnan(pooled).sum() == 1
    assert np.nanmax(pooled) == 1.0

    small = np.array([[-1.5, 2.0], [0.0, -3.0]], dtype=np.float32)
    pooled, rs, cs = block_max_pool(small)
    assert pooled.dtype == np.float64
    np.testing.assert_array_equal(pooled, np.abs(small.astype(np.float64)))
    assert list(rs) == [0, 1] and list(cs) == [0, 1]

    with pytest.raises(ValueError):
        block_max_pool(np.zeros(5))


# --------------------------------------------------------------------------------------------- diff figures
def test_diff_heatmap_z_is_log10_of_pooled_values():
    rng = np.random.default_rng(1)
    d = rng.standard_normal((520, 300)) * 1e-4
    d[0:3, :] = 0.0  # a block of exactly equal elements
    d[100, 100] = np.inf
    fig = diff_heatmap(d, title="q_proj")
    pooled, rs, cs = block_max_pool(d)
    heat = fig.data[0]
    z = np.asarray(heat.z, dtype=float)
    finite = np.isfinite(pooled) & (pooled > 0)
    np.testing.assert_array_equal(z[finite], np.log10(pooled[finite]))
    assert np.isnan(z[~finite]).all()
    assert np.isnan(z[0, 0])  # exactly equal → blank
    assert list(heat.x) == list(cs) and list(heat.y) == list(rs)
    assert "block max over 3×2 blocks" in fig.layout.title.text
    assert "blank = exactly equal" in heat.colorbar.title.text
    # the Inf block is marked rather than left blank
    marks = [tr for tr in fig.data if tr.type == "scatter"]
    assert len(marks) == 1 and len(marks[0].x) == 1
    assert heat.text[0][0].startswith("rows 0–2, cols 0–1")
    assert f"{pooled[5, 7]:.6g}" in heat.text[5][7]


def test_diff_heatmap_small_matrix_not_pooled():
    d = np.array([[0.0, 1e-3], [-1e-5, 0.0]])
    fig = diff_heatmap(d)
    assert "block max" not in fig.layout.title.text
    z = np.asarray(fig.data[0].z, dtype=float)
    assert z[0, 1] == np.log10(1e-3) and z[1, 0] == np.log10(1e-5)
    assert np.isnan(z[0, 0])
    assert isinstance(diff_heatmap(np.zeros(7)), go.Figure)  # 1-D tensors show as one row


def test_diff_histogram_counts_add_up():
    rng = np.random.default_rng(2)
    d = rng.standard_normal(10_000) * 1e-5
    d[:123] = 0.0
    d[200:205] = np.nan
    d[300] = -np.inf
    fig = diff_histogram(d, bins=40)
    bar = fig.data[0]
    assert sum(bar.y) == 10_000 - 123 - 6
    assert len(bar.y) == 40
    assert "123 exactly equal" in fig.layout.title.text
    assert "6 NaN/Inf" in fig.layout.title.text
    empty = diff_histogram(np.zeros(4))
    assert "4 exactly equal" in empty.layout.title.text


# --------------------------------------------------------------------------------------------- environment
def test_environment_table_and_highlight():
    envs = {
        "cuda/float32": {"torch": "2.13.0", "tf32_matmul": True, "gpu_name": "H100", "cudnn": None},
        "cpu/float32": {"torch": "2.13.0", "tf32_matmul": False, "cudnn": None},
    }
    df = F.environment_table(envs)
    assert list(df.columns) == ["cuda/float32", "cpu/float32", "differs"]
    assert list(df.index) == ["cudnn", "gpu_name", "tf32_matmul", "torch"]
    assert df.loc["tf32_matmul", "differs"]
    assert not df.loc["torch", "differs"]
    assert not df.loc["cudnn", "differs"]
    assert df.loc["gpu_name", "differs"]  # absent on one target counts as different
    assert df.loc["gpu_name", "cpu/float32"] == F.MISSING
    assert df.loc["cudnn", "cuda/float32"] == F.MISSING
    assert df.loc["tf32_matmul", "cuda/float32"] == "True"
    assert df["differs"].dtype == bool

    styler = F.highlight_differences(df)
    assert "differs" not in styler.data.columns  # dropped: st.dataframe ignores hidden columns
    n_diff = int(df["differs"].sum())
    assert list(styler.data.index[:n_diff]) == list(df.index[df["differs"]])  # differing rows first
    css = styler.to_html().split("</style>")[0]
    rules = re.findall(r"([^{}]+)\{([^}]*)\}", css)
    painted = {
        (int(r), int(c))
        for selector, body in rules
        if "255,165,0" in body
        for r, c in re.findall(r"row(\d+)_col(\d+)", selector)
    }
    assert painted == {(r, c) for r in range(n_diff) for c in range(len(styler.data.columns))}


# --------------------------------------------------------------------------------------------- export
def test_figure_html_is_self_contained(table):
    text = F.figure_html(F.drift_heatmap(table, "max_abs"))
    assert "<html" in text
    assert '<script src="https://cdn' not in text
    assert "plotly.js v" in text or "Plotly" in text
    assert len(text) > 1_000_000  # the library itself is inlined


def test_diff_heatmap_outlines_the_blocks_that_hold_failing_elements():
    diff = np.full((600, 300), 1e-6)
    failing = np.zeros_like(diff, dtype=bool)
    failing[0, 0] = failing[599, 299] = failing[1, 1] = True  # (0,0) and (1,1) share a 3×2 block
    fig = diff_heatmap(diff, failing=failing)
    marks = [t for t in fig.data if t.type == "scatter" and "beyond tolerance" in t.name]
    assert len(marks) == 1 and "3 elements" in marks[0].name
    assert sorted(zip(marks[0].y, marks[0].x, strict=True)) == [(0, 0), (597, 298)]
    assert not [t for t in diff_heatmap(diff, failing=np.zeros_like(failing)).data if t.type == "scatter"]


def test_diff_heatmap_names_the_fold_of_an_already_folded_tensor():
    logits = np.ones((32, 256)) * 1e-6  # (2, 16, 256) as ElementDiff hands it over
    fig = diff_heatmap(logits, shape=(2, 16, 256))
    assert "2×16×256 folded to 256 columns" in fig.layout.title.text
    assert fig.data[0].z.shape == (32, 256)


def test_drift_checks_are_the_per_tensor_checks_a_table_has_in_its_order():
    table = pd.DataFrame({"check": ["outputs", "deltas", "merge", "weights", "deltas"]})
    assert F.drift_checks(table) == ["deltas", "weights"]
    assert F.drift_checks(table.iloc[:0]) == [] and F.drift_checks(table[table.check == "merge"]) == []
