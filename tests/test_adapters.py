"""Adapter consistency: the load strategies on the demo models, the pure pieces in core.methods.consistency,
and the `adapters` check's rows.

The facts of issue 6, measured on the tiny demo llama in float32 on the CPU: a loop of
`PeftModel.from_pretrained` over two plain LoRAs stacks them yet predicts bitwise like `isolated`;
an unconverted PiSSA rewrites the base, so a LoRA loaded after it drifts (max |Δlogit| ≈ 0.1) with
both `from_pretrained_loop` and `load_adapter`; the converted PiSSA agrees with it (≈ 2e-7) and no
longer changes later adapters; a zero-B LoRA changes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from core.checks.outputs import forward_output
from core.methods import consistency
from core.models.checkpoint import LoadError, read_checkpoint
from core.models.loading import STRATEGIES
from core.spec import AdapterRef, ModelRef, Target

CPU32 = Target.parse("cpu/float32")
PISSA_MODULES = {
    f"model.layers.{i}.{m}.weight"
    for i in range(4)
    for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj")
}


@pytest.fixture(scope="module")
def ws(demo_workspace, tmp_path_factory) -> dict:
    """Base path and adapter paths; `lora_b` and `lora_noop` made here when the demo lacks them."""
    adapters = {name: entry["path"] for name, entry in demo_workspace["adapters"].items()}
    base = demo_workspace["models"]["tiny-llama"]
    missing = [n for n in ("lora_b", "lora_noop") if n not in adapters]
    if missing:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        folder = tmp_path_factory.mktemp("extra-adapters")
        configs = {
            "lora_b": (
                LoraConfig(
                    r=4, target_modules=["q_proj", "v_proj", "o_proj", "up_proj"], init_lora_weights=False
                ),
                7,
            ),
            "lora_noop": (LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), 8),  # B = 0
        }
        for name in missing:
            config, seed = configs[name]
            torch.manual_seed(seed)
            get_peft_model(AutoModelForCausalLM.from_pretrained(base), config).save_pretrained(folder / name)
            adapters[name] = str(folder / name)
    return {"base": base, "adapters": adapters}


def refs(ws: dict, *names: str) -> tuple[AdapterRef, ...]:
    return tuple(AdapterRef(ws["adapters"][n], n) for n in names)


IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def run_strategy(ws: dict, strategy: str, names: tuple[str, ...], target: Target = CPU32) -> dict:
    """Load `names` by `strategy`; per step: logits, logits with the adapter disabled, base
    fingerprint, module structure, notes; plus the number of stage() calls."""
    stages: list[str] = []
    steps: dict[str, dict] = {}
    for loaded in STRATEGIES[strategy].load(
        ModelRef(ws["base"]), refs(ws, *names), target, stage=stages.append
    ):
        name = "-" if loaded.adapter is None else loaded.adapter.name
        step = {
            "logits": forward_output(loaded.model, {"input_ids": IDS})[1],
            "fingerprint": consistency.fingerprint(loaded.model),
        }
        if loaded.adapter is not None:
            with loaded.model.disable_adapter():
                step["disabled"] = forward_output(loaded.model, {"input_ids": IDS})[1]
            step["structure"] = consistency.module_structure(loaded.model)
            step["notes"] = loaded.notes
            step["base_tensors"] = dict(consistency.base_parameters(loaded.model))
        steps[name] = step
    steps["stages"] = stages
    return steps


@pytest.fixture(scope="module")
def isolated(ws) -> dict:
    return run_strategy(ws, "isolated", ("lora", "lora_b", "pissa", "pissa_lora", "lora_noop"))


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def test_strategies_registered_with_exact_stage_counts(ws):
    assert {"isolated", "from_pretrained_loop", "load_adapter", "load_adapter_low_mem"} <= set(STRATEGIES)
    names = ("lora", "lora_b", "lora_noop")
    for strategy in ("from_pretrained_loop", "load_adapter", "load_adapter_low_mem"):
        steps = run_strategy(ws, strategy, names)
        assert len(steps["stages"]) == STRATEGIES[strategy].stages(refs(ws, *names), CPU32) == 4, strategy
        assert steps["stages"] == [
            "load base",
            "load adapter lora",
            "load adapter lora_b",
            "load adapter lora_noop",
        ]


def test_loop_over_two_loras_stacks_them_yet_predicts_bitwise_like_isolated(ws, isolated):
    loop = run_strategy(ws, "from_pretrained_loop", ("lora", "lora_b"))
    # stacked: modules the second call adapted hold both adapters, the last one active
    groups = consistency.structure_groups(loop["lora_b"]["structure"])
    assert consistency.is_stacked(loop["lora_b"]["structure"])
    assert {"holds": ["lora", "lora_b"], "active": ["lora_b"]}.items() <= groups[0].items()
    assert groups[0]["text"] == "holds lora, lora_b; active lora_b"
    assert all(s["active"] == ["lora_b"] for s in loop["lora_b"]["structure"])
    assert any("Already found a `peft_config`" in n for n in loop["lora_b"]["notes"])
    # … and yet: predictions bitwise equal to isolated, base weights untouched
    for name in ("lora", "lora_b"):
        assert torch.equal(loop[name]["logits"], isolated[name]["logits"]), name
        assert torch.equal(loop[name]["disabled"], loop["-"]["logits"]), name
        assert consistency.changed_tensors(loop["-"]["fingerprint"], loop[name]["fingerprint"]) == []


@pytest.mark.parametrize("strategy", ["from_pretrained_loop", "load_adapter"])
def test_unconverted_pissa_mutates_the_base_and_changes_a_later_lora(ws, isolated, strategy):
    steps = run_strategy(ws, strategy, ("pissa", "lora"))
    # PiSSA itself predicts as isolated; the LoRA after it does not
    assert torch.equal(steps["pissa"]["logits"], isolated["pissa"]["logits"])
    drift = max_abs(steps["lora"]["logits"], isolated["lora"]["logits"])
    assert 0.01 < drift < 1.0, drift  # measured 0.1039 (torch 2.13, peft 0.21.2)
    agree = consistency.agreement(steps["lora"]["logits"], isolated["lora"]["logits"])
    assert agree["argmax_agree"] < 1.0
    # the base-mutation list names exactly the PiSSA-targeted weights, at both steps
    for step in ("pissa", "lora"):
        assert (
            set(consistency.changed_tensors(steps["-"]["fingerprint"], steps[step]["fingerprint"]))
            == PISSA_MODULES
        )
    # … each of them differs from the checkpoint (the PiSSA residual replaced W)
    checkpoint = read_checkpoint(ws["base"], names=PISSA_MODULES)
    for name in PISSA_MODULES:
        assert max_abs(steps["lora"]["base_tensors"][name], checkpoint[name]) > 1e-3, name
    # disable_adapter() exposes the mutation: outputs are no longer the base model's
    assert max_abs(steps["lora"]["disabled"], steps["-"]["logits"]) > 0.01
    assert max_abs(steps["pissa"]["disabled"], steps["-"]["logits"]) > 0.01


def test_isolated_pissa_mutates_only_its_own_base(isolated):
    assert (
        set(consistency.changed_tensors(isolated["-"]["fingerprint"], isolated["pissa"]["fingerprint"]))
        == PISSA_MODULES
    )
    for name in ("lora", "lora_b", "pissa_lora", "lora_noop"):
        assert consistency.changed_tensors(isolated["-"]["fingerprint"], isolated[name]["fingerprint"]) == []


def test_converted_pissa_agrees_with_pissa_and_no_longer_changes_later_adapters(ws, isolated):
    pissa = json.loads((Path(ws["adapters"]["pissa"]) / "adapter_config.json").read_text())
    converted = json.loads((Path(ws["adapters"]["pissa_lora"]) / "adapter_config.json").read_text())
    assert converted["r"] == 2 * pissa["r"]  # the conversion doubles the rank
    residual = max_abs(isolated["pissa_lora"]["logits"], isolated["pissa"]["logits"])
    assert 0 < residual < 1e-6, residual  # measured 2.4e-7: float32 rounding only
    loop = run_strategy(ws, "from_pretrained_loop", ("pissa_lora", "lora"))
    assert torch.equal(loop["lora"]["logits"], isolated["lora"]["logits"])
    assert consistency.changed_tensors(loop["-"]["fingerprint"], loop["lora"]["fingerprint"]) == []
    assert torch.equal(loop["pissa_lora"]["disabled"], loop["-"]["logits"])


def test_zero_b_adapter_is_not_applied(isolated):
    assert torch.equal(isolated["lora_noop"]["logits"], isolated["-"]["logits"])
    assert not torch.equal(isolated["lora"]["logits"], isolated["-"]["logits"])


def test_low_cpu_mem_usage_cannot_initialise_pissa(ws):
    with pytest.raises(LoadError, match="adapter pissa .* did not load"):
        run_strategy(ws, "load_adapter_low_mem", ("pissa", "lora"))


def test_pissa_on_a_float64_target_is_loaded_through_float32(ws):
    steps = run_strategy(ws, "load_adapter", ("lora", "pissa"), Target.parse("cpu/float64"))
    assert steps["pissa"]["logits"].dtype == torch.float64
    assert any("cast to float32 for this load" in n for n in steps["pissa"]["notes"])


# --- pure pieces --------------------------------------------------------------------------------


def test_fingerprint_names_are_checkpoint_names(ws, isolated):
    names = set(isolated["lora"]["fingerprint"])
    assert names == set(read_checkpoint(ws["base"]))  # tied lm_head is listed once, as in the file
    assert not any("lora_" in n or "base_layer" in n for n in names)


def test_tensor_hash_sees_every_bit():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    u = t.clone()
    u.view(torch.int32)[1, 2] ^= 1  # one mantissa bit
    assert consistency.tensor_hash(t) == consistency.tensor_hash(t.clone())
    assert consistency.tensor_hash(t) != consistency.tensor_hash(u)
    assert consistency.tensor_hash(t) != consistency.tensor_hash(t.reshape(3, 2))
    assert consistency.tensor_hash(t) != consistency.tensor_hash(t.double())
    assert consistency.changed_tensors({"a": "1", "b": "2"}, {"a": "1", "b": "3", "c": "4"}) == ["b", "c"]


def test_agreement():
    ref = torch.tensor([[[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]]])
    assert consistency.agreement(ref, ref, k=2) == {"argmax_agree": 1.0, "topk_agree": 1.0}
    other = torch.tensor([[[0.0, 1.0, 3.0, 2.0], [3.0, 2.0, 1.0, 0.0]]])  # position 0: top-1 3→2
    assert consistency.agreement(other, ref, k=2) == {"argmax_agree": 0.5, "topk_agree": 1.0}
    assert consistency.agreement(other, ref, k=1) == {"argmax_agree": 0.5, "topk_agree": 0.5}
    nan = consistency.agreement(ref, ref[:, :1])
    assert nan["argmax_agree"] != nan["argmax_agree"]


def test_structure_groups_describe_stacking():
    structure = [
        {"module": "a.q", "available": ["m1", "m2"], "active": ["m2"]},
        {"module": "b.q", "available": ["m1", "m2"], "active": ["m2"]},
        {"module": "a.k", "available": ["m2"], "active": ["m2"]},
    ]
    groups = consistency.structure_groups(structure)
    assert [(g["text"], g["modules"]) for g in groups] == [
        ("holds m1, m2; active m2", 2),
        ("holds m2; active m2", 1),
    ]
    assert consistency.is_stacked(structure) and not consistency.is_stacked(structure[2:])


def test_conversion_pairs(ws):
    configs = {
        n: json.loads((Path(ws["adapters"][n]) / "adapter_config.json").read_text())
        for n in ("pissa", "pissa_init", "pissa_lora", "lora", "lora_b")
    }
    assert consistency.conversion_pairs(configs) == [("pissa", "pissa_lora")]
    assert consistency.conversion_pairs({k: v for k, v in configs.items() if k != "pissa_lora"}) == []
    twin = {**configs, "other": configs["pissa_lora"]}
    # two fits for `pissa`: the one named pissa_lora wins
    assert ("pissa", "pissa_lora") in consistency.conversion_pairs(twin)


# --- the `adapters` check through the engine (in-process runner) ---------------------------------


def run_check(tmp_path, manifest, adapters, strategies, scenario=None):
    from core.demo.scenarios import demo_spec, scenario_spec
    from core.engine.jobs import Engine
    from core.engine.runners import InProcessRunner

    engine = Engine(tmp_path, runner=InProcessRunner())
    if scenario:
        spec = scenario_spec(scenario, manifest, engine.devices)
    else:
        spec = demo_spec(manifest, adapters, ["cpu/float32"], ["adapters"], strategies=strategies)
    job = engine.submit(spec)
    assert job.wait(300)
    snap = job.snapshot()
    assert snap["state"] == "succeeded", snap["error"]
    return engine.store.open(job.run_id), snap


def test_check_loop_over_pissa_and_lora(tmp_path, demo_workspace):
    from core.checks import CHECKS
    from core.checks.base import METRIC_COLUMNS

    record, snap = run_check(tmp_path, demo_workspace, None, None, scenario="loop-pissa-lora")
    spec = record.spec
    assert spec.strategies == ("from_pretrained_loop", "load_adapter")
    assert CHECKS["adapters"].variants(spec, CPU32) == ("isolated", "from_pretrained_loop", "load_adapter")
    for variant in ("isolated", "from_pretrained_loop", "load_adapter"):
        task = snap["tasks"][f"cpu/float32 · adapters:{variant}"]
        assert task["step"] == task["of"]  # the stage count is exact
    table = record.metrics()
    assert set(METRIC_COLUMNS) <= set(table.columns) and "strategy" in table.columns
    assert set(table["target"]) == {"cpu/float32"}
    pred = table[table["role"] == "prediction"].set_index(["strategy", "adapter"])
    for strategy in ("from_pretrained_loop", "load_adapter"):
        lora = pred.loc[(strategy, "lora")]
        assert lora["verdict"] == "drift" and 0.01 < lora["max_abs"] < 1.0
        assert lora["argmax_agree"] < 1.0 and lora["topk_agree"] < 1.0
        assert "base mutated by pissa (PiSSA)" in lora["reason"] and "stacked" in lora["reason"]
        assert pred.loc[(strategy, "pissa")]["verdict"] == "identical"
        base = table[(table["role"] == "base weight") & (table["strategy"] == strategy)]
        assert set(base["tensor"]) == PISSA_MODULES and set(base["adapter"]) == {"pissa"}
        assert (base["verdict"] == "drift").all() and (base["reference"] == "checkpoint").all()
        disabled = table[(table["role"] == "disabled") & (table["strategy"] == strategy)].set_index("adapter")
        assert disabled.loc["lora", "verdict"] == "drift" and disabled.loc["lora", "reason"] == "base mutated"
    assert not len(table[(table["role"] == "prediction") & (table["strategy"] == "isolated")])
    structure = record.table("adapters_structure")
    loop = structure[(structure["strategy"] == "from_pretrained_loop") & (structure["step"] == "lora")]
    assert "holds lora, pissa; active lora" in set(loop["structure"])


def test_check_stacked_loras_are_not_blamed_and_the_noop_is_flagged(tmp_path, demo_workspace):
    record, _ = run_check(tmp_path, demo_workspace, None, None, scenario="adapter-not-applied")
    table = record.metrics()
    pred = table[table["role"] == "prediction"].set_index("adapter")
    assert (pred["verdict"] == "identical").all() and (pred["bitwise_equal"]).all()
    assert pred.loc["lora_b", "stacked"]
    assert "stacking is not the cause" in pred.loc["lora_b", "reason"]
    applied = table[table["role"] == "applied"]
    assert set(applied["adapter"]) == {"lora_noop"} and set(applied["strategy"]) == {
        "isolated",
        "from_pretrained_loop",
    }
    assert (applied["verdict"] == "broken").all() and (applied["reason"] == "not applied").all()
    assert not len(table[table["role"] == "base weight"])
    assert (table[table["role"] == "disabled"]["verdict"] == "identical").all()


def test_check_converted_pissa(tmp_path, demo_workspace):
    record, _ = run_check(tmp_path, demo_workspace, None, None, scenario="pissa-converted")
    table = record.metrics()
    conversion = table[table["role"] == "pissa conversion"]
    assert len(conversion) == 1
    row = conversion.iloc[0]
    assert (row["adapter"], row["reference"]) == ("pissa_lora", "pissa (PiSSA)")
    assert row["verdict"] in ("identical", "within tolerance") and row["max_abs"] < 1e-6
    # loaded first in the loop, the converted adapter leaves the LoRA after it exact
    pred = table[table["role"] == "prediction"].set_index("adapter")
    assert pred.loc["lora", "verdict"] == "identical"


def test_check_reports_a_strategy_that_cannot_load(tmp_path, demo_workspace):
    record, _ = run_check(tmp_path, demo_workspace, ["pissa", "lora"], ("load_adapter_low_mem",))
    table = record.metrics()
    pred = table[(table["role"] == "prediction") & (table["strategy"] == "load_adapter_low_mem")]
    assert (pred["verdict"] == "broken").all() and len(pred) == 2
    reasons = dict(zip(pred["adapter"], pred["explanation"], strict=True))
    assert "did not load" in reasons["pissa"] and "pissa failed before it" in reasons["lora"]
