"""The layering DESIGN.md asks for: core/ and the figure builders never import Streamlit."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import core

ROOT = Path(__file__).resolve().parent.parent


def test_core_and_figures_import_without_streamlit():
    modules = sorted(f"core.{m.name}" for m in pkgutil.walk_packages(core.__path__) if m.name != "__main__")
    modules += [
        "core.checks.weights",
        "core.checks.deltas",
        "core.checks.outputs",
        "dashboard.figures.common",
    ]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print('streamlit' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", "core/ or dashboard/figures/ pulled in Streamlit"
