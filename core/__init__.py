"""WeightDrift's library: no UI, no Streamlit. `python -m core` is the CLI (`core.cli`). Layers, each
importing only those below it (tests/test_architecture.py checks it): `core.cli` → `core.demo` →
`core.engine` → `core.checks` → `core.capture` / `core.models` → `core.methods` → `core.numerics` →
`core.spec`; `core.report` (table summaries) imports nothing from core. Only `core.cli` and the
dashboard import `core.demo`."""
