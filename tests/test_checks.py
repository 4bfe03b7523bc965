"""Each check on tiny models (in-process runner), and the row rules on constructed captures."""

import math

import pytest
import torch

from core.capture import BASE, Capture, TensorKey
from core.checks import CHECKS, get_checks
from core.checks.base import Reference
from core.engine import Engine, InProcessRunner
from core.spec import AdapterRef, ModelRef, ProbeSpec, SpecError, Target, ToleranceOverride


def run_in_process(home, base, adapters, targets, checks):
    engine = Engine(home, runner=InProcessRunner())
    spec = ProbeSpec(
        base=ModelRef(base),
        adapters=tuple(adapters),
        targets=tuple(map(Target.parse, targets)),
        checks=tuple(checks),
    )
    job = engine.submit(spec)
    assert job.wait(300)
    assert job.state == "succeeded", job.error
    return engine.store.open(job.run_id)


def test_unknown_check_is_refused():
    with pytest.raises(SpecError, match="unknown check nope; available: weights, deltas, outputs"):
        get_checks(["weights", "nope"])


def test_bert_encoder_all_checks(tmp_path, demo_workspace):
    bert = demo_workspace["models"]["tiny-bert"]
    adapter = AdapterRef(demo_workspace["adapters"]["bert-lora"]["path"], "bert-lora")
    record = run_in_process(tmp_path, bert, [adapter], ["cpu/float32"], ["weights", "deltas", "outputs"])
    table = record.metrics()
    weights = table[table.check == "weights"]
    assert (weights.verdict == "identical").all()
    assert {"base", "lora_A", "lora_B"} <= set(weights.role)
    assert set(weights[weights.role == "lora_A"].module) == {"query", "value"}
    assert weights[weights.role == "lora_A"].layer.notna().all()
    outputs = table[table.check == "outputs"]
    assert set(outputs.module) == {"last_hidden_state"}
    assert (outputs.verdict == "within tolerance").all()
    deltas = table[table.check == "deltas"]
    assert len(deltas) == 4 and (deltas.verdict == "within tolerance").all()
    capture = Capture.load(record.run_dir / "captures" / "cpu_float32")
    env = capture.environment
    for key in (
        "python",
        "torch",
        "transformers",
        "peft",
        "tf32_matmul",
        "deterministic_algorithms",
        "float32_matmul_precision",
        "num_threads",
        "cpu",
        "os",
        "cuda_runtime",
        "gpu_name",
    ):
        assert key in env


@pytest.fixture(scope="module")
def tiny_t5(tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import T5Config, T5ForConditionalGeneration

    folder = tmp_path_factory.mktemp("t5")
    torch.manual_seed(3)
    config = T5Config(
        vocab_size=128,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
    )
    model = T5ForConditionalGeneration(config)
    model.save_pretrained(folder / "base")
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q", "v"], init_lora_weights=False))
    peft_model.save_pretrained(folder / "lora")
    return folder


def test_encoder_decoder_t5(tmp_path, tiny_t5):
    record = run_in_process(
        tmp_path,
        str(tiny_t5 / "base"),
        [AdapterRef(str(tiny_t5 / "lora"), "t5lora")],
        ["cpu/float32"],
        ["deltas", "outputs"],
    )
    table = record.metrics()
    outputs = table[table.check == "outputs"]
    assert set(outputs.module) == {"logits"} and len(outputs) == 2
    assert (outputs.verdict == "within tolerance").all()
    assert (table[table.check == "deltas"].verdict != "broken").all()


def _capture(name, tensor, check="outputs", adapter=BASE, target="cpu/float32"):
    c = Capture(target=target)
    c.add(TensorKey(check, adapter, name), tensor)
    return c


def _spec():
    return ProbeSpec(base=ModelRef("/m"), adapters=(), targets=(Target.parse("cpu/float32"),))


@pytest.mark.parametrize(
    "target, verdict, fragment",
    [
        (lambda r: r.clone(), "identical", "bitwise identical"),
        (lambda r: torch.where(torch.arange(r.numel()).view(r.shape) == 5, torch.nan, r), "broken", "NaN"),
        (lambda r: torch.zeros_like(r), "broken", "all zeros"),
        (lambda r: r[:1, :1, :].expand_as(r).clone(), "broken", "rows are identical"),
        (lambda r: r + 1e-3, "drift", "Mismatched elements"),
    ],
)
def test_outputs_rows_health(target, verdict, fragment):
    torch.manual_seed(0)
    ref = torch.randn(2, 4, 8, dtype=torch.float32)
    check = CHECKS["outputs"]
    capture = _capture("logits", target(ref))
    rows = check.rows(
        _spec(), capture, Reference("cpu/float64", {TensorKey("outputs", BASE, "logits").encode(): ref}, {})
    )
    assert len(rows) == 1
    assert rows[0]["verdict"] == verdict, rows[0]
    assert fragment in rows[0]["explanation"]


def test_weights_row_names_the_changed_element():
    torch.manual_seed(1)
    ref = torch.randn(6, 5)
    tampered = ref.clone()
    tampered[4, 2] += 0.5
    key = TensorKey("weights", BASE, "model.layers.3.self_attn.q_proj.weight")
    row = CHECKS["weights"].rows(
        _spec(),
        _capture(key.name, tampered, check="weights"),
        Reference("checkpoint", {key.encode(): ref}, {}),
    )[0]
    assert row["verdict"] == "drift"
    assert (row["layer"], row["module"], row["role"]) == (3, "q_proj", "base")
    assert row["worst_index"] == "(4, 2)"
    assert row["n_mismatch"] == 1
    assert math.isclose(row["max_abs"], 0.5, rel_tol=1e-6)


def test_missing_reference_is_broken_key_mismatch():
    key = TensorKey("weights", "lora", "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight")
    row = CHECKS["weights"].rows(
        _spec(),
        _capture(key.name, torch.ones(3, 2), check="weights", adapter="lora"),
        Reference("checkpoint", {}, {}),
    )[0]
    assert row["verdict"] == "broken" and "key mismatch" in row["explanation"]
    assert (row["role"], row["module"], row["layer"], row["adapter"]) == ("lora_B", "up_proj", 0, "lora")


def test_tolerance_override_applies_to_rows():
    ref = torch.ones(4)
    key = TensorKey("outputs", BASE, "logits")
    spec = ProbeSpec(
        base=ModelRef("/m"),
        adapters=(),
        targets=(Target.parse("cpu/float32"),),
        tolerances={"*": ToleranceOverride(atol=1e-2)},
    )
    row = CHECKS["outputs"].rows(
        spec, _capture("logits", ref + 5e-3), Reference("cpu/float64", {key.encode(): ref.double()}, {})
    )[0]
    assert row["verdict"] == "within tolerance"
    assert row["atol"] == 1e-2 and row["rtol"] == 1.3e-6


def test_checkpoint_tensor_not_loaded_is_broken():
    ref = {
        TensorKey("weights", BASE, "a.weight").encode(): torch.ones(2),
        TensorKey("weights", BASE, "model.layers.1.mlp.extra.weight").encode(): torch.ones(3),
    }
    rows = CHECKS["weights"].rows(
        _spec(), _capture("a.weight", torch.ones(2), check="weights"), Reference("checkpoint", ref, {})
    )
    assert [r["verdict"] for r in rows] == ["identical", "broken"]
    assert rows[1]["tensor"] == "model.layers.1.mlp.extra.weight"
    assert "not loaded" in rows[1]["explanation"] and rows[1]["layer"] == 1


def test_method_without_a_delta_formula_is_noted_not_fatal(tmp_path, demo_workspace):
    from peft import LoHaConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = demo_workspace["models"]["tiny-llama"]
    torch.manual_seed(5)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoHaConfig(r=4, target_modules=["q_proj"], init_weights=False),
    )
    model.save_pretrained(tmp_path / "loha")
    record = run_in_process(
        tmp_path / "home",
        base,
        [AdapterRef(str(tmp_path / "loha"), "loha")],
        ["cpu/float32"],
        ["weights", "deltas", "outputs"],
    )
    table = record.metrics()
    assert "loha" not in set(table[table.check == "deltas"].adapter.dropna())
    loha = table[(table.check == "weights") & (table.adapter == "loha")]
    assert (loha.verdict == "identical").all()
    assert {"hada_w1_a", "hada_w1_b"} <= set(loha.role) and set(loha.module) == {"q_proj"}
    assert any("loha adapter; its ΔW is not covered" in n for n in record.notes())
    assert (table[(table.check == "outputs") & (table.adapter == "loha")].verdict == "within tolerance").all()
