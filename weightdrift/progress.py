"""A run's progress in a notebook or a terminal: one tqdm bar over every task's steps (tqdm's notebook
widget in Jupyter when ipywidgets is installed, its text bar otherwise)."""

from __future__ import annotations

import importlib.util
from typing import Any


def bar_class() -> Any:
    """tqdm's notebook bar inside a Jupyter kernel with ipywidgets, else its text bar."""
    try:
        from IPython import get_ipython
    except ImportError:
        get_ipython = None
    shell = get_ipython() if get_ipython is not None else None
    if shell is not None and "IPKernelApp" in shell.config and importlib.util.find_spec("ipywidgets"):
        from tqdm.notebook import tqdm

        return tqdm
    from tqdm import tqdm

    return tqdm


def follow(job, interval: float = 0.25) -> None:
    """Show `job`'s progress (`core.engine.jobs.Job`) until it ends: steps done over every task's steps,
    the stage of a running task beside it."""
    shown = None
    with bar_class()(total=None, desc=f"run {job.run_id}", unit="step", leave=True) as bar:
        while True:
            done = job.wait(interval)
            tasks = list(job.snapshot()["tasks"].items())
            running = [f"{name}: {t['stage']}" for name, t in tasks if t["state"] == "running"]
            state = (
                sum(t["of"] or 0 for _, t in tasks) or None,
                sum(t["step"] or 0 for _, t in tasks),
                running[0] if running else "",
            )
            if state != shown:  # a notebook keeps every redraw of a text bar: draw only what changed
                bar.total, bar.n, shown = state[0], state[1], state
                bar.set_postfix_str(state[2], refresh=False)
                bar.refresh()
            if done:
                return
