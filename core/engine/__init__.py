"""Running checks: the engine that turns a spec into tasks (`schedule`) and jobs (`jobs`), the worker process
(`python -m core.engine.worker`), the Ray runner, the run store and snapshots, the pairwise table and
the drill-down's element-wise difference. May import core.checks, core.models, core.methods,
core.numerics, core.capture, core.report and core.spec — never core.demo, core.cli or the dashboard."""
