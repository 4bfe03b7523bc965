"""Checkpoint keys matched to loaded tensors through transformers' own conversion on load.

Tiny random models built from configs and saved by transformers (which writes the checkpoint's old
names: it reverts its conversion on save), then run through the CLI in this process.
"""

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from tiny_models import ARCHITECTURES

from core import cli
from core.capture import BASE, Capture, TensorKey
from core.checks import CHECKS
from core.models import conversion
from core.models.checkpoint import Checkpoint
from core.models.validate import validate_adapter, validate_model
from core.spec import AdapterRef, ModelRef, ProbeSpec, Target


def run_weights(capsys, home: Path, base: Path) -> tuple[int, dict, pd.DataFrame]:
    code = cli.main(
        ["run", "--base", str(base), "--check", "weights", "--target", "cpu/float32"]
        + ["--in-process", "--json", "--home", str(home)]
    )
    out = json.loads(capsys.readouterr().out)
    return code, out, pd.read_parquet(Path(out["run_dir"]) / "metrics.parquet").set_index("tensor")


def all_identical(out: dict, n: int) -> bool:
    return out["exit_code"] == 0 and out["verdicts"] == {
        "identical": n,
        "within tolerance": 0,
        "drift": 0,
        "broken": 0,
    }


@pytest.mark.parametrize("tied", [False, True])
def test_gpt_neox_embed_out_is_compared_as_the_loaded_lm_head(capsys, tmp_path, tied):
    torch.manual_seed(0)
    folder = tmp_path / "neox"
    ARCHITECTURES["gpt_neox"].build(num_hidden_layers=2, tie_word_embeddings=tied).save_pretrained(folder)
    in_file = Checkpoint.open(folder).names()
    assert ("embed_out.weight" in in_file) is not tied  # tied: stored once, as embed_in

    code, out, table = run_weights(capsys, tmp_path / "home", folder)
    assert code == 0 and all_identical(out, len(in_file))
    assert "embed_out.weight" not in table.index
    if tied:
        assert "lm_head.weight" not in table.index
        assert (
            table.loc["gpt_neox.embed_in.weight"].note == "shares storage with lm_head.weight (tied weights)"
        )
    else:
        head = table.loc["lm_head.weight"]
        assert (head.verdict, head["shape"], head.bitwise_equal) == ("identical", "64x16", True)
        assert head.note == "renamed on load from the checkpoint's embed_out.weight"
        assert table.drop("lm_head.weight").note.eq("").all()


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    torch.manual_seed(1)
    folder = tmp_path_factory.mktemp("mixtral")
    model = ARCHITECTURES["mixtral"].build(
        hidden_size=16,
        intermediate_size=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=3,
        max_position_embeddings=32,
    )
    model.save_pretrained(folder)
    return folder, {n: t.detach().clone() for n, t in model.state_dict().items()}


def test_mixtral_fused_experts_are_compared_against_the_per_expert_file_tensors(
    capsys, tmp_path, tiny_mixtral
):
    folder, state = tiny_mixtral
    in_file = Checkpoint.open(folder).names()
    # embeddings, final norm, head; per layer 4 attention, 2 norms, the router and 3 experts × w1/w2/w3
    # in the file, one gate_up_proj and one down_proj loaded
    assert len(in_file) == 3 + 2 * (4 + 2 + 1 + 9) and len(state) == 3 + 2 * (4 + 2 + 1 + 2)

    code, out, table = run_weights(capsys, tmp_path / "home", folder)
    assert code == 0 and all_identical(out, len(state))
    assert sorted(table.index) == sorted(state)  # no per-expert file key left as "not loaded"
    fused = table.loc["model.layers.1.mlp.experts.gate_up_proj"]
    assert (fused.verdict, fused["shape"], fused.numel, fused.bitwise_equal) == (
        "identical",
        "3x16x16",
        768,
        True,
    )
    expert = "model.layers.1.block_sparse_moe.experts"
    assert fused.note == (
        f"built on load from the checkpoint's 6 tensors {expert}.0.w1.weight, {expert}.1.w1.weight, "
        f"{expert}.2.w1.weight, … {expert}.2.w3.weight "
        "(transformers: MergeModulelist(dim=0), Concatenate(dim=1))"
    )
    down = table.loc["model.layers.0.mlp.experts.down_proj"]
    assert (down.verdict, down["shape"]) == ("identical", "3x16x8")
    assert down.note == (
        "built on load from the checkpoint's 3 tensors model.layers.0.block_sparse_moe.experts.0.w2.weight, "
        "model.layers.0.block_sparse_moe.experts.1.w2.weight, model.layers.0.block_sparse_moe.experts.2.w2.weight "
        "(transformers: MergeModulelist(dim=0))"
    )
    assert table.loc["model.layers.0.mlp.gate.weight"].note == (
        "renamed on load from the checkpoint's model.layers.0.block_sparse_moe.gate.weight"
    )


def test_mixtral_reference_rebuilt_without_a_loaded_model(tiny_mixtral):
    """The drill-down's path (the dashboard's process loaded no model): the conversion comes from a model
    built on the meta device from the config, and the fused tensor from the file's expert tensors."""
    folder, state = tiny_mixtral
    conversion._known.clear()  # what a fresh process holds
    spec = ProbeSpec(base=ModelRef(str(folder)), adapters=(), targets=(Target.parse("cpu/float32"),))
    name = "model.layers.0.mlp.experts.gate_up_proj"
    key = TensorKey("weights", BASE, name)
    reference = CHECKS["weights"].reference_for(spec, key, None)
    expected = state[name]
    assert torch.equal(reference.tensors[key.encode()], expected)
    # gate (w1) then up (w3) along dim 1, each stacked over the experts
    file = Checkpoint.open(folder)
    w1 = file.read("model.layers.0.block_sparse_moe.experts.2.w1.weight")
    assert torch.equal(expected[2, :8], w1)
    assert reference.notes[key.encode()].startswith("built on load from the checkpoint's 6 tensors")


def test_bert_legacy_layernorm_gamma_beta_are_identical(capsys, tmp_path):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(2)
    folder = tmp_path / "old-bert"
    ARCHITECTURES["bert"].build(num_hidden_layers=2).save_pretrained(folder)
    weights = folder / "model.safetensors"
    tensors = load_file(str(weights))
    # the names TensorFlow-era BERT checkpoints carry
    legacy = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
        for k, v in tensors.items()
    }
    assert sum(".gamma" in k or ".beta" in k for k in legacy) == 10
    save_file(legacy, str(weights), metadata={"format": "pt"})

    code, out, table = run_weights(capsys, tmp_path / "home", folder)
    assert code == 0 and all_identical(out, len(tensors))
    assert sorted(table.index) == sorted(tensors)
    row = table.loc["encoder.layer.1.output.LayerNorm.bias"]
    assert (row.verdict, row.note) == (
        "identical",
        "renamed on load from the checkpoint's encoder.layer.1.output.LayerNorm.beta",
    )
    assert (table.note != "").sum() == 10


@pytest.fixture(scope="module")
def tiny_vit(tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import ViTForImageClassification

    torch.manual_seed(3)
    root = tmp_path_factory.mktemp("vit")
    ARCHITECTURES["vit"].build(
        image_size=8, hidden_size=16, num_attention_heads=2, intermediate_size=32, num_labels=3
    ).save_pretrained(root / "base")
    model = ViTForImageClassification.from_pretrained(root / "base")
    lora = get_peft_model(
        model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    lora.save_pretrained(root / "lora")
    return root


def test_vit_adapter_is_matched_to_the_loaded_module_names(tiny_vit):
    in_file = Checkpoint.open(tiny_vit / "base").names()
    assert "vit.encoder.layer.0.attention.attention.query.weight" in in_file  # the file's old names
    adapter = Checkpoint.open(tiny_vit / "lora", prefix="adapter_model").names()
    assert "base_model.model.vit.layers.0.attention.q_proj.lora_A.weight" in adapter  # the loaded model's

    shapes = validate_model(ModelRef(str(tiny_vit / "base")))
    assert shapes["vit.layers.0.attention.q_proj.weight"] == (16, 16)
    assert "vit.encoder.layer.0.attention.attention.query.weight" not in shapes
    validate_adapter(AdapterRef(str(tiny_vit / "lora"), "lora"), shapes, str(tiny_vit / "base"))


def test_vit_base_weights_are_identical(tiny_vit):
    """The weights check on the loaded ViT classifier (the run itself needs image inputs, made elsewhere)."""
    from core.checks.base import CaptureContext
    from core.models.loading import Loaded, load_base

    base = str(tiny_vit / "base")
    spec = ProbeSpec(base=ModelRef(base), adapters=(), targets=(Target.parse("cpu/float32"),))
    check = CHECKS["weights"]
    capture = Capture(target="cpu/float32")
    ctx = CaptureContext(spec=spec, target=spec.targets[0], probe={})
    check.capture(ctx, Loaded(adapter=None, model=load_base(spec.base, spec.targets[0]), notes=[]), capture)
    reference = check.reference(spec, capture.keys("weights"), None)
    rows = {r["tensor"]: r for r in check.rows(spec, capture, reference)}
    assert len(rows) == len(Checkpoint.open(base).names())
    assert {r["verdict"] for r in rows.values()} == {"identical"}
    assert rows["vit.layers.1.attention.q_proj.weight"]["note"] == (
        "renamed on load from the checkpoint's vit.encoder.layer.1.attention.attention.query.weight"
    )


def test_adapters_check_reads_base_weights_under_their_loaded_names(tmp_path):
    """The adapters check compares base weights after loading adapters with the file, by loaded name."""
    from core.checks.adapters import BASE_WEIGHT

    torch.manual_seed(5)
    ARCHITECTURES["gpt_neox"].build().save_pretrained(tmp_path)
    spec = ProbeSpec(base=ModelRef(str(tmp_path)), adapters=(), targets=(Target.parse("cpu/float32"),))
    key = TensorKey("adapters", "lora", BASE_WEIGHT + "lm_head.weight")
    reference = CHECKS["adapters"].reference(spec, [key], None)
    assert torch.equal(reference.tensors[key.encode()], Checkpoint.open(tmp_path).read("embed_out.weight"))


def test_a_model_transformers_cannot_build_keeps_the_file_names(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    save_file({"encoder.LayerNorm.gamma": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    assert validate_model(ModelRef(str(tmp_path))) == {"encoder.LayerNorm.gamma": (2,)}
    found = conversion.for_folder(tmp_path, Checkpoint.open(tmp_path))
    assert found.sources("encoder.LayerNorm.gamma") == ("encoder.LayerNorm.gamma",)
    assert found.converted() == {}
