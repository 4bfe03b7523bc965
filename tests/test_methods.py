"""LoHa, LoKr, VeRA, AdaLoRA, FourierFT, SHiRA, HRA, MiSS, RandLoRA and DeLoRA: ΔW and merge against
float64 formulas written out here, on tiny random models built in fixtures (a Llama, and a GPT-2 whose Conv1D layers store W as (in, out)).

The formulas below (`_expected_delta`) are this test's own, written from the adapter files and the
configs this module makes, independently of `core.methods.formulas` (torch.kron and diagonal matrices where
core writes broadcasts), so that both have to agree with PEFT and with each other.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import ARCHITECTURES, quiet

from core.engine.jobs import Engine
from core.engine.runners import InProcessRunner
from core.engine.store import RunRecord
from core.methods import adapter_keys, formulas, peft_path, projections, registry
from core.methods.families import adalora, lora
from core.models import merging
from core.spec import AdapterRef, ModelRef, ProbeInputs, ProbeSpec, Target

METHODS = ("loha", "lokr", "vera", "adalora")
LLAMA_ADAPTERS = ("loha", "lokr", "lokr_lowrank", "vera", "adalora")
GPT2_ADAPTERS = ("vera_gpt2", "adalora_gpt2")
ENCODER_ADAPTERS = ("loha_roberta", "lokr_roberta", "vera_roberta", "adalora_roberta", "adalora_no_alpha")
# AdaLoRA's budget pruned this module to 4 of its 6 ranks (what rank_pattern records); PEFT then
# still divides by init_r (6), the rank it was created with.
ADALORA_PRUNED = "model.layers.0.self_attn.q_proj"
ADALORA_KEEP = [True, False, True, True, False, True]


def _configs() -> dict[str, tuple[str, object]]:
    """Adapter name → (base, PEFT config); init_weights off everywhere, so that ΔW is not zero."""
    from peft import AdaLoraConfig, LoHaConfig, LoKrConfig, LoraConfig, VeraConfig

    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "init_lora_weights": False}
    encoder = ["query", "value", "intermediate.dense"]
    return {
        "lora_a": ("llama", LoraConfig(**lora)),
        "lora_b": ("llama", LoraConfig(**lora)),
        "loha": (
            "llama",
            LoHaConfig(
                r=4,
                alpha=8,
                target_modules=["q_proj", "v_proj", "down_proj"],
                rank_pattern={"down_proj": 2},
                alpha_pattern={"v_proj": 3},
                init_weights=False,
            ),
        ),
        # r 4 keeps both Kronecker factors whole ...
        "lokr": (
            "llama",
            LoKrConfig(r=4, alpha=8, target_modules=["q_proj", "down_proj"], init_weights=False),
        ),
        # ... r 1 with decompose_both stores each as a rank-1 product (lokr_w1_a @ lokr_w1_b, ...)
        "lokr_lowrank": (
            "llama",
            LoKrConfig(
                r=1, alpha=2, decompose_both=True, target_modules=["q_proj", "down_proj"], init_weights=False
            ),
        ),
        # down_proj's 48 inputs make the shared vera_A wider than q_proj and v_proj use: sliced
        "vera": (
            "llama",
            VeraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_weights=False),
        ),
        "adalora": (
            "llama",
            AdaLoraConfig(
                init_r=6,
                target_r=4,
                lora_alpha=8,
                total_step=10,
                target_modules=["q_proj", "down_proj"],
                init_lora_weights=False,
            ),
        ),
        "vera_gpt2": (
            "gpt2",
            VeraConfig(r=4, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True, init_weights=False),
        ),
        # an encoder: RoBERTa's attention and feedforward
        "loha_roberta": ("roberta", LoHaConfig(r=2, alpha=4, target_modules=encoder, init_weights=False)),
        "lokr_roberta": ("roberta", LoKrConfig(r=2, alpha=4, target_modules=encoder, init_weights=False)),
        "vera_roberta": ("roberta", VeraConfig(r=4, target_modules=encoder, init_weights=False)),
        "adalora_roberta": (
            "roberta",
            AdaLoraConfig(
                init_r=4, lora_alpha=8, total_step=10, target_modules=encoder, init_lora_weights=False
            ),
        ),
        # lora_alpha 0: PEFT scales by the rank instead
        "adalora_no_alpha": (
            "roberta",
            AdaLoraConfig(
                init_r=4, lora_alpha=0, total_step=10, target_modules=["query"], init_lora_weights=False
            ),
        ),
        "adalora_gpt2": (
            "gpt2",
            AdaLoraConfig(
                init_r=4,
                lora_alpha=16,
                total_step=10,
                target_modules=["c_attn", "mlp.c_proj"],
                fan_in_fan_out=True,
                init_lora_weights=False,
            ),
        ),
    }


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """{"models": {"llama", "gpt2", "roberta"} → folder, "adapters": name → folder}, all made here, seeded."""

    quiet()
    root = tmp_path_factory.mktemp("methods")
    models = {"llama": root / "llama", "gpt2": root / "gpt2", "roberta": root / "roberta"}
    torch.manual_seed(0)
    ARCHITECTURES["llama"].build(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ).save_pretrained(models["llama"])
    ARCHITECTURES["gpt2"].build(n_embd=32, n_layer=2, bos_token_id=0, eos_token_id=0).save_pretrained(
        models["gpt2"]
    )
    ARCHITECTURES["roberta"].build(
        "RobertaModel", hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4
    ).save_pretrained(models["roberta"])
    adapters = {}
    for seed, (name, (base, config)) in enumerate(_configs().items()):
        model = _random_peft(models[base], config, seed, 100 + seed)
        if name == "adalora":
            key = f"{ADALORA_PRUNED}.lora_E.default"
            model.peft_config["default"].rank_pattern = {key: ADALORA_KEEP}
        model.save_pretrained(root / name)
        adapters[name] = root / name
    return {"models": models, "adapters": adapters}


def _load(folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModel, AutoModelForCausalLM

    auto = AutoModel if folder.name == "roberta" else AutoModelForCausalLM
    return auto.from_pretrained(folder, dtype=dtype).eval()


def _random_peft(base: Path, config, seed: int, fill_seed: int) -> torch.nn.Module:
    """PEFT's `config` on the float32 model saved at `base` (made after `torch.manual_seed(seed)`), every
    trained tensor then random from `fill_seed`, at a scale where ΔW is a small part of W."""
    from peft import get_peft_model

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(_load(base, torch.float32), config)
    generator = torch.Generator().manual_seed(fill_seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))
    return model


def _peft(workspace: dict, name: str, dtype: torch.dtype) -> torch.nn.Module:
    from peft import PeftModel

    base = workspace["models"][_configs()[name][0]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PeftModel.from_pretrained(_load(base, dtype), str(workspace["adapters"][name])).eval()


def _files(workspace: dict, name: str) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(adapter config, adapter tensors, base state dict in float64) as saved."""
    folder = workspace["adapters"][name]
    config = json.loads((folder / "adapter_config.json").read_text())
    base = workspace["models"][_configs()[name][0]] / "model.safetensors"
    return (
        config,
        load_file(folder / "adapter_model.safetensors"),
        {k: v.double() for k, v in load_file(base).items()},
    )


def _pattern(config: dict, field: str, module: str, default: float) -> float:
    """The configs here name a pattern by a module's last part."""
    return next((v for k, v in (config.get(field) or {}).items() if module.endswith(k)), default)


def _expected_delta(config: dict, tensors: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> dict:
    """Module → ΔW in float64, this test's own formula per method (module shapes as the base stores W)."""
    t = {k.removeprefix("base_model.model."): v.double() for k, v in tensors.items()}
    kind = config["peft_type"].lower()
    suffix = {"loha": ".hada_w1_a", "lokr": ".lokr_w", "vera": ".vera_lambda_b", "adalora": ".lora_A"}[kind]
    modules = sorted({k.split(suffix)[0] for k in t if suffix in k})
    out = {}
    for m in modules:
        w = base[f"{m}.weight"]
        if kind == "loha":
            r = _pattern(config, "rank_pattern", m, config["r"])
            alpha = _pattern(config, "alpha_pattern", m, config["alpha"])
            h1 = t[f"{m}.hada_w1_a"] @ t[f"{m}.hada_w1_b"]
            h2 = t[f"{m}.hada_w2_a"] @ t[f"{m}.hada_w2_b"]
            out[m] = h1 * h2 * alpha / r
        elif kind == "lokr":

            def factor(i: int, m: str = m) -> torch.Tensor:
                whole = t.get(f"{m}.lokr_w{i}")
                return whole if whole is not None else t[f"{m}.lokr_w{i}_a"] @ t[f"{m}.lokr_w{i}_b"]

            out[m] = torch.kron(factor(1), factor(2)) * config["alpha"] / config["r"]
        elif kind == "vera":
            fifo = config["fan_in_fan_out"]
            n_out, n_in = (w.shape[1], w.shape[0]) if fifo else w.shape
            a, b = tensors["base_model.vera_A"].double(), tensors["base_model.vera_B"].double()
            d = (
                torch.diag(t[f"{m}.vera_lambda_b"])
                @ b[:n_out]
                @ torch.diag(t[f"{m}.vera_lambda_d"])
                @ a[:, :n_in]
            )
            out[m] = d.T if fifo else d
        else:  # AdaLoRA: divided by init_r, whatever rank is left
            d = t[f"{m}.lora_B"] @ torch.diag(t[f"{m}.lora_E"][:, 0]) @ t[f"{m}.lora_A"]
            scaling = config["lora_alpha"] if config["lora_alpha"] > 0 else t[f"{m}.lora_A"].shape[0]
            d = d * scaling / (config["init_r"] + 1e-5)
            out[m] = d.T if config["fan_in_fan_out"] else d
        assert out[m].shape == w.shape, m
    return out


ALL = LLAMA_ADAPTERS + GPT2_ADAPTERS + ENCODER_ADAPTERS


def test_the_adapters_are_what_the_tests_claim(workspace: dict) -> None:
    """The fixture exercises what it says: low-rank LoKr factors, a pruned AdaLoRA module, fan_in_fan_out."""
    _, lowrank, _ = _files(workspace, "lokr_lowrank")
    assert any(k.endswith("lokr_w1_a") for k in lowrank) and any(k.endswith("lokr_w2_b") for k in lowrank)
    assert not any(k.endswith(("lokr_w1", "lokr_w2")) for k in lowrank)
    config, adalora, _ = _files(workspace, "adalora")
    assert adalora[f"base_model.model.{ADALORA_PRUNED}.lora_E"].shape == (sum(ADALORA_KEEP), 1)
    assert adalora["base_model.model.model.layers.1.self_attn.q_proj.lora_E"].shape == (6, 1)
    assert config["rank_pattern"]
    for name in GPT2_ADAPTERS:
        assert _files(workspace, name)[0]["fan_in_fan_out"] is True


@pytest.mark.parametrize("name", ALL)
def test_reference_deltas_equal_the_formula_written_here(workspace: dict, name: str) -> None:
    config, tensors, base = _files(workspace, name)
    expected = _expected_delta(config, tensors, base)
    got = formulas.reference_deltas(config, tensors, base)
    assert sorted(got) == sorted(expected) and len(got) >= 2
    for m, d in expected.items():
        assert got[m].dtype == torch.float64
        # the same float64 products in another order: a few ulps of ΔW
        assert (got[m] - d).abs().max() <= 1e-15 * d.abs().max(), m
        assert d.abs().max() > 1e-3 * base[f"{m}.weight"].abs().max(), m  # ΔW is not negligible


@pytest.mark.parametrize("name", ALL)
def test_peft_float64_delta_and_merge_equal_the_formula_written_here(workspace: dict, name: str) -> None:
    """PEFT in float64: its ΔW (through core's peft_delta) and merge_and_unload() against W + ΔW from here."""
    config, tensors, base = _files(workspace, name)
    expected = _expected_delta(config, tensors, base)
    model = _peft(workspace, name, torch.float64)
    layers = adapter_keys.adapted_modules(model)
    assert sorted(layers) == sorted(expected)
    for m, (layer, names) in layers.items():
        delta = peft_path.peft_delta(layer, names[0])
        assert (delta - expected[m]).abs().max() <= 1e-15 * expected[m].abs().max(), m
        assert (
            peft_path.peft_delta_source(layer, names[0]) == f"{config['peft_type'].lower()}.get_delta_weight"
        )
    merged = model.merge_and_unload().state_dict()
    for m, d in expected.items():
        exact = base[f"{m}.weight"] + d
        # one float64 addition: at most half an ulp of the result
        assert (merged[f"{m}.weight"] - exact).abs().max() <= 2.3e-16 * exact.abs().max(), m


@pytest.mark.parametrize("name", ALL)
def test_peft_float32_delta_is_float32_rounding_of_the_formula(workspace: dict, name: str) -> None:
    config, tensors, base = _files(workspace, name)
    expected = _expected_delta(config, tensors, base)
    for m, (layer, names) in adapter_keys.adapted_modules(_peft(workspace, name, torch.float32)).items():
        delta = peft_path.peft_delta(layer, names[0])
        assert delta.dtype == torch.float32
        rel = ((delta.double() - expected[m]).norm() / expected[m].norm()).item()
        assert 0 < rel < 1e-6, (m, rel)  # float32 products: ~1e-7 relative, never exact here


def test_vera_projections_are_shared_keys(workspace: dict) -> None:
    config, tensors, base = _files(workspace, "vera")
    assert adapter_keys.split_adapter_key("base_model.vera_A") is None  # no module of its own
    modules = adapter_keys.adapter_module_keys(tensors)
    assert sorted(modules) == sorted(_expected_delta(config, tensors, base))
    for mod in modules.values():
        assert mod.keys["vera_A"] == "base_model.vera_A" and mod.keys["vera_B"] == "base_model.vera_B"
    without = {k: v for k, v in tensors.items() if not k.startswith("base_model.vera_")}
    # a file without the pair (save_projection=False) needs it regenerated first: the formula says so ...
    with pytest.raises(ValueError, match="save_projection=False"):
        formulas.reference_deltas(config, without, base)
    # ... and with it regenerated from the config and the modules' shapes, ΔW is the saved file's, bit for bit
    shapes = [base[f"{m}.weight"].shape for m in modules]
    regenerated = {**without, **projections.regenerate("vera", config, shapes)}
    saved = formulas.reference_deltas(config, tensors, base)
    for m, d in formulas.reference_deltas(config, regenerated, base).items():
        assert torch.equal(d, saved[m]), m


@pytest.mark.parametrize(
    ("name", "key", "match"),
    [
        ("loha", "self_attn.q_proj.hada_w2_b", r"hada_w2_b has shape \(4, 31\)"),
        ("lokr", "self_attn.q_proj.lokr_w2", r"lokr_w1 ⊗ lokr_w2 has shape \(32, 28\)"),
        ("vera", "self_attn.q_proj.vera_lambda_b", r"vera_lambda_b has shape \(31,\)"),
        ("adalora", "self_attn.q_proj.lora_A", r"lora_A has shape \(4, 31\)"),
    ],
)
def test_shape_mismatch_names_the_module(workspace: dict, name: str, key: str, match: str) -> None:
    config, tensors, base = _files(workspace, name)
    full = f"base_model.model.model.layers.0.{key}"
    tensors[full] = tensors[full][..., : tensors[full].shape[-1] - 1]  # one input too few
    with pytest.raises(ValueError, match=rf"model.layers.0.self_attn.q_proj: {match}"):
        formulas.reference_deltas(config, tensors, base)


# --------------------------------------------------------------------------------------------------
# The deltas and merge checks' rows, through the engine
# --------------------------------------------------------------------------------------------------


def _run(
    workspace: dict,
    base: str,
    adapters: list[str],
    checks: tuple[str, ...],
    home: Path,
    dtype: str = "float32",
) -> RunRecord:
    """Run `checks` on cpu/`dtype` through the engine (in process); the stored run."""
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(5))
    spec = ProbeSpec(
        base=ModelRef(path=str(workspace["models"][base])),
        adapters=tuple(AdapterRef(path=str(workspace["adapters"][a]), name=a) for a in adapters),
        targets=(Target.parse(f"cpu/{dtype}"),),
        checks=checks,
        probe=ProbeInputs(input_ids=tuple(tuple(int(i) for i in row) for row in ids)),
    )
    engine = Engine(home, runner=InProcessRunner())
    job = engine.submit(spec)
    assert job.wait(300) and job.state == "succeeded", job.error
    return engine.store.open(job.run_id)


@pytest.fixture(scope="module")
def runs(workspace: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunRecord]:
    """weights + deltas + merge on cpu/float32: the Llama with two LoRAs first and VeRA last (the merge
    of the LoRAs together used to be skipped without a word when the last adapter was no LoRA); GPT-2;
    RoBERTa."""
    home = tmp_path_factory.mktemp("methods-home")
    checks = ("weights", "deltas", "merge")
    llama = ["lora_a", "lora_b", "loha", "lokr", "lokr_lowrank", "adalora", "vera"]
    return {
        "llama": _run(workspace, "llama", llama, checks, home),
        "gpt2": _run(workspace, "gpt2", list(GPT2_ADAPTERS), checks, home),
        "roberta": _run(workspace, "roberta", list(ENCODER_ADAPTERS), checks, home),
    }


@pytest.mark.parametrize("name", ALL)
def test_delta_and_merged_rows_equal_the_formula_written_here(workspace: dict, runs: dict, name: str) -> None:
    """Every deltas row and every merge `delta`/`merged` row of the adapter: max |Δ| equals what PEFT in
    float32 (its get_delta_weight; merge_and_unload on a fresh load) leaves against the float64 ΔW and
    W + ΔW written here."""
    table = runs[_configs()[name][0]].metrics()
    rows = table[(table.adapter == name) & (table.target == "cpu/float32")]
    config, tensors, base = _files(workspace, name)
    expected = _expected_delta(config, tensors, base)
    model = _peft(workspace, name, torch.float32)
    want: dict[tuple[str, str], float] = {}
    for m, (layer, names) in adapter_keys.adapted_modules(model).items():
        with torch.no_grad():
            err = (layer.get_delta_weight(names[0]).double() - expected[m]).abs().max().item()
        want[("deltas", m)] = want[("merge", f"delta:peft:{m}")] = err
    merged = model.merge_and_unload().state_dict()
    for m, d in expected.items():
        exact = base[f"{m}.weight"] + d
        err = (merged[f"{m}.weight"].double() - exact).abs().max().item()
        # safe_merge adds the same ΔW to a copy of W: the same single rounding in float32
        want[("merge", f"merged:merge_adapter:{m}")] = want[("merge", f"merged:safe_merge:{m}")] = err
    roles = rows[(rows.check == "deltas") | rows.role.isin(["delta", "merged"])]
    got = {(r.check, r.tensor): r.max_abs for r in roles.itertuples()}
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert 0 < value < 1e-6 * max(1.0, expected[key[1].rsplit(":", 1)[-1]].abs().max().item()), key
        # the check's float64 reference is core's formula, the test's is its own: equal to ~1e-17
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-15), key
    assert set(rows[rows.role.isin(["delta", "merged"])].verdict) <= {
        "identical",
        "within tolerance",
        "drift",
    }
    # the adapter's own tensors load as saved (float32 file, float32 target), VeRA's projections included
    weights = rows[rows.check == "weights"]
    assert len(weights) == len(tensors) and (weights.verdict == "identical").all()


def test_loras_before_a_vera_are_merged_together(runs: dict) -> None:
    table = runs["llama"].metrics()
    subset = table[(table.adapter == "lora_a+lora_b") & (table.role == "merged")]
    assert set(subset.stage) == {"subset merge_adapter sequential", "subset merge_adapter combined"}
    findings = runs["llama"].table("merge_findings")
    assert not len(findings), findings.to_dict("records")


def test_an_adapter_merge_cannot_cover_says_so_and_the_loras_before_it_merge(
    workspace: dict, tmp_path: Path
) -> None:
    """LN tuning (no formula here: it replaces the layer norms whole) as the last adapter: a finding row and
    a note name it; the LoRAs still merge."""
    from peft import LNTuningConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(
            _load(workspace["models"]["llama"], torch.float32),
            LNTuningConfig(target_modules=["input_layernorm"]),
        )
    model.save_pretrained(tmp_path / "ln")
    ws = {**workspace, "adapters": {**workspace["adapters"], "ln": tmp_path / "ln"}}
    run = _run(ws, "llama", ["lora_a", "lora_b", "ln"], ("merge",), tmp_path / "home")
    table = run.metrics()
    assert "subset merge_adapter combined" in set(table[table.adapter == "lora_a+lora_b"].stage)
    assert not len(table[table.adapter == "ln"])
    findings = run.table("merge_findings")
    ln = findings[findings.adapter == "ln"]
    assert list(zip(ln.target, ln.finding, strict=True)) == [("cpu/float32", "not covered")]
    assert "ln is a ln_tuning adapter; its merge rule is not covered" in ln.detail.iloc[0]
    assert f"merge: {ln.detail.iloc[0]}" in run.notes()


def test_adalora_module_pruned_by_rank_pattern_loads_rounded_to_bfloat16(
    workspace: dict, tmp_path: Path
) -> None:
    """PEFT rebuilds a module AdaLoRA's budget pruned when it loads the adapter, in the model's dtype,
    and copies the file's float32 tensors into it: on bfloat16 they come back rounded to bfloat16
    (upcast to float32 again), the other modules' exactly as saved. The weights rows show it and the
    deltas row says why."""
    run = _run(workspace, "llama", ["adalora"], ("weights", "deltas"), tmp_path, dtype="bfloat16")
    table = run.metrics()
    _, tensors, _ = _files(workspace, "adalora")
    weights = table[table.check == "weights"].set_index("tensor")
    for key, t in tensors.items():
        row = weights.loc[key]
        if ADALORA_PRUNED in key:
            rounded = (t.double() - t.to(torch.bfloat16).double()).abs().max().item()
            assert not row.bitwise_equal and row.max_abs == rounded > 0, key
        else:
            assert row.verdict == "identical", key
    deltas = table[table.check == "deltas"].set_index("tensor")
    assert "rounds its lora_A, lora_B and lora_E to bfloat16" in deltas.loc[ADALORA_PRUNED, "note"]
    assert not any("rank_pattern" in n for n in deltas.drop(ADALORA_PRUNED).note)
    # ΔW of the pruned module carries the rounding of its factors: 1e-3 relative, the others 1e-7
    config, tensors, base = _files(workspace, "adalora")
    expected = _expected_delta(config, tensors, base)
    rel = {m: deltas.loc[m, "max_abs"] / expected[m].abs().max().item() for m in expected}
    assert 1e-4 < rel[ADALORA_PRUNED] < 1e-2
    assert all(v < 1e-6 for m, v in rel.items() if m != ADALORA_PRUNED), rel


@pytest.mark.parametrize("kind", ["fourierft", "shira"])
def test_fourierft_and_shira_deltas_equal_the_formula_written_here(workspace: dict, kind: str) -> None:
    """FourierFT: the real part of the inverse FFT of its spectrum laid out at the frequencies the PEFT layer
    holds; SHiRA: its values at its indices, a sparse tensor made dense. Core's float64 formulas (cosines and
    sines with the frequencies drawn anew from the seed; an index_put) against these, and PEFT's float32 ΔW
    against both."""
    from peft import FourierFTConfig, ShiraConfig, get_peft_model_state_dict

    targets = ["q_proj", "down_proj"]
    config = (
        FourierFTConfig(n_frequency=20, scaling=2.0, target_modules=targets)
        if kind == "fourierft"
        else ShiraConfig(r=2, random_seed=3, target_modules=targets, init_weights=False)
    )
    model = _random_peft(workspace["models"]["llama"], config, 5, 6)
    tensors = get_peft_model_state_dict(model)
    saved = json.loads(json.dumps(model.peft_config["default"].to_dict(), default=list))
    base = {k: v.double() for k, v in load_file(workspace["models"]["llama"] / "model.safetensors").items()}
    got = formulas.reference_deltas(saved, tensors, base)
    layers = adapter_keys.adapted_modules(model)
    assert sorted(got) == sorted(layers) and len(got) == 4  # q_proj and down_proj of both layers
    for m, (layer, _) in layers.items():
        shape = base[f"{m}.weight"].shape
        if kind == "fourierft":
            dense = torch.zeros(shape, dtype=torch.float64)
            rows, cols = layer.indices["default"]
            dense[rows, cols] = layer.fourierft_spectrum["default"].detach().double()
            expected = torch.fft.ifft2(dense).real * 2.0
        else:
            values = layer.shira_weight["default"].detach().double()
            expected = torch.sparse_coo_tensor(layer.shira_indices["default"], values, shape).to_dense()
        assert expected.abs().max() > 0, m
        assert (got[m] - expected).abs().max() <= 1e-13 * expected.abs().max(), m
        delta = peft_path.peft_delta(layer, "default")
        assert delta.dtype == torch.float32 and not delta.is_sparse
        rel = ((delta.double() - expected).norm() / expected.norm()).item()
        assert rel < 1e-6, (m, rel)  # float32 rounding (SHiRA: none, its values are float32 as saved)


# HRA, MiSS (its three inits), RandLoRA (also on GPT-2's Conv1D, fan_in_fan_out) and DeLoRA: name → (base,
# PEFT config class, its arguments). Ranks chosen so that the formulas' corners are exercised: MiSS r 5 leaves
# a narrower last slice of q_proj's 32 inputs; RandLoRA r 3 gives 11 bases (32/3, rounded up), so PEFT's two
# flattening orders pair different (rank, basis) indices; down_proj (48 in, 32 out) is wider than tall.
NEWER = {
    "hra": ("llama", "HRAConfig", {"r": 3}),
    "hra_gs": ("llama", "HRAConfig", {"r": 3, "apply_GS": True}),
    "miss": ("llama", "MissConfig", {"r": 5}),
    "miss_bat": ("llama", "MissConfig", {"r": 4, "init_weights": "bat"}),
    "miss_mini": ("llama", "MissConfig", {"r": 2, "init_weights": "mini", "mini_r": 4}),
    "randlora": ("llama", "RandLoraConfig", {"r": 3, "randlora_alpha": 6}),
    "randlora_gpt2": ("gpt2", "RandLoraConfig", {"r": 4, "randlora_alpha": 8, "fan_in_fan_out": True}),
    "delora": ("llama", "DeloraConfig", {"r": 2, "rank_pattern": {"down_proj": 3}}),
}


def _newer_expected(name: str, config: dict, tensors: dict, base: dict) -> dict[str, torch.Tensor]:
    """Module → ΔW in float64, written here from the methods' definitions with matrices where core writes
    loops, gathers and QR: HRA's reflections multiplied out (Gram–Schmidt by hand), MiSS's block tiled with
    torch.cat and its bat blocks one by one, RandLoRA's scaled bases flattened as PEFT's layer flattens them,
    DeLoRA's diagonal matrices."""
    t = {k.removeprefix("base_model.model."): v.double() for k, v in tensors.items()}
    kind = config["peft_type"].lower()
    suffix = {"hra": ".hra_u", "miss": ".miss_block", "randlora": ".randlora_lambda", "delora": ".delora_A"}[
        kind
    ]
    out = {}
    for m in sorted(k.removesuffix(suffix) for k in t if k.endswith(suffix)):
        w = base[f"{m}.weight"]
        if kind == "hra":
            u = t[f"{m}.hra_u"]
            if config["apply_GS"]:  # classical Gram–Schmidt
                q = []
                for i in range(u.shape[1]):
                    v = u[:, i] - sum(((qj @ u[:, i]) * qj for qj in q), torch.zeros_like(u[:, i]))
                    q.append(v / v.norm())
                q = torch.stack(q, dim=1)
                h = torch.eye(u.shape[0], dtype=torch.float64) - 2 * q @ q.T
            else:
                h = torch.eye(u.shape[0], dtype=torch.float64)
                for i in range(u.shape[1]):
                    v = u[:, i : i + 1] / u[:, i].norm()
                    h = h @ (torch.eye(u.shape[0], dtype=torch.float64) - 2 * v @ v.T)
            out[m] = w @ h - w
        elif kind == "miss":
            block, (n_out, n_in) = t[f"{m}.miss_block"], w.shape
            if config["init_weights"] == "bat":
                r = config["r"]
                d = torch.zeros_like(w)
                for a in range(n_out // r):
                    for c in range(n_in // r):
                        rows, cols = slice(a * r, (a + 1) * r), slice(c * r, (c + 1) * r)
                        d[rows, cols] = w[rows, cols] @ block[a] + block[a]
                out[m] = d
            else:
                if config["init_weights"] == "mini":
                    block = block.repeat(1, n_out // config["mini_r"])
                tiles = -(-n_in // block.shape[0])
                out[m] = torch.cat([block.T] * tiles, dim=1)[:, :n_in]
        elif kind == "randlora":
            fifo = config["fan_in_fan_out"]
            n_out, n_in = (w.shape[1], w.shape[0]) if fifo else w.shape
            lam, gamma = t[f"{m}.randlora_lambda"], t[f"{m}.randlora_gamma"]
            (r, n), small = lam.shape, min(n_in, n_out)
            a, b = t[f"{m}.randlora_A"], t[f"{m}.randlora_B"]
            scaled = (lam[:, :, None] * a[:, :, :small] * gamma[None]).reshape(r * n, small)
            flat_b = b[: max(n_in, n_out), :n].reshape(-1, n * r)
            d = flat_b @ scaled
            d = d if n_in <= n_out else d.T
            out[m] = (d.T if fifo else d) * config["randlora_alpha"] / config["r"]
        else:
            a, b = t[f"{m}.delora_A"], t[f"{m}.delora_B"]
            r = a.shape[0]
            assert r == _pattern(config, "rank_pattern", m, config["r"])
            diag = torch.diag(t[f"{m}.delora_lambda"] / r / (a.norm(dim=1) * b.norm(dim=0)))
            out[m] = b @ diag @ a @ torch.diag(t[f"{m}.delora_w_norm"])
        assert out[m].shape == w.shape, m
    return out


@pytest.mark.parametrize("name", NEWER)
def test_hra_miss_randlora_and_delora_deltas_equal_peft_and_the_formula_written_here(
    workspace: dict, name: str
) -> None:
    """Core's float64 ΔW against the formula written here and against PEFT's own (`peft_delta`: its
    get_delta_weight, HRA's reflections applied to W, MiSS's merge of a zero W) on the same adapter in float64.
    Bitwise for MiSS's default and mini inits (both sides copy the block's values, no arithmetic); otherwise
    within 4e-15 of max |ΔW|, i.e. about 18 float64 ulps of the largest element: the same float64 sums of at
    most 48 products in another order (measured: at most 1.1e-15; HRA with Gram–Schmidt against a QR of
    a well-conditioned basis is no worse). PEFT's float32 ΔW within float32 rounding of it."""
    import peft
    from peft import get_peft_model_state_dict

    base_name, cls, kwargs = NEWER[name]
    targets = ["c_attn", "c_fc"] if base_name == "gpt2" else ["q_proj", "down_proj"]
    model = _random_peft(
        workspace["models"][base_name], getattr(peft, cls)(target_modules=targets, **kwargs), 11, 12
    )
    tensors = get_peft_model_state_dict(model)
    config = json.loads(json.dumps(model.peft_config["default"].to_dict(), default=str))
    base = {k: v.double() for k, v in load_file(workspace["models"][base_name] / "model.safetensors").items()}
    expected = _newer_expected(name, config, tensors, base)
    got = formulas.reference_deltas(config, tensors, base)
    assert sorted(got) == sorted(expected) and len(got) == 4  # both targets of both layers
    for m, d in expected.items():
        assert d.abs().max() > 1e-3 * base[f"{m}.weight"].abs().max(), m  # ΔW is not negligible
        assert got[m].dtype == torch.float64
        assert (got[m] - d).abs().max() <= 4e-15 * d.abs().max(), m
    layers32 = adapter_keys.adapted_modules(model)
    for m, (layer, _) in layers32.items():  # float32: PEFT's own arithmetic, rounded
        delta = peft_path.peft_delta(layer, "default")
        assert delta.dtype == torch.float32
        rel = ((delta.double() - expected[m]).norm() / expected[m].norm()).item()
        assert rel < 1e-6, (m, rel)
    for m, (layer, _) in adapter_keys.adapted_modules(model.double()).items():
        delta = peft_path.peft_delta(layer, "default")
        assert delta.dtype == torch.float64
        if name in ("miss", "miss_mini"):
            assert torch.equal(delta, got[m]) and torch.equal(got[m], expected[m]), m
        assert (delta - got[m]).abs().max() <= 4e-15 * got[m].abs().max(), m
        assert peft_path.peft_delta_source(layer, "default")


# --------------------------------------------------------------------------------------------------
# VeRA and RandLoRA saved without their shared projections (save_projection=False)
# --------------------------------------------------------------------------------------------------

# name → (base, PEFT config class, its arguments, its targets): the shared pair saved (PEFT's default), to
# compare the regenerated one with; RandLoRA's three draws (dense bfloat16, sparse, very sparse float32)
PROJECTED = {
    "vera": ("llama", "VeraConfig", {"r": 4, "projection_prng_key": 3}, ["q_proj", "v_proj", "down_proj"]),
    "vera_gpt2": ("gpt2", "VeraConfig", {"r": 4, "fan_in_fan_out": True}, ["c_attn", "c_fc"]),
    "randlora": ("llama", "RandLoraConfig", {"r": 3, "projection_prng_key": 9}, ["q_proj", "down_proj"]),
    "randlora_gpt2": ("gpt2", "RandLoraConfig", {"r": 4, "fan_in_fan_out": True}, ["c_attn", "c_fc"]),
    "randlora_sparse": ("llama", "RandLoraConfig", {"r": 4, "sparse": True}, ["q_proj", "down_proj"]),
    "randlora_very_sparse": ("llama", "RandLoraConfig", {"r": 4, "very_sparse": True}, ["q_proj", "v_proj"]),
}


def _projected(workspace: dict, name: str, save_projection: bool = True) -> torch.nn.Module:
    """PROJECTED[name] on its base in float32 (trained tensors random, seeded), a PeftModel."""
    import peft

    base_name, cls, kwargs, targets = PROJECTED[name]
    config = getattr(peft, cls)(
        target_modules=targets, init_weights=False, save_projection=save_projection, **kwargs
    )
    return _random_peft(workspace["models"][base_name], config, 13, 14)


@pytest.mark.parametrize("name", PROJECTED)
def test_regenerated_projections_equal_peft_s_bit_for_bit(workspace: dict, name: str) -> None:
    """`projections.regenerate`, from the config and the adapted weights' shapes as stored, equals the pair
    PEFT drew (saved with save_projection=True), value for value: vera_A/vera_B float32, RandLoRA's dense
    bases bfloat16, its sparse ones float32; and the loaded model passes `loaded_mismatch`."""
    from peft import get_peft_model_state_dict

    model = _projected(workspace, name)
    kind = name.split("_")[0]
    tensors = get_peft_model_state_dict(model)
    config = json.loads(json.dumps(model.peft_config["default"].to_dict(), default=str))
    base = load_file(workspace["models"][PROJECTED[name][0]] / "model.safetensors")
    modules = adapter_keys.adapter_module_keys(tensors)
    assert len(modules) >= 4
    got = projections.regenerate(kind, config, [base[f"{m}.weight"].shape for m in modules])
    assert set(got) == set(projections.KEYS[kind])
    dense = kind == "randlora" and "sparse" not in name
    for key, t in got.items():
        assert t.dtype == (torch.bfloat16 if dense else torch.float32), key
        # PEFT's buffer as it saved it, exactly the same numbers
        assert torch.equal(t.double(), tensors[key].double()), key
    assert projections.loaded_mismatch(kind, config, adapter_keys.adapted_modules(model), "default") is None
    # another key draws other numbers, which the check on a loaded model names
    shapes = [base[f"{m}.weight"].shape for m in modules]
    other = projections.regenerate(kind, {**config, "projection_prng_key": 1234}, shapes)
    loaded = {k: tensors[k] for k in other}
    assert (
        projections.matches_loaded(other, loaded)
        == f"the loaded {kind}_A differs from the one regenerated here"
    )


@pytest.fixture(scope="module")
def unsaved(workspace: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name → adapter folder: PROJECTED's VeRA and RandLoRA on the Llama, saved with save_projection=False."""
    root = tmp_path_factory.mktemp("unsaved")
    out = {}
    for name in ("vera", "randlora"):
        model = _projected(workspace, name, save_projection=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.save_pretrained(root / name)
        out[name] = root / name
    return out


def _unsaved_run(workspace: dict, unsaved: dict, home: Path, targets: tuple[str, ...], checks) -> RunRecord:
    spec = ProbeSpec(
        base=ModelRef(path=str(workspace["models"]["llama"])),
        adapters=tuple(AdapterRef(path=str(f), name=n) for n, f in unsaved.items()),
        targets=tuple(Target.parse(t) for t in targets),
        checks=tuple(checks),
        probe=ProbeInputs(batch=2, seq_len=6),
    )
    engine = Engine(home, runner=InProcessRunner())
    job = engine.submit(spec)
    assert job.wait(300) and job.state == "succeeded", job.error
    return engine.store.open(job.run_id)


def test_unsaved_projections_are_regenerated_as_peft_loads_them(workspace: dict, unsaved: dict) -> None:
    """The files hold no shared pair; `merging.adapter_files` regenerates it (sized from the base's headers)
    and it equals, bit for bit, the one PEFT regenerated when it loaded the adapter."""
    from peft import PeftModel

    for name, folder in unsaved.items():
        assert not any(
            k.startswith(f"base_model.{name}_") for k in load_file(folder / "adapter_model.safetensors")
        )
        config, tensors = merging.adapter_files(
            AdapterRef(path=str(folder), name=name), str(workspace["models"]["llama"])
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = PeftModel.from_pretrained(_load(workspace["models"]["llama"], torch.float32), str(folder))
        for key, ab in zip(projections.KEYS[name], "AB", strict=True):
            loaded = getattr(model.base_model, f"{name}_{ab}")["default"]
            assert torch.equal(tensors[key].double(), loaded.double()), key


def test_a_run_of_adapters_saved_without_projections_has_nothing_broken(
    workspace: dict, unsaved: dict, tmp_path: Path
) -> None:
    """Every check on cpu/float32 and cpu/bfloat16 runs (it used to fail the run: no reference ΔW); each
    module has its ΔW row against the regenerated pair, within tolerance on float32, nothing broken, no
    `not covered` finding."""
    from core.checks import CHECKS

    run = _unsaved_run(workspace, unsaved, tmp_path / "home", ("cpu/float32", "cpu/bfloat16"), CHECKS)
    table = run.metrics()
    assert "broken" not in set(table.verdict)
    # what the shared pair feeds: ΔW, the merges, the loaded tensors (activations and outputs compare
    # PEFT's float32 forward as for any adapter)
    float32 = table[(table.target == "cpu/float32") & table.check.isin(["deltas", "merge", "weights"])]
    assert set(float32.verdict) <= {"identical", "within tolerance"}, float32[["tensor", "verdict"]].values
    for name, folder in unsaved.items():
        modules = set(adapter_keys.adapter_module_keys(load_file(folder / "adapter_model.safetensors")))
        for target in ("cpu/float32", "cpu/bfloat16"):
            deltas = table[(table.adapter == name) & (table.check == "deltas") & (table.target == target)]
            assert set(deltas.tensor) == modules and len(deltas) == len(modules), (name, target)
            assert all(projections.REGENERATED in n for n in deltas.note), deltas.note.tolist()
            merged = table[(table.adapter == name) & (table.check == "merge") & (table.role == "merged")]
            assert {t.rsplit(":", 1)[-1] for t in merged.tensor} == modules
    for check in ("deltas", "merge"):
        findings = run.table(f"{check}_findings")
        assert "not covered" not in set(findings.finding), findings


def test_projections_peft_drew_otherwise_are_not_covered_not_broken(
    workspace: dict, unsaved: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the pair a target loaded is not the regenerated one (RandLoRA on a machine without bfloat16:
    PEFT draws its bases in float16; here the regeneration is made to draw float16 instead), the run still
    succeeds: deltas and merge give that adapter a `not covered` finding saying why and no ΔW or merged
    row; the other adapter is compared as usual."""
    monkeypatch.setattr(projections, "RANDLORA_DTYPE", torch.float16)
    run = _unsaved_run(
        workspace, unsaved, tmp_path / "home", ("cpu/float32",), ("weights", "deltas", "merge")
    )
    table = run.metrics()
    assert "broken" not in set(table.verdict)
    own = table[table.adapter == "randlora"]
    assert own[own.role.isin(["delta", "merged"])].empty
    vera = adapter_keys.adapter_module_keys(load_file(unsaved["vera"] / "adapter_model.safetensors"))
    assert set(table[(table.adapter == "vera") & (table.check == "deltas")].tensor) == set(vera)
    for check in ("deltas", "merge"):
        findings = run.table(f"{check}_findings")
        found = findings[findings.adapter == "randlora"]
        assert list(found.finding) == ["not covered"], findings
        assert "save_projection=False" in found.detail.iloc[0] and "float16" in found.detail.iloc[0]
        assert findings[findings.adapter == "vera"].empty


def test_every_family_module_keeps_the_contract_and_the_registry_derives_from_them():
    """Each family module the registry lists has what `core.methods.families` says a family holds, no adapter
    type or parameter name is claimed by two, a kind whose ΔW depends on W has its PEFT path, and the lists
    derived from them keep the order and the key rules the messages and the key split rely on."""
    kinds, params = [], []
    for family in registry.FAMILIES:
        for name in ("FORMULAS", "PARAMS", "SHARED_KEYS", "ADDITIVE", "layer_kind"):
            assert hasattr(family, name), f"{family.__name__} lacks {name}"
        assert set(family.ADDITIVE) <= set(family.FORMULAS), family.__name__
        if set(family.FORMULAS) - set(family.ADDITIVE):
            assert callable(family.peft_delta) and callable(family.peft_source), family.__name__
        kinds += family.FORMULAS
        params += family.PARAMS
    assert len(kinds) == len(set(kinds)) and len(params) == len(set(params))
    assert registry.ADAPTER_TYPES == (
        "lora", "dora", "pissa", "boft", "oft", "ia3", "loha", "lokr", "vera", "adalora", "fourierft", "shira",
        "hra", "miss", "randlora", "delora",
    )  # fmt: skip
    assert registry.FAMILY["pissa"] is lora and registry.FAMILY["adalora"] is adalora
    assert adapter_keys.adapter_type({"peft_type": "LORA", "use_dora": True}) == "dora"
    assert (
        adapter_keys.adapter_type({"peft_type": "PeftType.LORA", "init_lora_weights": "pissa_niter_4"})
        == "pissa"
    )
    assert adapter_keys.adapter_type({"peft_type": "VBLORA"}) == "vblora"
    # the bias names come after every method's own, so that LoRA's own bias on B is not read as a module's bias
    assert adapter_keys.split_adapter_key("base_model.model.a.q.lora_B.bias") == ("a.q", "lora_B.bias")
    assert adapter_keys.split_adapter_key("base_model.model.a.q.base_layer.bias") == (
        "a.q",
        "base_layer.bias",
    )
    assert adapter_keys.split_adapter_key("base_model.vera_A") is None


def test_dora_and_ia3_deltas_where_bitsandbytes_is_hidden(tmp_path: Path) -> None:
    """The GPU machines' fork server imports PEFT with bitsandbytes hidden (its import makes a CUDA
    context): a DoRA and an IA3 layer's ΔW are still taken there, as they are with it installed."""
    import subprocess
    import sys

    script = """
import sys
sys.modules["bitsandbytes"] = None  # as core.engine.worker.serve_forks does on the GPU path
import torch
from peft import IA3Config, LoraConfig, get_peft_model
from tiny_models import ARCHITECTURES
from core.methods import peft_path
from core.methods.reading import bnb_layers

assert bnb_layers("lora") == () == bnb_layers("ia3")
for config in (LoraConfig(r=4, use_dora=True, init_lora_weights=False, target_modules=["q_proj"]),
               IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"],
                         init_ia3_weights=False)):
    torch.manual_seed(0)
    model = get_peft_model(ARCHITECTURES["llama"].build(), config)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    delta = peft_path.peft_delta(layer, "default")
    assert delta.shape == layer.weight.shape and delta.abs().max() > 0, type(config).__name__
print("ok")
"""
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)])}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
