"""The dashboard's shared objects and its URL-backed view state.

One Engine per server process (so every browser tab sees the same jobs), obtained only through
`engine()`. The view — run, target, metric, tensor, … — lives in `st.query_params`, so a link
reproduces what is on screen; session state mirrors it so that a page switch, which starts a page
with a clean URL, keeps the selection.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st

from core.engine.jobs import Engine
from core.engine.runners import FRESH_SPARES, InProcessRunner, ProcessRunner, Runner
from core.engine.store import ACTIVE_STATES, RunRecord, Store, StoreError, table_problem
from core.engine.store import metrics_table as rows_table
from core.spec import ProbeSpec, SpecError, weightdrift_home
from dashboard import pages
from dashboard.text import literal

# Query parameters that make up a view; anything else in the URL is left alone.
VIEW_KEYS = ("run", "check", "adapter", "target", "metric", "stage", "tensor", "drift")
RUNNER_ENV = "WEIGHTDRIFT_RUNNER"  # "in-process" for tests only: the server itself runs the work


def home() -> Path:
    """The WeightDrift home this server works in ($WEIGHTDRIFT_HOME or ~/.cache/weightdrift)."""
    return weightdrift_home()


@st.cache_resource(show_spinner=False)
def _engine(home_dir: str, runner: str) -> Engine:
    in_process = runner == "in-process"
    # the fork server imports the libraries once, with the server: every Run's tasks start warm
    made = Engine(
        Path(home_dir),
        runner=InProcessRunner() if in_process else ProcessRunner(),
        warm=True,
        fresh=0 if in_process else FRESH_SPARES,
    )
    # When the server stops (Ctrl-C, SIGTERM, and SIGHUP under `python -m dashboard`), its jobs are
    # cancelled and marked so, and no worker outlives it.
    atexit.register(made.shutdown, "cancelled: the dashboard server stopped")
    return made


@st.cache_resource(show_spinner=False)
def ray_runner(address: str) -> Runner:
    """The server's one Ray runner for `address` ('' starts a local Ray), shared by every session:
    a job the run form sends to Ray runs its tasks there (core.engine.ray_runner); Ray is imported only now."""
    from core.engine.ray_runner import RayRunner, import_ray

    import_ray()  # RayUnavailable (how to install it) before anything is cached
    runner = RayRunner(address=address or None)
    atexit.register(runner.kill_all)  # no Ray task of this server outlives it
    return runner


def engine() -> Engine:
    """The server's one Engine for the current home (shared by every session and tab)."""
    return _engine(str(home()), os.environ.get(RUNNER_ENV, "process"))


def store() -> Store:
    """The store of the engine (the runs on disk)."""
    return engine().store


@st.cache_data(show_spinner=False, max_entries=32)
def _table(path: str, mtime: float) -> pd.DataFrame:
    return pd.read_parquet(path)


@st.cache_data(show_spinner=False, max_entries=8)
def _rows_so_far(paths: tuple[str, ...], mtimes: tuple[float, ...]) -> pd.DataFrame:
    return rows_table([pd.read_parquet(p) for p in paths])


def run_table(record: RunRecord, name: str) -> pd.DataFrame:
    """A table of the run (`metrics`, or a check's own such as `memory_timeline`), cached while its
    file is unchanged; empty when the run has none. While the run goes on: what is in so far (the
    metrics of the checks compared, `RunRecord.compared`, and their own tables)."""
    path = record.run_dir / f"{name}.parquet"
    running = record.status in ACTIVE_STATES
    if name == "metrics" and running and not path.exists():
        files = record.partial_tables()
        try:
            mtimes = tuple(f.stat().st_mtime for f in files)
        except OSError:  # the run ended between the two reads: its metrics.parquet is there now
            return run_table(store().open(record.run_id), name)
        return _rows_so_far(tuple(map(str, files)), mtimes) if files else pd.DataFrame()
    if (record.status != "succeeded" and not running) or not path.exists():
        return pd.DataFrame()
    problem = table_problem(path)  # metrics.parquet is checked when the run is read; a check's own here
    if problem is not None:
        st.error(f"Run {literal(record.run_id)}: {literal(problem)}. Run it again to get this table back.")
        return pd.DataFrame()
    return _table(str(path), path.stat().st_mtime)


def metrics_table(record: RunRecord) -> pd.DataFrame:
    """The run's metrics table (see `run_table`)."""
    return run_table(record, "metrics")


# --- view state ---------------------------------------------------------------------------------


def _skey(name: str) -> str:
    return f"view.{name}"


def sync_view_with_url() -> None:
    """Take the view from the URL where it has it; put the session's view back where it does not.

    Called once per rerun before the page runs: a shared link wins, and after a page switch (which
    starts with an empty query string) the selection carries over.
    """
    for name in VIEW_KEYS:
        if name in st.query_params:
            st.session_state[_skey(name)] = st.query_params[name]
        elif st.session_state.get(_skey(name)) is not None:
            st.query_params[name] = st.session_state[_skey(name)]


def view(name: str) -> str | None:
    """The current value of a view parameter (None when unset)."""
    value = st.session_state.get(_skey(name))
    return value if value not in ("", None) else None


def set_view(name: str, value: Any) -> None:
    """Change a view parameter in the session and in the URL (None removes it)."""
    if value in ("", None):
        st.session_state[_skey(name)] = None
        if name in st.query_params:
            del st.query_params[name]
        return
    st.session_state[_skey(name)] = str(value)
    st.query_params[name] = str(value)


def view_query() -> dict[str, str]:
    """The view as query parameters, for links to other pages."""
    return {name: v for name in VIEW_KEYS if (v := view(name)) is not None}


def bound_select(
    label: str,
    name: str,
    options: Sequence[Any],
    default: Any = None,
    *,
    format_func: Callable[[Any], str] = str,
    container: Any = None,
    help: str | None = None,
    horizontal: bool = False,
) -> Any:
    """A selectbox (or segmented control when `horizontal`) whose value is the view parameter `name`.

    The URL's value is used when it is one of the options; otherwise `default` (or the first
    option). The chosen value is written back to the URL.
    """
    container = container or st
    options = list(options)
    if not options:
        return None
    as_text = {str(o): o for o in options}
    current = as_text.get(view(name) or "", default if default in options else options[0])
    set_view(name, current)
    key = f"widget.{name}"
    st.session_state[key] = current

    def changed() -> None:
        # Streamlit can hand back a stale option label (e.g. a run's label from before its status
        # changed) when it no longer names an option: never write that into the URL.
        if str(st.session_state[key]) in as_text:
            set_view(name, st.session_state[key])

    if horizontal:
        value = container.segmented_control(
            label, options, key=key, format_func=format_func, on_change=changed, help=help, required=True
        )
    else:
        value = container.selectbox(
            label, options, key=key, format_func=format_func, on_change=changed, help=help
        )
    return value


# --- runs ---------------------------------------------------------------------------------------


def run_label(record: RunRecord) -> str:
    """One line naming a run: id, status, targets, adapters."""
    spec = record.spec
    targets = ", ".join(t.label for t in spec.targets) if spec else "?"
    adapters = f"{len(spec.adapters)} adapter(s)" if spec else ""
    return f"{record.run_id} · {record.status} · {targets} · {adapters}"


def open_run(name: str = "run", *, container: Any = None, check: str | None = None) -> RunRecord | None:
    """The run picker: the URL's run, else the newest finished run (that ran `check`, when given and
    there is one); None when the store has no runs."""
    records = store().list_runs()
    if not records:
        return None
    by_id = {r.run_id: r for r in records}
    wanted = view(name)
    if wanted is not None and wanted not in by_id:
        st.warning(
            f"Run {literal(wanted)} is not in {literal(store().runs_dir)} (deleted, or made with another home)."
        )
    done = [r for r in records if r.status == "succeeded"]
    with_check = [r for r in done if check is not None and r.spec is not None and check in r.spec.checks]
    newest_done = (with_check or done or records)[0].run_id
    run_id = bound_select(
        "Run",
        name,
        list(by_id),
        default=newest_done,
        format_func=lambda rid: run_label(by_id[rid]),
        container=container,
        help="Runs of this WeightDrift home, newest first; runs made with the CLI appear here too.",
    )
    return store().open(run_id)


def start_run(spec: ProbeSpec, page: str, runner: Runner | None = None) -> None:
    """Submit `spec` and open `views/<page>.py` on the new run (its progress, then its result).

    `runner`: what runs its tasks, when not the engine's worker processes (the form's Ray choice).
    A spec the engine refuses is shown as an error where the caller drew its widgets.
    """
    try:
        job = engine().submit(spec, runner=runner)
    except (SpecError, StoreError) as e:  # a refused spec; a home that is full or read-only
        st.error(literal(e), icon=":material/error:")
        return
    for name in VIEW_KEYS:
        set_view(name, None)
    set_view("run", job.run_id)
    st.switch_page(pages.page(page).script, query_params={"run": job.run_id})


def start_comparison(paths: Sequence[Path], uploads: Sequence[tuple[str, bytes]] = ()) -> None:
    """Compare snapshot files (paths here, and uploaded files, kept under `<home>/snapshots/`) as a
    new run (`core.engine.snapshot`) and open its Overview.

    A file that is damaged, of another base or not a snapshot, or an upload that cannot be kept, is
    shown as an error where the caller drew its widgets; nothing stored is touched, and the uploads
    kept for it are removed.
    """
    from core.engine.snapshot import comparison, read_snapshot

    saved: list[Path] = []
    try:
        for name, data in uploads:
            saved.append(save_upload(name, data))
        spec, install = comparison([read_snapshot(p) for p in [*paths, *saved]], home=home())
        job = engine().submit(spec, install=install)
    except (SpecError, StoreError, OSError) as e:
        for path in saved:
            path.unlink(missing_ok=True)
        st.error(literal(e), icon=":material/error:")
        return
    for name in VIEW_KEYS:
        set_view(name, None)
    set_view("run", job.run_id)
    st.switch_page(pages.OVERVIEW.script, query_params={"run": job.run_id})


def save_upload(name: str, data: bytes) -> Path:
    """Keep an uploaded snapshot under `<home>/snapshots/` (a fresh name: uploads never overwrite)."""
    import secrets

    from core.engine.store import atomic_write_bytes

    safe = "".join(c if c.isascii() and (c.isalnum() or c in "-_.") else "_" for c in Path(name).name)
    path = home() / "snapshots" / f"{secrets.token_hex(3)}-{safe.lstrip('.') or 'snapshot'}"
    atomic_write_bytes(path, data)
    return path
