"""`python -m dashboard [streamlit options…]`: the WeightDrift dashboard, from any directory.

The same as `streamlit run dashboard/app.py` (its safe defaults, localhost only, come from
`dashboard/.streamlit/config.toml`, which Streamlit reads beside the app whatever the working
directory), plus SIGHUP (a closed terminal or SSH session) handled like Ctrl-C: the server stops,
its jobs are cancelled and marked so, and their workers are killed.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

APP = Path(__file__).resolve().parent / "app.py"


def _hangup(signum: int, frame: object) -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # Streamlit stops cleanly on SIGTERM; atexit then cleans up


def main(argv: list[str] | None = None) -> None:
    """Start the Streamlit server on the dashboard with the given extra options."""
    from streamlit.web import cli

    signal.signal(signal.SIGHUP, _hangup)
    sys.argv = ["streamlit", "run", str(APP), *(sys.argv[1:] if argv is None else argv)]
    cli.main()


if __name__ == "__main__":
    main()
