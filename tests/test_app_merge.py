"""The Merge residuals page under AppTest, on a stored merge run (tied embeddings, NaN, LoRA), and on
the same run as stored before PEFT's default merge and safe_merge were told apart."""

from __future__ import annotations

import shutil

import pandas as pd
import pytest
from apptest import make_app, shown
from tiny_models import ARCHITECTURES

from core.demo.build import build_demo
from core.demo.scenarios import demo_spec
from core.engine.jobs import Engine
from core.engine.runners import InProcessRunner


@pytest.fixture(scope="module")
def merge_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("merge-app")
    manifest = build_demo(home)
    spec = demo_spec(
        manifest, ["lora", "lora_b", "lora_embed", "lora_nan"], ["cpu/float32", "cpu/bfloat16"], ["merge"]
    )
    job = Engine(home, runner=InProcessRunner()).submit(spec)
    assert job.wait(300) and job.state == "succeeded", job.error
    return home, job.run_id


def _page_text(at) -> str:
    kinds = ("error", "success", "warning", "info", "subheader", "caption", "text")
    return "\n".join(
        str(e.value) if kind == "text" else shown(e) for kind in kinds for e in getattr(at, kind)
    )


@pytest.mark.parametrize("adapter", ["lora_embed", "lora_nan", "lora"])
def test_merge_page_renders(merge_home, monkeypatch, adapter):
    home, run_id = merge_home
    at = make_app(home, monkeypatch, run=run_id, adapter=adapter)
    at.switch_page("views/merge.py").run()
    assert not at.exception, [e.value for e in at.exception]
    text = _page_text(at)
    assert "Save round trip" in text
    if adapter == "lora_embed":
        assert "Tied weights" in text and "untie before merging" in text
        assert "Some tensors share memory" in text  # the library's message, as text
    if adapter == "lora_nan":
        # safe_merge refuses the module; PEFT's default merge writes the NaN into W: both named
        assert "safe_merge refused** in model.layers.1.self_attn.v_proj on " in text
        assert (
            "NaN/Inf merged into W by PEFT's default merge** in model.layers.1.self_attn.v_proj on " in text
        )
        assert "NaNs detected in the merged weights" in text
    assert any(b.label.startswith("bfloat16 merge residual") for b in at.button)
    # every stage named for what it runs, in run order, with what it runs beside it
    legend = at.dataframe[1].value
    assert list(legend.stage) == [
        "unmerged",
        "merge_adapter",
        "unmerge_adapter",
        "safe_merge",
        "merge_and_unload",
        "reload",
        "subset unmerged",
        "subset merge_adapter sequential",
        "subset merge_adapter combined",
    ]
    assert "safe_merge=False" in legend.set_index("stage").loc["merge_and_unload", "runs"]
    # the heatmap opens on PEFT's default path; the other path is one pick away
    assert at.selectbox(key="widget.stage").options == ["merge_adapter", "safe_merge"]
    assert at.selectbox(key="widget.stage").value == "merge_adapter"


def test_merge_page_switches_to_safe_merge(merge_home, monkeypatch):
    home, run_id = merge_home
    at = make_app(home, monkeypatch, run=run_id, adapter="lora", stage="safe_merge")
    at.switch_page("views/merge.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert any(shown(c).startswith("28 modules merged by safe_merge") for c in at.caption)
    assert at.query_params["stage"] == "safe_merge"


@pytest.fixture(scope="module")
def legacy_home(merge_home, tmp_path_factory):
    """The run as the check stored it before: safe merges under the default's names, no default path."""
    home, run_id = merge_home
    legacy = tmp_path_factory.mktemp("merge-legacy") / "home"
    shutil.copytree(home, legacy)
    path = legacy / "runs" / run_id / "metrics.parquet"
    t = pd.read_parquet(path)
    merge = t["check"] == "merge"
    t = t[~(merge & t["stage"].eq("merge_adapter"))].copy()
    old = {
        "safe_merge": "merge_adapter",
        "subset merge_adapter sequential": "subset sequential",
        "subset merge_adapter combined": "subset together",
    }
    for new, name in old.items():
        rows = merge & t["stage"].eq(new)
        t.loc[rows, "tensor"] = t.loc[rows, "tensor"].str.replace(f":{new}:", f":{name}:", regex=False)
        t.loc[rows, "stage"] = name
    t.to_parquet(path)
    return legacy, run_id


def test_a_run_stored_before_the_split_renders_under_what_it_ran(legacy_home, monkeypatch):
    home, run_id = legacy_home
    at = make_app(home, monkeypatch, run=run_id, adapter="lora")
    at.switch_page("views/merge.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert any(
        "stored before PEFT's default merge and safe_merge were measured apart" in shown(i) for i in at.info
    )
    assert at.selectbox(key="widget.stage").options == ["safe_merge"]
    stages = list(at.dataframe[1].value.stage)
    assert stages == [
        "unmerged",
        "safe_merge",
        "unmerge after safe_merge",
        "merge_and_unload(safe_merge=True) after merge + unmerge",
        "reload",
        "subset unmerged",
        "subset safe_merge sequential",
        "subset safe_merge combined",
    ]


def test_merge_page_without_merge_rows(tmp_path, monkeypatch):
    at = make_app(tmp_path, monkeypatch)
    at.switch_page("views/merge.py").run()
    assert not at.exception


@pytest.fixture(scope="module")
def uncovered_home(tmp_path_factory):
    """A tiny llama with a LoRA and an LN tuning adapter (a method the merge check has no formula for), and
    two merge runs: both adapters, and the LN tuning alone."""
    import torch
    from peft import LNTuningConfig, LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from core.spec import AdapterRef, ModelRef, ProbeSpec, Target

    home = tmp_path_factory.mktemp("uncovered-app")
    torch.manual_seed(0)
    ARCHITECTURES["llama"].build(
        hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=4
    ).save_pretrained(home / "llama")
    for name, adapter in (
        ("lora", LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)),
        ("ln", LNTuningConfig(target_modules=["input_layernorm"])),
    ):
        get_peft_model(LlamaForCausalLM.from_pretrained(home / "llama"), adapter).save_pretrained(home / name)
    runs = {}
    for adapters in (("lora", "ln"), ("ln",)):
        spec = ProbeSpec(
            base=ModelRef(path=str(home / "llama")),
            adapters=tuple(AdapterRef(path=str(home / a), name=a) for a in adapters),
            targets=(Target.parse("cpu/float32"),),
            checks=("merge",),
        )
        job = Engine(home, runner=InProcessRunner()).submit(spec)
        assert job.wait(300) and job.state == "succeeded", job.error
        runs[adapters] = job.run_id
    return home, runs


@pytest.mark.parametrize("adapters", [("lora", "ln"), ("ln",)], ids=["with-lora", "alone"])
def test_merge_page_says_which_adapter_it_does_not_cover(uncovered_home, monkeypatch, adapters):
    home, runs = uncovered_home
    at = make_app(home, monkeypatch, run=runs[adapters])
    at.switch_page("views/merge.py").run()
    assert not at.exception, [e.value for e in at.exception]
    text = _page_text(at)
    assert text.count("Merge not covered") == 1
    assert "ln is a ln_tuning adapter; its merge rule is not covered" in text
    assert "did not run the `merge` check" not in text
    if "lora" in adapters:  # the covered adapter's rows are there to pick, the LN tuning is not offered
        assert at.selectbox(key="widget.adapter").options == ["lora"]


@pytest.fixture(scope="module")
def prompt_home(uncovered_home):
    """The same llama with a prompt-tuning adapter (virtual tokens, no weight changed) in a merge run."""
    from peft import PromptTuningConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from core.spec import AdapterRef, ModelRef, ProbeSpec, Target

    home, _ = uncovered_home
    config = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)
    get_peft_model(LlamaForCausalLM.from_pretrained(home / "llama"), config).save_pretrained(home / "soft")
    spec = ProbeSpec(
        base=ModelRef(path=str(home / "llama")),
        adapters=(AdapterRef(path=str(home / "soft"), name="soft"),),
        targets=(Target.parse("cpu/float32"),),
        checks=("merge",),
    )
    job = Engine(home, runner=InProcessRunner()).submit(spec)
    assert job.wait(300) and job.state == "succeeded", job.error
    return home, job.run_id


def test_merge_page_says_merging_does_not_apply_to_prompt_tuning(prompt_home, monkeypatch):
    from core.methods.adapter_keys import VIRTUAL_TOKENS

    home, run = prompt_home
    at = make_app(home, monkeypatch, run=run)
    at.switch_page("views/merge.py").run()
    assert not at.exception, [e.value for e in at.exception]
    text = _page_text(at)
    assert text.count("Merge does not apply") == 1
    assert f"soft is a prompt_tuning adapter: {VIRTUAL_TOKENS}, so merging does not apply" in text
    assert "did not run the `merge` check" not in text


@pytest.fixture(scope="module")
def saved_head_home(tmp_path_factory):
    """A tiny RoBERTa sequence classifier with a SEQ_CLS LoRA (PEFT saves the classifier head whole in
    the adapter: modules_to_save), in a merge run."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import RobertaForSequenceClassification

    from core.spec import AdapterRef, ModelRef, ProbeSpec, Target

    home = tmp_path_factory.mktemp("saved-head-app")
    torch.manual_seed(0)
    ARCHITECTURES["roberta_cls"].build(
        hidden_size=32, intermediate_size=48, num_attention_heads=4
    ).save_pretrained(home / "roberta_cls")
    lora = LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["query"], init_lora_weights=False)
    model = get_peft_model(RobertaForSequenceClassification.from_pretrained(home / "roberta_cls"), lora)
    model.save_pretrained(home / "cls_lora")
    spec = ProbeSpec(
        base=ModelRef(path=str(home / "roberta_cls")),
        adapters=(AdapterRef(path=str(home / "cls_lora"), name="cls_lora"),),
        targets=(Target.parse("cpu/float32"),),
        checks=("merge",),
    )
    job = Engine(home, runner=InProcessRunner()).submit(spec)
    assert job.wait(300) and job.state == "succeeded", job.error
    return home, job.run_id


def test_merge_page_lists_the_saved_head_as_replaced(saved_head_home, monkeypatch):
    home, run = saved_head_home
    at = make_app(home, monkeypatch, run=run)
    at.switch_page("views/merge.py").run()
    assert not at.exception, [e.value for e in at.exception]
    markdown = [shown(m) for m in at.markdown]
    title = (
        "**The modules the adapter saves whole (modules_to_save), as merge_and_unload() puts them in place of "
        "the base's, against the adapter file: replaced, not merged**"
    )
    assert title in markdown
    # the table under it lists the head's four tensors, identical to the file
    head = {
        f"modules_to_save:merge_and_unload:base_model.model.classifier.{m}.{p}"
        for m in ("dense", "out_proj")
        for p in ("weight", "bias")
    }
    tables = [t.value for t in at.dataframe if "tensor" in t.value.columns]
    saved = [t for t in tables if set(t["tensor"]) == head]
    assert len(saved) == 1, [list(t["tensor"]) for t in tables]
    assert set(saved[0]["verdict"]) == {"identical"}
