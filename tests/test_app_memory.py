"""The Memory placement page under AppTest: a real CPU run (RSS timeline, all on cpu), the same run
with GPU-like tables showing a stray device and a mixed layer, a run without the check, and the
demo scenario button."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from apptest import finished, make_app, shown, texts

from core.demo.build import build_demo
from core.demo.scenarios import demo_spec
from core.engine.jobs import Engine
from core.engine.runners import InProcessRunner
from core.engine.store import Store
from core.models import memory


@pytest.fixture(scope="module")
def memory_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("memory-app")
    manifest = build_demo(home)
    job = Engine(home, runner=InProcessRunner()).submit(
        demo_spec(manifest, ["lora", "dora"], ["cpu/float32"], ["memory"])
    )
    assert job.wait(300) and job.state == "succeeded", job.error
    return home, job.run_id


def test_memory_page_renders_a_cpu_run(memory_home, monkeypatch):
    home, run_id = memory_home
    at = make_app(home, monkeypatch, run=run_id)
    at.switch_page("views/memory.py").run()
    assert not at.exception, [e.value for e in at.exception]
    text = texts(at)
    assert "Memory placement" in text
    assert "resident memory (RSS)" in text  # honest about a CPU-only timeline
    assert "Every tensor and every byte on the device asked for" in text
    assert "torch_device" in text and "not a fresh worker process" in text
    charts = at.get("plotly_chart")
    assert len(charts) == 2  # timeline heatmap, module × device heatmap
    assert any(b.label == "Memory per device and load stage" for b in at.button)
    assert len(at.dataframe) >= 1  # the get_layer_status() summary


def test_memory_page_shows_flags_of_a_gpu_run(memory_home, monkeypatch, tmp_path):
    home, run_id = memory_home
    # A copy of the run whose tables read as on a two-GPU machine, target cuda:1, with a stray cuda:0.
    store = Store(home)
    record = store.open(run_id)
    timeline = record.table("memory_timeline")
    gpu = []
    for (variant, order, stage), _ in timeline.groupby(["variant", "order", "stage"], sort=False):
        # cuBLAS's workspace on the target from the first forward to the merge (cleanup released it)
        workspace = 32 * 2**20 if stage in (memory.FIRST_FORWARD, memory.MERGED) else 0
        for device, used in (
            ("cuda:0", 300 * 2**20 if variant == "no_torch_device" and order >= 3 else 0),
            ("cuda:1", 500 * 2**20),
        ):
            held = workspace if device == "cuda:1" else 0
            gpu.append(
                {
                    **memory.timeline_record(
                        stage,
                        order,
                        device,
                        allocated=held,
                        reserved=held,
                        driver_used=used,
                        context=used > 0,
                        workspace=held,
                    ),
                    "variant": variant,
                    "target": "cuda:1/float32",
                    "requested": device == "cuda:1",
                }
            )
    gpu_table = pd.concat([timeline.assign(target="cuda:1/float32"), pd.DataFrame(gpu)], ignore_index=True)
    store.write_table(run_id, "memory_timeline", gpu_table)
    metrics = record.metrics()
    flag = {
        **metrics.iloc[0].to_dict(),
        "target": "cuda:1/float32",
        "variant": "no_torch_device",
        "verdict": "broken",
        "rule": "stray device",
        "stage": "adapter lora loaded",
        "device": "cuda:0",
        "module": None,
        "explanation": "cuda:0 holds driver_used 300.0 MiB, a CUDA context",
    }
    store.write_metrics(run_id, pd.concat([metrics, pd.DataFrame([flag])], ignore_index=True))
    try:
        at = make_app(home, monkeypatch, run=run_id)
        at.switch_page("views/memory.py").run()
        assert not at.exception, [e.value for e in at.exception]
        text = texts(at)
        assert "1 finding(s):" in text
        assert "no_torch_device: stray device on cuda:0, from stage 'adapter lora loaded'" in text
        assert at.segmented_control(key="widget.metric").value == "driver_used"
        flags = next(d.value for d in at.dataframe if "rule" in d.value.columns)
        assert list(flags["stage"]) == ["adapter lora loaded"]
        fig = json.loads(at.get("plotly_chart")[0].proto.spec)
        assert any(cell.startswith("✗") for trace in fig["data"] for row in trace["text"] for cell in row)
        assert fig["data"][0]["x"][-1] == "cuda:1 workspaces"
        assert "**workspaces** columns: what cuBLAS" in text
    finally:
        store.write_table(run_id, "memory_timeline", timeline)
        store.write_metrics(run_id, metrics)


def test_memory_page_without_the_check(tmp_path, monkeypatch):
    at = make_app(tmp_path, monkeypatch)
    at.switch_page("views/memory.py").run()
    assert not at.exception, [e.value for e in at.exception]


def test_scenario_button_runs_the_memory_scenario(memory_home, monkeypatch):
    home, _ = memory_home
    store = Store(home)
    before = {r.run_id for r in store.list_runs()}
    at = make_app(home, monkeypatch)
    at.switch_page("views/memory.py").run()
    at.button(key="scenario.memory-placement").click().run()
    assert not at.exception, [e.value for e in at.exception]
    new = [r for r in store.list_runs() if r.run_id not in before]
    assert len(new) == 1 and new[0].spec.checks == ("memory",)
    assert finished(store, new[0].run_id, 120).status == "succeeded"


def _in_order(node):
    yield node
    for child in getattr(node, "children", {}).values():
        yield from _in_order(child)


def test_library_warnings_fold_into_one_expander_after_the_finding(memory_home, monkeypatch):
    home, run_id = memory_home
    store = Store(home)
    metrics = store.open(run_id).metrics()
    warning = (
        "lora: PEFT warned: Failed to load the CUDA extension: CUDA_HOME environment variable is not set"
    )
    noted = metrics.assign(note=metrics["note"].fillna("").map(lambda n: f"{n}; {warning}" if n else warning))
    store.write_metrics(run_id, noted)
    try:
        at = make_app(home, monkeypatch, run=run_id)
        at.switch_page("views/memory.py").run()
        assert not at.exception, [e.value for e in at.exception]
        assert [e.label for e in at.expander if e.label.startswith("warnings")] == [
            "warnings while loading (1)"
        ]
        folded = next(e for e in at.expander if e.label.startswith("warnings"))
        assert [shown(c) for c in folded.caption] == [warning]
        assert "CUDA_HOME" not in "\n".join(shown(c) for c in at.caption if c not in folded.caption)
        # the page's elements in order: the finding comes before the folded warnings
        order = [(getattr(n, "type", ""), getattr(n, "label", "")) for n in _in_order(at.main)]
        finding = next(i for i, (kind, _) in enumerate(order) if kind == "success")
        assert order.index(("expander", "warnings while loading (1)")) > finding
    finally:
        store.write_metrics(run_id, metrics)
