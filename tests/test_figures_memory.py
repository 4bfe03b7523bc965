"""The Memory placement page's figure builders on constructed tables (no Streamlit)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from core.models import memory
from dashboard.figures import memory as fm

MIB = 2**20


def timeline() -> pd.DataFrame:
    rows = []
    for variant, stray in (("torch_device", 0), ("no_torch_device", 300 * MIB)):
        rows += [
            {**memory.timeline_record(memory.PROCESS_START, 0, "cpu", rss=15 * MIB), "variant": variant},
            {**memory.timeline_record(memory.BASE_LOADED, 1, "cpu", rss=400 * MIB), "variant": variant},
            {
                **memory.timeline_record(
                    memory.BASE_LOADED, 1, "cuda:0", allocated=0, reserved=0, driver_used=0, context=False
                ),
                "variant": variant,
            },
            {
                **memory.timeline_record(
                    memory.BASE_LOADED,
                    1,
                    "cuda:1",
                    allocated=MIB,
                    reserved=2 * MIB,
                    driver_used=None,
                    context=True,
                ),
                "variant": variant,
            },
            {
                **memory.timeline_record(
                    memory.CLEANED_UP,
                    2,
                    "cuda:0",
                    allocated=0,
                    reserved=0,
                    driver_used=stray,
                    context=bool(stray),
                ),
                "variant": variant,
            },
            {**memory.timeline_record(memory.CLEANED_UP, 2, "cpu", rss=380 * MIB), "variant": variant},
        ]
    table = pd.DataFrame(rows)
    table["target"] = "cuda:1/float32"
    table["requested"] = table["device"].isin(["cpu", "cuda:1"])
    return table


def test_timeline_grid_is_stage_by_device_in_mib():
    part = timeline()
    grid = fm.timeline_grid(part[part["variant"] == "no_torch_device"])
    assert list(grid.index) == [memory.PROCESS_START, memory.BASE_LOADED, memory.CLEANED_UP]
    assert list(grid.columns) == ["cpu", "cuda:0", "cuda:1"]
    assert grid.loc[memory.BASE_LOADED, "cpu"] == 400
    # no driver figure: the allocator's reserved bytes stand in
    assert grid.loc[memory.BASE_LOADED, "cuda:1"] == 2
    assert grid.loc[memory.CLEANED_UP, "cuda:0"] == 300
    assert math.isnan(grid.loc[memory.PROCESS_START, "cuda:0"])
    assert fm.timeline_grid(part, "allocated").loc[memory.BASE_LOADED, "cuda:1"] == 1


def test_timeline_heatmap_has_one_panel_per_strategy_and_marks_stray_cells():
    fig = fm.timeline_heatmap(timeline())
    heatmaps = [t for t in fig.data if t.type == "heatmap"]
    assert [t.name for t in heatmaps] == ["torch_device", "no_torch_device"]
    assert list(heatmaps[0].x) == ["cpu (RSS)", "cuda:0", "cuda:1"]
    assert list(heatmaps[0].y) == [memory.PROCESS_START, memory.BASE_LOADED, memory.CLEANED_UP]
    stray = heatmaps[1].text[2][1]
    assert stray.startswith("✗") and "300.0" in stray
    assert not heatmaps[0].text[2][1].startswith("✗")
    assert "not asked for" in heatmaps[1].hovertext[2][1]
    assert fig.layout.coloraxis.cmax == 400


def test_timeline_heatmap_on_a_cpu_only_run_is_rss():
    table = timeline()
    cpu = table[table["device"] == "cpu"]
    fig = fm.timeline_heatmap(cpu)
    assert list(fig.data[0].x) == ["cpu (RSS)"]
    assert "RSS" in fig.layout.title.text
    assert fm.timeline_heatmap(pd.DataFrame()).layout.annotations[0].text.startswith("no memory")


def placement() -> pd.DataFrame:
    rows = [
        ("m.q.base_layer.weight", "m.layers.0.q", "base", None, "cuda:1", 4096),
        ("m.q.lora_A.a.weight", "m.layers.0.q", "lora_A", "a", "cuda:0", 256),
        ("m.q.lora_B.a.weight", "m.layers.0.q", "lora_B", "a", "cuda:1", 256),
        ("m.v.base_layer.weight", "m.layers.0.v", "base", None, "cuda:1", 4096),
        ("m.k.weight", "m.layers.1.q", "base", None, "cuda:1", 2 * MIB),
    ]
    cols = list(memory.PLACEMENT_COLUMNS)
    table = pd.DataFrame(
        [dict(zip(cols, (n, m, r, a, d, "float32", b), strict=True)) for n, m, r, a, d, b in rows]
    )
    return pd.concat([table.assign(variant="torch_device"), table.assign(variant="no_torch_device")]).assign(
        target="cuda:1/float32"
    )


def test_module_device_heatmap_sums_bytes_per_module_and_device():
    fig = fm.module_device_heatmap(placement())
    assert len(fig.data) == 2
    trace = fig.data[0]
    assert list(trace.y) == ["m.layers.0.q", "m.layers.0.v", "m.layers.1.q"]
    assert list(trace.x) == ["cuda:0", "cuda:1"]
    values = np.asarray(trace.customdata)
    assert values[0].tolist() == [256, 4352] and values[1].tolist() == [0, 4096]
    assert trace.text[0][0] == "256 B" and trace.text[2][1] == "2.0 MiB" and trace.text[1][0] == ""
    assert math.isnan(trace.z[1][0])
    kinds = fm.module_device_heatmap(placement(), by="kind")
    assert list(kinds.data[0].y) == ["q", "v"]
    assert np.asarray(kinds.data[0].customdata)[0].tolist() == [256, 4352 + 2 * MIB]


def test_flags_table_keeps_only_memory_findings():
    metrics = pd.DataFrame(
        [
            {
                "check": "memory",
                "verdict": "broken",
                "rule": "stray device",
                "stage": "s",
                "device": "cuda:0",
            },
            {"check": "memory", "verdict": "identical", "rule": "as asked"},
            {"check": "weights", "verdict": "broken"},
        ]
    )
    flags = fm.flags_table(metrics)
    assert list(flags.columns) == fm.FLAG_COLUMNS
    assert len(flags) == 1 and flags.loc[0, "rule"] == "stray device" and flags.loc[0, "stage"] == "s"
    assert fm.flags_table(pd.DataFrame()).empty


def test_flag_summary_is_one_line_per_strategy_and_rule():
    flags = pd.DataFrame(
        [
            {
                "rule": "stray device",
                "target": "t",
                "variant": "v",
                "stage": "a",
                "device": "cuda:0",
                "module": None,
            },
            {
                "rule": "mixed placement",
                "target": "t",
                "variant": "v",
                "stage": "b",
                "device": "cuda:0, cuda:1",
                "module": "m.q",
            },
            {
                "rule": "mixed placement",
                "target": "t",
                "variant": "v",
                "stage": "b",
                "device": "cuda:0, cuda:1",
                "module": "m.k",
            },
        ]
    )
    assert fm.flag_summary(flags) == [
        "v: stray device on cuda:0, from stage 'a'",
        "v: mixed placement on cuda:0, cuda:1 in 2 layers, from stage 'b'",
    ]
    assert fm.flag_summary(fm.flags_table(pd.DataFrame())) == []


def test_leak_table_per_panel():
    table = timeline()
    # only a base-loaded baseline is not "before the base load": add one
    before = table[table["order"] == 1].assign(order=0, stage=memory.IMPORT_LIBS)
    leaks = fm.leak_table(pd.concat([table[table["order"] != 0], before]))
    assert set(leaks["panel"]) == {"torch_device", "no_torch_device"}
    stray = leaks[(leaks["panel"] == "no_torch_device") & (leaks["device"] == "cuda:0")].iloc[0]
    assert stray["driver_used"] == 300 * MIB and stray["allocated"] == 0


def workspace_timeline(with_column: bool = True) -> pd.DataFrame:
    """A cuda:0 load as the H200 recorded it: DoRA's weight norm, the first matmul, makes cuBLAS's 32 MiB
    workspace; the forward makes it again after the sample released it; cleanup releases it."""
    workspace = 32 * MIB
    stages = [
        (memory.IMPORT_LIBS, 0, 0),
        (memory.BASE_LOADED, 660_992, 0),
        (memory.adapter_stage("dora"), 660_992 + 145_408 + workspace, workspace),
        (memory.FIRST_FORWARD, 660_992 + 145_408 + workspace, workspace),
        (memory.CLEANED_UP, 0, 0),
    ]
    rows = []
    for order, (stage, allocated, held) in enumerate(stages):
        rows.append(memory.timeline_record(stage, order, "cpu", rss=(400 + order) * MIB))
        rows.append(
            memory.timeline_record(
                stage,
                order,
                "cuda:0",
                allocated=allocated,
                reserved=allocated and 36 * MIB,
                driver_used=allocated and 700 * MIB,
                context=order > 0,
                workspace=held if with_column else None,
            )
        )
    table = pd.DataFrame(rows).assign(variant="torch_device", target="cuda:0/float32", requested=True)
    return table if with_column else table.drop(columns="workspace")


def test_timeline_heatmap_draws_library_workspaces_beside_their_device():
    table = workspace_timeline()
    assert fm.workspace_devices(table) == ["cuda:0"]
    fig = fm.timeline_heatmap(table, "allocated")
    (trace,) = fig.data
    assert list(trace.x) == ["cpu (RSS)", "cuda:0", "cuda:0 workspaces"]
    dora = list(trace.y).index(memory.adapter_stage("dora"))
    # the workspace column: 32 MiB at the stages whose matmuls made it, 0 elsewhere, none on the CPU
    assert [row[2] for row in trace.text] == ["0.0", "0.0", "32.0", "32.0", "0.0"]
    assert trace.z[dora][2] == 32 and trace.z[dora][1] == (660_992 + 145_408) / MIB + 32
    assert "library workspaces (cuBLAS, cuBLASLt) 32.00 MiB" in trace.hovertext[dora][2]
    assert "no leak" in trace.hovertext[dora][2]
    assert "allocated 32.77 MiB, of which library workspaces 32.00 MiB" in trace.hovertext[dora][1]
    assert "library workspaces" in fig.layout.title.text
    # after cleanup: nothing held, no tensor left
    (leak,) = fm.leak_table(table)[lambda t: t["device"] == "cuda:0"].to_dict(orient="records")
    assert (leak["allocated"], leak["workspace"], leak["tensors"]) == (0, 0, 0)


def test_timeline_heatmap_of_a_run_without_workspaces_has_no_such_column():
    old = workspace_timeline(with_column=False)  # recorded before workspaces had a column of their own
    assert fm.workspace_devices(old) == []
    assert list(fm.timeline_heatmap(old).data[0].x) == ["cpu (RSS)", "cuda:0"]
    assert "of which" not in fm.timeline_heatmap(old).data[0].hovertext[2][1]
    # a CPU target on a GPU machine: the column is there, every figure 0, nothing to draw
    idle = workspace_timeline().assign(workspace=0)
    assert fm.workspace_devices(idle) == [] and len(fm.timeline_heatmap(idle).data[0].x) == 2
    assert list(fm.leak_table(old).columns) == ["panel", *memory.LEAK_COLUMNS]
    assert list(fm.leak_table(pd.DataFrame()).columns) == ["panel", *memory.LEAK_COLUMNS]
