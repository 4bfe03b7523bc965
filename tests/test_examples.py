"""The snapshots made on a real GPU that ship in examples/: they read, compare on a machine without a
GPU to the numbers the GPU gave, and open from the Runs page."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from core.engine.jobs import Engine
from core.engine.runners import InProcessRunner
from core.engine.snapshot import comparison, read_snapshot
from core.engine.store import Store

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
H200 = EXAMPLES / "h200-generation-parts.wdsnap"


def test_every_example_is_a_valid_snapshot_small_enough_to_ship():
    examples = sorted(EXAMPLES.glob("*.wdsnap"))
    assert H200 in examples
    for path in examples:
        shot = read_snapshot(path)  # sizes, CRCs and content hashes checked
        assert path.stat().st_size < 1 << 20, path
        assert any(t.device.startswith("cuda:") for t in shot.spec.targets), path


def test_the_h200_example_compares_here_to_what_the_gpu_measured(tmp_path):
    spec, install = comparison([read_snapshot(H200)], home=tmp_path)
    engine = Engine(tmp_path, runner=InProcessRunner())
    job = engine.submit(spec, install=install)
    assert job.wait(300)
    assert job.state == "succeeded", job.error
    table = engine.store.open(job.run_id).metrics()
    outputs = table[(table.check == "outputs") & (table.adapter == "lora_tie")].set_index("target")
    # the lora_tie logits against the H200's own cpu/float64 reference (measured there, 2026-11-27)
    assert outputs.loc["h200/cuda:0/float32", "max_abs"] == pytest.approx(9.314458e-06, rel=1e-5)
    assert outputs.loc["h200/cuda:0/float32+tf32", "max_abs"] == pytest.approx(3.652757e-02, rel=1e-5)
    assert outputs.loc["h200/cuda:0/float32", "verdict"] == "within tolerance"
    assert outputs.loc["h200/cuda:0/float32+tf32", "verdict"] == "drift"
    # TF32 is the anomaly: thousands of times its peer's (cpu/float32) error
    assert outputs.loc["h200/cuda:0/float32+tf32", "peer_ratio"] > 1000
    generate = table[(table.check == "generate") & (table.verdict == "drift")]
    assert sorted(generate.target) == ["h200/cpu/bfloat16", "h200/cuda:0/bfloat16"]
    assert set(generate.first_divergence) == {4}  # bfloat16 takes the other token at step 4, on both


def test_the_runs_page_opens_an_example(tmp_path, monkeypatch):
    sys.path.insert(0, str(Path(__file__).parent))
    from apptest import finished, make_app, no_exceptions, texts

    at = make_app(tmp_path / "home", monkeypatch)
    at.switch_page("views/runs.py").run()
    no_exceptions(at)
    assert "h200-generation-parts" in texts(at)
    at.button(key="runs.example.h200-generation-parts").click().run()
    no_exceptions(at)
    run_id = at.query_params["run"]
    record = finished(Store(tmp_path / "home"), run_id)
    assert record.status == "succeeded", record.error
    at.switch_page("views/overview.py").run()
    no_exceptions(at)
    # the Overview leads with the GPU's anomaly
    assert "h200/cuda:0/float32+tf32: outputs 3.83e+03× the error of h200/cpu/float32" in texts(at)
