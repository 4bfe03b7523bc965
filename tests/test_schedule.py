"""The schedule of a run (`core.engine.schedule`): lanes, niceness, which task waits for which and the
partial compares, from a spec alone (no process, no model file: the base's size is given)."""

from __future__ import annotations

import pytest

import core.engine.schedule as schedule
from core.engine.schedule import DEVICE_LANES, SMALL_MODEL_LANES, plan
from core.spec import ModelRef, ProbeSpec, Target

CHECKS = ("weights", "outputs", "activations", "memory", "adapters")
FIRST = ["cpu/float32 · weights", "cpu/bfloat16 · weights"]  # the first pass: the first page's rows
LATER = ["cpu/float32 · outputs, activations", "cpu/bfloat16 · outputs, activations"]
MEMORY = ["cpu/float32 · memory", "cpu/bfloat16 · memory"]
ADAPTERS = ["cpu/float32 · adapters:isolated", "cpu/bfloat16 · adapters:isolated"]


def _spec(targets=("cpu/float32", "cpu/bfloat16"), checks=CHECKS) -> ProbeSpec:
    base = ModelRef("/no/such/base")  # never read: `small_base` is set by each test
    return ProbeSpec(base=base, adapters=(), targets=tuple(map(Target.parse, targets)), checks=checks)


def _small(monkeypatch, small: bool) -> None:
    monkeypatch.setattr(schedule, "small_base", lambda spec: small)


def _lanes(s) -> dict[str, list[tuple[str, int]]]:
    return {lane: [(t.label, t.niceness) for t in tasks] for lane, tasks in s.lanes.items()}


def _groups(s) -> list[tuple[list[str], str, int]]:
    return [(sorted(g.needs), g.task.label, g.task.niceness) for g in s.groups]


def test_a_small_models_cpu_tasks(monkeypatch):
    """A lane per target (its first pass, its own-worker tasks, its later pass), the reference's after the
    first pass, memory timelines in lanes of their own; all but the first page's work at nice 5."""
    _small(monkeypatch, True)
    s = plan(_spec(), "run", concurrent=True, cpus=2)
    assert s.policy == SMALL_MODEL_LANES and s.first_compare == "compare · weights"
    assert _lanes(s) == {
        "cpu · cpu/float32": [(FIRST[0], 0), (ADAPTERS[0], 5), (LATER[0], 5)],
        "cpu · cpu/bfloat16": [(FIRST[1], 0), (ADAPTERS[1], 5), (LATER[1], 5)],
        "cpu · cpu/float64": [("cpu/float64", 5)],
        "cpu · fresh 0": [(MEMORY[0], 0)],  # a memory timeline's niceness is its runner's
        "cpu · fresh 1": [(MEMORY[1], 0)],
    }
    assert s.after == {
        "cpu/float64": FIRST,
        **{label: [*FIRST, "compare · weights"] for label in MEMORY},
        **{label: ["compare · weights"] for label in ADAPTERS},
        # activations: a target reads the reference's capture while it captures
        **{label: ["cpu/float64"] for label in LATER},
    }
    assert s.waits_for(FIRST[0]) == [] and s.waits_for("cpu/float64") == FIRST
    assert _groups(s) == [
        (sorted(FIRST), "compare · weights", 0),
        (sorted([*LATER, "cpu/float64"]), "compare · outputs, activations", 5),
        (sorted(MEMORY), "compare · memory", 5),
        (sorted(ADAPTERS), "compare · adapters", 5),
    ]
    # one CPU: one lane of timelines, its first after the first page and the others after it
    s = plan(_spec(), "run", concurrent=True, cpus=1)
    assert _lanes(s)["cpu · fresh 0"] == [(MEMORY[0], 0), (MEMORY[1], 0)]
    assert s.waits_for(MEMORY[0]) == [*FIRST, "compare · weights"] and s.waits_for(MEMORY[1]) == []


@pytest.mark.parametrize("small, concurrent", [(False, True), (True, False)])
def test_a_large_model_or_one_task_at_a_time(monkeypatch, small, concurrent):
    """One lane per device, in the order the tasks are listed, all at nice 0; only the reference-first
    waits (activations); no first compare."""
    _small(monkeypatch, small)
    s = plan(_spec(), "run", concurrent=concurrent, cpus=2)
    assert s.policy == DEVICE_LANES and s.first_compare is None
    # the in-process runner: a small base is still captured in passes, in one lane; a large one in one
    # pass, a task per target labelled by the target alone
    one_pass = [*FIRST, "cpu/float64", *LATER] if small else ["cpu/float64", "cpu/float32", "cpu/bfloat16"]
    assert s.lanes == {"cpu": s.tasks}
    assert _lanes(s) == {"cpu": [(label, 0) for label in [*one_pass, *MEMORY, *ADAPTERS]]}
    readers = LATER if small else one_pass[1:]
    assert s.after == {label: ["cpu/float64"] for label in readers}
    assert all(g.task.niceness == 0 for g in s.groups)


def test_devices_and_nodes_are_lanes_of_their_own(monkeypatch):
    """A GPU's tasks in one lane whatever the model's size; a Ray node's device is a device of its own."""
    _small(monkeypatch, True)
    targets = ("cpu/float32", "cuda:0/float32", "cuda:0/float32+node=n1")
    s = plan(_spec(targets, ("weights", "outputs")), "run", concurrent=True, cpus=2)
    assert _lanes(s) == {
        "cpu · cpu/float32": [("cpu/float32 · weights", 0), ("cpu/float32 · outputs", 5)],
        "cuda:0": [("cuda:0/float32 · weights", 0), ("cuda:0/float32 · outputs", 0)],
        "n1/cuda:0": [("cuda:0/float32+node=n1 · weights", 0), ("cuda:0/float32+node=n1 · outputs", 0)],
        "cpu · cpu/float64": [("cpu/float64", 5)],
    }
    first = ["cpu/float32 · weights", "cuda:0/float32 · weights", "cuda:0/float32+node=n1 · weights"]
    assert s.after == {"cpu/float64": first}


def test_the_reference_as_a_target_is_captured_first_in_each_pass(monkeypatch):
    _small(monkeypatch, False)
    s = plan(_spec(("cpu/float32", "cpu/float64"), ("weights", "outputs")), "run", concurrent=True, cpus=2)
    assert [t.label for t in s.tasks] == ["cpu/float64", "cpu/float32"]
    assert _groups(s) == [(["cpu/float32", "cpu/float64"], "compare · weights, outputs", 0)]
    assert s.after == {}
