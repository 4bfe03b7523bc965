"""Untrusted text on a page: shown as exactly its characters, never as Markdown.

Streamlit renders the body of `st.markdown`, `st.error`, `st.warning`, `st.info`, `st.success`,
`st.caption`, `st.toast`, button labels and progress texts as Markdown (links, images, colours,
icons, LaTeX). Text that comes from a file (a run folder, a model's config), from the URL or from an
exception must not: a crafted string would draw links and load remote images inside the app's own
alert boxes. Every such string goes through `literal` (the one way to do it; a test scans the
dashboard for Markdown calls fed anything else). Markdown the code itself owns, written elsewhere
than at the call, is marked with `trusted`.
"""

from __future__ import annotations

import re
import string

import pandas as pd
import plotly.graph_objects as go

# CommonMark lets a backslash escape any ASCII punctuation character, which then stands for itself:
# no link, image, emphasis, code span, HTML, autolink, list, heading, and none of Streamlit's
# `:colour[…]`, `:icon:` or `$LaTeX$` forms can start.
_PUNCTUATION = re.compile("([" + re.escape(string.punctuation) + "])")
_ESCAPED = re.compile(r"\\([" + re.escape(string.punctuation) + "])")
# GitHub-flavoured Markdown turns bare `http://…`, `www.…` and `name@host.tld` into links after
# escapes are resolved: an invisible WORD JOINER inside each of them keeps the text and stops the link.
_AUTOLINK = re.compile(r"(?i)(?<=https)(?=://)|(?<=http)(?=://)|(?<=www)(?=\.)|(?<=@)(?=[\w-])")
WORD_JOINER = "\u2060"


def literal(value: object) -> str:
    """`value` as Markdown that renders as its exact text: every ASCII punctuation character
    escaped, line breaks kept, bare URLs and e-mail addresses not turned into links (an invisible
    word joiner inside). Never put the result inside backticks (a code span shows the backslashes)."""
    text = _PUNCTUATION.sub(r"\\\1", _AUTOLINK.sub(WORD_JOINER, str(value)))
    # A lone newline is a space in Markdown: make each a hard line break; no blank-line paragraphs.
    return "  \n".join(line.strip() for line in text.splitlines()) if "\n" in text else text


def trusted(markdown: str) -> str:
    """Markdown written by this code base (e.g. a scenario's description), passed through unchanged:
    the mark that tells the reader, and the scanning test, that it is not untrusted text."""
    return markdown


def unescape(markdown: str) -> str:
    """The text a `literal` renders as (for tests and plain-text exports)."""
    return _ESCAPED.sub(r"\1", markdown.replace("  \n", "\n")).replace(WORD_JOINER, "")


# Spreadsheet tools run a cell that starts with one of these as a formula (OWASP "CSV injection").
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def spreadsheet_safe(table: pd.DataFrame) -> pd.DataFrame:
    """`table` for a CSV download: every text cell (and column name) that a spreadsheet would run as
    a formula gets a leading apostrophe, as spreadsheet tools expect; numbers stay numbers."""

    def cell(value: object) -> object:
        if isinstance(value, str) and value.startswith(_FORMULA_START):
            return "'" + value
        return value

    out = table.copy()
    for column in out.columns:
        if out[column].dtype == object or pd.api.types.is_string_dtype(out[column].dtype):
            out[column] = out[column].map(cell)
    out.columns = [cell(c) if isinstance(c, str) else c for c in out.columns]
    return out


def inert(fig: go.Figure) -> go.Figure:
    """`fig` with every category label (a trace's x and y values that are text: tensor, module,
    adapter, target names from a run's files) shown as its characters. Plotly reads `<a href>`,
    `<b>`, `<br>` in labels as markup; `<` and `>` become entities (idempotent: a figure shown
    and then downloaded is escaped once). Changes `fig` in place and returns it."""
    for trace in fig.data:
        for attr in ("x", "y"):
            values = getattr(trace, attr, None)
            if values is None or isinstance(values, str):
                continue
            if any(isinstance(v, str) and ("<" in v or ">" in v) for v in values):
                trace[attr] = [plot_text(v) if isinstance(v, str) else v for v in values]
    return fig


def plot_text(value: object) -> str:
    """Untrusted text inside a Plotly title, hover text or label: no markup (`<`, `>` as entities)."""
    return str(value).replace("<", "&lt;").replace(">", "&gt;")
