"""Job progress: polled by fragments, drawn from the engine's thread-safe snapshots.

Worker threads never touch Streamlit: they update the Job; these fragments read `Job.snapshot()`
on the script thread every second while something runs, and at once when the job stores rows
(`wake_on_rows`), and rerun the whole app once a job ends
so the pages show its results.
"""

from __future__ import annotations

import time

import streamlit as st

from core.engine.jobs import Job
from dashboard.state import engine
from dashboard.text import literal, trusted

POLL_S = 1.0
IDLE_POLL_S = 5.0
STATE_ICON = {
    "queued": ":material/schedule:",
    "running": ":material/progress_activity:",
    "succeeded": ":material/check_circle:",
    "failed": ":material/error:",
    "cancelled": ":material/cancel:",
}


def active_jobs() -> list[Job]:
    """Jobs of this server that are queued or running, newest first."""
    return [j for j in engine().jobs() if j.snapshot()["state"] in ("queued", "running")]


def _rerun_when_finished(run_ids: list[str]) -> None:
    """Rerun the app (once) when a job this session watched has ended."""
    watched = st.session_state.setdefault("jobs.watched", set())
    ended = [rid for rid in watched if (job := engine().job(rid)) and job.done_event.is_set()]
    watched.update(run_ids)
    if ended:
        watched.difference_update(ended)
        st.rerun(scope="app")


def wake_on_rows(job: Job) -> None:
    """Have `job` rerun this browser session's script as soon as more of its rows are stored (and when
    it ends), instead of at the page's next look, up to POLL_S later: the first heatmap after a click
    waited half a second for it on average. The rerun is requested as Streamlit's run-on-save does from
    its file watcher's thread (`AppSession.request_rerun` with the session's last client state: the
    progress fragment's, which then reruns the app as on a look). That is Streamlit's internal API, of
    the pinned streamlit==1.67.0: where it is missing (AppTest has no runtime), the looks alone redraw."""
    woken = st.session_state.setdefault("jobs.woken", set())
    if job.run_id in woken:
        return
    try:
        from streamlit.runtime import Runtime
        from streamlit.runtime.scriptrunner import get_script_run_ctx

        session_id = get_script_run_ctx().session_id
        sessions = Runtime.instance()._session_mgr
    except Exception:
        return

    def wake() -> None:
        info = sessions.get_active_session_info(session_id)
        if info is not None:  # the tab was closed: nothing to redraw
            info.session.request_rerun(info.session._client_state)

    job.on_rows(wake)
    woken.add(job.run_id)


def draw_progress(job: Job, *, compact: bool = False) -> None:
    """Per task: state, stage, step k of n and elapsed time; the job's error if it failed."""
    snap = job.snapshot()
    elapsed = (snap["finished"] or time.time()) - (snap["started"] or snap["created"])
    if not compact:
        st.markdown(f"**Run {literal(snap['run_id'])}** — {literal(snap['state'])} · {elapsed:.1f} s")
    for name, task in snap["tasks"].items():
        frac = task["step"] / task["of"] if task["of"] else (1.0 if task["state"] == "succeeded" else 0.0)
        took = f"{task['elapsed_s']:.1f} s" if task["elapsed_s"] is not None else "waiting"
        stage = task["stage"] or task["state"]
        steps = f" · step {task['step']} of {task['of']}" if task["of"] else ""
        st.progress(
            min(max(frac, 0.0), 1.0),
            text=trusted(STATE_ICON.get(task["state"], ""))
            + " "
            + literal(f"{name} · {stage}{steps} · {took}"),
        )
    if snap["state"] == "failed" and snap["error"]:
        st.error(f"Run failed: {literal(snap['error'])}")


def job_panel(run_id: str, *, folded: bool = False) -> None:
    """The selected run's live progress with a cancel button (polls while the job is active);
    `folded`: the progress bars in a closed expander (the page shows results above them already)."""
    job = engine().job(run_id)
    if job is None:
        stored_progress(run_id)
        return
    active = job.snapshot()["state"] in ("queued", "running")

    seen = len(job.snapshot()["compared"])  # the checks the page was drawn with

    if active:
        wake_on_rows(job)

    @st.fragment(run_every=POLL_S if active else None)
    def panel() -> None:
        if folded:
            with st.expander("Progress of every task"):
                draw_progress(job)
        else:
            draw_progress(job)
        snap = job.snapshot()
        running = snap["state"] in ("queued", "running")
        if running and len(snap["compared"]) > seen:
            st.rerun(scope="app")  # another check's rows are in: the page shows them
        if running and st.button("Cancel run", key=f"cancel.{run_id}", icon=":material/stop_circle:"):
            job.cancel()
            st.toast(f"Cancelling {literal(run_id)}: workers stop at their next stage.")
        _rerun_when_finished([run_id] if active else [])

    panel()


def sidebar_jobs() -> None:
    """A compact list of running jobs in the sidebar (any tab's jobs: one engine per server)."""
    jobs = active_jobs()

    # Idle tabs still look every few seconds, so a job started in another tab shows up here.
    @st.fragment(run_every=POLL_S if jobs else IDLE_POLL_S)
    def panel() -> None:
        running = active_jobs()
        for job in running:
            st.caption(f"Running {literal(job.run_id)}")
            draw_progress(job, compact=True)
        _rerun_when_finished([j.run_id for j in running])

    panel()


def stored_progress(run_id: str) -> None:
    """Progress of a run another process owns (e.g. the CLI), read from its run.json every second."""
    from dashboard.state import store

    seen = len(store().open(run_id).compared())

    @st.fragment(run_every=POLL_S)
    def panel() -> None:
        record = store().open(run_id)
        if record.status not in ("queued", "running") or len(record.compared()) > seen:
            st.rerun(scope="app")
        owner = record.info.get("owner") or {}
        st.info(
            f"Run {literal(run_id)} is running in another process "
            f"(pid {literal(owner.get('pid'))} on {literal(owner.get('host'))})."
        )
        for name, task in (record.info.get("targets") or {}).items():
            frac = (task.get("step") or 0) / task["of"] if task.get("of") else 0.0
            state = task.get("state") or "queued"
            line = f"{name} · {task.get('stage') or state} · step {task.get('step') or 0} of {task.get('of') or 0}"
            st.progress(
                min(max(frac, 0.0), 1.0), text=trusted(STATE_ICON.get(state, "")) + " " + literal(line)
            )

    panel()
