"""`python -m dashboard [streamlit options…]` (installed: `weightdrift-dashboard`): the WeightDrift
dashboard, from any directory.

The same as `streamlit run dashboard/app.py` with the settings of the one server config,
`.streamlit/config.toml` (localhost only, the theme), passed as flags, plus SIGHUP (a closed terminal
or SSH session) handled like Ctrl-C: the server stops, its jobs are cancelled and marked so, and their
workers are killed. Why flags: Streamlit reads a config file only from the working directory, the app
script's folder and ~/.streamlit, and a wheel cannot carry a top-level folder (docs/architecture.md).
"""

from __future__ import annotations

import os
import signal
import sys
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path

HERE = Path(__file__).resolve().parent
APP = HERE / "app.py"
# The same file in both places: a checkout's top-level .streamlit/, or the wheel's copy of it as
# package data (pyproject.toml maps dashboard._streamlit to .streamlit/).
CONFIG_PLACES = (HERE.parent / ".streamlit" / "config.toml", HERE / "_streamlit" / "config.toml")


def config_file() -> Path:
    """The server config this dashboard ships with: the checkout's, else the installed package's."""
    for path in CONFIG_PLACES:
        if path.is_file():
            return path
    raise FileNotFoundError(f"no dashboard config at {' or '.join(map(str, CONFIG_PLACES))}")


def _settings(table: Mapping[str, object], prefix: str = "") -> Iterator[tuple[str, object]]:
    for key, value in table.items():
        if isinstance(value, Mapping):
            yield from _settings(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def config_flags(path: Path, environ: Mapping[str, str]) -> list[str]:
    """The file's settings as `streamlit run` flags (a list is one flag per item).

    A setting whose STREAMLIT_* variable is set in `environ` is left to the variable, and flags given
    after these win over them, so both still override the file as they would a config file.
    """
    from streamlit import config

    options = config.get_config_options()
    flags = []
    for key, value in _settings(tomllib.loads(path.read_text(encoding="utf-8"))):
        if options[key].env_var in environ:
            continue
        for item in value if isinstance(value, list) else [value]:
            flags.append(f"--{key}={str(item).lower() if isinstance(item, bool) else item}")
    return flags


def _hangup(signum: int, frame: object) -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # Streamlit stops cleanly on SIGTERM; atexit then cleans up


def main(argv: list[str] | None = None) -> None:
    """Start the Streamlit server on the dashboard with the given extra options."""
    from streamlit.web import cli

    signal.signal(signal.SIGHUP, _hangup)
    extra = sys.argv[1:] if argv is None else argv
    if extra[:1] in (["--help"], ["-h"]):
        print(__doc__.strip(), end="\n\n")
        sys.argv = ["streamlit", "run", "--help"]
    else:
        sys.argv = ["streamlit", "run", str(APP), *config_flags(config_file(), os.environ), *extra]
    cli.main()


if __name__ == "__main__":
    main()
