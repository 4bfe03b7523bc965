"""The offline demo workspace: two tiny random base models and one adapter per supported method.

Everything is generated locally from fixed seeds (no hub access), saved as float32 safetensors,
and described by ``<home>/demo/manifest.json``::

    {"version": DEMO_VERSION,
     "models": {"tiny-llama": "<abs path>", "tiny-bert": "<abs path>"},
     "adapters": {"lora": {"path": "<abs path>", "type": "lora", "base": "tiny-llama"}, ...}}

The build is deterministic (the same safetensors bytes every time), idempotent (an intact
workspace of the current version is returned as is) and atomic (built in a temporary folder next
to ``demo`` and renamed into place, so a crash never leaves a half-built ``demo``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a build needs it: finding a built workspace needs none
    import torch

DEMO_VERSION = "3"
"""Bump when the contents change: an existing workspace of another version is rebuilt."""

DEMO_DIR = "demo"
MANIFEST = "manifest.json"

LLAMA_CONFIG: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}
BERT_CONFIG: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 128,
}

LLAMA_ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ROTATED = ["q_proj", "v_proj", "up_proj", "down_proj"]  # in_features 64 and 128: block size 8 fits both

# One fixed seed per artifact, so that rebuilding or reordering one leaves the others' bytes alone.
SEEDS: dict[str, int] = {
    "tiny-llama": 1,
    "tiny-bert": 2,
    "lora": 101,
    "dora": 102,
    "pissa": 103,
    "boft": 104,
    "oft": 105,
    "ia3": 106,
    "bert-lora": 107,
    "lora_b": 108,
    "lora_lm_head": 109,
    "lora_embed": 110,
    "lora_nan": 111,
    "lora_noop": 112,
    "lora_tie": 113,
}

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class AdapterEntry:
    """One adapter of the workspace as listed in the manifest."""

    name: str
    type: str
    base: str

    def as_manifest(self, path: Path) -> dict[str, str]:
        """The manifest record for this adapter saved at ``path``."""
        return {"path": str(path), "type": self.type, "base": self.base}


# (stage label, folder) per artifact, in build order; the length is the progress total.
_ARTIFACTS: list[tuple[str, str]] = [
    ("model tiny-llama", "models/tiny-llama"),
    ("model tiny-bert", "models/tiny-bert"),
    ("adapter lora", "adapters/lora"),
    ("adapter dora", "adapters/dora"),
    ("adapter pissa_init", "adapters/pissa_init"),
    ("adapter pissa", "adapters/pissa"),
    ("adapter pissa_lora", "adapters/pissa_lora"),
    ("adapter boft", "adapters/boft"),
    ("adapter oft", "adapters/oft"),
    ("adapter ia3", "adapters/ia3"),
    ("adapter bert-lora", "adapters/bert-lora"),
    ("adapter lora_b", "adapters/lora_b"),
    ("adapter lora_lm_head", "adapters/lora_lm_head"),
    ("adapter lora_embed", "adapters/lora_embed"),
    ("adapter lora_nan", "adapters/lora_nan"),
    ("adapter lora_noop", "adapters/lora_noop"),
    ("adapter lora_tie", "adapters/lora_tie"),
]

# The module whose lora_B gets a NaN in `lora_nan` (safe_merge must name it).
NAN_MODULE = "model.layers.1.self_attn.v_proj"


def load_manifest(home: Path) -> dict | None:
    """The manifest of an intact workspace under ``home/demo`` of the current version, else None.

    Intact means: ``manifest.json`` parses, its version is :data:`DEMO_VERSION`, and every model and
    adapter folder it lists exists inside this ``demo`` folder (a moved ``home`` is not intact,
    since the manifest holds absolute paths).
    """
    root = (Path(home).expanduser().resolve()) / DEMO_DIR
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("version") != DEMO_VERSION:
        return None
    try:
        paths = list(manifest["models"].values()) + [a["path"] for a in manifest["adapters"].values()]
    except (KeyError, TypeError, AttributeError):
        return None
    for p in paths:
        path = Path(p)
        if not path.is_dir() or root not in path.parents:
            return None
    return manifest


def build_demo(home: Path, progress: Progress | None = None) -> dict:
    """Build (or find) the demo workspace under ``home/demo`` and return its manifest.

    ``progress(stage, k, n)`` is called as each of the ``n`` artifacts starts being built, e.g.
    ``("adapter dora", 4, 11)``; it is not called when an intact workspace is found.
    """
    home = Path(home).expanduser().resolve()
    found = load_manifest(home)
    if found is not None:
        return found
    home.mkdir(parents=True, exist_ok=True)
    final = home / DEMO_DIR
    tmp = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=home))
    tmp.chmod(0o755)  # mkdtemp makes it private (0700); the workspace is meant to be shared
    try:
        manifest = _build_into(tmp, final, progress)
        return _install(tmp, final, manifest)
    finally:
        # after a successful install tmp no longer exists; after a failure it is a half build
        shutil.rmtree(tmp, ignore_errors=True)


def _install(tmp: Path, final: Path, manifest: dict) -> dict:
    """Rename the finished build to ``final``, replacing a stale workspace."""
    old: Path | None = None
    if final.exists():
        old = final.with_name(f".demo-old-{os.getpid()}-{tmp.name}")
        final.rename(old)
    try:
        tmp.rename(final)
    except OSError:
        # another process installed a workspace between our check and rename: use theirs
        theirs = load_manifest(final.parent)
        if theirs is None:
            raise
        manifest = theirs
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return manifest


def _quiet() -> None:
    """Silence transformers' progress bars and info logs for the build."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _build_into(tmp: Path, final: Path, progress: Progress | None) -> dict:
    """Write every artifact under ``tmp``; paths recorded in configs and manifest point into ``final``."""
    import torch
    from peft import BOFTConfig, IA3Config, LoraConfig, OFTConfig

    from core.methods.adapter_keys import adapter_type
    from core.methods.families.orthogonal import remember_fbd_cuda_failure

    _quiet()
    total = len(_ARTIFACTS)
    step = iter(range(1, total + 1))

    def start(stage: str) -> None:
        k = next(step)
        assert _ARTIFACTS[k - 1][0] == stage, (stage, _ARTIFACTS[k - 1])
        if progress is not None:
            progress(stage, k, total)

    llama, bert = tmp / "models/tiny-llama", tmp / "models/tiny-bert"
    models = {"tiny-llama": final / "models/tiny-llama", "tiny-bert": final / "models/tiny-bert"}
    adapters: dict[str, dict[str, str]] = {}

    def record(name: str, base: str, config_type: str | None = None) -> None:
        """Point the saved config at the final base folder and list the adapter in the manifest."""
        folder = tmp / "adapters" / name
        config_file = folder / "adapter_config.json"
        config = json.loads(config_file.read_text())
        config["base_model_name_or_path"] = str(models[base])
        for key in ("target_modules", "feedforward_modules"):
            # PEFT saves these sets in hash order, which changes from run to run; sorted is stable
            if isinstance(config.get(key), list):
                config[key] = sorted(config[key])
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        # PEFT's model card records the temporary build path; it carries nothing else we need
        (folder / "README.md").unlink(missing_ok=True)
        entry = AdapterEntry(name=name, type=config_type or adapter_type(config), base=base)
        adapters[name] = entry.as_manifest(final / "adapters" / name)

    with warnings.catch_warnings():
        # PEFT warns about the missing BOFT CUDA extension, PiSSA conversion etc.: expected here
        warnings.simplefilter("ignore")

        start("model tiny-llama")
        _save_llama(llama)
        start("model tiny-bert")
        _save_bert(bert)

        start("adapter lora")
        lora = LoraConfig(r=8, lora_alpha=16, target_modules=LLAMA_ALL_LINEAR, init_lora_weights=False)
        _save_adapter(_load_llama(llama), lora, SEEDS["lora"], tmp / "adapters/lora")
        record("lora", "tiny-llama")

        start("adapter dora")
        dora = LoraConfig(
            r=8, lora_alpha=16, target_modules=LLAMA_ALL_LINEAR, init_lora_weights=False, use_dora=True
        )
        _save_adapter(
            _load_llama(llama), dora, SEEDS["dora"], tmp / "adapters/dora", mutate=_perturb_magnitude
        )
        record("dora", "tiny-llama")

        _save_pissa(_load_llama(llama), tmp / "adapters", start)
        record("pissa_init", "tiny-llama")
        record("pissa", "tiny-llama")
        record("pissa_lora", "tiny-llama")

        start("adapter boft")
        remember_fbd_cuda_failure()
        # Butterfly factor 1: without PEFT's fbd_cuda extension (every CPU-only install) PEFT builds
        # factor 1 whatever the config says, and a config saying 2 would then fail to load (tensor
        # shape mismatch) wherever the extension does compile.
        boft = BOFTConfig(
            boft_block_size=8, boft_n_butterfly_factor=1, target_modules=ROTATED, init_weights=False
        )
        _save_adapter(_load_llama(llama), boft, SEEDS["boft"], tmp / "adapters/boft")
        record("boft", "tiny-llama")

        start("adapter oft")
        # PEFT's defaults, spelled out so that the saved config documents the rotation used
        oft = OFTConfig(
            oft_block_size=8,
            r=0,
            target_modules=ROTATED,
            init_weights=False,
            use_cayley_neumann=True,
            num_cayley_neumann_terms=5,
            coft=False,
            block_share=False,
        )
        _save_adapter(_load_llama(llama), oft, SEEDS["oft"], tmp / "adapters/oft")
        record("oft", "tiny-llama")

        start("adapter ia3")
        ia3 = IA3Config(
            target_modules=["k_proj", "v_proj", "down_proj"],
            feedforward_modules=["down_proj"],
            init_ia3_weights=False,
        )
        _save_adapter(_load_llama(llama), ia3, SEEDS["ia3"], tmp / "adapters/ia3")
        record("ia3", "tiny-llama")

        start("adapter bert-lora")
        bert_lora = LoraConfig(r=8, lora_alpha=16, target_modules=["query", "value"], init_lora_weights=False)
        _save_adapter(_load_bert(bert), bert_lora, SEEDS["bert-lora"], tmp / "adapters/bert-lora")
        record("bert-lora", "tiny-bert")

        # Scenario adapters (merge residuals, adapter consistency): all for tiny-llama, whose
        # lm_head is tied to embed_tokens.
        start("adapter lora_b")
        lora_b = LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj", "o_proj", "up_proj"],
            init_lora_weights=False,
        )
        _save_adapter(_load_llama(llama), lora_b, SEEDS["lora_b"], tmp / "adapters/lora_b")
        record("lora_b", "tiny-llama")

        start("adapter lora_lm_head")
        tied_head = LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "lm_head"], init_lora_weights=False
        )
        _save_adapter(_load_llama(llama), tied_head, SEEDS["lora_lm_head"], tmp / "adapters/lora_lm_head")
        record("lora_lm_head", "tiny-llama")

        start("adapter lora_embed")
        tied_embed = LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "embed_tokens"], init_lora_weights=False
        )
        _save_adapter(_load_llama(llama), tied_embed, SEEDS["lora_embed"], tmp / "adapters/lora_embed")
        record("lora_embed", "tiny-llama")

        start("adapter lora_nan")
        nan = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        _save_adapter(
            _load_llama(llama), nan, SEEDS["lora_nan"], tmp / "adapters/lora_nan", mutate=_inject_nan
        )
        record("lora_nan", "tiny-llama")

        start("adapter lora_noop")
        # PEFT's default init: B = 0, so the adapter changes nothing ("is my adapter applied?")
        noop = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=True)
        _save_adapter(_load_llama(llama), noop, SEEDS["lora_noop"], tmp / "adapters/lora_noop")
        record("lora_noop", "tiny-llama")

        start("adapter lora_tie")
        a, token = _tie(llama)
        tie = LoraConfig(r=1, lora_alpha=1, target_modules=["lm_head"], init_lora_weights=False)

        def place(model: torch.nn.Module, gen: torch.Generator) -> None:
            for name, p in model.named_parameters():
                if "lora_A" in name:
                    p.copy_(a[None, :])
                elif "lora_B" in name:
                    p.copy_(torch.nn.functional.one_hot(torch.tensor(token), p.shape[0]).to(p.dtype)[:, None])

        _save_adapter(_load_llama(llama), tie, SEEDS["lora_tie"], tmp / "adapters/lora_tie", mutate=place)
        record("lora_tie", "tiny-llama")

    manifest = {
        "version": DEMO_VERSION,
        "models": {name: str(path) for name, path in models.items()},
        "adapters": adapters,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _save_llama(folder: Path) -> None:
    """Seeded random tiny LlamaForCausalLM, float32 safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEEDS["tiny-llama"])
    LlamaForCausalLM(LlamaConfig(**LLAMA_CONFIG)).to(torch.float32).save_pretrained(folder)
    save_byte_tokenizer(folder)


# `lora_tie`: from TIE_PROMPT, the tiny Llama's float64 greedy generation with this adapter takes at
# generated position TIE_STEP the token ranked second there without it, ahead of the first by TIE_MARGIN
# only: float32's rounding keeps that order, bfloat16's (on the CPU) does not, so cpu/bfloat16's text
# parts from the reference's at TIE_STEP (the `generation-parts` scenario; tests hold the position).
TIE_PROMPT = "The quick brown fox"
TIE_STEP = 4
TIE_MARGIN = 1e-4


def _tie(llama: Path) -> tuple[torch.Tensor, int]:
    """(a, t) of `lora_tie`, a rank-1 LoRA on lm_head adding (a·h)·e_t to the logits: `a` is orthogonal to
    the final hidden states of the generated positions before TIE_STEP (they keep their logits, in
    float64) and lifts token t at TIE_STEP to TIE_MARGIN above the top logit there. Computed in float64."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(llama, dtype=torch.float64).eval()
    ids = torch.tensor([list(TIE_PROMPT.encode())])
    with torch.no_grad():
        seq = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=TIE_STEP + 1,
            pad_token_id=EOS_BYTE,
        )[0]
        hidden = model.model(seq[None, :-1]).last_hidden_state[0, ids.shape[1] - 1 :]
        logits = model.lm_head(hidden)
    order = logits[TIE_STEP].argsort(descending=True)
    top, token = order[0], order[1]
    lift = logits[TIE_STEP, top] - logits[TIE_STEP, token] + TIE_MARGIN
    before, h = hidden[:TIE_STEP], hidden[TIE_STEP]
    q, _ = torch.linalg.qr(before.T)
    free = h - q @ (q.T @ h)  # h's part no earlier position's hidden state has
    return (free * lift / (free @ h)).to(torch.float32), int(token)


# Byte 0 pads and byte 2 ends a sequence: the tiny Llama's config says eos_token_id 2.
PAD_BYTE, EOS_BYTE = 0, 2


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte 0…255 (what a byte-level BPE's vocabulary spells)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def save_byte_tokenizer(folder: Path) -> None:
    """A byte-level tokenizer whose 256 ids are the bytes of UTF-8 text, matching the tiny Llama's
    vocab_size exactly; saved as tokenizer.json + tokenizer_config.json so that AutoTokenizer loads it
    offline, without remote code. Written from fixed data: the same bytes every build."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    symbols = _byte_symbols()
    tokenizer = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(symbols)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": symbols[PAD_BYTE],
        "eos_token": symbols[EOS_BYTE],
        "padding_side": "left",  # as generation wants a decoder-only model's prompts
        "model_max_length": LLAMA_CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _save_bert(folder: Path) -> None:
    """Seeded random tiny BertModel, float32 safetensors."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(SEEDS["tiny-bert"])
    BertModel(BertConfig(**BERT_CONFIG)).to(torch.float32).save_pretrained(folder)


def _load_llama(folder: Path) -> torch.nn.Module:
    """A fresh float32 copy of the tiny llama (adapters like PiSSA rewrite the base in memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def _load_bert(folder: Path) -> torch.nn.Module:
    """A fresh float32 copy of the tiny bert."""
    import torch
    from transformers import AutoModel

    return AutoModel.from_pretrained(folder, dtype=torch.float32)


def _save_adapter(
    base: torch.nn.Module,
    config: Any,
    seed: int,
    folder: Path,
    mutate: Callable[[torch.nn.Module, torch.Generator], None] | None = None,
) -> None:
    """Wrap ``base`` with ``config`` (adapter init drawn from ``seed``), optionally mutate, save."""
    import torch
    from peft import get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(base, config)
    if mutate is not None:
        with torch.no_grad():
            mutate(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(folder)


def _perturb_magnitude(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Scale each DoRA magnitude by a factor in [0.9, 1.1]; at init it equals ‖W + sBA‖, a no-op."""
    import torch

    for _, module in sorted(model.named_modules(), key=lambda item: item[0]):
        dora = getattr(module, "lora_magnitude_vector", None)
        if dora is None or "default" not in dora:
            continue
        weight = dora["default"].weight
        weight.mul_(1 + 0.1 * (2 * torch.rand(weight.shape, generator=gen) - 1))


def _inject_nan(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Write one NaN into lora_B of :data:`NAN_MODULE` (a diverged training run, in one element)."""
    for name, module in model.named_modules():
        if name.endswith(NAN_MODULE) and hasattr(module, "lora_B"):
            module.lora_B["default"].weight[3, 2] = float("nan")
            return
    raise AssertionError(f"{NAN_MODULE} is not adapted")


def _save_pissa(base: torch.nn.Module, adapters: Path, start: Callable[[str], None]) -> None:
    """PiSSA: the initial state, a "trained" (perturbed) state, and that state converted to LoRA."""
    import torch
    from peft import LoraConfig, get_peft_model

    start("adapter pissa_init")
    # alpha = r keeps scaling 1, so A and B are exactly the square-rooted singular triplets
    config = LoraConfig(
        r=8, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights="pissa"
    )
    torch.manual_seed(SEEDS["pissa"])
    model = get_peft_model(base, config)
    init_dir = adapters / "pissa_init"
    model.save_pretrained(init_dir)

    start("adapter pissa")
    gen = torch.Generator().manual_seed(SEEDS["pissa"])
    with torch.no_grad():
        for _, module in sorted(model.named_modules(), key=lambda item: item[0]):
            for attr in ("lora_A", "lora_B"):
                holder = getattr(module, attr, None)
                if not isinstance(holder, torch.nn.ModuleDict) or "default" not in holder:
                    continue
                w = holder["default"].weight
                # simulated training: noise at 2% of each tensor's spread
                w.add_(0.02 * w.std() * torch.randn(w.shape, generator=gen))
    model.save_pretrained(adapters / "pissa")

    start("adapter pissa_lora")
    init_config = (init_dir / "adapter_config.json").read_bytes()
    model.save_pretrained(adapters / "pissa_lora", path_initial_model_for_weight_conversion=str(init_dir))
    # The conversion rewrites the initial adapter's config with init_lora_weights=True, which would
    # make it load as plain LoRA on the original base: keep it a PiSSA adapter.
    (init_dir / "adapter_config.json").write_bytes(init_config)
