"""The `merge` check's own tables, from its captures' metadata: `merge_save` (what each save path did
with the merged model, and the reload) and `merge_findings` (tied storage, NaN/Inf merged in, refusals,
stages that do not apply, a merge into weights bitsandbytes repacked for its fused CPU kernel). Beside `core.checks.merge`, which is at the size limit."""

from __future__ import annotations

import pandas as pd

from core.capture import Capture

SUBSET_SEP = "+"  # joins the names of the adapters merged together into one adapter slot
UNTIE = "untie before merging"
# bitsandbytes' fused 4-bit CPU kernel (its default on a CPU with AVX512-BF16) repacks a weight at the first
# forward; PEFT's merge then reads the repacked layout as the plain one (`core.models.targets.repacked`)
REPACKED_MERGE = (
    "PEFT's merge read the 4-bit weight in the layout bitsandbytes' fused CPU kernel (AVX512-BF16, its "
    "default here) repacked it into at the first forward as the plain one: the merged W is not W + ΔW"
)
REPACKED_SAVE = (
    "save_pretrained after a forward: bitsandbytes' state_dict() undoes the CPU repacking but leaves the "
    "block scales of a row with several blocks in the packed order (bitsandbytes 0.50.2), so the saved "
    "model is not the one that ran"
)
# the merge check's output stages a merge of repacked weights changes (against unmerged and the reference)
REPACKED_STAGES = (
    "merge_adapter",
    "unmerge_adapter",
    "safe_merge",
    "merge_and_unload",
    "reload",
    "subset merge_adapter sequential",
    "subset merge_adapter combined",
)


def subset_label(names: list[str] | tuple[str, ...]) -> str:
    """The adapter slot of the adapters merged together: their names joined by `SUBSET_SEP`."""
    return SUBSET_SEP.join(names)


def repacked_finding(info: dict) -> str:
    """The sentence of a merge into 4-bit weights bitsandbytes had repacked for its fused CPU kernel."""
    moved = info.get("repacked_moved")
    by = (
        ""
        if moved is None
        else f": merge_and_unload() moved the outputs by {moved:.3g} (max |Δ| against unmerged)"
    )
    return (
        f"on this CPU (AVX512-BF16) bitsandbytes' default fused 4-bit kernel repacked the weights of "
        f"{len(info['repacked'])} adapted modules at the first forward, and PEFT's merge read them as the "
        f"plain layout, so the merged weights are not W + ΔW{by}; merged before any forward, or on the "
        "target +portable, they are"
    )


def save_table(captures: list[Capture]) -> pd.DataFrame:
    """The save report: per target, adapter and save path, whether it worked, the error and the fix."""
    rows = []
    for c in captures:
        for adapter, info in c.meta.get("merge", {}).get("adapters", {}).items():
            save = info.get("save")
            if not save:
                continue
            shared = "; ".join(" ↔ ".join(g) for g in save.get("shared", []))
            for attempt in save.get("attempts", []):
                rows.append(
                    {
                        "target": c.target,
                        "adapter": adapter,
                        "method": attempt["method"],
                        "ok": bool(attempt["ok"]),
                        "error": attempt.get("error", ""),
                        "shared_tensors": shared,
                        "folder": attempt.get("folder", ""),
                        "files": ", ".join(attempt.get("files") or []),
                        "reload_error": save.get("reload_error", "")
                        if attempt["method"] == "save_pretrained"
                        else "",
                        "fix": save.get("fix", "") if not attempt["ok"] else "",
                    }
                )
    return pd.DataFrame(
        rows,
        columns=[
            "target",
            "adapter",
            "method",
            "ok",
            "error",
            "shared_tensors",
            "folder",
            "files",
            "reload_error",
            "fix",
        ],
    )


def findings_table(captures: list[Capture]) -> pd.DataFrame:
    """Adapters whose merge rule is not covered, tied adapted modules, NaN/Inf merged in, safe-merge
    refusals, stages that could not apply or start from the loaded W, per target and adapter."""
    rows = []
    for c in captures:
        merge_meta = c.meta.get("merge", {})
        for adapter, info in merge_meta.get("adapters", {}).items():
            for field, finding in (("not_covered", "not covered"), ("does_not_apply", "does not apply")):
                if info.get(field):
                    rows.append(
                        {
                            "target": c.target,
                            "adapter": adapter,
                            "finding": finding,
                            "module": "",
                            "detail": info[field],
                        }
                    )
            for f in info.get("tied", []):
                rows.append(
                    {
                        "target": c.target,
                        "adapter": adapter,
                        "finding": "tied",
                        "module": f["module"],
                        "detail": f"{f['pair']}: merging changes {', '.join(f['tied_to'])} too; {UNTIE}",
                    }
                )
            for module, n in info.get("nonfinite_merged", {}).items():
                rows.append(
                    {
                        "target": c.target,
                        "adapter": adapter,
                        "finding": "nonfinite_merge",
                        "module": module,
                        "detail": f"merge_adapter() with PEFT's default safe_merge=False wrote {n} NaN/Inf into W "
                        "(merge_and_unload() runs the same merge; safe_merge=True refuses this module)",
                    }
                )
            for module, error in info.get("safe_merge_errors", {}).items():
                rows.append(
                    {
                        "target": c.target,
                        "adapter": adapter,
                        "finding": "safe_merge",
                        "module": module,
                        "detail": error,
                    }
                )
            for stage in ("merge_adapter", "merge_and_unload"):
                if info.get(f"{stage}_error"):
                    rows.append(
                        {
                            "target": c.target,
                            "adapter": adapter,
                            "finding": stage,
                            "module": "",
                            "detail": info[f"{stage}_error"],
                        }
                    )
            if info.get("repacked"):
                rows.append(
                    {
                        "target": c.target,
                        "adapter": adapter,
                        "finding": "repacked",
                        "module": "",
                        "detail": repacked_finding(info),
                    }
                )
            for module in info.get("restore_mismatch", []):
                rows.append(
                    {
                        "target": c.target,
                        "adapter": adapter,
                        "finding": "restore",
                        "module": module,
                        "detail": "its parameters could not be restored bit for bit to the loaded ones: the stages "
                        "after the first merge do not start from the loaded W",
                    }
                )
        for module in merge_meta.get("subset_restore_mismatch", []):
            rows.append(
                {
                    "target": c.target,
                    "adapter": subset_label(merge_meta.get("subset", [])),
                    "finding": "restore",
                    "module": module,
                    "detail": "not restored bit for bit before the combined merge",
                }
            )
        if merge_meta.get("subset_repacked"):
            rows.append(
                {
                    "target": c.target,
                    "adapter": subset_label(merge_meta.get("subset", [])),
                    "finding": "repacked",
                    "module": "",
                    "detail": repacked_finding({"repacked": merge_meta["subset_repacked"]}),
                }
            )
        for field in ("subset_note", "subset_together_error"):
            if merge_meta.get(field):
                rows.append(
                    {
                        "target": c.target,
                        "adapter": subset_label(merge_meta.get("subset", [])),
                        "finding": "subset",
                        "module": "",
                        "detail": merge_meta[field],
                    }
                )
    return pd.DataFrame(rows, columns=["target", "adapter", "finding", "module", "detail"])
