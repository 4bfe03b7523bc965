"""Reference formulas (float64, checkpoint only) against PEFT's merge and PEFT's own layer code."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import ARCHITECTURES

from core.methods import adapter_keys
from core.methods.adapter_keys import adapted_modules, adapter_type
from core.methods.families import orthogonal
from core.methods.formulas import merged_weights, reference_deltas
from core.methods.peft_path import peft_delta, peft_delta_source

# Max |merged − (W + ΔW_ref)| in float64, per method. The checks run the same float64 arithmetic
# in a different order, so they land at 0 to a few 1e-17 (measured on the demo: LoRA 0, DoRA 2.8e-17,
# BOFT 4.2e-17, OFT 3.5e-18, IA3 3.5e-18); the bounds leave room for other BLAS builds.
MERGE_TOL = {"lora": 1e-12, "dora": 1e-12, "boft": 1e-12, "oft": 1e-15, "ia3": 1e-15, "pissa_lora": 1e-12}
LLAMA_ADAPTERS = ["lora", "dora", "pissa_lora", "boft", "oft", "ia3"]


def _quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _base(path: str, dtype: torch.dtype, cls: str = "AutoModelForCausalLM") -> torch.nn.Module:
    import transformers

    _quiet_transformers()
    return getattr(transformers, cls).from_pretrained(path, dtype=dtype).eval()


def _peft(base: torch.nn.Module, adapter_path: str | Path) -> torch.nn.Module:
    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PeftModel.from_pretrained(base, str(adapter_path)).eval()


def _adapter(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json dict, adapter tensors) of a saved adapter folder."""
    path = Path(path)
    config = json.loads((path / "adapter_config.json").read_text())
    return config, load_file(path / "adapter_model.safetensors")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of ``a`` against ``b`` (both taken to float64)."""
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def llama(demo_workspace: dict) -> str:
    return demo_workspace["models"]["tiny-llama"]


@pytest.fixture(scope="module")
def base64(llama: str) -> dict[str, torch.Tensor]:
    """The tiny llama's state dict from its safetensors file, in float64."""
    return {k: v.double() for k, v in load_file(Path(llama) / "model.safetensors").items()}


def _merge_error(base_path: str, adapter_path: str | Path, base_sd: dict[str, torch.Tensor]) -> float:
    """Max |PEFT float64 merge_and_unload − (W + reference ΔW)| over all weights of the model."""
    ref = reference_deltas(*_adapter(adapter_path), base_sd)
    merged = _peft(_base(base_path, torch.float64), adapter_path).merge_and_unload().state_dict()
    assert ref and all(name + ".weight" in merged for name in ref)
    worst = 0.0
    for key, weight in base_sd.items():
        if key not in merged:  # tied lm_head is not in the file
            continue
        expected = weight + ref[key[: -len(".weight")]] if key[: -len(".weight")] in ref else weight
        worst = max(worst, (merged[key] - expected).abs().max().item())
    return worst


# --------------------------------------------------------------------------------------------------
# adapter_type
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"peft_type": "LORA", "init_lora_weights": True}, "lora"),
        ({"peft_type": "LORA", "init_lora_weights": False, "use_dora": True}, "dora"),
        ({"peft_type": "LORA", "init_lora_weights": "pissa"}, "pissa"),
        ({"peft_type": "LORA", "init_lora_weights": "pissa_niter_4"}, "pissa"),
        ({"peft_type": "LORA", "init_lora_weights": "olora"}, "lora"),
        ({"peft_type": "BOFT"}, "boft"),
        ({"peft_type": "OFT"}, "oft"),
        ({"peft_type": "IA3"}, "ia3"),
        ({"peft_type": "LOHA"}, "loha"),
    ],
)
def test_adapter_type(config: dict, expected: str) -> None:
    assert adapter_type(config) == expected


def test_adapter_type_needs_a_peft_type() -> None:
    with pytest.raises(ValueError, match="peft_type"):
        adapter_type({"r": 8})


# --------------------------------------------------------------------------------------------------
# Reference vs PEFT's float64 merge, on the demo adapters
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", LLAMA_ADAPTERS)
def test_reference_matches_float64_merge(
    name: str, demo_workspace: dict, llama: str, base64: dict[str, torch.Tensor]
) -> None:
    err = _merge_error(llama, demo_workspace["adapters"][name]["path"], base64)
    print(f"{name}: max |merge − (W + ΔW_ref)| = {err:.3g}")
    assert err <= MERGE_TOL[name]


def test_reference_matches_float64_merge_bert(demo_workspace: dict) -> None:
    bert = demo_workspace["models"]["tiny-bert"]
    path = demo_workspace["adapters"]["bert-lora"]["path"]
    base_sd = {k: v.double() for k, v in load_file(Path(bert) / "model.safetensors").items()}
    ref = reference_deltas(*_adapter(path), base_sd)
    assert sorted(ref) == [
        f"encoder.layer.{i}.attention.self.{m}" for i in range(2) for m in ("query", "value")
    ]
    merged = _peft(_base(bert, torch.float64, "AutoModel"), path).merge_and_unload().state_dict()
    err = max((merged[k + ".weight"] - base_sd[k + ".weight"] - d).abs().max().item() for k, d in ref.items())
    assert err < 1e-12


def test_reference_is_float64_on_cpu_and_covers_the_adapted_modules(
    demo_workspace: dict, llama: str, base64: dict[str, torch.Tensor]
) -> None:
    for name in LLAMA_ADAPTERS + ["pissa"]:
        path = demo_workspace["adapters"][name]["path"]
        ref = reference_deltas(*_adapter(path), base64)
        assert all(d.dtype == torch.float64 and d.device.type == "cpu" for d in ref.values())
        assert all(d.shape == base64[k + ".weight"].shape and d.abs().max() > 0 for k, d in ref.items())
        modules = adapted_modules(_peft(_base(llama, torch.float32), path))
        assert sorted(modules) == sorted(ref)
        assert all(names == ["default"] for _, names in modules.values())


# --------------------------------------------------------------------------------------------------
# PiSSA
# --------------------------------------------------------------------------------------------------


def test_pissa_refuses_float64(demo_workspace: dict, llama: str) -> None:
    with pytest.raises(TypeError, match="Please initialize PiSSA under float32"):
        _peft(_base(llama, torch.float64), demo_workspace["adapters"]["pissa"]["path"])


def test_pissa_reference_against_float32_peft(
    demo_workspace: dict, llama: str, base64: dict[str, torch.Tensor]
) -> None:
    pissa = _adapter(demo_workspace["adapters"]["pissa"]["path"])
    ref = reference_deltas(*pissa, base64)
    model = _peft(_base(llama, torch.float32), demo_workspace["adapters"]["pissa"]["path"])
    for name, (layer, _) in adapted_modules(model).items():
        assert _rel(layer.get_delta_weight("default"), ref[name]) < 1e-6
        assert _rel(peft_delta(layer, "default"), ref[name]) < 1e-6
    # merged: PEFT's float32 residual (W − top-8 SVD) + ΔW against the float64 one. PEFT's float32
    # SVD leaves ~4.6e-7 (5e-6 of max|W| = 0.093) in the residual; the bound is 10x that.
    expected = merged_weights(*pissa, base64)
    merged = model.merge_and_unload().state_dict()
    assert max((merged[k + ".weight"].double() - w).abs().max().item() for k, w in expected.items()) < 5e-6


def test_pissa_lora_conversion_and_init_agree_with_the_formula(
    demo_workspace: dict, base64: dict[str, torch.Tensor]
) -> None:
    adapters = demo_workspace["adapters"]
    pissa = merged_weights(*_adapter(adapters["pissa"]["path"]), base64)
    converted = reference_deltas(*_adapter(adapters["pissa_lora"]["path"]), base64)
    init = merged_weights(*_adapter(adapters["pissa_init"]["path"]), base64)
    assert sorted(pissa) == sorted(converted) == sorted(init)
    for name, merged in pissa.items():
        weight = base64[name + ".weight"]
        # the converted LoRA, on the untouched base, gives the trained PiSSA model (up to PEFT's fp32 SVD)
        assert (weight + converted[name] - merged).abs().max().item() < 5e-6
        # untrained PiSSA is the base itself
        assert (init[name] - weight).abs().max().item() < 5e-6


# --------------------------------------------------------------------------------------------------
# peft_delta
# --------------------------------------------------------------------------------------------------


def _peft_delta_errors(
    adapter_path: str, llama: str, base_sd: dict[str, torch.Tensor], dtype: torch.dtype
) -> tuple[float, list[str]]:
    """Worst relative error of peft_delta against the reference, and the sources used."""
    ref = reference_deltas(*_adapter(adapter_path), base_sd)
    model = _peft(_base(llama, dtype), adapter_path)
    worst, sources = 0.0, []
    for name, (layer, names) in adapted_modules(model).items():
        delta = peft_delta(layer, names[0])
        # PEFT keeps adapters in float32 on a bfloat16 model (autocast_adapter_dtype): ΔW comes in
        # the adapter's dtype, not W's
        assert delta.dtype == (torch.float32 if dtype == torch.bfloat16 else dtype)
        assert layer.get_base_layer().weight.dtype == dtype
        assert delta.device == layer.get_base_layer().weight.device
        worst = max(worst, _rel(delta, ref[name]))
        sources.append(peft_delta_source(layer, names[0]))
    return worst, sources


@pytest.mark.parametrize("name", LLAMA_ADAPTERS)
def test_peft_delta_float64_float32_bfloat16(
    name: str, demo_workspace: dict, llama: str, base64: dict[str, torch.Tensor]
) -> None:
    path = demo_workspace["adapters"][name]["path"]
    f64, sources = _peft_delta_errors(path, llama, base64, torch.float64)
    f32, _ = _peft_delta_errors(path, llama, base64, torch.float32)
    bf16, _ = _peft_delta_errors(path, llama, base64, torch.bfloat16)
    print(f"{name}: relative ΔW error float64 {f64:.2g}, float32 {f32:.2g}, bfloat16 {bf16:.2g}")
    assert f64 < 1e-13
    assert f32 < 1e-5
    kind = demo_workspace["adapters"][name]["type"]
    if kind == "lora":
        # additive ΔW = s·BA never touches W, and the adapter stays float32: float32 accuracy
        assert bf16 < 1e-5
    else:
        # multiplicative methods apply the adapter to W, which is rounded to bfloat16 (8 bits)
        assert 10 * f32 < bf16 < 0.05
    prefix = {"dora": "lora.get_delta_weight + DoraLinearLayer", "ia3": "ia3_l"}.get(kind, kind + ".")
    assert all(s.startswith(prefix) for s in sources)
    if kind == "boft":
        assert all("torch.block_diag" in s for s in sources)  # no fbd_cuda extension on a CPU build


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", LLAMA_ADAPTERS + ["pissa"])
def test_peft_delta_does_not_modify_the_layer(
    name: str, dtype: torch.dtype, demo_workspace: dict, llama: str
) -> None:
    model = _peft(_base(llama, dtype), demo_workspace["adapters"][name]["path"])
    for layer, names in adapted_modules(model).values():
        before = {k: v.clone() for k, v in layer.state_dict().items()}
        peft_delta(layer, names[0])
        after = layer.state_dict()
        assert before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
        assert layer.merged_adapters == []


def test_peft_delta_refuses_a_merged_layer(demo_workspace: dict, llama: str) -> None:
    model = _peft(_base(llama, torch.float32), demo_workspace["adapters"]["lora"]["path"])
    layer, names = next(iter(adapted_modules(model).values()))
    layer.merge()
    with pytest.raises(ValueError, match="merged"):
        peft_delta(layer, names[0])


# --------------------------------------------------------------------------------------------------
# Configurations the demo does not cover, built in memory in float64 and saved
# --------------------------------------------------------------------------------------------------


def _roundtrip(
    base: torch.nn.Module, config, folder: Path, mutate: Callable | None = None
) -> torch.nn.Module:
    """get_peft_model in float64 (seeded), optional tweak, save to ``folder``; returns the PEFT model."""
    from peft import get_peft_model

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(base, config)
    if mutate is not None:
        with torch.no_grad():
            mutate(model)
    model.save_pretrained(folder)
    return model


def _check_roundtrip(
    model: torch.nn.Module, folder: Path, base_sd: dict[str, torch.Tensor], tol: float, rel_tol: float = 1e-13
) -> None:
    """Reference from the saved files against the in-memory model's float64 peft_delta and merge."""
    ref = reference_deltas(*_adapter(folder), base_sd)
    for name, (layer, names) in adapted_modules(model).items():
        assert _rel(peft_delta(layer, names[0]), ref[name]) < rel_tol, name
    merged = model.merge_and_unload().state_dict()
    err = max((merged[k + ".weight"] - base_sd[k + ".weight"] - d).abs().max().item() for k, d in ref.items())
    assert err < tol, err


def _scale_magnitudes(model: torch.nn.Module) -> None:
    for module in model.modules():
        for dora in getattr(module, "lora_magnitude_vector", {}).values():
            dora.weight.mul_(1.05)


# PEFT computes COFT's bound eps/sqrt(#blocks) as eps / torch.sqrt(torch.tensor(8)): an integer
# tensor, so the square root is float32 even for a float64 model. The projected blocks, hence ΔW,
# are off by that rounding: measured 3.3e-8 relative (9e-12 absolute on the merged weights).
# The reference keeps the exact bound.
COFT_REL = 1e-7


@pytest.mark.parametrize(
    ("make_config", "rel_tol"),
    [
        pytest.param(
            lambda: _lora(
                rank_pattern={"q_proj": 2, "layers.1.mlp.down_proj": 6}, alpha_pattern={"v_proj": 3}
            ),
            1e-13,
            id="lora-patterns",
        ),
        pytest.param(lambda: _lora(use_rslora=True), 1e-13, id="rslora"),
        pytest.param(lambda: _lora(use_dora=True, rank_pattern={"v_proj": 2}), 1e-13, id="dora-pattern"),
        pytest.param(lambda: _oft(use_cayley_neumann=False), 1e-13, id="oft-exact-cayley"),
        pytest.param(lambda: _oft(num_cayley_neumann_terms=3), 1e-13, id="oft-neumann-3"),
        pytest.param(lambda: _oft(num_cayley_neumann_terms=8), 1e-13, id="oft-neumann-8"),
        pytest.param(lambda: _oft(block_share=True), 1e-13, id="oft-block-share"),
        pytest.param(lambda: _oft(coft=True, eps=1e-2), COFT_REL, id="oft-coft"),
        pytest.param(lambda: _oft(oft_block_size=16, use_cayley_neumann=False), 1e-13, id="oft-block-16"),
        pytest.param(lambda: _boft(boft_block_num=4, boft_block_size=0), 1e-13, id="boft-block-num"),
    ],
)
def test_reference_on_more_configurations(
    make_config: Callable, rel_tol: float, llama: str, base64, tmp_path: Path
) -> None:
    model = _roundtrip(_base(llama, torch.float64), make_config(), tmp_path, _scale_magnitudes)
    _check_roundtrip(model, tmp_path, base64, 1e-12 if rel_tol < 1e-12 else 1e-10, rel_tol)


def _lora(**kwargs):
    from peft import LoraConfig

    targets = ["q_proj", "v_proj", "down_proj"]
    return LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, **kwargs)


def _oft(**kwargs):
    from peft import OFTConfig

    kwargs.setdefault("oft_block_size", 8)
    return OFTConfig(target_modules=["q_proj", "down_proj"], init_weights=False, **kwargs)


def _boft(**kwargs):
    from peft import BOFTConfig

    return BOFTConfig(target_modules=["q_proj", "down_proj"], init_weights=False, **kwargs)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, torch.Tensor]]:
    """A tiny random GPT-2 (Conv1D layers store weights as (in, out): fan_in_fan_out)."""
    _quiet_transformers()
    torch.manual_seed(3)
    folder = tmp_path_factory.mktemp("gpt2")
    ARCHITECTURES["gpt2"].build(n_embd=32, n_layer=2).save_pretrained(folder)
    return str(folder), {k: v.double() for k, v in load_file(folder / "model.safetensors").items()}


@pytest.mark.parametrize("kind", ["lora", "dora", "ia3"])
def test_fan_in_fan_out(kind: str, gpt2, tmp_path: Path) -> None:
    from peft import IA3Config, LoraConfig

    path, base_sd = gpt2
    if kind == "ia3":
        config = IA3Config(
            target_modules=["c_attn", "mlp.c_proj"],
            feedforward_modules=["mlp.c_proj"],
            init_ia3_weights=False,
        )
    else:
        config = LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["c_attn", "c_fc"],
            fan_in_fan_out=True,
            use_dora=kind == "dora",
            init_lora_weights=False,
        )
    model = _roundtrip(_base(path, torch.float64), config, tmp_path, _scale_magnitudes)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    _check_roundtrip(model, tmp_path, base_sd, 1e-12)


@pytest.mark.parametrize("factor", [2, 3])
def test_boft_butterfly_factors_against_peft_structure(
    factor: int, llama: str, base64, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PEFT builds butterfly factors > 1 only with its CUDA extension; emulate that on the CPU.

    ``get_fbd_cuda`` is made to succeed and ``FastBlockDiag`` is replaced by a per-factor
    ``torch.block_diag``, so PEFT's own permutations and product order run and are compared with the
    reference, which reads the factor count from ``boft_R``'s shape.
    """
    from peft.tuners.boft import layer as boft_layer

    def block_diag(blocks: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.block_diag(*factor_blocks) for factor_blocks in blocks])

    monkeypatch.setattr(boft_layer, "get_fbd_cuda", lambda: object())
    monkeypatch.setattr(boft_layer.FastBlockDiag, "apply", staticmethod(block_diag))
    model = _roundtrip(
        _base(llama, torch.float64), _boft(boft_block_size=4, boft_n_butterfly_factor=factor), tmp_path
    )
    layer, names = next(iter(adapted_modules(model).values()))
    assert layer.boft_R[names[0]].shape[0] == factor
    assert "fbd_cuda" in peft_delta_source(layer, names[0])
    _check_roundtrip(model, tmp_path, base64, 1e-12)


def test_boft_without_extension_ignores_the_butterfly_factor(llama: str, tmp_path: Path) -> None:
    """Documented surprise: on a CPU build PEFT silently uses factor 1 whatever the config says."""
    model = _roundtrip(
        _base(llama, torch.float32), _boft(boft_block_size=4, boft_n_butterfly_factor=2), tmp_path
    )
    config, tensors = _adapter(tmp_path)
    assert config["boft_n_butterfly_factor"] == 2
    assert {t.shape[0] for k, t in tensors.items() if k.endswith("boft_R")} == {1}
    assert not next(iter(adapted_modules(model).values()))[0].fbd_cuda_available


def test_a_failing_fbd_cuda_build_is_attempted_once_per_machine(
    llama: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PEFT retries its failing fbd_cuda build at every BOFT layer (5.7–8.7 s per adapter load on an H200
    machine); `remember_fbd_cuda_failure` keeps the first failure in the process and, keyed, on disk.
    A build that succeeds, or a changed toolchain, is PEFT's as before."""
    from peft import get_peft_model
    from peft.tuners.boft import layer as boft_layer

    attempts: list[int] = []

    def failing_build():  # PEFT's get_fbd_cuda when the build fails: None, its cache left at None
        if boft_layer._FBD_CUDA is not None:
            return boft_layer._FBD_CUDA
        attempts.append(1)
        return None

    def as_imported() -> None:  # a new process: PEFT's module as imported
        monkeypatch.setattr(boft_layer, "_FBD_CUDA", None)
        monkeypatch.setattr(boft_layer, "get_fbd_cuda", failing_build)

    def boft_layers() -> list:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = get_peft_model(_base(llama, torch.float32), _boft(boft_block_size=4))
        return [layer for layer, _ in adapted_modules(model).values()]

    markers = tmp_path / "markers"
    as_imported()
    plain = boft_layers()
    assert len(attempts) == len(plain) == 8  # q_proj and down_proj of the demo's four layers: a build each
    attempts.clear()
    orthogonal.remember_fbd_cuda_failure(markers)
    remembered = boft_layers()
    assert len(attempts) == 1
    assert [m.name for m in markers.iterdir()] == [f"{orthogonal.fbd_cuda_build_key()}.failed"]
    assert [layer.fbd_cuda_available for layer in remembered] == [False] * 8
    shapes = [[p.shape for p in layer.boft_R.values()] for layer in plain]
    assert [[p.shape for p in layer.boft_R.values()] for layer in remembered] == shapes

    as_imported()
    orthogonal.remember_fbd_cuda_failure(markers)
    assert [layer.fbd_cuda_available for layer in boft_layers()] == [False] * 8
    assert len(attempts) == 1  # the marker: no build in this process

    as_imported()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")  # another toolchain setting: another key
    orthogonal.remember_fbd_cuda_failure(markers)
    boft_layers()
    assert len(attempts) == 2 and len(list(markers.iterdir())) == 2

    as_imported()
    blocked = tmp_path / "a-file"  # a cache that cannot hold markers: remembered in the process alone
    blocked.write_text("")
    orthogonal.remember_fbd_cuda_failure(blocked)
    assert [layer.fbd_cuda_available for layer in boft_layers()] == [False] * 8
    assert len(attempts) == 3 and blocked.read_text() == ""

    extension = object()

    def working_build():
        boft_layer._FBD_CUDA = extension
        return extension

    monkeypatch.setattr(boft_layer, "_FBD_CUDA", None)
    monkeypatch.setattr(boft_layer, "get_fbd_cuda", working_build)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    orthogonal.remember_fbd_cuda_failure(markers)
    assert boft_layer.get_fbd_cuda() is extension and boft_layer.get_fbd_cuda() is extension
    assert len(list(markers.iterdir())) == 2


# --------------------------------------------------------------------------------------------------
# OFT rotation quirks, against PEFT's own function
# --------------------------------------------------------------------------------------------------


def test_oft_rotation_matches_peft_and_its_quirks() -> None:
    from peft.tuners.oft.layer import OFTRotationModule

    size, blocks = 6, 3
    module = OFTRotationModule(blocks, size * (size - 1) // 2, size, size * blocks).double()
    gen = torch.Generator().manual_seed(0)
    vec = 0.02 * torch.randn(blocks, size * (size - 1) // 2, generator=gen, dtype=torch.float64)
    skew = orthogonal.skew_from_upper(vec, size)
    for terms in range(1, 9):
        ours = orthogonal.oft_rotation(skew, True, terms)
        theirs = module._cayley_batch(vec, size, True, terms)
        assert torch.allclose(ours, theirs, rtol=0, atol=1e-15), terms
    exact = orthogonal.oft_rotation(skew, False, 0)
    assert torch.allclose(exact, module._cayley_batch(vec, size, False, 5), rtol=0, atol=1e-15)
    neumann = orthogonal.oft_rotation(skew, True, 8)
    # Neumann approximates (I + Q)(I − Q)^-1 = exactᵀ: the two settings rotate opposite ways
    towards, against = (neumann - exact.mT).abs().max().item(), (neumann - exact).abs().max().item()
    assert towards < 1e-6 and against > 0.01, (towards, against)
    # three and four terms are the same series in PEFT 0.21
    assert torch.equal(orthogonal.oft_rotation(skew, True, 3), orthogonal.oft_rotation(skew, True, 4))


def test_peft_get_delta_weight_mutates_coft_weights_but_peft_delta_does_not(
    llama: str, tmp_path: Path
) -> None:
    model = _roundtrip(_base(llama, torch.float32), _oft(coft=True, eps=1e-3), tmp_path)
    layer, names = next(iter(adapted_modules(model).values()))
    saved = layer.oft_R[names[0]].weight.detach().clone()
    peft_delta(layer, names[0])
    assert torch.equal(layer.oft_R[names[0]].weight, saved)
    with torch.no_grad():
        layer.get_delta_weight(names[0])  # PEFT projects and writes the projection back
    assert not torch.equal(layer.oft_R[names[0]].weight, saved)


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------


def test_adapter_for_a_different_base_is_a_clear_error(demo_workspace: dict, base64) -> None:
    config, tensors = _adapter(demo_workspace["adapters"]["bert-lora"]["path"])
    with pytest.raises(ValueError, match=r"encoder\.layer\.0\.attention\.self\.query.*different base model"):
        reference_deltas(config, tensors, base64)


@pytest.mark.parametrize("name", ["lora", "dora", "boft", "oft", "ia3"])
def test_shape_mismatch_is_a_clear_error(name: str, demo_workspace: dict, base64) -> None:
    config, tensors = _adapter(demo_workspace["adapters"][name]["path"])
    module = next(iter(adapter_keys.adapter_module_keys(tensors)))
    wrong = dict(base64)
    wrong[module + ".weight"] = torch.zeros(48, 48, dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"{module}.*(shape|in_features)"):
        reference_deltas(config, tensors, wrong)


def test_missing_tensor_and_unknown_keys_are_clear_errors(demo_workspace: dict, base64) -> None:
    config, tensors = _adapter(demo_workspace["adapters"]["dora"]["path"])
    key = next(k for k in tensors if k.endswith("lora_magnitude_vector"))
    with pytest.raises(ValueError, match=r"lacks 'lora_magnitude_vector'"):
        reference_deltas(config, {k: v for k, v in tensors.items() if k != key}, base64)
    extra = dict(tensors, **{"base_model.model.lm_head.modules_to_save.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="modules_to_save"):
        reference_deltas(config, extra, base64)
    with pytest.raises(ValueError, match="not supported"):
        reference_deltas(dict(config, peft_type="C3A"), tensors, base64)


def test_adapter_module_keys() -> None:
    tensors = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(1),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(1),
        "model.layers.1.mlp.down_proj.ia3_l": torch.zeros(1),
    }
    keys = adapter_keys.adapter_module_keys(tensors)
    assert list(keys) == ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    assert keys["model.layers.0.self_attn.q_proj"].keys == {
        "lora_A.weight": "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "lora_B.weight": "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
    }
