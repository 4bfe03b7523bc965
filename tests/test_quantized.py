"""Quantized bases as targets (issue 26): `cpu/nf4`, `cpu/fp4`, `cpu/int8` and the 4-bit formats `+portable`
on a tiny Llama with a LoRA, through the engine (in process) with weights, deltas, outputs and merge; their
logits and NF4's merge against transformers + bitsandbytes + PEFT called here directly, bit for bit. On a
CPU with AVX512-BF16 (issue 35) `cpu/nf4` runs bitsandbytes' default there, its fused kernel, and `+portable`
the path every other CPU runs."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tiny_models import save_with_lora

from core.capture import Capture
from core.engine.jobs import Engine, next_best_reference
from core.engine.runners import InProcessRunner
from core.engine.store import RunRecord
from core.models.targets import Device, check_targets_exist
from core.spec import (
    QUANTIZED_FORMATS,
    REFERENCE_TARGET,
    AdapterRef,
    ModelRef,
    ProbeInputs,
    ProbeSpec,
    SpecError,
    Target,
    peer_of,
)

# bitsandbytes repacks a 4-bit weight for its fused kernel on a CPU with AVX512-BF16 (its default there,
# docs/quantized.md) and asserts that its out_features divide by 32: the test model's every quantized
# layer's do (the family's tiny 16 and 8 do not)
SIZES = {"hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}
FORMATS = QUANTIZED_FORMATS  # every format a target can name is run here (README's table says so)
# each format with bitsandbytes' defaults, and the 4-bit ones on the portable CPU path
TARGETS = (*(f"cpu/{f}" for f in FORMATS), "cpu/nf4+portable", "cpu/fp4+portable")
FUSED = pytest.mark.skipif(
    not __import__("bitsandbytes.functional").functional.has_avx512bf16(),
    reason="this CPU lacks AVX512-BF16: bitsandbytes' fused 4-bit kernel, and its repacking, never run here",
)
IDS = ((3, 17, 42, 5, 60, 8), (1, 2, 33, 48, 9, 27))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunRecord, Path, Path]:
    """One run of the three formats (and the 4-bit ones +portable) with the four checks on a tiny Llama and its
    LoRA (q_proj, v_proj)."""
    root = tmp_path_factory.mktemp("quantized")
    model, adapter = save_with_lora("llama", root, seed=3, **SIZES)
    spec = ProbeSpec(
        base=ModelRef(path=str(model)),
        adapters=(AdapterRef(path=str(adapter), name="lora"),),
        targets=tuple(Target.parse(t) for t in TARGETS),
        checks=("weights", "deltas", "outputs", "merge"),
        probe=ProbeInputs(input_ids=IDS),
    )
    engine = Engine(root / "home", runner=InProcessRunner())
    job = engine.submit(spec)
    assert job.wait(600) and job.state == "succeeded", job.error
    return engine.store.open(job.run_id), model, adapter


def _bnb(fmt: str):
    """The target's meaning, written out: bitsandbytes' config with its defaults."""
    from transformers import BitsAndBytesConfig

    if fmt == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=fmt)


def _fresh(model: Path, target: str):
    """`target`'s model as a user's script loads it: bitsandbytes' defaults; `+portable`, its fused 4-bit
    CPU kernel turned off on every 4-bit layer (what WeightDrift did on every CPU before issue 35)."""
    from transformers import AutoModelForCausalLM

    fmt, _, flag = target.removeprefix("cpu/").partition("+")
    m = AutoModelForCausalLM.from_pretrained(model, quantization_config=_bnb(fmt), device_map="cpu").eval()
    if flag == "portable":
        for layer in m.modules():
            if hasattr(layer, "support_avx512bf16_for_cpu"):
                layer.support_avx512bf16_for_cpu = False
    return m


def _logits(m) -> torch.Tensor:
    ids = torch.tensor(IDS)
    with torch.no_grad():
        return m(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def _capture(record: RunRecord, target: str) -> Capture:
    return Capture.load(record.run_dir / "captures" / Target.parse(target).slug)


def test_target_strings() -> None:
    t = Target.parse("cuda:1/nf4+compute=bf16+double_quant")
    assert (t.dtype, t.compute, t.double_quant, t.quantized, t.float_dtype) == (
        "nf4",
        "bfloat16",
        True,
        True,
        "bfloat16",
    )
    assert str(t) == "cuda:1/nf4+compute=bfloat16+double_quant" and Target.parse(str(t)) == t
    assert Target.parse("cpu/int8").float_dtype == "float32"
    portable = Target.parse("cpu/fp4+double_quant+portable")
    assert (
        portable.portable
        and str(portable) == "cpu/fp4+double_quant+portable"
        and portable.label == ("cpu·fp4·dq·portable")
    )
    assert not Target.parse("cpu/nf4").portable
    for bad, says in (
        (
            "cpu/int8+portable",
            "turns off bitsandbytes' fused 4-bit CPU kernel and applies to nf4 and fp4 only",
        ),
        ("cpu/nf4+portable=1", "double_quant or portable"),
        ("cpu/int8+double_quant", "applies to nf4 and fp4 only"),
        ("cpu/float32+compute=bfloat16", "applies to nf4 and fp4 only"),
        ("cpu/nf4+compute=float64", "compute=bfloat16|float16|float32"),
        ("cpu/nf3", "nf4, fp4, int8"),
    ):
        with pytest.raises(SpecError, match=says):
            Target.parse(bad)
    devices = [Device("cpu", "cpu", "a CPU"), Device("cuda:0", "cuda", "a GPU")]
    check_targets_exist([Target.parse("cpu/nf4+portable")], devices)
    with pytest.raises(SpecError, match=r"portable applies to the CPU only"):
        check_targets_exist([Target.parse("cuda:0/nf4+portable")], devices)


def test_a_quantized_targets_peer_is_its_format_on_the_cpu() -> None:
    for text in (
        "cuda:0/nf4+compute=bfloat16+double_quant",
        "cuda:1/int8",
        "cpu/fp4+compute=float16",
        "cpu/nf4+portable",  # judged against bitsandbytes' default path on this CPU
    ):
        t = Target.parse(text)
        assert peer_of(t, (t,), REFERENCE_TARGET) == Target(device="cpu", dtype=t.dtype)
    spec = ProbeSpec(base=ModelRef("m"), adapters=(), targets=(Target.parse("cpu/nf4+portable"),))
    assert spec.with_peers().added_peers == (Target.parse("cpu/nf4"),)


def test_a_quantized_target_never_stands_in_for_the_reference() -> None:
    def spec(*targets: str) -> ProbeSpec:
        return ProbeSpec(base=ModelRef("m"), adapters=(), targets=tuple(Target.parse(t) for t in targets))

    assert next_best_reference(spec("cpu/nf4", "cpu/bfloat16", "cpu/int8")) == Target.parse("cpu/bfloat16")
    assert next_best_reference(spec("cpu/nf4", "cuda:0/int8")) is None


def test_every_format_runs_every_check(run) -> None:
    from bitsandbytes.functional import has_avx512bf16

    from core.checks.merge.tables import REPACKED_MERGE

    record, _, _ = run
    table = record.metrics()
    for text in TARGETS:
        target = Target.parse(text)
        fmt = target.dtype
        rows = table[table["target"] == text]
        assert set(rows["check"]) == {"weights", "deltas", "outputs", "merge"}, fmt
        broken = rows[rows["verdict"] == "broken"]
        if fmt != "int8" and not target.portable and has_avx512bf16():
            # a merge after the fused kernel repacked the weights: the finding of the test below, alone
            assert set(broken["check"]) == {"merge"}, broken[["check", "tensor"]]
            broken = broken[~broken["explanation"].str.contains(REPACKED_MERGE, regex=False)]
        assert broken.empty, broken[["tensor", "explanation"]]
        # each quantized weight is dequantized, compared with the file and named for its format
        q = rows[(rows["check"] == "weights") & rows["tensor"].str.contains(r"_proj\.weight$")]
        assert len(q) == 7 and (q["verdict"] == "drift").all() and (q["dtype"] == "float32").all()
        block = "LLM.int8" if fmt == "int8" else f"{fmt} (bitsandbytes), block size 64"
        assert q["note"].str.contains(block, regex=False).all(), q["note"].iloc[0]
        # the norms and embeddings are not quantized: the file's values, bit for bit
        others = rows[(rows["check"] == "weights") & ~rows["tensor"].str.contains("_proj")]
        assert (others["verdict"] == "identical").all()


@pytest.mark.parametrize("target", TARGETS)
def test_logits_are_those_of_transformers_and_bitsandbytes(run, target: str) -> None:
    """`cpu/nf4` is the user's script with bitsandbytes' defaults (on this CPU the fused kernel where it has
    AVX512-BF16), `cpu/nf4+portable` that script with `support_avx512bf16_for_cpu=False`: bit for bit."""
    from peft import PeftModel

    record, model, adapter = run
    capture = _capture(record, target)
    base = _fresh(model, target)
    assert torch.equal(capture.tensors["outputs::-::logits"], _logits(base))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = PeftModel.from_pretrained(_fresh(model, target), adapter, adapter_name="lora").eval()
    assert torch.equal(capture.tensors["outputs::lora::logits"], _logits(peft_model))


@FUSED
def test_the_default_4bit_path_on_this_cpu_is_the_fused_kernel_and_portable_is_not(run) -> None:
    """Where the CPU has AVX512-BF16, `cpu/nf4` and `cpu/nf4+portable` are two computations (the fused kernel
    multiplies in bfloat16), each named in a note; the test above pins each to the user's script."""
    from core.models.targets import FUSED_4BIT_NOTE, PORTABLE_4BIT_NOTE

    record, _, _ = run
    for fmt in ("nf4", "fp4"):
        default, portable = _capture(record, f"cpu/{fmt}"), _capture(record, f"cpu/{fmt}+portable")
        assert not torch.equal(default.tensors["outputs::-::logits"], portable.tensors["outputs::-::logits"])
        assert any(FUSED_4BIT_NOTE in n for n in default.notes), default.notes
        assert any(PORTABLE_4BIT_NOTE in n for n in portable.notes), portable.notes


def test_nf4_merge_is_peft_merge_and_unload_on_a_fresh_4bit_model(run) -> None:
    from peft import PeftModel
    from peft.utils.integrations import dequantize_bnb_weight

    record, model, adapter = run
    capture = _capture(record, "cpu/nf4+portable")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        merged = PeftModel.from_pretrained(
            _fresh(model, "cpu/nf4+portable"), adapter, adapter_name="lora"
        ).merge_and_unload()
    assert torch.equal(capture.tensors["merge::lora::output:merge_and_unload:logits"], _logits(merged))
    table = record.metrics()
    rows = table[
        (table["target"] == "cpu/nf4+portable") & (table["check"] == "merge") & (table["role"] == "merged")
    ]
    assert set(rows["stage"]) == {"merge_adapter", "safe_merge"} and len(rows) == 4
    for module in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"):
        mine = dequantize_bnb_weight(merged.get_submodule(module).weight)
        for stage in ("merge_adapter", "safe_merge"):
            assert torch.equal(capture.tensors[f"merge::lora::merged:{stage}:{module}"], mine), (
                module,
                stage,
            )
    # merging moved the outputs of the 4-bit model by far more than float32 rounding
    out = table[
        (table["target"] == "cpu/nf4+portable")
        & (table["role"] == "output")
        & (table["stage"] == "merge_and_unload")
    ]
    against_unmerged = out[out["reference"] == "unmerged (cpu/nf4+portable)"]
    assert float(against_unmerged["max_abs"].iloc[0]) == float(
        (_logits(merged) - _unmerged(model, adapter)).abs().max()
    )


@FUSED
def test_a_merge_into_weights_the_fused_kernel_repacked_is_a_finding(run) -> None:
    """On bitsandbytes' default path on this CPU, the merge check merges as a user's script does after a
    forward: PEFT reads the repacked 4-bit weights as the plain layout. Its outputs are that script's, bit for
    bit; its merged weights, read from the layout they are in, are far from W + ΔW; the rows and a finding
    say why, and the same merge on `+portable` moves the outputs by the merge's own effect alone."""
    from peft import PeftModel

    from core.checks.merge.tables import REPACKED_MERGE

    record, model, adapter = run
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = PeftModel.from_pretrained(_fresh(model, "cpu/nf4"), adapter, adapter_name="lora").eval()
        unmerged = _logits(peft_model)  # the first forward: bitsandbytes repacks each 4-bit weight
        merged = _logits(peft_model.merge_and_unload())
    capture = _capture(record, "cpu/nf4")
    assert torch.equal(capture.tensors["merge::lora::output:unmerged:logits"], unmerged)
    assert torch.equal(capture.tensors["merge::lora::output:merge_and_unload:logits"], merged)
    moved = float((merged.double() - unmerged.double()).abs().max())
    info = capture.meta["merge"]["adapters"]["lora"]
    modules = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]
    assert info["repacked"] == modules and info["repacked_moved"] == moved

    findings = record.table("merge_findings")
    said = findings[(findings["target"] == "cpu/nf4") & (findings["finding"] == "repacked")]
    assert list(said["detail"]) == [
        "on this CPU (AVX512-BF16) bitsandbytes' default fused 4-bit kernel repacked the weights of 2 adapted "
        "modules at the first forward, and PEFT's merge read them as the plain layout, so the merged weights "
        f"are not W + ΔW: merge_and_unload() moved the outputs by {moved:.3g} (max |Δ| against unmerged); "
        "merged before any forward, or on the target +portable, they are"
    ]
    assert findings[findings["finding"] == "repacked"]["target"].tolist() == ["cpu/nf4", "cpu/fp4"]

    table = record.metrics()
    merge = table[table["check"] == "merge"]
    for target, broken in (("cpu/nf4", True), ("cpu/nf4+portable", False)):
        rows = merge[(merge["target"] == target) & merge["role"].isin(["merged", "roundtrip"])]
        assert len(rows) == 6 and (rows["verdict"] == "broken").all() == broken, rows[["tensor", "verdict"]]
        assert rows["explanation"].fillna("").str.contains(REPACKED_MERGE, regex=False).all() == broken
    # the merged weights against W + ΔW in float64: several times the 4-bit format's own error on +portable
    rel = merge[merge["role"] == "merged"].groupby("target")["rel_l2"].max()
    assert rel["cpu/nf4"] > 3 * rel["cpu/nf4+portable"], rel
    # what the merge moves: on +portable its own effect, on the default path several times that
    out = merge[(merge["stage"] == "merge_and_unload") & merge["reference"].str.startswith("unmerged")]
    by_target = dict(zip(out["target"], out["max_abs"], strict=True))
    assert by_target["cpu/nf4"] == moved and by_target["cpu/nf4"] > 3 * by_target["cpu/nf4+portable"]


def test_a_repacked_4bit_weight_is_read_from_its_layout(tmp_path: Path) -> None:
    """`dequantize` of a weight bitsandbytes repacked at a forward: its codes times its block scales rounded
    to bfloat16, in row order (a row of 128 inputs has two blocks of 64), bit for bit; before the forward
    the plain weight, as PEFT reads it. Without AVX512-BF16 nothing is repacked and it stays the plain one."""
    import copy

    from bitsandbytes.functional import dequantize_4bit

    from core.models.targets import dequantize, repacked

    model, _ = save_with_lora("llama", tmp_path, seed=5, **{**SIZES, "intermediate_size": 128})
    base = _fresh(model, "cpu/nf4")
    layer = base.get_submodule("model.layers.0.mlp.down_proj")
    state = copy.deepcopy(layer.weight.quant_state)
    data = layer.weight.data.clone()
    plain = dequantize(layer)
    assert not repacked(layer) and torch.equal(plain, dequantize_4bit(data, state))
    _logits(base)
    state.absmax = state.absmax.to(torch.bfloat16).to(torch.float32)
    expected = dequantize_4bit(data, state)
    if not __import__("bitsandbytes.functional").functional.has_avx512bf16():
        assert not repacked(layer) and torch.equal(dequantize(layer), plain)
        return
    assert repacked(layer) and torch.equal(dequantize(layer), expected)
    assert repacked(layer)  # reading it left the layer's layout alone


def _unmerged(model: Path, adapter: Path) -> torch.Tensor:
    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _logits(
            PeftModel.from_pretrained(_fresh(model, "cpu/nf4+portable"), adapter, adapter_name="lora").eval()
        )


@pytest.fixture(scope="module")
def scenario_run(demo_workspace: dict, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, RunRecord]:
    """The `qlora-served-elsewhere` scenario's run on the demo workspace, in a home of its own."""
    from core.demo.scenarios import scenario_spec

    home = tmp_path_factory.mktemp("qlora-home")
    engine = Engine(home, runner=InProcessRunner())
    job = engine.submit(scenario_spec("qlora-served-elsewhere", demo_workspace, engine.devices))
    assert job.wait(600) and job.state == "succeeded", job.error
    return home, engine.store.open(job.run_id)


def test_served_elsewhere_scenario_says_how_far_the_outputs_move(scenario_run) -> None:
    from core import report

    _, record = scenario_run
    pairs = record.table("pairwise")
    sentences = report.served_elsewhere(pairs)
    assert len(sentences) == 2
    for served, sentence in zip(("cpu/bfloat16", "cpu/float32"), sorted(sentences), strict=True):
        row = pairs[
            (pairs["check"] == "outputs")
            & (pairs["adapter"] == "lora")
            & ({*pairs["target"], *pairs["other"]} >= {served})
            & (pairs["target"].isin([served, "cpu/nf4"]))
            & (pairs["other"].isin([served, "cpu/nf4"]))
        ]
        assert len(row) == 1
        max_abs, rel = float(row["max_abs"].iloc[0]), float(row["rel_l2"].iloc[0])
        assert max_abs > 0
        assert sentence == (
            f"lora served on {served} instead of cpu/nf4: its logits move by {max_abs:.3g} (max |Δ|, relative "
            f"L2 {rel:.3g}) from what the nf4 model gives"
        )
    # merge_and_unload into the 4-bit base, beside the float bases: the merge rows of every target
    table = record.metrics()
    merged = table[(table["check"] == "merge") & (table["stage"] == "merge_and_unload")]
    assert {"cpu/nf4", "cpu/bfloat16", "cpu/float32"} <= set(merged["target"])


def test_merge_page_shows_the_finding(scenario_run, monkeypatch: pytest.MonkeyPatch) -> None:
    from apptest import make_app, shown

    from core import report

    home, record = scenario_run
    at = make_app(home, monkeypatch, run=record.run_id)
    at.switch_page("views/merge.py").run()
    assert not at.exception, [e.value for e in at.exception]
    infos = [shown(e) for e in at.info]
    for sentence in report.served_elsewhere(record.table("pairwise")):
        assert any(sentence in s for s in infos), (sentence, infos)
    assert any(b.label.startswith("QLoRA served on bfloat16 and float32") for b in at.button)


def _repacked_scenario(demo_workspace: dict, home: Path) -> RunRecord:
    from core.demo.scenarios import scenario_spec

    engine = Engine(home, runner=InProcessRunner())
    job = engine.submit(scenario_spec("qlora-merge-repacked", demo_workspace, engine.devices))
    assert job.wait(600) and job.state == "succeeded", job.error
    return engine.store.open(job.run_id)


def _moved(record: RunRecord) -> dict[str, float]:
    """merge_and_unload()'s max |Δ| against unmerged, per target."""
    table = record.metrics()
    out = table[
        (table["check"] == "merge")
        & (table["stage"] == "merge_and_unload")
        & table["reference"].str.startswith("unmerged")
    ]
    return dict(zip(out["target"], out["max_abs"], strict=True))


@FUSED
def test_repacked_merge_scenario_shows_the_finding_in_one_click(
    demo_workspace: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`qlora-merge-repacked` on this CPU: the merge check's finding on `cpu/nf4` alone, said on the Merge
    page, and a merge that moves the outputs more than twice as far as the same merge on `+portable`."""
    from apptest import make_app, no_exceptions

    from core.checks.merge.tables import repacked_finding

    record = _repacked_scenario(demo_workspace, tmp_path)
    findings = record.table("merge_findings")
    said = findings[findings["finding"] == "repacked"]
    assert said["target"].tolist() == ["cpu/nf4"]
    info = Capture.load(record.run_dir / "captures" / "cpu_nf4").meta["merge"]["adapters"]["lora"]
    assert said["detail"].tolist() == [repacked_finding(info)]
    moved = _moved(record)
    assert moved["cpu/nf4"] == info["repacked_moved"] > 2 * moved["cpu/nf4+portable"], moved

    at = make_app(tmp_path, monkeypatch, run=record.run_id)
    at.switch_page("views/merge.py").run()
    no_exceptions(at)
    assert any(e.value == repacked_finding(info) for e in at.text), [e.value for e in at.text]
    assert any("repacked for its fused CPU kernel" in str(e.value) for e in at.error)


def test_repacked_merge_scenario_on_a_cpu_without_avx512_bf16_says_it_lacks_it(
    demo_workspace: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the CPU lacks AVX512-BF16 (here bitsandbytes is told so), both targets run the portable path: the
    same outputs bit for bit, no finding, and a note on each saying the CPU lacks it."""
    import bitsandbytes.nn.modules

    from core.models.targets import NO_FUSED_4BIT_NOTE

    monkeypatch.setattr(bitsandbytes.nn.modules, "has_avx512bf16", lambda: False)
    record = _repacked_scenario(demo_workspace, tmp_path)
    findings = record.table("merge_findings")
    assert "repacked" not in set(findings["finding"])
    default, portable = (
        Capture.load(record.run_dir / "captures" / s) for s in ("cpu_nf4", "cpu_nf4_portable")
    )
    for capture in (default, portable):
        assert any(NO_FUSED_4BIT_NOTE in n for n in capture.notes), capture.notes
    for key, tensor in default.tensors.items():
        if key.startswith("merge::lora::output:"):
            assert torch.equal(tensor, portable.tensors[key]), key
    moved = _moved(record)
    assert moved["cpu/nf4"] == moved["cpu/nf4+portable"] > 0


def test_the_form_builds_a_portable_target(demo_workspace: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The target builder offers +portable for a 4-bit format on the CPU, and only there."""
    from apptest import make_app, no_exceptions

    home = Path(demo_workspace["models"]["tiny-llama"]).parents[2]  # the demo is there already
    at = make_app(home, monkeypatch)
    at.run()
    no_exceptions(at)
    assert at.sidebar.toggle(key="form.new.portable").disabled  # cpu/float32 first
    at.sidebar.selectbox(key="form.new.dtype").set_value("nf4").run()
    at.sidebar.toggle(key="form.new.portable").set_value(True).run()
    at.sidebar.button(key="form.new.add").click().run()
    no_exceptions(at)
    assert "cpu/nf4+portable" in at.session_state["form.targets"]


def test_memory_placement_of_a_4bit_base_holds_its_packed_weights(tmp_path: Path) -> None:
    """The memory check on `cpu/nf4`: every stage sampled, and the placement map names each quantized
    weight as bitsandbytes holds it (4-bit values packed two to a uint8 byte), the adapter in float32."""
    model, adapter = save_with_lora("llama", tmp_path, seed=3, **SIZES)
    spec = ProbeSpec(
        base=ModelRef(path=str(model)),
        adapters=(AdapterRef(path=str(adapter), name="lora"),),
        targets=(Target.parse("cpu/nf4"),),
        checks=("memory",),
        probe=ProbeInputs(input_ids=IDS),
    )
    engine = Engine(tmp_path / "home", runner=InProcessRunner())
    job = engine.submit(spec)
    assert job.wait(300) and job.state == "succeeded", job.error
    record = engine.store.open(job.run_id)
    placement, timeline = record.table("placement"), record.table("memory_timeline")
    assert {"base loaded", "adapter lora loaded", "first forward"} <= set(timeline["stage"])
    q = placement[placement["name"].str.endswith("layers.0.self_attn.q_proj.base_layer.weight")].iloc[0]
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        saved = f.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape()
    assert q["dtype"] == "uint8" and q["device"] == "cpu"
    assert q["bytes"] == q["numel"] and 2 * q["numel"] == saved[0] * saved[1]  # two 4-bit values a byte
    lora_a = placement[(placement["role"] == "lora_A") & (placement["adapter"] == "lora")]
    assert len(lora_a) and set(lora_a["dtype"]) == {"float32"}


# QLoRA's other methods on the same base: QDoRA and IA3, and PiSSA, which PEFT will not initialise on a
# 4-bit or 8-bit base (it takes an SVD of W and rewrites it) — placed between them, so the run shows the
# adapters after a refused one still loading.
QUANTIZED_METHODS = ("dora", "pissa", "ia3")
LLAMA_MODULES = {"attention": ("q_proj", "v_proj"), "feedforward": "down_proj"}
METHOD_TARGETS = ("cpu/nf4", "cpu/int8")


@pytest.fixture(scope="module")
def methods_run(run, tmp_path_factory: pytest.TempPathFactory) -> tuple[RunRecord, Path, dict[str, Path]]:
    from tiny_models import save_method

    _, model, _ = run
    root = tmp_path_factory.mktemp("quantized-methods")
    folders = {
        m: save_method("llama", m, model, root, seed, modules=LLAMA_MODULES, task_type="CAUSAL_LM")
        for seed, m in enumerate(QUANTIZED_METHODS)
    }
    spec = ProbeSpec(
        base=ModelRef(path=str(model)),
        adapters=tuple(AdapterRef(path=str(f), name=m) for m, f in folders.items()),
        targets=tuple(Target.parse(t) for t in METHOD_TARGETS),
        checks=("weights", "deltas", "outputs", "adapters"),
        strategies=("isolated", "load_adapter"),
        probe=ProbeInputs(input_ids=IDS),
    )
    engine = Engine(tmp_path_factory.mktemp("quantized-methods-home"), runner=InProcessRunner())
    job = engine.submit(spec)
    assert job.wait(600) and job.state == "succeeded", job.error
    return engine.store.open(job.run_id), model, folders


def test_an_adapter_peft_refuses_on_a_quantized_base_is_a_broken_row_not_a_failed_run(methods_run) -> None:
    from core.checks.base import CAPTURE_FAILED, NOT_LOADED

    record, _, _ = methods_run
    table = record.metrics()
    for target in METHOD_TARGETS:
        rows = table[table["target"] == target]
        refused = rows[rows["adapter"] == "pissa"]
        # weights, deltas and outputs: one row each, saying what PEFT said
        shared = refused[refused["check"] != "adapters"]
        assert sorted(shared["check"]) == ["deltas", "outputs", "weights"], shared[["check", "tensor"]]
        assert (shared["tensor"] == NOT_LOADED).all() and (shared["verdict"] == "broken").all()
        assert shared["explanation"].str.contains("Please initialize PiSSA under float32", regex=False).all()
        # the adapters on either side of it are measured
        others = rows[rows["adapter"].isin(["dora", "ia3"]) & (rows["check"] != "adapters")]
        assert {(c, a) for c, a in zip(others["check"], others["adapter"], strict=True)} == {
            (c, a) for c in ("weights", "deltas", "outputs") for a in ("dora", "ia3")
        }
        broken = others[others["verdict"] == "broken"]
        if target == "cpu/nf4":
            assert broken.empty, broken["explanation"]
        else:
            # QDoRA on int8 on the CPU: PEFT's DoRA forward puts the 8-bit weight back with `.to()` once its
            # layer has run (the bare base's forward, here), without its scales, and bitsandbytes then fails
            # (PEFT 0.21.2, bitsandbytes 0.50.2): a row says so, and DoRA's weights and ΔW are still measured
            assert list(zip(broken["check"], broken["adapter"], broken["tensor"], strict=True)) == [
                ("outputs", "dora", CAPTURE_FAILED)
            ]
            assert "(raised in bitsandbytes/" in broken["explanation"].iloc[0], broken["explanation"].iloc[0]
        # the adapters check: `load_adapter` in a loop stops at PiSSA as the user's loop would, and says why
        loop = rows[(rows["check"] == "adapters") & (rows["strategy"] == "load_adapter")]
        said = loop[loop["adapter"] == "pissa"]["explanation"]
        assert len(said) == 1 and "Please initialize PiSSA" in said.iloc[0], said
    # on the float64 reference PiSSA loads (in float32, upcast): only the quantized targets lack it
    assert set(table[(table["adapter"] == "pissa") & (table["verdict"] == "broken")]["target"]) == set(
        METHOD_TARGETS
    )


@pytest.mark.parametrize("target", METHOD_TARGETS)
def test_qdora_delta_on_a_quantized_base_is_peft_merge_of_the_dequantized_weight(
    methods_run, target: str
) -> None:
    """ΔW of DoRA on a bitsandbytes layer: PEFT's own DoRA merge (`merge_safe`) of the dequantized W,
    minus that W, bit for bit; and IA3's scaling of the dequantized W."""
    from peft import PeftModel
    from peft.utils.integrations import dequantize_module_weight

    record, model, folders = methods_run
    capture = _capture(record, target)
    for name in ("dora", "ia3"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft_model = PeftModel.from_pretrained(
                _fresh(model, target), folders[name], adapter_name=name
            ).eval()
        for module in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"):
            layer = peft_model.base_model.model.get_submodule(module)
            if name not in getattr(layer, "lora_A", getattr(layer, "ia3_l", {})):
                continue
            w = dequantize_module_weight(layer.get_base_layer())
            with torch.no_grad():
                if name == "dora":
                    expected = layer.lora_variant[name].merge_safe(layer, name, w.clone()) - w
                else:  # feedforward: IA3 scales the inputs, W's columns; otherwise its outputs, W's rows
                    scale = layer.ia3_l[name].detach()
                    expected = w * scale - w
            mine = capture.tensors[f"deltas::{name}::{module}"]
            assert torch.equal(mine, expected), (name, module, (mine - expected).abs().max())


def test_the_pages_say_which_adapter_peft_refused(methods_run, monkeypatch: pytest.MonkeyPatch) -> None:
    from apptest import make_app, no_exceptions, shown, texts

    record, _, _ = methods_run
    home = record.run_dir.parent.parent
    for page in ("views/overview.py", "views/drift.py"):
        at = make_app(home, monkeypatch, run=record.run_id)
        at.switch_page(page).run()
        no_exceptions(at)
        # the Overview's broken rows; the Drift page opens on its worst row (PiSSA's on nf4, or on int8)
        assert "Please initialize PiSSA" in texts(at), texts(at)
    captions = [shown(c) for c in at.caption]
    assert any("colour: log₁₀ relative L2 · symbols" in c for c in captions), captions
    assert not any("{" in c for c in captions), captions  # every placeholder filled in
