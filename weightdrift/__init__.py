"""WeightDrift from Python (a notebook): `import weightdrift as wd` (docs/api.md).

    run = wd.run(base=..., adapters={"lora": path}, targets=["cpu/float32", "cpu/bfloat16"])
    run.summary(); run.metrics; run.figure("drift", adapter="lora")

A run made here is a run like any other: stored in the WeightDrift home, listed by `weightdrift runs`
and on the dashboard's Runs page.
"""

from weightdrift.api import DASHBOARD_URL, Run, RunError, compare, demo, open, run

__all__ = ["DASHBOARD_URL", "Run", "RunError", "compare", "demo", "open", "run"]
