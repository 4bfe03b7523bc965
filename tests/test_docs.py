"""What a newcomer meets: the README's two commands (CI runs the second), docs/cli.md as the parser
has it, docs/architecture.md's module list as the modules' docstrings have it, links that lead
somewhere, and the package's declarations (console scripts, packages, one source of dependencies).

A real `pip install` of the package takes minutes (torch), too slow for the suite: these tests read
pyproject.toml and resolve what it names; docs/architecture.md says how the install was checked."""

from __future__ import annotations

import ast
import importlib
import re
import sys
import tomllib
from pathlib import Path

from core import cli_reference

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
ARCHITECTURE = ROOT / "docs" / "architecture.md"
# docs/architecture.md's list of modules is generated between these lines (`module_list`)
MODULES_BEGIN = (
    "<!-- generated from each module's docstring (its first sentence) by tests/test_docs.py; "
    "rewrite with `PYTHONPATH=. .venv/bin/python tests/test_docs.py` -->"
)
MODULES_END = "<!-- end of the generated module list -->"
MODULE_PACKAGES = ("core", "dashboard", "weightdrift", "bench")
# a sentence ends at . ! or ? before a space or the end, not at "e.g." / "i.e." / "etc."
FIRST_SENTENCE = re.compile(r"(.+?(?<!\be\.g)(?<!\bi\.e)(?<!\betc)[.!?])(?:\s|$)")


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)


def test_docs_cli_md_is_what_the_parser_gives():
    assert cli_reference.PAGE.read_text(encoding="utf-8") == cli_reference.reference(), (
        "docs/cli.md is stale: run .venv/bin/python -m core.cli_reference"
    )
    assert cli_reference.main(["--check"]) == 0


def module_purpose(path: Path) -> str:
    """The first sentence of a module's docstring, on one line ("" when it has none)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"), str(path))) or ""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    match = FIRST_SENTENCE.match(paragraph)
    return match.group(1) if match else paragraph


def module_list(root: Path = ROOT) -> str:
    """docs/architecture.md's module list: every module of the packages, in path order, with its purpose."""
    rows = ["| module | what it is |", "|---|---|"]
    for package in MODULE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            purpose = module_purpose(path).replace("|", "\\|")
            rows.append(f"| `{path.relative_to(root).as_posix()}` | {purpose} |")
    return "\n".join(rows)


def _generated_block(text: str) -> tuple[int, int]:
    start = text.index(MODULES_BEGIN) + len(MODULES_BEGIN)
    return start, text.index(MODULES_END, start)


def test_architecture_md_lists_every_module_as_its_docstring_says():
    undocumented = [
        str(p.relative_to(ROOT))
        for d in MODULE_PACKAGES
        for p in (ROOT / d).rglob("*.py")
        if not module_purpose(p)
    ]
    assert not undocumented, f"modules without a docstring saying what they are: {undocumented}"
    text = ARCHITECTURE.read_text(encoding="utf-8")
    start, end = _generated_block(text)
    block = module_list()
    assert text[start:end].strip("\n") == block, (
        "docs/architecture.md's module list is stale: run `PYTHONPATH=. .venv/bin/python tests/test_docs.py`, "
        f"or put this between its markers:\n{block}"
    )


def test_the_module_list_takes_each_modules_first_sentence(tmp_path):
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "a.py").write_text('"""Parts | pieces,\ne.g. this one. More here.\n\nDetails."""\n')
    (tmp_path / "core" / "b.py").write_text("x = 1\n")
    assert module_list(tmp_path).splitlines()[2:] == [
        "| `core/a.py` | Parts \\| pieces, e.g. this one. |",
        "| `core/b.py` |  |",
    ]


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


if __name__ == "__main__" and sys.argv[1:] == []:
    # rewrites docs/architecture.md's module list (run from the repository root with PYTHONPATH=.)
    page = ARCHITECTURE.read_text(encoding="utf-8")
    first, last = _generated_block(page)
    ARCHITECTURE.write_text(f"{page[:first]}\n{module_list()}\n{page[last:]}", encoding="utf-8")
