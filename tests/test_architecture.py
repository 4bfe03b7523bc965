"""The layering (docs/architecture.md, "Where things live"): core/ and the figure builders never import
Streamlit, each package imports only the packages below it (ALLOWED), and no folder or file grows past
what a reader can hold."""

from __future__ import annotations

import ast
import pkgutil
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import core

ROOT = Path(__file__).resolve().parent.parent

# Package → the core/dashboard packages it may import besides itself (stdlib and third party are free).
LOWER = {
    "core.engine",
    "core.checks",
    "core.models",
    "core.methods",
    "core.numerics",
    "core.capture",
    "core.spec",
}
ALLOWED: dict[str, set[str]] = {
    "dashboard": {"dashboard", "core.demo", "core.report", "core.judgement", *LOWER},
    "core.cli": {"core.demo", "core.report", "core.judgement", "core.progress", *LOWER},
    "core.demo": LOWER,
    "core.engine": (LOWER | {"core.report", "core.judgement"}) - {"core.engine"},
    "core.checks": {"core.models", "core.methods", "core.numerics", "core.capture", "core.spec"},
    "core.capture": {"core.numerics", "core.spec"},
    "core.models": {"core.methods", "core.numerics", "core.spec"},
    "core.methods": {"core.numerics", "core.spec"},
    "core.numerics": {"core.spec"},
    "core.report": set(),
    "core.progress": set(),
    "core.judgement": set(),
    "core.spec": set(),
    "core.__main__": {"core.cli"},
    "core.cli_reference": {"core.cli"},  # docs/cli.md from the parser; nothing imports it
    "core": set(),  # core/__init__.py
    # the notebook API: a facade over core (the demo included); draws with the dashboard's pure modules
    "weightdrift": {"weightdrift", "core.demo", "core.report", "core.judgement", *LOWER},
}
# The dashboard's modules that import no Streamlit (the figure builders, text, the report), and the
# layers outside the dashboard that may import them: the CLI's `report` command writes the report the
# Overview's button downloads; the notebook API draws the dashboard's figures.
PURE_DASHBOARD = ("dashboard.report", "dashboard.figures", "dashboard.text")
PURE_USERS: dict[str, tuple[str, ...]] = {"core.cli": ("dashboard.report",), "weightdrift": PURE_DASHBOARD}
PACKAGES = ("core", "dashboard", "weightdrift")
MAX_LINES = 700
# A folder holds as many features as there are (DESIGN.md): no module count. What a budget made instead
# is a module named for its size or its overflow, not for what it is; the one that remains is issue 39's.
# A number counts after an underscore (`metrics_2`): a PEFT method's own name may end in one (`families/ia3.py`).
OVERFLOW_NAME = re.compile(r"(_more|_parts|_extra|_misc|_rest|_overflow|_\d+)$")
NAMED_FOR_SIZE = {"core/numerics/_kernel_parts.py"}


def layer_name(module: str) -> str:
    """The layer a `core.*` / `dashboard.*` / `weightdrift.*` module belongs to (its package in the table)."""
    if module.startswith(("dashboard", "weightdrift")):
        return module.split(".")[0]
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else "core"


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(root: Path, path: Path) -> list[str]:
    """Every core/dashboard module `path` imports, at module level or inside a function, relative ones
    resolved. `from pkg import name` counts as importing `pkg.name` when that is a module file, else `pkg`."""
    name = _module_name(root, path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                as_file = root.joinpath(*sub.split("."))
                is_module = as_file.with_suffix(".py").is_file() or (as_file / "__init__.py").is_file()
                targets.append(sub if is_module else base)
        else:
            continue
        found += [t for t in targets if t.split(".")[0] in PACKAGES]
    return found


def check_layers(root: Path) -> dict[str, list[str]]:
    """Every breach of the rules under `root` (a folder holding core/, dashboard/, weightdrift/), by rule."""
    files = sorted(p for d in PACKAGES for p in (root / d).rglob("*.py"))
    problems: dict[str, list[str]] = defaultdict(list)
    # every import between modules, those inside functions too: a circle closed by a function-level
    # import still ties the modules together (neither can be read, moved or tested without the other)
    graph: dict[str, set[str]] = defaultdict(set)
    layers: dict[str, set[str]] = defaultdict(set)  # every import between layers
    for path in files:
        importer = _module_name(root, path)
        for imported in _imports(root, path):
            src, dst = layer_name(importer), layer_name(imported)
            pure = any(imported == m or imported.startswith(m + ".") for m in PURE_USERS.get(src, ()))
            if dst != src and dst not in ALLOWED.get(src, set()) and not pure:
                problems["layer"].append(f"{importer} imports {imported} ({src} may not import {dst})")
            if dst == "core.demo" and src not in ("core.cli", "dashboard", "core.demo", "weightdrift"):
                problems["layer"].append(
                    f"{importer} imports {imported} (only core.cli and the dashboard may)"
                )
            if dst != src:
                layers[src].add(dst)
            if imported != importer:
                graph[importer].add(imported)
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_LINES:
            problems["size"].append(f"{path.relative_to(root)} has {lines} lines (at most {MAX_LINES})")
    for path in files:
        name = str(path.relative_to(root))
        if OVERFLOW_NAME.search(path.stem) and name not in NAMED_FOR_SIZE:
            problems["size"].append(f"{name} is named for its size, not for what it holds")
    for label, edges in (("package", layers), ("module", graph)):
        for cycle in _cycles(edges):
            problems["cycle"].append(f"{label} import cycle: {' → '.join(cycle)}")
    return dict(problems)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The cycles a depth-first walk of `edges` closes (one per back edge, so every circle is named at
    least once), each as its nodes with the first repeated; empty if the graph is acyclic."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                found.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return found


def test_core_the_figures_the_report_and_the_api_import_without_streamlit():
    modules = sorted(
        m.name for m in pkgutil.walk_packages(core.__path__, "core.") if not m.name.endswith("__main__")
    )
    figures = ROOT / "dashboard" / "figures"
    modules += [
        "dashboard.figures",
        *(f"dashboard.figures.{p.stem}" for p in sorted(figures.glob("[!_]*.py"))),
        "dashboard.report",
        "dashboard.text",
        "weightdrift",
        *(f"weightdrift.{p.stem}" for p in sorted((ROOT / "weightdrift").glob("[!_]*.py"))),
    ]
    assert "core.engine.worker" in modules and "dashboard.figures.common" in modules
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print('streamlit' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", (
        "core/, the dashboard's pure modules or weightdrift/ pulled in Streamlit"
    )


def test_layers_sizes_and_cycles():
    problems = check_layers(ROOT)
    assert not problems, "\n".join(p for found in problems.values() for p in found)


def test_the_checker_names_a_wrong_way_import_a_cycle_and_an_oversized_file(tmp_path):
    def write(rel: str, text: str = "") -> None:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    for pkg in ("core", "core/numerics", "core/engine", "dashboard"):
        write(f"{pkg}/__init__.py")
    write("core/numerics/x.py", "from core.engine.jobs import Engine\n")
    write(
        "core/engine/jobs.py",
        "from core.numerics import x\n\n\ndef f():\n    from ..numerics import x  # noqa\n",
    )
    write("core/spec.py", "def f():\n    import dashboard.app\n" + "\n" * MAX_LINES)
    write("core/numerics/metrics_more.py", "")  # named for its size
    # the CLI may import the report (no Streamlit), not the rest of the dashboard
    write("core/cli.py", "def f():\n    from dashboard.report import a\n    from dashboard.state import b\n")
    write("dashboard/app.py", "from core import cli\n")
    # a circle inside one package, closed only by an import inside a function
    write("core/models/__init__.py")
    write("core/models/checkpoint.py", "from core.models import validate\n")
    write("core/models/validate.py", "def f():\n    from core.models.checkpoint import Checkpoint  # noqa\n")
    problems = check_layers(tmp_path)
    layer = "\n".join(problems["layer"])
    assert "core.numerics.x imports core.engine.jobs" in layer
    assert "core.spec imports dashboard.app" in layer
    assert "dashboard.app imports core.cli" in layer
    assert "core.cli imports dashboard.state" in layer and "imports dashboard.report" not in layer
    assert "core.engine.jobs" not in layer.replace(
        "core.numerics.x imports core.engine.jobs", ""
    )  # allowed way
    assert any("core.numerics.x" in c and "core.engine.jobs" in c for c in problems["cycle"])
    assert (
        "module import cycle: core.models.checkpoint → core.models.validate → core.models.checkpoint"
        in (problems["cycle"])
    )
    assert sorted(problems["size"]) == [
        "core/numerics/metrics_more.py is named for its size, not for what it holds",
        f"core/spec.py has {MAX_LINES + 2} lines (at most {MAX_LINES})",
    ]
