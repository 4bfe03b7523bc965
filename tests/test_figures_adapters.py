"""The Adapter consistency page's pure builders, on hand-made rows."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from dashboard.figures.adapters import (
    IDENTICAL_FLOOR,
    consistency_cells,
    consistency_matrix,
    conversion_table,
    flag_rows,
    mutation_table,
    stacking_summary,
)

T = "cpu/float32"


def row(strategy, adapter, role, verdict, max_abs=0.0, reason="", **extra):
    return {
        "check": "adapters",
        "target": T,
        "strategy": strategy,
        "adapter": adapter,
        "role": role,
        "verdict": verdict,
        "max_abs": max_abs,
        "rel_l2": max_abs,
        "reason": reason,
        "argmax_agree": extra.pop("argmax_agree", math.nan),
        "topk_agree": math.nan,
        "explanation": extra.pop("explanation", ""),
        "note": extra.pop("note", ""),
        "reference": extra.pop("reference", "isolated"),
        "tensor": extra.pop("tensor", "logits"),
        "layer": extra.pop("layer", None),
        "module": extra.pop("module", "logits"),
    }


TABLE = pd.DataFrame(
    [
        row("isolated", "pissa", "disabled", "drift", 0.49, "base mutated"),
        row("isolated", "lora", "disabled", "identical"),
        row("isolated", "noop", "applied", "broken", 0.0, "not applied", explanation="not applied: …"),
        row("loop", "pissa", "prediction", "identical", 0.0, "rewrites the base itself, as in isolated"),
        row(
            "loop",
            "lora",
            "prediction",
            "drift",
            0.104,
            "base mutated by pissa (PiSSA); stacked (…)",
            argmax_agree=0.69,
        ),
        row(
            "loop",
            "noop",
            "prediction",
            "identical",
            0.0,
            "not applied; stacked (holds lora, noop; active noop); stacking is not the cause: predictions are bitwise equal",
        ),
        row(
            "loop",
            "pissa",
            "base weight",
            "drift",
            0.06,
            "base mutated",
            tensor="model.layers.0.self_attn.q_proj.weight",
            module="q_proj",
            layer=0,
            reference="checkpoint",
        ),
        row(
            "isolated",
            "pissa_lora",
            "pissa conversion",
            "within tolerance",
            2.4e-7,
            reference="pissa (PiSSA)",
        ),
    ]
)


def test_cells_one_per_adapter_and_strategy():
    cells = consistency_cells(TABLE)
    got = {(c["adapter"], c["strategy"]): c["verdict"] for c in cells.to_dict(orient="records")}
    assert got[("lora", "loop")] == "drift" and got[("pissa", "loop")] == "identical"
    assert got[("pissa", "isolated")] == "ground truth" and got[("noop", "isolated")] == "ground truth"
    noop = cells[(cells["adapter"] == "noop") & (cells["strategy"] == "isolated")].iloc[0]
    assert noop["reason"] == "not applied"
    assert stacking_summary(cells) == [f"noop with loop ({T})"]
    assert consistency_cells(pd.DataFrame()).empty


def test_matrix_colours_drift_and_puts_identical_at_the_floor():
    fig = consistency_matrix(consistency_cells(TABLE), T)
    heat = fig.data[0]
    assert list(heat.x) == ["isolated", "loop"]
    z = np.array(heat.z, dtype=float)
    adapters = list(heat.y)
    lora, pissa = adapters.index("lora"), adapters.index("pissa")
    assert math.isclose(z[lora][1], math.log10(0.104))
    assert z[pissa][1] == IDENTICAL_FLOOR
    assert np.isnan(z[lora][0])  # isolated is the ground truth, not coloured
    assert "base mutated by pissa" in heat.text[lora][1]
    assert "stacked, not the cause" in heat.text[adapters.index("noop")][1]
    assert "ground truth" in heat.text[lora][0]
    assert consistency_matrix(consistency_cells(TABLE), "cuda:0/float32").layout.annotations


def test_tables():
    mutation = mutation_table(TABLE)
    assert list(mutation["tensor"]) == ["model.layers.0.self_attn.q_proj.weight"]
    assert list(mutation["changed by"]) == ["pissa"]
    flags = flag_rows(TABLE)
    assert sorted(zip(flags["adapter"], flags["role"], strict=True)) == [
        ("noop", "applied"),
        ("pissa", "disabled"),
    ]
    conversion = conversion_table(TABLE)
    assert list(conversion["adapter"]) == ["pissa_lora"] and conversion["max_abs"].iloc[0] == 2.4e-7
    for build in (mutation_table, flag_rows, conversion_table):
        assert build(pd.DataFrame()).empty
