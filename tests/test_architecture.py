"""The layering (docs/architecture.md, "Where things live"): core/ and the figure builders never import
Streamlit, each package imports only the packages below it (ALLOWED), no import closes a circle, no
module is named for its size, and a module's private names stay its own. A long file or function is
printed as a warning, not a failure: its fix is a split by meaning, not one made to meet a count."""

from __future__ import annotations

import ast
import io
import pkgutil
import re
import subprocess
import sys
import tokenize
import warnings
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

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
# Past these a file or a function is printed as a warning (`size_warnings`), not failed.
MAX_LINES = 700
MAX_FUNCTION_LINES = 100
# A folder holds as many features as there are: no module count. What a budget made instead is a module
# named for its size or its overflow, not for what it is. A number counts after an underscore
# (`metrics_2`): a PEFT method's own name may end in one (`families/ia3.py`).
OVERFLOW_NAME = re.compile(r"(_more|_parts|_extra|_misc|_rest|_overflow|_\d+)$")
NAMED_FOR_SIZE: set[str] = set()
# Uses of another module's `_private` name (`private_uses`): each says why on its line, and there are
# at most this many. A name another module needs is public, or moves to where it is used.
PRIVATE_BUDGET = 10


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
    for path in files:
        name = str(path.relative_to(root))
        if OVERFLOW_NAME.search(path.stem) and name not in NAMED_FOR_SIZE:
            problems["name"].append(f"{name} is named for its size, not for what it holds")
    for label, edges in (("package", layers), ("module", graph)):
        for cycle in _cycles(edges):
            problems["cycle"].append(f"{label} import cycle: {' → '.join(cycle)}")
    return dict(problems)


def size_warnings(root: Path) -> list[str]:
    """Every file over `MAX_LINES` lines and every function over `MAX_FUNCTION_LINES` under `root`."""
    found = []
    for path in sorted(p for d in PACKAGES for p in (root / d).rglob("*.py")):
        name, text = path.relative_to(root), path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        if lines > MAX_LINES:
            found.append(f"{name} has {lines} lines (more than {MAX_LINES})")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(
                        f"{name}:{node.lineno} {node.name} has {length} lines (more than {MAX_FUNCTION_LINES})"
                    )
    return found


class PrivateUse(NamedTuple):
    """One module's use of another module's private name."""

    path: str  # the file using it, relative to the root
    line: int  # its first use there
    name: str  # dotted: the lending module (or the name imported from it) and the private name
    commented: bool  # whether a comment stands on the line (the import statement's lines) saying why


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(root: Path) -> list[PrivateUse]:
    """Every use under `root` (core/, dashboard/, weightdrift/, bench/) of a `_name` another module
    defines: imported (`from m import _x`, `import m._x`, a private module included) or read off a
    module or name imported from the project (`m._x`). One entry per file and name, at its first use."""
    dirs = [root / d for d in (*PACKAGES, "bench") if (root / d).is_dir()]
    return sorted(
        use
        for path in sorted(p for d in dirs for p in d.rglob("*.py"))
        for use in _private_uses_in(root, path)
    )


def _private_uses_in(root: Path, path: Path) -> list[PrivateUse]:
    rel, importer = str(path.relative_to(root)), _module_name(root, path)
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    text = path.read_text(encoding="utf-8")
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    comments = {t.start[0] for t in tokens if t.type == tokenize.COMMENT}
    bound: dict[str, str] = {}  # a local name → the project module or name it is bound to
    uses: dict[str, PrivateUse] = {}

    def use(name: str, node: ast.AST) -> None:
        if name.rpartition(".")[0] == importer:
            return  # the module's own name
        commented = bool(comments & set(range(node.lineno, node.end_lineno + 1)))
        old = uses.get(name)
        if old is None or (commented and not old.commented):
            uses[name] = PrivateUse(rel, old.line if old else node.lineno, name, commented)

    def dotted(node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return bound.get(node.id)
        if isinstance(node, ast.Attribute):
            base = dotted(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    tree = ast.parse(text, str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base.split(".")[0] not in (*PACKAGES, "bench"):
                continue
            if any(_private(part) for part in base.split(".")):
                use(base, node)
            for alias in node.names:
                if _private(alias.name):
                    use(f"{base}.{alias.name}", node)
                bound[alias.asname or alias.name] = f"{base}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] not in (*PACKAGES, "bench"):
                    continue
                if any(_private(part) for part in parts):
                    use(alias.name, node)
                bound[alias.asname or parts[0]] = alias.name if alias.asname else parts[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = dotted(node.value)
            if owner:
                use(f"{owner}.{node.attr}", node)
    return list(uses.values())


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
        "dashboard.pages",
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


def test_layers_names_and_cycles():
    problems = check_layers(ROOT)
    assert not problems, "\n".join(p for found in problems.values() for p in found)
    for found in size_warnings(ROOT):  # a long file or function: a split by meaning is due, not a failure
        print(found)
        warnings.warn(found, stacklevel=1)


def test_names_a_module_lends_are_public():
    counted = private_uses(ROOT)
    listing = "\n".join(f"{u.path}:{u.line} {u.name}" for u in counted)
    assert len(counted) <= PRIVATE_BUDGET, (
        f"{len(counted)} uses of another module's private name (at most {PRIVATE_BUDGET}): make the name "
        f"public or move it to where it is used\n{listing}"
    )
    bare = [f"{u.path}:{u.line} {u.name}" for u in counted if not u.commented]
    assert not bare, "a private name used by another module says why on its line:\n" + "\n".join(bare)


def _tree(root: Path):
    """A writer of files (with their folders) under `root`, for the checkers' own tests."""

    def write(rel: str, text: str = "") -> None:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    return write


def test_the_checker_names_a_wrong_way_import_a_cycle_and_an_oversized_file(tmp_path):
    write = _tree(tmp_path)
    for pkg in ("core", "core/numerics", "core/engine", "dashboard"):
        write(f"{pkg}/__init__.py")
    write("core/numerics/x.py", "from core.engine.jobs import Engine\n")
    write(
        "core/engine/jobs.py",
        "from core.numerics import x\n\n\ndef f():\n    from ..numerics import x  # noqa\n",
    )
    write("core/spec.py", "def f():\n    import dashboard.app\n" + "\n" * MAX_LINES)
    write("core/numerics/long.py", "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
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
    assert problems["name"] == ["core/numerics/metrics_more.py is named for its size, not for what it holds"]
    assert "size" not in problems  # long files and functions are warned of, not failed
    assert size_warnings(tmp_path) == [
        f"core/numerics/long.py:1 f has {MAX_FUNCTION_LINES + 1} lines (more than {MAX_FUNCTION_LINES})",
        f"core/spec.py has {MAX_LINES + 2} lines (more than {MAX_LINES})",
    ]


def test_the_checker_finds_a_private_name_used_by_another_module(tmp_path):
    write = _tree(tmp_path)
    for pkg in ("core", "core/numerics", "dashboard", "weightdrift"):
        write(f"{pkg}/__init__.py")
    write(
        "core/numerics/a.py", "_x = _y = _z = 1\npublic = 2\n\n\ndef f():\n    return _x + public.__class__\n"
    )
    write("core/numerics/b.py", "from core.numerics.a import (  # the kernel's own\n    _x,\n)\n")
    write("core/numerics/c.py", "from . import a\n\n\ndef f():\n    return a._y + a._y + a.public\n")
    write("core/numerics/d.py", "import core.numerics.a\n\nz = core.numerics.a._z\n")
    write("core/numerics/e.py", "from core.numerics import _hidden\nfrom core.numerics import _hidden as h\n")
    write("dashboard/f.py", "import core.numerics._hidden as h  # numba's loops, imported where numba is\n")
    write("core/numerics/_hidden.py", "def _own():\n    pass\n\n\n_own()\n")
    assert private_uses(tmp_path) == [
        PrivateUse("core/numerics/b.py", 1, "core.numerics.a._x", True),
        PrivateUse("core/numerics/c.py", 5, "core.numerics.a._y", False),
        PrivateUse("core/numerics/d.py", 3, "core.numerics.a._z", False),
        PrivateUse("core/numerics/e.py", 1, "core.numerics._hidden", False),
        PrivateUse("dashboard/f.py", 1, "core.numerics._hidden", True),
    ]
