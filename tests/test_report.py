"""The one-file report (`weightdrift report RUN_ID -o FILE`, dashboard/report.py): its size for the demo's
run with every check, its numbers against the run's tables, the command that runs it again, untrusted
text shown as text, and (e2e) headless Chromium opening it offline with no request and no console error."""

from __future__ import annotations

import html
import json
import re
import shlex
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest

from core import report
from core.checks import CHECKS
from core.cli import build_parser, spec_from_args
from core.demo.workspace import DEMO_TARGETS, demo_selection
from core.engine.jobs import Engine
from core.engine.runners import InProcessRunner
from core.engine.store import Store
from core.spec import AdapterRef, ModelRef, ProbeInputs, ProbeSpec, Target, ToleranceOverride
from dashboard.report import PAGE_FIGURES, SelectionError, page_figures, report_html, run_command

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "tests" / "artifacts"
PLOTLY_JS_BANNER = "plotly.js v"  # the first line of Plotly's bundle, once per copy


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, demo_workspace) -> tuple[Path, str]:
    """The demo's run: its default selection (one adapter per method) with every check, cpu fp32 and bf16."""
    home = tmp_path_factory.mktemp("report-home")
    base, adapters = demo_selection(demo_workspace)
    spec = ProbeSpec(
        base=ModelRef(path=base),
        adapters=tuple(adapters),
        targets=tuple(map(Target.parse, DEMO_TARGETS)),
        checks=tuple(CHECKS),
    )
    job = Engine(home, runner=InProcessRunner()).submit(spec)
    assert job.wait(600)
    assert job.state == "succeeded", job.error
    return home, job.run_id


@pytest.fixture(scope="module")
def report_file(demo_run, tmp_path_factory) -> Path:
    """The demo run's report, written by the CLI."""
    home, run_id = demo_run
    out = tmp_path_factory.mktemp("report") / "report.html"
    done = subprocess.run(
        [sys.executable, "-m", "core", "report", run_id, "-o", str(out), "--home", str(home)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == f"report {out}: {out.stat().st_size / 2**20:.2f} MiB"
    return out


class _Tables(HTMLParser):
    """Every <table> of a document as rows of cell texts, by the table's class."""

    def __init__(self):
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self._rows: list[list[str]] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self._rows = self.tables.setdefault(dict(attrs).get("class", ""), [])
        elif tag == "tr" and self._rows is not None:
            self._rows.append([])
        elif tag in ("td", "th") and self._rows is not None:
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._rows[-1].append("".join(self._cell))
            self._cell = None
        elif tag == "table":
            self._rows = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def test_the_demo_report_is_one_file_under_10_mb_with_plotly_once_and_no_script_of_ours(report_file):
    text = report_file.read_text(encoding="utf-8")
    assert report_file.stat().st_size < 10 * 2**20
    assert text.count(PLOTLY_JS_BANNER) == 1
    scripts = re.findall(r"<script[^>]*>", text)
    # Plotly's bundle, and per figure the newPlot call plotly's to_html writes; nothing loaded from outside
    assert not any("src=" in s for s in scripts)
    assert len(scripts) == 1 + 1 + text.count('class="plotly-graph-div"')
    # our own markup links and loads nothing (Plotly's bundle names sites for map tiles, never used here)
    markup = re.sub(r"<script[^>]*>.*?</script>", "", text, flags=re.S)
    assert not re.search(r"(?:src|href)=", markup)


def test_the_reports_numbers_are_the_runs(demo_run, report_file):
    home, run_id = demo_run
    record = Store(home).open(run_id)
    table = record.metrics()
    text = report_file.read_text(encoding="utf-8")
    counts = report.verdict_counts(table)
    assert "Rows: " + " · ".join(f"{n} {v}" for v, n in counts.items()) in text
    parsed = _Tables()
    parsed.feed(text)
    header, *rows = parsed.tables["dataframe worst"]
    worst = report.worst_rows(table, 20)
    assert header == list(worst.columns) and len(rows) == len(worst) == 20
    for cells, expected in zip(rows, worst.to_dict(orient="records"), strict=True):
        got = dict(zip(header, cells, strict=True))
        assert (got["target"], got["tensor"], got["verdict"]) == (
            expected["target"],
            expected["tensor"],
            expected["verdict"],
        )
        for metric in ("max_abs", "rel_l2", "max_ulp"):
            if pd.notna(expected[metric]):
                assert float(got[metric]) == float(expected[metric]), (metric, got)  # exactly, not rounded
    # every figure's data as plotly holds it: the verdict bars count the table's rows per check and target
    by = report.verdicts_by_check_target(table)
    first = json.loads(re.search(r'Plotly\.newPlot\(\s*"[^"]+",\s*(\[.*?\]),\s*\{', text, re.S).group(1))
    drawn = {trace["name"].split(" ", 1)[1]: trace["x"] for trace in first}
    assert drawn == {v: by[v].tolist() for v in report.VERDICT_ORDER}
    for sentence in record.answer(table):
        assert html.escape(sentence.strip()) in text


def test_every_page_of_the_demo_run_has_its_figures_and_a_wrong_selection_says_what_there_is(demo_run):
    home, run_id = demo_run
    record = Store(home).open(run_id)
    table = record.metrics()
    for page in PAGE_FIGURES:
        assert page_figures(record, page, table), page
    (drift,) = page_figures(record, "drift", table, check="weights", adapter="lora", metric="rel_l2")
    assert drift[0] == "weights · lora · relative L2"
    with pytest.raises(
        SelectionError, match=r"adapter 'nope' is not in this run: one of boft, dora, ia3, lora, oft, pissa$"
    ):
        page_figures(record, "drift", table, check="deltas", adapter="nope")
    with pytest.raises(SelectionError, match="the drift page has no selector 'stage'"):
        page_figures(record, "drift", table, stage="x")
    with pytest.raises(SelectionError, match="no page 'drifts': one of overview, drift"):
        page_figures(record, "drifts", table)


def test_the_command_runs_the_same_spec_again(tmp_path):
    spec = ProbeSpec(
        base=ModelRef(path="/models/my base", trust_remote_code=True),
        adapters=(AdapterRef(path="/a/lo ra", name="lora"), AdapterRef(path="/a/dora", name="d")),
        targets=(Target.parse("cpu/float32"), Target.parse("cpu/bfloat16+threads=2")),
        checks=("weights", "outputs", "adapters", "merge", "generate"),
        probe=ProbeInputs(prompts=('it\'s a "test"', "$(rm -rf /)")),
        tolerances={"*": ToleranceOverride(rtol=1e-3, atol=2.5e-7)},
        seed=7,
        strategies=("isolated", "from_pretrained_loop"),
        merge_subset=("lora", "d"),
        keep_tensors=True,
        reference=Target.parse("cpu/float32"),
        peers=False,
        max_new_tokens=5,
    )
    args = build_parser().parse_args(shlex.split(run_command(spec))[1:] + ["--home", str(tmp_path)])
    assert spec_from_args(args, tmp_path) == spec
    # the peers the engine added are left out: it adds them again
    with_peers = ProbeSpec(base=ModelRef(path="b"), adapters=(), targets=(Target.parse("cuda:0/bfloat16"),))
    added = with_peers.with_peers()
    args = build_parser().parse_args(shlex.split(run_command(added))[1:])
    assert spec_from_args(args, tmp_path).targets == with_peers.targets


def test_untrusted_text_in_a_run_is_shown_as_text(demo_run, tmp_path):
    home, run_id = demo_run
    store = Store(tmp_path)
    crafted = store.runs_dir / "20260101-000000-abcdef"
    shutil.copytree(Store(home).runs_dir / run_id, crafted)
    spec = json.loads((crafted / "spec.json").read_text())
    spec["base"]["path"] = "/m/<script>alert(1)</script>"
    spec["adapters"][0]["name"] = "<img src=x onerror=alert(2)>"
    (crafted / "spec.json").write_text(json.dumps(spec))
    info = json.loads((crafted / "run.json").read_text())
    info.update(status="failed", error="OSError: <iframe src='https://evil.example'></iframe>")
    (crafted / "run.json").write_text(json.dumps(info))
    text = report_html(store.open(crafted.name))
    for markup in ("<script>alert", "<img src=x", "<iframe"):
        assert markup not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text and "&lt;iframe src=" in text


def test_a_missing_run_is_a_one_line_error(demo_run, tmp_path):
    home, _ = demo_run
    done = subprocess.run(
        [sys.executable, "-m", "core", "report", "nope", "-o", str(tmp_path / "r.html"), "--home", str(home)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: no run nope in {home / 'runs'} (python -m core runs lists them)"
    assert not (tmp_path / "r.html").exists()


@pytest.mark.e2e
def test_the_report_opens_offline_in_chromium_without_a_request_or_a_console_error(report_file):
    from bench.dashboard import CHROMIUM, CHROMIUM_ARGS, VIEWPORT

    if not Path(CHROMIUM).exists():
        pytest.fail(f"no Chromium at {CHROMIUM}: apt-get install chromium (README's test command does)")
    import playwright.sync_api as playwright_sync

    requests, errors = [], []
    with playwright_sync.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport=VIEWPORT)

            def route(r):
                if r.request.url.startswith(("file:", "data:")):
                    r.continue_()
                else:
                    requests.append(r.request.url)
                    r.abort()

            context.route("**/*", route)
            page = context.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(report_file.as_uri())
            plots = page.locator(".js-plotly-plot")
            plots.last.locator(".main-svg").first.wait_for(timeout=60_000)  # every figure drawn
            expected = report_file.read_text(encoding="utf-8").count('class="plotly-graph-div"')
            assert plots.count() == expected > 10
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "report.png"))
            page.get_by_role("heading", name="Drift", exact=True).scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / "report-drift.png"))
        finally:
            browser.close()
    assert requests == [] and errors == []
