"""Behaviour (issue 27): prompts through the checkpoint's tokenizer, next-token KL / top-1 / top-5 on an
LM head's logits, and the `generate` check's greedy tokens and first divergence."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from bench.judgement import perturbing
from core import cli
from core.capture import Capture, TensorKey
from core.checks.generate import first_divergence
from core.demo.build import TIE_PROMPT, TIE_STEP
from core.engine.store import Store
from core.models.probes import probe_inputs
from core.numerics.behaviour import next_token_behaviour
from core.spec import ModelRef, ProbeInputs, ProbeSpec, Target

SECOND = "Hi"  # shorter than TIE_PROMPT: the batch is padded (on the demo tokenizer's left)


def _independent(ref: torch.Tensor, tgt: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """kl_mean, kl_max, top1_agree by torch's own kl_div, in float64, over the mask's positions."""
    keep = mask.bool()
    log_ref = torch.log_softmax(ref.double(), -1)[keep]
    log_tgt = torch.log_softmax(tgt.double(), -1)[keep]
    kl = torch.nn.functional.kl_div(log_tgt, log_ref, reduction="none", log_target=True).sum(-1)
    agree = (ref.double().argmax(-1) == tgt.double().argmax(-1))[keep]
    return {
        "kl_mean": kl.mean().item(),
        "kl_max": kl.max().item(),
        "top1_agree": agree.double().mean().item(),
    }


def test_kl_and_agreement_equal_an_independent_computation_over_unpadded_positions():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(2, 5, 11, generator=g, dtype=torch.float64)
    tgt = (ref + 0.3 * torch.randn(2, 5, 11, generator=g, dtype=torch.float64)).float()
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    found = next_token_behaviour(ref, tgt, mask)
    want = _independent(ref, tgt, mask)
    summary = found.summary()
    assert summary["kl_mean"] == pytest.approx(want["kl_mean"], rel=1e-12)
    assert summary["kl_max"] == pytest.approx(want["kl_max"], rel=1e-12)
    assert summary["top1_agree"] == want["top1_agree"]
    assert found.rows.tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert found.positions.tolist() == [2, 3, 4, 0, 1, 2, 3, 4]
    # padding is excluded: a wild logit at a padded position changes nothing
    wild = tgt.clone()
    wild[0, 0] = 1e4
    assert next_token_behaviour(ref, wild, mask).summary() == summary


def test_top5_overlap_is_the_mean_share_of_the_reference_s_top5_in_the_target_s():
    ref = torch.arange(8, dtype=torch.float64).repeat(1, 2, 1)  # top 5: tokens 7, 6, 5, 4, 3
    tgt = ref.clone()
    tgt[0, 1, 7] = -1.0  # second position: token 7 leaves the top 5, token 2 comes in
    found = next_token_behaviour(ref, tgt)
    assert found.top5.tolist() == [5, 4]
    assert found.summary()["top5_overlap"] == (5 + 4) / 10
    assert found.top1.tolist() == [True, False]
    assert found.summary()["top1_agree"] == 0.5
    assert found.kl[0].item() == 0.0


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # the target stopped early (end of sequence)


def test_prompts_round_trip_and_old_specs_load():
    spec = ProbeSpec(
        base=ModelRef("m"),
        adapters=(),
        targets=(Target.parse("cpu/float32"),),
        probe=ProbeInputs(prompts=("héllo", "a\tb")),
        max_new_tokens=7,
    )
    again = ProbeSpec.from_json(spec.to_json())
    assert again == spec
    old = json.loads(spec.to_json())
    del old["probe"]["prompts"], old["max_new_tokens"]
    loaded = ProbeSpec.from_dict(old)
    assert loaded.probe.prompts == () and loaded.max_new_tokens == 32


def test_a_prompt_through_minilm_gives_its_tokenizer_s_ids(minilm):
    from transformers import AutoConfig, AutoTokenizer, BertModel

    prompts = ("WeightDrift measures drift.", "Short one")
    config = AutoConfig.from_pretrained(minilm["base"])
    probe = probe_inputs(config, BertModel, ProbeInputs(prompts=prompts), 0, ModelRef(str(minilm["base"])))
    direct = AutoTokenizer.from_pretrained(minilm["base"], trust_remote_code=False)(
        list(prompts), padding=True, return_tensors="pt"
    )
    assert torch.equal(probe["input_ids"], direct["input_ids"])
    assert torch.equal(probe["attention_mask"], direct["attention_mask"])
    assert probe["attention_mask"][1].tolist().count(0) > 0  # the shorter prompt is padded


def _cli(capfd, *args) -> tuple[int, dict, str]:
    capfd.readouterr()
    code = cli.main([*args, "--in-process", "--json"])
    out = capfd.readouterr()
    return code, json.loads(out.out) if out.out.strip() else {}, out.err


def test_a_checkpoint_without_a_tokenizer_is_refused_with_a_sentence(demo_workspace, tmp_path, capfd):
    base = demo_workspace["models"]["tiny-bert"]
    code = cli.main(
        ["run", "--base", base, "--target", "cpu/float32", "--prompt", "hi", "--home", str(tmp_path)]
    )
    err = capfd.readouterr().err
    assert code == 2
    assert "has no tokenizer" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def tie_run(demo_workspace, tmp_path_factory):
    """The generation-parts scenario with a second, shorter prompt (a padded batch)."""
    home = tmp_path_factory.mktemp("tie")
    code = cli.main(
        ["run", "--scenario", "generation-parts", "--prompt", TIE_PROMPT, "--prompt", SECOND]
        + ["--home", str(home), "--in-process", "--json"]
    )
    record = Store(home).list_runs()[0]
    return code, record


def test_bfloat16_generation_parts_at_the_tie_and_float32_generates_as_model_generate(
    tie_run, demo_workspace
):
    code, record = tie_run
    assert record.status == "succeeded", record.error
    gens = record.table("generations")
    assert list(gens.columns) == ["target", "adapter", "prompt", "tokens", "text", "first_divergence"]
    tie = gens[(gens["adapter"] == "lora_tie") & (gens["prompt"] == TIE_PROMPT)].set_index("target")
    assert tie.loc["cpu/bfloat16", "first_divergence"] == TIE_STEP
    assert pd.isna(tie.loc["cpu/float32", "first_divergence"])
    assert pd.isna(tie.loc["cpu/float64", "first_divergence"])  # the reference's own row
    # the captured greedy tokens are what model.generate(do_sample=False) decodes on cpu/float32
    for prompt in (TIE_PROMPT, SECOND):
        row = gens[
            (gens["target"] == "cpu/float32") & (gens["adapter"] == "lora_tie") & (gens["prompt"] == prompt)
        ]
        assert list(row["tokens"].iloc[0]) == _greedy(demo_workspace, torch.float32, None, prompt)
    metrics = record.metrics()
    generate = metrics[metrics["check"] == "generate"]
    assert set(generate.loc[generate["first_divergence"].notna(), "target"]) == {"cpu/bfloat16"}
    assert code == 1  # bfloat16's generation parts: a drift row


def test_kl_columns_equal_an_independent_computation_from_the_captures(tie_run):
    _, record = tie_run
    metrics = record.metrics()
    rows = metrics[(metrics["check"] == "outputs") & (metrics["tensor"] == "logits")]
    captures = record.run_dir / "captures"
    ref = Capture.load(captures / Target.parse("cpu/float64").slug)
    mask = torch.tensor(ref.meta["attention_mask"])
    assert mask.tolist()[1].count(0) == len(TIE_PROMPT) - len(SECOND)  # left padding, excluded
    for target in ("cpu/float32", "cpu/bfloat16"):
        capture = Capture.load(captures / Target.parse(target).slug)
        for adapter, name in (("-", None), ("lora_tie", "lora_tie")):
            key = TensorKey("outputs", adapter, "logits")
            want = _independent(ref.get(key), capture.get(key), mask)
            row = rows[(rows["target"] == target) & (rows["adapter"].fillna("-") == (name or "-"))].iloc[0]
            assert row["kl_mean"] == pytest.approx(want["kl_mean"], rel=1e-9, abs=1e-300)
            assert row["kl_max"] == pytest.approx(want["kl_max"], rel=1e-9, abs=1e-300)
            assert row["top1_agree"] == want["top1_agree"]
            assert 0 <= row["top5_overlap"] <= 1
    kl = record.table("kl_positions")
    assert len(kl) == 2 * 2 * int(mask.sum())  # targets × models × unpadded positions


WITNESS_MODULE, WITNESS_SCALE = "model.layers.3.mlp.down_proj", 0.01


def _greedy(demo, dtype, hook_scale: float | None, prompt: str = TIE_PROMPT) -> list[int]:
    """The test's own greedy decoding of `prompt` with lora_tie (the witness's hook where asked)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo["models"]["tiny-llama"], dtype=dtype)
    model = PeftModel.from_pretrained(model, demo["adapters"]["lora_tie"]["path"]).eval()
    if hook_scale is not None:
        module = next(m for n, m in model.named_modules() if n.endswith(WITNESS_MODULE))
        module.register_forward_hook(lambda mod, args, out: out * (1 + hook_scale))
    ids = torch.tensor([list(prompt.encode())])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=12,
            pad_token_id=2,
        )
    return out[0, ids.shape[1] :].tolist()


def test_a_perturbed_module_witness_parts_at_the_position_the_test_knows(demo_workspace, tmp_path, capfd):
    # a 1% larger last MLP output moves the 1e-4 tie at TIE_STEP; the earlier steps' margins hold
    reference = _greedy(demo_workspace, torch.float64, None)
    witness = _greedy(demo_workspace, torch.float32, WITNESS_SCALE)
    assert first_divergence(witness, reference) == TIE_STEP
    with perturbing("cpu/float32", WITNESS_MODULE, WITNESS_SCALE):  # the same hook, in the tool's loads
        code, out, err = _cli(
            capfd, "run", "--scenario", "generation-parts", "--target", "cpu/float32", "--home", str(tmp_path)
        )
    assert out["status"] == "succeeded", err
    assert out["generation_divergence"]["cpu/float32"] == (
        f"cpu/float32: its generation parts from the reference's at generated token {TIE_STEP} "
        "(lora_tie, prompt 1); 1 of 2 generations part"
    )


def test_generations_side_by_side_marks_the_first_divergence_and_the_kl_figure_takes_the_worst_target():
    from dashboard.figures.outputs import generations_side_by_side, kl_position_figure, worst_kl_target

    gens = pd.DataFrame(
        {
            "target": ["cpu/float64", "cpu/bfloat16"],
            "adapter": [None, None],
            "prompt": ["<b>hi</b>", "<b>hi</b>"],
            "tokens": [[1, 2, 3], [1, 2, 9]],
            "text": ["abc", "ab*"],
            "first_divergence": pd.array([None, 2], dtype="Int64"),
        }
    )
    side = generations_side_by_side(gens)
    assert side.loc[0, "cpu/bfloat16 tokens"] == "1 2 ⟦ 9"
    assert side.loc[0, "cpu/float64 tokens"] == "1 2 3"
    assert side.loc[0, "cpu/bfloat16 parts at"] == 2 and pd.isna(side.loc[0, "cpu/float64 parts at"])
    assert side.loc[0, "prompt"] == "<b>hi</b>"  # as text: st.dataframe shows it literally
    kl = pd.DataFrame(
        {
            "target": ["cpu/float32", "cpu/float32", "cpu/bfloat16", "cpu/bfloat16"],
            "adapter": [None] * 4,
            "tensor": ["logits"] * 4,
            "row": [0, 0, 0, 0],
            "position": [0, 1, 0, 1],
            "kl": [1e-12, 0.0, 1e-3, 2e-3],
        }
    )
    assert worst_kl_target(kl) == "cpu/bfloat16"
    fig = kl_position_figure(kl)
    assert list(fig.data[0].y) == [1e-3, 2e-3]
    assert "cpu/bfloat16" in fig.layout.title.text
