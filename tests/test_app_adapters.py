"""The Adapter consistency page under AppTest, on runs of its demo scenarios (in-process runner)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from apptest import finished, make_app, no_exceptions, texts
from streamlit.testing.v1 import AppTest

from core.demo.build import build_demo
from core.demo.scenarios import scenario_spec
from core.engine.jobs import Engine
from core.engine.runners import InProcessRunner

PAGE = "views/adapters.py"


def frame_with(at: AppTest, column: str):
    """The first dataframe on the page that has `column` (AppTest does not keep dataframe keys)."""
    return next(d.value for d in at.dataframe if column in d.value.columns)


@pytest.fixture(scope="module")
def scenario_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A home with one finished run per adapters scenario."""
    home = tmp_path_factory.mktemp("adapters-app-home")
    manifest = build_demo(home)
    engine = Engine(home, runner=InProcessRunner())
    runs = {}
    for name in ("loop-pissa-lora", "pissa-converted", "adapter-not-applied"):
        job = engine.submit(scenario_spec(name, manifest, engine.devices))
        assert job.wait(300)
        assert job.snapshot()["state"] == "succeeded", job.snapshot()["error"]
        runs[name] = job.run_id
    return home, runs


def test_page_on_an_empty_store_offers_the_scenarios(tmp_path, monkeypatch):
    at = make_app(tmp_path, monkeypatch)
    at.run()
    at.switch_page(PAGE).run()
    no_exceptions(at)
    assert "No runs" in texts(at)
    # its one chart is the hidden empty one that gets the browser's chart component ready before a run
    (chart,) = at.get("plotly_chart")
    assert json.loads(chart.proto.spec)["data"] == []
    assert any(".st-key-chart-ahead { display: none; }" in h.proto.body for h in at.get("html"))
    titles = {b.label for b in at.button if b.key and b.key.startswith("scenario.")}
    assert {
        "loop with from_pretrained over LoRA + PiSSA adapters",
        "PiSSA converted to LoRA",
        "adapter that is not applied",
    } <= titles


def test_loop_over_pissa_and_lora_names_the_base_mutation(scenario_runs, monkeypatch):
    home, runs = scenario_runs
    at = make_app(home, monkeypatch, run=runs["loop-pissa-lora"])
    at.switch_page(PAGE).run()
    no_exceptions(at)
    text = texts(at)
    assert "Predictions differ from isolated" in text
    assert "lora with from_pretrained_loop" in text and "lora with load_adapter" in text
    assert "base mutated by pissa (PiSSA)" in text
    assert "does not give the base model back" in text
    assert "holds lora, pissa; active lora" in text
    assert len(at.get("plotly_chart")) == 1
    mutation = frame_with(at, "changed by")
    assert set(mutation["module"]) == {"q_proj", "v_proj", "up_proj"}
    assert set(mutation["changed by"]) == {"pissa"}
    labels = {b.label for b in at.get("download_button")}
    assert {"Download CSV", "Download figure (HTML)"} <= labels


def test_stacking_is_said_not_to_be_the_cause_and_the_noop_adapter_is_flagged(scenario_runs, monkeypatch):
    home, runs = scenario_runs
    at = make_app(home, monkeypatch, run=runs["adapter-not-applied"])
    at.switch_page(PAGE).run()
    no_exceptions(at)
    text = texts(at)
    assert "Every strategy predicts bitwise like isolated" in text
    assert "Stacking is not the cause" in text and "lora_b with from_pretrained_loop" in text
    assert "Not applied" in text and "lora_noop" in text
    assert "No load changed any base weight" in text


def test_pissa_conversion_table(scenario_runs, monkeypatch):
    home, runs = scenario_runs
    at = make_app(home, monkeypatch, run=runs["pissa-converted"])
    at.switch_page(PAGE).run()
    no_exceptions(at)
    assert "PiSSA converted to LoRA" in texts(at)
    conversion = frame_with(at, "reference")
    assert list(conversion["adapter"]) == ["pissa_lora"]
    assert conversion["verdict"].iloc[0] in ("identical", "within tolerance")


def test_form_offers_load_strategies_when_the_adapters_check_is_chosen(scenario_runs, monkeypatch):
    home, _ = scenario_runs
    at = make_app(home, monkeypatch)
    at.run()
    # the demo's default selection runs every check, adapters included: a choice without it has no strategies
    at.sidebar.multiselect(key="form.checks").set_value(["weights"]).run()
    assert not [m for m in at.sidebar.multiselect if m.key == "form.strategies"]
    at.sidebar.multiselect(key="form.checks").set_value(["adapters"]).run()
    at.sidebar.multiselect(key="form.adapters").set_value(
        [a for a in at.sidebar.multiselect(key="form.adapters").value if Path(a).name in ("lora", "pissa")]
    ).run()
    at.sidebar.multiselect(key="form.strategies").set_value(["load_adapter"]).run()
    at.sidebar.button(key="form.run").click().run()
    no_exceptions(at)
    from core.engine.store import Store

    newest = Store(home).list_runs()[0]
    assert newest.spec.checks == ("adapters",)
    assert newest.spec.strategies == ("isolated", "load_adapter")
    assert finished(Store(home), newest.run_id, 120).status == "succeeded"
