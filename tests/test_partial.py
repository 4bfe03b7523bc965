"""Rows before the run ends: a small base is captured in passes, each group of checks is compared as
soon as its captures are in, and the pages show those rows while the other checks go on.

The final metrics table must be the one a single pass gives, row for row and bit for bit.
"""

from __future__ import annotations

import threading
import time

import pandas as pd
import pytest
from apptest import make_app, no_exceptions, texts

import core.spec
from core.checks import CHECKS, get_checks
from core.engine.jobs import Engine
from core.engine.runners import InProcessRunner
from core.engine.schedule import capture_passes
from core.engine.store import PARTIAL_DIR, Store
from core.spec import AdapterRef, ModelRef, ProbeSpec, Target

ALL_CHECKS = tuple(CHECKS)
EARLY = ["weights", "deltas", "outputs", "activations", "merge", "memory", "generate"]


class GatedRunner(InProcessRunner):
    """The in-process runner, holding the adapters check's tasks (the run's last) until `gate` opens."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.order: list[str] = []

    def run(self, task, on_event, cancel, log_path):
        self.order.append(task.label)
        if task.own_check == "adapters":
            while not self.gate.wait(0.05):
                if cancel.is_set():
                    from core.engine.runners import Outcome

                    return Outcome(ok=False, cancelled=True)
        return super().run(task, on_event, cancel, log_path)


def _spec(manifest: dict) -> ProbeSpec:
    return ProbeSpec(
        base=ModelRef(manifest["models"]["tiny-llama"]),
        adapters=tuple(AdapterRef(manifest["adapters"][n]["path"], n) for n in ("lora", "boft")),
        targets=(Target.parse("cpu/float32"), Target.parse("cpu/bfloat16")),
        checks=ALL_CHECKS,
    )


def test_capture_passes_split_a_small_base_only(demo_workspace, monkeypatch):
    spec = _spec(demo_workspace)
    checks = get_checks(spec.checks)
    assert capture_passes(spec, checks) == [
        ("weights", "deltas"),
        ("outputs", "merge", "activations", "generate"),
    ]
    # one kind of check alone: one pass
    assert capture_passes(spec, get_checks(("outputs", "merge"))) == [("outputs", "merge")]
    assert capture_passes(spec, get_checks(("memory",))) == []
    monkeypatch.setattr(core.spec, "CAPTURE_PASSES_UP_TO", 0)  # a base larger than the limit
    assert capture_passes(spec, checks) == [
        ("weights", "deltas", "outputs", "merge", "activations", "generate")
    ]


def test_rows_come_while_the_run_goes_on_and_the_table_is_a_single_pass_one(
    demo_workspace, tmp_path, monkeypatch
):
    spec = _spec(demo_workspace)
    home = tmp_path / "home"
    store = Store(home)
    runner = GatedRunner()
    job = Engine(home, runner=runner).submit(spec)
    # what a page registers to redraw at once (`dashboard.jobs.wake_on_rows`); one that fails stops nothing
    told: list[tuple[tuple[str, ...], bool]] = []
    job.on_rows(lambda: 1 / 0)
    job.on_rows(lambda: told.append((tuple(job.snapshot()["compared"]), job.done_event.is_set())))
    try:
        deadline = time.time() + 240
        while set(store.open(job.run_id).compared()) != set(EARLY) and time.time() < deadline:
            assert not job.done_event.is_set(), job.snapshot()["error"]
            time.sleep(0.2)
        while (not told or set(told[-1][0]) != set(EARLY)) and time.time() < deadline:
            time.sleep(0.05)
        # told after each partial compare, with its checks in: more each time, the run still going
        assert [len(t[0]) for t in told] == sorted({len(t[0]) for t in told}) and told[0][0]
        assert set(told[-1][0]) == set(EARLY) and not any(done for _, done in told)
        record = store.open(job.run_id)
        # Every check but the held one is in, in the run's order, and the run still goes on.
        assert record.status == "running"
        assert record.compared() == [c for c in ALL_CHECKS if c in EARLY]
        assert not (record.run_dir / "metrics.parquet").exists()
        so_far = record.metrics()
        assert list(dict.fromkeys(so_far["check"])) == record.compared()
        assert set(job.snapshot()["compared"]) == set(EARLY)
        # The checks' own tables are there too (the Memory and Merge pages read them).
        assert not record.table("memory_timeline").empty and not record.table("merge_save").empty

        # The pages of the running run: Drift and Memory draw, Adapters says its check is still to come.
        at = make_app(home, monkeypatch, run=job.run_id)
        for page in ("views/drift.py", "views/memory.py", "views/activations.py", "views/overview.py"):
            at.switch_page(page).run()
            no_exceptions(at)
            assert at.get("plotly_chart"), page
            assert "is still running" in texts(at), page
        at.switch_page("views/adapters.py").run()
        no_exceptions(at)
        assert "The `adapters` check of this run is still running" in texts(at)
        assert "did not run" not in texts(at)
        assert not at.get("plotly_chart")
    finally:
        runner.gate.set()
    assert job.wait(240)
    assert job.snapshot()["state"] == "succeeded", job.snapshot()["error"]
    assert told[-1][1]  # and once it ended
    record = store.open(job.run_id)
    assert not (record.run_dir / PARTIAL_DIR).exists(), (
        "the partial tables go once metrics.parquet is written"
    )

    # Two passes over the loaded models, the reference first in the second; the partial compares
    # named by their checks; the adapters check's rows came with the final compare.
    labels = list(job.snapshot()["tasks"])
    assert labels[:5] == [
        "cpu/float32 · weights, deltas",
        "cpu/bfloat16 · weights, deltas",
        "cpu/float64",  # the reference has the one pass that needs it: no part in its label
        "cpu/float32 · outputs, merge, activations, generate",
        "cpu/bfloat16 · outputs, merge, activations, generate",
    ]
    partials = [label for label in labels if label.startswith("compare · ")]
    assert partials == [
        "compare · weights, deltas",
        "compare · outputs, merge, activations, generate",
        "compare · memory",
    ]
    assert labels[-1] == "compare"
    # the Drift page's rows were compared before the reference's capture started
    assert runner.order.index("compare · weights, deltas") < runner.order.index("cpu/float64")

    # The same run in one pass (a base over the limit): the same table, row for row, bit for bit.
    monkeypatch.setattr(core.spec, "CAPTURE_PASSES_UP_TO", 0)
    single = Engine(tmp_path / "single", runner=InProcessRunner()).submit(spec)
    assert single.wait(240)
    assert single.snapshot()["state"] == "succeeded", single.snapshot()["error"]
    assert "cpu/float32" in single.snapshot()["tasks"]
    one = Store(tmp_path / "single").open(single.run_id).metrics()
    two = record.metrics()
    assert list(one.columns) == list(two.columns)
    for check in ALL_CHECKS:
        a = one[one["check"] == check].reset_index(drop=True)
        b = two[two["check"] == check].reset_index(drop=True)
        if (
            check == "memory"
        ):  # measured bytes of this process differ from run to run; the rows' labels do not
            a, b = a[["target", "tensor", "verdict"]], b[["target", "tensor", "verdict"]]
        pd.testing.assert_frame_equal(a, b, check_exact=True, obj=check)


@pytest.mark.parametrize("checks", [("weights", "deltas"), ("outputs",)])
def test_a_run_of_one_group_has_no_partial_compare(demo_workspace, tmp_path, checks):
    spec = ProbeSpec(
        base=ModelRef(demo_workspace["models"]["tiny-llama"]),
        adapters=(AdapterRef(demo_workspace["adapters"]["lora"]["path"], "lora"),),
        targets=(Target.parse("cpu/float32"),),
        checks=checks,
    )
    job = Engine(tmp_path, runner=InProcessRunner()).submit(spec)
    assert job.wait(120)
    snap = job.snapshot()
    assert snap["state"] == "succeeded", snap["error"]
    # its checks' rows come with the last capture: the final compare has them, no partial one runs
    assert not [label for label in snap["tasks"] if label.startswith("compare · ")]
    assert "cpu/float32" in snap["tasks"]
