"""`python -m core` and the `weightdrift` command: the command-line interface (`core.cli`)."""

import contextlib
import os
import sys


def entry() -> None:
    """`core.cli.main`, then exit without the interpreter's teardown, once what it printed is flushed:
    with torch and pandas imported, freeing module by module took 0.5 s after the last line. Not after
    a Ray run, whose exit handler stops the local cluster it started."""
    from core.cli import main

    code = main()
    with contextlib.suppress(OSError):  # a closed pipe (`| head`): nothing more can be said
        sys.stdout.flush()
        sys.stderr.flush()
    if "ray" in sys.modules:
        sys.exit(code)
    os._exit(code)


if __name__ == "__main__":
    entry()
