"""Figure builders of the Merge residuals page, on hand-made rows."""

import pandas as pd

from dashboard.figures_merge import stage_bars, stage_table, weight_heatmap, worst_modules


def _rows():
    base = {"check": "merge", "adapter": "lora", "reference": "x", "explanation": "", "note": ""}
    out = []
    for target, scale in (("cpu/float32", 1e-7), ("cpu/bfloat16", 1e-3)):
        for stage in ("reload", "merge_adapter", "unmerged"):
            out.append(
                {
                    **base,
                    "target": target,
                    "role": "output",
                    "stage": stage,
                    "tensor": f"output:{stage}:logits",
                    "layer": None,
                    "module": "logits",
                    "against": "cpu/float64",
                    "max_abs": scale,
                    "rel_l2": scale,
                    "max_ulp": 1.0,
                    "min_atol": 0.0,
                    "verdict": "drift",
                    "peft_tol": 1e-4,
                    "peft_verdict": "within tolerance",
                    "dtype": "float32",
                    "shape": "2x16x256",
                }
            )
        out.append(
            {
                **base,
                "target": target,
                "role": "merged",
                "stage": "merge_adapter",
                "layer": 0,
                "module": "q_proj",
                "tensor": "merged:merge_adapter:model.layers.0.self_attn.q_proj",
                "max_abs": scale,
                "rel_l2": scale,
                "max_ulp": 2.0,
                "min_atol": 0.0,
                "verdict": "broken",
                "dtype": "float32",
                "shape": "64x64",
            }
        )
    return pd.DataFrame(out)


def test_stage_bars_one_panel_per_target_in_stage_order():
    t = _rows()
    fig = stage_bars(t[t.role == "output"])
    assert [a.text for a in fig.layout.annotations] == ["cpu/float32", "cpu/bfloat16"]
    assert list(fig.data[0].x) == ["unmerged", "merge_adapter", "reload"]
    assert fig.data[0].text[0] == "▲/✓"


def test_stage_table_and_worst_modules():
    t = _rows()
    assert list(stage_table(t[t.role == "output"]).stage[:3]) == ["unmerged", "merge_adapter", "reload"]
    worst = worst_modules(t[t.role == "merged"], "max_ulp")
    assert worst.iloc[0].verdict == "broken"
    fig = weight_heatmap(t[t.role == "merged"], "max_ulp")
    assert len(fig.data) > 0


def test_empty_tables():
    assert stage_bars(_rows().iloc[0:0]).layout.annotations
