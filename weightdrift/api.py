"""The notebook API: `run`, `open`, `compare` (each gives a `Run`) and `demo`; docs/api.md documents them.

A facade over core: the same specs, engine, store and judgement as the CLI, and the dashboard's own
figure builders (through `dashboard.report`, which imports no Streamlit).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from core import report
from core.engine.store import RunRecord, Store
from core.judgement import Judgement
from core.judgement import anomalies as anomaly_rows
from core.spec import (
    DEFAULT_CHECKS,
    DEFAULT_MAX_NEW_TOKENS,
    REFERENCE_TARGET,
    AdapterRef,
    ModelRef,
    ProbeInputs,
    ProbeSpec,
    SpecError,
    Target,
    ToleranceOverride,
    known_checks,
    weightdrift_home,
)
from weightdrift.progress import follow

# Where `Run.url` points: the dashboard as `weightdrift-dashboard` serves it by default.
DASHBOARD_URL = "http://localhost:8501"


class RunError(Exception):
    """A run that did not succeed (failed, cancelled): the message says why; `.run` is the stored run."""

    def __init__(self, run: Run):
        super().__init__(f"run {run.run_id} {run.status}: {run.error}")
        self.run = run


class Run:
    """A stored run: its tables, its judgement, its figures (`run`, `open` and `compare` give one)."""

    def __init__(self, record: RunRecord):
        self._record = record
        self._metrics: pd.DataFrame | None = None
        self._judgement: Judgement | None = None

    def __repr__(self) -> str:
        targets = ", ".join(map(str, self.spec.targets)) if self.spec else "?"
        return f"<weightdrift.Run {self.run_id} {self.status}: {targets}>"

    @property
    def run_id(self) -> str:
        return self._record.run_id

    @property
    def run_dir(self) -> Path:
        """The run's folder in the WeightDrift home."""
        return self._record.run_dir

    @property
    def status(self) -> str:
        """`succeeded`, `failed`, `cancelled` (or `damaged`: a folder that holds no readable run)."""
        return self._record.status

    @property
    def error(self) -> str | None:
        """Why the run did not succeed (None when it did)."""
        return self._record.error

    @property
    def spec(self) -> ProbeSpec | None:
        """What was run (`core.spec.ProbeSpec`), peers the engine added included."""
        return self._record.spec

    @property
    def metrics(self) -> pd.DataFrame:
        """The metrics table: a row per check, target, reference and tensor or output (docs/metrics.md)."""
        if self._metrics is None:
            self._metrics = self._record.metrics()
        return self._metrics.copy()

    @property
    def judgement(self) -> Judgement:
        """Agreement groups, anomalies and the drift each dtype's rounding explains (`core.judgement`)."""
        if self._judgement is None:
            self._judgement = self._record.judgement(self._table)
        return self._judgement

    @property
    def groups(self) -> pd.DataFrame:
        """Which targets agree bitwise, per check: a row per group (check, group, targets, how it
        differs from the first group, tensors differing), as the Overview shows it."""
        from dashboard.figures.overview import groups_table

        return groups_table(self.judgement.groups)

    @property
    def anomalies(self) -> pd.DataFrame:
        """The metric rows whose error is more than k× their peer's on the same tensor (worst first);
        empty when none, or when the run was not judged (`judgement.unjudged` says why)."""
        if self.judgement.unjudged:
            return self._table.iloc[0:0]
        return anomaly_rows(self._table, self.judgement.k)

    def summary(self, top: int = 3) -> str:
        """What `weightdrift run` prints when the run ends: the answer, verdict counts, each check's
        `top` worst rows (3 in the CLI's text), notes."""
        record = self._record
        if self.status != "succeeded":
            return f"run {self.run_id} {self.status}: {self.error}"
        duration = record.info.get("duration_s")
        lines = report.summary_lines(
            self.run_id, self.run_dir, duration, self._table, top, record.answer(self._table)
        )
        lines += [f"note: {note}" for note in record.notes()]
        for i in record.imported():  # where an imported run's targets came from
            lines.append(f"from {i['snapshot']}: machine {i['machine']}, targets {', '.join(i['targets'])}")
        return "\n".join(lines)

    def tables(self) -> list[str]:
        """The names `table` takes: the run's tables besides `metrics` (pairwise, memory_timeline, …)."""
        return sorted(p.stem for p in self.run_dir.glob("*.parquet") if p.stem != "metrics")

    def table(self, name: str) -> pd.DataFrame:
        """One of the run's tables (`tables()` names them): a check's own table (`generations`,
        `kl_positions`, `memory_timeline`, `placement`, `merge_save`, …) or `pairwise`, `metrics`."""
        if name == "metrics":
            return self.metrics
        names = self.tables()
        if name not in names:
            raise KeyError(f"run {self.run_id} has no table {name!r}: it has {', '.join(names) or 'none'}")
        return self._record.table(name)

    def figures(self, page: str, **selection: Any) -> dict[str, go.Figure]:
        """The main figures of a dashboard page (overview, drift, outputs, activations, merge, memory,
        adapters) by title, as the page draws them. `selection` is what the page's selectors pick —
        drift: check, adapter, metric; activations: adapter, metric, drift; merge: adapter, metric,
        stage; memory: metric, by; adapters: target — the worst first where left out."""
        from dashboard.report import page_figures

        found = page_figures(self._record, page, self._table, **selection)
        if not found:
            raise ValueError(f"run {self.run_id} has nothing for the {page} page (checks: {self._checks()})")
        return dict(found)

    def figure(self, page: str, **selection: Any) -> go.Figure:
        """The first of `figures(page, **selection)`: the page's main figure (the drift heatmap, …)."""
        return next(iter(self.figures(page, **selection).values()))

    @property
    def url(self) -> str:
        """The dashboard's link to this run (its Overview), at `DASHBOARD_URL`."""
        return f"{DASHBOARD_URL}/overview?run={self.run_id}"

    def snapshot(self, path: str | os.PathLike[str], machine: str | None = None) -> Path:
        """Pack the run's captures into one portable snapshot file (`weightdrift snapshot`'s format) for
        `compare` on another machine; `machine` names its targets there (default: this host's name)."""
        from core.engine.snapshot import write_snapshot

        self._finished()
        return write_snapshot(self.run_dir, self.spec, Path(path).expanduser(), machine=machine)

    def report(self, path: str | os.PathLike[str]) -> Path:
        """Write the run as one self-contained HTML file (`weightdrift report`'s file) to `path`."""
        from core.engine.store import atomic_write_bytes
        from dashboard.report import report_html

        out = Path(path).expanduser()
        atomic_write_bytes(out, report_html(self._record).encode())
        return out

    @property
    def _table(self) -> pd.DataFrame:
        if self._metrics is None:
            self._metrics = self._record.metrics()
        return self._metrics

    def _checks(self) -> str:
        return ", ".join(self.spec.checks) if self.spec else "?"

    def _finished(self) -> None:
        if self.status != "succeeded" or self.spec is None:
            raise RunError(self)


def demo(home: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The demo workspace (built on first use, offline): {"base": the tiny Llama's folder, "adapters":
    {name: folder} one per method, "targets": the demo's targets, "models", "manifest"}."""
    from core.demo.build import build_demo
    from core.demo.workspace import DEMO_TARGETS, demo_selection

    manifest = build_demo(weightdrift_home(home))
    base, adapters = demo_selection(manifest)
    return {
        "base": base,
        "adapters": {a.name: a.path for a in adapters},
        "targets": list(DEMO_TARGETS),
        "models": dict(manifest["models"]),
        "manifest": manifest,
    }


def run(
    base: str | os.PathLike[str],
    adapters: Mapping[str, str | os.PathLike[str]] | Sequence[str | os.PathLike[str]] = (),
    targets: Iterable[str | Target] = ("cpu/float32",),
    checks: Iterable[str] = DEFAULT_CHECKS,
    prompts: Iterable[str] = (),
    *,
    reference: str | Target | None = None,
    seed: int = 0,
    strategies: Iterable[str] = (),
    merge_subset: Iterable[str] = (),
    atol: float | None = None,
    rtol: float | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    keep_tensors: bool = False,
    peers: bool = True,
    trust_remote_code: bool = False,
    home: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> Run:
    """Run checks on targets, as `weightdrift run` does, and wait for the end with a progress bar.

    `adapters`: {name: folder or hub id}, or folders (each named by its folder), loaded in this order;
    `targets`: `DEVICE/DTYPE[+FLAG…]` strings (docs/cli.md); `prompts`: probe texts through the base's
    tokenizer. The other arguments are `weightdrift run`'s options. Returns the finished `Run`;
    `RunError` if it failed, `core.spec.SpecError` (a ValueError) for input that cannot run. An
    interrupt (Ctrl-C, a notebook's stop) cancels the run and stops its workers."""
    if isinstance(adapters, Mapping):
        refs = tuple(AdapterRef(path=os.fspath(p), name=n) for n, p in adapters.items())
    else:
        refs = tuple(AdapterRef.parse(os.fspath(p)) for p in adapters)
    targets = tuple(t if isinstance(t, Target) else Target.parse(t) for t in targets)
    if len(set(targets)) != len(targets):
        raise SpecError("a target is given twice")
    if isinstance(reference, str):
        reference = Target.parse(reference)
    overrides = {"*": ToleranceOverride(rtol=rtol, atol=atol)} if atol is not None or rtol is not None else {}
    spec = ProbeSpec(
        base=ModelRef(path=os.fspath(base), trust_remote_code=trust_remote_code),
        adapters=refs,
        targets=targets,
        checks=known_checks(checks),
        tolerances=overrides,
        seed=seed,
        strategies=tuple(dict.fromkeys(["isolated", *strategies])),
        merge_subset=tuple(merge_subset),
        keep_tensors=keep_tensors,
        reference=reference or REFERENCE_TARGET,
        peers=peers,
        probe=ProbeInputs(prompts=tuple(prompts)),
        max_new_tokens=max_new_tokens,
    )
    return _execute(weightdrift_home(home), lambda _: (spec, None), progress)


def open(
    run_id: str, home: str | os.PathLike[str] | None = None
) -> Run:  # `wd.open`: shadows the builtin inside this module only
    """A stored run of the home by its id (`weightdrift runs` lists them); KeyError when there is none."""
    store = Store(weightdrift_home(home))
    try:
        return Run(store.open(run_id))
    except KeyError:
        raise KeyError(f"no run {run_id} in {store.runs_dir}") from None


def compare(
    *snapshots: str | os.PathLike[str] | Run,
    targets: Iterable[str | Target] = (),
    base: str | os.PathLike[str] | None = None,
    adapters: Mapping[str, str | os.PathLike[str]] | None = None,
    peers: bool = True,
    home: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> Run:
    """Compare snapshot files (`Run.snapshot`, `weightdrift snapshot`) and finished `Run`s of this home
    as one run, with `targets` of this machine run here too (`weightdrift compare`). `base`/`adapters`:
    where the models are here, when not at the paths the first snapshot recorded."""
    import tempfile

    from core.engine.snapshot import comparison, read_snapshot, write_snapshot

    if not snapshots:
        raise SpecError("give at least one snapshot file or Run")
    local = [t if isinstance(t, Target) else Target.parse(t) for t in targets]
    refs = [AdapterRef(path=os.fspath(p), name=n) for n, p in adapters.items()] if adapters else None
    with tempfile.TemporaryDirectory(prefix="weightdrift-compare-") as tmp:

        def plan(home_dir: Path):
            read = []
            for s in snapshots:
                if isinstance(s, Run):  # a run joins as a snapshot of it, as `compare --run` does
                    s._finished()
                    s = write_snapshot(s.run_dir, s.spec, Path(tmp) / f"{s.run_id}.wdsnap")
                read.append(read_snapshot(s))
            model = ModelRef(path=os.fspath(base)) if base is not None else None
            return comparison(read, local, model, refs, home=home_dir, peers=peers)

        return _execute(weightdrift_home(home), plan, progress)


def _execute(home: Path, plan, progress: bool) -> Run:
    """Submit `plan(home)`'s spec (and what installs imported captures) and wait for its end."""
    from core.engine.jobs import Engine
    from core.engine.runners import ProcessRunner, fresh_spares

    spec, install = plan(home)
    runner = ProcessRunner()
    runner.warm(fresh_spares(spec.checks), quantized=spec.loads_quantized)
    engine = Engine(home, runner=runner)
    try:
        job = engine.submit(spec, install=install)
        try:
            follow(job) if progress else job.wait()
        except KeyboardInterrupt:
            engine.shutdown("cancelled: interrupted in Python")
            raise
    finally:
        runner.kill_all()  # a worker made ready for a task that never came
    result = Run(engine.store.open(job.run_id))
    if result.status != "succeeded":
        raise RunError(result)
    return result
