"""`python -m core`: the command-line interface (see core/cli.py)."""

from core.cli import entry

entry()
