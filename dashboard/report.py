"""A run as one self-contained HTML file to attach to a bug (`weightdrift report`, the Overview's
button), and each page's main figures for a selection (the report, `weightdrift.Run.figure`).

No Streamlit here: the figures are the pages' own builders (`dashboard/figures`), opened on what the
page opens on (the worst selection first). The file holds Plotly's JS once and no script of ours;
every text that comes from the run (paths, model names, exception messages) is escaped.
"""

from __future__ import annotations

import html
import inspect
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from core import report
from core.checks.activations import ACCUMULATED, LOCAL_DRIFT, first_divergences
from core.engine.pairwise import pair_matrix
from core.engine.store import ACTIVE_STATES, RunRecord, Store, StoreError, atomic_write_bytes, io_advice
from core.spec import REFERENCE_TARGET, ProbeSpec
from dashboard import pages
from dashboard.figures.activations import activations_heatmap, depth_line_chart
from dashboard.figures.adapters import consistency_cells, consistency_matrix
from dashboard.figures.common import (
    BASE,
    METRIC_LABELS,
    colourable,
    drift_checks,
    drift_heatmap,
    empty_figure,
    environment_table,
    metric_choices,
    selection_rows,
    severity,
)
from dashboard.figures.diffs import diff_heatmap, diff_histogram, sketch_heatmap, sketch_histogram
from dashboard.figures.memory import CUDA_METRICS, module_device_heatmap, timeline_heatmap
from dashboard.figures.merge import MERGE_METRICS, output_rows, relabel_legacy, stage_bars, weight_rows
from dashboard.figures.outputs import kl_position_figure, outputs_figure
from dashboard.figures.overview import groups_table, pairwise_figure, verdict_counts_figure
from dashboard.text import inert

Figures = list[tuple[str, go.Figure]]  # (what the figure shows, the figure)


class SelectionError(ValueError):
    """A page or selection this run does not have; the message names what it has."""


def _pick(name: str, value: Any, options: list[Any], default: Any) -> Any:
    if value is None:
        return default
    if value not in options:
        raise SelectionError(f"{name} {value!r} is not in this run: one of {', '.join(map(str, options))}")
    return value


def _rows(table: pd.DataFrame, check: str) -> pd.DataFrame:
    return table[table["check"] == check] if len(table) else table


def _overview(record: RunRecord, table: pd.DataFrame) -> Figures:
    by = report.verdicts_by_check_target(table)
    figures = [("Verdicts per check and target", verdict_counts_figure(by))]
    pairs = record.table("pairwise")
    if not pairs.empty:
        figures.append(("Every target against every other", pairwise_figure(pair_matrix(pairs))))
    return figures


def tensor_figures(
    record: RunRecord, check: str, target: str, adapter: str | None, tensor: str, title: str
) -> tuple[go.Figure, go.Figure, bool] | None:
    """One tensor's element-wise |Δ| from its reference (the drill-down): its map, its histogram, and
    whether they come from the worker's sketch (a large model's tensors are not kept); None when every
    element equals the reference. Raises what reading the run's or the model's files raises."""
    from core.engine.diffmap import SketchedDiff, element_diff

    diff = element_diff(record, check, target, adapter, tensor)
    if isinstance(diff, SketchedDiff):
        # same pictures from the block-max map and the binned histogram, and the title says so
        if diff.sketch is None:
            return None
        title = title.replace("element-wise", "block max") + " · sketch (tensors not kept)"
        return sketch_heatmap(diff.sketch, title=title), sketch_histogram(diff.sketch), True
    if not (diff.diff != 0).any():
        return None
    heat = diff_heatmap(diff.diff, title=title, failing=diff.mismatch, shape=diff.shape)
    return heat, diff_histogram(diff.diff), False


def _drift(
    record: RunRecord,
    table: pd.DataFrame,
    check: str | None = None,
    adapter: str | None = None,
    metric=None,
    target: str | None = None,
    tensor: str | None = None,
) -> Figures:
    present = drift_checks(table)
    if not present:
        return []
    worst = max(present, key=lambda c: severity(_rows(table, c)))
    rows = _rows(table, _pick("check", check, present, worst))
    check = rows["check"].iloc[0]
    choices = [*dict.fromkeys(rows["adapter"].dropna()), *([BASE] if rows["adapter"].isna().any() else [])]
    worst = max(choices, key=lambda a: severity(selection_rows(rows, a)))
    adapter = _pick("adapter", adapter, choices, worst)
    metric = _pick(
        "metric", metric, list(metric_choices(rows)), "max_ulp" if check == "weights" else "rel_l2"
    )
    shown = selection_rows(rows, adapter)
    title = f"{check} · {adapter} · {METRIC_LABELS[metric]}"
    heatmap = [(title, drift_heatmap(colourable(shown, metric), metric, title=title))]
    if tensor is None:
        return heatmap
    # the drill-down into one tensor, first: what the selection went down to
    targets = list(dict.fromkeys(shown["target"]))
    target = _pick(
        "target", target, targets, max(targets, key=lambda t: severity(shown[shown["target"] == t]))
    )
    mine = shown[shown["target"] == target]
    tensor = _pick("tensor", tensor, list(dict.fromkeys(mine["tensor"])), None)
    row = mine[mine["tensor"] == tensor].iloc[0]
    title = f"|Δ| element-wise · {tensor} · {target}"
    found = tensor_figures(
        record, check, target, row["adapter"] if isinstance(row["adapter"], str) else None, tensor, title
    )
    if found is None:
        return [
            (f"{tensor} on {target} equals its reference exactly: nothing to map", empty_figure("|Δ| = 0")),
            *heatmap,
        ]
    return [(title, found[0]), (f"histogram of |Δ| · {tensor} · {target}", found[1]), *heatmap]


def _outputs(record: RunRecord, table: pd.DataFrame) -> Figures:
    rows = _rows(table, "outputs")
    if rows.empty:
        return []
    figures = [("Outputs against the reference", outputs_figure(rows))]
    kl = record.table("kl_positions")
    if len(kl):
        figures.append(("KL(p_ref ‖ p_target) per position", kl_position_figure(kl)))
    return figures


def _activations(
    record: RunRecord, table: pd.DataFrame, adapter: str | None = None, metric=None, drift=None
) -> Figures:
    rows = _rows(table, "activations")
    if rows.empty:
        return []
    choices = [*([BASE] if rows["adapter"].isna().any() else []), *dict.fromkeys(rows["adapter"].dropna())]
    adapter = _pick("adapter", adapter, choices, choices[0])
    metric = _pick("metric", metric, list(metric_choices(table)), "rel_l2")
    drift = _pick("drift", drift, [ACCUMULATED, LOCAL_DRIFT], ACCUMULATED)
    shown = rows[rows["adapter"].isna()] if adapter == BASE else rows[rows["adapter"] == adapter]
    divergences = first_divergences(shown)
    title = f"{adapter} · {drift} drift · {metric}"
    return [
        (title, activations_heatmap(colourable(shown, metric), metric, drift, divergences, title=title)),
        (
            f"{adapter}: {METRIC_LABELS[metric]} over depth",
            depth_line_chart(shown, metric, drift, divergences),
        ),
    ]


def _merge(
    record: RunRecord, table: pd.DataFrame, adapter: str | None = None, metric=None, stage=None
) -> Figures:
    rows, _ = relabel_legacy(_rows(table, "merge"))
    names = [a.name for a in record.spec.adapters] if record.spec else []
    adapters = [a for a in dict.fromkeys(rows["adapter"].dropna()) if a in names] if len(rows) else []
    if not adapters:
        return []
    worst = max(adapters, key=lambda a: severity(rows[rows["adapter"] == a]))
    adapter = _pick("adapter", adapter, adapters, worst)
    metric = _pick("metric", metric, list(MERGE_METRICS), "scale_ulp")
    mine = rows[rows["adapter"] == adapter]
    paths = [s for s in ("merge_adapter", "safe_merge") if s in set(weight_rows(mine)["stage"])]
    figures = []
    if paths:
        path = _pick("stage", stage, paths, paths[0])
        merged, tied = weight_rows(mine, stage=path), weight_rows(mine, role="tied", stage=path)
        shown = pd.concat([merged, tied]) if len(tied) else merged
        title = f"{path} · {adapter} · {METRIC_LABELS[metric]}"
        figures.append((title, drift_heatmap(shown, metric, title=title)))
    title = f"{adapter}: max |Δ| of outputs per stage (symbols: dtype default / PEFT tol)"
    return [*figures, (title, stage_bars(output_rows(mine), title=title))]


def _memory(record: RunRecord, table: pd.DataFrame, metric=None, by=None) -> Figures:
    timeline, placement = record.table("memory_timeline"), record.table("placement")
    figures = []
    if len(timeline):
        metric = _pick("metric", metric, list(CUDA_METRICS), "driver_used")
        figures.append(("Memory per load stage and device", timeline_heatmap(timeline, metric)))
    if len(placement):
        by = _pick("by", by, ["module", "kind"], "module")
        figures.append(("Where each module's tensors live", module_device_heatmap(placement, by)))
    return figures


def _adapters(record: RunRecord, table: pd.DataFrame, target: str | None = None) -> Figures:
    rows = _rows(table, "adapters")
    if rows.empty:
        return []
    targets = list(dict.fromkeys(rows["target"]))
    target = _pick("target", target, targets, targets[0])
    cells = consistency_cells(rows[rows["target"] == target])
    return [(f"Load strategies against isolated on {target}", consistency_matrix(cells, target))]


# page (its url path on the dashboard) → its main figures; keyword arguments are the page's selection
PAGE_FIGURES: dict[str, Callable[..., Figures]] = {
    "overview": _overview,
    "drift": _drift,
    "outputs": _outputs,
    "activations": _activations,
    "merge": _merge,
    "memory": _memory,
    "adapters": _adapters,
}


def page_figures(
    record: RunRecord, page: str, table: pd.DataFrame | None = None, **selection: Any
) -> Figures:
    """The main figures of a dashboard page for this run, as the page draws them: `selection` picks what
    the page's selectors pick (drift: check, adapter, metric, and target and tensor for the drill-down
    into one tensor, whose figures come first; activations: adapter, metric, drift; merge:
    adapter, metric, stage; memory: metric, by; adapters: target), the worst first where left out.
    Empty when the run has no rows for the page; SelectionError for a page or selection it lacks."""
    if page not in PAGE_FIGURES:
        raise SelectionError(f"no page {page!r}: one of {', '.join(PAGE_FIGURES)}")
    selectors = list(inspect.signature(PAGE_FIGURES[page]).parameters)[2:]  # after record and table
    unknown = sorted(set(selection) - set(selectors))
    if unknown:
        raise SelectionError(
            f"the {page} page has no selector {', '.join(map(repr, unknown))}: "
            f"it has {', '.join(selectors) or 'none'}"
        )
    table = record.metrics() if table is None else table
    return [(title, inert(fig)) for title, fig in PAGE_FIGURES[page](record, table, **selection)]


def run_command(spec: ProbeSpec) -> str:
    """The `weightdrift run` command line that runs `spec` again (peers the engine added are left out:
    it adds them again). Per-role tolerances, fixed token ids and hub revisions have no flag; the report
    shows them in the spec."""
    args = ["weightdrift", "run", "--base", spec.base.path]
    if spec.adapters:
        args += ["--adapter", *(f"{a.path}={a.name}" for a in spec.adapters)]
    args += ["--target", *(str(t) for t in spec.targets if t not in spec.added_peers)]
    args += ["--check", *spec.checks]
    extra = [s for s in spec.strategies if s != "isolated"]
    if extra:
        args += ["--strategy", *extra]
    if spec.merge_subset:
        args += ["--merge-subset", *spec.merge_subset]
    everywhere = spec.tolerances.get("*")
    if everywhere is not None and everywhere.atol is not None:
        args += ["--atol", repr(everywhere.atol)]
    if everywhere is not None and everywhere.rtol is not None:
        args += ["--rtol", repr(everywhere.rtol)]
    args += ["--seed", str(spec.seed)]
    for prompt in spec.probe.prompts:
        args += ["--prompt", prompt]
    if "generate" in spec.checks:
        args += ["--max-new-tokens", str(spec.max_new_tokens)]
    if spec.reference != REFERENCE_TARGET:
        args += ["--reference", str(spec.reference)]
    flags = {
        "--keep-tensors": spec.keep_tensors,
        "--trust-remote-code": spec.base.trust_remote_code,
        "--no-peers": not spec.peers,
    }
    return shlex.join(args + [flag for flag, on in flags.items() if on])


def _command(record: RunRecord) -> str:
    """How to make this run again: `weightdrift run …`, or `weightdrift compare …` for a run made from
    snapshots."""
    imported = record.imported()
    if not imported:
        return run_command(record.spec)
    local = [str(t) for t in record.spec.targets if t.machine is None and t not in record.spec.added_peers]
    args = ["weightdrift", "compare", *(i["snapshot"] for i in imported)]
    return shlex.join(args + (["--target", *local] if local else []))


# --------------------------------------------------------------------------------------------- HTML
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; padding: 0 1rem; max-width: 1280px; }
body { color: #1f2933; }
h1 { font-size: 1.6rem; } h2 { border-bottom: 1px solid #d0d7de; padding-bottom: .3rem; margin-top: 2.2rem; }
table { border-collapse: collapse; font-size: .85rem; margin: .5rem 0; }
th, td { border: 1px solid #d0d7de; padding: .25rem .5rem; text-align: left; vertical-align: top; }
th { background: #f3f5f7; }
pre { background: #f6f8fa; padding: .8rem; overflow-x: auto; white-space: pre-wrap; }
.anomaly { color: #b42318; } .muted { color: #57606a; font-size: .9rem; }
"""
# Nothing leaves the file: no request to any address (Plotly's JS is inline and needs eval)
POLICY = (
    "default-src 'none'; script-src 'unsafe-inline' 'unsafe-eval'; style-src 'unsafe-inline'; "
    "img-src data: blob:; font-src data:"
)


def _text(value: Any) -> str:
    return html.escape(str(value))


def _number(value: Any) -> str:
    """A float as its shortest exact decimal: the file's numbers read back as the run's."""
    return repr(float(value))


def _table(frame: pd.DataFrame, class_: str = "") -> str:
    if frame.empty:
        return "<p class='muted'>(none)</p>"
    return frame.to_html(index=False, escape=True, na_rep="", border=0, float_format=_number, classes=class_)


def _section(title: str, body: str) -> str:
    return f"<h2>{_text(title)}</h2>\n{body}\n"


def _judgement(record: RunRecord, table: pd.DataFrame) -> str:
    if not len(table):
        return "<p>This run has no metric rows.</p>"
    judgement = record.judgement(table)
    counts = report.verdict_counts(table)
    parts = ["<p>Rows: " + " · ".join(f"{n:d} {_text(v)}" for v, n in counts.items()) + "</p>"]
    parts.append("<h3>Which targets agree</h3>" + _table(groups_table(judgement.groups)))
    if judgement.unjudged:
        parts.append(f"<p>No anomaly judgement: {_text(judgement.unjudged)}.</p>")
    elif judgement.anomalies:
        items = "".join(f"<li>{_text(a.sentence())}</li>" for a in judgement.anomalies)
        parts.append(
            f"<h3 class='anomaly'>{len(judgement.anomalies)} anomal"
            f"{'y' if len(judgement.anomalies) == 1 else 'ies'}: error over {judgement.k:g}× the peer's on "
            f"the same tensor</h3><ul>{items}</ul>"
        )
    else:
        parts.append(
            f"<p>No anomaly: every target's error is within {judgement.k:g}× its peer's on every tensor.</p>"
        )
    parts.append("<h3>The answer, as <code>weightdrift run</code> prints it</h3>")
    parts.append(f"<pre>{_text(chr(10).join(record.answer(table)))}</pre>")
    return "\n".join(parts)


def report_html(record: RunRecord) -> str:
    """The whole report of a finished run as one HTML document (see the module's docstring)."""
    if record.status in ACTIVE_STATES:
        raise SelectionError(f"run {record.run_id} is {record.status}: a report is made of a finished run")
    table = record.metrics() if record.status == "succeeded" else pd.DataFrame()
    spec = record.spec
    info = record.info
    created = info.get("created")
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(created)) if created else "unknown"
    duration = info.get("duration_s")
    head = [
        f"<p>Status <b>{_text(record.status)}</b> · created {_text(when)}"
        + (f" · {duration:.1f} s" if isinstance(duration, (int, float)) else "")
        + f" · folder <code>{_text(record.run_dir)}</code></p>"
    ]
    if record.error:
        head.append(f"<pre class='anomaly'>{_text(record.error)}</pre>")
    body = [f"<h1>WeightDrift run {_text(record.run_id)}</h1>", *head]
    if spec is not None:
        body.append(_section("The command that reproduces it", f"<pre>{_text(_command(record))}</pre>"))
    body.append(_section("Judgement", _judgement(record, table)))
    body.append(_section("Figures", _page_figures_html(record, table)))
    worst = report.worst_rows(table, 20)
    body.append(_section("Furthest from their reference (20 worst rows)", _table(worst, "worst")))
    notes = record.notes()
    if notes:
        body.append(
            _section(
                "Notes from the workers", "<ul>" + "".join(f"<li>{_text(n)}</li>" for n in notes) + "</ul>"
            )
        )
    imported = record.imported()
    if imported:
        rows = pd.DataFrame([{k: str(v) for k, v in i.items()} for i in imported])
        body.append(_section("Imported from snapshots", _table(rows)))
    env = environment_table(record.environments())
    body.append(_section("Environment per target", _table(env.reset_index()) if len(env) else _table(env)))
    if spec is not None:
        body.append(_section("Spec", f"<pre>{_text(spec.to_json())}</pre>"))
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<meta http-equiv='Content-Security-Policy' content=\"{POLICY}\">"
        f"<title>WeightDrift run {_text(record.run_id)}</title><style>{STYLE}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def _page_figures_html(record: RunRecord, table: pd.DataFrame) -> str:
    if not len(table):
        return "<p class='muted'>(no figures: the run has no metric rows)</p>"
    parts = []
    first = True
    for page in PAGE_FIGURES:
        figures = page_figures(record, page, table)
        if not figures:
            continue
        parts.append(f"<h3>{_text(pages.page(page).title)}</h3>")
        for title, fig in figures:
            parts.append(f"<p class='muted'>{_text(title)}</p>")
            parts.append(fig.to_html(full_html=False, include_plotlyjs=first, config={"displaylogo": False}))
            first = False
    return "\n".join(parts)


def write_report(home: Path, run_id: str, out: Path) -> str:
    """`weightdrift report RUN_ID -o FILE`: the run's report written to `out` (through a temporary file);
    what was written, in words. StoreError, in one line, for a run that is not there or not finished, or
    a file that cannot be written."""
    store = Store(home)
    try:
        record = store.open(run_id)
    except KeyError:
        raise StoreError(f"no run {run_id} in {store.runs_dir} (python -m core runs lists them)") from None
    try:
        data = report_html(record).encode()
    except SelectionError as e:
        raise StoreError(str(e)) from None
    try:
        atomic_write_bytes(out.expanduser(), data)
    except OSError as e:
        raise StoreError(f"cannot write the report {out}: {e.strerror or e} ({io_advice(e)})") from None
    return f"{out}: {len(data) / 2**20:.2f} MiB"
