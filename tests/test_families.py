"""Every supported model family and PEFT method, on tiny random models built here (tests/tiny_models.py)
with an adapter made by PEFT, run through the engine (in process) on `cpu/float32 cpu/bfloat16` with every
check; docs/supported.md's "Supported models and methods" tables are this module's
parameter lists (a test below keeps them equal).

Each family's probe (pixel values; audio features with decoder ids; token ids) is what its model
takes, and the outputs rows compare its logits against the cpu/float64 reference. Mixtral's
reference runs although grouped matmul has no float64 kernel: its experts run the per-expert loop,
and the rows say so.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tiny_models import ARCHITECTURES, METHODS, save_method, save_with_lora

from core import report
from core.checks import CHECKS as REGISTRY
from core.engine.jobs import Engine
from core.engine.runners import InProcessRunner
from core.engine.store import RunRecord
from core.models.checkpoint import LoadError
from core.models.loading import (
    EAGER_EXPERTS_NOTE,
    float32_fallback_notes,
    float32_fallbacks,
    load_base,
    load_notes,
    model_class,
)
from core.models.probes import probe_inputs
from core.models.validate import InputError
from core.spec import (
    DEFAULT_CHECKS,
    DEFAULT_MAX_NEW_TOKENS,
    QUANTIZED_FORMATS,
    AdapterRef,
    ModelRef,
    ProbeInputs,
    ProbeSpec,
    Target,
)

# The families with assertions of their own below (probe shapes, logits, attention blocks).
FAMILIES = ("vit", "whisper", "mixtral", "bart", "wav2vec2")
TARGETS = ("cpu/float32", "cpu/bfloat16")
# Every check there is, in the one run per family and per group of methods.
CHECKS = tuple(REGISTRY)
# The families whose model generates nothing from the probe, and why `generate` says it does not apply.
NO_GENERATION = {
    **{f: "has no generation head" for f in ("roberta", "roberta_cls", "bert", "distilbert", "bert_qa")},
    **{f: "has no generation head" for f in ("vit", "wav2vec2", "convnext", "clip")},
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Architecture → (model folder, LoRA folder), made here, seeded."""
    root = tmp_path_factory.mktemp("families")
    return {name: save_with_lora(name, root, seed) for seed, name in enumerate(ARCHITECTURES)}


def _submit(engine: Engine, spec: ProbeSpec) -> RunRecord:
    job = engine.submit(spec)
    assert job.wait(300) and job.state == "succeeded", (spec.base.path, job.error)
    record = engine.store.open(job.run_id)
    # read once: each of a run's method tests asks for its notes, and they come from every capture document
    notes = record.notes()
    record.notes = lambda: list(notes)  # type: ignore[method-assign]
    return record


class _OnFirstUse(dict):
    """A dict that makes a missing value with `make(key)` when first asked for: a module fixture whose runs
    each cost the setup of the first test that needs it, not all of them the first test's."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, key):
        self[key] = self.make(key)
        return self[key]


@pytest.fixture(scope="module")
def runs(workspace: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunRecord]:
    """Architecture → its run: the default checks and merge together, on cpu/float32 and cpu/bfloat16
    (one run each, to keep this module's time down: the checks do not share state), made when first used."""
    engine = Engine(tmp_path_factory.mktemp("families-home"), runner=InProcessRunner())

    def run(name: str) -> RunRecord:
        model, adapter = workspace[name]
        spec = ProbeSpec(
            base=ModelRef(path=str(model)),
            adapters=(AdapterRef(path=str(adapter), name="lora"),),
            targets=tuple(Target.parse(t) for t in TARGETS),
            checks=CHECKS,
            probe=ProbeInputs(batch=2, seq_len=6),
        )
        return _submit(engine, spec)

    return _OnFirstUse(run)


# What the outputs check compares, where not the logits: a bare encoder's last hidden state and pooled output.
# A question-answering head's start and end logits; CLIP's similarity logits and both embeddings.
OUTPUTS = {
    "bert": {"last_hidden_state", "pooler_output"},
    "bert_qa": {"start_logits", "end_logits"},
    "clip": {"logits_per_image", "logits_per_text", "text_embeds", "image_embeds"},
}


def test_outputs_are_every_floating_field_of_the_output_object() -> None:
    """A head's fields by name (the hidden states it reads left out), a bare model's hidden states, never a
    cache, an integer field or a nested output; nothing floating at all is an error, not an empty row set."""
    from transformers.modeling_outputs import (
        BaseModelOutputWithPooling,
        QuestionAnsweringModelOutput,
        Seq2SeqLMOutput,
    )

    from core.checks.outputs import output_tensors

    x, ids = torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long)
    qa = QuestionAnsweringModelOutput(start_logits=x, end_logits=x + 1)
    assert list(output_tensors(qa)) == ["start_logits", "end_logits"]
    seq2seq = Seq2SeqLMOutput(logits=x, encoder_last_hidden_state=x, past_key_values=None)
    assert list(output_tensors(seq2seq)) == ["logits"]
    bare = BaseModelOutputWithPooling(last_hidden_state=x, pooler_output=x[:, 0], hidden_states=(x, x))
    assert list(output_tensors(bare)) == ["last_hidden_state", "pooler_output"]
    nested = {"logits_per_text": x, "text_model_output": bare, "input_ids": ids}
    assert list(output_tensors(nested)) == ["logits_per_text"]
    with pytest.raises(ValueError, match=r"the model's output \(dict\) holds no floating tensor to compare"):
        output_tensors({"input_ids": ids})


def _lora_modules(adapter: Path) -> set[str]:
    """The modules a LoRA adapter file adapts, by the names the loaded model has (PEFT saves those)."""
    with safe_open(adapter / "adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
    return {k.removeprefix("base_model.model.").split(".lora_A.")[0] for k in keys if ".lora_A." in k}


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_every_architecture_runs_every_check_and_nothing_is_broken(
    workspace: dict, runs: dict, name: str
) -> None:
    """The issue's table, row by row: the run succeeds and would exit 0 or 1 (drift, never an error); each
    check produced its rows on both targets; on cpu/float32 every row is identical or within tolerance
    (no false `broken`: renamed or fused checkpoint keys, saved heads and all)."""
    table = runs[name].metrics()
    assert report.exit_code(table) in (0, 1)
    assert "broken" not in set(table.verdict), table[table.verdict == "broken"][["check", "tensor"]].values
    float32 = table[table.target == "cpu/float32"]
    assert set(float32.verdict) <= {"identical", "within tolerance"}, float32[
        ~float32.verdict.isin(["identical", "within tolerance"])
    ][["check", "tensor", "verdict"]].values
    lora = table[table.adapter == "lora"]
    modules = _lora_modules(workspace[name][1])
    assert modules
    for target in TARGETS:
        rows = lora[lora.target == target]
        base = table[(table.target == target) & table.adapter.isna()]
        by_check = rows.groupby("check").size().to_dict()
        # memory's rows are the load's (no adapter of their own); generate's where the model generates
        expected = set(CHECKS) - {"memory"} - ({"generate"} if name in NO_GENERATION else set())
        assert set(by_check) == expected, (target, by_check)
        # the base alone: its weights against the file, its outputs against the reference, each module's
        # activations; the memory rows of each load variant
        assert {"weights", "outputs", "activations", "memory"} <= set(base.check), target
        assert ("generate" in set(base.check)) == (name not in NO_GENERATION), target
        # every adapted module: one ΔW row, its lora_A and lora_B, and a merged row per merge path
        deltas = rows[(rows.check == "deltas") & (rows.role == "delta")]
        assert set(deltas.tensor) == modules and len(deltas) == len(modules), target
        assert len(rows[rows.role.isin(["lora_A", "lora_B"])]) == 2 * len(modules), target
        merged = rows[(rows.check == "merge") & (rows.role == "merged")]
        assert set(merged.tensor) == {
            f"merged:{stage}:{m}" for m in modules for stage in ("merge_adapter", "safe_merge")
        }
        outputs = rows[rows.check == "outputs"]
        assert set(outputs.module) == OUTPUTS.get(name, {"logits"}) and len(outputs) == len(
            set(outputs.module)
        )
        assert outputs.max_abs.notna().all()
    notes = "\n".join(runs[name].notes())
    # generate and the memory check's unload (after its merge) ran through
    assert "generate failed" not in notes and "\nunload() failed" not in notes, notes
    if name in NO_GENERATION:
        for who in ("base", "lora"):
            assert f"generate · {who}: " in notes and NO_GENERATION[name] in notes, notes


# Each PEFT method on a decoder and an encoder: base → the modules a method adapts, by kind (Method.adapts;
# IA3 adds the feedforward module, which it scales on its input). The encoder is a sequence classifier, the head PEFT's prompt learning needs.
METHOD_BASES = {
    "opt": {
        "attention": ("q_proj", "v_proj"),
        "feedforward": "fc2",
        "norm": ("self_attn_layer_norm", "final_layer_norm"),
        "embedding": "embed_tokens",
    },
    "roberta_cls": {
        "attention": ("query", "value"),
        "feedforward": "output.dense",
        "norm": ("LayerNorm",),
        "embedding": "word_embeddings",
    },
}
# PEFT's own merge_and_unload fails here (PEFT 0.21: every tuner but LoRA's reads `.weight` of the saved
# classifier head, which RoBERTa's has not): a finding of that stage; the earlier stages' rows stand.
PEFT_MERGE_FAILURES = {
    ("roberta_cls", method): "AttributeError: 'RobertaClassificationHead' object has no attribute 'weight'"
    for method in (
        "ia3",
        "loha",
        "lokr",
        "vera",
        "boft",
        "oft",
        "fourierft",
        "shira",
        "hra",
        "miss",
        "randlora",
        "delora",
    )
}
# LoRA inits PEFT runs on the base weight in float32 at most (it refuses a float64 base).
FLOAT32_INITS = {"pissa": "PiSSA", "olora": "OLoRA"}
# The part of an adapter key that starts a method's own parameter (what follows the module's path).
_METHOD_PARAMETER = re.compile(
    r"^(lora|ia3|hada|lokr|vera|boft|oft|hra|fourierft|miss|randlora|shira|delora|trainable_tokens|ln_tuning)_"
)
# LoRA on OPT's token embedding, which its LM head shares (tied): merging writes ΔW into the head as well, which
# the merge check reports (broken merged rows naming the tie, and a `tied` finding): a finding, as it should be.
TIED_MERGES = {
    ("opt", "lora_embedding"): (
        "model.decoder.embed_tokens.weight ↔ lm_head.weight: merging changes lm_head.weight too; untie before merging"
    )
}


# The methods in runs of one group each per base (the methods of old, then the ones added with issue 24), so
# that no single test's setup makes them all.
METHOD_GROUPS = (tuple(METHODS)[:15], tuple(METHODS)[15:])


@pytest.fixture(scope="module")
def method_runs(
    workspace: dict, tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, str], tuple[RunRecord, dict]]:
    """(base, method) → (the run of the method's group on that base, one adapter per method; method → adapter
    folder): the default checks and merge on cpu/float32 and cpu/bfloat16, every adapter loaded alone on a
    fresh base (isolated). A group's run is made when first used."""
    root = tmp_path_factory.mktemp("methods")
    engine = Engine(tmp_path_factory.mktemp("methods-home"), runner=InProcessRunner())
    done: dict[tuple[str, tuple[str, ...]], tuple[RunRecord, dict]] = {}

    def run(key: tuple[str, str]) -> tuple[RunRecord, dict]:
        name, method = key
        group = next(g for g in METHOD_GROUPS if method in g)
        if (name, group) not in done:
            folders = {
                m: save_method(
                    name,
                    m,
                    workspace[name][0],
                    root,
                    list(METHODS).index(m),  # its seed
                    modules=METHOD_BASES[name],
                    task_type=ARCHITECTURES[name].task_type,
                )
                for m in group
            }
            spec = ProbeSpec(
                base=ModelRef(path=str(workspace[name][0])),
                adapters=tuple(AdapterRef(path=str(f), name=m) for m, f in folders.items()),
                targets=tuple(Target.parse(t) for t in TARGETS),
                checks=CHECKS,
                probe=ProbeInputs(batch=2, seq_len=6),
            )
            done[(name, group)] = (_submit(engine, spec), folders)
        return done[(name, group)]

    return _OnFirstUse(run)


def _adapted_modules(adapter: Path) -> set[str]:
    """The modules an adapter file adapts: each key's path up to the method's own parameter name (a head
    saved whole, modules_to_save, and VeRA's shared projections have none)."""
    with safe_open(adapter / "adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
    out = set()
    for key in keys:
        if not key.startswith("base_model.model."):  # VeRA's shared projections, P-tuning's head
            continue
        parts = key.removeprefix("base_model.model.").split(".")
        at = next((i for i, part in enumerate(parts) if _METHOD_PARAMETER.match(part)), None)
        if at:
            out.add(".".join(parts[:at]))
    return out


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("base", METHOD_BASES)
def test_every_method_runs_every_check_on_a_decoder_and_an_encoder(
    method_runs: dict, base: str, method: str
) -> None:
    """Its tensors load as saved (cpu/float32: identical) and its outputs are compared on both targets; a
    weight-based method has a ΔW row per adapted module and merged rows per merge path, a prompt-learning
    method a `does not apply` finding from deltas and from merge instead, a method without a formula a `not
    covered` one. Nothing broken but the merge rows that report a tied embedding (TIED_MERGES); on
    cpu/float32 nothing else beyond tolerance."""
    run, folders = method_runs[(base, method)]
    table = run.metrics()
    rows = table[table.adapter == method]
    tied = TIED_MERGES.get((base, method))
    # the rows that report a tie, where one is expected: the merge check's, each naming it
    reported = rows[(rows.check == "merge") & rows.explanation.str.contains("tied weights", regex=False)]
    assert (len(reported) > 0 and "broken" in set(reported.verdict)) == bool(tied)
    judged = rows.drop(reported.index)
    assert "broken" not in set(judged.verdict)
    # PiSSA and OLoRA replace W by a residual when they load, by design: the adapters check says so (the base
    # weights and the outputs with the adapter disabled differ from the base's), for these and no other
    rewritten = judged[(judged.check == "adapters") & (judged.reason == "base mutated")]
    assert (len(rewritten) > 0) == (method in FLOAT32_INITS), rewritten[["tensor", "note"]].values
    assert set(rewritten.role) <= {"disabled", "base weight"}
    judged = judged.drop(rewritten.index)
    float32 = judged[judged.target == "cpu/float32"]
    assert set(float32.verdict) <= {"identical", "within tolerance"}, float32[
        ~float32.verdict.isin(["identical", "within tolerance"])
    ][["check", "tensor", "verdict"]].values
    # loaded tensors are bitwise the file; the base weights PiSSA/OLoRA rewrite at load are computed
    rewrites = float32[float32.role == "rewritten base"]
    assert (len(rewrites) > 0) == (method in FLOAT32_INITS), rewrites[["tensor", "verdict"]].values
    weights = float32[(float32.check == "weights") & (float32.role != "rewritten base")]
    assert len(weights) and set(weights.verdict) == {"identical"}
    modules = _adapted_modules(folders[method])
    if method in FLOAT32_INITS:
        note = f"{FLOAT32_INITS[method]} cannot be initialised in float64; loaded in float32 and upcast to float64"
        assert f"{method}: {note}" in run.notes()
    findings = {check: run.table(f"{check}_findings") for check in ("deltas", "merge")}
    memory = table[table.check == "memory"]  # the loads', shared by the group's methods
    assert set(memory.target) == set(TARGETS) and "broken" not in set(memory.verdict)
    notes = "\n".join(run.notes())
    # generate and the memory check's unload (after its merge) ran through
    assert "generate failed" not in notes and "\nunload() failed" not in notes, notes
    for target in TARGETS:
        at = rows[rows.target == target]
        loaded = at[(at.check == "weights") & (at.role != "rewritten base")]
        assert len(at[at.check == "outputs"]) == 1 and len(loaded) == len(weights)
        assert len(at[at.role == "rewritten base"]) == len(rewrites), target  # on every target alike
        # each module's output with the method loaded; its load alone (isolated) against the base
        assert len(at[at.check == "activations"]) and len(at[at.check == "adapters"]), target
        if base in NO_GENERATION:
            assert at[at.check == "generate"].empty and f"generate · {method}: " in notes
        else:
            assert len(at[at.check == "generate"]) == 1, target
        # against float64: its reference ran (PiSSA and OLoRA load in float32 there, then upcast)
        assert set(at[at.check == "outputs"].reference) == {"cpu/float64"}, run.notes()
        own = {check: f[(f.adapter == method) & (f.target == target)] for check, f in findings.items()}
        if METHODS[method].prompt_learning:
            assert not modules and at[at.check == "merge"].empty
            for check, found in own.items():
                assert list(found.finding) == ["does not apply"], (check, target)
        elif not METHODS[method].covered:
            # no formula: its weights and outputs are compared, and both checks say its ΔW is not
            assert modules and at[at.role.isin(["delta", "merged"])].empty
            for check, found in own.items():
                assert list(found.finding) == ["not covered"], (check, target)
        else:
            assert modules and own["deltas"].empty, own
            failure = PEFT_MERGE_FAILURES.get((base, method))
            assert list(zip(own["merge"].finding, own["merge"].detail, strict=True)) == (
                [("merge_and_unload", failure)] if failure else [("tied", tied)] if tied else []
            )
            if failure:
                assert f"merge: {method}: merge_and_unload() failed ({failure})" in run.notes()
            deltas = at[(at.check == "deltas") & (at.role == "delta")]
            assert set(deltas.tensor) == modules and len(deltas) == len(modules), target
            merged = at[(at.check == "merge") & (at.role == "merged")]
            assert set(merged.tensor) == {
                f"merged:{stage}:{m}" for m in modules for stage in ("merge_adapter", "safe_merge")
            }, target


SUPPORTED = Path(__file__).resolve().parent.parent / "docs" / "supported.md"
GENERATED = (
    "<!-- generated from tests/test_families.py (ARCHITECTURES, METHODS): edit those, then paste what "
    "test_supported_page_lists_what_this_module_runs prints -->",
    "<!-- end of generated tables -->",
)


def supported_tables() -> str:
    """docs/supported.md's tables of the families and methods this module runs, from its parameter lists."""
    lines = [
        "| model | transformers class | adapter `task_type` | LoRA target modules |",
        "|---|---|---|---|",
    ]
    for arch in ARCHITECTURES.values():
        targets = (
            f"`{', '.join(arch.lora_targets)}`" if arch.lora_targets else "PEFT's default for the model type"
        )
        lines.append(f"| {arch.label} | `{arch.model_class}` | {arch.task_type or '—'} | {targets} |")
    bases = " | ".join(f"on {ARCHITECTURES[b].label}" for b in METHOD_BASES)
    lines += [
        "",
        f"| method | PEFT config | ΔW and merge | {bases} |",
        "|---|---|---|" + "---|" * len(METHOD_BASES),
    ]
    for name, method in METHODS.items():
        covered = (
            "does not apply (virtual tokens): a finding"
            if method.prompt_learning
            else "against float64"
            if method.covered
            else "not covered: a finding"
        )
        cells = []
        for base in METHOD_BASES:
            if (base, name) in PEFT_MERGE_FAILURES:
                cells.append("✓ (PEFT's `merge_and_unload` fails: a finding)")
            elif (base, name) in TIED_MERGES:
                cells.append("✓ (the embedding is tied to the LM head: merging changes both, a finding)")
            else:
                cells.append("✓")
        lines.append(f"| {method.label} | `{method.config_class}` | {covered} | {' | '.join(cells)} |")
    lines += [
        "",
        "| quantized target | bitsandbytes config (its defaults otherwise) | checks, on Llama (`tests/test_quantized.py`) |",
        "|---|---|---|",
    ]
    for fmt in QUANTIZED_FORMATS:
        config = "load_in_8bit=True" if fmt == "int8" else f'load_in_4bit=True, bnb_4bit_quant_type="{fmt}"'
        lines.append(f"| `DEVICE/{fmt}` | `BitsAndBytesConfig({config})` | weights, deltas, outputs, merge |")
    return "\n".join([GENERATED[0], *lines, GENERATED[1]])


def test_supported_page_lists_what_this_module_runs() -> None:
    """docs/supported.md's families and methods are this module's parameter lists, neither more nor less."""
    text = SUPPORTED.read_text()
    start, end = text.find(GENERATED[0]), text.find(GENERATED[1])
    assert 0 <= start < end, f"docs/supported.md lacks the generated tables; add:\n{supported_tables()}"
    assert text[start : end + len(GENERATED[1])] == supported_tables(), (
        f"docs/supported.md's tables differ from this module's lists; replace them with:\n{supported_tables()}"
    )


# What each family's probe holds: its forward's arguments and their shapes (batch 2, 6 tokens).
PROBES = {
    "vit": {"pixel_values": (2, 3, 16, 16)},
    "whisper": {"input_features": (2, 8, 24), "decoder_input_ids": (2, 6)},
    "mixtral": {"input_ids": (2, 6), "attention_mask": (2, 6)},
    "bart": {"input_ids": (2, 6), "attention_mask": (2, 6), "decoder_input_ids": (2, 6)},
    # 60 samples: its convolutions (kernel 8 stride 4, kernel 4 stride 2) turn them into 6 frames
    "wav2vec2": {"input_values": (2, 60)},
    "clip": {"input_ids": (2, 6), "attention_mask": (2, 6), "pixel_values": (2, 3, 16, 16)},
}
# The logits each family's outputs rows compare: image classes; a token distribution per position.
LOGITS = {"vit": "2x5", "whisper": "2x6x64", "mixtral": "2x6x64", "bart": "2x6x64", "wav2vec2": "2x6x32"}
# Attention blocks holding q_proj and v_proj: 2 layers; 2 encoder, 2 decoder and 2 cross-attention; 1 layer.
ATTENTION_BLOCKS = {"vit": 2, "mixtral": 2, "whisper": 6, "bart": 6, "wav2vec2": 1}


@pytest.mark.parametrize("family", PROBES)
def test_probe_is_what_the_family_takes_and_is_deterministic(workspace: dict, family: str) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(workspace[family][0])
    cls = model_class(config)
    first = probe_inputs(config, cls, ProbeInputs(batch=2, seq_len=6), seed=3)
    again = probe_inputs(config, cls, ProbeInputs(batch=2, seq_len=6), seed=3)
    other = probe_inputs(config, cls, ProbeInputs(batch=2, seq_len=6), seed=4)
    assert {k: tuple(t.shape) for k, t in first.items()} == PROBES[family]
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(next(iter(first.values())), next(iter(other.values())))


@pytest.mark.parametrize("family", FAMILIES)
def test_outputs_rows_compare_each_target_against_float64(runs: dict, family: str) -> None:
    table = runs[family].metrics()
    outputs = table[table["check"] == "outputs"]
    # the bare base's rows have no adapter
    assert sorted(zip(outputs["target"], outputs["adapter"].fillna("-"), strict=True)) == sorted(
        (t, a) for t in TARGETS for a in ("-", "lora")
    )
    assert set(outputs["reference"]) == {"cpu/float64"}
    assert set(outputs["module"]) == {"logits"}
    assert set(outputs["shape"]) == {LOGITS[family]}
    assert outputs["max_abs"].notna().all() and (outputs["max_abs"] < 1).all()
    assert set(outputs["verdict"]) <= {"identical", "within tolerance", "drift"}
    float32 = outputs[outputs["target"] == "cpu/float32"]
    assert set(float32["verdict"]) <= {"identical", "within tolerance"}


@pytest.mark.parametrize("family", FAMILIES)
def test_weight_rows_were_captured(runs: dict, family: str) -> None:
    table = runs[family].metrics()
    weights = table[(table["check"] == "weights") & (table["adapter"] == "lora")]
    assert set(weights["target"]) == set(TARGETS)
    # per target: lora_A and lora_B of q_proj and v_proj in every attention block, each compared to the file
    lora = weights[weights["role"].isin(["lora_A", "lora_B"])]
    assert len(lora) == len(TARGETS) * 2 * 2 * ATTENTION_BLOCKS[family]
    assert set(lora["verdict"]) == {"identical"}


def test_mixtral_reference_says_its_experts_ran_the_per_expert_loop(runs: dict) -> None:
    table = runs["mixtral"].metrics()
    outputs = table[table["check"] == "outputs"]
    assert all(EAGER_EXPERTS_NOTE in note for note in outputs["note"])
    assert any(EAGER_EXPERTS_NOTE in note for note in runs["mixtral"].notes())
    other = runs["vit"].metrics()
    assert not other["note"].fillna("").str.contains("per-expert").any()


def test_marian_tensors_computed_when_built_are_compared_with_a_fresh_build(
    workspace: dict, tmp_path: Path
) -> None:
    """Marian's sinusoidal position embeddings are parameters it computes when built and never saves: the
    weights rows compare them with a fresh float64 build (float32 builds them from float32 sines: the very
    values; bfloat16 rounds them), and the activations check re-runs each embedding alone with the
    arguments it was called with (an input shape, not a tensor), which gives the reference's output."""
    model, adapter = workspace["marian"]
    run = _submit(
        Engine(tmp_path / "home", runner=InProcessRunner()),
        ProbeSpec(
            base=ModelRef(path=str(model)),
            adapters=(AdapterRef(path=str(adapter), name="lora"),),
            targets=tuple(Target.parse(t) for t in TARGETS),
            checks=("weights", "activations"),
            probe=ProbeInputs(batch=2, seq_len=6),
        ),
    )
    table = run.metrics()
    assert "broken" not in set(table.verdict)
    assert not [n for n in run.notes() if "no local drift" in n]
    embeddings = [f"model.{stack}.embed_positions" for stack in ("decoder", "encoder")]
    built = table[(table.check == "weights") & table.tensor.isin([f"{e}.weight" for e in embeddings])]
    assert sorted(zip(built.target, built.tensor, built.verdict, built.reference, strict=True)) == [
        (t, f"{e}.weight", verdict, "fresh build (float64)")
        for t, verdict in (("cpu/bfloat16", "within tolerance"), ("cpu/float32", "identical"))
        for e in embeddings
    ]
    assert set(built.note) == {
        "computed by MarianSinusoidalPositionalEmbedding when the model is built and not saved in the "
        "checkpoint: compared with a fresh float64 build of it"
    }
    local = table[(table.check == "activations") & table.tensor.isin([f"local:{e}" for e in embeddings])]
    assert len(local) == 2 * 2 * 2  # both embeddings, base and adapter, both targets
    assert set(local[local.target == "cpu/float32"].verdict) == {"identical"}
    assert set(local[local.target == "cpu/bfloat16"].verdict) == {"within tolerance"}
    assert set(local["shape"]) == {"6x16"}  # a row per position, as the embedding returns them


def _with_task_type(adapter: Path, folder: Path, task_type: str) -> Path:
    """A copy of the adapter whose adapter_config.json names `task_type`."""
    shutil.copytree(adapter, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["task_type"] = task_type
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def test_a_task_head_the_family_lacks_is_refused_before_loading(workspace: dict, tmp_path: Path) -> None:
    model, adapter = workspace["whisper"]
    engine = Engine(tmp_path / "home", runner=InProcessRunner())
    spec = ProbeSpec(
        base=ModelRef(path=str(model)),
        adapters=(AdapterRef(path=str(_with_task_type(adapter, tmp_path / "cls", "SEQ_CLS")), name="cls"),),
        targets=(Target.parse("cpu/float32"),),
    )
    with pytest.raises(InputError) as e:
        engine.submit(spec)
    assert str(e.value) == (
        f"base model {model}: the adapter was trained for SEQ_CLS, but transformers has no such head for "
        "WhisperConfig (expected one of AutoModelForSequenceClassification)"
    )
    assert engine.store.list_runs() == []


def test_adapters_trained_with_different_heads_are_refused_before_loading(
    workspace: dict, tmp_path: Path
) -> None:
    model, adapter = workspace["bart"]
    engine = Engine(tmp_path / "home", runner=InProcessRunner())
    spec = ProbeSpec(
        base=ModelRef(path=str(model)),
        adapters=(
            AdapterRef(path=str(adapter), name="lm"),
            AdapterRef(path=str(_with_task_type(adapter, tmp_path / "cls", "SEQ_CLS")), name="cls"),
        ),
        targets=(Target.parse("cpu/float32"),),
    )
    with pytest.raises(InputError) as e:
        engine.submit(spec)
    assert str(e.value) == (
        f"base model {model}: the adapters were trained with different task heads "
        "(lm: SEQ_2_SEQ_LM, cls: SEQ_CLS); they cannot share one base"
    )
    assert engine.store.list_runs() == []


def test_an_op_without_a_float64_kernel_runs_in_float32_and_the_rows_say_so(
    workspace: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mixtral's reference left on its grouped matmul (as if transformers offered no per-expert loop):
    that one op runs in float32 from float64 inputs, the run succeeds and every outputs row names it."""
    monkeypatch.setattr("core.models.loading._has_experts_implementation", lambda cls: False)
    model, adapter = workspace["mixtral"]
    engine = Engine(tmp_path / "home", runner=InProcessRunner())
    spec = ProbeSpec(
        base=ModelRef(path=str(model)),
        adapters=(AdapterRef(path=str(adapter), name="lora"),),
        targets=(Target.parse("cpu/float32"),),
        checks=("outputs",),
        probe=ProbeInputs(batch=2, seq_len=6),
    )
    job = engine.submit(spec)
    assert job.wait(300) and job.state == "succeeded", job.error
    run = engine.store.open(job.run_id)
    outputs = run.metrics()
    note = "_grouped_mm has no float64 kernel here: computed in float32 from float64 inputs"
    assert len(outputs) == 2 and all(note in n for n in outputs["note"])
    assert not any(EAGER_EXPERTS_NOTE in n for n in outputs["note"])
    assert any(note in n for n in run.notes())
    # float32 targets against a reference whose experts ran in float32: close, not exact
    assert set(outputs["verdict"]) == {"within tolerance"}


def test_float32_fallback_leaves_other_failures_as_they_are() -> None:
    """Only an op whose float inputs are all float64 is retried: float64 meeting float32 stays an error."""
    model = torch.nn.Linear(2, 2).double()
    with pytest.raises(RuntimeError), float32_fallbacks(model):
        torch.mm(torch.ones(2, 2, dtype=torch.float64), torch.ones(2, 2, dtype=torch.float32))
    with pytest.raises(RuntimeError), float32_fallbacks(model):
        torch.mm(torch.ones(2, 3, dtype=torch.float64), torch.ones(2, 3, dtype=torch.float64))
    assert float32_fallback_notes(model) == []


def test_a_head_the_checkpoint_lacks_is_noted(workspace: dict) -> None:
    """BART saved with its LM head, loaded for SEQ_CLS: the classification head is random, and said so."""
    model = load_base(
        ModelRef(path=str(workspace["bart"][0])), Target.parse("cpu/float32"), task_type="SEQ_CLS"
    )
    assert type(model).__name__ == "BartForSequenceClassification"
    assert load_notes(model) == [
        "BartForSequenceClassification has tensors the checkpoint lacks, initialised at random from a fixed "
        "seed (the same values on every target): classification_head.dense.bias, "
        "classification_head.dense.weight, classification_head.out_proj.bias and 1 more"
    ]
    assert load_notes(load_base(ModelRef(path=str(workspace["bart"][0])), Target.parse("cpu/float32"))) == []


def test_token_ids_for_an_image_model_are_refused_before_loading(workspace: dict, tmp_path: Path) -> None:
    model = workspace["vit"][0]
    engine = Engine(tmp_path / "home", runner=InProcessRunner())
    spec = ProbeSpec(
        base=ModelRef(path=str(model)),
        adapters=(),
        targets=(Target.parse("cpu/float32"),),
        probe=ProbeInputs(input_ids=((1, 2, 3),)),
    )
    with pytest.raises(InputError) as e:
        engine.submit(spec)
    assert str(e.value) == (
        f"base model {model}: probe input ids were given, but ViTForImageClassification takes no token ids"
    )
    assert engine.store.list_runs() == []


def test_a_reference_that_cannot_run_is_replaced_by_the_next_best_target(
    workspace: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cpu/float64 reference fails to load: the targets' captures stand, their outputs are compared
    against cpu/float32 instead, and the rows and the run's notes say so."""

    def no_float64(model: ModelRef) -> None:
        raise LoadError("float64 refused here")

    monkeypatch.setattr("core.models.loading.float64_offload_dtype", no_float64)
    model, adapter = workspace["bart"]
    engine = Engine(tmp_path / "home", runner=InProcessRunner())
    spec = ProbeSpec(
        base=ModelRef(path=str(model)),
        adapters=(AdapterRef(path=str(adapter), name="lora"),),
        targets=tuple(Target.parse(t) for t in ("cpu/bfloat16", "cpu/float32")),
        probe=ProbeInputs(batch=2, seq_len=6),
    )
    job = engine.submit(spec)
    assert job.wait(300) and job.state == "succeeded", job.error
    assert job.tasks["cpu/float64"].state == "failed"
    run = engine.store.open(job.run_id)
    note = (
        "the reference cpu/float64 did not run (cpu/float64: float64 refused here (stage 'load base', step 2 of "
        "6)); compared against cpu/float32, the next-best target, instead"
    )
    assert run.notes()[0] == note
    table = run.metrics()
    outputs = table[table["check"] == "outputs"]
    assert len(outputs) == 4 and set(outputs["reference"]) == {"cpu/float32"}
    assert all(n.endswith(note) for n in outputs["note"])
    by_target = outputs.groupby("target")["verdict"].agg(set).to_dict()
    assert by_target == {"cpu/float32": {"identical"}, "cpu/bfloat16": {"drift"}}
    # the weights are compared with the file, as ever, on both targets
    weights = table[table["check"] == "weights"]
    assert set(weights["target"]) == {"cpu/bfloat16", "cpu/float32"}
    assert not weights["note"].fillna("").str.contains("did not run").any()


def test_a_random_head_is_the_same_on_every_target(workspace: dict) -> None:
    """The head a checkpoint lacks is drawn from a fixed seed in float32: float64 holds it exactly, bfloat16
    rounded, and a second load the same values (transformers alone draws new ones on every load)."""
    model = ModelRef(path=str(workspace["bart"][0]))
    name = "classification_head.dense.weight"
    heads = {
        t: load_base(model, Target.parse(t), task_type="SEQ_CLS").state_dict()[name]
        for t in ("cpu/float32", "cpu/float64", "cpu/bfloat16")
    }
    again = load_base(model, Target.parse("cpu/float32"), task_type="SEQ_CLS").state_dict()[name]
    assert torch.equal(heads["cpu/float32"], again) and heads["cpu/float32"].std() > 0
    assert torch.equal(heads["cpu/float64"], heads["cpu/float32"].double())
    assert torch.equal(heads["cpu/bfloat16"], heads["cpu/float32"].to(torch.bfloat16))


CLS_LABELS = 5


def test_a_classifier_adapter_on_a_base_without_its_head(workspace: dict, tmp_path: Path) -> None:
    """A SEQ_CLS LoRA trained with 5 labels on a RoBERTa saved as a masked LM (no classifier head, and a
    config saying 2 labels): the head is sized from the adapter's saved copy, which every check compares,
    and the base's own random head is neither broken nor a drift on cpu/float32."""
    from peft import LoraConfig, get_peft_model
    from transformers import RobertaForSequenceClassification

    base = workspace["roberta"][0]
    torch.manual_seed(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = RobertaForSequenceClassification.from_pretrained(base, num_labels=CLS_LABELS)
        get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=4, init_lora_weights=False)).save_pretrained(
            tmp_path / "cls"
        )
    run = _submit(
        Engine(tmp_path / "home", runner=InProcessRunner()),
        ProbeSpec(
            base=ModelRef(path=str(base)),
            adapters=(AdapterRef(path=str(tmp_path / "cls"), name="cls"),),
            targets=tuple(Target.parse(t) for t in TARGETS),
            checks=(*DEFAULT_CHECKS, "merge"),
            probe=ProbeInputs(batch=2, seq_len=6),
        ),
    )
    table = run.metrics()
    assert "broken" not in set(table.verdict)
    assert set(table[table.target == "cpu/float32"].verdict) <= {"identical", "within tolerance"}
    outputs = table[table.check == "outputs"]
    assert len(outputs) == 4 and set(outputs["shape"]) == {f"2x{CLS_LABELS}"}
    assert f"-: num_labels {CLS_LABELS}, from the classifier head the adapters save (modules_to_save); " in (
        "\n".join(run.notes())
    )
    # the base's head: nothing in the checkpoint to compare it with, and the adapter replaces it
    head = table[
        (table.check == "weights") & table.adapter.isna() & table.tensor.str.startswith("classifier.")
    ]
    assert len(head) == 2 * 4 and set(head.verdict) == {"within tolerance"}
    assert set(head.explanation) == {"not compared: the checkpoint has no such tensor"}
    assert all(n.endswith("cls replace it with their saved copy (modules_to_save)") for n in head.note)
    # the adapter's copy: compared with its file in weights, deltas and merge_and_unload's model
    saved = table[(table.adapter == "cls") & (table.role == "modules_to_save")]
    assert sorted(saved.check.unique()) == ["deltas", "merge", "weights"]
    assert set(saved[saved.target == "cpu/float32"].verdict) == {"identical"}


def test_whisper_generates_from_its_audio_as_a_greedy_loop_by_hand(workspace: dict, runs: dict) -> None:
    """Whisper's encoder takes no token ids: generate decodes each probe row's audio from the decoder start
    token. On cpu/float32 the stored tokens are what argmax over the logits, one token at a time, gives by
    hand (the generation config's suppressed tokens never picked), for the base and the LoRA."""
    from peft import PeftModel
    from transformers import WhisperForConditionalGeneration

    model_dir, adapter_dir = workspace["whisper"]
    gens = runs["whisper"].table("generations")
    float32 = gens[gens.target == "cpu/float32"]
    assert set(float32.adapter.fillna("base")) == {"base", "lora"} and len(float32) == 2  # one row each
    base = WhisperForConditionalGeneration.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    probe = probe_inputs(base.config, type(base), ProbeInputs(batch=2, seq_len=6), seed=0)
    features = probe["input_features"][:1]
    generation = base.generation_config
    banned = set(generation.suppress_tokens or []) | set(generation.begin_suppress_tokens or [])
    # the check stops where the decoder's positions run out (the start token takes one)
    limit = min(DEFAULT_MAX_NEW_TOKENS, base.config.max_target_positions - 1)

    def by_hand(model) -> list[int]:
        ids = [generation.decoder_start_token_id]
        with torch.no_grad():
            for _ in range(limit):
                logits = model(input_features=features, decoder_input_ids=torch.tensor([ids])).logits[0, -1]
                logits[[t for t in sorted(banned) if t < len(logits)]] = -float("inf")
                ids.append(int(logits.argmax()))
                if ids[-1] == generation.eos_token_id:
                    break
        return ids[1:]

    expected_base = by_hand(base)
    assert list(float32[float32.adapter.isna()].tokens.iloc[0]) == expected_base
    lora = PeftModel.from_pretrained(base, adapter_dir).eval()
    assert list(float32[float32.adapter == "lora"].tokens.iloc[0]) == by_hand(lora)
