"""Each check on tiny models (in-process runner), and the row rules on constructed captures."""

import math

import pytest
import torch
from tiny_models import ARCHITECTURES

from core.capture import BASE, Capture, TensorKey
from core.checks import CHECKS, get_checks
from core.checks.base import Reference
from core.engine.jobs import Engine
from core.engine.runners import InProcessRunner
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


def test_the_check_names_the_cli_reads_before_importing_the_checks_are_the_registrys():
    from core.spec import CHECK_NAMES

    assert tuple(CHECKS) == CHECK_NAMES


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
    # a bare encoder: its last hidden state and its pooled output, per model
    assert sorted(outputs.module) == [
        "last_hidden_state",
        "last_hidden_state",
        "pooler_output",
        "pooler_output",
    ]
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

    folder = tmp_path_factory.mktemp("t5")
    torch.manual_seed(3)
    model = ARCHITECTURES["t5"].build(
        vocab_size=128, d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4
    )
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


def test_identical_rows_within_tolerance_are_not_broken():
    """A bfloat16 classifier whose logits rows the reference tells apart by 1e-8 only: its rows round to
    the same values, within tolerance, and a collapse is not claimed."""
    ref = torch.tensor([[0.0723, 0.0503, 0.0537]], dtype=torch.float64).repeat(2, 1)
    ref[1] += 1e-8
    capture = _capture("logits", ref.to(torch.bfloat16), target="cpu/bfloat16")
    spec = ProbeSpec(base=ModelRef("/m"), adapters=(), targets=(Target.parse("cpu/bfloat16"),))
    rows = CHECKS["outputs"].rows(
        spec, capture, Reference("cpu/float64", {TensorKey("outputs", BASE, "logits").encode(): ref}, {})
    )
    assert [(r["verdict"], r["health_identical_rows"]) for r in rows] == [("within tolerance", True)]
    assert "_rows_collapsed" not in rows[0]


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
    from peft import LNTuningConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = demo_workspace["models"]["tiny-llama"]
    torch.manual_seed(5)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base), LNTuningConfig(target_modules=["input_layernorm"])
    )
    with torch.no_grad():  # trained: not the base's norm
        for name, p in model.named_parameters():
            if "ln_tuning_layers" in name:
                p.add_(0.01 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "ln")
    record = run_in_process(
        tmp_path / "home",
        base,
        [AdapterRef(str(tmp_path / "ln"), "ln")],
        ["cpu/float32"],
        ["weights", "deltas", "outputs"],
    )
    table = record.metrics()
    assert "ln" not in set(table[table.check == "deltas"].adapter.dropna())
    ln = table[(table.check == "weights") & (table.adapter == "ln")]
    assert len(ln) and (ln.verdict == "identical").all()
    assert set(ln.module) == {"input_layernorm"}
    assert any("ln_tuning adapter; its ΔW is not covered" in n for n in record.notes()), record.notes()
    assert (table[(table.check == "outputs") & (table.adapter == "ln")].verdict == "within tolerance").all()


class _Buffers(torch.nn.Module):
    """A tiny model with every kind of tensor a checkpoint key can meet."""

    _keys_to_ignore_on_load_unexpected = [r"^old\."]

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(4, 3)
        self.head = torch.nn.Linear(3, 4, bias=False)
        self.head.weight = self.embed.weight  # tied: one storage, stored once
        self.register_buffer("mask", torch.tensor([True, False, True]))  # persistent, bool
        self.register_buffer("ids", torch.arange(6).view(1, 6), persistent=False)
        self.register_buffer("scratch", torch.zeros(2), persistent=False)  # not in the file


def _weights_rows(tmp_path, model, file):
    from safetensors.torch import save_file

    from core.checks.base import CaptureContext
    from core.models.loading import Loaded

    save_file(file, str(tmp_path / "model.safetensors"))
    spec = ProbeSpec(base=ModelRef(str(tmp_path)), adapters=(), targets=(Target.parse("cpu/float32"),))
    check = CHECKS["weights"]
    capture = Capture(target="cpu/float32")
    ctx = CaptureContext(
        spec=spec, target=spec.targets[0], probe={"input_ids": torch.zeros(1, 1, dtype=torch.long)}
    )
    check.capture(ctx, Loaded(adapter=None, model=model, notes=[]), capture)
    reference = check.reference(spec, capture.keys("weights"), None)
    return {r["tensor"]: r for r in check.rows(spec, capture, reference)}


def test_weights_buffers_unused_keys_and_integer_tensors(tmp_path):
    torch.manual_seed(2)
    model = _Buffers()
    ids = torch.arange(6).view(1, 6)
    ids[0, 4] = 9  # the file's value; the model's buffer holds 4
    mask = torch.tensor([True, True, True])  # element 1 differs from the model's False
    file = {
        "embed.weight": model.embed.weight.detach().clone(),
        "mask": mask,
        "ids": ids,
        "old.rotary.inv_freq": torch.ones(2),
        "cls.bias": torch.zeros(5),
    }
    rows = _weights_rows(tmp_path, model, file)
    assert sorted(rows) == ["cls.bias", "embed.weight", "ids", "mask", "old.rotary.inv_freq"]
    assert rows["embed.weight"]["verdict"] == "identical"
    assert rows["embed.weight"]["note"] == "shares storage with head.weight (tied weights)"

    # the non-persistent buffer is compared with the model's own values, exactly
    buf = rows["ids"]
    assert (buf["dtype"], buf["verdict"], buf["n_mismatch"], buf["numel"]) == ("int64", "drift", 1, 6)
    assert (buf["max_abs"], buf["worst_index"], buf["worst_target"], buf["worst_reference"]) == (
        5.0,
        "(0, 4)",
        4.0,
        9.0,
    )
    assert (buf["rtol"], buf["atol"]) == (0.0, 0.0)
    assert buf["note"] == "non-persistent buffer (not in the state dict): the model's own values"
    assert "Mismatched elements: 1 / 6" in buf["explanation"]

    # a bool tensor: equal or not, element by element
    m = rows["mask"]
    assert (m["dtype"], m["verdict"], m["n_mismatch"], m["worst_index"], m["max_abs"]) == (
        "bool",
        "drift",
        1,
        "(1)",
        1.0,
    )

    # keys the model has no parameter or buffer for: noted, passing, not compared
    for name, listed in (("cls.bias", False), ("old.rotary.inv_freq", True)):
        row = rows[name]
        assert (row["verdict"], row["bitwise_equal"], row["dtype"]) == ("within tolerance", False, None)
        assert row["explanation"] == "not compared: the model does not use this checkpoint tensor"
        note = "not used by _Buffers: it has no parameter or buffer of this name"
        assert row["note"] == note + (" (its _keys_to_ignore_on_load_unexpected lists it)" if listed else "")
    assert (rows["cls.bias"]["shape"], rows["cls.bias"]["numel"]) == ("5", 5)

    # the same model against a file holding the model's own values: all identical
    file.update(ids=torch.arange(6).view(1, 6), mask=model.mask.clone())
    rows = _weights_rows(tmp_path, model, file)
    assert [rows[n]["verdict"] for n in ("embed.weight", "ids", "mask")] == ["identical"] * 3
    assert rows["mask"]["bitwise_equal"] and rows["ids"]["bitwise_equal"]


def test_old_bert_checkpoint_with_position_ids_and_an_unused_head(tmp_path):
    from safetensors.torch import load_file, save_file

    from core import report

    torch.manual_seed(4)
    folder = tmp_path / "old-bert"
    ARCHITECTURES["bert"].build().save_pretrained(folder)
    weights = folder / "model.safetensors"
    tensors = load_file(str(weights))
    assert "embeddings.position_ids" not in tensors  # transformers no longer saves it
    position_ids = torch.arange(16).view(1, 16)
    position_ids[0, 3] = 7  # a file value the model does not take: its buffer keeps 3
    tensors["embeddings.position_ids"] = position_ids
    tensors["cls.predictions.bias"] = torch.zeros(64)  # a pretraining head BertModel leaves out
    save_file(tensors, str(weights), metadata={"format": "pt"})

    record = run_in_process(tmp_path / "home", str(folder), [], ["cpu/float32"], ["weights"])
    table = record.metrics().set_index("tensor")
    assert len(table) == len(tensors) == 25
    pos = table.loc["embeddings.position_ids"]
    assert tuple(pos[["verdict", "dtype", "n_mismatch", "max_abs", "worst_index"]]) == (
        "drift",
        "int64",
        1,
        4.0,
        "(0, 3)",
    )
    head = table.loc["cls.predictions.bias"]
    assert head.verdict == "within tolerance"
    assert head.note == "not used by BertModel: it has no parameter or buffer of this name"
    rest = table.drop(["embeddings.position_ids", "cls.predictions.bias"])
    assert len(rest) == 23 and (rest.verdict == "identical").all()
    assert report.exit_code(table.reset_index()) == 1  # the position ids differ; nothing is broken
    assert report.exit_code(table.drop("embeddings.position_ids").reset_index()) == 0


def test_the_runners_fresh_interpreter_checks_are_the_classes():
    """The CLI and the API warm fresh interpreters by check name before they import the checks: the names
    are the checks whose class says so, and only a run of one of them gets spares."""
    from core.engine.runners import FRESH_INTERPRETER_CHECKS, FRESH_SPARES, fresh_spares

    assert set(FRESH_INTERPRETER_CHECKS) == {name for name, c in CHECKS.items() if c.fresh_interpreter}
    assert fresh_spares(["weights", "memory"]) == FRESH_SPARES
    assert fresh_spares(["weights", "deltas"]) == fresh_spares(None) == 0
