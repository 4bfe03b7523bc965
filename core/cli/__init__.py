"""`python -m core …`: the same runs as the dashboard, headless, for CI and remote machines.

Exit codes: 0 every row identical or within tolerance · 1 any row drift or broken ·
2 usage error or failed job (message on stderr; traceback only with --debug).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

from core.cli.parser import UsageError, build_parser
from core.progress import stdout_for_the_answer, watch
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
    input_folders,
    known_checks,
    weightdrift_home,
)

EXIT_OK, EXIT_DRIFT, EXIT_ERROR = 0, 1, 2


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (`timeout`, a CI cancel, a container stop, a closed terminal): handled
    exactly like Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signame = signal.Signals(signum).name


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(signum)


def terminate_like_interrupt():
    """Within the block, SIGTERM and SIGHUP raise `Terminated` in the main thread, like Ctrl-C."""
    return _handling_signals((signal.SIGTERM, signal.SIGHUP), _raise_terminated)


@contextlib.contextmanager
def _handling_signals(signals, handler):
    """Within the block, `signals` go to `handler` (in the main thread: elsewhere none can be handled)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)


def main(argv: list[str] | None = None) -> int:
    from core.engine.store import StoreError

    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        args = build_parser().parse_args(argv)
        commands = {
            "demo": cmd_demo,
            "run": execute,
            "snapshot": cmd_snapshot,
            "compare": cmd_compare,
            "runs": cmd_runs,
            "report": cmd_report,
            "scenarios": cmd_scenarios,
            "devices": cmd_devices,
        }
        # the answer alone on stdout: what libraries and their processes print goes to stderr
        with terminate_like_interrupt(), stdout_for_the_answer() as answer:
            return commands[args.command](args, answer)
    except (UsageError, SpecError, StoreError) as e:
        print(f"error: {e}", file=sys.stderr)
        if debug:
            traceback.print_exc()
        return EXIT_ERROR
    except Terminated as e:
        print(f"interrupted: received {e.signame}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:
        # `weightdrift runs | head -1`: nothing to report; stdout to /dev/null, so the exit's flush is quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    except Exception as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        if debug:
            traceback.print_exc()
        return EXIT_ERROR


def ensure_demo(home: Path) -> dict[str, Any]:
    """Build (or find) the demo workspace, with progress on stderr."""
    from core.demo.build import build_demo

    return build_demo(
        home, progress=lambda stage, k, n: print(f"[demo] {k}/{n} {stage}", file=sys.stderr, flush=True)
    )


def cmd_demo(args, answer: TextIO) -> int:
    home = weightdrift_home(args.home)
    manifest = ensure_demo(home)
    if args.json:
        print(json.dumps({key: manifest[key] for key in ("models", "adapters")}, indent=2), file=answer)
    else:
        print(f"demo workspace: {home / 'demo'}", file=answer)
        for name, path in manifest["models"].items():
            print(f"  model    {name:12s} {path}", file=answer)
        for name, a in manifest["adapters"].items():
            print(f"  adapter  {name:12s} {a['type']:5s} for {a['base']:11s} {a['path']}", file=answer)
    return EXIT_OK


def spec_from_args(args, home: Path) -> ProbeSpec:
    """Build the ProbeSpec of `run` from its arguments (filling in the demo where asked)."""
    from core.demo.workspace import demo_selection

    if args.scenario:
        return scenario_from_args(args, home)
    base = args.base
    adapters = [AdapterRef.parse(a) for a in args.adapter]
    if args.demo:
        manifest = ensure_demo(home)
        if base is None:
            base, demo_adapters = demo_selection(manifest)
            adapters = adapters or demo_adapters
    if base is None:
        raise UsageError("--base is required (or --demo)")
    if not args.target:
        raise UsageError("--target is required, e.g. --target cpu/float32 cpu/bfloat16")
    targets = [Target.parse(t) for t in args.target]
    if len(set(targets)) != len(targets):
        raise UsageError("a target is given twice")
    tolerances = {}
    if args.atol is not None or args.rtol is not None:
        tolerances["*"] = ToleranceOverride(rtol=args.rtol, atol=args.atol)
    return ProbeSpec(
        base=ModelRef(path=base, trust_remote_code=args.trust_remote_code),
        adapters=tuple(adapters),
        targets=tuple(targets),
        checks=known_checks(args.check) if args.check else DEFAULT_CHECKS,
        tolerances=tolerances,
        seed=args.seed,
        strategies=tuple(dict.fromkeys(["isolated", *args.strategy])),
        merge_subset=tuple(args.merge_subset),
        keep_tensors=args.keep_tensors,
        reference=Target.parse(args.reference) if args.reference else REFERENCE_TARGET,
        peers=not args.no_peers,
        probe=ProbeInputs(prompts=prompts_from_args(args)),
        max_new_tokens=_max_new_tokens(args) or DEFAULT_MAX_NEW_TOKENS,
        task_timeout_s=args.task_timeout,
    )


def prompts_from_args(args) -> tuple[str, ...]:
    """`--prompt` texts, then `--prompt-file`'s prompts (`spec.prompts_from_text`)."""
    from core.spec import prompts_from_text

    prompts = list(args.prompt)
    if args.prompt_file:
        try:
            text = Path(args.prompt_file).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read the prompt file {args.prompt_file}: {e}") from e
        prompts += prompts_from_text(text)
    if any(not p.strip() for p in prompts):
        raise UsageError("--prompt is empty: give text to tokenize")
    return tuple(prompts)


def _max_new_tokens(args) -> int | None:
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens}: give at least 1")
    return args.max_new_tokens


def scenario_from_args(args, home: Path) -> ProbeSpec:
    """The spec of `--scenario NAME` on the demo workspace; --target/--check/--seed/tolerances override it."""
    import dataclasses

    from core.demo.scenarios import scenario_spec
    from core.models.targets import discover_devices

    if args.base or args.adapter:
        raise UsageError("--scenario picks the base and adapters itself; leave out --base and --adapter")
    spec = scenario_spec(args.scenario, ensure_demo(home), discover_devices())
    changes: dict[str, Any] = {"seed": args.seed, "peers": not args.no_peers}
    changes["task_timeout_s"] = args.task_timeout
    if args.target:
        changes["targets"] = tuple(Target.parse(t) for t in args.target)
    if args.check:
        changes["checks"] = tuple(args.check)
    if args.strategy:
        changes["strategies"] = tuple(dict.fromkeys(["isolated", *args.strategy]))
    if args.merge_subset:
        changes["merge_subset"] = tuple(args.merge_subset)
    if args.keep_tensors:
        changes["keep_tensors"] = True
    if args.reference:
        changes["reference"] = Target.parse(args.reference)
    if args.atol is not None or args.rtol is not None:
        changes["tolerances"] = {"*": ToleranceOverride(rtol=args.rtol, atol=args.atol)}
    prompts = prompts_from_args(args)
    if prompts:
        changes["probe"] = dataclasses.replace(spec.probe, prompts=prompts)
    if _max_new_tokens(args) is not None:
        changes["max_new_tokens"] = args.max_new_tokens
    return dataclasses.replace(spec, **changes)


def cmd_scenarios(args, answer: TextIO) -> int:
    from core.demo.scenarios import SCENARIOS

    if args.json:
        print(
            json.dumps(
                [
                    {"name": s.name, "title": s.title, "page": s.page, "description": s.description}
                    for s in SCENARIOS.values()
                ],
                indent=2,
            ),
            file=answer,
        )
    else:
        for s in SCENARIOS.values():
            print(f"{s.name:32s} [{s.page}] {s.title}: {s.description}", file=answer)
    return EXIT_OK


def cmd_snapshot(args, answer: TextIO) -> int:
    """`run`, then its captures packed into one file (`core.engine.snapshot`)."""
    from core.engine.snapshot import write_snapshot

    out = Path(args.output).expanduser()

    def pack(record) -> dict[str, Any]:
        try:
            write_snapshot(record.run_dir, record.spec, out, machine=args.machine)
        except OSError as e:
            raise UsageError(f"cannot write the snapshot {out}: {e.strerror or e}") from e
        size = out.stat().st_size
        print(f"snapshot {out}: {size / 2**20:.2f} MiB", file=sys.stderr, flush=True)
        return {"snapshot": str(out), "snapshot_bytes": size}

    code = execute(args, answer, after=pack)
    return EXIT_ERROR if code == EXIT_ERROR else EXIT_OK


def cmd_compare(args, answer: TextIO) -> int:
    """A run whose targets are the snapshots' captures (plus `--run` runs' and local `--target`s)."""
    import tempfile

    from core.engine.snapshot import comparison, read_snapshot, write_snapshot
    from core.engine.store import Store

    if not args.files and not args.run:
        raise UsageError("give at least one snapshot FILE (or --run RUN_ID)")

    def plan(home: Path):
        snapshots = [read_snapshot(f) for f in args.files]
        store = Store(home)
        for run_id in args.run:
            # a stored run joins as a snapshot of it: one way to import captures
            try:
                record = store.open(run_id)
            except KeyError as e:
                raise UsageError(
                    f"no run {run_id} in {store.runs_dir} (python -m core runs lists them)"
                ) from e
            if record.status != "succeeded" or record.spec is None:
                raise UsageError(f"run {run_id} is {record.status}: only a finished run can be compared")
            path = write_snapshot(record.run_dir, record.spec, Path(tmp) / f"{run_id}.wdsnap")
            snapshots.append(read_snapshot(path))
        base = ModelRef(path=args.base) if args.base else None
        adapters = [AdapterRef.parse(a) for a in args.adapter] or None
        targets = [Target.parse(t) for t in args.target]
        if any(t.machine for t in targets):
            raise UsageError(
                "--target names a target of this machine (DEVICE/DTYPE[+FLAG…]), without a machine"
            )
        return comparison(snapshots, targets, base, adapters, home=home, peers=not args.no_peers)

    def sources(record) -> dict[str, Any]:
        return {"snapshots": record.imported()}

    # the captures of --run runs are packed here, and unpacked into the new run before it starts
    with tempfile.TemporaryDirectory(prefix="weightdrift-compare-") as tmp:
        return execute(args, answer, plan, after=sources)


def execute(args, answer: TextIO, plan=None, after=None) -> int:
    """Run a spec as a job with progress on stderr, its summary (or JSON) to `answer`; the exit code.
    `plan(home)` gives the spec and what installs imported captures into its run folder (`Engine.submit`),
    by default `run`'s from the arguments: read, and its folders looked at, before any worker starts; the
    demo's and a scenario's (built first) once the workers start importing. `after(record)` runs once the
    run succeeded and returns what to add to the report."""
    from core.engine.jobs import Engine
    from core.engine.ray_runner import make_runner
    from core.engine.runners import InProcessRunner, fresh_spares

    quantized = True  # unknown until the demo or a scenario is built, or snapshots are read
    if plan is None and not (args.demo or args.scenario):
        # given paths, not the demo's: a typo or a wrong folder is answered before a worker starts
        given = spec_from_args(args, weightdrift_home(args.home))
        input_folders(given)
        quantized = given.loads_quantized

        def plan(home: Path):
            return given, None

    runner = InProcessRunner() if args.in_process else make_runner(args.runner, args.ray_address)
    # workers import the libraries while this process reads the inputs (memory timelines' too)
    runner.warm(fresh_spares(getattr(args, "check", None)), quantized=quantized)
    try:
        return _run_and_report(args, answer, Engine, runner, plan, after)
    finally:
        runner.kill_all()  # a worker made ready for a task that never came


def _run_and_report(args, answer: TextIO, engine_class, runner, plan=None, after=None) -> int:
    from core import report
    from core.engine.store import RunRecord

    home = weightdrift_home(args.home)
    spec, install = plan(home) if plan is not None else (spec_from_args(args, home), None)
    engine = engine_class(home, runner=runner)
    job = engine.submit(spec, install=install)
    added = ", ".join(map(str, job.spec.added_peers))
    print(
        f"run {job.run_id}: {len(job.spec.targets)} target(s), checks {', '.join(spec.checks)}"
        + (f" (added as peers: {added})" if added else ""),
        file=sys.stderr,
    )
    watcher = threading.Thread(target=watch, args=(job,), daemon=True)  # bars on a terminal
    watcher.start()
    try:
        job.wait()
    except KeyboardInterrupt as e:
        why = f"received {e.signame}" if isinstance(e, Terminated) else "received SIGINT (Ctrl-C)"
        print(f"cancelling run {job.run_id}: {why}; stopping its workers", file=sys.stderr, flush=True)
        # A second signal while the workers stop must not leave them behind: shutdown kills them.
        with _handling_signals((signal.SIGINT, signal.SIGTERM, signal.SIGHUP), signal.SIG_IGN):
            engine.shutdown(f"cancelled: the CLI {why}")
    watcher.join(timeout=2)
    snap = job.snapshot()
    try:
        record = engine.store.open(job.run_id)
    except KeyError:  # its folder was removed from outside while it ran
        record = RunRecord(
            job.run_id, job.run_dir, {"status": "failed", "error": f"{job.run_dir} was removed"}
        )
    status, error = record.status, record.error
    if snap["store_error"] is not None:  # run.json could not be kept: the job knows better
        status, error = snap["state"], snap["error"]
    table = record.metrics() if status == "succeeded" else None
    duration = record.info.get("duration_s")
    if table is None:
        if args.json:
            print(
                json.dumps(
                    {
                        "run_id": job.run_id,
                        "run_dir": str(record.run_dir),
                        "status": status,
                        "error": error,
                        "verdicts": {},
                        "worst": [],
                    }
                ),
                file=answer,
            )
        print(f"error: run {job.run_id} {status}: {error}", file=sys.stderr)
        return EXIT_ERROR
    code = report.exit_code(table)
    extra = after(record) if after is not None else {}
    judgement = record.judgement(table)
    if args.json:
        worst = report.worst_rows(table, args.top)
        by = report.verdicts_by_check_target(table)
        print(
            json.dumps(
                {
                    "run_id": job.run_id,
                    "run_dir": str(record.run_dir),
                    "status": status,
                    "duration_s": duration,
                    "exit_code": code,
                    **judgement.answer_json(table),  # groups, rewrites, anomalies
                    "verdicts": report.verdict_counts(table),
                    "verdicts_by_check_target": report.records(by),
                    "worst": report.records(worst),
                    "notes": record.notes(),
                    **_divergences(table),
                    **extra,
                },
                indent=2,
                default=str,
            ),
            file=answer,
        )
    else:
        findings = (
            judgement.lines()
            + report.served_elsewhere(record.table("pairwise"))
            + [s for found in _divergences(table).values() for s in found.values()]
        )
        lines = report.summary_lines(job.run_id, record.run_dir, duration, table, min(args.top, 3), findings)
        print("\n".join(lines), file=answer)
        for note in record.notes():
            print(f"note: {note}", file=answer)
        for key, value in extra.items():
            if key == "snapshots":  # where an imported run's targets came from, one line each
                for i in value:
                    targets = ", ".join(i["targets"])
                    print(f"from {i['snapshot']}: machine {i['machine']}, targets {targets}", file=answer)
            else:
                print(f"{key}: {value}", file=answer)
    return code


def _divergences(table) -> dict[str, Any]:
    """Where each target parts from the reference: {"first_divergence": {target (· adapter): sentence}}
    from activations rows, {"generation_divergence": …} from generate rows; a key only where its check ran."""
    from core.checks.activations import divergence_sentences as modules
    from core.checks.generate import divergence_sentences as generations

    found = {"first_divergence": modules(table), "generation_divergence": generations(table)}
    return {key: sentences for key, sentences in found.items() if sentences}


def cmd_runs(args, answer: TextIO) -> int:
    from core.engine.store import Store

    store = Store(weightdrift_home(args.home))
    runs = store.list_runs()
    if args.json:
        listed = [{**r.info, "run_id": r.run_id, "run_dir": str(r.run_dir)} for r in runs]
        print(json.dumps(listed, default=str), file=answer)
        return EXIT_OK
    if not runs:
        print(f"no runs in {store.runs_dir}", file=answer)
    for r in runs:
        targets = ", ".join(str(t) for t in r.spec.targets) if r.spec else "?"
        when = r.info.get("created")
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) if when else "unknown".ljust(19)
        dur = r.info.get("duration_s")
        line = f"{r.run_id}  {r.status:10s} {created}  {'' if dur is None else f'{dur:.1f} s':>8s}  {targets}"
        if r.error:
            line += f"  — {r.error.splitlines()[0]}"
        if r.id_note:
            line += f"  — note: {r.id_note}"
        print(line, file=answer)
    return EXIT_OK


def cmd_report(args, answer: TextIO) -> int:
    """One HTML file of a stored run, drawn by the dashboard's figure builders (docs/architecture.md)."""
    from dashboard.report import write_report

    written = write_report(weightdrift_home(args.home), args.run_id, Path(args.output))
    print(f"report {written}", file=sys.stderr)
    return EXIT_OK


def cmd_devices(args, answer: TextIO) -> int:
    from core.models.targets import devices_lines, devices_report

    info = devices_report()
    text = json.dumps(info, indent=2, default=str) if args.json else "\n".join(devices_lines(info))
    print(text, file=answer)
    return EXIT_OK
