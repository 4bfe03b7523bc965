"""PEFT options and model kinds beyond the families × methods table (tests/test_families.py): adapters that
train biases, LoRA on parameters (`target_parameters`), layers replicated before loading (`layer_replication`),
LoRA on `nn.MultiheadAttention`, methods merged by PEFT's own ΔW, checkpoints whose class the task's Auto
mapping lacks. Each kind is built here on tiny models of families and sizes of its own, run through the
engine (in process) with every check on `cpu/float32 cpu/bfloat16`, and its float64 ΔW checked against
PEFT's own merge in float64.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import ARCHITECTURES, quiet

from core.checks import CHECKS
from core.engine.jobs import Engine
from core.engine.runners import InProcessRunner
from core.engine.store import RunRecord
from core.methods import formulas
from core.spec import AdapterRef, ModelRef, ProbeInputs, ProbeSpec, Target

TARGETS = ("cpu/float32", "cpu/bfloat16")


def save_adapter(model: torch.nn.Module, config, folder: Path, seed: int) -> Path:
    """PEFT's adapter of `config` on `model` (a copy is not made: PEFT injects into it), every trained
    tensor random (seeded, small, as a trained adapter's), saved to `folder`."""
    from peft import get_peft_model

    quiet()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in peft_model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
    peft_model.save_pretrained(folder)
    return folder


def build(name: str, folder: Path, seed: int, **sizes) -> Path:
    """Architecture `name` with `sizes` over its row's, seeded, saved to `folder`."""
    quiet()
    torch.manual_seed(seed)
    ARCHITECTURES[name].build(**sizes).save_pretrained(folder)
    return folder


def run_all_checks(home: Path, model: Path, adapters: dict[str, Path]) -> RunRecord:
    """Every check on both targets, each adapter loaded alone on a fresh base (the default)."""
    engine = Engine(home, runner=InProcessRunner())
    spec = ProbeSpec(
        base=ModelRef(path=str(model)),
        adapters=tuple(AdapterRef(path=str(f), name=n) for n, f in adapters.items()),
        targets=tuple(Target.parse(t) for t in TARGETS),
        checks=tuple(CHECKS),
        probe=ProbeInputs(batch=2, seq_len=5),
    )
    job = engine.submit(spec)
    assert job.wait(300) and job.state == "succeeded", job.error
    return engine.store.open(job.run_id)


def nothing_broken(table) -> None:
    """No row broken; on cpu/float32 every row identical or within tolerance but the adapters check's
    `base mutated` rows, which say what the adapter changes in the base by design."""
    assert "broken" not in set(table.verdict), table[table.verdict == "broken"][["check", "tensor"]].values
    float32 = table[(table.target == "cpu/float32") & (table.reason.fillna("") != "base mutated")]
    bad = float32[~float32.verdict.isin(["identical", "within tolerance"])]
    assert bad.empty, bad[["check", "tensor", "verdict"]].values


def peft_merged_float64(model_folder: Path, model_class: str, adapter: Path) -> dict[str, torch.Tensor]:
    """PEFT's own merge_and_unload in float64: the merged model's state dict."""
    import transformers
    from peft import PeftModel

    quiet()
    base = getattr(transformers, model_class).from_pretrained(model_folder, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    return merged.state_dict()


def base_state(model_folder: Path) -> dict[str, torch.Tensor]:
    return load_file(model_folder / "model.safetensors")


# ----------------------------------------------------------------------------------------------------------
# 1. Adapters that train biases
# ----------------------------------------------------------------------------------------------------------

# Qwen2 (biases on q, k and v) at hidden 24, two layers: LoRA on q and v, biases trained everywhere or only
# on the LoRA modules.
BIAS_SIZES = {"hidden_size": 24, "num_hidden_layers": 2, "num_attention_heads": 3}


@pytest.fixture(scope="module")
def bias_case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:

    root = tmp_path_factory.mktemp("bias")
    model = build("qwen2", root / "qwen2", 11, **BIAS_SIZES)
    arch = ARCHITECTURES["qwen2"]
    adapters = {}
    for seed, bias in enumerate(("all", "lora_only")):
        base = arch.build(**BIAS_SIZES).__class__.from_pretrained(model)
        config = arch.lora(target_modules=["q_proj", "v_proj"], bias=bias)
        adapters[bias] = save_adapter(base, config, root / f"lora-{bias}", seed)
    return model, adapters


def test_trained_biases_float64_equal_peft_merge(bias_case) -> None:
    """ΔW and Δb of both bias options against PEFT's merge_and_unload in float64: the biases bit for bit
    (the merged bias is the trained one), ΔW within 4 ulp of float64 at W's scale (PEFT adds s·B@A with its
    own association)."""
    model, adapters = bias_case
    base = base_state(model)
    with_bias = {"all": 6, "lora_only": 4}  # k too with "all"; q and v in both layers
    for bias, folder in adapters.items():
        import json

        config = json.loads((folder / "adapter_config.json").read_text())
        tensors = load_file(folder / "adapter_model.safetensors")
        merged = formulas.merged_weights(config, tensors, base)
        peft = peft_merged_float64(model, "Qwen2ForCausalLM", folder)
        biases = [n for n in merged if n.endswith(".bias")]
        assert len(biases) == with_bias[bias]
        for name, tensor in merged.items():
            want = peft[name if name.endswith(".bias") else name + ".weight"]
            if name.endswith(".bias"):
                assert torch.equal(tensor, want), name
                assert not torch.equal(want, base[name].double())  # trained: it differs from the base's
            else:
                bound = 4 * torch.finfo(torch.float64).eps * want.abs().max()
                assert (tensor - want).abs().max() <= bound, name


def test_trained_biases_run_every_check(bias_case, tmp_path: Path) -> None:
    """Both bias options: the biases are compared with the file (weights), a Δb row per trained bias beside
    ΔW (deltas), the merged biases against the trained ones (merge), and the adapters check names the base
    mutation the bias load is. Two such adapters in one run are refused: PEFT holds one on a model."""
    model, adapters = bias_case
    for bias, count in (("all", 6), ("lora_only", 4)):  # PEFT holds one adapter with bias on a model
        table = run_all_checks(tmp_path / bias, model, {bias: adapters[bias]}).metrics()
        nothing_broken(table)
        rows = table[table.adapter == bias]
        for target in TARGETS:
            at = rows[rows.target == target]
            weights = at[(at.check == "weights") & at.tensor.str.endswith(".bias")]
            assert len(weights) == count
            db = at[(at.check == "deltas") & (at.role == "bias delta")]
            assert len(db) == count and set(db.tensor) == {
                t.removeprefix("base_model.model.").replace(".base_layer.", ".") for t in weights.tensor
            }
            merged = at[(at.check == "merge") & (at.role == "merged") & at.tensor.str.endswith(".bias")]
            assert len(merged) == 2 * count  # merge_adapter and safe_merge
            mutated = at[
                (at.check == "adapters") & (at.reason == "base mutated") & (at.role == "base weight")
            ]
            assert len(mutated) == count and all("it trained biases" in n for n in mutated.note)
        float32 = rows[rows.target == "cpu/float32"]
        assert set(float32[float32.role == "bias delta"].verdict) == {"identical"}


def test_two_adapters_that_train_biases_are_refused_before_loading(bias_case, tmp_path: Path) -> None:
    from core.models.validate import InputError

    model, adapters = bias_case
    engine = Engine(tmp_path / "home", runner=InProcessRunner())
    spec = ProbeSpec(
        base=ModelRef(path=str(model)),
        adapters=tuple(AdapterRef(path=str(f), name=n) for n, f in adapters.items()),
        targets=(Target.parse("cpu/float32"),),
    )
    with pytest.raises(InputError) as e:
        engine.submit(spec)
    assert str(e.value) == (
        "adapters all (bias='all'), lora_only (bias='lora_only') each train biases, and PEFT holds only one "
        "adapter with bias on a model (the run loads its adapters together): run them in separate runs"
    )


# ----------------------------------------------------------------------------------------------------------
# 2. LoRA on parameters (target_parameters): a stack of experts, and a plain 2-d weight
# ----------------------------------------------------------------------------------------------------------

# Qwen3-MoE at hidden 24 with 3 experts: LoRA on both expert stacks (two parameters of one module: PEFT nests
# their wrappers) and on q_proj as a module; Mixtral at hidden 20: its experts' down projection and o_proj's
# weight named as a parameter.
PARAMETER_CASES = {
    "qwen3_moe": (
        {"hidden_size": 24, "num_attention_heads": 3, "num_experts": 3, "moe_intermediate_size": 8},
        {
            "target_modules": ["q_proj"],
            "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        },
        "Qwen3MoeForCausalLM",
    ),
    "mixtral": (
        {"hidden_size": 20, "intermediate_size": 28, "num_hidden_layers": 1, "num_local_experts": 3},
        {"target_modules": [], "target_parameters": ["experts.down_proj", "self_attn.o_proj.weight"]},
        "MixtralForCausalLM",
    ),
}


@pytest.fixture(scope="module")
def parameter_cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    import transformers

    root = tmp_path_factory.mktemp("parameters")
    out = {}
    for seed, (name, (sizes, targets, cls)) in enumerate(PARAMETER_CASES.items()):
        model = build(name, root / name, 20 + seed, **sizes)
        base = getattr(transformers, cls).from_pretrained(model)
        config = ARCHITECTURES[name].lora(r=2, lora_alpha=6, **targets)
        out[name] = (model, save_adapter(base, config, root / f"{name}-lora", seed))
    return out


def test_targeted_parameters_float64_equal_peft_merge(parameter_cases) -> None:
    """Each targeted parameter's W + ΔW (float64, from the files, PEFT's nesting of wrappers worked out on a
    meta-device model) against PEFT's merge_and_unload in float64: within 4 ulp of float64 at the weight's
    scale (the per-expert sums are PEFT's einsum's, perhaps in another order)."""
    import transformers

    from core.models import merging

    for name, (model, adapter) in parameter_cases.items():
        config, tensors = merging.adapter_files(AdapterRef(path=str(adapter), name="p"), str(model))
        # the base as transformers loads it (its experts stacked as the file has them, or as it stacks them)
        base = getattr(transformers, PARAMETER_CASES[name][2]).from_pretrained(model).state_dict()
        merged = formulas.merged_weights(config, tensors, base)
        peft = peft_merged_float64(model, PARAMETER_CASES[name][2], adapter)
        targeted = PARAMETER_CASES[name][1]["target_parameters"]
        assert {n for n in merged if n.endswith(tuple(t.removesuffix(".weight") for t in targeted))}, name
        for module, tensor in merged.items():
            want = peft[module if module in peft else module + ".weight"]
            bound = 4 * torch.finfo(torch.float64).eps * want.abs().max()
            assert tensor.shape == want.shape and (tensor - want).abs().max() <= bound, (name, module)


def test_targeted_parameters_run_every_check(parameter_cases, tmp_path: Path) -> None:
    """Qwen3-MoE's expert stacks: a ΔW row and merged rows per targeted parameter (named by its path) beside
    q_proj's, and the adapter's tensors compared with the file."""
    model, adapter = parameter_cases["qwen3_moe"]
    table = run_all_checks(tmp_path / "home", model, {"experts": adapter}).metrics()
    nothing_broken(table)
    expected = {"model.layers.0.self_attn.q_proj"} | {
        f"model.layers.0.mlp.experts.{p}" for p in ("gate_up_proj", "down_proj")
    }
    for target in TARGETS:
        at = table[(table.adapter == "experts") & (table.target == target)]
        deltas = at[(at.check == "deltas") & (at.role == "delta")]
        assert set(deltas.tensor) == expected and len(deltas) == 3
        merged = at[(at.check == "merge") & (at.role == "merged")]
        assert set(merged.tensor) == {
            f"merged:{s}:{m}" for m in expected for s in ("merge_adapter", "safe_merge")
        }
        assert len(at[(at.check == "weights") & at.role.isin(["lora_A", "lora_B"])]) == 6


# ----------------------------------------------------------------------------------------------------------
# 3. layer_replication: PEFT expands the base's layers before it loads the adapter
# ----------------------------------------------------------------------------------------------------------

# Gemma at hidden 24 with 2 layers, expanded to 0, 1, 1, 0 (four layers): LoRA on every copy's q and o.
REPLICATION = [[0, 2], [1, 2], [0, 1]]


@pytest.fixture(scope="module")
def replication_case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    import transformers

    root = tmp_path_factory.mktemp("replication")
    model = build("gemma", root / "gemma", 31, hidden_size=24, num_hidden_layers=2, num_attention_heads=3)
    base = transformers.GemmaForCausalLM.from_pretrained(model)
    config = ARCHITECTURES["gemma"].lora(target_modules=["q_proj", "o_proj"], layer_replication=REPLICATION)
    return model, save_adapter(base, config, root / "gemma-lora", 3)


def test_replicated_layers_float64_equal_peft_delta(replication_case) -> None:
    """Each copy's ΔW (float64, from the files) against PEFT's get_delta_weight on the model PEFT expanded in
    float64: bit for bit (both s·B@A in float64); the copies' base weights are the layers they copy."""
    import json

    import transformers
    from peft import PeftModel

    from core.methods.adapter_keys import adapted_modules

    model, adapter = replication_case
    config = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(adapter / "adapter_model.safetensors")
    deltas = formulas.reference_deltas(config, tensors, base_state(model))
    assert len(deltas) == 2 * 4  # q and o of four layers
    base = transformers.GemmaForCausalLM.from_pretrained(model, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft = PeftModel.from_pretrained(base, adapter)
    layers = adapted_modules(peft)
    assert set(layers) == set(deltas)
    for name, (layer, _) in layers.items():
        assert torch.equal(deltas[name], layer.get_delta_weight("default")), name
    merged = formulas.merged_weights(config, tensors, base_state(model), deltas=deltas)
    original = base_state(model)["model.layers.0.self_attn.q_proj.weight"].double()
    copy = "model.layers.3.self_attn.q_proj"  # the fourth layer copies the first
    assert torch.equal(merged[copy], original + deltas[copy])


def test_replicated_layers_run_every_check(replication_case, tmp_path: Path) -> None:
    """The run says the base was expanded; every copy has its ΔW row; merging is PEFT's refusal, said in one
    finding; the adapters check names the expansion as what disabling the adapter does not undo."""
    model, adapter = replication_case
    run = run_all_checks(tmp_path / "home", model, {"rep": adapter})
    table = run.metrics()
    nothing_broken(table)
    note = (
        "rep: PEFT expanded the base's layers to 4 before loading the adapter (layer_replication "
        "[[0, 2], [1, 2], [0, 1]]: layers 0, 1, 1, 0; each copy shares the weights of the layer it copies)"
    )
    assert note in run.notes()
    findings = run.table("merge_findings")
    for target in TARGETS:
        at = table[(table.adapter == "rep") & (table.target == target)]
        deltas = at[(at.check == "deltas") & (at.role == "delta")]
        assert set(deltas.tensor) == {
            f"model.layers.{i}.self_attn.{m}" for i in range(4) for m in ("q_proj", "o_proj")
        }
        assert at[at.check == "merge"].empty
        found = findings[(findings.adapter == "rep") & (findings.target == target)]
        assert (
            list(found.finding) == ["does not apply"] and "PEFT refuses to merge it" in found.detail.iloc[0]
        )
        disabled = at[(at.check == "adapters") & (at.role == "disabled")]
        assert set(disabled.reason) == {"base mutated"} and all(
            "layer_replication" in n for n in disabled.note
        )


# ----------------------------------------------------------------------------------------------------------
# 4. Methods PEFT merges with no float64 formula here: PEFT's own get_delta_weight in float64
# ----------------------------------------------------------------------------------------------------------


def _own_configs():
    """VBLoRA, C3A, GraLoRA and WaveFT on Qwen3's q_proj and v_proj (in 16; out 16 and 8)."""
    import peft

    common = {"target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM"}
    return {
        "vblora": peft.VBLoRAConfig(r=2, num_vectors=8, vector_length=4, **common),
        "c3a": peft.C3AConfig(block_size=4, **common),
        "gralora": peft.GraloraConfig(r=4, gralora_k=2, alpha=8, **common),
        "waveft": peft.WaveFTConfig(n_frequency=16, **common),
    }


@pytest.fixture(scope="module")
def own_case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    import transformers

    root = tmp_path_factory.mktemp("own")
    model = build("qwen3", root / "qwen3", 41)
    adapters = {}
    for seed, (name, config) in enumerate(_own_configs().items()):
        base = transformers.Qwen3ForCausalLM.from_pretrained(model)
        adapters[name] = save_adapter(base, config, root / name, seed)
    return model, adapters


def test_peft_merges_these_methods_by_adding_get_delta_weight(own_case) -> None:
    """What `peft_path.PEFT_ADDITIVE` claims, on PEFT itself in float64: merge_and_unload gives W + the
    float64 twin's get_delta_weight (`float64_peft_delta`), bit for bit."""
    import transformers
    from peft import PeftModel

    from core.methods import peft_path
    from core.methods.adapter_keys import adapted_modules

    model, adapters = own_case
    assert set(adapters) == set(peft_path.PEFT_ADDITIVE)
    base = base_state(model)
    for name, folder in adapters.items():
        loaded = transformers.Qwen3ForCausalLM.from_pretrained(model, dtype=torch.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft = PeftModel.from_pretrained(loaded, folder)
        layers = {m: layer for m, (layer, _) in adapted_modules(peft).items()}
        refs = peft_path.own_references(layers, "default", name, base)
        assert len(refs) == 2, name
        merged = peft.merge_and_unload().state_dict()
        for module, (delta, weight, note) in refs.items():
            assert delta.abs().max() > 0 and note.startswith(f"{name}: PEFT's own get_delta_weight")
            assert torch.equal(merged[f"{module}.weight"], weight), (name, module)


def test_methods_merged_by_peft_own_delta_run_every_check(own_case, tmp_path: Path) -> None:
    """VBLoRA and C3A: a ΔW row and merged rows per module against PEFT's own get_delta_weight in float64,
    named so; no `not covered` finding."""
    model, adapters = own_case
    run = run_all_checks(tmp_path / "home", model, {n: adapters[n] for n in ("vblora", "c3a")})
    table = run.metrics()
    nothing_broken(table)
    modules = {f"model.layers.0.self_attn.{m}" for m in ("q_proj", "v_proj")}
    for name in ("vblora", "c3a"):
        for target in TARGETS:
            at = table[(table.adapter == name) & (table.target == target)]
            deltas = at[(at.check == "deltas") & (at.role == "delta")]
            assert set(deltas.tensor) == modules and set(deltas.reference) == {
                "PEFT's own get_delta_weight in float64"
            }
            merged = at[(at.check == "merge") & (at.role == "merged")]
            assert set(merged.tensor) == {
                f"merged:{s}:{m}" for m in modules for s in ("merge_adapter", "safe_merge")
            }
            assert set(merged.reference) == {"W + PEFT's own get_delta_weight in float64"}
    for check in ("deltas", "merge"):
        findings = run.table(f"{check}_findings")
        assert findings[findings.adapter.isin(["vblora", "c3a"])].empty


# ----------------------------------------------------------------------------------------------------------
# 5. LoRA on nn.MultiheadAttention: SigLIP's attention-pooling head
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def attention_case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A SigLIP vision tower (hidden 24, one layer, 8×8 images of 4×4 patches) whose pooling head is an
    nn.MultiheadAttention: LoRA on it (PEFT wraps it and its out_proj) and on the encoder's v_proj."""
    import transformers
    from peft import LoraConfig

    root = tmp_path_factory.mktemp("attention")
    quiet()
    torch.manual_seed(51)
    config = transformers.SiglipVisionConfig(
        hidden_size=24,
        intermediate_size=40,
        num_hidden_layers=1,
        num_attention_heads=3,
        image_size=8,
        patch_size=4,
    )
    transformers.SiglipVisionModel(config).eval().save_pretrained(root / "siglip")
    base = transformers.SiglipVisionModel.from_pretrained(root / "siglip")
    lora = LoraConfig(r=2, lora_alpha=6, init_lora_weights=False, target_modules=["head.attention", "v_proj"])
    return root / "siglip", save_adapter(base, lora, root / "siglip-lora", 5)


def test_attention_float64_equal_peft_merge(attention_case) -> None:
    """in_proj's and out_proj's merged weights (float64, from the files) against PEFT's merge_and_unload in
    float64: within 4 ulp of float64 at the weight's scale. PEFT 0.21.2 adds out_proj's ΔW twice (in its
    forward too: checked here against a model merged by hand), which the reference follows."""
    import copy

    import transformers
    from peft import PeftModel

    from core.methods.adapter_keys import OUT_PROJ_TWICE
    from core.models import merging

    model, adapter = attention_case
    config, tensors = merging.adapter_files(AdapterRef(path=str(adapter), name="a"), str(model))
    base = base_state(model)
    deltas = formulas.reference_deltas(config, tensors, base)
    assert set(deltas) == {
        "head.attention.in_proj_weight",
        "head.attention.out_proj",
        "encoder.layers.0.self_attn.v_proj",
    }
    merged = formulas.merged_weights(config, tensors, base, deltas=deltas)
    loaded = transformers.SiglipVisionModel.from_pretrained(model, dtype=torch.float64).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft = PeftModel.from_pretrained(copy.deepcopy(loaded), adapter).eval()
    pixels = torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        unmerged = peft(pixel_values=pixels).pooler_output
        by_hand = copy.deepcopy(loaded)
        for name, weight in merged.items():
            target = name if name.endswith("in_proj_weight") else name + ".weight"
            by_hand.get_parameter(target).copy_(weight)
        assert (by_hand(pixel_values=pixels).pooler_output - unmerged).abs().max() < 1e-12
    state = peft.merge_and_unload().state_dict()
    for name, weight in merged.items():
        want = state[name if name.endswith("in_proj_weight") else name + ".weight"]
        assert (weight - want).abs().max() <= 4 * torch.finfo(torch.float64).eps * want.abs().max(), name
    assert "adds out_proj's ΔW twice" in OUT_PROJ_TWICE


def test_attention_runs_every_check(attention_case, tmp_path: Path) -> None:
    """ΔW rows of in_proj and out_proj; merged rows against W + ΔW (out_proj W + 2ΔW, said in a note)."""
    model, adapter = attention_case
    run = run_all_checks(tmp_path / "home", model, {"mha": adapter})
    table = run.metrics()
    nothing_broken(table)
    modules = {
        "head.attention.in_proj_weight",
        "head.attention.out_proj",
        "encoder.layers.0.self_attn.v_proj",
    }
    for target in TARGETS:
        at = table[(table.adapter == "mha") & (table.target == target)]
        deltas = at[(at.check == "deltas") & (at.role == "delta")]
        assert set(deltas.tensor) == modules
        merged = at[(at.check == "merge") & (at.role == "merged")]
        assert set(merged.tensor) == {
            f"merged:{s}:{m}" for m in modules for s in ("merge_adapter", "safe_merge")
        }
    assert any("adds out_proj's ΔW twice" in n for n in run.notes())


# ----------------------------------------------------------------------------------------------------------
# 6. A checkpoint whose class the task's Auto mapping lacks: a Llava-style VLM with a CAUSAL_LM adapter
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vlm_case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Llava: a CLIP vision tower (8×8 images of 4×4 patches: 4 image tokens) and a Llama LM (hidden 16, 64
    tokens, the last one the image token); a CAUSAL_LM LoRA on q_proj and v_proj of both."""
    import transformers
    from peft import LoraConfig

    root = tmp_path_factory.mktemp("vlm")
    quiet()
    torch.manual_seed(61)
    vision = transformers.CLIPVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=8,
        patch_size=4,
    )
    text = transformers.LlamaConfig(**{**ARCHITECTURES["llama"].config, "max_position_embeddings": 64})
    config = transformers.LlavaConfig(
        vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=63, image_seq_length=4
    )
    transformers.LlavaForConditionalGeneration(config).eval().save_pretrained(root / "llava")
    base = transformers.LlavaForConditionalGeneration.from_pretrained(root / "llava")
    lora = LoraConfig(
        r=2, lora_alpha=4, init_lora_weights=False, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
    )
    return root / "llava", save_adapter(base, lora, root / "llava-lora", 6)


def test_vlm_class_is_the_checkpoints_and_its_probe_holds_pixels_and_image_tokens(vlm_case) -> None:
    from transformers import AutoConfig

    from core.models.loading import model_class
    from core.models.probes import probe_inputs

    config = AutoConfig.from_pretrained(vlm_case[0])
    cls = model_class(config, "CAUSAL_LM")
    assert cls.__name__ == "LlavaForConditionalGeneration"
    probe = probe_inputs(config, cls, ProbeInputs(batch=2, seq_len=5), seed=0)
    assert {k: tuple(t.shape) for k, t in probe.items()} == {
        "input_ids": (2, 9),
        "attention_mask": (2, 9),
        "pixel_values": (2, 3, 8, 8),
    }
    assert (probe["input_ids"][:, :4] == 63).all() and not (probe["input_ids"][:, 4:] == 63).any()


def test_vlm_runs_every_check(vlm_case, tmp_path: Path) -> None:
    """Both towers' LoRA modules have their ΔW and merged rows; the logits cover the image tokens and the text."""
    model, adapter = vlm_case
    table = run_all_checks(tmp_path / "home", model, {"vl": adapter}).metrics()
    nothing_broken(table)
    modules = {
        f"model.{tower}.layers.0.self_attn.{m}"
        for tower in ("language_model", "vision_tower.encoder")
        for m in ("q_proj", "v_proj")
    }
    for target in TARGETS:
        at = table[(table.adapter == "vl") & (table.target == target)]
        assert set(at[(at.check == "deltas") & (at.role == "delta")].tensor) == modules
        merged = at[(at.check == "merge") & (at.role == "merged")]
        assert set(merged.tensor) == {
            f"merged:{s}:{m}" for m in modules for s in ("merge_adapter", "safe_merge")
        }
        assert set(at[at.check == "outputs"]["shape"]) == {"2x9x64"}
        assert len(at[at.check == "generate"]) == 1


# ----------------------------------------------------------------------------------------------------------
# On a GPU (skipped without CUDA): each kind on cuda:0, in worker processes
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "case", ["bias_case", "parameter_cases", "replication_case", "own_case", "attention_case", "vlm_case"]
)
def test_each_kind_on_cuda(case: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Every check on cuda:0/float32 and cuda:0/bfloat16 (the trained biases' Δb on the device, a float64
    twin of a VBLoRA layer made from a CUDA layer, ParamWrapper and MultiheadAttention merges on the GPU):
    nothing broken, and cuda:0/float32 identical or within tolerance (but `base mutated` rows)."""
    from core.engine.runners import ProcessRunner

    made = request.getfixturevalue(case)
    if case == "parameter_cases":
        model, adapters = made["qwen3_moe"][0], {"experts": made["qwen3_moe"][1]}
    elif case in ("bias_case", "own_case"):
        model, adapters = made[0], {n: made[1][n] for n in list(made[1])[:1]}
    else:
        model, adapters = made[0], {"a": made[1]}
    engine = Engine(tmp_path / "home", runner=ProcessRunner())
    spec = ProbeSpec(
        base=ModelRef(path=str(model)),
        adapters=tuple(AdapterRef(path=str(f), name=n) for n, f in adapters.items()),
        targets=tuple(Target.parse(t) for t in ("cuda:0/float32", "cuda:0/bfloat16")),
        checks=tuple(CHECKS),
        probe=ProbeInputs(batch=2, seq_len=5),
    )
    job = engine.submit(spec)
    assert job.wait(600) and job.state == "succeeded", job.error
    table = engine.store.open(job.run_id).metrics()
    assert "broken" not in set(table.verdict)
    float32 = table[(table.target == "cuda:0/float32") & (table.reason.fillna("") != "base mutated")]
    assert set(float32.verdict) <= {"identical", "within tolerance"}, float32[
        ~float32.verdict.isin(["identical", "within tolerance"])
    ][["check", "tensor", "verdict"]].values
