"""The notebook API (`import weightdrift as wd`, docs/api.md): a Run reads back what the CLI and the
dashboard give for the same run, bad input is one clear error, and (e2e) examples/notebook.ipynb runs
the demo through `wd.run` with real workers, its figures and numbers those of the stored run, which
`weightdrift runs` lists and `wd.compare` compares again from its snapshot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import weightdrift as wd
from core.cli import main as cli_main
from core.engine.store import Store
from core.spec import SpecError
from dashboard.report import SelectionError, page_figures

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "examples" / "notebook.ipynb"
PLOTLY_MIME = "application/vnd.plotly.v1+json"


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory, demo_workspace):
    """A run made by `weightdrift run` (in-process): lora and boft, weights and outputs, cpu fp32 + bf16;
    its home and what the CLI printed."""
    home = tmp_path_factory.mktemp("api-home")
    adapters = demo_workspace["adapters"]
    args = [
        "run",
        "--base",
        demo_workspace["models"]["tiny-llama"],
        "--adapter",
        f"{adapters['lora']['path']}=lora",
        f"{adapters['boft']['path']}=boft",
        "--target",
        "cpu/float32",
        "cpu/bfloat16",
        "--check",
        "weights",
        "deltas",
        "outputs",
        "--in-process",
        "--home",
        str(home),
    ]
    out = tmp_path_factory.mktemp("api-out") / "stdout.txt"
    with open(out, "w", encoding="utf-8") as f:
        saved = sys.stdout
        sys.stdout = f
        try:
            code = cli_main(args)
        finally:
            sys.stdout = saved
    assert code == 1  # bf16 drifts beyond its default tolerance on the demo
    (record,) = Store(home).list_runs()
    return home, record.run_id, out.read_text(encoding="utf-8")


def test_a_run_reads_back_what_the_cli_printed_and_the_store_holds(cli_run):
    home, run_id, printed = cli_run
    run = wd.open(run_id, home=home)
    assert run.summary() + "\n" == printed  # the CLI's text, exactly
    record = Store(home).open(run_id)
    assert run.metrics.equals(record.metrics())
    assert run.status == "succeeded" and run.run_dir == record.run_dir
    assert run.url == f"http://localhost:8501/overview?run={run_id}"
    assert repr(run) == f"<weightdrift.Run {run_id} succeeded: cpu/float32, cpu/bfloat16>"
    # the judgement: every target in exactly one group per check; no anomaly on the demo
    for _check, rows in run.groups.groupby("check"):
        assert sorted(t for cell in rows["targets"] for t in cell.split(", ")) == [
            "cpu/bfloat16",
            "cpu/float32",
        ]
    assert run.anomalies.empty and run.judgement.unjudged is None and run.judgement.anomalies == []
    assert run.table("pairwise").equals(record.table("pairwise"))
    assert "pairwise" in run.tables() and "metrics" not in run.tables()


def test_figures_are_the_pages_own(cli_run):
    home, run_id, _ = cli_run
    run = wd.open(run_id, home=home)
    record = Store(home).open(run_id)
    fig = run.figure("drift", check="weights", adapter="lora", metric="rel_l2")
    ((title, expected),) = page_figures(record, "drift", check="weights", adapter="lora", metric="rel_l2")
    assert fig.to_json() == expected.to_json() and title == "weights · lora · relative L2"
    # the drill-down into the worst bf16 weight of lora: its map's largest |Δ| is the row's max_abs
    table = run.metrics
    rows = table[(table["check"] == "weights") & (table["target"] == "cpu/bfloat16") & (table["max_abs"] > 0)]
    worst = rows.sort_values("max_abs").iloc[-1]
    drill = run.figures(
        "drift", check="weights", adapter="lora", target="cpu/bfloat16", tensor=worst["tensor"]
    )
    first = next(iter(drill.values()))
    assert (
        run.figure("drift", check="weights", adapter="lora", target="cpu/bfloat16", tensor=worst["tensor"])
        is not None
    )
    assert 10 ** np.nanmax(np.asarray(first.data[0].z, dtype=float)) == pytest.approx(
        worst["max_abs"], rel=1e-9
    )
    assert set(run.figures("outputs")) == {
        "Outputs against the reference",
        "KL(p_ref ‖ p_target) per position",
    }


def test_bad_input_is_one_clear_error(cli_run, tmp_path):
    home, run_id, _ = cli_run
    run = wd.open(run_id, home=home)
    with pytest.raises(KeyError, match=f"no run nope in {home / 'runs'}"):
        wd.open("nope", home=home)
    with pytest.raises(KeyError, match="has no table 'nope': it has "):
        run.table("nope")
    with pytest.raises(SelectionError, match="adapter 'dora' is not in this run: one of boft, lora"):
        run.figure("drift", check="deltas", adapter="dora")
    with pytest.raises(
        ValueError, match=r"has nothing for the merge page \(checks: weights, deltas, outputs\)"
    ):
        run.figure("merge")
    with pytest.raises(SpecError, match="cpu/float99"):
        wd.run(base=tmp_path, targets=["cpu/float99"], home=tmp_path)
    with pytest.raises(SpecError, match="a target is given twice"):
        wd.run(base=tmp_path, targets=["cpu/float32", "cpu/float32"], home=tmp_path)
    with pytest.raises(SpecError, match="unknown check nope; available: weights, deltas, outputs, memory"):
        wd.run(base=tmp_path, targets=["cpu/float32"], checks=["weights", "nope"], home=tmp_path)
    with pytest.raises(SpecError, match="give at least one snapshot"):
        wd.compare(home=tmp_path)


def test_the_notebook_is_stored_without_outputs():
    notebook = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    code = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    assert code and all(c["outputs"] == [] and c["execution_count"] is None for c in code)


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_the_notebook_runs_the_demo_and_its_run_is_a_run_like_any_other(
    tmp_path, demo_workspace, monkeypatch
):
    try:
        import nbclient
        import nbformat
    except ImportError:
        pytest.fail("nbclient is not installed: pip install -r requirements-dev.txt")
    home = tmp_path / "home"
    home.mkdir()
    # the session's demo workspace, so the notebook's wd.demo() finds it built
    os.symlink(Path(demo_workspace["models"]["tiny-llama"]).parent.parent, home / "demo")
    monkeypatch.setenv("WEIGHTDRIFT_HOME", str(home))  # the kernel inherits it
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    ).execute()
    cells = [c for c in notebook.cells if c.cell_type == "code"]
    errors = [o for c in cells for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    (record,) = Store(home).list_runs()
    run = wd.open(record.run_id)
    assert run.status == "succeeded" and len(run.spec.adapters) == 2

    def output(source_start: str):
        (cell,) = [c for c in cells if c.source.startswith(source_start)]
        return cell.outputs

    printed = "".join(o.text for o in output("print(run.summary())") if o.output_type == "stream")
    assert printed == run.summary() + "\n"
    figures = [o.data[PLOTLY_MIME] for c in cells for o in c.outputs if PLOTLY_MIME in o.get("data", {})]
    heatmap = run.figure("drift", check="deltas", adapter="lora", metric="rel_l2")
    assert json.loads(heatmap.to_json())["data"] == figures[0]["data"]
    # the drill-down: the tensor the notebook printed, its map's peak is the row's max_abs
    said = [o.text for o in output("bf16 = ") if o.output_type == "stream"][0].split()
    table = run.metrics
    row = table[
        (table["check"] == "deltas")
        & (table["adapter"] == "lora")
        & (table["target"] == "cpu/bfloat16")
        & (table["tensor"] == said[0])
    ].iloc[0]
    assert float(said[3]) == row["max_abs"] and float(said[6]) == row["rel_l2"]
    drill = run.figure("drift", check="deltas", adapter="lora", target="cpu/bfloat16", tensor=said[0])
    assert json.loads(drill.to_json())["data"] == figures[1]["data"]
    assert 10 ** np.nanmax(np.asarray(drill.data[0].z, dtype=float)) == pytest.approx(
        row["max_abs"], rel=1e-9
    )
    assert len(figures) == 4  # heatmap, drill-down, activations heatmap and depth chart
    generations = output("generations = ")[0].data["text/plain"]
    assert all(t in generations for t in ("cpu/float64", "cpu/float32", "cpu/bfloat16"))
    # listed by `weightdrift runs`, like a run of the CLI
    listed = subprocess.run(
        [sys.executable, "-m", "core", "runs", "--home", str(home), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert [r["run_id"] for r in json.loads(listed.stdout)] == [run.run_id]
    # its snapshot compares again here: a new run of the same home, its targets the snapshot's
    snapshot = run.snapshot(tmp_path / "nb.wdsnap", machine="nb")
    again = wd.compare(snapshot, progress=False)
    assert again.run_id != run.run_id
    assert {str(t) for t in again.spec.targets} >= {"nb/cpu/float32", "nb/cpu/bfloat16"}
    assert (
        again.metrics["verdict"].value_counts().to_dict() == run.metrics["verdict"].value_counts().to_dict()
    )
