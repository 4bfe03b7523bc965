"""Scheduling: a run's capture tasks and partial compares, which of them run at once (lanes), at which
niceness, and which waits for which (docs/workers.md, "Which tasks run at once").

Plain data made from a spec (`plan`): no process, no thread. `core.engine.jobs` runs what it says.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from core.engine.tasks import BACKGROUND_NICENESS, Task
from core.spec import ProbeSpec, Target

# The named policies a run's CPU tasks are placed by (`Schedule.policy`)
DEVICE_LANES = "one lane per device"  # a large model, or a runner that runs one task at a time
SMALL_MODEL_LANES = "a small model's CPU lanes"  # a lane per target, memory timelines' lanes, niceness


def capture_passes(spec: ProbeSpec, checks: list) -> list[tuple[str, ...]]:
    """The shared load loop's checks, per pass over the loaded models (each pass a worker per target).

    A small base (up to CAPTURE_PASSES_UP_TO) is loaded twice: first for the checks compared against
    the checkpoint files (no forward pass, no reference target), whose rows come first, then for the
    others. A larger one is loaded once, for all of them.
    """
    shared = [c for c in checks if not c.own_worker]
    first = tuple(c.name for c in shared if not c.needs_reference_target)
    rest = tuple(c.name for c in shared if c.needs_reference_target)
    if not first or not rest:
        return [first or rest] if shared else []
    return [first, rest] if small_base(spec) else [first + rest]


def small_base(spec: ProbeSpec) -> bool:
    """Whether the run's base checkpoint holds at most CAPTURE_PASSES_UP_TO bytes (unknown: large)."""
    from core.models.checkpoint import base_bytes
    from core.spec import CAPTURE_PASSES_UP_TO

    size = base_bytes(spec)
    return size is not None and size <= CAPTURE_PASSES_UP_TO


def capture_tasks(spec: ProbeSpec, run_dir: str) -> list[Task]:
    """Every capture task of a run, in the order each device runs them: the shared load loop's passes
    (`capture_passes`), each with the reference first where its checks need it, then the own-worker
    checks' tasks."""
    from core.checks import get_checks

    checks = get_checks(spec.checks)
    by_name = {c.name: c for c in checks}
    passes = capture_passes(spec, checks)
    # a target imported from a snapshot has its captures in the run folder already
    local = [t for t in spec.targets if t.machine is None]
    tasks: list[Task] = []
    for names in passes:
        part = len(passes) > 1
        ref_names = tuple(n for n in names if by_name[n].needs_reference_target)
        ordered = sorted(local, key=lambda t: t != spec.reference)  # the reference first
        if ref_names and spec.reference not in spec.targets and spec.reference.machine is None:
            # the reference (not a target) has one pass only, the one whose checks need it: its
            # label stays `cpu/float64`
            tasks.append(_capture(spec, run_dir, spec.reference, ref_names))
        tasks += [_capture(spec, run_dir, t, names, part=part) for t in ordered]
    # Checks that load models their own way get a fresh worker per target and variant.
    tasks += [
        _capture(spec, run_dir, t, (c.name,), v)
        for c in checks
        if c.own_worker
        for t in local
        for v in c.variants(spec, t)
    ]
    return tasks


def _capture(
    spec: ProbeSpec,
    run_dir: str,
    target: Target,
    names: tuple[str, ...],
    variant: str | None = None,
    part=False,
) -> Task:
    return Task(
        kind="capture",
        run_dir=run_dir,
        spec=spec.to_dict(),
        target=str(target),
        checks=names,
        variant=variant,
        part=part,
    )


@dataclass(frozen=True)
class CompareGroup:
    """Checks compared together before the run ends, once every capture task they read has succeeded."""

    needs: frozenset[str]  # labels of those capture tasks
    task: Task  # the partial compare task (`Task.partial`)


def compare_groups(spec: ProbeSpec, run_dir: str, tasks: list[Task]) -> list[CompareGroup]:
    """The run's checks grouped by the capture tasks their rows need (the reference's too), each group
    compared as soon as those have succeeded."""
    needs = {c: frozenset(t.label for t in tasks if c in t.checks) for c in spec.checks}
    groups: dict[frozenset[str], list[str]] = {}
    for name, labels in needs.items():
        groups.setdefault(labels, []).append(name)
    return [
        CompareGroup(
            needs=labels,
            task=Task(kind="compare", run_dir=run_dir, spec=spec.to_dict(), checks=tuple(names)),
        )
        for labels, names in groups.items()
        if labels  # imported from snapshots only: nothing to wait for, the final compare has it
    ]


def task_lanes(
    tasks: list[Task], spec: ProbeSpec, small: bool, cpus: int, first_compare: str | None = None
) -> tuple[dict[str, list[Task]], dict[str, list[str]]]:
    """The capture tasks by lane (each lane's in order, the lanes at once), and the labels a task waits
    for before it starts beyond its lane's order (docs/workers.md, "Which tasks run at once").

    A lane is a device (cuda:0 of two Ray nodes are two devices): one model in its memory at a time. A
    small model's (`small`) CPU tasks: a lane per target (its first pass, its own-worker tasks once the
    first pass's compare `first_compare` is in, its later passes), the reference's task after the first
    pass, the memory timelines in `cpus` lanes of their own after the first pass and its compare; all
    but the first pass's at `BACKGROUND_NICENESS` (`Task.niceness`): the first page gets the CPU first.
    """
    lanes: dict[str, list[Task]] = {}
    after: dict[str, list[str]] = {}
    first_pass = [t.label for t in tasks if t.variant is None and t.part and t.checks == tasks[0].checks]
    fresh = 0
    target_lanes: set[str] = set()  # a small model's lanes of one target each, on the CPU
    for task in tasks:
        target = Target.parse(task.target)
        lane = target.device if target.node is None else f"{target.node}/{target.device}"
        if small and target.node is None and target.device == "cpu":
            if task.fresh_process:
                lane, fresh = f"cpu · fresh {fresh % cpus}", fresh + 1
                if fresh <= cpus and first_pass:  # a lane's first: the others follow it
                    after[task.label] = first_pass + ([first_compare] if first_compare else [])
            else:
                lane = f"cpu · {task.target}"
                target_lanes.add(lane)
                if task.target == str(spec.reference) and spec.reference not in spec.targets:
                    after[task.label] = first_pass
                if first_pass and task.label not in first_pass:
                    task = replace(task, niceness=BACKGROUND_NICENESS)
                if first_compare and task.variant is not None:
                    after[task.label] = [first_compare]
        lanes.setdefault(lane, []).append(task)
    for lane in target_lanes:
        lanes[lane].sort(key=lambda t: 0 if t.label in first_pass else 1 if t.variant is not None else 2)
    return lanes, after


def reference_first_waits(spec: ProbeSpec, tasks: list[Task]) -> dict[str, list[str]]:
    """The reference's capture tasks a target's task waits for where one of its checks reads the
    reference's capture while it captures (`Check.reference_first`: activations), by the task's label."""
    from core.checks import get_checks

    first_checks = {c.name for c in get_checks(spec.checks) if c.reference_first}
    reference = str(spec.reference)
    waits: dict[str, list[str]] = {}
    for task in tasks:
        wanted = first_checks.intersection(task.checks)
        if wanted and task.target != reference:
            labels = [t.label for t in tasks if t.target == reference and wanted.intersection(t.checks)]
            if labels:
                waits[task.label] = labels
    return waits


@dataclass(frozen=True)
class Schedule:
    """How a run's tasks run: its capture tasks (`tasks`, in the order `capture_tasks` lists them), by
    lane (`lanes`: each lane's in order, the lanes at once, each task at its `Task.niceness`), the labels
    each waits for beyond its lane's order (`after`: capture tasks' or partial compares'), and the
    partial compares (`groups`), `first_compare` the one the first page's rows come from."""

    policy: str  # DEVICE_LANES or SMALL_MODEL_LANES
    tasks: list[Task]
    lanes: dict[str, list[Task]]
    after: dict[str, list[str]]
    groups: list[CompareGroup]
    first_compare: str | None = None

    def waits_for(self, label: str) -> list[str]:
        """The labels the task `label` waits for before it starts, beyond its lane's order."""
        return self.after.get(label, [])


def plan(spec: ProbeSpec, run_dir: str, concurrent: bool, cpus: int) -> Schedule:
    """The schedule of a run of `spec` in `run_dir`, on a runner that runs tasks at once (`concurrent`:
    worker processes) or one at a time, on a machine with `cpus` CPUs (the memory timelines' lanes)."""
    tasks = capture_tasks(spec, run_dir)
    groups = compare_groups(spec, run_dir, tasks)
    small = concurrent and small_base(spec)
    first_compare = None
    if small and tasks and tasks[0].part:  # as the tasks: the first page's compare first
        for i, group in enumerate(groups):
            if set(group.task.checks) == set(tasks[0].checks):
                first_compare = group.task.label
            else:
                groups[i] = replace(group, task=replace(group.task, niceness=BACKGROUND_NICENESS))
    lanes, after = task_lanes(tasks, spec, small, cpus, first_compare)
    for label, labels in reference_first_waits(spec, tasks).items():
        after[label] = after.get(label, []) + labels
    policy = SMALL_MODEL_LANES if small else DEVICE_LANES
    return Schedule(policy, tasks, lanes, after, groups, first_compare)
