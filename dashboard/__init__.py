"""The Streamlit app (`python -m dashboard`, entry `dashboard/app.py`): pages in `views/`, pure
DataFrame → Plotly builders in `figures/`. May import everything in core except core.cli."""
