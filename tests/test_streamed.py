"""Compared in the worker, kept as sketches: the same rows as with every tensor kept, bounded captures."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from core.capture import Capture, TensorKey
from core.engine.diffmap import ElementDiff, SketchedDiff, element_diff
from core.engine.jobs import Engine
from core.engine.runners import InProcessRunner
from core.engine.store import Store
from core.spec import AdapterRef, ModelRef, ProbeSpec, Target

CHECKS = ("weights", "deltas", "outputs")
# what two runs of the same spec may differ in: where their folders are, not what they measured
METRIC_COLUMNS = [
    "check",
    "target",
    "adapter",
    "tensor",
    "role",
    "verdict",
    "explanation",
    "note",
    "n_mismatch",
]
NUMBERS = ["max_abs", "mean_abs", "rmse", "rel_l2", "cos_sim", "max_ulp", "min_atol"]


def _run(home, ws, keep: bool, monkeypatch) -> tuple:
    # Below the threshold every model keeps its tensors; 0 makes the demo behave like a large model.
    monkeypatch.setattr("core.spec.KEEP_TENSORS_UP_TO", 1 << 40 if keep else 0)
    spec = ProbeSpec(
        base=ModelRef(ws["models"]["tiny-llama"]),
        adapters=tuple(AdapterRef(ws["adapters"][n]["path"], n) for n in ("lora", "dora", "boft")),
        targets=(Target.parse("cpu/float32"), Target.parse("cpu/bfloat16")),
        checks=CHECKS,
    )
    engine = Engine(home, runner=InProcessRunner())
    job = engine.submit(spec)
    assert job.wait(300) and job.state == "succeeded", job.error
    record = engine.store.open(job.run_id)
    return record, record.metrics()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_workspace):
    mp = pytest.MonkeyPatch()
    try:
        home = tmp_path_factory.mktemp("streamed")
        kept = _run(home, demo_workspace, True, mp)
        sketched = _run(home, demo_workspace, False, mp)
    finally:
        mp.undo()
    return kept, sketched


def _sorted(table: pd.DataFrame) -> pd.DataFrame:
    return table.sort_values(["check", "target", "adapter", "tensor"], na_position="first").reset_index(
        drop=True
    )


def test_rows_do_not_depend_on_keeping_tensors(runs):
    (_, kept), (_, sketched) = runs
    a, b = _sorted(kept), _sorted(sketched)
    assert len(a) == len(b) > 100
    pd.testing.assert_frame_equal(a[METRIC_COLUMNS], b[METRIC_COLUMNS])
    # bit for bit: the same kernel on the same tensors, in the worker or later
    np.testing.assert_array_equal(a[NUMBERS].to_numpy(float), b[NUMBERS].to_numpy(float))


def test_sketched_capture_holds_no_weight(runs):
    (kept_record, _), (record, table) = runs
    for target in ("cpu_float32", "cpu_bfloat16"):
        sketched = Capture.load(record.run_dir / "captures" / target)
        kept = Capture.load(kept_record.run_dir / "captures" / target)
        assert sketched.keys("weights") and sketched.keys("deltas")
        assert {TensorKey.decode(k).check for k in sketched.tensors} == {"outputs"}
        assert len(sketched.results) == len(kept.results) > 0
        doc = json.loads((record.run_dir / "captures" / target / "capture.json").read_text())
        assert doc["format"] == "weightdrift-capture/2"
    drifting = table[(table.target == "cpu/bfloat16") & (table.check == "weights") & ~table.bitwise_equal]
    assert len(drifting) > 0


def test_drill_down_from_the_sketch(runs):
    (kept_record, kept_table), (record, table) = runs
    row = table[(table.target == "cpu/bfloat16") & (table.check == "deltas")].iloc[0]
    args = ("deltas", "cpu/bfloat16", row.adapter, row.tensor)
    full = element_diff(kept_record, *args)
    sketched = element_diff(record, *args)
    assert isinstance(full, ElementDiff) and isinstance(sketched, SketchedDiff)
    assert sketched.row["max_abs"] == full.row["max_abs"] == row.max_abs
    assert sketched.explanation == full.explanation
    s = sketched.sketch
    assert s is not None and s.shape == full.shape
    # the sketch's map is the full map, pooled; its failing blocks add up to the row's count
    from dashboard.figures.diffs import block_max_pool

    pooled, _, _ = block_max_pool(full.diff)
    np.testing.assert_array_equal(s.pooled, pooled.astype(np.float32))  # stored at float32
    assert int(s.failing.sum()) == full.n_mismatch == row.n_mismatch
    assert int(s.hist_counts.sum()) + s.n_zero + s.n_nonfinite == int(np.prod(full.shape))
    # an identical tensor has nothing to draw
    same = table[(table.check == "weights") & table.bitwise_equal].iloc[0]
    adapter = None if pd.isna(same.adapter) else same.adapter
    assert element_diff(record, "weights", same.target, adapter, same.tensor).sketch is None


def test_another_reference_is_named_on_every_row(tmp_path, demo_workspace, capsys):
    from core import cli

    lora = demo_workspace["adapters"]["lora"]["path"]
    args = ["run", "--base", demo_workspace["models"]["tiny-llama"], "--adapter", f"{lora}=lora"]
    args += ["--target", "cpu/bfloat16", "--check", "outputs", "--reference", "cpu/float32"]
    code = cli.main([*args, "--in-process", "--json", "--home", str(tmp_path)])
    out = json.loads(capsys.readouterr().out)
    assert code in (0, 1)
    record = Store(tmp_path).open(out["run_id"])
    table = record.metrics()
    assert set(table.reference) == {"cpu/float32"} and len(table) == 2
    assert (record.run_dir / "captures" / "cpu_float32").is_dir()
    assert not (record.run_dir / "captures" / "cpu_float64").exists()
    assert record.spec.reference == Target.parse("cpu/float32")
