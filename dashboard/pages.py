"""The dashboard's pages, in one table: title, icon, URL path (also `views/<path>.py`), the checks whose
results each shows, and which page a run opens on. The navigation, the Overview's links, the pages'
headings and the report's sections all read it; it imports no Streamlit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dashboard.figures.common import DRIFT_CHECKS


@dataclass(frozen=True)
class Page:
    """One page of the dashboard."""

    path: str  # URL path; its script is views/<path>.py
    title: str
    icon: str
    checks: tuple[str, ...] = ()  # the checks whose results it shows
    opens: int | None = None  # a run opens on its result page of least `opens` (None: opens no run)

    @property
    def script(self) -> str:
        """The page's script, relative to dashboard/ (what `st.switch_page` and `st.page_link` take)."""
        return f"views/{self.path}.py"


# In navigation order. A run with per-tensor checks opens on the Drift page, else on its first check's.
PAGES: tuple[Page, ...] = (
    Page("overview", "Overview", ":material/dashboard:"),
    Page("drift", "Drift", ":material/grid_on:", DRIFT_CHECKS, opens=0),
    Page("outputs", "Outputs", ":material/output:", ("outputs", "generate"), opens=1),
    Page("activations", "Activations", ":material/stacked_line_chart:", ("activations",), opens=5),
    Page("merge", "Merge residuals", ":material/merge:", ("merge",), opens=2),
    Page("memory", "Memory placement", ":material/memory:", ("memory",), opens=4),
    Page("adapters", "Adapter consistency", ":material/layers:", ("adapters",), opens=3),
    Page("runs", "Runs", ":material/history:"),
)
OVERVIEW = PAGES[0]


def page(path: str) -> Page:
    """The page at URL path `path` (KeyError for none)."""
    for p in PAGES:
        if p.path == path:
            return p
    raise KeyError(path)


def result_pages(checks: Sequence[str]) -> list[Page]:
    """The pages that show these checks' results, once each, the one a run opens on first."""
    shown = [p for p in PAGES if p.opens is not None and set(p.checks) & set(checks)]
    return sorted(shown, key=lambda p: p.opens)


def result_page(checks: Sequence[str]) -> str:
    """Where a run of these checks opens (a URL path): the Drift page when it has per-tensor checks, else
    its first check's page; the Overview when no page shows them."""
    pages = result_pages(checks)
    return pages[0].path if pages else OVERVIEW.path
