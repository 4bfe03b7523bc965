"""WeightDrift's library: no UI, no Streamlit. `python -m core` is the CLI (`core.cli`). Layers, each
importing only those below it (tests/test_architecture.py checks it): `core.cli` → `core.demo` →
`core.engine` → `core.checks` → `core.capture` / `core.models` → `core.methods` → `core.numerics` →
`core.spec`; `core.report` (table summaries) and `core.judgement` (anomalies) import nothing from core.
Only `core.cli`, the dashboard and `weightdrift` import `core.demo`."""

import logging

# On a CPU with AVX512-BF16, bitsandbytes warns at import that it cannot fetch an optional 4-bit kernel
# from the hub (the `kernels` package, which would download it; nothing here may): it uses its own ops,
# as on any other CPU. Said on every run and in every worker's log, it reads like a failure.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
