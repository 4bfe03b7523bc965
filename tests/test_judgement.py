"""Judgement (core.judgement): agreement groups, peers and anomalies.

Unit tests on hand-made tables (exact ratios and partitions), then runs in process on the demo's tiny
Llama: a clean CPU run has no anomaly and its groups partition its targets; a target with one module's
output perturbed (a test-only hook) and a snapshot from "another machine" whose outputs were altered
are each an anomaly with the right target, check and tensor; ordinary variants never are.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.judgement import perturbing
from core import cli
from core.checks import get_checks
from core.engine.store import Store
from core.judgement import (
    ANOMALY,
    ANOMALY_RATIO,
    AS_EXPECTED,
    add_peer_columns,
    agreement_groups,
    anomalies,
    anomaly_records,
    dtype_floor,
    explain,
    judged_verdicts,
    ratio,
    rewrites,
    summarise_anomalies,
)
from core.spec import REFERENCE_TARGET, ProbeSpec, Target, peer_of

PERTURBED = "cpu/float32+threads=1"
PERTURBED_MODULE = "model.layers.1.mlp.down_proj"
GROUPED = ["weights", "deltas", "outputs"]


# --- peers --------------------------------------------------------------------------------------


def test_a_target_s_peer_is_the_cpu_target_of_its_dtype_without_flags():
    t = [Target.parse(s) for s in ("cuda:1/bfloat16+tf32", "cpu/float32+threads=1", "cpu/float32")]
    assert peer_of(t[0], t, REFERENCE_TARGET) == Target.parse("cpu/bfloat16")
    assert peer_of(t[1], t, REFERENCE_TARGET) == Target.parse("cpu/float32")
    assert peer_of(t[2], t, REFERENCE_TARGET) == t[2]  # its own peer: no ratio
    assert peer_of(Target.parse("cuda:0/float64"), t, REFERENCE_TARGET) is None  # the reference judges it


def test_an_imported_target_takes_the_local_peer_else_the_first_snapshot_s():
    a, b = Target.parse("box-a/cuda:0/float32"), Target.parse("box-a/cpu/float32")
    c = Target.parse("box-b/cpu/float32")
    local = Target.parse("cpu/float32")
    assert peer_of(a, [a, b, c, local], REFERENCE_TARGET) == local
    assert peer_of(a, [a, c, b], REFERENCE_TARGET) == c  # the first snapshot's in the run's order
    assert peer_of(a, [a], REFERENCE_TARGET, can_add=False) is None
    assert peer_of(a, [a], REFERENCE_TARGET, can_add=True) == local


def test_with_peers_adds_the_missing_ones_and_no_peers_adds_none():
    spec = ProbeSpec.from_dict(
        {"base": {"path": "m"}, "adapters": [], "targets": ["cuda:0/bfloat16+tf32", "cpu/float32+threads=1"]}
    )
    added = spec.with_peers()
    assert [str(t) for t in added.targets] == [
        "cuda:0/bfloat16+tf32",
        "cpu/float32+threads=1",
        "cpu/bfloat16",
        "cpu/float32",
    ]
    assert [str(t) for t in added.added_peers] == ["cpu/bfloat16", "cpu/float32"]
    assert ProbeSpec.from_dict(added.to_dict()) == added  # stored and read back as it ran
    off = ProbeSpec.from_dict({**spec.to_dict(), "peers": False})
    assert off.with_peers() == off and off.peer_map() == {}


# --- ratios and groups on hand-made tables ------------------------------------------------------


def _rows(*rows):
    cols = ["check", "target", "reference", "adapter", "tensor", "rel_l2", "verdict", "dtype"]
    return pd.DataFrame([dict(zip(cols, r, strict=True)) for r in rows])


def test_peer_ratio_is_rel_l2_over_the_peer_s_on_the_same_tensor():
    table = _rows(
        ("outputs", "cpu/float32", "cpu/float64", None, "logits", 2e-7, "within tolerance", "float32"),
        ("outputs", "cuda:0/float32", "cpu/float64", None, "logits", 6.2e-5, "drift", "float32"),
        ("outputs", "cuda:0/float32", "cpu/float64", "lora", "logits", 2e-7, "within tolerance", "float32"),
        ("outputs", "cpu/float32", "cpu/float64", "lora", "logits", 4e-7, "within tolerance", "float32"),
        ("weights", "cpu/float32", "checkpoint", None, "w", 0.0, "identical", "float32"),
        ("weights", "cuda:0/float32", "checkpoint", None, "w", 1e-9, "within tolerance", "float32"),
        ("merge", "cpu/float32", "unmerged (cpu/float32)", "lora", "y", 3e-7, "within tolerance", "float32"),
        (
            "merge",
            "cuda:0/float32",
            "unmerged (cuda:0/float32)",
            "lora",
            "y",
            6e-7,
            "within tolerance",
            "float32",
        ),
        ("memory", "cuda:0/float32", "x", None, "m", 5.0, "drift", "float32"),
    )
    peers = {"cpu/float32": "cpu/float32", "cuda:0/float32": "cpu/float32"}
    out = add_peer_columns(table, peers, {"outputs", "weights", "merge"}, strict=frozenset({"weights"}))
    assert out["peer"].tolist() == ["cpu/float32"] * 8 + [None]
    r = out["peer_ratio"].tolist()
    assert math.isnan(r[0]) and math.isnan(r[3])  # the peer's own rows have no ratio
    assert r[1] == 6.2e-5 / 2e-7 and r[2] == 2e-7 / 4e-7
    assert r[5] == math.inf  # the peer is bitwise exact, this target is not
    assert r[7] == 6e-7 / 3e-7  # a reference naming the row's own target is the peer's own
    assert math.isnan(r[8])  # memory is not judged
    assert (
        ratio(0.0, 0.0) == 1.0 and ratio(float("nan"), 1e-3) == math.inf and math.isnan(ratio(1.0, math.nan))
    )
    found = anomaly_records(out)
    assert found == [
        {"target": "cuda:0/float32", "check": "weights", "tensor": "w", "ratio": None, "peer": "cpu/float32"},
        {
            "target": "cuda:0/float32",
            "check": "outputs",
            "tensor": "logits",
            "ratio": 6.2e-5 / 2e-7,
            "peer": "cpu/float32",
        },
    ]


def test_a_computed_tensor_s_peer_error_is_floored_at_its_dtype_s_epsilon_and_a_load_s_is_not():
    eps32, eps16 = torch.finfo(torch.float32).eps, torch.finfo(torch.bfloat16).eps
    assert dtype_floor("float32") == eps32 and dtype_floor("torch.bfloat16") == eps16
    assert dtype_floor("float16") == torch.finfo(torch.float16).eps
    assert dtype_floor("float64") == torch.finfo(torch.float64).eps and dtype_floor("int8") == 0.0
    table = _rows(
        ("activations", "cpu/float32", "cpu/float64", None, "norm", 0.0, "identical", "float32"),
        ("activations", "cuda:0/float32", "cpu/float64", None, "norm", 5e-8, "within tolerance", "float32"),
        ("activations", "cuda:0/float32", "cpu/float64", "p", "up", 3e-5, "drift", "float32"),
        ("activations", "cpu/float32", "cpu/float64", "p", "up", 1e-7, "within tolerance", "float32"),
        ("weights", "cpu/float32", "checkpoint", None, "w", 0.0, "identical", "float32"),
        ("weights", "cuda:0/float32", "checkpoint", None, "w", 5e-8, "within tolerance", "float32"),
        ("outputs", "cpu/bfloat16", "cpu/float64", None, "logits", 0.0, "identical", "bfloat16"),
        ("outputs", "cuda:0/bfloat16", "cpu/float64", None, "logits", 4e-3, "drift", "bfloat16"),
    )
    peers = {t: t.replace("cuda:0", "cpu") for t in table["target"]}
    out = add_peer_columns(table, peers, {"activations", "weights", "outputs"}, strict=frozenset({"weights"}))
    r = out["peer_ratio"].tolist()
    assert r[1] == 5e-8 / eps32  # an exact CPU peer: GPU float32 rounding is no infinite ratio
    assert r[2] == 3e-5 / eps32  # the peer under ε: judged against ε
    assert r[5] == math.inf  # a load that should be bitwise and is not stays ∞
    assert r[7] == 4e-3 / eps16
    assert [a["tensor"] for a in anomaly_records(out)] == ["w", "up"]
    assert ratio(0.0, 0.0, eps32) == 1.0 and ratio(0.0, 0.0) == 1.0 and ratio(1e-9, 0.0) == math.inf
    # the pages' marks: judged drift is its dtype's rounding unless over k× the peer's, then an anomaly
    marks = judged_verdicts(out).tolist()
    assert marks == [
        "identical",
        "within tolerance",
        ANOMALY,
        "within tolerance",
        "identical",
        ANOMALY,
        "identical",
        AS_EXPECTED,
    ]


# The metrics table of `core run --demo --check weights deltas outputs merge activations generate` on an
# NVIDIA H200 (shared/gpu-runs/h200-2026-11-28/demo-all-checks), peer columns as that run wrote them.
H200_DEMO = Path(__file__).parent / "data" / "h200" / "demo-all-checks-metrics.parquet"


def test_on_the_h200_demo_the_anomalies_are_pissa_on_cuda_float32_and_tf32_and_nothing_on_bfloat16():
    table = pd.read_parquet(H200_DEMO).drop(columns=["peer", "peer_ratio"])
    targets = [Target.parse(t) for t in dict.fromkeys(table["target"])]
    peers = {str(t): str(peer_of(t, targets, REFERENCE_TARGET, True)) for t in targets}
    assert peers["cuda:0/float32+tf32"] == "cpu/float32" and peers["cuda:0/bfloat16"] == "cpu/bfloat16"
    strict = frozenset(c.name for c in get_checks(list(dict.fromkeys(table["check"]))) if c.loads_exactly)
    assert strict == {"weights"}
    out = add_peer_columns(table, peers, set(table["check"]), strict)
    found = anomalies(out)
    by = found.groupby(["target", "check"]).size().to_dict()
    assert by == {
        ("cuda:0/float32", "activations"): 59,
        ("cuda:0/float32", "merge"): 6,
        ("cuda:0/float32", "outputs"): 1,
        ("cuda:0/float32+tf32", "activations"): 546,
        ("cuda:0/float32+tf32", "deltas"): 100,
        ("cuda:0/float32+tf32", "merge"): 398,
        ("cuda:0/float32+tf32", "outputs"): 7,
    }
    assert set(found.loc[found["target"] == "cuda:0/float32", "adapter"]) == {"pissa"}
    # before the floor: 136 on cuda:0/float32, 70 of them infinite (norm layers exact on the CPU)
    before = anomalies(add_peer_columns(table, peers, set(table["check"]), frozenset(table["check"])))
    plain = before[before["target"] == "cuda:0/float32"]
    assert len(plain) == 136 and int((plain["peer_ratio"] == math.inf).sum()) == 70
    # the pages mark no bfloat16 cell as an anomaly, and no judged cell as bare drift
    marks = judged_verdicts(out)
    assert not (marks[out["dtype"] == "bfloat16"] == ANOMALY).any()
    assert not (marks[out["peer"].notna()] == "drift").any()
    summaries = summarise_anomalies(out)
    assert {s.target for s in summaries} == {"cuda:0/float32", "cuda:0/float32+tf32"}
    # the Overview's lines say that PiSSA alone is off on plain GPU float32, and TF32 everywhere
    plain = [s.sentence() for s in summaries if s.target == "cuda:0/float32"]
    assert len(plain) == 3 and all(", all pissa; worst " in line for line in plain)
    assert not any("all " in s.sentence() for s in summaries if s.target != "cuda:0/float32")


def test_groups_partition_targets_by_bitwise_equality_and_name_what_splits_them():
    pair = []
    for layer in range(2):
        for role in ("lora_A", "lora_B", "base"):
            name = f"layers.{layer}.q.{role}"
            adapter = None if role == "base" else "lora"
            for a, b, equal in (
                ("cuda:0", "cuda:2", True),
                ("cuda:0", "cuda:1", role == "base"),
                ("cuda:1", "cuda:3", True),
                ("cuda:2", "cuda:3", role == "base"),
            ):
                pair.append(("weights", f"{a}/float32", f"{b}/float32", adapter, name, layer, role, equal))
    cols = ["check", "target", "other", "adapter", "tensor", "layer", "role", "bitwise_equal"]
    pairwise = pd.DataFrame(pair, columns=cols)
    targets = [f"cuda:{i}/float32" for i in range(4)]
    groups = agreement_groups(pairwise, targets, ["weights"])["weights"]
    assert [g.members for g in groups.groups] == [
        ["cuda:0/float32", "cuda:2/float32"],
        ["cuda:1/float32", "cuda:3/float32"],
    ]
    assert groups.groups[1].n_differing == 4
    assert groups.sentence() == (
        "weights: {cuda:0/float32, cuda:2/float32} bitwise equal; {cuda:1/float32, cuda:3/float32} equal to "
        "each other, differs from the first group in 4 of 6 adapter tensors (lora_A/lora_B of every layer)"
    )


def test_the_flag_that_explains_an_anomaly_is_named_from_the_environment_diff():
    peer = {"tf32_matmul": False, "num_threads": 2, "float32_matmul_precision": "highest", "device": "cpu"}
    target = {**peer, "tf32_matmul": True, "float32_matmul_precision": "high", "device": "cuda:1"}
    assert explain(target, peer) == "TF32 on, float32 matmul precision 'high', on cuda:1 (peer: cpu)"
    assert explain(peer, peer) == ""


# --- runs on the demo ---------------------------------------------------------------------------


def _cli(capfd, *args) -> tuple[int, dict, str]:
    capfd.readouterr()
    code = cli.main([*args, "--in-process", "--json"])
    out = capfd.readouterr()
    return code, json.loads(out.out), out.err


def _lora(demo) -> list[str]:
    return ["--base", demo["models"]["tiny-llama"], "--adapter", f"{demo['adapters']['lora']['path']}=lora"]


def test_a_clean_cpu_run_has_no_anomaly_and_its_groups_partition_its_targets(demo_workspace, tmp_path, capfd):
    targets = ["cpu/float32", "cpu/float32+threads=1", "cpu/float32+deterministic", "cpu/bfloat16"]
    code, out, err = _cli(
        capfd,
        "run",
        *_lora(demo_workspace),
        "--target",
        *targets,
        "--check",
        *GROUPED,
        "activations",
        "--home",
        str(tmp_path),
    )
    assert out["status"] == "succeeded", err
    assert out["anomalies"] == []
    assert set(out["groups"]) == {*GROUPED, "activations"}
    for check, groups in out["groups"].items():
        members = [t for g in groups for t in g]
        assert sorted(members) == sorted(targets), check  # every target in exactly one group
    # loading is exact on every float32 target; their float32 weights are one group, bfloat16 another
    assert out["groups"]["weights"] == [targets[:3], ["cpu/bfloat16"]]
    table = Store(tmp_path).open(out["run_id"]).metrics()
    judged = table[table["check"].isin([*GROUPED, "activations"])]
    assert judged["peer"].notna().all()
    assert set(judged.loc[judged["target"] == "cpu/bfloat16", "peer"]) == {"cpu/bfloat16"}
    ratios = judged.loc[judged["target"] != judged["peer"], "peer_ratio"]
    assert ratios.notna().all() and ratios.max() < ANOMALY_RATIO / 4  # ordinary variants, far from k
    # the CLI summary leads with the answer, and bfloat16's drift is one line
    capfd.readouterr()
    cli.main(
        [
            "run",
            *_lora(demo_workspace),
            "--target",
            *targets,
            "--check",
            *GROUPED,
            "--home",
            str(tmp_path),
            "--in-process",
        ]
    )
    text = capfd.readouterr().out
    assert text.index("agreement groups:") < text.index("no anomaly") < text.index("verdicts per check")
    assert "drift as expected for bfloat16:" in text


def test_a_perturbed_module_is_an_anomaly_on_its_target_only(demo_workspace, tmp_path, capfd):
    with perturbing(PERTURBED, PERTURBED_MODULE, 1e-4):  # a test-only hook on that module's output
        code, out, err = _cli(
            capfd,
            "run",
            *_lora(demo_workspace),
            "--target",
            PERTURBED,
            "cpu/bfloat16",
            "--check",
            "outputs",
            "activations",
            "--home",
            str(tmp_path),
        )
    assert out["status"] == "succeeded", err
    found = {(a["target"], a["check"], a["tensor"]) for a in out["anomalies"]}
    assert {a["target"] for a in out["anomalies"]} == {PERTURBED}
    assert {a["peer"] for a in out["anomalies"]} == {"cpu/float32"}  # added as the peer
    assert (PERTURBED, "outputs", "logits") in found
    assert (PERTURBED, "activations", PERTURBED_MODULE) in found
    # nothing before the perturbed module is an anomaly: the first activation anomaly is that module
    table = Store(tmp_path).open(out["run_id"]).metrics()
    acts = table[(table["check"] == "activations") & (table["target"] == PERTURBED)]
    acts = acts[~acts["tensor"].str.startswith("local:")].sort_values("order")
    first = acts[acts["peer_ratio"] > ANOMALY_RATIO].iloc[0]
    assert first["tensor"] == PERTURBED_MODULE
    assert (acts.loc[acts["order"] < first["order"], "peer_ratio"] < ANOMALY_RATIO).all()
    assert out["groups"]["outputs"] == [[PERTURBED], ["cpu/bfloat16"], ["cpu/float32"]]


def test_no_peers_adds_none_and_judges_nothing(demo_workspace, tmp_path, capfd):
    with perturbing(PERTURBED, PERTURBED_MODULE, 1e-4):
        code, out, err = _cli(
            capfd,
            "run",
            *_lora(demo_workspace),
            "--target",
            PERTURBED,
            "--check",
            "outputs",
            "--no-peers",
            "--home",
            str(tmp_path),
        )
    assert out["status"] == "succeeded", err
    assert out["anomalies"] == [] and out["groups"] == {"outputs": [[PERTURBED]]}
    record = Store(tmp_path).open(out["run_id"])
    assert [str(t) for t in record.spec.targets] == [PERTURBED]
    assert record.metrics()["peer"].isna().all()
    assert "--no-peers" in record.judgement().unjudged


def _alter_outputs(run_dir: Path, target: str, scale: float) -> None:
    """What another machine might have produced: its outputs capture's logits scaled."""
    folder = run_dir / "captures" / Target.parse(target).slug
    tensors = load_file(folder / "tensors.safetensors")
    changed = {
        k: (v * (1 + scale) if "outputs" in k and v.is_floating_point() else v) for k, v in tensors.items()
    }
    assert any(not torch.equal(changed[k], tensors[k]) for k in tensors)
    save_file(changed, folder / "tensors.safetensors")


@pytest.mark.parametrize("scale, anomalous", [(0.0, False), (1e-4, True)])
def test_a_snapshot_from_another_machine_with_altered_outputs_is_an_anomaly(
    demo_workspace, tmp_path, capfd, scale, anomalous
):
    from core.engine.snapshot import write_snapshot

    code, made, err = _cli(
        capfd,
        "run",
        *_lora(demo_workspace),
        "--target",
        "cpu/float32",
        "--check",
        "outputs",
        "--home",
        str(tmp_path / "box"),
    )
    record = Store(tmp_path / "box").open(made["run_id"])
    if scale:
        _alter_outputs(record.run_dir, "cpu/float32", scale)
    snap = write_snapshot(record.run_dir, record.spec, tmp_path / "box.wdsnap", machine="gpu-box")
    code, out, err = _cli(
        capfd,
        "compare",
        str(snap),
        "--target",
        "cpu/float32",
        *_lora(demo_workspace)[2:],
        "--base",
        demo_workspace["models"]["tiny-llama"],
        "--home",
        str(tmp_path / "laptop"),
    )
    assert out["status"] == "succeeded", err
    found = {(a["target"], a["check"], a["tensor"], a["peer"]) for a in out["anomalies"]}
    if anomalous:
        assert ("gpu-box/cpu/float32", "outputs", "logits", "cpu/float32") in found
        assert {a["target"] for a in out["anomalies"]} == {"gpu-box/cpu/float32"}
    else:  # the same dtype in another process, on "another machine": an ordinary variant
        assert found == set()
        assert out["groups"]["outputs"] == [["gpu-box/cpu/float32", "cpu/float32"]]


# --- base weights an adapter rewrites at load (PiSSA) --------------------------------------------


def test_the_rewrite_sentence_names_the_targets_whose_rewritten_weights_differ_from_their_peer():
    names = [f"model.layers.{i}.mlp.up_proj.base_layer.weight" for i in range(12)]
    rows = [
        {
            "check": "weights",
            "target": t,
            "adapter": "pissa",
            "tensor": n,
            "rewrite": "SVD on the load device",
            "peer": "cpu/float32",
        }
        for t in ("cpu/float32", "cuda:0/float32")
        for n in names
    ]
    table = pd.DataFrame(rows)
    pairwise = pd.DataFrame(
        [
            {
                "check": "weights",
                "target": "cpu/float32",
                "other": "cuda:0/float32",
                "adapter": "pissa",
                "tensor": n,
                "bitwise_equal": i != 3,
            }
            for i, n in enumerate(names)
        ]
    )
    [found] = rewrites(table, pairwise, ["cpu/float32", "cuda:0/float32"])
    assert found.sentence() == (
        "pissa rewrites 12 base weights at load (SVD on the load device): cuda:0/float32 differs from "
        "cpu/float32 in them"
    )
    same = pairwise.assign(bitwise_equal=True)
    assert (
        rewrites(table, same, ["cpu/float32", "cuda:0/float32"])[0]
        .sentence()
        .endswith(": every target is bitwise its peer in them")
    )
    assert rewrites(table.drop(columns="rewrite"), pairwise, ["cpu/float32"]) == []
    # targets that are each their own peer (cpu/float32 and cpu/bfloat16) set nothing against each other
    alone = table[table["target"] == "cpu/float32"]
    assert (
        rewrites(alone, pairwise, ["cpu/float32"])[0]
        .sentence()
        .endswith(": no target here has a peer besides itself to set them against")
    )


def test_pissa_s_rewritten_base_is_measured_against_its_float64_rewrite_and_plain_lora_adds_none(
    demo_workspace, tmp_path, capfd
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from core.checks.weights import REWRITE_REFERENCE, REWRITTEN

    demo = demo_workspace
    pissa = demo["adapters"]["pissa"]["path"]
    targets = ["cpu/float32", "cpu/float32+threads=1", "cpu/bfloat16"]
    code, out, err = _cli(
        capfd,
        "run",
        *_lora(demo),
        f"{pissa}=pissa",
        "--target",
        *targets,
        "--check",
        "weights",
        "--home",
        str(tmp_path),
    )
    assert out["status"] == "succeeded", err
    record = Store(tmp_path).open(out["run_id"])
    table = record.metrics()
    rewritten = table[table["role"] == REWRITTEN]
    # PiSSA's 12 targeted base weights on every target; LoRA rewrites none
    assert set(rewritten["adapter"]) == {"pissa"}
    assert rewritten.groupby("target")["tensor"].nunique().to_dict() == {t: 12 for t in targets}
    assert set(rewritten["reference"]) == {REWRITE_REFERENCE}
    assert set(rewritten["rewrite"]) == {"SVD on the load device"}

    # the float32 row is PEFT's own residual against W − U_r S_r V_rᵀ in float64, computed here alone
    name = "model.layers.0.self_attn.q_proj"
    base = AutoModelForCausalLM.from_pretrained(demo["models"]["tiny-llama"], dtype=torch.float32)
    w64 = base.get_submodule(name).weight.detach().to(torch.float64)
    peft_w = PeftModel.from_pretrained(base, pissa).base_model.model.get_submodule(name).base_layer.weight
    u, s, vh = torch.linalg.svd(w64, full_matrices=False)
    ref = w64 - u[:, :8] @ torch.diag(s[:8]) @ vh[:8]
    row = rewritten[
        (rewritten["target"] == "cpu/float32") & (rewritten["tensor"] == f"{name}.base_layer.weight")
    ]
    d = peft_w.detach().to(torch.float64) - ref
    assert row["max_abs"].item() == d.abs().max().item()
    assert row["rel_l2"].item() == pytest.approx((d.norm() / ref.norm()).item(), rel=1e-12)
    assert not row["bitwise_equal"].item()

    # bfloat16's rewrite differs from float32's: the weights groups split on it and say so
    assert ["cpu/bfloat16"] in out["groups"]["weights"]
    [sentence] = out["rewrites"]
    assert sentence.startswith("pissa rewrites 12 base weights at load (SVD on the load device): ")
    # a thread count that changes the SVD's rounding is named exactly when its rewritten weights differ
    pairs = record.table("pairwise")
    mine = pairs[
        (pairs["target"].isin(["cpu/float32", targets[1]]))
        & (pairs["other"].isin(["cpu/float32", targets[1]]))
        & pairs["tensor"].isin(set(rewritten["tensor"]))
    ]
    differs = not mine["bitwise_equal"].astype(bool).all()
    assert (f"{targets[1]} differs from cpu/float32 in them" in sentence) == differs
    assert sentence.endswith("every target is bitwise its peer in them") == (not differs)

    # plain LoRA alone: no rewritten row, no rewrite sentence
    code, out, err = _cli(
        capfd, "run", *_lora(demo), "--target", "cpu/float32", "--check", "weights", "--home", str(tmp_path)
    )
    assert out["status"] == "succeeded", err
    table = Store(tmp_path).open(out["run_id"]).metrics()
    assert not (table["role"] == REWRITTEN).any() and out["rewrites"] == []
