"""Small pieces every page uses: downloads for tables and figures, and how a run is introduced."""

from __future__ import annotations

import re
from dataclasses import replace

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from core.engine.store import DAMAGED, RunRecord
from core.spec import SpecError
from dashboard.figures.common import figure_html
from dashboard.jobs import job_panel
from dashboard.report import tensor_figures
from dashboard.state import engine, home, open_run, set_view, start_run, store
from dashboard.text import inert, literal, spreadsheet_safe, trusted

# How the metric columns read in every table: exponent form, so 1e-7 and 1e-3 are told apart.
METRIC_COLUMN_CONFIG = {
    "max_abs": st.column_config.NumberColumn(format="%.4e"),
    "rel_l2": st.column_config.NumberColumn(format="%.4e"),
    "max_ulp": st.column_config.NumberColumn(format="%.4g"),
    "scale_ulp": st.column_config.NumberColumn(format="%.3g"),
    "min_atol": st.column_config.NumberColumn(format="%.4e"),
}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")


def csv_download(table: pd.DataFrame, name: str, *, key: str) -> None:
    """A button that downloads `table` as CSV (`name`.csv), formulas neutralised."""
    st.download_button(
        "Download CSV",
        data=spreadsheet_safe(table).to_csv(index=False).encode(),
        file_name=f"{_slug(name)}.csv",
        mime="text/csv",
        key=key,
        icon=":material/download:",
        on_click="ignore",
    )


def figure_download(fig: go.Figure, name: str, *, key: str) -> None:
    """A button that downloads `fig` as one self-contained HTML file (made only when clicked)."""
    st.download_button(
        "Download figure (HTML)",
        data=lambda: figure_html(inert(fig)),
        file_name=f"{_slug(name)}.html",
        mime="text/html",
        key=key,
        icon=":material/download:",
        on_click="ignore",
    )


def downloads(fig: go.Figure, table: pd.DataFrame, name: str, *, key: str) -> None:
    """The figure (HTML) and the table behind it (CSV), side by side."""
    left, right = st.columns(2)
    with left:
        figure_download(fig, name, key=f"{key}.html")
    with right:
        csv_download(table, name, key=f"{key}.csv")


def run_header(record: RunRecord) -> bool:
    """What the run is and its state; True when it has results to show.

    A running run shows live progress (with cancel), a failed one its reason.
    """
    spec = record.spec
    if spec is not None:
        adapters = ", ".join(a.name for a in spec.adapters) or "none (base model only)"
        targets = ", ".join(t.label for t in spec.targets)
        st.caption(
            f"Base {literal(spec.base.path)} · adapters {literal(adapters)} · targets {literal(targets)} · "
            f"checks {literal(', '.join(spec.checks))}"
        )
    if record.id_note is not None:  # a copied or renamed folder: it is this folder's run all the same
        st.caption(f"Run {literal(record.run_id)}: {literal(record.id_note)}")
    if record.status in ("queued", "running"):
        compared = record.compared()
        if not compared:
            job_panel(record.run_id)
            return False
        # Rows of some checks are in: the page shows them, and the progress folds away above them.
        waiting = [c for c in (spec.checks if spec is not None else ()) if c not in compared]
        st.info(
            f"Run {literal(record.run_id)} is still running. In so far: {literal(', '.join(compared))}"
            + (f"; still to come: {literal(', '.join(waiting))}" if waiting else "")
            + ". Pages fill in as their checks finish.",
            icon=":material/progress_activity:",
        )
        job_panel(record.run_id, folded=True)
        return True
    if record.status == "failed":
        st.error(f"Run {literal(record.run_id)} failed: {literal(record.error)}", icon=":material/error:")
        return False
    if record.status == DAMAGED:
        st.error(
            f"Run {literal(record.run_id)} is damaged: {literal(record.error)}",
            icon=":material/broken_image:",
        )
        return False
    if record.status == "cancelled":
        st.warning(
            f"Run {literal(record.run_id)} was cancelled before it finished; it has no results"
            + (f": {literal(record.error)}" if record.error else ".")
        )
        return False
    return True


def clickable_heatmap(fig: go.Figure, key: str) -> None:
    """Show a heatmap whose cells carry (target, …, tensor) as customdata; a click on a cell puts
    that target and tensor into the view (the URL), for the drill-down below it."""
    event = st.plotly_chart(inert(fig), key=key, on_select="rerun", selection_mode="points")
    points = (event or {}).get("selection", {}).get("points", [])  # PlotlyState is a dict
    if not points:
        return
    data = points[0].get("customdata")
    signature = repr(data)
    # The chart keeps its selection across reruns: act on a new click only.
    if data and st.session_state.get(f"{key}.applied") != signature:
        st.session_state[f"{key}.applied"] = signature
        set_view("target", data[0])
        set_view("tensor", data[2])


def verdict_box(verdict: str, text: str) -> None:
    """A row's verdict in the box of its severity, then `text` (plain text: tensor names, the
    explanation and its reason come from the run's files)."""
    if verdict == "identical":
        st.success(f"**{literal(verdict)}** · {literal(text)}")
    elif verdict == "within tolerance":
        st.info(f"**{literal(verdict)}** · {literal(text)}")
    elif verdict == "drift":
        st.warning(f"**{literal(verdict)}** · {literal(text)}")
    else:
        st.error(f"**{literal(verdict)}** · {literal(text)}")


def chart_component_ahead() -> None:
    """An empty chart, hidden, on a page that has none: the browser fetches and compiles Streamlit's
    Plotly component (4.7 MB of JavaScript, loaded on a page's first chart) while the user reads the
    page, not between the click on Run and the first heatmap (~2 s of it on a 2-core machine)."""
    st.html("<style>.st-key-chart-ahead { display: none; }</style>")
    with st.container(key="chart-ahead"):
        st.plotly_chart(inert(go.Figure()), key="chart-ahead-figure")


def finished_run(check: str | None = None, page: str | None = None) -> RunRecord:
    """The run the URL selects (else the newest that ran `check`), when it has results; otherwise say
    why and stop the page (with no run at all, after `page`'s demo scenarios, in plain sight)."""
    record = open_run(check=check)
    if record is None:
        st.info("No runs yet. The sidebar's **Run** button starts one on the demo workspace.")
        if page is not None:
            scenario_buttons(page, plain=True)
        chart_component_ahead()
        st.stop()
    if not run_header(record):
        st.stop()
    return record


def check_not_run(record: RunRecord, check: str, page: str, text: str) -> None:
    """Say (`text`) that the run shown did not run `check`; offer, in plain sight, the same selection
    with this check (one click) and the page's demo scenarios; then stop the page. A run still going
    on that has `check` to come says so instead."""
    if record.status in ("queued", "running") and record.spec is not None and check in record.spec.checks:
        still_running(record, check)
    st.info(trusted(text))
    if record.spec is not None and st.button(
        trusted(f"Run {check} on this run's selection"),
        key=f"{page}.rerun",
        icon=":material/play_arrow:",
        type="primary",
        help="The same base, adapters, targets, probe and tolerances, with this check alone.",
    ):
        start_run(replace(record.spec, checks=(check,)), page)
    scenario_buttons(page, plain=True)
    st.stop()


def still_running(record: RunRecord, check: str) -> None:
    """Say that the run's `check` has not been compared yet (the page fills in when it is); stop the page."""
    st.info(
        trusted(  # a check's name from the registry (the page's own constant), not from a file
            f"The `{check}` check of this run is still running: this page fills in as soon as its "
            "captures are compared (progress above)."
        ),
        icon=":material/hourglass_top:",
    )
    st.stop()


def scenario_buttons(page: str, *, plain: bool = False) -> None:
    """The demo scenarios this page offers, one button each: a click runs it and opens the result here.

    In a folded expander, or `plain`: in plain sight, where the page has nothing else to show.
    """
    from core.demo.build import load_manifest
    from core.demo.scenarios import scenario_spec, scenarios_for

    scenarios = scenarios_for(page)
    if not scenarios:
        return
    if plain:
        st.subheader("Demo scenarios: reproduce a problem in one click")
    with st.container() if plain else st.expander("Demo scenarios: reproduce a problem in one click"):
        manifest = load_manifest(home())
        if manifest is None:
            st.info("The demo workspace is not built yet (it is built on first launch).")
            return
        columns = st.columns(min(len(scenarios), 3))
        for i, scenario in enumerate(scenarios):
            with columns[i % len(columns)]:
                clicked = st.button(
                    trusted(scenario.title),
                    key=f"scenario.{scenario.name}",
                    help=trusted(scenario.description),
                    icon=":material/play_arrow:",
                    use_container_width=True,
                )
                st.caption(trusted(scenario.description))
                if clicked:
                    try:
                        spec = scenario_spec(scenario.name, manifest, engine().devices)
                    except SpecError as e:
                        st.error(literal(e))
                        continue
                    start_run(spec, page)


@st.cache_data(show_spinner="Reading the tensor and its reference…", max_entries=8)
def _diff_figures(run_id: str, check: str, target: str, adapter: str | None, tensor: str, title: str):
    """The element-wise map and histogram of one tensor (None when it equals its reference).

    Only the figures are cached (at most 256×256 cells): the full-size difference arrays of a
    large tensor are dropped as soon as they are drawn.
    """
    return tensor_figures(store().open(run_id), check, target, adapter, tensor, title)


def element_diff_view(
    record: RunRecord,
    check: str,
    target: str,
    adapter: str | None,
    tensor: str,
    *,
    title: str,
    exact: str,
    key: str,
) -> None:
    """One tensor's element-wise difference from its reference: map and histogram with downloads.

    `exact` (plain text) is what is said when every element equals the reference; a tensor that
    cannot be read (run folder damaged, base model or adapter moved since the run) is explained, not
    raised.
    """
    try:
        figures = _diff_figures(record.run_id, check, target, adapter, tensor, title)
    except Exception as e:  # whatever reading the files raises (LoadError, OSError, …): said, not raised
        st.error(
            f"Cannot show the element-wise difference of {literal(tensor)} on {literal(target)}: "
            f"{literal(e)}. If the run's base model or adapters moved since it ran, put them back or run "
            "it again.",
            icon=":material/error:",
        )
        return
    if figures is None:
        st.success(literal(exact))
        return
    heat, hist, sketched = figures
    if sketched:
        st.caption(
            "This run kept each tensor's sketch, not the tensor (its base is over 256 MiB): the map shows "
            "the largest |Δ| of each block and the histogram counts every element. For the map of every "
            "element, run again with --keep-tensors (the form's “Keep every compared tensor”)."
        )
    left, right = st.columns([3, 2])
    with left:
        st.plotly_chart(inert(heat), key=f"{key}.diff")
        figure_download(heat, f"{record.run_id}-{target}-{tensor}-diff", key=f"{key}.diff.html")
    with right:
        st.plotly_chart(inert(hist), key=f"{key}.hist")
        figure_download(hist, f"{record.run_id}-{target}-{tensor}-hist", key=f"{key}.hist.html")
