"""The drill-down: element-wise differences must agree exactly with the stored metrics rows."""

from __future__ import annotations

import math
import re
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file

from core.capture import BASE, Capture, TensorKey
from core.engine.diffmap import _elementwise, as_2d, element_diff
from core.engine.jobs import Engine
from core.engine.runners import InProcessRunner
from core.engine.store import Store
from core.numerics import metrics
from core.spec import AdapterRef, ModelRef, ProbeSpec, SpecError, Target

TARGETS = ("cpu/float32", "cpu/bfloat16")


@pytest.fixture(scope="module")
def run(tmp_path_factory, demo_workspace):
    """A real run of every check: tiny llama + lora + boft on cpu/float32 and cpu/bfloat16."""
    home = tmp_path_factory.mktemp("diffmap-home")
    adapters = demo_workspace["adapters"]
    spec = ProbeSpec(
        base=ModelRef(path=demo_workspace["models"]["tiny-llama"]),
        adapters=(
            AdapterRef(path=adapters["lora"]["path"], name="lora"),
            AdapterRef(path=adapters["boft"]["path"], name="boft"),
        ),
        targets=tuple(map(Target.parse, TARGETS)),
    )
    job = Engine(home, runner=InProcessRunner()).submit(spec)
    assert job.wait(300)
    assert job.state == "succeeded", job.error
    record = Store(home).open(job.run_id)
    return record, record.metrics()


def _adapter(row) -> str | None:
    return row["adapter"] if isinstance(row["adapter"], str) else None


def _missing(value) -> bool:
    return value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value))


def _pick(table: pd.DataFrame, **where) -> pd.Series:
    sel = table
    for col, value in where.items():
        sel = sel[sel[col].isna()] if value is None else sel[sel[col] == value]
    assert len(sel), f"no row with {where}"
    return sel.iloc[0]


def _assert_agrees(record, row) -> None:
    d = element_diff(record, row["check"], row["target"], _adapter(row), row["tensor"])
    assert (d.check, d.target, d.adapter, d.tensor) == (
        row["check"],
        row["target"],
        _adapter(row),
        row["tensor"],
    )
    assert d.reference == row["reference"]
    assert "x".join(map(str, d.shape)) == row["shape"] and d.dtype == row["dtype"]
    assert d.diff.dtype == np.float64 and d.allowed.dtype == np.float64
    assert d.diff.shape == d.allowed.shape == d.mismatch.shape == as_2d(d.shape)
    assert d.diff.size == row["numel"]
    # Exact (float) equality: the drill-down shows the very numbers the table holds.
    assert float(np.abs(d.diff).max()) == row["max_abs"]
    assert d.n_mismatch == row["n_mismatch"]
    # Within the bound means passing (beyond it may still pass: the rule rounds |diff| first).
    assert not (d.mismatch & (np.abs(d.diff) <= d.allowed)).any()
    assert (d.rtol, d.atol) == (row["rtol"], row["atol"])
    assert d.explanation == row["explanation"] == d.row["explanation"]
    if not _missing(row["worst_index"]):  # the worst element sits where the row says
        flat = int(np.abs(d.diff).argmax())
        assert metrics._fmt_tuple(np.unravel_index(flat, d.shape)) == row["worst_index"]
    for col, value in row.items():  # the recomputed row is the stored row, column by column
        if col in ("peer", "peer_ratio"):  # a judgement across targets (core.judgement), not the row's own
            continue
        got = d.row.get(col)
        if _missing(value):  # Parquet reads None back as NaN / NA
            assert _missing(got), (col, got)
        else:
            assert got == value, (col, got, value)


def test_named_rows_agree(run):
    record, table = run
    cases = [
        # a bf16 base weight rounded on load: within tolerance, not identical
        dict(check="weights", target="cpu/bfloat16", adapter=None, verdict="within tolerance"),
        dict(check="weights", target="cpu/float32", adapter=None, role="base"),
        # adapter tensors kept bit for bit (identical: diff is all zero)
        dict(check="weights", target="cpu/bfloat16", adapter="lora", role="lora_B"),
        dict(check="weights", target="cpu/float32", adapter="boft", role="boft_R"),
        # ΔW: within tolerance on float32, drift for boft on bf16
        dict(check="deltas", target="cpu/float32", adapter="lora"),
        dict(check="deltas", target="cpu/bfloat16", adapter="boft", verdict="drift"),
        # logits: against cpu/float64
        dict(check="outputs", target="cpu/float32", adapter=None),
        dict(check="outputs", target="cpu/bfloat16", adapter="boft", verdict="drift"),
    ]
    for case in cases:
        _assert_agrees(record, _pick(table, **case))


def test_every_row_agrees(run):
    # The whole table is a few hundred small tensors: cheap enough to check every row.
    record, table = run
    assert set(table.check) == {"weights", "deltas", "outputs"} and set(table.target) == set(TARGETS)
    assert (table.verdict != "broken").all()
    for _, row in table.iterrows():
        _assert_agrees(record, row)


def test_identical_tensor_has_zero_diff(run):
    record, table = run
    row = _pick(table, check="weights", target="cpu/bfloat16", adapter="lora", verdict="identical")
    d = element_diff(record, "weights", "cpu/bfloat16", "lora", row["tensor"])
    assert not d.diff.any() and not d.mismatch.any()
    assert d.explanation == "bitwise identical" and d.dtype == "float32"  # PEFT keeps lora in float32
    assert (d.rtol, d.atol) == (1.6e-2, 1e-5)  # but judged by the target's dtype, bfloat16


def test_bf16_base_weight_and_drifting_logits(run):
    record, table = run
    row = _pick(table, check="weights", target="cpu/bfloat16", adapter=None, verdict="within tolerance")
    d = element_diff(record, "weights", "cpu/bfloat16", None, row["tensor"])
    assert d.dtype == "bfloat16" and d.reference == "checkpoint" and d.diff.any()
    assert (np.abs(d.diff) <= d.allowed).all()

    logits = element_diff(record, "outputs", "cpu/bfloat16", "boft", "logits")
    assert logits.shape == (2, 16, 256) and logits.diff.shape == (32, 256)
    assert logits.reference == "cpu/float64" and logits.dtype == "bfloat16"
    assert logits.row["verdict"] == "drift" and logits.explanation.startswith("Mismatched elements")
    assert logits.n_mismatch > 0
    # Row-major reshape: element (b, s, v) is at (b * 16 + s, v).
    capture = Capture.load(record.run_dir / "captures" / "cpu_bfloat16")
    ref = Capture.load(record.run_dir / "captures" / "cpu_float64")
    key = TensorKey("outputs", "boft", "logits")
    expect = capture.get(key).double()[1, 3, 7] - ref.get(key).double()[1, 3, 7]
    assert logits.diff[1 * 16 + 3, 7] == float(expect)


def test_reads_one_tensor_not_the_capture(run, monkeypatch):
    record, _ = run

    def refuse(folder):
        raise AssertionError("Capture.load reads the whole capture")

    monkeypatch.setattr(Capture, "load", staticmethod(refuse))
    d = element_diff(record, "outputs", "cpu/float32", "lora", "logits")
    assert d.row["verdict"] == "within tolerance"


def test_errors_are_clear(run):
    record, _ = run
    rid = record.run_id
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(
        KeyError, match=f"run {rid} has no capture for target cpu/float16 \\(targets: cpu/float32"
    ):
        element_diff(record, "weights", "cpu/float16", None, q_proj)
    with pytest.raises(SpecError):  # a ValueError naming the accepted forms
        element_diff(record, "weights", "cpu", None, q_proj)
    with pytest.raises(
        KeyError, match="no tensor 'foo' for adapter lora in check weights on cpu/float32; it has"
    ):
        element_diff(record, "weights", "cpu/float32", "lora", "foo")
    with pytest.raises(KeyError, match="no tensor 'foo' of the base model in check outputs on cpu/bfloat16"):
        element_diff(record, "outputs", "cpu/bfloat16", None, "foo")
    with pytest.raises(KeyError, match=f"run {rid} has no adapter 'dora' \\(adapters: lora, boft\\)"):
        element_diff(record, "weights", "cpu/float32", "dora", q_proj)
    with pytest.raises(KeyError, match=f"run {rid} did not run check merge"):
        element_diff(record, "merge", "cpu/float32", None, q_proj)
    # the base model has no ΔW: the key exists nowhere
    with pytest.raises(KeyError, match="no tensor 'model.layers.0.self_attn.q_proj' of the base model"):
        element_diff(record, "deltas", "cpu/float32", None, "model.layers.0.self_attn.q_proj")


def test_shape_mismatch_and_missing_reference(run, tmp_path):
    record, _ = run
    # A copy of the run with a tampered capture: one weight reshaped, one tensor the checkpoint lacks.
    home = tmp_path / "home"
    shutil.copytree(record.run_dir, home / "runs" / record.run_id)
    copy = Store(home).open(record.run_id)
    path = copy.run_dir / "captures" / "cpu_float32" / "tensors.safetensors"
    tensors = load_file(str(path))
    q_proj = TensorKey("weights", BASE, "model.layers.0.self_attn.q_proj.weight")
    original = tuple(tensors[q_proj.encode()].shape)
    tensors[q_proj.encode()] = tensors[q_proj.encode()].reshape(-1).clone()
    tensors[TensorKey("weights", BASE, "extra.weight").encode()] = torch.ones(3)
    save_file(tensors, str(path))

    flat = re.escape(f"({math.prod(original)})")
    with pytest.raises(
        ValueError, match=rf"shape mismatch .* target {flat} vs reference \(checkpoint\) \(64, 64\)"
    ):
        element_diff(copy, "weights", "cpu/float32", None, q_proj.name)
    with pytest.raises(
        KeyError, match="no reference \\(checkpoint\\) for tensor 'extra.weight' of the base model"
    ):
        element_diff(copy, "weights", "cpu/float32", None, "extra.weight")


def test_nonfinite_elements_fail_like_the_metrics():
    # NaN/Inf are counted exactly as metrics.compare counts them; both-NaN and equal Inf are equal.
    nan, inf = math.nan, math.inf
    target = torch.tensor([[1.0, nan, nan, inf, inf, 2.0], [-inf, 0.0, 1.0001, 5.0, 1e-6, -0.0]])
    reference = torch.tensor(
        [[1.0, nan, 1.0, inf, 3.0, nan], [inf, 0.0, 1.0, 5.0, 0.0, 0.0]], dtype=torch.float64
    )
    tol = metrics.Tolerance(rtol=1e-5, atol=1e-8)
    stats = metrics.compare(target, reference, tol)
    diff, allowed, mismatch = _elementwise(target, reference, tol.rtol, tol.atol)
    assert int(mismatch.sum()) == stats.n_mismatch == 6
    assert diff[0, 1] == 0 and diff[0, 3] == 0 and diff[1, 5] == 0  # NaN == NaN, inf == inf, -0 == 0
    assert np.isnan(diff[0, 2]) and np.isinf(diff[1, 0])
    finite = np.isfinite(diff)
    assert float(np.abs(diff[finite]).max()) == stats.max_abs


def test_mismatch_follows_the_promoted_rule():
    # Two bfloat16 tensors are judged in bfloat16, as assert_close and metrics.compare judge them.
    bf16 = torch.bfloat16
    target = torch.tensor([[-0.2392578125, 1.0], [2.0, 3.0]], dtype=bf16)
    reference = torch.tensor([[-0.2431640625, 1.0], [2.0, 3.5]], dtype=bf16)
    tol = metrics.default_tolerance(bf16)
    diff, allowed, mismatch = _elementwise(target, reference, tol.rtol, tol.atol)
    assert diff[0, 0] == 2.0**-8 == allowed[0, 0]  # atol + rtol·|r| rounded as bfloat16 rounds it
    assert diff[0, 0] > tol.atol + tol.rtol * 0.2431640625  # the float64 bound it would fail
    assert mismatch.tolist() == [[False, False], [False, True]]
    assert int(mismatch.sum()) == metrics.compare(target, reference).n_mismatch == 1


def test_as_2d():
    assert as_2d(()) == (1, 1)
    assert as_2d((7,)) == (1, 7)
    assert as_2d((4, 5)) == (4, 5)
    assert as_2d((2, 16, 256)) == (32, 256)
    assert as_2d((0,)) == (1, 0)


def test_weights_drilldown_reads_only_the_one_tensor_from_the_checkpoint(run, monkeypatch):
    """A drill-down must not load the whole checkpoint (GBs for a real base)."""
    from core.models.checkpoint import Checkpoint

    record, table = run
    row = table[(table["check"] == "weights") & table["adapter"].isna()].iloc[0]
    calls = []
    real = Checkpoint.read

    def spy(checkpoint, name, scratch=False):
        calls.append(name)
        assert not scratch  # the drill-down keeps its reference: never in a buffer the next read reuses
        return real(checkpoint, name, scratch)

    monkeypatch.setattr(Checkpoint, "read", spy)
    d = element_diff(record, "weights", row["target"], None, row["tensor"])
    assert calls == [row["tensor"]]
    assert float(np.abs(d.diff).max()) == row["max_abs"]


def test_deltas_drilldown_reads_one_base_weight_only(run, monkeypatch):
    """The ΔW reference of one module needs that module's base weight, not the whole base."""
    import core.models.checkpoint

    record, table = run
    row = table[(table["check"] == "deltas") & (table["target"] == "cpu/bfloat16")].iloc[0]
    calls = []
    real = core.models.checkpoint.read_checkpoint

    def spy(folder, prefix="", names=None):
        calls.append((prefix, names))
        return real(folder, prefix=prefix, names=names)

    import core.models.conversion

    real_loaded = core.models.conversion.read_loaded

    def spy_loaded(folder, names):
        calls.append(("", set(names)))
        return real_loaded(folder, names)

    monkeypatch.setattr("core.checks.deltas.read_checkpoint", spy)
    # the base is read by the loaded model's names (transformers may rename keys on load)
    monkeypatch.setattr("core.checks.deltas.read_loaded", spy_loaded)
    monkeypatch.setattr("core.models.conversion.read_loaded", spy_loaded)  # merging.reference_base's
    d = element_diff(record, "deltas", row["target"], row["adapter"], row["tensor"])
    # the base: that module's tensors alone, read lazily (its weight; its bias and a parameter by its
    # own path, which adapters that train biases or target parameters need, where the file has them)
    module = row["tensor"]
    base_reads = [names for prefix, names in calls if prefix == "" and f"{module}.weight" in names]
    assert len(base_reads) == 1 and base_reads[0] <= {f"{module}.weight", f"{module}.bias", module}, calls
    assert float(np.abs(d.diff).max()) == row["max_abs"]
    assert d.explanation == row["explanation"]
