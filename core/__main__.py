"""`python -m core`: the command-line interface (see core/cli.py)."""

import sys

from core.cli import main

sys.exit(main())
