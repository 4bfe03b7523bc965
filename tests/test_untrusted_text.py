"""Untrusted text stays text: every Markdown-rendering call in the dashboard is fed only constants,
numbers, code-owned Markdown (`trusted`) or text made literal (`literal`).

The scan reads the dashboard's source (ast): a new `st.error(f"… {e}")`, `st.caption(path)`,
`st.warning("…" + name)` or an alias such as `box = st.error` fails it, with file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dashboard.text import literal, unescape

DASHBOARD = Path(__file__).resolve().parent.parent / "dashboard"

# Streamlit calls whose first argument (or these keywords) is rendered as Markdown.
MARKDOWN_CALLS = {
    "markdown",
    "error",
    "warning",
    "info",
    "success",
    "caption",
    "write",
    "toast",
    "title",
    "header",
    "subheader",
    "button",
    "download_button",
    "popover",
    "expander",
    "metric",
    "page_link",
    "progress",
}
MARKDOWN_KEYWORDS = ("body", "label", "text", "help")
NUMERIC_SPECS = tuple("dfFgGeE%n")
SAFE_CALLS = {"literal", "trusted", "len", "int", "float", "round"}


def _spec(node: ast.FormattedValue) -> str:
    if node.format_spec is None:
        return ""
    return "".join(v.value for v in node.format_spec.values if isinstance(v, ast.Constant))


def _problems(expr: ast.expr) -> list[str]:
    """What in `expr` could put untrusted text into Markdown (empty when nothing)."""
    if isinstance(expr, ast.Constant):
        return []
    if isinstance(expr, ast.JoinedStr):
        found = []
        for i, part in enumerate(expr.values):
            if not isinstance(part, ast.FormattedValue):
                continue
            spec = _spec(part)
            if spec.endswith(NUMERIC_SPECS):
                continue  # a numeric format raises on text: only a number gets here
            found += _problems(part.value)
            before = expr.values[i - 1] if i else None
            if isinstance(before, ast.Constant) and str(before.value).endswith("`"):
                found.append(f"{ast.unparse(part.value)} inside a code span (shows the escapes)")
        return found
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
        return _problems(expr.left) + _problems(expr.right)
    if isinstance(expr, ast.IfExp):
        return _problems(expr.body) + _problems(expr.orelse)
    if isinstance(expr, ast.Call):
        func = expr.func
        if isinstance(func, ast.Name) and func.id in SAFE_CALLS:
            return []
        # "sep".join(… for …): each joined element must be safe
        if (
            isinstance(func, ast.Attribute)
            and func.attr == "join"
            and isinstance(func.value, ast.Constant)
            and len(expr.args) == 1
        ):
            arg = expr.args[0]
            if isinstance(arg, ast.GeneratorExp | ast.ListComp):
                return _problems(arg.elt)
            return _problems(arg)
    return [ast.unparse(expr)]


def violations(source: str, filename: str) -> list[str]:
    """Every Markdown-rendering call in `source` fed something that is not known to be safe, and every
    Markdown function used other than by calling it (an alias hides the call from this scan)."""
    tree = ast.parse(source)
    called = set()
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        if node.func.attr not in MARKDOWN_CALLS:
            continue
        called.add(id(node.func))
        # st.progress(value, text): the text comes second; st.page_link(page, label): the label is a keyword
        first = {"progress": 1, "page_link": 99}.get(node.func.attr, 0)
        fed = [node.args[first]] if len(node.args) > first else []
        fed += [k.value for k in node.keywords if k.arg in MARKDOWN_KEYWORDS]
        for arg in fed:
            for what in _problems(arg):
                found.append(f"{filename}:{node.lineno}: {node.func.attr}(…) fed {what}")
    for node in ast.walk(tree):
        # Plotly reads <a href>, <b>, <br> in category labels as markup: every chart goes through inert()
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "plotly_chart"
        ):
            arg = node.args[0] if node.args else None
            if not (isinstance(arg, ast.Call) and isinstance(arg.func, ast.Name) and arg.func.id == "inert"):
                found.append(
                    f"{filename}:{node.lineno}: plotly_chart(…) of a figure not passed through inert()"
                )
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in MARKDOWN_CALLS
            and id(node) not in called
            and isinstance(node.value, ast.Name)
            and node.value.id == "st"
        ):
            found.append(f"{filename}:{node.lineno}: st.{node.attr} used without a call (an alias)")
    return found


def test_the_dashboard_feeds_markdown_only_safe_text():
    found = []
    for path in sorted(DASHBOARD.rglob("*.py")):
        found += violations(path.read_text(), str(path.relative_to(DASHBOARD.parent)))
    assert found == []


@pytest.mark.parametrize(
    "line",
    [
        'st.error(f"Run failed: {error}")',
        "st.caption(record.error)",
        'st.warning("Run " + run_id + " is gone")',
        'st.markdown(f"**{name}**")',
        'st.error(f"Cannot: {e}")',
        'st.info("; ".join(f"{a}" for a in names))',
        'st.button(f"Open {run_id}")',
        'st.progress(0.5, text=f"{stage}")',
        'st.caption(f"Base `{literal(path)}`")',
        "box = {'drift': st.warning}['drift']",
        'st.plotly_chart(fig, key="x")',
        "col.error(str(e))",
        'st.caption(f"{path:>10s}")',
    ],
)
def test_the_scan_catches_each_kind_of_violation(line):
    assert len(violations(line, "x.py")) == 1, violations(line, "x.py")


@pytest.mark.parametrize(
    "line",
    [
        'st.error(f"Run failed: {literal(error)}")',
        'st.success(f"All {len(table)} rows, {bad:d} bad, max {x:.3g}")',
        'st.info("; ".join(f"{literal(a)} ({n:d})" for a, n in items))',
        "st.caption(trusted(scenario.description))",
        'st.warning("fixed text", icon=":material/lan:")',
        'st.plotly_chart(inert(fig), key="x")',
    ],
)
def test_the_scan_lets_safe_calls_pass(line):
    assert violations(line, "x.py") == []


CRAFTED = (
    "Session expired - [click to sign in again](http://evil.example/login) "
    "![x](http://evil.example/pixel.png) <img src=x> :red[alert] :material/lock: $x^2$ "
    "www.evil.example `code` **bold** # heading\n- item\n1. item"
)


def test_literal_renders_as_its_exact_text():
    import markdown_it

    md = literal(CRAFTED)
    assert unescape(md) == CRAFTED
    html = markdown_it.MarkdownIt("commonmark").render(md)
    for made in ("<a ", "<img", "<strong", "<code", "<h1", "<li"):
        assert made not in html, html


def test_csv_downloads_neutralise_formulas():
    import pandas as pd

    from dashboard.text import spreadsheet_safe

    table = pd.DataFrame(
        {
            "adapter": ['=HYPERLINK("http://evil.example","x")', "+1+1", "-2+3", "@SUM(A1)", "lora", None],
            "max_abs": [-1.5, 2.0, 0.0, 1e-7, -3.0, 1.0],
            "=cmd": ["a", "b", "c", "d", "e", "f"],
        }
    )
    safe = spreadsheet_safe(table)
    assert list(safe["adapter"][:5]) == [
        '\'=HYPERLINK("http://evil.example","x")',
        "'+1+1",
        "'-2+3",
        "'@SUM(A1)",
        "lora",
    ]
    assert pd.isna(safe["adapter"][5])
    assert list(safe["max_abs"]) == [-1.5, 2.0, 0.0, 1e-7, -3.0, 1.0]  # numbers stay numbers
    assert list(safe.columns) == ["adapter", "max_abs", "'=cmd"]
    assert list(table["adapter"])[0].startswith("=")  # the shown table is left as it is


def test_literal_keeps_bare_urls_and_addresses_from_becoming_links():
    md = literal("see http://evil.example/x, HTTPS://a.b, www.evil.example and a@evil.example")
    # GFM's autolink literals need these contiguous (escapes do not stop them): a word joiner sits inside
    for made in ("http\u2060\\:", "HTTPS\u2060\\:", "www\u2060\\.", "\\@\u2060evil"):
        assert made in md, (made, md)
    assert unescape(md) == "see http://evil.example/x, HTTPS://a.b, www.evil.example and a@evil.example"


def test_inert_shows_plotly_labels_as_text_once():
    import plotly.graph_objects as go

    from dashboard.text import inert, plot_text

    crafted = '<a href="http://evil.example">sign in</a>'
    fig = go.Figure(go.Heatmap(z=[[1, 2]], x=[crafted, "q_proj"], y=["layer <b>0</b>"]))
    inert(inert(fig))  # shown, then downloaded: escaped once
    assert list(fig.data[0].x) == ['&lt;a href="http://evil.example"&gt;sign in&lt;/a&gt;', "q_proj"]
    assert list(fig.data[0].y) == ["layer &lt;b&gt;0&lt;/b&gt;"]
    assert plot_text("a<br>b") == "a&lt;br&gt;b"
