"""Shared pytest fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def demo_workspace(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The demo workspace (tiny models + adapters), built once per session; returns its manifest."""
    from core.demo import build_demo

    return build_demo(tmp_path_factory.mktemp("demo-home"))
