"""Pairwise rows: every target against every other, tensor by tensor (`pairwise.parquet`).

The metrics table compares each target with its reference (the checkpoint, the float64 forward);
these rows say which targets agree with each other. Tensors the workers compared themselves carry
an xxh3-128 content hash, so two targets' weights are found bitwise equal by hash alone, without
moving a tensor between machines; where both captures kept the tensors (small models, outputs),
unequal ones are measured with the same statistics and tolerance rule as every other row (the
looser dtype's tolerance of the two). Where only hashes are there, an unequal pair reads `differs`.
"""

from __future__ import annotations

from itertools import combinations
from typing import Any

import pandas as pd
import torch

from core.capture import BASE, Capture, TensorKey
from core.checks.base import Check, tolerance
from core.numerics import metrics
from core.spec import ProbeSpec, Target

# A pair whose hashes differ and whose tensors stayed where they were captured.
DIFFERS = "differs"
# worst first, for the target × target matrix (`differs` sits between a pass and a failure)
PAIR_SEVERITY = {"identical": 0, "within tolerance": 1, DIFFERS: 2, "drift": 3, "broken": 4}
COLUMNS = (
    "check",
    "target",
    "other",
    "adapter",
    "tensor",
    "layer",
    "module",
    "role",
    "dtype",
    "other_dtype",
    "numel",
    "compared_by",
    "bitwise_equal",
    "n_mismatch",
    "max_abs",
    "rel_l2",
    "max_ulp",
    "min_atol",
    "verdict",
    "explanation",
)
# How close a dtype's results come to float64's: the looser of a pair sets its tolerance.
_CLOSENESS = {"float64": 3, "float32": 2, "float16": 1, "bfloat16": 0}


def _looser(a: str, b: str) -> torch.dtype:
    return getattr(torch, min((a, b), key=lambda d: _CLOSENESS.get(d, -1)))


def pair_row(spec: ProbeSpec, check: Check, key: TensorKey, a: Capture, b: Capture) -> dict[str, Any] | None:
    """The row of one tensor on targets `a` and `b`; None when either lacks it (the metrics table
    says so against the reference)."""
    ra, rb = a.result(key), b.result(key)
    ta, tb = a.get(key), b.get(key)
    if (ra is None and ta is None) or (rb is None and tb is None):
        return None
    dtype_a = ta.dtype if ta is not None else None
    row: dict[str, Any] = {
        "check": check.name,
        "target": a.target,
        "other": b.target,
        "adapter": None if key.adapter == BASE else key.adapter,
        "tensor": key.name,
        **check.describe(key),
        "dtype": str(dtype_a).removeprefix("torch.") if dtype_a is not None else (ra or {}).get("dtype"),
        "other_dtype": str(tb.dtype).removeprefix("torch.") if tb is not None else (rb or {}).get("dtype"),
    }
    hash_a, hash_b = (ra or {}).get("hash"), (rb or {}).get("hash")
    if hash_a and hash_b and hash_a == hash_b:
        numel = ((ra or {}).get("row") or {}).get("numel")
        return {
            **row,
            "numel": numel,
            "compared_by": "hash",
            "bitwise_equal": True,
            "n_mismatch": 0,
            "max_abs": 0.0,
            "verdict": "identical",
            "explanation": "bitwise equal (same xxh3-128 content hash)",
        }
    if ta is None or tb is None:
        numel = ((ra or {}).get("row") or {}).get("numel")
        return {
            **row,
            "numel": numel,
            "compared_by": "hash",
            "bitwise_equal": False,
            "verdict": DIFFERS,
            "explanation": "content hashes differ; the tensors were not kept, so each target's distance "
            "is in its own row against the reference",
        }
    dtypes = (Target.parse(a.target).float_dtype, Target.parse(b.target).float_dtype)
    tol = tolerance(spec, check.role_of(spec, key), _looser(*dtypes))
    stats = metrics.stats_to_row(metrics.compare(tb, ta, tol))
    return {**row, "compared_by": "values", **{k: stats.get(k) for k in COLUMNS if k in stats}}


def pairwise_table(spec: ProbeSpec, checks: list[Check], captures: list[Capture]) -> pd.DataFrame:
    """Every pair of the run's targets (shared-load-loop captures), every tensor both hold, for the
    checks that compare tensors of one target with a reference (not own-worker checks)."""
    rows = []
    for check in checks:
        if check.own_worker:
            continue
        for a, b in combinations(captures, 2):
            keys = {k.encode() for k in a.keys(check.name)} & {k.encode() for k in b.keys(check.name)}
            for encoded in sorted(keys):
                row = pair_row(spec, check, TensorKey.decode(encoded), a, b)
                if row is not None:
                    rows.append(row)
    table = pd.DataFrame(rows, columns=list(COLUMNS))
    table["layer"] = table["layer"].astype("Int64")
    return table


def pair_matrix(table: pd.DataFrame) -> pd.DataFrame:
    """Per ordered pair of targets, the worst verdict and the largest max |Δ| over its rows (both
    directions filled, so it reads as a symmetric target × target matrix)."""
    if table.empty:
        return pd.DataFrame(columns=["target", "other", "verdict", "max_abs", "rows"])
    t = table.assign(severity=table["verdict"].map(PAIR_SEVERITY).fillna(4))
    g = t.groupby(["target", "other"], sort=False)
    out = pd.DataFrame(
        {"severity": g["severity"].max(), "max_abs": g["max_abs"].max(), "rows": g.size()}
    ).reset_index()
    back = out.rename(columns={"target": "other", "other": "target"})
    out = pd.concat([out, back], ignore_index=True)
    names = {v: k for k, v in PAIR_SEVERITY.items()}
    out["verdict"] = out["severity"].astype(int).map(names)
    return out[["target", "other", "verdict", "max_abs", "rows"]]
