"""The `activations` check: a perturbed module is found as the first divergence, its numbers equal an
independent computation (plain torch hooks + core.numerics.metrics.compare) on the demo's Llama, a tiny T5,
ALBERT and the packaged all-MiniLM-L6-v2 with a LoRA, the figure builders, and the Activations page under AppTest. In-process runner, tiny models."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from core.checks.activations import (
    ACCUMULATED,
    LOCAL_DRIFT,
    ActivationsCheck,
    first_divergences,
    first_tensor,
    module_role,
)
from core.engine.jobs import Engine
from core.engine.runners import InProcessRunner
from core.numerics import metrics
from core.spec import AdapterRef, ModelRef, ProbeSpec, Target

PERTURBED = "model.layers.1.self_attn.v_proj"


def _run(home: Path, base: str, targets, adapters=()):
    engine = Engine(home, runner=InProcessRunner())
    spec = ProbeSpec(
        base=ModelRef(base),
        adapters=tuple(adapters),
        targets=tuple(map(Target.parse, targets)),
        checks=("activations",),
    )
    job = engine.submit(spec)
    assert job.wait(300)
    assert job.state == "succeeded", job.error
    return engine.store.open(job.run_id)


def _home(manifest: dict) -> Path:
    # the demo workspace's own home (home/demo/models/<name>): runs stored there open in the app
    return Path(manifest["models"]["tiny-llama"]).parents[2]


@pytest.fixture(scope="module")
def bf16_run(demo_workspace):
    """tiny-llama on cpu/float32 and cpu/bfloat16 (the demo scenario), stored in the demo's home."""
    return _run(
        _home(demo_workspace), demo_workspace["models"]["tiny-llama"], ["cpu/float32", "cpu/bfloat16"]
    )


def test_witness_a_perturbed_module_is_the_first_divergence(tmp_path, demo_workspace, monkeypatch):
    original = ActivationsCheck.capture

    def perturbed(self, ctx, loaded, out):
        # test-only: on the target (not the reference) one module's output gets a small error
        handle = None
        if not ctx.target.is_reference:
            prefix = "base_model.model." if hasattr(loaded.model, "get_base_model") else ""
            module = loaded.model.get_submodule(prefix + PERTURBED)
            handle = module.register_forward_hook(lambda m, a, y: y + 1e-2 * y.abs().amax())
        try:
            original(self, ctx, loaded, out)
        finally:
            if handle is not None:
                handle.remove()

    monkeypatch.setattr(ActivationsCheck, "capture", perturbed)
    lora = AdapterRef(demo_workspace["adapters"]["lora"]["path"], "lora")
    record = _run(tmp_path, demo_workspace["models"]["tiny-llama"], ["cpu/float32"], [lora])
    rows = record.metrics()
    rows = rows[rows["adapter"] == "lora"]
    # a PEFT layer is one module: its base layer and lora_A/B are not recorded apart
    assert not rows["module_path"].str.contains("lora_A|base_layer").any()
    (found,) = first_divergences(rows)
    assert found.module == PERTURBED and found.target == "cpu/float32"
    local = rows[rows["drift"] == LOCAL_DRIFT].set_index("module_path")
    assert local.loc[PERTURBED, "verdict"] == "drift"
    assert local.loc[PERTURBED, "rel_l2"] > 1e-3
    after = local[local["order"] > found.order]
    assert len(after) > 10
    # every other module adds only float32 rounding by itself, however much error it inherits
    assert after["verdict"].isin(["identical", "within tolerance"]).all()
    assert after["rel_l2"].max() < 1e-5
    accumulated = rows[rows["drift"] == ACCUMULATED]
    assert (
        accumulated[accumulated["order"] < found.order]["verdict"]
        .isin(["identical", "within tolerance"])
        .all()
    )
    assert found.share is not None and found.share > 0.5
    assert f"cpu/float32 with lora parts from the reference at {PERTURBED} (local" in found.sentence()


def _leaf(module) -> bool:
    """A module without children, or a PEFT adapter layer (its base layer and lora_A/B are one module)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return isinstance(module, BaseTunerLayer) or next(module.children(), None) is None


def _independent(model64, model_t, probe, dtype, names):
    """Accumulated and local rows by hand: hooks on every named module of both models (a PeftModel's
    modules named as in its bare base)."""
    outs64, ins64, outs_t = {}, {}, {}

    def record(store, inputs=None):
        def hook(module, args, output):
            k = store.setdefault(("calls", id(module)), 0)
            store[("calls", id(module))] = k + 1
            key = (module._wd_name, k)
            store[key] = first_tensor(output).detach().clone()
            if inputs is not None and args:
                inputs[key] = args[0].detach().clone()

        return hook

    handles = []
    for model, store, inputs in ((model64, outs64, ins64), (model_t, outs_t, None)):
        for raw, module in model.named_modules():
            name = raw.removeprefix("base_model.model.")
            if name in names:
                module._wd_name = name
                handles.append(module.register_forward_hook(record(store, inputs)))
        with torch.no_grad():
            model(**{k: v.to(torch.float64) if v.is_floating_point() else v for k, v in probe.items()})
    for h in handles:
        h.remove()
    tol = metrics.default_tolerance(dtype)
    acc, loc = {}, {}
    modules_t = {n.removeprefix("base_model.model."): m for n, m in model_t.named_modules()}
    for key, ref in outs64.items():
        if key[0] == "calls":
            continue
        name = key[0] if key[1] == 0 else f"{key[0]}@{key[1]}"
        acc[name] = metrics.compare(outs_t[key], ref, tol)
        if key in ins64 and _leaf(modules_t[key[0]]):
            x = ins64[key]
            with torch.no_grad():
                y = modules_t[key[0]](x.to(dtype) if x.is_floating_point() else x)
            loc[name] = metrics.compare(first_tensor(y), ref, tol)
    return acc, loc


def _assert_equal_rows(rows, acc, loc, target):
    mine = rows[rows["target"] == target]
    for drift, expected in ((ACCUMULATED, acc), (LOCAL_DRIFT, loc)):
        part = mine[mine["drift"] == drift]
        names = [n.removeprefix("local:") for n in part["tensor"]]
        assert set(names) == set(expected), drift
        for name, row in zip(names, part.to_dict(orient="records"), strict=True):
            stats = expected[name]
            assert row["max_abs"] == stats.max_abs, (drift, name)
            assert row["rel_l2"] == stats.rel_l2, (drift, name)
            assert row["n_mismatch"] == stats.n_mismatch, (drift, name)
            assert row["verdict"] == metrics.verdict(stats), (drift, name)


def test_llama_rows_equal_an_independent_computation(bf16_run):
    from transformers import AutoConfig, AutoModelForCausalLM

    from core.models.probes import probe_inputs

    spec = bf16_run.spec
    path = spec.base.path
    rows = bf16_run.metrics()
    rows = rows[rows["check"] == "activations"]
    names = set(rows["module_path"])
    # the modules the issue names are all there, the blocks included; parameterless ones are not
    for expected in (
        "model.embed_tokens",
        "model.layers.0.input_layernorm",
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn",
        "model.layers.0.mlp.down_proj",
        "model.layers.3",
        "model.norm",
        "lm_head",
    ):
        assert expected in names
    assert not any(n.endswith(("rotary_emb", "act_fn")) for n in names)
    config = AutoConfig.from_pretrained(path)
    model64 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    probe = probe_inputs(config, type(model64), spec.probe, spec.seed)
    for dtype in (torch.float32, torch.bfloat16):
        model_t = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        acc, loc = _independent(model64, model_t, probe, dtype, names)
        _assert_equal_rows(rows, acc, loc, f"cpu/{str(dtype).removeprefix('torch.')}")
    orders = rows[rows["target"] == "cpu/bfloat16"].sort_values(["order", "drift"])
    assert orders["tensor"].iloc[0] == "model.embed_tokens" and orders["tensor"].iloc[-1] == "local:lm_head"


@pytest.fixture(scope="module")
def tiny_t5(tmp_path_factory):
    from transformers import T5Config, T5ForConditionalGeneration

    folder = tmp_path_factory.mktemp("t5-act")
    torch.manual_seed(5)
    config = T5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2
    )
    config.decoder_start_token_id = 0
    T5ForConditionalGeneration(config).save_pretrained(folder)
    return folder


def test_t5_tuple_outputs_equal_an_independent_computation(tmp_path, tiny_t5):
    from transformers import AutoConfig, T5ForConditionalGeneration

    from core.models.probes import probe_inputs

    record = _run(tmp_path, str(tiny_t5), ["cpu/bfloat16"])
    rows = record.metrics()
    rows = rows[rows["check"] == "activations"]
    # attention modules return tuples: their first tensor is recorded; the two stacks' roles differ
    assert "encoder.block.0.layer.0.SelfAttention" in set(rows["module_path"])
    assert module_role("decoder.block.0.layer.1.EncDecAttention.q") == "decoder.layer.1.EncDecAttention.q"
    config = AutoConfig.from_pretrained(tiny_t5)
    model64 = T5ForConditionalGeneration.from_pretrained(tiny_t5, dtype=torch.float64).eval()
    model_t = T5ForConditionalGeneration.from_pretrained(tiny_t5, dtype=torch.bfloat16).eval()
    probe = probe_inputs(config, T5ForConditionalGeneration, record.spec.probe, record.spec.seed)
    acc, loc = _independent(model64, model_t, probe, torch.bfloat16, set(rows["module_path"]))
    _assert_equal_rows(rows, acc, loc, "cpu/bfloat16")


def test_albert_shared_layer_is_recorded_per_call(tmp_path):
    from transformers import AlbertConfig, AlbertModel, AutoConfig

    from core.models.probes import probe_inputs

    torch.manual_seed(6)
    config = AlbertConfig(
        vocab_size=64,
        embedding_size=8,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
    )
    AlbertModel(config).save_pretrained(tmp_path / "albert")
    record = _run(tmp_path / "home", str(tmp_path / "albert"), ["cpu/bfloat16"])
    rows = record.metrics()
    rows = rows[rows["check"] == "activations"]
    query = "encoder.albert_layer_groups.0.albert_layers.0.attention.query"
    # one layer object runs twice (ALBERT shares its layers): a row per call, local drift per call
    assert {query, query + "@1", "local:" + query, "local:" + query + "@1"} <= set(rows["tensor"])
    model64 = AlbertModel.from_pretrained(tmp_path / "albert", dtype=torch.float64).eval()
    model_t = AlbertModel.from_pretrained(tmp_path / "albert", dtype=torch.bfloat16).eval()
    probe = probe_inputs(
        AutoConfig.from_pretrained(tmp_path / "albert"), AlbertModel, record.spec.probe, record.spec.seed
    )
    acc, loc = _independent(model64, model_t, probe, torch.bfloat16, set(rows["module_path"]))
    _assert_equal_rows(rows, acc, loc, "cpu/bfloat16")


def test_real_encoder_with_its_lora_equals_an_independent_computation(tmp_path, minilm):
    """The packaged all-MiniLM-L6-v2 (a real pretrained BERT), bare and with a seeded LoRA, on float32
    and bfloat16: the LoRA layers are leaves, re-run alone for local drift."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModel, BertModel

    from core.models.probes import probe_inputs

    lora = AdapterRef(str(minilm["lora"]), "lora")
    record = _run(tmp_path, str(minilm["base"]), ["cpu/float32", "cpu/bfloat16"], [lora])
    rows = record.metrics()
    rows = rows[rows["check"] == "activations"]
    query = "encoder.layer.0.attention.self.query"
    with_lora = rows[rows["adapter"] == "lora"]
    assert {query, "local:" + query, "embeddings.word_embeddings", "encoder.layer.5"} <= set(
        with_lora["tensor"]
    )
    assert not with_lora["module_path"].str.contains("base_layer|lora_A").any()

    def load(adapter, dtype):
        model = AutoModel.from_pretrained(minilm["base"], dtype=dtype).eval()
        return model if adapter is None else PeftModel.from_pretrained(model, adapter.path, adapter.name)

    probe = probe_inputs(
        AutoConfig.from_pretrained(minilm["base"]), BertModel, record.spec.probe, record.spec.seed
    )
    for adapter, mine in ((None, rows[rows["adapter"].isna()]), (lora, with_lora)):
        names = set(mine["module_path"])
        model64 = load(adapter, torch.float64)
        for dtype in (torch.float32, torch.bfloat16):
            acc, loc = _independent(model64, load(adapter, dtype), probe, dtype, names)
            assert loc[query].rel_l2 > 0  # bfloat16 and float32 rounding both show
            _assert_equal_rows(mine, acc, loc, f"cpu/{str(dtype).removeprefix('torch.')}")


def test_demo_scenario_names_the_first_divergence(bf16_run):
    rows = bf16_run.metrics()
    found = {d.target: d for d in first_divergences(rows)}
    assert set(found) == {"cpu/bfloat16"}  # float32 stays within tolerance throughout
    d = found["cpu/bfloat16"]
    assert d.local is not None and d.sentence().startswith("cpu/bfloat16 parts from the reference at model.")
    # bounded: the target's capture keeps results and sketches; the reference's inputs stay in its own
    from core.capture import Capture

    target = Capture.load(bf16_run.run_dir / "captures" / "cpu_bfloat16")
    assert not any(k.split("::")[2].startswith("input:") for k in target.tensors)
    assert target.results  # compared in the worker as produced
    reference = Capture.load(bf16_run.run_dir / "captures" / "cpu_float64")
    # an input that is an output recorded already is kept once: q_proj's is input_layernorm's output
    aliases = reference.meta["activations"]["input_alias"]["-"]
    assert aliases["model.layers.0.self_attn.q_proj"] == "model.layers.0.input_layernorm"
    assert "activations::-::input:model.layers.0.self_attn.q_proj" not in reference.tensors
    assert "activations::-::input:model.layers.0.self_attn.o_proj" in reference.tensors


def test_cli_json_names_the_first_divergence(demo_workspace, capsys, tmp_path):
    import json

    from core import cli

    code = cli.main(
        [
            "run",
            "--base",
            demo_workspace["models"]["tiny-llama"],
            "--target",
            "cpu/bfloat16",
            "--check",
            "activations",
            "--json",
            "--in-process",
            "--home",
            str(tmp_path),
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["exit_code"] == 1
    assert out["first_divergence"]["cpu/bfloat16"].startswith("cpu/bfloat16 parts from the reference at ")


# --- figures ----------------------------------------------------------------------------------------


def _rows() -> pd.DataFrame:
    names = [
        "model.embed_tokens",
        "model.layers.0.self_attn.q_proj",
        "model.layers.0",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1",
        "lm_head",
    ]
    out = []
    for target, scale in (("cpu/float32", 1e-7), ("cpu/bfloat16", 1e-3)):
        for order, name in enumerate(names):
            for drift in (ACCUMULATED, LOCAL_DRIFT):
                verdict = "drift" if target == "cpu/bfloat16" and order >= 1 else "within tolerance"
                out.append(
                    {
                        "check": "activations",
                        "target": target,
                        "reference": "cpu/float64",
                        "adapter": None,
                        "tensor": ("local:" if drift == LOCAL_DRIFT else "") + name,
                        "module_path": name,
                        "call": 0,
                        "layer": 0 if ".0" in name else 1 if ".1" in name else None,
                        "module": name.rsplit(".", 1)[-1],
                        "role": module_role(name),
                        "drift": drift,
                        "order": order,
                        "verdict": verdict,
                        "rel_l2": scale * (order + 1),
                        "max_abs": 0.0 if order == 0 else scale,
                        "max_ulp": 1.0,
                        "min_atol": 0.0,
                    }
                )
    return pd.DataFrame(out)


def test_figures_depth_by_role_and_the_divergence_marked():
    from dashboard.figures.activations import (
        activation_grid,
        activations_heatmap,
        depth_labels,
        depth_line_chart,
        depth_profile,
    )

    rows = _rows()
    assert list(depth_labels(rows[rows["target"] == "cpu/float32"].iloc[::2])) == [
        "in",
        "0",
        "0",
        "1",
        "1",
        "out",
    ]
    grid = activation_grid(
        rows[(rows["target"] == "cpu/bfloat16") & (rows["drift"] == ACCUMULATED)], "rel_l2"
    )
    assert list(grid.index) == ["in", "0", "1", "out"]
    assert list(grid.columns) == ["model.embed_tokens", "self_attn.q_proj", "block", "lm_head"]
    assert grid.loc["1", "block"] == pytest.approx(5e-3) and pd.isna(grid.loc["in", "block"])
    divergences = first_divergences(rows)
    assert [(d.target, d.module) for d in divergences] == [
        ("cpu/bfloat16", "model.layers.0.self_attn.q_proj")
    ]
    fig = activations_heatmap(rows, "rel_l2", ACCUMULATED, divergences)
    heatmaps = [t for t in fig.data if t.type == "heatmap"]
    assert len(heatmaps) == 2
    marks = [t for t in fig.data if t.name == "first divergence"]
    assert len(marks) == 1 and marks[0].x == ("self_attn.q_proj",) and marks[0].y == ("0",)
    clickable = [t for t in fig.data if t.type == "scatter" and t.customdata is not None]
    assert {tuple(c) for t in clickable for c in t.customdata} >= {
        ("cpu/bfloat16", "", "model.layers.0.self_attn.q_proj", "activations")
    }
    local = activations_heatmap(rows, "max_abs", LOCAL_DRIFT, divergences)
    assert all(
        c[2].startswith("local:")
        for t in local.data
        if t.type == "scatter" and t.customdata
        for c in t.customdata
    )
    profile = depth_profile(rows, "rel_l2")
    assert list(profile[profile["target"] == "cpu/float32"]["depth"]) == ["in", "0", "1", "out"]
    line = depth_line_chart(rows, "max_abs", ACCUMULATED, divergences)
    assert line.layout.yaxis.type == "log"
    lines = [t for t in line.data if t.mode == "lines+markers"]
    assert [t.name for t in lines] == ["cpu/float32", "cpu/bfloat16"]
    assert lines[0].y[0] is None  # a zero is a gap on a log axis, not a fake value
    assert any("first divergence" in (t.name or "") for t in line.data)
    assert activations_heatmap(rows.iloc[:0], "rel_l2").layout.annotations  # empty: says why


# --- the page -----------------------------------------------------------------------------------------


def test_activations_page(bf16_run, demo_workspace, monkeypatch):
    from apptest import make_app, no_exceptions, texts

    at = make_app(_home(demo_workspace), monkeypatch, run=bf16_run.run_id)
    at.switch_page("views/activations.py").run()
    no_exceptions(at)
    said = texts(at)
    assert "cpu/bfloat16 parts from the reference at model." in said
    assert "cpu/float32 stays within tolerance" in said
    # heatmap, depth line chart, and the first divergence's |Δ| map and histogram
    assert len(at.get("plotly_chart")) == 4
    assert at.query_params["drift"] == ACCUMULATED
    first = first_divergences(bf16_run.metrics())[0]
    assert at.selectbox(key="widget.tensor").value == first.module
    # the local view and another module, from the URL
    at.query_params["drift"] = LOCAL_DRIFT
    at.query_params["tensor"] = "local:lm_head"
    at.run()
    no_exceptions(at)
    assert at.selectbox(key="widget.tensor").value == "local:lm_head"
    assert len(at.get("plotly_chart")) == 4


def test_a_block_as_first_divergence_names_the_worst_leaf_inside_it():
    rows = _rows()
    rows = rows[rows["target"] == "cpu/float32"].copy()
    rows = rows[
        ~rows["tensor"].isin(["local:model.layers.0", "local:model.layers.1"])
    ]  # blocks are no leaves
    block = (rows["module_path"] == "model.layers.1") & (rows["drift"] == ACCUMULATED)
    rows.loc[block, "verdict"] = "drift"
    rows.loc[rows["tensor"] == "local:model.layers.1.self_attn.q_proj", "rel_l2"] = 3e-6
    (d,) = first_divergences(rows)
    assert d.module == "model.layers.1" and d.local is None
    assert d.worst_inside == ("model.layers.1.self_attn.q_proj", 3e-6)
    assert "the largest local drift inside it: model.layers.1.self_attn.q_proj, 3e-06" in d.sentence()


def test_a_run_without_the_check_offers_to_run_it_on_its_selection(demo_workspace, monkeypatch):
    from apptest import finished, make_app, no_exceptions, texts

    from core.engine.store import Store

    home = _home(demo_workspace)
    engine = Engine(home, runner=InProcessRunner())
    spec = ProbeSpec(
        base=ModelRef(demo_workspace["models"]["tiny-llama"]),
        adapters=(),
        targets=(Target.parse("cpu/float32"),),
        checks=("weights",),
    )
    job = engine.submit(spec)
    assert job.wait(120) and job.state == "succeeded", job.error
    at = make_app(home, monkeypatch, run=job.run_id)
    at.switch_page("views/activations.py").run()
    no_exceptions(at)
    assert "did not run the `activations` check" in texts(at)
    before = {r.run_id for r in Store(home).list_runs()}
    at.button(key="activations.rerun").click().run()
    no_exceptions(at)
    (new,) = [r for r in Store(home).list_runs() if r.run_id not in before]
    assert new.spec.checks == ("activations",) and new.spec.targets == spec.targets
    # the job runs in this process: let it end before the next test
    assert finished(Store(home), new.run_id, 120).status == "succeeded"
