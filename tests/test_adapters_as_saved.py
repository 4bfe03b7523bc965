"""Adapters as PEFT saves them: a classifier's head saved whole (``modules_to_save``) and the
prompt-learning methods (prompt tuning, prefix tuning, P-tuning), whose trained tensors are virtual
tokens. On tiny random models built here (a RoBERTa sequence classifier, a GPT-2), through the
in-process engine and the CLI, on cpu/float32: every tensor loads as saved, so the weights rows are
exactly `identical`; the head has its own role; the checks that do not apply say so in a note and a row.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import ARCHITECTURES, quiet

from core.checks.deltas import REPLACED
from core.checks.merge import SAVED_NOTE
from core.cli import main
from core.engine.jobs import Engine
from core.engine.runners import InProcessRunner
from core.engine.store import RunRecord
from core.methods import adapter_keys
from core.spec import AdapterRef, ModelRef, ProbeInputs, ProbeSpec, Target, ToleranceOverride

TARGET = "cpu/float32"
HEAD = [
    "classifier.dense.bias",
    "classifier.dense.weight",
    "classifier.out_proj.bias",
    "classifier.out_proj.weight",
]
LORA_MODULES = [f"roberta.encoder.layer.{i}.attention.self.{m}" for i in range(2) for m in ("query", "value")]
# Adapter names PEFT does not warn about (it refuses names inside its prefixes, e.g. "prefix_tuning_").
PROMPT_ADAPTERS = {
    "soft": "prompt_tuning",
    "pfx": "prefix_tuning",
    "penc": "p_tuning",
    "soft_cls": "prompt_tuning",
    "pfx_cls": "prefix_tuning",
}
# The prompt-learning adapters on the classifier: PEFT saves its head beside the virtual tokens.
CLS_PROMPT = ("penc", "soft_cls", "pfx_cls")
# (run, adapter) of every prompt-learning adapter: GPT-2's and the classifier's.
PROMPT_CASES = [("gpt2", "soft"), ("gpt2", "pfx"), *(("roberta_cls", a) for a in CLS_PROMPT)]


def _configs() -> dict[str, tuple[str, object]]:
    """Adapter name → (base, PEFT config)."""
    from peft import LoraConfig, PrefixTuningConfig, PromptEncoderConfig, PromptTuningConfig

    return {
        # PEFT adds the classifier head to modules_to_save for SEQ_CLS and saves it whole
        "cls_lora": (
            "roberta_cls",
            LoraConfig(
                task_type="SEQ_CLS",
                r=4,
                lora_alpha=8,
                target_modules=["query", "value"],
                init_lora_weights=False,
            ),
        ),
        # a second head on the same base: PEFT activates one saved copy of a module at a time
        "cls_lora2": (
            "roberta_cls",
            LoraConfig(
                task_type="SEQ_CLS", r=2, lora_alpha=4, target_modules=["query"], init_lora_weights=False
            ),
        ),
        "penc": (
            "roberta_cls",
            PromptEncoderConfig(task_type="SEQ_CLS", num_virtual_tokens=4, encoder_hidden_size=16),
        ),
        "soft": ("gpt2", PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)),
        "pfx": ("gpt2", PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)),
        "soft_cls": ("roberta_cls", PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=4)),
        "pfx_cls": ("roberta_cls", PrefixTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=4)),
    }


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Base and adapter folders by name, all made here, seeded; every trained tensor random."""
    from peft import get_peft_model
    from transformers import GPT2LMHeadModel, RobertaForSequenceClassification

    quiet()
    root = tmp_path_factory.mktemp("as-saved")
    classes = {"roberta_cls": RobertaForSequenceClassification, "gpt2": GPT2LMHeadModel}
    torch.manual_seed(0)
    ARCHITECTURES["roberta_cls"].build(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4
    ).save_pretrained(root / "roberta_cls")
    ARCHITECTURES["gpt2"].build(n_embd=32, n_layer=2, bos_token_id=0, eos_token_id=0).save_pretrained(
        root / "gpt2"
    )
    folders = {"roberta_cls": root / "roberta_cls", "gpt2": root / "gpt2"}
    for seed, (name, (base, config)) in enumerate(_configs().items()):
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = get_peft_model(classes[base].from_pretrained(folders[base]), config)
        generator = torch.Generator().manual_seed(100 + seed)
        with torch.no_grad():  # the head too: a trained head differs from the base's
            for p in model.parameters():
                if p.requires_grad:
                    p.copy_(0.1 * torch.randn(p.shape, generator=generator))
        model.save_pretrained(root / name)
        folders[name] = root / name
    return folders


def _spec(
    workspace: dict[str, Path],
    base: str,
    adapters: list[str],
    checks: tuple[str, ...],
    target: str = TARGET,
    **fields,
) -> ProbeSpec:
    """`checks` on `target` with fixed probe ids; `fields`: further ProbeSpec fields (merge_subset)."""
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(5))
    return ProbeSpec(
        **fields,
        base=ModelRef(path=str(workspace[base])),
        adapters=tuple(AdapterRef(path=str(workspace[a]), name=a) for a in adapters),
        targets=(Target.parse(target),),
        checks=checks,
        probe=ProbeInputs(input_ids=tuple(tuple(int(i) for i in row) for row in ids)),
    )


@pytest.fixture(scope="module")
def runs(workspace: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunRecord]:
    """weights, deltas, merge and outputs on cpu/float32: the classifier with its LoRA, P-tuning, prompt
    tuning and prefix tuning; GPT-2 with prompt tuning and prefix tuning."""
    engine = Engine(tmp_path_factory.mktemp("as-saved-home"), runner=InProcessRunner())
    checks = ("weights", "deltas", "merge", "outputs")
    out = {}
    for name, (base, adapters) in {
        "roberta_cls": ("roberta_cls", ["cls_lora", *CLS_PROMPT]),
        "gpt2": ("gpt2", ["soft", "pfx"]),
    }.items():
        job = engine.submit(_spec(workspace, base, adapters, checks))
        assert job.wait(300) and job.state == "succeeded", job.error
        out[name] = engine.store.open(job.run_id)
    return out


def _rows(run: RunRecord, check: str, adapter: str) -> list[tuple]:
    table = run.metrics()
    rows = table[(table.check == check) & (table.adapter == adapter) & (table.target == TARGET)]
    return sorted(zip(rows.tensor, rows.module, rows.role, rows.verdict, strict=True))


def test_the_adapters_are_what_the_tests_claim(workspace: dict[str, Path]) -> None:
    """The files hold what PEFT saves: the whole head beside the LoRA tensors; virtual tokens under a
    key with no module path; P-tuning's head under a `base_model.` prefix."""
    keys = {name: sorted(load_file(workspace[name] / "adapter_model.safetensors")) for name in _configs()}
    lora = [f"base_model.model.{m}.lora_{ab}.weight" for m in LORA_MODULES for ab in "AB"]
    assert keys["cls_lora"] == sorted([f"base_model.model.{k}" for k in HEAD] + lora)
    for name in CLS_PROMPT:
        assert keys[name] == sorted([f"base_model.{k}" for k in HEAD] + [adapter_keys.PROMPT_KEY]), name
    assert keys["soft"] == keys["pfx"] == [adapter_keys.PROMPT_KEY]


def test_modules_to_save_head_loads_as_saved_in_its_own_role(runs: dict[str, RunRecord]) -> None:
    run = runs["roberta_cls"]
    head = [(f"base_model.model.{k}", k.split(".")[1], adapter_keys.SAVED_MODULE, "identical") for k in HEAD]
    lora = [
        (f"base_model.model.{m}.lora_{ab}.weight", m.rsplit(".", 1)[-1], f"lora_{ab}", "identical")
        for m in LORA_MODULES
        for ab in "AB"
    ]
    assert _rows(run, "weights", "cls_lora") == sorted(head + lora)
    table = run.metrics()
    notes = table[(table.check == "weights") & (table.role == adapter_keys.SAVED_MODULE)].note
    assert len(notes) == len(HEAD) * (1 + len(CLS_PROMPT))  # cls_lora's head and the prompt adapters'
    assert set(notes) == {"modules_to_save: the adapter's own copy of classifier, which replaces the base's"}


def test_modules_to_save_deltas_are_replaced_not_a_formula(runs: dict[str, RunRecord]) -> None:
    """ΔW of the LoRA modules against the float64 formula (float32 rounding: within tolerance); the
    head's rows say it is replaced whole and compare the target's copy with the file (identical)."""
    rows = _rows(runs["roberta_cls"], "deltas", "cls_lora")
    head = [
        (
            f"{adapter_keys.SAVED_MODULE}:base_model.model.{k}",
            k.split(".")[1],
            adapter_keys.SAVED_MODULE,
            "identical",
        )
        for k in HEAD
    ]
    deltas = [(m, m.rsplit(".", 1)[-1], "delta", "within tolerance") for m in LORA_MODULES]
    assert rows == sorted(head + deltas)
    table = runs["roberta_cls"].metrics()
    saved = table[(table.check == "deltas") & (table.role == adapter_keys.SAVED_MODULE)]
    assert set(saved.note) == {REPLACED}


def test_modules_to_save_merge_puts_the_saved_head_in_place(runs: dict[str, RunRecord]) -> None:
    """merge_and_unload's model holds the adapter's head exactly; the LoRA modules merge as usual."""
    table = runs["roberta_cls"].metrics()
    rows = table[(table.check == "merge") & (table.adapter == "cls_lora")]
    saved = rows[rows.role == adapter_keys.SAVED_MODULE]
    assert sorted(zip(saved.tensor, saved.stage, saved.verdict, strict=True)) == sorted(
        (
            f"{adapter_keys.SAVED_MODULE}:merge_and_unload:base_model.model.{k}",
            "merge_and_unload",
            "identical",
        )
        for k in HEAD
    )
    assert set(saved.note) == {SAVED_NOTE}
    merged = rows[rows.role == "merged"]
    assert sorted(zip(merged.module, merged.stage, strict=True)) == sorted(
        (m.rsplit(".", 1)[-1], stage) for m in LORA_MODULES for stage in ("merge_adapter", "safe_merge")
    )
    assert set(merged.verdict) == {"within tolerance"}


@pytest.mark.parametrize(("run", "adapter"), PROMPT_CASES)
def test_prompt_learning_virtual_tokens_and_outputs_are_compared(
    runs: dict[str, RunRecord], run: str, adapter: str
) -> None:
    weights = _rows(runs[run], "weights", adapter)
    tokens = (adapter_keys.PROMPT_KEY, "prompt_encoder", adapter_keys.PROMPT_KEY, "identical")
    head = [(f"base_model.{k}", k.split(".")[1], adapter_keys.SAVED_MODULE, "identical") for k in HEAD]
    assert weights == sorted([tokens] + (head if adapter in CLS_PROMPT else []))
    assert _rows(runs[run], "outputs", adapter) == [("logits", "logits", "output", "within tolerance")]


@pytest.mark.parametrize(("run", "adapter"), PROMPT_CASES)
def test_prompt_learning_deltas_and_merge_say_they_do_not_apply(
    runs: dict[str, RunRecord], run: str, adapter: str
) -> None:
    """No ΔW and nothing merged: a note and a finding row each, in the same sentence; no merge row.
    A classifier's saved head still gets its deltas rows (the target's copy against the file)."""
    record = runs[run]
    kind = PROMPT_ADAPTERS[adapter]
    tables = {check: record.table(f"{check}_findings") for check in ("deltas", "merge")}
    findings = {check: t[t.adapter == adapter] for check, t in tables.items()}
    deltas_why = (
        f"{adapter} is a {kind} adapter: {adapter_keys.VIRTUAL_TOKENS}, so there is no ΔW; "
        "its virtual tokens (weights check) and outputs are compared"
    )
    merge_why = f"{adapter} is a {kind} adapter: {adapter_keys.VIRTUAL_TOKENS}, so merging does not apply"
    for check, why in (("deltas", deltas_why), ("merge", merge_why)):
        rows = findings[check]
        assert list(zip(rows.target, rows.finding, rows.detail, strict=True)) == [
            (TARGET, "does not apply", why)
        ]
        assert f"{check}: {why}" in record.notes()
    assert _rows(record, "merge", adapter) == []
    deltas = _rows(record, "deltas", adapter)
    assert {r[2] for r in deltas} == ({adapter_keys.SAVED_MODULE} if adapter in CLS_PROMPT else set())
    assert len(deltas) == (len(HEAD) if adapter in CLS_PROMPT else 0)


@pytest.mark.parametrize(("base", "adapter"), [("roberta_cls", "cls_lora"), ("gpt2", "soft")])
def test_cli_runs_default_and_merge_checks(
    workspace: dict[str, Path], tmp_path: Path, base: str, adapter: str
) -> None:
    """The issue's table rows, through the CLI: the default checks, then `--check merge`; exit 0 (cpu/float32:
    nothing drifts), never an error."""
    common = ["run", "--base", str(workspace[base]), "--adapter", f"{workspace[adapter]}={adapter}"]
    common += ["--target", TARGET, "--home", str(tmp_path), "--in-process"]
    assert main(common) == 0
    assert main([*common, "--check", "merge"]) == 0


def test_split_saved_module_key() -> None:
    names = ("classifier", "score", "model.embed_tokens")
    split = adapter_keys.split_saved_module_key
    assert split("base_model.model.classifier.dense.weight", names) == ("classifier", "dense.weight")
    assert split("base_model.classifier.out_proj.bias", names) == ("classifier", "out_proj.bias")
    # older saves keep the wrapper's part; a name matches the end of a module path at a dot
    assert split("base_model.model.classifier.modules_to_save.default.dense.weight", names) == (
        "classifier",
        "dense.weight",
    )
    assert split("base_model.model.model.embed_tokens.weight", names) == ("model.embed_tokens", "weight")
    assert split("base_model.model.head.score.weight", names) == ("head.score", "weight")
    assert split("base_model.model.roberta.encoder.layer.0.output.dense.weight", names) is None
    assert split("base_model.model.my_classifier.weight", names) is None
    assert split(adapter_keys.PROMPT_KEY, names) is None
    assert adapter_keys.saved_module_names({"modules_to_save": ["classifier", "score", "classifier"]}) == (
        "classifier",
        "score",
    )
    assert adapter_keys.saved_module_names({"modules_to_save": None}) == ()


def test_adapter_module_keys_leave_out_saved_modules_only() -> None:
    t = torch.zeros(1)
    keys = {
        "base_model.model.enc.q.lora_A.weight": t,
        "base_model.model.enc.q.lora_B.weight": t,
        "base_model.model.classifier.dense.weight": t,
    }
    modules = adapter_keys.adapter_module_keys(keys, ("classifier",))
    assert list(modules) == ["enc.q"]
    assert modules["enc.q"].keys == {
        "lora_A.weight": "base_model.model.enc.q.lora_A.weight",
        "lora_B.weight": "base_model.model.enc.q.lora_B.weight",
    }
    with pytest.raises(
        ValueError, match=r"no lora/.* parameter: base_model\.model\.classifier\.dense\.weight"
    ):
        adapter_keys.adapter_module_keys(keys)


SAVES = "saves classifier, score whole (modules_to_save), and PEFT activates one saved copy at a time"


@pytest.mark.parametrize(
    ("subset", "detail"),
    [
        (
            (),
            "merge subset: fewer than two plain LoRA adapters in the run, nothing merged together; "
            f"left out: cls_lora ({SAVES}), cls_lora2 ({SAVES})",
        ),
        (
            ("cls_lora", "cls_lora2"),
            "merge subset: only plain LoRA adapters can share one PeftModel and be combined into one adapter "
            f"here; not cls_lora ({SAVES}), cls_lora2 ({SAVES})",
        ),
    ],
    ids=["default", "named"],
)
def test_loras_with_saved_heads_are_not_merged_together_and_say_why(
    workspace: dict[str, Path], tmp_path: Path, subset: tuple[str, ...], detail: str
) -> None:
    """Merging several adapters activates them all at once, which PEFT refuses for two saved copies of
    one module (it used to fail the whole run): each adapter's own merge runs; the subset says why not."""
    engine = Engine(tmp_path, runner=InProcessRunner())
    spec = _spec(workspace, "roberta_cls", ["cls_lora", "cls_lora2"], ("merge",), merge_subset=subset)
    job = engine.submit(spec)
    assert job.wait(300) and job.state == "succeeded", job.error
    run = engine.store.open(job.run_id)
    findings = run.table("merge_findings")
    assert list(zip(findings.target, findings.adapter, findings.finding, findings.detail, strict=True)) == [
        (TARGET, "", "subset", detail)
    ]
    table = run.metrics()
    saved = table[table.role == adapter_keys.SAVED_MODULE]
    assert sorted(zip(saved.adapter, saved.verdict, strict=True)) == sorted(
        (a, "identical") for a in ("cls_lora", "cls_lora2") for _ in HEAD
    )


@pytest.mark.parametrize("override", [False, True], ids=["default", "zero-for-modules_to_save"])
def test_a_tolerance_for_modules_to_save_judges_the_head(
    workspace: dict[str, Path], tmp_path: Path, override: bool
) -> None:
    """On bfloat16 the head loads rounded from the float32 file (PEFT keeps the LoRA tensors in float32):
    within bfloat16's tolerance by default, drift under a zero tolerance set for role modules_to_save,
    in the weights rows (compared in the worker) as in the deltas rows; the LoRA rows stay identical."""
    tolerances = {adapter_keys.SAVED_MODULE: ToleranceOverride(rtol=0.0, atol=0.0)} if override else {}
    engine = Engine(tmp_path, runner=InProcessRunner())
    spec = _spec(
        workspace, "roberta_cls", ["cls_lora"], ("weights", "deltas"), "cpu/bfloat16", tolerances=tolerances
    )
    job = engine.submit(spec)
    assert job.wait(300) and job.state == "succeeded", job.error
    table = engine.store.open(job.run_id).metrics()
    rows = table[(table.adapter == "cls_lora") & (table.target == "cpu/bfloat16")]
    head = rows[rows.role == adapter_keys.SAVED_MODULE]
    assert sorted(head.check) == ["deltas"] * len(HEAD) + ["weights"] * len(HEAD)
    assert set(head.verdict) == {"drift" if override else "within tolerance"}
    assert set(rows[rows.role.isin(["lora_A", "lora_B"])].verdict) == {"identical"}
