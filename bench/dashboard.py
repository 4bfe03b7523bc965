"""The dashboard's click on Run → first heatmap, and → last page, over several runs.

What a user sees: the real server started as a user starts it (``python -m dashboard``, real
worker processes) over a fresh WeightDrift home, a real headless Chromium through Playwright, the
built-in demo workspace (the app builds it on first launch) and the form's default selection (every
check, the demo's adapters, ``cpu/float32`` + ``cpu/bfloat16``).

Per repetition: ``/`` is opened in a fresh browser context (a new Streamlit session), the app is let
go idle and then left alone for ``settle_s`` seconds (a user who opened the page, then clicked: by
then the server's fork server has imported the libraries, as it has for a user), Run is clicked, and

- ``first_heatmap_s``: click → the Drift page's first heatmap is visible;
- ``last_page_s``: click → the run's ``run.json`` says it ended (its last check compared: every
  result page filled), polled every 0.25 s;
- ``weights_deltas_ready_s``: from the run's start (``run.json["started"]``) to the end of its
  ``compare · weights, deltas`` task (the heatmap's data written): the engine's share of the wait,
  so that the page's share is ``first_heatmap_s`` minus it and the queueing before the start.

Selectors and waits are those of ``tests/test_e2e_browser.py`` (copied: tests/ is not a package).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

REPO_ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1600, "height": 1000}
DEMO_TARGETS = ("cpu/float32", "cpu/bfloat16")

HEALTH_TIMEOUT_S = 60.0
FORM_TIMEOUT_S = 120.0  # first launch builds the demo workspace before the form appears
STEP_TIMEOUT_S = 60.0  # a page load, a rerun, Run → the Drift page's URL
SETTLE_S = 8.0  # idle page → click: the fork server (started with the server) has imported the libraries
STOP_TIMEOUT_S = 20.0  # SIGINT → the server has cancelled its jobs and exited; then SIGKILL
RUN_ID = re.compile(r"^\d{8}-\d{6}-[0-9a-f]{6}$")
NOT_ENDED = ("queued", "running")  # statuses of a run that has not ended

# Streamlit gives a widget with key `a.b` the class `st-key-a-b`.
SIDEBAR = '[data-testid="stSidebar"]'
RUN_BUTTON = f"{SIDEBAR} .st-key-form-run button"
TARGETS_FIELD = f"{SIDEBAR} .st-key-form-targets"
MAIN = '[data-testid="stMain"]'
CHART = '[data-testid="stPlotlyChart"]'
HEATMAP = ".st-key-drift-heatmap"
FIRST_HEATMAP = f"{MAIN} {HEATMAP} {CHART}"
RUN_ERROR = f'{MAIN} [data-testid="stAlertContentError"]'
EXCEPTION = '[data-testid="stException"]'

WEIGHTS_DELTAS = re.compile(r"^compare · .*\bweights\b")  # the heatmap's compare task
SUMMARY_FIELDS = ("first_heatmap_s", "last_page_s", "weights_deltas_ready_s", "run_started_after_click_s")


# --- the server ---------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port free on localhost now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    """Whether the Streamlit server at `url` answers its health check."""
    try:
        with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
            return r.read().decode().strip() == "ok"
    except OSError:
        return False


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as e:
        return f"(no server log: {e})"


def start_server(home: Path, log: Path, port: int | None = None) -> tuple[subprocess.Popen, str]:
    """``python -m dashboard`` on a free port over `home`, as a user starts it; returns once healthy."""
    port = port or free_port()
    env = dict(os.environ)
    env.pop("WEIGHTDRIFT_RUNNER", None)  # real worker processes
    env["WEIGHTDRIFT_HOME"] = str(home)
    env["STREAMLIT_BROWSER_GATHER_USAGE_STATS"] = "false"
    cmd = [sys.executable, "-m", "dashboard", "--server.port", str(port), "--server.headless", "true"]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://localhost:{port}"
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while not healthy(url):
        if proc.poll() is not None:
            raise RuntimeError(f"the dashboard exited with {proc.returncode}:\n{_tail(log)}")
        if time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"the dashboard is not healthy after {HEALTH_TIMEOUT_S:g} s:\n{_tail(log)}")
        time.sleep(0.5)
    return proc, url


def stop_server(proc: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S) -> dict[str, Any]:
    """SIGINT (Ctrl-C: the server cancels its jobs and kills its workers), SIGKILL to its process
    group after `timeout_s`. Says how it went, and whether any process of the group outlived it."""
    how: dict[str, Any] = {"returncode": proc.poll(), "killed": False, "leftover_processes": 0}
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            how["killed"] = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        how["returncode"] = proc.returncode
    # Workers are in the server's process group (start_new_session): none should be left.
    leftovers = _group_members(proc.pid)
    if leftovers:
        how["leftover_processes"] = len(leftovers)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return how


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def log_problems(log: Path, limit: int = 20) -> list[str]:
    """Lines of the server log that name an error or a traceback (the first `limit`)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    hits = [ln for ln in lines if re.search(r"Traceback|Error|Exception|CRITICAL", ln)]
    return hits[:limit]


# --- the browser --------------------------------------------------------------------------------


def query_params(url: str) -> dict[str, str]:
    """The query parameters of `url`, one value each."""
    return {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}


def wait_idle(page, timeout_s: float = STEP_TIMEOUT_S) -> None:
    """Wait until Streamlit shows no rerun in progress (the status widget) and no stale elements."""
    page.wait_for_function(
        """() => !document.querySelector('[data-testid="stStatusWidget"]')
                 && !document.querySelector('[data-stale="true"]')""",
        polling=100,  # not every animation frame (the default), which keeps the renderer drawing
        timeout=timeout_s * 1000,
    )


def _poll(page, predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.25) -> None:
    """Poll `predicate()` until true; TimeoutError naming `what` when it never is."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if predicate():
                return
        except (OSError, ValueError):  # run.json being replaced, or not there yet: look again
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what} at {page.url}")
        # Not time.sleep: Playwright's sync API takes in navigations (page.url) only while it runs.
        page.wait_for_timeout(interval_s * 1000)


def _read_run(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _main_text(page, limit: int = 1500) -> str:
    try:
        return page.locator(MAIN).inner_text(timeout=5_000)[:limit]
    except Exception as e:  # only for failure messages
        return f"(could not read the page: {e})"


def engine_timeline(info: dict[str, Any]) -> dict[str, Any]:
    """From a run.json: each task's end relative to the run's start, and the heatmap's compare task's."""
    started = info.get("started")
    tasks: dict[str, float] = {}
    ready = None
    if isinstance(started, (int, float)):
        for label, t in (info.get("targets") or {}).items():
            if isinstance(t, dict) and isinstance(t.get("finished"), (int, float)):
                tasks[label] = round(t["finished"] - started, 3)
        matches = [v for k, v in tasks.items() if WEIGHTS_DELTAS.match(k)]
        ready = min(matches) if matches else None
    return {
        "weights_deltas_ready_s": ready,
        "task_finished_s": dict(sorted(tasks.items(), key=lambda kv: kv[1])),
    }


def _one_run(browser, url: str, home: Path, index: int, timeout_s: float, settle_s: float) -> dict[str, Any]:
    """One repetition: fresh page, idle, `settle_s` of nothing, click Run, time the heatmap and the end."""
    rec: dict[str, Any] = {"index": index, "ok": False, "status": None, "error": None}
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    try:
        page.goto(f"{url}/")
        page.locator(RUN_BUTTON).wait_for(state="visible", timeout=FORM_TIMEOUT_S * 1000)
        wait_idle(page)
        field = page.locator(TARGETS_FIELD)
        chosen = field.locator('[data-baseweb="tag"]').all_inner_texts() or [field.inner_text()]
        rec["form_targets"] = [t for t in DEMO_TARGETS if any(t in c for c in chosen)]
        page.wait_for_timeout(settle_s * 1000)
        wait_idle(page)
        rec["load_average_at_click"] = list(os.getloadavg())
        page.locator(RUN_BUTTON).click()
        t_click, click_epoch = time.monotonic(), time.time()
        _poll(
            page,
            lambda: "/drift" in page.url and bool(RUN_ID.match(query_params(page.url).get("run", ""))),
            STEP_TIMEOUT_S,
            "Run to switch to the Drift page of the new run",
        )
        rec["url_switch_s"] = round(time.monotonic() - t_click, 3)
        run_id = rec["run_id"] = query_params(page.url)["run"]
        run_json = home / "runs" / run_id / "run.json"
        heatmap, failed = page.locator(FIRST_HEATMAP).first, page.locator(RUN_ERROR).first
        heatmap.or_(failed).first.wait_for(state="visible", timeout=timeout_s * 1000)
        t_heatmap = time.monotonic() - t_click
        if heatmap.is_visible():
            rec["first_heatmap_s"] = round(t_heatmap, 3)
            with contextlib.suppress(OSError, ValueError):
                rec["status_at_first_heatmap"] = _read_run(run_json).get("status")
        else:
            rec["error"] = "the page shows an error instead of the heatmap: " + " / ".join(
                failed.all_inner_texts()
            )
        _poll(
            page,
            lambda: _read_run(run_json).get("status") not in NOT_ENDED,
            timeout_s,
            f"run {run_id} to end",
        )
        rec["last_page_s"] = round(time.monotonic() - t_click, 3)
        info = _read_run(run_json)
        rec["status"] = info.get("status")
        rec["run_duration_s"] = info.get("duration_s")
        if isinstance(info.get("started"), (int, float)):
            rec["run_started_after_click_s"] = round(info["started"] - click_epoch, 3)
        rec.update(engine_timeline(info))
        if rec["status"] != "succeeded":
            rec["error"] = rec["error"] or f"run {run_id} ended {rec['status']}: {info.get('error')}"
        if page.locator(EXCEPTION).count():
            shown = " / ".join(page.locator(EXCEPTION).all_inner_texts())[:1000]
            rec["error"] = rec["error"] or f"the page shows an exception: {shown}"
        rec["ok"] = rec["error"] is None and "first_heatmap_s" in rec
    except Exception as e:  # a repetition that fails is recorded; the next one still runs
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        rec["page_text"] = _main_text(page)
    finally:
        with contextlib.suppress(Exception):
            context.close()
    # A run left going (a timeout) would slow the next repetition: wait for it, within reason.
    run_json = home / "runs" / str(rec.get("run_id")) / "run.json"
    deadline = time.monotonic() + timeout_s
    while rec.get("run_id") and time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            if _read_run(run_json).get("status") not in NOT_ENDED:
                break
        time.sleep(0.5)
    if rec.get("run_id") and rec["status"] is None:  # timed out: what the run did after all
        with contextlib.suppress(OSError, ValueError):
            info = _read_run(run_json)
            rec["status_after_timeout"] = info.get("status")
            rec["run_duration_s"] = info.get("duration_s")
            rec.update(engine_timeline(info))
    return rec


# --- the summary --------------------------------------------------------------------------------


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median, min and max of each timing over the repetitions that succeeded (`ok`)."""
    ok = [r for r in runs if r.get("ok")]
    out: dict[str, Any] = {"runs": len(runs), "succeeded": len(ok), "failed": len(runs) - len(ok)}
    for name in SUMMARY_FIELDS:
        values = [r[name] for r in ok if isinstance(r.get(name), (int, float))]
        out[name] = (
            {
                "median": round(statistics.median(values), 3),
                "min": round(min(values), 3),
                "max": round(max(values), 3),
                "n": len(values),
            }
            if values
            else None
        )
    return out


def _s(v: Any, digits: int = 1) -> str:
    return "–" if not isinstance(v, (int, float)) else f"{v:.{digits}f}"


def dashboard_table(result: dict[str, Any]) -> str:
    """Markdown: one row per repetition, then the medians (over the repetitions that succeeded)."""
    lines = [
        "| run | first heatmap s | last page s | weights+deltas compared at s | status |",
        "|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        status = r.get("status") or (
            f"{r['status_after_timeout']} after the timeout" if r.get("status_after_timeout") else "–"
        )
        if r.get("error"):
            status += f" ✗ {r['error'][:120]}"
        elif r.get("status_at_first_heatmap") not in (None, "running"):
            status += f" (heatmap shown after the run {r['status_at_first_heatmap']})"
        lines.append(
            f"| {r['index']}{' `' + r['run_id'] + '`' if r.get('run_id') else ''} | "
            f"{_s(r.get('first_heatmap_s'))} | {_s(r.get('last_page_s'))} | "
            f"{_s(r.get('weights_deltas_ready_s'))} | {status} |"
        )
    s = result["summary"]

    def med(name: str) -> str:
        v = s.get(name)
        return "–" if not v else f"**{v['median']:.1f}** ({v['min']:.1f}–{v['max']:.1f})"

    lines.append(
        f"| median (min–max) of {s['succeeded']} | {med('first_heatmap_s')} | {med('last_page_s')} | "
        f"{med('weights_deltas_ready_s')} | {s['succeeded']}/{s['runs']} succeeded |"
    )
    return "\n".join(lines)


def dashboard_notes(result: dict[str, Any]) -> str:
    """What the table's numbers mean, and how the machine was, in a few lines."""
    m = result["machine"]
    before, after = m["load_average_before"], m["load_average_after"]
    notes = [
        f"- each repetition: `/` opened in a fresh browser context, the app idle, then {result['settle_s']:g} s "
        "untouched before the click (a user who opened the page, then clicked: the server's fork "
        "server has imported the libraries by then); `last page` = the run's `run.json` ended "
        "(every result page filled); `weights+deltas compared at` = the end of the "
        "`compare · weights, deltas` task from the run's start (the engine's share of the heatmap's wait)",
        f"- first launch on an empty home (the app builds the demo) → Run button: {_s(result.get('first_launch_s'))} s",
        f"- {m['cpu_count']} CPUs; load average before {before[0]:.2f} / {before[1]:.2f} / {before[2]:.2f}, "
        f"after {after[0]:.2f} / {after[1]:.2f} / {after[2]:.2f}",
    ]
    if result.get("server_log_problems"):
        notes.append(
            f"- the server log has {len(result['server_log_problems'])} error line(s), the first: "
            f"`{result['server_log_problems'][0][:200]}`"
        )
    stop = result.get("server_stop") or {}
    if stop.get("killed") or stop.get("leftover_processes"):
        notes.append(f"- server stop: {stop}")
    return "\n".join(notes)


# --- the measurement ----------------------------------------------------------------------------


def measure_dashboard(
    runs: int,
    home: Path | None = None,
    timeout_s: float = 600.0,
    *,
    settle_s: float = SETTLE_S,
    keep_home: bool = False,
    say: Callable[[str], None] = lambda message: None,
) -> dict[str, Any]:
    """Start the dashboard over `home` (default: a fresh temporary folder, removed afterwards unless
    `keep_home`), open it in headless Chromium, then `runs` times: click Run on the default demo
    form and time the first heatmap and the run's end. `timeout_s` bounds each wait for a run."""
    if not Path(CHROMIUM).exists():
        raise RuntimeError(f"no Chromium at {CHROMIUM}: apt-get install chromium")
    import playwright.sync_api as playwright_sync

    own_home = home is None
    home = Path(tempfile.mkdtemp(prefix="weightdrift-bench-dash-")) if home is None else Path(home)
    home.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="weightdrift-bench-dash-log-"))
    log = log_dir / "streamlit-server.log"
    result: dict[str, Any] = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "home": str(home),
        "fresh_home": own_home,
        "settle_s": settle_s,
        "timeout_s": timeout_s,
        "server_command": "python -m dashboard --server.port PORT --server.headless true",
        "machine": {"cpu_count": os.cpu_count(), "load_average_before": list(os.getloadavg())},
        "runs": [],
    }
    say(f"dashboard: starting `python -m dashboard` over {home}")
    t0 = time.monotonic()
    proc, url = start_server(home, log)
    result["server_healthy_s"] = round(time.monotonic() - t0, 3)
    try:
        with playwright_sync.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                context = browser.new_context(viewport=VIEWPORT)
                page = context.new_page()
                t0 = time.monotonic()
                page.goto(f"{url}/")
                page.locator(RUN_BUTTON).wait_for(state="visible", timeout=FORM_TIMEOUT_S * 1000)
                result["first_launch_s"] = round(time.monotonic() - t0, 3)
                result["demo_built"] = (home / "demo" / "manifest.json").exists()
                context.close()
                say(f"dashboard: first launch → Run button {result['first_launch_s']:.1f} s")
                for i in range(1, runs + 1):
                    if proc.poll() is not None:
                        result["runs"].append(
                            {"index": i, "ok": False, "error": f"the server exited with {proc.returncode}"}
                        )
                        break
                    rec = _one_run(browser, url, home, i, timeout_s, settle_s)
                    result["runs"].append(rec)
                    say(
                        f"dashboard: run {i}/{runs} {rec.get('run_id', '?')}: first heatmap "
                        f"{_s(rec.get('first_heatmap_s'))} s, last page {_s(rec.get('last_page_s'))} s, "
                        f"{rec.get('status')}{' — ' + rec['error'] if rec.get('error') else ''}"
                    )
            finally:
                browser.close()
    except Exception as e:  # the first launch or the browser failed: say so, keep what was measured
        result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        say(f"dashboard: {result['error']}")
    finally:
        result["server_stop"] = stop_server(proc)
        result["machine"]["load_average_after"] = list(os.getloadavg())
        result["server_log_problems"] = log_problems(log)
        result["server_log_tail"] = _tail(log, 30)
        shutil.rmtree(log_dir, ignore_errors=True)
        if own_home and not keep_home:
            shutil.rmtree(home, ignore_errors=True)
    result["summary"] = summarize(result["runs"])
    return result
