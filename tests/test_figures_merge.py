"""Figure builders of the Merge residuals page, on hand-made rows."""

import pandas as pd

from dashboard.figures.common import drift_heatmap
from dashboard.figures.merge import stage_bars, stage_table, worst_modules


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
    # one log axis for all panels, so 1e-3 (bfloat16) stands four decades above 1e-7 (float32)
    axes = [fig.layout.yaxis, fig.layout.yaxis2]
    assert [a.type for a in axes] == ["log", "log"] and axes[1].matches == "y"


def test_stage_table_and_worst_modules():
    t = _rows()
    assert list(stage_table(t[t.role == "output"]).stage[:3]) == ["unmerged", "merge_adapter", "reload"]
    worst = worst_modules(t[t.role == "merged"], "max_ulp")
    assert worst.iloc[0].verdict == "broken"
    fig = drift_heatmap(t[t.role == "merged"], "max_ulp")
    assert len(fig.data) > 0


def test_empty_tables():
    assert stage_bars(_rows().iloc[0:0]).layout.annotations


def test_method_summary_one_row_per_adapter_and_target_worst_first():
    from dashboard.figures.merge import method_summary

    def row(adapter, target, role, stage="merge_adapter", against=None, **kw):
        return {"adapter": adapter, "target": target, "role": role, "stage": stage, "against": against, **kw}

    table = pd.DataFrame(
        [
            row("lora", "cpu/float32", "merged", max_abs=4e-8, scale_ulp=1.9, verdict="within tolerance"),
            row("lora", "cpu/float32", "merged", max_abs=1e-8, scale_ulp=0.5, verdict="identical"),
            # safe_merge's weights have their own column; the default path's lead the summary
            row(
                "lora",
                "cpu/float32",
                "merged",
                "safe_merge",
                max_abs=9e-8,
                scale_ulp=3.0,
                verdict="identical",
            ),
            row("lora", "cpu/float32", "roundtrip", stage="unmerge_adapter", max_abs=3e-9, verdict="drift"),
            row(
                "lora",
                "cpu/float32",
                "output",
                stage="merge_and_unload",
                against="unmerged (cpu/float32)",
                max_abs=3e-7,
                verdict="within tolerance",
                peft_verdict="within tolerance",
            ),
            row(
                "lora",
                "cpu/float32",
                "output",
                stage="merge_and_unload",
                against="cpu/float64",
                max_abs=2e-7,
                verdict="within tolerance",
                peft_verdict="drift",
            ),
            row(
                "lora",
                "cpu/float32",
                "output",
                stage="reload",
                against="merged before save",
                max_abs=0.0,
                verdict="identical",
            ),
            row("tied", "cpu/float32", "merged", max_abs=0.3, scale_ulp=9.0, verdict="broken"),
        ]
    )
    save = pd.DataFrame(
        [
            {"target": "cpu/float32", "adapter": "lora", "method": "save_pretrained", "ok": True},
            {"target": "cpu/float32", "adapter": "lora", "method": "safetensors.save_file", "ok": False},
        ]
    )
    summary = method_summary(table, save)
    assert list(summary["adapter"]) == ["tied", "lora"]  # broken first
    lora = summary.iloc[1]
    assert lora["verdict"] == "drift"  # the round trip's verdict is the worst of the adapter's rows
    assert (lora["weights_scale_ulp"], lora["weights_max_abs"]) == (1.9, 4e-8)
    assert lora["safe_merge_max_abs"] == 9e-8
    assert (lora["merged_vs_unmerged"], lora["merged_vs_fp64"]) == (3e-7, 2e-7)
    assert lora["peft_verdict"] == "drift" and lora["roundtrip_max_abs"] == 3e-9
    assert bool(lora["reload_identical"])
    assert lora["saves_with"] == "save_pretrained"
    assert pd.isna(summary.iloc[0]["reload_identical"]) and summary.iloc[0]["saves_with"] == ""


def test_stages_in_run_order_with_what_they_run():
    from dashboard.figures.merge import ordered_stages, stage_legend

    assert ordered_stages(
        ["reload", "subset unmerged", "safe_merge", "unmerged", "merge_adapter", "safe_merge"]
    ) == [
        "unmerged",
        "merge_adapter",
        "safe_merge",
        "reload",
        "subset unmerged",
    ]
    assert ordered_stages(["someday", "unmerged"]) == ["unmerged", "someday"]  # unknown ones last
    legend = stage_legend(["merge_and_unload", "safe_merge", "someday"]).set_index("stage")
    assert list(legend.index) == ["safe_merge", "merge_and_unload", "someday"]
    assert legend.loc["safe_merge", "runs"].startswith("layer.merge(safe_merge=True")
    assert "PEFT's defaults (safe_merge=False)" in legend.loc["merge_and_unload", "runs"]
    assert legend.loc["someday", "runs"] == ""


def test_a_legacy_table_is_relabelled_for_what_it_ran():
    from dashboard.figures.merge import relabel_legacy

    old = pd.DataFrame(
        {
            "stage": [
                "unmerged",
                "merge_adapter",
                "unmerge_adapter",
                "merge_and_unload",
                "reload",
                "subset together",
            ],
            "tensor": ["output:merge_adapter:logits"] * 6,
        }
    )
    relabelled, legacy = relabel_legacy(old)
    assert legacy
    assert list(relabelled.stage) == [
        "unmerged",
        "safe_merge",
        "unmerge after safe_merge",
        "merge_and_unload(safe_merge=True) after merge + unmerge",
        "reload",
        "subset safe_merge combined",
    ]
    assert (relabelled.tensor == old.tensor).all()  # the stored names, which the drill-down reads
    fig = stage_bars(
        relabelled.assign(
            target="cpu/float32",
            max_abs=1e-3,
            rel_l2=1e-3,
            verdict="drift",
            against="cpu/float64",
            reference="x",
        )
    )
    assert list(fig.data[0].x) == list(relabelled.stage)
    # a table of today's check is left alone, and so is one without merge stages
    new = pd.DataFrame({"stage": ["unmerged", "merge_adapter", "safe_merge"]})
    assert relabel_legacy(new)[1] is False and relabel_legacy(new)[0] is new
    assert relabel_legacy(pd.DataFrame({"stage": ["unmerged"]}))[1] is False
