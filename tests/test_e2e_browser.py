"""End to end in a real browser: the real Streamlit server, real worker processes, headless Chromium.

First launch on an empty WeightDrift home (the app builds the demo workspace itself), one click on
Run with the default demo form, the drift heatmap, a drill-down into one tensor, and the URL of that
view opened in a fresh browser context (a colleague opening a shared link) showing the same thing.
Screenshots and the server log go to tests/artifacts/; the click → first heatmap time is printed and
written to tests/artifacts/timings.json.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode, urlsplit

import pytest

from bench.dashboard import (
    CHART,
    CHROMIUM,
    CHROMIUM_ARGS,
    DEMO_TARGETS,
    EXCEPTION,
    FORM_TIMEOUT_S,
    HEALTH_TIMEOUT_S,
    HEATMAP,
    MAIN,
    RUN_BUTTON,
    RUN_ID,
    STEP_TIMEOUT_S,
    TARGETS_FIELD,
    VIEWPORT,
    free_port,
    healthy,
    query_params,
    wait_idle,
)

# Our own waits (form 120 s, first heatmap 180 s, the run's end 600 s, each step 60 s) should fail
# first, with their messages.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "tests" / "artifacts"
DRILL_TARGET = "cpu/bfloat16"

RUN_TIMEOUT_S = 180
# the demo's first run runs every check: its last page comes a minute or more after its first heatmap
RUN_END_TIMEOUT_S = 600
QUIET_S = 6.0  # longer than the sidebar's idle poll (dashboard/jobs.py IDLE_POLL_S = 5 s)

# Streamlit gives a widget with key `a.b` the class `st-key-a-b` (more selectors: bench/dashboard.py).
DIFF_CHART = ".st-key-drift-diff"


# --- the server ---------------------------------------------------------------------------------


@dataclass
class Server:
    url: str
    log: Path
    home: Path

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError as e:
            return f"(no server log: {e})"
        return "\n".join(lines[-n:])


def _stop(proc: subprocess.Popen) -> None:
    """Terminate the server's process group (the server and its worker processes)."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`streamlit run dashboard/app.py` on a free port, over a fresh, empty WeightDrift home."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for old in [*ARTIFACTS.glob("[0-9][0-9]-*.png"), ARTIFACTS / "timings.json"]:
        old.unlink(missing_ok=True)  # this test's artifacts of an earlier run
    port = free_port()
    home = tmp_path_factory.mktemp("weightdrift-home")
    env = dict(os.environ)
    env.pop("WEIGHTDRIFT_RUNNER", None)  # real worker processes
    env["WEIGHTDRIFT_HOME"] = str(home)
    env["STREAMLIT_BROWSER_GATHER_USAGE_STATS"] = "false"
    log = ARTIFACTS / "streamlit-server.log"
    cmd = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        "dashboard/app.py",
        "--server.port",
        str(port),
        "--server.headless",
        "true",
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    srv = Server(url=f"http://localhost:{port}", log=log, home=home)
    try:
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while not healthy(srv.url):
            if proc.poll() is not None:
                pytest.fail(f"streamlit exited with {proc.returncode}:\n{srv.log_tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"streamlit not healthy after {HEALTH_TIMEOUT_S} s:\n{srv.log_tail()}")
            time.sleep(0.5)
        yield srv
    finally:
        _stop(proc)


# --- browser helpers ----------------------------------------------------------------------------


def _shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / name))


def _main_text(page) -> str:
    try:
        return page.locator(MAIN).inner_text(timeout=5_000)
    except Exception as e:  # only for failure messages
        return f"(could not read the page: {e})"


def _no_exception(page, where: str) -> None:
    shown = page.locator(EXCEPTION)
    if shown.count():
        pytest.fail(f"{where}: the page shows an exception:\n" + "\n---\n".join(shown.all_inner_texts()))


def _combo(page, key: str):
    """The text input of the selectbox with widget key `key` (dots as in the app, e.g. widget.tensor)."""
    return page.locator(f".st-key-{key.replace('.', '-')} input[role='combobox']")


def _selected(page, key: str) -> str:
    """What a selectbox shows as chosen (its input's value)."""
    return _combo(page, key).input_value()


def _options(page, key: str):
    """Open the selectbox's dropdown; returns its option locator."""
    combo = _combo(page, key)
    listbox = page.locator('[role="listbox"]')
    combo.click()
    if not listbox.is_visible():
        combo.press("ArrowDown")  # the react-aria combobox opens on ArrowDown when a click only focuses it
    listbox.wait_for(state="visible", timeout=10_000)
    return listbox.locator('[role="option"]')


def _choose(page, key: str, *, text: str | None = None, index: int | None = None) -> str:
    """Choose an option (by exact text or position) in a selectbox; returns the chosen option's text."""
    options = _options(page, key)
    if text is not None:
        option = options.filter(has_text=re.compile(f"^{re.escape(text)}$")).first
    else:
        option = options.nth(index or 0)
    label = option.inner_text().strip()
    option.click()
    return label


def _wait_for(predicate, timeout_s: float, what: str, page) -> None:
    """Poll `predicate()` until it is true; fail with the page's text when it never is."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if predicate():
                return
        except Exception:  # elements replaced by a rerun mid-read: just look again
            pass
        if time.monotonic() > deadline:
            pytest.fail(
                f"timed out after {timeout_s} s waiting for {what} at {page.url}; page:\n{_main_text(page)}"
            )
        # Not time.sleep: Playwright's sync API takes in navigations (page.url) only while it runs.
        page.wait_for_timeout(250)


def _settle_url(page, quiet_s: float = QUIET_S, timeout_s: float = STEP_TIMEOUT_S) -> list[str]:
    """Every URL the page shows until it has not changed for `quiet_s` seconds (the last one last)."""
    seen = [page.url]
    quiet_since = deadline = time.monotonic()
    deadline += timeout_s
    while time.monotonic() - quiet_since < quiet_s:
        if time.monotonic() > deadline:
            pytest.fail(f"the URL kept changing for {timeout_s} s: {seen}")
        page.wait_for_timeout(100)
        if page.url != seen[-1]:
            seen.append(page.url)
            quiet_since = time.monotonic()
    return seen


def _svg_texts(page, selector: str) -> list[str]:
    return page.locator(f"{selector} svg text").all_text_contents()


def _failure_shots(browser) -> None:
    """Screenshots of every open page, as they are when the test fails (99-failure-*.png)."""
    pages = [pg for ctx in browser.contexts for pg in ctx.pages]
    for i, pg in enumerate(pages):
        with contextlib.suppress(Exception):
            pg.screenshot(path=str(ARTIFACTS / f"99-failure-{i}.png"))
            print(f"failure screenshot {ARTIFACTS / f'99-failure-{i}.png'} of {pg.url}")


# --- the test -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _browser(server: Server) -> Iterator:
    """Headless Chromium through Playwright; a failure inside leaves screenshots and the server log tail."""
    # CI installs both (README's test command): their absence is a failure, not a silent skip,
    # unless a developer opts out explicitly.
    if os.environ.get("WEIGHTDRIFT_SKIP_BROWSER") == "1":
        pytest.skip("WEIGHTDRIFT_SKIP_BROWSER=1")
    if not Path(CHROMIUM).exists():
        pytest.fail(f"no Chromium at {CHROMIUM}: apt-get install chromium (README's test command does)")
    import playwright.sync_api as playwright_sync

    try:
        with playwright_sync.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                yield browser
            except BaseException:
                _failure_shots(browser)
                raise
            finally:
                browser.close()
    except BaseException:
        print(f"\n--- server log ({server.log}), last lines ---\n{server.log_tail()}")
        raise


def test_first_launch_run_drilldown_and_shared_link(server: Server, capsys: pytest.CaptureFixture) -> None:
    timings: dict[str, float | str] = {}
    try:
        with _browser(server) as browser:
            _scenario(browser, server, timings)
    finally:
        if timings:
            (ARTIFACTS / "timings.json").write_text(json.dumps(timings, indent=2) + "\n")
    with capsys.disabled():
        print(
            f"\ne2e: first launch → run form: {timings['first_launch_to_form_s']:.1f} s · "
            f"click Run → first heatmap: {timings['click_run_to_first_heatmap_s']:.1f} s, "
            f"→ last page: {timings['click_run_to_last_page_s']:.1f} s "
            f"(run {timings['run_id']}, {os.cpu_count()} CPUs); drilled into {timings['drilldown']}"
        )


def _scenario(browser, server: Server, timings: dict) -> None:
    # 1. First launch: the app builds the demo workspace, then the sidebar form appears.
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    t0 = time.monotonic()
    page.goto(f"{server.url}/")
    page.locator(RUN_BUTTON).wait_for(state="visible", timeout=FORM_TIMEOUT_S * 1000)
    timings["first_launch_to_form_s"] = round(time.monotonic() - t0, 2)
    assert (server.home / "demo" / "manifest.json").exists(), "the demo workspace was not built"
    wait_idle(page)
    _no_exception(page, "first launch")
    _shot(page, "01-first-launch.png")

    # 2. The default form is the demo: both demo targets are in the Targets field.
    targets_field = page.locator(TARGETS_FIELD)
    chosen = targets_field.locator('[data-baseweb="tag"]').all_inner_texts()
    shown = targets_field.inner_text() if not chosen else " ".join(chosen)
    for target in DEMO_TARGETS:
        assert target in shown, f"Targets field shows {shown!r}, expected {DEMO_TARGETS}"

    # 3. Run → the Drift page (URL names the new run) shows progress, then the heatmap.
    page.locator(RUN_BUTTON).click()
    t_click = time.monotonic()
    _wait_for(
        lambda: "/drift" in page.url and RUN_ID.match(query_params(page.url).get("run", "")),
        STEP_TIMEOUT_S,
        "Run to switch to the Drift page of the new run",
        page,
    )
    run_id = query_params(page.url)["run"]
    timings["run_id"] = run_id
    heatmap = page.locator(CHART).first
    failed = page.locator(f'{MAIN} [data-testid="stAlertContentError"]')
    with contextlib.suppress(Exception):  # the demo run may be over before progress is caught
        # a task past its first step, so the bars show progress
        page.locator(MAIN).get_by_text(re.compile(r"step [1-9]\d* of [1-9]")).first.wait_for(timeout=20_000)
        if not heatmap.is_visible():
            _shot(page, "02-running.png")
    heatmap.or_(failed).first.wait_for(state="visible", timeout=RUN_TIMEOUT_S * 1000)
    t_heatmap = time.monotonic() - t_click
    if not heatmap.is_visible():
        pytest.fail("the run failed:\n" + "\n".join(failed.all_inner_texts()) + "\n" + _main_text(page))
    timings["click_run_to_first_heatmap_s"] = round(t_heatmap, 2)
    # The default selection runs every check: the heatmap comes while the others still run.
    run_json = server.home / "runs" / run_id / "run.json"
    if json.loads(run_json.read_text()).get("status") == "running":
        _shot(page, "02-first-heatmap-while-running.png")
    _wait_for(
        lambda: json.loads(run_json.read_text()).get("status") not in ("queued", "running"),
        RUN_END_TIMEOUT_S,
        f"run {run_id} to end",
        page,
    )
    timings["click_run_to_last_page_s"] = round(time.monotonic() - t_click, 2)
    status = json.loads(run_json.read_text()).get("status")
    assert status == "succeeded", f"run {run_id} is {status}"

    # The job's end reruns the app (more than once: the page's and the sidebar's progress fragments);
    # through all of that the URL must keep naming this run, or a link copied then opens another one.
    seen = _settle_url(page)
    runs_in_url = {query_params(u).get("run") for u in seen}
    assert runs_in_url == {run_id}, f"after the run ended the URL named other runs: {seen}"
    assert "/drift" in page.url, f"Run should land on the Drift page, got {page.url}"
    wait_idle(page)
    _no_exception(page, "Drift after the run")

    # The heatmap has one panel per target.
    _wait_for(
        lambda: all(t in _svg_texts(page, HEATMAP) for t in DEMO_TARGETS),
        STEP_TIMEOUT_S,
        f"heatmap panels {DEMO_TARGETS}",
        page,
    )
    assert run_id in _selected(page, "widget.run")
    _shot(page, "03-drift.png")

    # Choosing a cell by clicking it: a cell of the first panel (cpu/float32) moves the drill-down there.
    before = query_params(page.url)
    assert before.get("target") == "cpu/bfloat16", before  # the page opens on the worst target
    cell = page.locator(HEATMAP).locator(".scatterlayer .trace .points path").first
    box = cell.bounding_box()
    page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    _wait_for(
        lambda: (
            query_params(page.url).get("target") == DEMO_TARGETS[0]
            and _selected(page, "widget.target") == DEMO_TARGETS[0]
        ),
        STEP_TIMEOUT_S,
        f"a click on a {DEMO_TARGETS[0]} cell to select that target in the URL and the picker",
        page,
    )
    wait_idle(page)

    # 4. Drill into one tensor: the target picker (away from the default and to cpu/bfloat16), then the
    #    second-worst tensor, so neither is just what the page opened on.
    other = next(t for t in DEMO_TARGETS if t != DRILL_TARGET)
    visited = ([other] if _selected(page, "widget.target") == DRILL_TARGET else []) + [DRILL_TARGET]
    for target in visited:
        _choose(page, "widget.target", text=target)
        _wait_for(
            lambda target=target: (
                query_params(page.url).get("target") == target
                and _selected(page, "widget.target") == target
                and target in _selected(page, "widget.tensor") + " ".join(_svg_texts(page, DIFF_CHART))
            ),
            STEP_TIMEOUT_S,
            f"target {target} in the picker, the URL and the diff chart",
            page,
        )
        wait_idle(page)
    default_tensor = query_params(page.url).get("tensor")
    option = _choose(page, "widget.tensor", index=1)
    _wait_for(
        lambda: (
            (tensor := query_params(page.url).get("tensor")) not in (None, default_tensor)
            and tensor in option
        ),
        STEP_TIMEOUT_S,
        f"the URL to name the tensor of option {option!r}",
        page,
    )
    tensor = query_params(page.url)["tensor"]
    _wait_for(
        lambda: any(tensor in t and DRILL_TARGET in t for t in _svg_texts(page, DIFF_CHART)),
        STEP_TIMEOUT_S,
        f"the element-wise diff chart of {tensor} on {DRILL_TARGET}",
        page,
    )
    wait_idle(page)
    _no_exception(page, "Drift drill-down")
    assert tensor in _selected(page, "widget.tensor")
    page.get_by_role("heading", name="Inspect one tensor").evaluate("e => e.scrollIntoView({block: 'start'})")
    _shot(page, "04-drilldown.png")

    timings["drilldown"] = {"targets_chosen": visited, "target": DRILL_TARGET, "tensor": tensor}
    shared = page.url
    query = query_params(shared)
    assert "/drift" in urlsplit(shared).path, shared
    assert query.get("run") == run_id, shared
    assert query.get("target") == DRILL_TARGET, shared
    assert query.get("tensor") == tensor, shared
    context.close()

    # 5. The shared link in a fresh browser context shows the same run, target and tensor.
    colleague = browser.new_context(viewport=VIEWPORT)
    page = colleague.new_page()
    page.goto(shared)
    page.locator(DIFF_CHART).locator(CHART).wait_for(state="visible", timeout=STEP_TIMEOUT_S * 1000)
    wait_idle(page)
    _no_exception(page, "shared link")
    assert run_id in _selected(page, "widget.run"), _selected(page, "widget.run")
    assert _selected(page, "widget.target") == DRILL_TARGET, _selected(page, "widget.target")
    assert tensor in _selected(page, "widget.tensor"), _selected(page, "widget.tensor")
    # Each Plotly chart draws on its own after the page is idle: the heatmap may come after the diff chart.
    page.locator(HEATMAP).locator(CHART).wait_for(state="visible", timeout=STEP_TIMEOUT_S * 1000)
    assert any(tensor in t and DRILL_TARGET in t for t in _svg_texts(page, DIFF_CHART))
    assert query_params(page.url).get("tensor") == tensor, page.url
    page.get_by_role("heading", name="Inspect one tensor").evaluate("e => e.scrollIntoView({block: 'start'})")
    _shot(page, "05-shared-link.png")

    # 6. The other pages of that run.
    page.goto(f"{server.url}/overview?run={run_id}")
    page.get_by_role("heading", name="Overview", exact=True).wait_for(timeout=STEP_TIMEOUT_S * 1000)
    page.locator('[data-testid="stMetricLabel"]').first.wait_for(timeout=STEP_TIMEOUT_S * 1000)
    wait_idle(page)
    _no_exception(page, "Overview")
    text = _main_text(page)
    # the answer first: agreement groups, then no anomaly and bfloat16's drift as one line, no red count
    assert "Which targets agree" in text and "No anomaly" in text, text
    assert "Drift as expected for bfloat16" in text and "rows are beyond tolerance" not in text, text
    labels = [t.strip() for t in page.locator('[data-testid="stMetricLabel"]').all_inner_texts()]
    for label in ("Identical", "Within tolerance", "Drift", "Broken"):
        assert label in labels, labels
    assert run_id in _selected(page, "widget.run")
    _shot(page, "06-overview.png")

    page.goto(f"{server.url}/runs")
    page.get_by_role("heading", name="Runs", exact=True).wait_for(timeout=STEP_TIMEOUT_S * 1000)
    page.locator(f'{MAIN} [data-testid="stDataFrame"]').first.wait_for(timeout=STEP_TIMEOUT_S * 1000)
    wait_idle(page)
    _no_exception(page, "Runs")
    # The history grid draws on a canvas; the caption above it names the newest run.
    assert f"newest {run_id} (succeeded)" in page.locator(MAIN).inner_text()
    _shot(page, "07-runs.png")

    page.goto(f"{server.url}/outputs?run={run_id}")
    page.get_by_role("heading", name="Outputs", exact=True).wait_for(timeout=STEP_TIMEOUT_S * 1000)
    page.locator(f"{MAIN} {CHART}").first.wait_for(timeout=STEP_TIMEOUT_S * 1000)
    wait_idle(page)
    _no_exception(page, "Outputs")
    assert run_id in _selected(page, "widget.run")
    _shot(page, "08-outputs.png")

    # The same first run filled every other result page too (the demo's default selection runs every check).
    for path, heading, shot in DEFAULT_RUN_PAGES:
        page.goto(f"{server.url}/{path}?run={run_id}")
        page.get_by_role("heading", name=heading, exact=True).wait_for(timeout=STEP_TIMEOUT_S * 1000)
        page.locator(f"{MAIN} {CHART}").first.wait_for(timeout=STEP_TIMEOUT_S * 1000)
        wait_idle(page)
        _no_exception(page, heading)
        text = _main_text(page)
        assert "did not run" not in text and "still running" not in text, f"{heading}: {text[:500]}"
        _shot(page, shot)

    # 8. A second run, cancelled from its progress panel: the job ends as cancelled, the page says so.
    page.locator(RUN_BUTTON).click()
    _wait_for(
        lambda: "/drift" in page.url and query_params(page.url).get("run") not in (None, run_id),
        STEP_TIMEOUT_S,
        "a second Run to switch to the Drift page of a new run",
        page,
    )
    second = query_params(page.url)["run"]
    cancel = page.locator(MAIN).get_by_role("button", name="Cancel run")
    cancel.wait_for(state="visible", timeout=STEP_TIMEOUT_S * 1000)
    cancel.click()
    run_json = server.home / "runs" / second / "run.json"
    _wait_for(
        lambda: json.loads(run_json.read_text()).get("status") == "cancelled",
        RUN_TIMEOUT_S,
        f"run {second} to end as cancelled",
        page,
    )
    page.locator(MAIN).get_by_text("was cancelled before it finished").wait_for(timeout=STEP_TIMEOUT_S * 1000)
    _no_exception(page, "cancelled run")
    _shot(page, "09-cancelled.png")
    colleague.close()


# The result pages of the first run besides Drift, Overview and Outputs: (url_path, heading, screenshot).
DEFAULT_RUN_PAGES = (
    ("activations", "Activations", "08a-run-activations.png"),
    ("merge", "Merge residuals", "08b-run-merge.png"),
    ("memory", "Memory placement", "08c-run-memory.png"),
    ("adapters", "Adapter consistency", "08d-run-adapters.png"),
)


# --- the scenario pages (merge residuals, memory placement, adapter consistency) ------------------

# (page url_path, scenario name, heading, text the result must show and the screenshot starts at,
# screenshot): one click on the scenario's button runs it in real worker processes and the page draws
# its result.
SCENARIO_PAGES = (
    ("merge", "bf16-merge-residual", "Merge residuals", "Output residual per stage", "10-merge.png"),
    (
        "memory",
        "memory-placement",
        "Memory placement",
        "Where each parameter and buffer lives",
        "11-memory.png",
    ),
    ("adapters", "loop-pissa-lora", "Adapter consistency", "base mutated by pissa", "12-adapters.png"),
    ("activations", "bf16-activations", "Activations", "parts from the reference at", "13-activations.png"),
    # the generated texts side by side, the first divergence marked (⟦)
    ("outputs", "generation-parts", "Outputs", "Generated text", "14-outputs-generation.png"),
)


def test_scenario_pages(server: Server, capsys: pytest.CaptureFixture) -> None:
    timings: dict[str, float] = {}
    with _browser(server) as browser:
        page = browser.new_context(viewport=VIEWPORT).new_page()
        for path, scenario, heading, expect, shot in SCENARIO_PAGES:
            timings[scenario] = _run_scenario(page, server, path, scenario, heading, expect, shot)
    with capsys.disabled():
        print("\ne2e scenarios, click → result: " + " · ".join(f"{k} {v:.1f} s" for k, v in timings.items()))


def _run_scenario(
    page, server: Server, path: str, scenario: str, heading: str, expect: str, shot: str
) -> float:
    """Open the page, click the scenario's button, wait for its result; the click → result seconds."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

    page.goto(f"{server.url}/{path}")
    page.get_by_role("heading", name=heading, exact=True).wait_for(timeout=FORM_TIMEOUT_S * 1000)
    wait_idle(page)
    button = page.locator(f"{MAIN} .st-key-scenario-{scenario} button").first
    before = query_params(page.url).get("run")
    # The scenarios sit in an expander that may keep the state a page before left it in (folded):
    # open it when the button is hidden, and again if a rerun folds it between the check and the click.
    for attempt in range(3):
        if not button.is_visible():
            page.locator(MAIN).get_by_text("Demo scenarios").first.click()
        button.wait_for(state="visible", timeout=STEP_TIMEOUT_S * 1000)
        try:
            button.click(timeout=5000)
            break
        except PlaywrightTimeoutError:
            if attempt == 2:
                raise
            wait_idle(page)
    t_click = time.monotonic()
    _wait_for(
        lambda: f"/{path}" in page.url and query_params(page.url).get("run") not in (None, before),
        STEP_TIMEOUT_S,
        f"the {scenario} button to open /{path} on a new run",
        page,
    )
    run_id = query_params(page.url)["run"]
    run_json = server.home / "runs" / run_id / "run.json"
    _wait_for(
        lambda: json.loads(run_json.read_text()).get("status") not in ("queued", "running"),
        RUN_TIMEOUT_S,
        f"run {run_id} ({scenario}) to end",
        page,
    )
    status = json.loads(run_json.read_text())
    assert status.get("status") == "succeeded", f"{scenario}: {status.get('error')}"
    page.locator(f"{MAIN} {CHART}").first.wait_for(state="visible", timeout=STEP_TIMEOUT_S * 1000)
    elapsed = time.monotonic() - t_click
    # the page drawn with the run's end: its result text, no rerun in progress (not a quiet period)
    _wait_for(lambda: expect in _main_text(page), STEP_TIMEOUT_S, f"/{path} to show {expect!r}", page)
    wait_idle(page)
    _no_exception(page, f"/{path} after {scenario}")
    assert query_params(page.url).get("run") == run_id, page.url
    page.mouse.move(5, 5)  # no button tooltip over the result
    # Fold the scenario buttons away so the screenshot opens on the result.
    if button.is_visible():
        page.locator(MAIN).get_by_text("Demo scenarios").first.click()
        button.wait_for(state="hidden", timeout=STEP_TIMEOUT_S * 1000)
    page.wait_for_timeout(1000)
    wait_idle(page)
    # the screenshot starts at the text the result must show (the generated texts sit below the charts)
    page.locator(MAIN).get_by_text(expect).first.evaluate("e => e.scrollIntoView({block: 'start'})")
    page.wait_for_timeout(500)
    _shot(page, shot)
    return elapsed


# --- untrusted text (issue 15) -------------------------------------------------------------------

PHISH = (
    "Session expired - [click to sign in again](http://evil.example/login) "
    "![pixel](http://evil.example/pixel.png) :red[ALERT] **bold**"
)


def test_a_crafted_run_url_and_run_folder_show_their_text_literally(server: Server) -> None:
    """A crafted `run` URL parameter and a run folder whose base path and error are Markdown: the page
    shows their characters, draws no link or image from them, and asks nothing of another host."""
    from core.engine.store import Store
    from core.spec import AdapterRef, ModelRef, ProbeSpec, Target

    store = Store(server.home)
    spec = ProbeSpec(
        base=ModelRef(path=PHISH),
        adapters=(AdapterRef(path="/nowhere/lora", name="lora"),),
        targets=(Target.parse("cpu/float32"),),
    )
    record = store.create_run(spec)
    store.update(record.run_id, status="failed", error=PHISH)
    store.release(record.run_id)

    foreign: list[str] = []
    with _browser(server) as browser:
        context = browser.new_context(viewport=VIEWPORT)

        def refuse(route) -> None:
            foreign.append(route.request.url)
            route.abort()

        # every request that is not to this server is recorded and refused
        context.route(re.compile(r"^(?!http://(localhost|127\.0\.0\.1)(:\d+)?/).*"), refuse)
        page = context.new_page()
        for path, query, expected in (
            ("overview", {"run": record.run_id}, (f"Base {PHISH} · adapters lora", f"failed: {PHISH}")),
            ("drift", {"run": PHISH}, (f"Run {PHISH} is not in",)),
        ):
            page.goto(f"{server.url}/{path}?{urlencode(query)}")
            for expect in expected:
                # as it reads: literal() keeps bare URLs from becoming links with an invisible word joiner
                _wait_for(
                    lambda e=expect: e in _main_text(page).replace("\u2060", ""),
                    FORM_TIMEOUT_S,
                    repr(expect),
                    page,
                )
            wait_idle(page)
            _no_exception(page, f"/{path} with crafted text")
            main = page.locator(MAIN)
            assert main.locator('a[href*="evil.example"]').count() == 0
            assert main.locator('img[src*="evil.example"]').count() == 0
            assert main.locator("strong", has_text="bold").count() == 0
            page.wait_for_timeout(500)
            _shot(page, f"3{0 if path == 'overview' else 1}-untrusted-{path}.png")
        context.close()
    assert foreign == []


# --- a real-sized model: the Drift page and its drill-down from sketches ------------------------

LARGE_TARGET = "cpu/bfloat16"


def test_large_model_drift_from_sketches(server: Server, capsys: pytest.CaptureFixture) -> None:
    """A 100M-parameter synthetic Llama (400 MB float32, over the keep-tensors threshold) run by the
    CLI into the server's home: its captures hold sketches, not tensors, and the Drift page draws
    the heatmap and a drill-down from them, saying so."""
    from bench.checkpoints import ensure_checkpoint, spec_for
    from core.engine.store import Store
    from core.spec import KEEP_TENSORS_UP_TO

    started = time.monotonic()
    checkpoint = ensure_checkpoint(spec_for("100m"))  # cached under ~/.cache/weightdrift-bench
    generated_s = time.monotonic() - started
    env = {**os.environ, "WEIGHTDRIFT_HOME": str(server.home)}
    env.pop("WEIGHTDRIFT_RUNNER", None)
    cmd = [sys.executable, "-m", "core", "run", "--base", str(checkpoint.model_dir)]
    cmd += ["--adapter", f"{checkpoint.adapter_dir}=lora", "--target", LARGE_TARGET]
    cmd += ["--check", "weights", "deltas", "--json"]
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S * 2)
    run_s = time.monotonic() - started
    assert done.returncode in (0, 1), done.stderr[-3000:]
    run_id = json.loads(done.stdout)["run_id"]
    record = Store(server.home).open(run_id)
    captures = record.run_dir / "captures" / LARGE_TARGET.replace("/", "_")
    folder_bytes = sum(p.stat().st_size for p in record.run_dir.rglob("*") if p.is_file())
    model_bytes = sum(p.stat().st_size for p in checkpoint.model_dir.glob("*.safetensors"))
    assert model_bytes > KEEP_TENSORS_UP_TO
    # nothing of the model kept: the captured tensors file is (nearly) empty, sketches are small
    assert (captures / "tensors.safetensors").stat().st_size < 1 << 20
    # ~110 sketches of ≤ 256×256 cells: a tenth of this small model (5 % of a 1B one, in the bench)
    assert folder_bytes < 0.10 * model_bytes, (folder_bytes, model_bytes)
    table = record.metrics()
    drifting = table[(table.check == "weights") & (table.verdict != "identical")]
    assert len(drifting) > 50  # every weight rounds to bfloat16
    tensor = "model.layers.3.self_attn.q_proj.weight"
    assert tensor in set(drifting.tensor)

    with _browser(server) as browser:
        page = browser.new_context(viewport=VIEWPORT).new_page()
        page.goto(f"{server.url}/drift?run={run_id}&target={LARGE_TARGET}&check=weights&tensor={tensor}")
        page.locator(HEATMAP).locator(CHART).wait_for(state="visible", timeout=STEP_TIMEOUT_S * 1000)
        page.locator(DIFF_CHART).locator(CHART).wait_for(state="visible", timeout=STEP_TIMEOUT_S * 1000)
        wait_idle(page)
        _no_exception(page, "Drift page of a sketched run")
        titles = " ".join(_svg_texts(page, DIFF_CHART))
        assert "sketch (tensors not kept)" in titles and "block max over" in titles, titles
        assert tensor in _selected(page, "widget.tensor")
        _shot(page, "20-large-model-drift.png")
        page.get_by_role("heading", name="Inspect one tensor").evaluate(
            "e => e.scrollIntoView({block: 'start'})"
        )
        _shot(page, "21-large-model-drilldown.png")
    with capsys.disabled():
        print(
            f"\ne2e: 100M checkpoint ready in {generated_s:.1f} s; `core run` {LARGE_TARGET} weights+deltas "
            f"{run_s:.1f} s; run folder {folder_bytes / 1e6:.1f} MB = {100 * folder_bytes / model_bytes:.2f} % "
            f"of the checkpoint"
        )


# --- snapshots of two machines compared: the Overview of the imported comparison ----------------


def test_an_imported_comparison_shows_its_machines_and_environment_diff(
    server: Server, demo_workspace, tmp_path
) -> None:
    """Two snapshots (made in this process: cheap) compared into the server's home; the Overview
    shows the target × target matrix, where the captures came from, and the environment diff."""
    from core import cli
    from core.engine.snapshot import machine_name
    from core.engine.store import Store

    base = ["--base", demo_workspace["models"]["tiny-llama"], "--check", "weights", "outputs"]
    base += ["--adapter", f"{demo_workspace['adapters']['lora']['path']}=lora", "--in-process"]
    files = []
    for name, target in (("a", "cpu/float32"), ("b", "cpu/float32+threads=1")):
        out = tmp_path / f"{name}.wdsnap"
        home = tmp_path / f"home-{name}"
        # each snapshot holds its one target (b's peer, cpu/float32, is a's)
        snap = ["snapshot", *base, "--target", target, "-o", str(out), "--home", str(home), "--no-peers"]
        assert cli.main(snap) == 0
        files.append(str(out))
    store = Store(server.home)
    before = {r.run_id for r in store.list_runs()}
    assert cli.main(["compare", *files, "--home", str(server.home), "--in-process"]) == 0
    (run_id,) = {r.run_id for r in store.list_runs()} - before
    machine = machine_name()
    with _browser(server) as browser:
        page = browser.new_context(viewport=VIEWPORT).new_page()
        page.goto(f"{server.url}/overview?run={run_id}")
        page.locator(".st-key-overview-pairwise").locator(CHART).wait_for(
            state="visible", timeout=STEP_TIMEOUT_S * 1000
        )
        wait_idle(page)
        _no_exception(page, "Overview of an imported comparison")
        text = _main_text(page)
        assert "Every target against every other" in text and "Imported from snapshots" in text
        assert "setting(s) differ between targets" in text
        labels = " ".join(_svg_texts(page, ".st-key-overview-pairwise"))
        assert f"{machine}/cpu/float32+threads=1" in labels, labels
        page.get_by_role("heading", name="Every target against every other").evaluate(
            "e => e.scrollIntoView({block: 'start'})"
        )
        _shot(page, "40-imported-pairwise.png")
        page.get_by_role("heading", name="Imported from snapshots").evaluate(
            "e => e.scrollIntoView({block: 'start'})"
        )
        page.wait_for_timeout(300)
        _shot(page, "41-imported-environment.png")
