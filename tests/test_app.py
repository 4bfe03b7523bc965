"""The dashboard under Streamlit's AppTest: first launch, every page on an empty store and on a
stored run, the form's validation, and a demo run submitted through the form.

Jobs run with the in-process runner here (WEIGHTDRIFT_RUNNER=in-process); the browser test runs
real worker processes.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from apptest import finished, make_app, no_exceptions, shown, texts

from core.checks import CHECKS
from core.demo.build import build_demo, load_manifest
from core.demo.workspace import DEMO_TARGETS
from core.engine.jobs import Engine
from core.engine.runners import InProcessRunner
from core.engine.store import Store
from core.spec import AdapterRef, ModelRef, ProbeSpec, Target
from dashboard import pages

PAGES = (
    "views/overview.py",
    "views/drift.py",
    "views/outputs.py",
    "views/merge.py",
    "views/memory.py",
    "views/adapters.py",
    "views/activations.py",
    "views/runs.py",
)


@pytest.fixture(scope="module")
def run_home(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A home with the demo workspace and one finished run (lora + boft on cpu fp32 and bf16)."""
    home = tmp_path_factory.mktemp("app-home")
    manifest = build_demo(home)
    spec = ProbeSpec(
        base=ModelRef(path=manifest["models"]["tiny-llama"]),
        adapters=tuple(AdapterRef(path=manifest["adapters"][n]["path"], name=n) for n in ("lora", "boft")),
        targets=(Target.parse("cpu/float32"), Target.parse("cpu/bfloat16")),
    )
    job = Engine(home, runner=InProcessRunner()).submit(spec)
    assert job.wait(300)
    assert job.snapshot()["state"] == "succeeded", job.snapshot()["error"]
    return home, job.run_id


def test_first_launch_builds_the_demo_and_every_page_renders_on_an_empty_store(tmp_path, monkeypatch):
    at = make_app(tmp_path, monkeypatch)
    at.run()
    no_exceptions(at)
    manifest = load_manifest(tmp_path)
    assert manifest is not None, "the first launch must build the demo workspace"
    # The form is preselected on the demo: its base, one adapter per method, cpu fp32 and bf16.
    assert at.sidebar.selectbox(key="form.base_choice").value == manifest["models"]["tiny-llama"]
    chosen = {Path(p).name for p in at.sidebar.multiselect(key="form.adapters").value}
    assert chosen == {"lora", "dora", "pissa", "boft", "oft", "ia3"}
    assert at.sidebar.multiselect(key="form.targets").value == ["cpu/float32", "cpu/bfloat16"]
    for page in PAGES:
        at.switch_page(page).run()
        no_exceptions(at)
        assert "No runs" in texts(at), page


def test_every_page_renders_a_stored_run(run_home, monkeypatch):
    home, run_id = run_home
    at = make_app(home, monkeypatch, run=run_id)
    at.run()
    no_exceptions(at)
    # bf16 logits drift on the demo: as its rounding gives, one line, not a red count
    assert "Drift as expected for bfloat16" in texts(at) and "No anomaly" in texts(at)
    assert [m.label for m in at.metric] == ["Identical", "Within tolerance", "Drift", "Broken"]
    # the whole run in one file (dashboard/report.py, the bytes `weightdrift report` writes)
    assert "Download the report (one HTML file)" in {b.label for b in at.get("download_button")}
    for page in PAGES[1:]:
        at.switch_page(page).run()
        no_exceptions(at)
        assert at.query_params["run"] == run_id or page.endswith("runs.py")
        # each page's heading is its title in the one table of pages (the navigation's)
        assert [t.value for t in at.title] == [pages.page(Path(page).stem).title], page


def test_the_table_of_pages_is_every_view_and_says_where_a_run_opens():
    views = Path(__file__).resolve().parent.parent / "dashboard" / "views"
    assert (
        sorted(p.script for p in pages.PAGES)
        == sorted(PAGES)
        == sorted(f"views/{p.name}" for p in views.glob("[!_]*.py"))
    )
    # every check has a page (generated text is on Outputs); the per-tensor ones share the Drift page,
    # which a run opens on first
    assert sorted(c for p in pages.PAGES for c in p.checks) == sorted(CHECKS)
    assert pages.result_page(["memory", "weights", "merge"]) == "drift"
    assert pages.result_page(["activations", "memory"]) == "memory"
    assert [p.path for p in pages.result_pages(["activations", "adapters", "outputs"])] == [
        "outputs",
        "adapters",
        "activations",
    ]
    assert pages.result_page(["generate"]) == "outputs" and pages.result_page([]) == "overview"


def test_drift_page_opens_the_view_the_url_names(run_home, monkeypatch):
    home, run_id = run_home
    table = Store(home).open(run_id).metrics()
    weights = table[(table["check"] == "weights") & (table["target"] == "cpu/bfloat16")]
    row = weights[weights["verdict"] == "within tolerance"].iloc[3]  # a bf16 base weight: it differs
    adapter = row["adapter"] if isinstance(row["adapter"], str) else "base model"
    at = make_app(
        home,
        monkeypatch,
        run=run_id,
        check="weights",
        adapter=adapter,
        metric="rel_l2",
        target="cpu/bfloat16",
        tensor=row["tensor"],
    )
    at.switch_page("views/drift.py").run()
    no_exceptions(at)
    assert at.selectbox(key="widget.run").value == run_id
    assert at.selectbox(key="widget.metric").value == "rel_l2"
    assert at.selectbox(key="widget.target").value == "cpu/bfloat16"
    assert at.selectbox(key="widget.tensor").value == row["tensor"]
    # The heatmap, the tensor's element-wise difference and its histogram.
    assert len(at.get("plotly_chart")) == 3
    assert row["explanation"] in texts(at)
    # And the state is written back to the URL, so a copied link reproduces it.
    assert at.query_params["tensor"] == row["tensor"]

    # A tensor equal to its reference has nothing to map: the page says so instead of an empty chart.
    same = table[(table["check"] == "weights") & (table["verdict"] == "identical")].iloc[0]
    at.query_params["adapter"] = same["adapter"] if isinstance(same["adapter"], str) else "base model"
    at.query_params["target"] = same["target"]
    at.query_params["tensor"] = same["tensor"]
    at.run()
    no_exceptions(at)
    assert at.selectbox(key="widget.tensor").value == same["tensor"]
    assert "equals its reference exactly" in texts(at)
    assert len(at.get("plotly_chart")) == 1


def test_drift_page_defaults_to_the_worst_target_and_tensor(run_home, monkeypatch):
    home, run_id = run_home
    at = make_app(home, monkeypatch, run=run_id, check="deltas")
    at.switch_page("views/drift.py").run()
    no_exceptions(at)
    table = Store(home).open(run_id).metrics()
    deltas = table[table["check"] == "deltas"]
    # bf16 deltas of the multiplicative methods drift; the page opens on that target and tensor.
    assert at.selectbox(key="widget.target").value == "cpu/bfloat16"
    tensor = at.selectbox(key="widget.tensor").value
    chosen = deltas[(deltas["target"] == "cpu/bfloat16") & (deltas["tensor"] == tensor)]
    assert (chosen["verdict"] == "drift").any()


def test_the_form_explains_invalid_input_next_to_the_field(run_home, monkeypatch, tmp_path):
    home, _ = run_home
    at = make_app(home, monkeypatch)
    at.run()
    at.session_state["form.base"] = str(tmp_path / "no-such-model")
    at.session_state["form.targets"] = ["cpu/float32", "cuda:7/float32"]
    at.run()
    no_exceptions(at)
    errors = [shown(e) for e in at.sidebar.error]
    assert any("no such folder" in e for e in errors), errors
    assert any("cuda:7 does not exist on this machine" in e for e in errors), errors
    runs_before = len(Store(home).list_runs())
    at.sidebar.button(key="form.run").click().run()
    assert any("Fix the fields" in shown(e) for e in at.sidebar.error)
    assert len(Store(home).list_runs()) == runs_before  # nothing was submitted

    # An adapter made for another base is refused with the reason.
    manifest = load_manifest(home)
    at.session_state["form.base"] = ""
    at.session_state["form.targets"] = ["cpu/float32"]
    at.run()
    at.session_state["form.adapters"] = [manifest["adapters"]["bert-lora"]["path"]]
    at.run()
    errors = [shown(e) for e in at.sidebar.error]
    assert any("made for a different base model" in e for e in errors), errors


def test_the_form_says_what_each_field_expected(run_home, monkeypatch, tmp_path):
    """Issue 16's bad inputs, typed into the form: each message under its own field, in field order."""
    from test_messages import PEFT_EXPECTED, THREADS_EXPECTED

    home, _ = run_home
    manifest = load_manifest(home)
    lora = manifest["adapters"]["lora"]["path"]
    bad = tmp_path / "superlora"
    shutil.copytree(lora, bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps(config | {"peft_type": "SUPERLORA"}))
    at = make_app(home, monkeypatch)
    at.run()
    at.session_state["form.adapters"] = [str(bad), lora]
    at.session_state["form.targets"] = ["cpu/float32+threads=²"]
    at.session_state["form.checks"] = ["merge"]
    at.run()  # the merge picker appears for the merge check
    at.session_state["form.merge_subset"] = ["lora"]
    at.run()
    no_exceptions(at)
    assert [shown(e) for e in at.sidebar.error] == [
        f'adapter superlora ({bad}): adapter_config.json field peft_type is "SUPERLORA"; {PEFT_EXPECTED}',
        f"target 'cpu/float32+threads=²': flag threads=² is not a CPU thread count; {THREADS_EXPECTED}",
        "merge subset names lora alone; name two or more adapters to merge together",
    ]


def test_a_demo_run_submitted_through_the_form_completes(run_home, monkeypatch):
    home, _ = run_home
    manifest = load_manifest(home)
    store = Store(home)
    before = {r.run_id for r in store.list_runs()}
    at = make_app(home, monkeypatch)
    at.run()
    at.session_state["form.adapters"] = [manifest["adapters"]["lora"]["path"]]
    at.run()
    at.sidebar.button(key="form.run").click().run()
    no_exceptions(at)
    new = [r.run_id for r in store.list_runs() if r.run_id not in before]
    assert len(new) == 1, "Run must start exactly one job"
    run_id = new[0]
    record = finished(store, run_id)
    assert record.status == "succeeded", record.error
    at.query_params["run"] = run_id
    at.switch_page("views/overview.py").run()
    no_exceptions(at)
    assert at.selectbox(key="widget.run").value == run_id
    counts = {m.label: m.value for m in at.metric}
    table = record.metrics()
    assert counts["Drift"] == str(int((table["verdict"] == "drift").sum()))
    assert counts["Identical"] == str(int((table["verdict"] == "identical").sum()))


def test_a_failed_run_shows_its_reason_on_every_result_page(run_home, monkeypatch):
    home, good = run_home
    store = Store(home)
    spec = store.open(good).spec
    record = store.create_run(spec)
    reason = "cpu/bfloat16: worker process was killed by SIGKILL (stage 'load base', step 2 of 21)"
    store.update(record.run_id, status="failed", error=reason)
    at = make_app(home, monkeypatch, run=record.run_id)
    for page in PAGES[:3]:
        at.switch_page(page).run()
        no_exceptions(at)
        assert any(reason in shown(e) for e in at.error), page
        assert not at.get("plotly_chart"), page
    store.release(record.run_id)
    store.delete(record.run_id)


def test_a_run_owned_by_another_process_shows_its_stored_progress(run_home, monkeypatch):
    home, good = run_home
    store = Store(home)
    record = store.create_run(store.open(good).spec)  # owned by this (live) pid, unknown to the app's engine
    progress = {"name": "cpu/float32", "state": "running", "stage": "capture lora", "step": 7, "of": 21}
    store.update(record.run_id, status="running", targets={"cpu/float32": progress})
    at = make_app(home, monkeypatch, run=record.run_id)
    at.switch_page("views/drift.py").run()
    no_exceptions(at)
    assert "is running in another process" in texts(at)
    assert any("capture lora · step 7 of 21" in str(p.proto.text) for p in at.get("progress"))
    store.release(record.run_id)
    store.delete(record.run_id)


def test_the_form_sends_strategies_merge_subset_and_time_limit_and_opens_the_first_checks_page(
    run_home, monkeypatch
):
    home, _ = run_home
    manifest = load_manifest(home)
    store = Store(home)
    before = {r.run_id for r in store.list_runs()}
    at = make_app(home, monkeypatch)
    at.run()
    at.session_state["form.adapters"] = [manifest["adapters"][n]["path"] for n in ("lora", "lora_b")]
    at.session_state["form.targets"] = ["cpu/float32"]
    at.session_state["form.checks"] = ["merge", "adapters"]
    at.run()  # the strategy and merge pickers appear for these checks
    at.session_state["form.strategies"] = ["load_adapter"]
    at.session_state["form.merge_subset"] = ["lora_b", "lora"]
    at.sidebar.number_input(key="form.task_timeout").set_value(900.0)  # the Runner section's time limit
    at.run()
    at.sidebar.button(key="form.run").click().run()
    no_exceptions(at)
    new = [r for r in store.list_runs() if r.run_id not in before]
    assert len(new) == 1
    spec = new[0].spec
    assert spec.checks == ("merge", "adapters")
    assert spec.strategies == ("isolated", "load_adapter")  # the ground truth is always added
    assert spec.merge_subset == ("lora_b", "lora")
    assert spec.task_timeout_s == 900.0
    assert at.query_params["run"] == new[0].run_id
    record = finished(store, new[0].run_id)
    assert record.status == "succeeded", record.error


# --- faults and untrusted text (issue 15) -----------------------------------------------------

CRAFTED = (
    "Session expired - [click to sign in again](http://evil.example/login) ![x](http://evil.example/p.png)"
)


def test_a_crafted_run_url_is_shown_as_text(run_home, monkeypatch):
    home, _ = run_home
    at = make_app(home, monkeypatch, run=CRAFTED)
    at.switch_page("views/drift.py").run()
    no_exceptions(at)
    warning = next(w for w in at.warning if "is not in" in shown(w))
    assert shown(warning).startswith(f"Run {CRAFTED} is not in ")
    # sent escaped: Markdown draws neither the link nor the image
    assert "](http" not in str(warning.value) and "![" not in str(warning.value)


def _damaged_copy(store: Store, good: str, damage) -> str:
    """A copy of the finished run `good`, then damaged by `damage(run_dir)`; returns its id."""
    import shutil

    from core.engine.store import new_run_id

    run_id = new_run_id()
    shutil.copytree(store.runs_dir / good, store.runs_dir / run_id)
    damage(store.runs_dir / run_id)
    return run_id


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda d: (d / "run.json").write_text("[]"), "run.json holds a JSON list, not an object"),
        (lambda d: (d / "metrics.parquet").write_bytes(b""), "metrics.parquet is damaged (0 bytes"),
    ],
    ids=["run.json", "metrics.parquet"],
)
def test_a_damaged_run_shows_why_and_can_be_deleted(run_home, monkeypatch, damage, reason):
    home, good = run_home
    store = Store(home)
    run_id = _damaged_copy(store, good, damage)
    at = make_app(home, monkeypatch, run=run_id)
    for page in PAGES[:3]:
        at.switch_page(page).run()
        no_exceptions(at)
        assert any(f"Run {run_id} is damaged: {reason}" in shown(e) for e in at.error), page
    at.switch_page("views/runs.py").run()
    no_exceptions(at)
    table = at.dataframe(key="runs.table").value
    row = table[table["run"] == run_id].iloc[0]
    assert row["status"] == "damaged" and row["error"].startswith(reason)
    assert store.open(run_id).status == "damaged"
    store.delete(run_id)  # what the page's delete button calls: allowed, nobody runs it


def test_run_on_a_home_that_cannot_be_written_says_so(run_home, monkeypatch):
    import errno

    from core.engine import store as store_module

    home, _ = run_home
    at = make_app(home, monkeypatch)
    at.run()
    manifest = load_manifest(home)
    at.session_state["form.adapters"] = [manifest["adapters"]["lora"]["path"]]
    at.run()

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(store_module.os, "fsync", read_only)
    before = {r.run_id for r in Store(home).list_runs()}
    at.sidebar.button(key="form.run").click().run()
    no_exceptions(at)
    message = [shown(e) for e in at.sidebar.error]
    assert any(
        m.startswith("cannot create the run folder ")
        and "Read-only file system (the folder is not writable: make it writable, or choose another home" in m
        for m in message
    ), message
    monkeypatch.undo()
    assert {r.run_id for r in Store(home).list_runs()} == before


def test_a_base_model_moved_after_the_run_is_explained_in_the_drill_down(run_home, monkeypatch):
    from core.engine import diffmap
    from core.models.checkpoint import LoadError

    home, run_id = run_home

    def moved(*args, **kwargs):
        raise LoadError("/gone/tiny-llama: no such folder")

    monkeypatch.setattr(diffmap, "element_diff", moved)
    import streamlit as st

    st.cache_data.clear()  # figures drawn by earlier tests are cached
    at = make_app(home, monkeypatch, run=run_id, check="weights", target="cpu/bfloat16", tensor="x-moved")
    at.switch_page("views/drift.py").run()
    no_exceptions(at)
    said = [shown(e) for e in at.error if "Cannot show the element-wise difference" in shown(e)]
    assert len(said) == 1, texts(at)
    assert ": /gone/tiny-llama: no such folder. If the run's base model or adapters moved" in said[0]


def test_a_home_that_cannot_be_made_is_said_not_raised(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    home = blocker / "home"  # cannot be made: its parent is a file (even for root)
    at = make_app(home, monkeypatch)
    at.run()
    no_exceptions(at)
    said = [shown(e) for e in at.sidebar.error]
    assert said == [
        f"WeightDrift cannot use its home: cannot create the runs folder {home / 'runs'}: Not a directory "
        "(check the folder and the disk)"
    ]


@pytest.mark.parametrize("page", ["merge", "memory", "adapters", "activations"])
def test_a_page_whose_check_did_not_run_offers_it_and_its_scenarios_in_plain_sight(
    run_home, monkeypatch, page
):
    # The stored run ran weights, deltas and outputs: each other check's page says so, offers the
    # same selection with that check (one click) and its demo scenarios, none of it folded away.
    home, run_id = run_home
    at = make_app(home, monkeypatch, run=run_id)
    at.run()
    at.switch_page(f"views/{page}.py").run()
    no_exceptions(at)
    assert f"did not run the `{page}` check" in texts(at)
    rerun = at.button(key=f"{page}.rerun")
    assert rerun.label == f"Run {page} on this run's selection"
    scenarios = [b for b in at.button if b.key and b.key.startswith("scenario.")]
    assert scenarios
    assert not at.main.expander  # in plain sight (the sidebar form has its own)
    # what the button submits, recorded rather than run: a job left running in this process would
    # share its process-global torch state with the tests after this one
    submitted = []
    monkeypatch.setattr("dashboard.ui.start_run", lambda spec, to: submitted.append((spec, to)))
    rerun.click().run()
    no_exceptions(at)
    stored = Store(home).open(run_id).spec
    assert submitted == [(replace(stored, checks=(page,)), page)]


RESULT_PAGES = ("overview", "drift", "outputs", "activations", "merge", "memory", "adapters")


def test_one_press_of_run_on_a_fresh_home_fills_every_result_page(tmp_path, monkeypatch):
    # The demo's default selection runs every check; one press of Run, and every result page shows
    # its chart and its finding, none a "did not run" message.
    at = make_app(tmp_path, monkeypatch)
    at.run()
    assert set(at.sidebar.multiselect(key="form.checks").value) == set(CHECKS)
    store = Store(tmp_path)
    at.sidebar.button(key="form.run").click().run()
    no_exceptions(at)
    (record,) = store.list_runs()
    record = finished(store, record.run_id)
    assert record.status == "succeeded", record.error
    assert record.spec.checks == tuple(CHECKS)
    assert len(record.spec.adapters) == 6
    at.query_params["run"] = record.run_id
    for page in RESULT_PAGES:
        at.switch_page(f"views/{page}.py").run()
        no_exceptions(at)
        assert at.get("plotly_chart"), f"{page}: no chart"
        said = texts(at)
        assert "did not run" not in said and "still running" not in said, f"{page}: {said[:400]}"
    # the Overview leads with the answer: agreement groups and no anomaly, bfloat16's drift one line
    at.switch_page("views/overview.py").run()
    said = texts(at)
    assert "Which targets agree" in said and "No anomaly" in said, said[:600]
    assert "Drift as expected for bfloat16" in said
    assert "beyond tolerance**" not in said and not any(
        "rows are beyond tolerance" in shown(e) for e in at.error
    )
    (groups,) = [d.value for d in at.dataframe if "how it differs" in d.value.columns]
    for check, rows in groups.groupby("check"):
        members = sorted(t for cell in rows["targets"] for t in cell.split(", "))
        assert members == sorted(DEMO_TARGETS), check  # every target in exactly one group
    # each page's finding, as the pages word it
    at.switch_page("views/activations.py").run()
    assert "parts from the reference at" in texts(at)
    at.switch_page("views/merge.py").run()
    assert "Output residual per stage" in texts(at)
    at.switch_page("views/memory.py").run()
    assert "Where each parameter and buffer lives" in texts(at)


def test_a_copied_run_is_listed_and_opened_as_its_folder_with_a_note(run_home, monkeypatch):
    home, good = run_home
    store = Store(home)
    copy = _damaged_copy(store, good, lambda d: None)  # copied, not damaged: its run.json names `good`
    note = f"its run.json names run {good}: this folder was copied or renamed, and is the run {copy} here"
    at = make_app(home, monkeypatch, run=copy)
    at.switch_page("views/runs.py").run()
    no_exceptions(at)
    table = at.dataframe(key="runs.table").value
    assert list(table[table["run"].isin([copy, good])]["note"]) == [note, ""]
    at.switch_page("views/overview.py").run()
    no_exceptions(at)
    assert [shown(c) for c in at.caption if shown(c).startswith(f"Run {copy}")] == [f"Run {copy}: {note}"]
    store.delete(copy)
    assert good in [r.run_id for r in store.list_runs()]
