"""Helpers shared by the dashboard's AppTest tests: the app on a given home, and what a page says."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from streamlit.testing.v1 import AppTest

from dashboard.text import unescape

if TYPE_CHECKING:
    from core.engine.store import RunRecord, Store

APP = str(Path(__file__).resolve().parent.parent / "dashboard" / "app.py")


def make_app(home: Path, monkeypatch: pytest.MonkeyPatch, **params: str) -> AppTest:
    """The app on WeightDrift home `home`, jobs run in-process, with `params` in the URL."""
    monkeypatch.setenv("WEIGHTDRIFT_HOME", str(home))
    monkeypatch.setenv("WEIGHTDRIFT_RUNNER", "in-process")
    at = AppTest.from_file(APP, default_timeout=120)
    for k, v in params.items():
        at.query_params[k] = v
    return at


def shown(element) -> str:
    """What an element's Markdown body reads as on screen (untrusted text is sent escaped)."""
    return unescape(str(element.value))


def texts(at: AppTest) -> str:
    """Every message, markdown, caption and metric label on the page, as one string, as it reads."""
    parts = []
    for kind in ("error", "warning", "info", "success", "markdown", "caption", "title", "subheader"):
        parts += [shown(e) for e in getattr(at, kind)]
    parts += [str(e.label) for e in at.metric]
    return "\n".join(parts)


def no_exceptions(at: AppTest) -> None:
    """Fail with the page's exceptions, if it shows any."""
    assert not at.exception, [e.value for e in at.exception]


def finished(store: Store, run_id: str, timeout_s: float = 240) -> RunRecord:
    """Run `run_id` as the store reads it once it has ended, or once `timeout_s` has passed (a job the
    app started in-process ends in the test's process: a test waits for it before it ends)."""
    deadline = time.monotonic() + timeout_s
    while store.open(run_id).status in ("queued", "running") and time.monotonic() < deadline:
        time.sleep(0.25)
    return store.open(run_id)
