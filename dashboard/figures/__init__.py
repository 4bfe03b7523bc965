"""Pure DataFrame → Plotly builders, no Streamlit: what several pages share in `common`, and one
module per page that has figures of its own. May import core (not core.cli) and dashboard.text."""
