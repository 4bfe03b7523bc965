"""What a newcomer meets: the README's two commands (CI runs the second), docs/cli.md as the parser
has it, links that lead somewhere, and the package's declarations (console scripts, packages, one source
of dependencies).

A real `pip install` of the package takes minutes (torch), too slow for the suite: these tests read
pyproject.toml and resolve what it names; docs/architecture.md says how the install was checked."""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path

from core import cli_reference

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)


def test_docs_cli_md_is_what_the_parser_gives():
    assert cli_reference.PAGE.read_text(encoding="utf-8") == cli_reference.reference(), (
        "docs/cli.md is stale: run .venv/bin/python -m core.cli_reference"
    )
    assert cli_reference.main(["--check"]) == 0


def test_the_reference_names_every_command_and_option():
    page = cli_reference.reference()
    for command in ("demo", "run", "snapshot", "compare", "runs", "scenarios", "devices"):
        assert f"## `python -m core {command}`" in page
    assert "| `-o`, `--output` | `FILE` |  | the snapshot file to write (e.g. gpu-box.wdsnap) |" in page
    assert "| `--runner` | `process \\| ray` | `process` |" in page
    assert "--in-process" not in page  # a test-only option, hidden from --help too


def test_readme_is_short_and_leads_with_the_two_commands_ci_runs_the_second():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    first, second = _bash_blocks(text)[:2]
    assert first == (
        "python3 -m venv .venv && .venv/bin/pip install -q -r requirements.txt && .venv/bin/python -m dashboard"
    )
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").rstrip().splitlines()
    assert ci[-1] == second


def test_relative_links_in_readme_and_docs_lead_to_files():
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} → {target}")
    assert not broken


def test_console_scripts_resolve_to_functions_that_exist():
    scripts = PYPROJECT["project"]["scripts"]
    assert scripts == {
        "weightdrift": "core.__main__:entry",
        "weightdrift-dashboard": "dashboard.__main__:main",
    }
    for target in scripts.values():
        module, _, name = target.partition(":")
        assert callable(getattr(importlib.import_module(module), name))


def test_every_package_is_listed_and_dependencies_come_from_the_requirements_files():
    setuptools = PYPROJECT["tool"]["setuptools"]
    on_disk = {
        ".".join(d.relative_to(ROOT).parts)
        for top in ("core", "dashboard", "weightdrift")
        for d in [ROOT / top, *(ROOT / top).rglob("*")]
        if d.is_dir() and any(d.glob("*.py"))
    }
    assert set(setuptools["packages"]) == on_disk | {"dashboard._streamlit"}
    assert setuptools["package-dir"] == {"dashboard._streamlit": ".streamlit"}
    assert (ROOT / ".streamlit" / "config.toml").is_file()
    dynamic = PYPROJECT["tool"]["setuptools"]["dynamic"]
    assert dynamic["dependencies"] == {"file": ["requirements.txt"]}
    assert dynamic["optional-dependencies"] == {"ray": {"file": ["requirements-ray.txt"]}}
    for name in ("requirements.txt", "requirements-ray.txt"):
        # setuptools reads these as requirement lines: pins and comments only, no pip options (`-r …`)
        lines = [ln.strip() for ln in (ROOT / name).read_text().splitlines()]
        pins = [ln for ln in lines if ln and not ln.startswith("#")]
        assert pins and all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][0-9A-Za-z.]*", p) for p in pins), name
