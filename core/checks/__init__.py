"""The checks, one module each, and their registry (name → Check instance): what a check measures on
a loaded model and writes into a capture. May import core.models, core.methods, core.numerics,
core.capture and core.spec — never core.engine, core.demo, core.cli or the dashboard."""

from __future__ import annotations

from core.checks.activations import ActivationsCheck
from core.checks.adapters import AdaptersCheck
from core.checks.base import Check
from core.checks.deltas import DeltasCheck
from core.checks.generate import GenerateCheck
from core.checks.memory import MemoryCheck
from core.checks.merge import MergeCheck
from core.checks.outputs import OutputsCheck
from core.checks.weights import WeightsCheck
from core.spec import known_checks

CHECKS: dict[str, Check] = {
    c.name: c
    for c in (
        WeightsCheck(),
        DeltasCheck(),
        OutputsCheck(),
        MemoryCheck(),
        MergeCheck(),
        AdaptersCheck(),
        ActivationsCheck(),
        GenerateCheck(),
    )
}


def get_checks(names: tuple[str, ...] | list[str]) -> list[Check]:
    """The Check objects for `names`, in order; SpecError naming the unknown ones."""
    return [CHECKS[n] for n in known_checks(names, CHECKS)]
