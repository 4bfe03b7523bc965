"""The command line's grammar: `python -m core`'s subcommands and their options (`build_parser`); what
each command does is `core.cli`'s. docs/cli.md is generated from this parser (`core.cli_reference`)."""

from __future__ import annotations

import argparse

from core.spec import DEFAULT_CHECKS, DEFAULT_MAX_NEW_TOKENS

HOME_HELP = "WeightDrift home (default $WEIGHTDRIFT_HOME or ~/.cache/weightdrift)"


class UsageError(Exception):
    """A command line that cannot be run; the message says why."""


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse exits with 2 as well; keep its message one line
        raise UsageError(message)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m core", description="WeightDrift: numerical drift of PEFT adapters.")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)

    demo = sub.add_parser("demo", help="build (or find) the demo workspace")
    demo.add_argument("--home", help=HOME_HELP)
    demo.add_argument("--json", action="store_true", help="print the workspace's models and adapters as JSON")

    run = sub.add_parser("run", help="run checks on targets and print a verdict summary")
    add_run_options(run)

    snapshot = sub.add_parser(
        "snapshot",
        help="run the captures on this machine and write them to one portable snapshot file",
        description="The same inputs as `run`; the run is stored here too, and its captures (rows, sketches, "
        "content hashes, logits, environment, memory timelines) go into FILE with the hashes of the "
        "checkpoint files. Exit 0 when FILE is written, 2 otherwise.",
    )
    add_run_options(snapshot)
    snapshot.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="FILE",
        help="the snapshot file to write (e.g. gpu-box.wdsnap)",
    )
    snapshot.add_argument(
        "--machine", help="the machine name its targets carry when compared (default: this host's name)"
    )

    compare = sub.add_parser(
        "compare",
        help="compare snapshots (and local targets) as one run: same metrics table, same exit codes as run",
    )
    compare.add_argument("files", nargs="*", metavar="FILE", help="snapshot files (python -m core snapshot)")
    compare.add_argument(
        "--run",
        metavar="RUN_ID",
        action="extend",
        nargs="+",
        default=[],
        help="a stored run of this home whose captures join the comparison as this machine's targets",
    )
    compare.add_argument(
        "--target",
        action="extend",
        nargs="+",
        default=[],
        metavar="SPEC",
        help="local targets to run here and compare too (needs the same base and adapters here)",
    )
    compare.add_argument(
        "--base", help="the base model here, for local targets (default: the path the snapshot recorded)"
    )
    compare.add_argument(
        "--adapter",
        action="extend",
        nargs="+",
        default=[],
        metavar="PATH=NAME",
        help="the adapters here, by the snapshot's names (default: the paths the snapshot recorded)",
    )
    add_runner_options(compare)
    add_peer_option(compare)
    compare.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    compare.add_argument("--home", help=HOME_HELP)
    compare.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    compare.add_argument(
        "--top", type=int, default=10, help="how many worst rows to report (3 per check in text)"
    )

    report = sub.add_parser("report", help="write a stored run as one self-contained HTML file (for a bug)")
    report.add_argument("run_id", metavar="RUN_ID", help="the run (python -m core runs lists them)")
    report.add_argument("-o", "--output", required=True, metavar="FILE", help="the HTML file to write")
    report.add_argument("--home", help=HOME_HELP)

    runs = sub.add_parser("runs", help="list stored runs")
    runs.add_argument("--home", help=HOME_HELP)
    runs.add_argument("--json", action="store_true", help="print the runs as JSON")

    scenarios = sub.add_parser("scenarios", help="list the demo scenarios")
    scenarios.add_argument("--json", action="store_true", help="print the scenarios as JSON")

    devices = sub.add_parser("devices", help="print the devices and the environment")
    devices.add_argument("--json", action="store_true", help="print devices and environment as JSON")
    return p


def add_runner_options(p: ArgumentParser) -> None:
    """Where the tasks run: local worker processes (default) or Ray tasks (core.engine.ray_runner)."""
    p.add_argument(
        "--runner",
        choices=("process", "ray"),
        default="process",
        help="process: a worker process per target on this machine (default); ray: a Ray task per "
        "target, on this or other machines (pip install -r requirements-ray.txt)",
    )
    p.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="the Ray cluster for --runner ray: auto, HOST:PORT or ray://HOST:10001 (default: a local Ray "
        "started for this run)",
    )


def add_peer_option(p: ArgumentParser) -> None:
    """`--no-peers` (run, snapshot, compare): judge no target against its peer (core.judgement)."""
    p.add_argument(
        "--no-peers",
        action="store_true",
        help="add no peer target (the CPU target of each target's dtype, without flags) and judge no row "
        "against one: no anomalies are reported",
    )


def add_run_options(run: ArgumentParser) -> None:
    """The options of `run`, shared with `snapshot` (the same inputs, the same checks)."""
    run.add_argument("--base", help="base model folder or hub id")
    run.add_argument(
        "--adapter",
        action="extend",
        nargs="+",
        default=[],
        metavar="PATH[=NAME]",
        help="adapter folders or hub ids, each named NAME (default: its folder's name), loaded in this order",
    )
    run.add_argument(
        "--target",
        action="extend",
        nargs="+",
        default=[],
        metavar="SPEC",
        help="DEVICE/DTYPE[+tf32|+deterministic|+threads=N|+matmul=P|+node=NAME (with --runner ray)], e.g. "
        "cpu/bfloat16; DTYPE nf4|fp4|int8 is bitsandbytes', nf4/fp4 +compute=D|+double_quant|+portable",
    )
    run.add_argument(
        "--check",
        action="extend",
        nargs="+",
        default=[],
        metavar="NAME",
        help=f"checks to run (default: {' '.join(DEFAULT_CHECKS)}); docs/metrics.md describes each",
    )
    run.add_argument(
        "--strategy",
        action="extend",
        nargs="+",
        default=[],
        metavar="NAME",
        help="load strategies the adapters check runs side by side (isolated is always added)",
    )
    run.add_argument(
        "--merge-subset",
        action="extend",
        nargs="+",
        default=[],
        metavar="NAME",
        help="adapter names the merge check merges together (adapter_names=)",
    )
    run.add_argument(
        "--scenario",
        metavar="NAME",
        help="run a demo scenario (implies --demo); `python -m core scenarios` lists them",
    )
    run.add_argument("--atol", type=float, help="absolute tolerance for every row (default: per dtype)")
    run.add_argument("--rtol", type=float, help="relative tolerance for every row (default: per dtype)")
    run.add_argument("--seed", type=int, default=0, help="seed of the probe inputs")
    run.add_argument(
        "--prompt",
        action="append",
        default=[],
        metavar="TEXT",
        help="probe with this text through the checkpoint's own tokenizer (repeatable; one probe row each)",
    )
    run.add_argument("--prompt-file", metavar="FILE", help="prompts, one a line (blank lines are skipped)")
    run.add_argument(
        "--max-new-tokens",
        type=int,
        metavar="N",
        help=f"tokens the generate check decodes greedily per prompt (default {DEFAULT_MAX_NEW_TOKENS})",
    )
    run.add_argument(
        "--reference",
        metavar="SPEC",
        help="the target outputs are compared against (default cpu/float64), e.g. cpu/float32",
    )
    run.add_argument(
        "--keep-tensors",
        action="store_true",
        help="keep every compared tensor whole in the run (element-wise drill-down); by default a base "
        "larger than 256 MiB keeps each tensor's row and a bounded sketch",
    )
    run.add_argument(
        "--demo",
        action="store_true",
        help="use the demo workspace: tiny-llama and all its adapters, unless --base/--adapter are given",
    )
    run.add_argument(
        "--trust-remote-code", action="store_true", help="allow the model's own code (off by default)"
    )
    add_runner_options(run)
    run.add_argument(
        "--task-timeout", type=float, metavar="SECONDS", help="kill a task past it; its rows read broken"
    )
    add_peer_option(run)
    run.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    run.add_argument("--home", help=HOME_HELP)
    run.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    run.add_argument(
        "--top", type=int, default=10, help="how many worst rows to report (3 per check in text)"
    )
