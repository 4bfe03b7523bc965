"""Compared in the worker, kept as sketches: the same rows as with every tensor kept, bounded captures."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from safetensors import safe_open

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


def _kept_and_streamed(tmp_path_factory, name: str, run, ws) -> tuple:
    """`run(home, ws, keep, monkeypatch)` with tensors kept, then streamed, in one home."""
    mp = pytest.MonkeyPatch()
    try:
        home = tmp_path_factory.mktemp(name)
        return run(home, ws, True, mp), run(home, ws, False, mp)
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_workspace):
    return _kept_and_streamed(tmp_path_factory, "streamed", _run, demo_workspace)


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


def test_a_weight_that_is_the_checkpoint_rounded_keeps_no_map_and_the_drill_down_draws_it(runs):
    """A bfloat16 base weight that is the float32 checkpoint rounded (torch's round to nearest even), bit
    for bit: its worker stores no sketch (a run folder holds no map of plain rounding); the drill-down
    draws it from the checkpoint, the same map the kept run's full difference pools to."""
    (kept_record, _), (record, table) = runs
    capture = Capture.load(record.run_dir / "captures" / "cpu_bfloat16")
    rounded = [k for k, r in capture.results.items() if r.get("rounding")]
    base = table[(table.target == "cpu/bfloat16") & (table.check == "weights") & table.adapter.isna()]
    drifting = base[~base.bitwise_equal]
    assert len(rounded) >= len(drifting) > 0  # every base weight loaded in bfloat16 is the rounding
    with safe_open(str(record.run_dir / "captures" / "cpu_bfloat16" / "sketches.safetensors"), "np") as f:
        stored = {k.split("##")[0] for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    assert not stored & set(rounded)
    assert not any(
        r.get("rounding") for r in Capture.load(record.run_dir / "captures" / "cpu_float32").results.values()
    )
    row = drifting.iloc[0]
    sketched = element_diff(record, "weights", "cpu/bfloat16", None, row.tensor)
    full = element_diff(kept_record, "weights", "cpu/bfloat16", None, row.tensor)
    assert (
        isinstance(sketched, SketchedDiff) and isinstance(full, ElementDiff) and sketched.sketch is not None
    )
    from dashboard.figures.diffs import block_max_pool

    pooled, _, _ = block_max_pool(full.diff)
    np.testing.assert_array_equal(sketched.sketch.pooled, pooled)
    assert int(sketched.sketch.failing.sum()) == full.n_mismatch == row.n_mismatch
    assert sketched.row["max_abs"] == row.max_abs


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


# The merge check's weights (merged, roundtrip, delta, tied, subset) streamed like the weights and deltas:
# a NaN adapter (safe_merge refusal, NaN written into W), a tied embedding, a multiplicative method and two
# LoRAs merged together.
MERGE_ADAPTERS = ("lora", "lora_b", "lora_embed", "lora_nan", "dora")


def _merge_run(home, ws, keep: bool, monkeypatch):
    from core.demo.scenarios import demo_spec

    monkeypatch.setattr("core.spec.KEEP_TENSORS_UP_TO", 1 << 40 if keep else 0)
    spec = demo_spec(ws, MERGE_ADAPTERS, ["cpu/float32", "cpu/bfloat16"], ["merge"])
    job = Engine(home, runner=InProcessRunner()).submit(spec)
    assert job.wait(300) and job.state == "succeeded", job.error
    return Store(home).open(job.run_id)


@pytest.fixture(scope="module")
def merge_runs(tmp_path_factory, demo_workspace):
    return _kept_and_streamed(tmp_path_factory, "streamed-merge", _merge_run, demo_workspace)


def _merge_rows(record) -> pd.DataFrame:
    table = record.metrics()
    table = table[table.check == "merge"]
    return table.sort_values(["target", "adapter", "tensor", "against"]).reset_index(drop=True)


def test_merge_rows_measured_in_the_worker_are_the_compare_tasks_bit_for_bit(merge_runs):
    """Kept tensors go the compare task's way (as before streaming); the streamed run measures its weights
    in the worker: every row, every number, note and finding the same. (Rows come in the capture's order,
    kept tensors first, as in weights and deltas, so the rows are sorted and the columns, named in the order
    rows bring them, aligned.)"""
    kept, streamed = merge_runs
    a, b = _merge_rows(kept), _merge_rows(streamed)
    assert set(a.columns) == set(b.columns)
    b = b[a.columns]
    roles = set(a.role)
    assert {"merged", "roundtrip", "delta", "tied", "output"} <= roles, roles
    assert len(a) > 300 and (a.verdict == "broken").any() and a.scale_ulp.notna().any()
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    for name in ("merge_findings", "merge_save"):
        columns = [c for c in kept.table(name).columns if c != "folder"]  # the run's own folder
        pd.testing.assert_frame_equal(
            kept.table(name)[columns], streamed.table(name)[columns], check_exact=True
        )


def test_streamed_merge_capture_keeps_only_outputs(merge_runs):
    from core.checks.merge import parse_name

    kept, streamed = merge_runs
    for target in ("cpu_float32", "cpu_bfloat16"):
        full = Capture.load(kept.run_dir / "captures" / target)
        light = Capture.load(streamed.run_dir / "captures" / target)

        def roles(tensors):
            return {parse_name(TensorKey.decode(k).name)[0] for k in tensors if k.startswith("merge::")}

        assert roles(full.tensors) >= {"merged", "roundtrip", "delta", "tied", "before", "output"}
        assert roles(light.tensors) == {"output"}
        weights = {
            k for k in full.tensors if k.startswith("merge::") and not roles([k]) & {"output", "before"}
        }
        assert set(light.results) == weights and not full.results
        # what the capture holds of the merge: its outputs alone, a small part of the tensors kept whole
        held = sum(t.nbytes for k, t in light.tensors.items() if k.startswith("merge::"))
        outputs = sum(t.nbytes for k, t in full.tensors.items() if roles([k]) == {"output"})
        everything = sum(t.nbytes for k, t in full.tensors.items() if k.startswith("merge::"))
        assert held == outputs < everything / 5, (held, everything)


def test_merge_drill_down_from_the_sketch(merge_runs):
    kept, streamed = merge_runs
    table = _merge_rows(streamed)
    for role in ("merged", "roundtrip"):
        row = table[(table.role == role) & (table.target == "cpu/bfloat16") & ~table.bitwise_equal].iloc[0]
        sketched = element_diff(streamed, "merge", row.target, row.adapter, row.tensor)
        assert isinstance(sketched, SketchedDiff) and sketched.sketch is not None
        assert sketched.row["max_abs"] == row.max_abs and sketched.row["note"] == row.note
        if role == "merged":  # kept whole, the element-wise map: the same row
            full = element_diff(kept, "merge", row.target, row.adapter, row.tensor)
            assert isinstance(full, ElementDiff) and full.row["max_abs"] == row.max_abs
            assert int(sketched.sketch.failing.sum()) == full.n_mismatch == row.n_mismatch
