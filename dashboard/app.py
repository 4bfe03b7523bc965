"""WeightDrift dashboard: `streamlit run dashboard/app.py`.

The entry point builds the demo workspace on first launch, draws the run form and the job list in
the sidebar, keeps the view in the URL and hands over to the page the URL names.
"""

from __future__ import annotations

import sys
from pathlib import Path

# `streamlit run dashboard/app.py` puts dashboard/ on sys.path, not the repository root.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import streamlit as st  # noqa: E402

from core.engine.store import StoreError  # noqa: E402
from dashboard.jobs import sidebar_jobs  # noqa: E402
from dashboard.pages import PAGES as TABLE  # noqa: E402
from dashboard.run_form import run_form  # noqa: E402
from dashboard.state import engine, home, store, sync_view_with_url  # noqa: E402
from dashboard.text import literal  # noqa: E402

VIEWS = Path(__file__).resolve().parent / "views"
FAVICON = Path(__file__).resolve().parent / "favicon.png"
# the navigation, from the one table of pages (dashboard/pages.py)
PAGES = [st.Page(VIEWS / f"{p.path}.py", title=p.title, icon=p.icon, url_path=p.path) for p in TABLE]


def start() -> None:
    """`/` opens the Overview at its own path, keeping the query string."""
    st.switch_page(PAGES[0], query_params=st.query_params.to_dict())


# Streamlit serves the default page at `/`; a hidden start page keeps `/overview` a real path.
START = st.Page(start, title="WeightDrift", url_path="start", default=True, visibility="hidden")


def demo_manifest() -> dict | None:
    """The demo workspace's manifest; built on first launch with visible progress."""
    from core.demo.build import build_demo, load_manifest

    manifest = load_manifest(home())
    if manifest is not None:
        return manifest
    bar = st.progress(0.0, text="Building the demo workspace (tiny models and adapters, offline)…")

    def progress(stage: str, k: int, n: int) -> None:
        bar.progress(
            k / n if n else 0.0, text=f"Building the demo workspace: {literal(stage)} · step {k:d} of {n:d}"
        )

    try:
        manifest = build_demo(home(), progress=progress)
    except Exception as e:  # the app must still come up, e.g. to open stored runs
        st.error(
            f"Could not build the demo workspace in {literal(home() / 'demo')}: {literal(type(e).__name__)}: "
            f"{literal(e)}"
        )
        return None
    bar.empty()
    return manifest


def main() -> None:
    # A local icon: a Material one would make every browser tab fetch it from fonts.gstatic.com.
    st.set_page_config(page_title="WeightDrift", page_icon=str(FAVICON), layout="wide")
    page = st.navigation([START, *PAGES], position="sidebar")
    sync_view_with_url()
    with st.sidebar:
        if st.get_option("server.address") in (None, "", "0.0.0.0", "::"):
            # The launcher applies .streamlit/config.toml (localhost) whatever the working directory; only
            # an explicit flag or STREAMLIT_SERVER_ADDRESS gets here, and this app starts jobs on this machine.
            st.warning(
                "This server listens on all network interfaces (--server.address or "
                "STREAMLIT_SERVER_ADDRESS overrides .streamlit/config.toml): anyone who can reach "
                "this machine can start jobs on it.",
                icon=":material/lan:",
            )
        try:
            engine()
        except StoreError as e:  # a home that cannot be made or written: say so, not a traceback
            st.error(f"WeightDrift cannot use its home: {literal(e)}", icon=":material/error:")
            st.stop()
        manifest = demo_manifest()
        st.subheader("New run")
        run_form(manifest)
        sidebar_jobs()
        st.caption(f"Runs are stored in {literal(store().runs_dir)}")
    page.run()


main()
