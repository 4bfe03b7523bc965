"""Demo scenarios: named runs on the demo workspace that reproduce one problem in one click.

Each scenario builds a ProbeSpec from the demo manifest (`core.demo`) and this machine's devices.
The dashboard offers a page's scenarios as buttons (`dashboard.ui.scenario_buttons`); the CLI runs
one with `python -m core run --scenario NAME`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from core.spec import AdapterRef, ModelRef, ProbeSpec, SpecError, Target
from core.targets import Device


@dataclass(frozen=True)
class Scenario:
    """One reproducible problem on the demo workspace."""

    name: str  # slug for the CLI (--scenario) and tests, e.g. "bf16-merge-residual"
    title: str  # button text
    page: str  # url_path of the page that offers it: "merge", "memory", "adapters", "drift"
    description: str  # what it shows, in a sentence or two
    build: Callable[[dict, list[Device]], ProbeSpec]  # (demo manifest, devices) -> spec


SCENARIOS: dict[str, Scenario] = {}


def register(scenario: Scenario) -> Scenario:
    """Add a scenario to the registry (names are unique)."""
    if scenario.name in SCENARIOS:
        raise ValueError(f"scenario {scenario.name!r} is registered twice")
    SCENARIOS[scenario.name] = scenario
    return scenario


def scenarios_for(page: str) -> list[Scenario]:
    """The scenarios a page offers, in registration order."""
    return [s for s in SCENARIOS.values() if s.page == page]


def scenario_spec(name: str, manifest: dict, devices: list[Device]) -> ProbeSpec:
    """The spec of scenario `name` on this demo workspace and machine; SpecError for an unknown name."""
    scenario = SCENARIOS.get(name)
    if scenario is None:
        raise SpecError(f"unknown scenario {name!r}; available: {', '.join(SCENARIOS)}")
    return scenario.build(manifest, devices)


def demo_spec(
    manifest: dict,
    adapters: tuple[str, ...] | list[str],
    targets: tuple[str, ...] | list[str],
    checks: tuple[str, ...] | list[str],
    base: str = "tiny-llama",
    **fields,
) -> ProbeSpec:
    """A spec on the demo workspace: demo adapter names in order (each loaded under its own name)."""
    missing = [a for a in adapters if a not in manifest["adapters"]]
    if missing:
        raise SpecError(
            f"the demo workspace has no adapter {', '.join(missing)}; rebuild it (python -m core demo)"
        )
    return ProbeSpec(
        base=ModelRef(path=manifest["models"][base]),
        adapters=tuple(AdapterRef(path=manifest["adapters"][a]["path"], name=a) for a in adapters),
        targets=tuple(Target.parse(t) for t in targets),
        checks=tuple(checks),
        **fields,
    )


def last_cuda(devices: list[Device]) -> str | None:
    """`cuda:N` for the highest N this machine has, or None without CUDA."""
    cuda = [d.name for d in devices if d.name.startswith("cuda:")]
    return max(cuda, key=lambda n: int(n.split(":")[1])) if cuda else None


# --- issue 4: merge residuals ---------------------------------------------------------------------


# --- issue 5: memory placement --------------------------------------------------------------------


# --- issue 6: adapter consistency -----------------------------------------------------------------
