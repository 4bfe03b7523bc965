"""Checks that run in their own worker per target and variant, the check tables, scenarios, and
specs stored before `strategies` became a list."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from core import checks as checks_module
from core.capture import Capture, TensorKey, capture_folder_name
from core.checks.base import OWN_WORKER, Check, Reference
from core.demo.scenarios import SCENARIOS, scenario_spec
from core.engine.jobs import Engine
from core.engine.runners import InProcessRunner
from core.models.targets import Device
from core.spec import ModelRef, ProbeSpec, SpecError, Target


class VariantCheck(Check):
    """Records which variant ran and how many stages it reported; one row per capture."""

    name = "variant_probe"
    description = "test double"
    loads = OWN_WORKER

    def variants(self, spec, target):
        return ("a", "b") if target.dtype == "float32" else ("a",)

    def run_stages(self, spec, target, variant):
        return 2

    def run(self, ctx, variant, stage, out):
        stage("first")
        stage("second")
        out.add(TensorKey(self.name, "-", "ids"), ctx.probe["input_ids"].to(torch.float32))
        out.meta[self.name] = {"variant": variant, "run_dir": str(ctx.run_dir)}

    def capture(self, ctx, loaded, out):
        raise AssertionError("an own-worker check never runs in the shared loop")

    def reference(self, spec, keys, reference_capture):
        return Reference(label="none", tensors={}, notes={})

    def tables(self, spec, captures, reference_capture=None):
        return {"variant_probe": pd.DataFrame({"label": [c.label for c in captures]})}


@pytest.fixture
def variant_check(monkeypatch):
    check = VariantCheck()
    monkeypatch.setitem(checks_module.CHECKS, check.name, check)
    return check


def test_own_worker_check_runs_once_per_target_and_variant(tmp_path, demo_workspace, variant_check):
    spec = ProbeSpec(
        base=ModelRef(demo_workspace["models"]["tiny-llama"]),
        adapters=(),
        targets=(Target.parse("cpu/float32"), Target.parse("cpu/bfloat16")),
        checks=("outputs", "variant_probe"),
    )
    job = Engine(tmp_path, runner=InProcessRunner()).submit(spec)
    assert job.wait(120)
    snap = job.snapshot()
    assert snap["state"] == "succeeded", snap["error"]
    labels = set(snap["tasks"])
    assert {
        "cpu/float32 · variant_probe:a",
        "cpu/float32 · variant_probe:b",
        "cpu/bfloat16 · variant_probe:a",
    } <= labels
    # the shared loop ran the other check (plus its cpu/float64 reference) and not this one
    assert {"cpu/float32", "cpu/bfloat16", "cpu/float64"} <= labels
    own = snap["tasks"]["cpu/float32 · variant_probe:b"]
    assert (own["step"], own["of"]) == (4, 4)  # apply flags, 2 own stages, write capture
    captures = job.run_dir / "captures"
    folder = captures / capture_folder_name(Target.parse("cpu/float32").slug, "variant_probe", "b")
    assert folder.name == "cpu_float32@variant_probe-b"
    capture = Capture.load(folder)
    assert (capture.check, capture.variant, capture.target) == ("variant_probe", "b", "cpu/float32")
    assert capture.meta["variant_probe"] == {"variant": "b", "run_dir": str(job.run_dir)}
    assert not Capture.load(captures / "cpu_float32").keys("variant_probe")
    record = Engine(tmp_path, runner=InProcessRunner()).store.open(job.run_id)
    assert sorted(record.table("variant_probe")["label"]) == [
        "cpu/bfloat16 · variant_probe:a",
        "cpu/float32 · variant_probe:a",
        "cpu/float32 · variant_probe:b",
    ]
    assert record.table("no_such_table").empty
    table = record.metrics()
    assert len(table[table["check"] == "variant_probe"]) == 3


def test_a_run_of_own_worker_checks_only_has_no_shared_task(tmp_path, demo_workspace, variant_check):
    spec = ProbeSpec(
        base=ModelRef(demo_workspace["models"]["tiny-llama"]),
        adapters=(),
        targets=(Target.parse("cpu/bfloat16"),),
        checks=("variant_probe",),
    )
    job = Engine(tmp_path, runner=InProcessRunner()).submit(spec)
    assert job.wait(60)
    assert set(job.snapshot()["tasks"]) == {"cpu/bfloat16 · variant_probe:a", "compare"}
    assert job.snapshot()["state"] == "succeeded", job.snapshot()["error"]


def test_spec_with_a_single_strategy_still_reads():
    spec = ProbeSpec(base=ModelRef("/m"), adapters=(), targets=(Target.parse("cpu/float32"),))
    old = spec.to_dict()
    del old["strategies"], old["merge_subset"]
    old["strategy"] = "isolated"
    again = ProbeSpec.from_dict(json.loads(json.dumps(old)))
    assert again.strategies == ("isolated",) and again == spec


def test_unknown_strategy_is_refused(tmp_path, demo_workspace):
    spec = ProbeSpec(
        base=ModelRef(demo_workspace["models"]["tiny-llama"]),
        adapters=(),
        targets=(Target.parse("cpu/float32"),),
        strategies=("isolated", "teleport"),
    )
    with pytest.raises(SpecError, match="unknown load strategy 'teleport'"):
        Engine(tmp_path, runner=InProcessRunner()).validate(spec)


def test_unknown_scenario_lists_the_known_ones(demo_workspace):
    with pytest.raises(SpecError, match="unknown scenario 'nope'"):
        scenario_spec("nope", demo_workspace, [Device("cpu", "cpu", "cpu")])


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_scenario_builds_a_valid_spec_on_a_cpu_machine(name, tmp_path, demo_workspace):
    devices = [Device("cpu", "cpu", "cpu")]
    spec = scenario_spec(name, demo_workspace, devices)
    Engine(tmp_path, runner=InProcessRunner(), devices=devices).validate(spec)
    assert SCENARIOS[name].page in ("merge", "memory", "adapters", "drift", "activations", "outputs")
