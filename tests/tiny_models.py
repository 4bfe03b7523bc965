"""Tiny random transformers models, one per architecture, built from configs (no download), and the
LoRA PEFT makes on each: the one place tests get an architecture's fixture model from.

`ARCHITECTURES` is the supported-families table: its rows are what tests/test_families.py runs
through every check, and what docs/supported.md lists (a test keeps
the two equal). Each row names the transformers model class, the config class and its (tiny)
fields, and the LoRA target modules where PEFT has no default for that model type (None: PEFT's
own default, as a user who names no target modules gets).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class Architecture:
    """One row of the table: how to build the model and which LoRA goes on it."""

    label: str  # what docs/supported.md calls it
    model_class: str  # transformers class
    config_class: str
    config: dict = field(default_factory=dict)
    # None: PEFT's default target modules for this model type; a list where PEFT has none
    lora_targets: tuple[str, ...] | None = None
    # PEFT's task_type: the head the adapter is trained with (None: PEFT has none for this head, as
    # for a masked LM, or the base PeftModel)
    task_type: str | None = "CAUSAL_LM"
    kind: str = "decoder"  # decoder, encoder, seq2seq, vision, speech, moe, ssm or vision-language

    def build(self, model_class: str | None = None, **overrides) -> torch.nn.Module:
        """The model with random weights (seed the global RNG first), float32, in eval mode.

        `overrides`: config fields other than the row's (a test's own sizes); `model_class`: another
        transformers class of the family (a bare `RobertaModel` for an encoder without a head)."""
        import transformers

        config = getattr(transformers, self.config_class)(**{**self.config, **overrides})
        cls = getattr(transformers, model_class or self.model_class)
        return cls(config).to(torch.float32).eval()

    def lora(self, **overrides):
        """The LoRA config for this model: B random (init_lora_weights=False) so that ΔW is not zero."""
        from peft import LoraConfig

        kwargs = {"r": 4, "lora_alpha": 8, "init_lora_weights": False, "task_type": self.task_type}
        if self.lora_targets is not None:
            kwargs["target_modules"] = list(self.lora_targets)
        return LoraConfig(**{**kwargs, **overrides})


# Decoder-only LMs share these sizes: hidden 16, one layer, 64 tokens.
_DECODER = {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
_LLAMA_LIKE = {**_DECODER, "intermediate_size": 32, "num_key_value_heads": 1, "max_position_embeddings": 32}

ARCHITECTURES: dict[str, Architecture] = {
    # the demo's family (core.demo.build builds its own, larger one)
    "llama": Architecture("Llama", "LlamaForCausalLM", "LlamaConfig", dict(_LLAMA_LIKE)),
    "gpt2": Architecture(
        "GPT-2",
        "GPT2LMHeadModel",
        "GPT2Config",
        {"vocab_size": 64, "n_positions": 32, "n_embd": 16, "n_layer": 1, "n_head": 2},
    ),
    "opt": Architecture(
        "OPT",
        "OPTForCausalLM",
        "OPTConfig",
        {**_DECODER, "ffn_dim": 32, "max_position_embeddings": 32, "word_embed_proj_dim": 16},
    ),
    "falcon": Architecture("Falcon", "FalconForCausalLM", "FalconConfig", dict(_DECODER)),
    "mistral": Architecture("Mistral", "MistralForCausalLM", "MistralConfig", dict(_LLAMA_LIKE)),
    "qwen2": Architecture("Qwen2", "Qwen2ForCausalLM", "Qwen2Config", dict(_LLAMA_LIKE)),
    "gemma": Architecture("Gemma", "GemmaForCausalLM", "GemmaConfig", {**_LLAMA_LIKE, "head_dim": 8}),
    "gemma2": Architecture("Gemma2", "Gemma2ForCausalLM", "Gemma2Config", {**_LLAMA_LIKE, "head_dim": 8}),
    "phi": Architecture("Phi", "PhiForCausalLM", "PhiConfig", {**_LLAMA_LIKE, "num_key_value_heads": 2}),
    # PEFT has no default target modules for Phi-3: its fused attention projection
    "phi3": Architecture(
        "Phi3",
        "Phi3ForCausalLM",
        "Phi3Config",
        {**_LLAMA_LIKE, "pad_token_id": 0},
        lora_targets=("qkv_proj",),
    ),
    "bloom": Architecture(
        "BLOOM",
        "BloomForCausalLM",
        "BloomConfig",
        {"vocab_size": 64, "hidden_size": 16, "n_layer": 1, "n_head": 2},
    ),
    "gpt_neox": Architecture(
        "GPT-NeoX",
        "GPTNeoXForCausalLM",
        "GPTNeoXConfig",
        {**_DECODER, "intermediate_size": 32, "max_position_embeddings": 32, "tie_word_embeddings": False},
    ),
    "roberta": Architecture(
        "RoBERTa (masked LM)",
        "RobertaForMaskedLM",
        "RobertaConfig",
        {**_DECODER, "intermediate_size": 32, "max_position_embeddings": 40},
        task_type=None,
        kind="encoder",
    ),
    # PEFT saves a SEQ_CLS adapter's classifier head whole (modules_to_save) beside the LoRA tensors
    "roberta_cls": Architecture(
        "RoBERTa (sequence classifier)",
        "RobertaForSequenceClassification",
        "RobertaConfig",
        {**_DECODER, "intermediate_size": 32, "max_position_embeddings": 40, "num_labels": 3},
        task_type="SEQ_CLS",
        kind="encoder",
    ),
    # a bare encoder: no head, so the outputs check compares its last hidden state
    "bert": Architecture(
        "BERT (bare encoder)",
        "BertModel",
        "BertConfig",
        {**_DECODER, "intermediate_size": 32, "max_position_embeddings": 16},
        task_type=None,
        kind="encoder",
    ),
    # no PEFT default for DistilBERT either: its attention's query and value
    "distilbert": Architecture(
        "DistilBERT",
        "DistilBertForMaskedLM",
        "DistilBertConfig",
        {
            "vocab_size": 64,
            "dim": 16,
            "hidden_dim": 32,
            "n_layers": 1,
            "n_heads": 2,
            "max_position_embeddings": 32,
        },
        lora_targets=("q_lin", "v_lin"),
        task_type=None,
        kind="encoder",
    ),
    "t5": Architecture(
        "T5",
        "T5ForConditionalGeneration",
        "T5Config",
        {
            "vocab_size": 64,
            "d_model": 16,
            "d_kv": 8,
            "d_ff": 32,
            "num_layers": 1,
            "num_decoder_layers": 1,
            "num_heads": 2,
            "decoder_start_token_id": 0,
        },
        task_type="SEQ_2_SEQ_LM",
        kind="seq2seq",
    ),
    # The four families below keep the sizes tests/test_families.py's shape assertions were written for.
    "bart": Architecture(
        "BART",
        "BartForConditionalGeneration",
        "BartConfig",
        {
            "vocab_size": 64,
            "d_model": 32,
            "encoder_layers": 2,
            "decoder_layers": 2,
            "encoder_attention_heads": 4,
            "decoder_attention_heads": 4,
            "encoder_ffn_dim": 48,
            "decoder_ffn_dim": 48,
            "max_position_embeddings": 32,
        },
        task_type="SEQ_2_SEQ_LM",
        kind="seq2seq",
    ),
    "vit": Architecture(
        "ViT (image classifier)",
        "ViTForImageClassification",
        "ViTConfig",
        {
            "image_size": 16,
            "patch_size": 4,
            "num_channels": 3,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_labels": 5,
        },
        lora_targets=("q_proj", "v_proj"),
        task_type=None,
        kind="vision",
    ),
    "whisper": Architecture(
        "Whisper (speech seq2seq)",
        "WhisperForConditionalGeneration",
        "WhisperConfig",
        {
            "vocab_size": 64,
            "num_mel_bins": 8,
            "d_model": 32,
            "encoder_layers": 2,
            "decoder_layers": 2,
            "encoder_attention_heads": 4,
            "decoder_attention_heads": 4,
            "encoder_ffn_dim": 48,
            "decoder_ffn_dim": 48,
            "max_source_positions": 12,
            "max_target_positions": 32,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "decoder_start_token_id": 1,
        },
        lora_targets=("q_proj", "v_proj"),
        task_type=None,
        kind="speech",
    ),
    "mixtral": Architecture(
        "Mixtral (mixture of experts)",
        "MixtralForCausalLM",
        "MixtralConfig",
        {
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
        # PEFT 0.21's default for Mixtral comes out empty here (it finds no target module): named
        lora_targets=("q_proj", "v_proj"),
        kind="moe",
    ),
    # PEFT saves a QUESTION_ANS adapter's span head (qa_outputs) whole; the outputs are its start and
    # end logits
    "bert_qa": Architecture(
        "BERT (question answering)",
        "BertForQuestionAnswering",
        "BertConfig",
        {**_DECODER, "intermediate_size": 32, "max_position_embeddings": 16},
        task_type="QUESTION_ANS",
        kind="encoder",
    ),
    # raw audio: its probe is a waveform, as long as its convolutions need for 6 frames
    "wav2vec2": Architecture(
        "Wav2Vec2 (CTC)",
        "Wav2Vec2ForCTC",
        "Wav2Vec2Config",
        {
            "vocab_size": 32,
            "hidden_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 32,
            "conv_dim": (8, 8),
            "conv_stride": (4, 2),
            "conv_kernel": (8, 4),
            "num_conv_pos_embeddings": 4,
            "num_conv_pos_embedding_groups": 2,
        },
        lora_targets=("q_proj", "v_proj"),
        task_type=None,
        kind="speech",
    ),
    # LoRA on the convolutions: the stem's patch embedding and the second stage's downsampling
    "convnext": Architecture(
        "ConvNeXt (image classifier, LoRA on convolutions)",
        "ConvNextForImageClassification",
        "ConvNextConfig",
        {
            "num_channels": 3,
            "patch_size": 2,
            "num_stages": 2,
            "hidden_sizes": [8, 16],
            "depths": [1, 1],
            "image_size": 16,
            "num_labels": 3,
        },
        lora_targets=("patch_embeddings", "downsampling_layer.1"),
        task_type=None,
        kind="vision",
    ),
    "mamba": Architecture(
        "Mamba (state-space model)",
        "MambaForCausalLM",
        "MambaConfig",
        {"vocab_size": 64, "hidden_size": 16, "state_size": 4, "num_hidden_layers": 1, "conv_kernel": 4},
        # PEFT refuses Mamba's out_proj and conv1d (their fused kernels bypass the layer)
        lora_targets=("in_proj", "x_proj"),
        kind="ssm",
    ),
    # token ids and pixel values together; its outputs are both similarity logits and both embeddings
    "clip": Architecture(
        "CLIP (vision-language)",
        "CLIPModel",
        "CLIPConfig",
        {
            "text_config": {
                "vocab_size": 64,
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "max_position_embeddings": 16,
            },
            "vision_config": {
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "image_size": 16,
                "patch_size": 4,
            },
            "projection_dim": 8,
        },
        lora_targets=("q_proj", "v_proj"),
        task_type=None,
        kind="vision-language",
    ),
    "qwen3": Architecture("Qwen3", "Qwen3ForCausalLM", "Qwen3Config", {**_LLAMA_LIKE, "head_dim": 8}),
    "qwen3_moe": Architecture(
        "Qwen3-MoE (mixture of experts)",
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        {
            **_LLAMA_LIKE,
            "head_dim": 8,
            "moe_intermediate_size": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
        },
        lora_targets=("q_proj", "v_proj"),
        kind="moe",
    ),
    # sinusoidal position embeddings: parameters the model computes when built and never saves
    "marian": Architecture(
        "Marian",
        "MarianMTModel",
        "MarianConfig",
        {
            "vocab_size": 64,
            "d_model": 16,
            "encoder_layers": 1,
            "decoder_layers": 1,
            "encoder_attention_heads": 2,
            "decoder_attention_heads": 2,
            "encoder_ffn_dim": 32,
            "decoder_ffn_dim": 32,
            "max_position_embeddings": 32,
            "pad_token_id": 0,
            "decoder_start_token_id": 0,
        },
        lora_targets=("q_proj", "v_proj"),
        task_type="SEQ_2_SEQ_LM",
        kind="seq2seq",
    ),
}


def quiet() -> None:
    """transformers' info logging and progress bars off: they bury pytest's own output."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def save_with_lora(name: str, root: Path, seed: int, lora=None, **sizes) -> tuple[Path, Path]:
    """Build architecture `name` (seeded), save it to root/name and PEFT's LoRA on it to root/name-lora.

    `lora`: a PEFT config instead of the row's LoRA; `sizes`: config fields other than the row's.
    Returns (model folder, adapter folder).
    """
    from peft import get_peft_model

    quiet()
    torch.manual_seed(seed)
    arch = ARCHITECTURES[name]
    model = arch.build(**sizes)
    model.save_pretrained(root / name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, lora if lora is not None else arch.lora())
    peft_model.save_pretrained(root / f"{name}-lora")
    return root / name, root / f"{name}-lora"


@dataclass(frozen=True)
class Method:
    """A PEFT method as the tests make it: its label in docs/supported.md and its config on given modules."""

    label: str
    config_class: str
    kwargs: dict = field(default_factory=dict)
    prompt_learning: bool = False  # virtual tokens: no ΔW, nothing to merge
    # which of the base's modules (`config`'s `modules`) it adapts: its attention projections, its
    # layer norms (LN tuning) or its token embedding
    adapts: str = "attention"
    # whether core has a float64 formula for its ΔW and merge (False: `deltas` and `merge` say `not covered`)
    covered: bool = True

    def config(self, modules: dict, task_type: str | None):
        """The PEFT config on the base's `modules` of the kind it `adapts` (`attention`, `norm`, `embedding`;
        IA3 adds the `feedforward` module, which it scales on the input).

        Every weight-based method is made with its init off, so that ΔW is not zero."""
        import peft

        kwargs = {"task_type": task_type, **self.kwargs}
        targets = modules[self.adapts]
        if not self.prompt_learning:
            kwargs["target_modules"] = [targets] if isinstance(targets, str) else list(targets)
        if self.config_class == "IA3Config":
            kwargs["target_modules"] = [*targets, modules["feedforward"]]
            kwargs["feedforward_modules"] = [modules["feedforward"]]
        return getattr(peft, self.config_class)(**kwargs)


METHODS: dict[str, Method] = {
    "lora": Method("LoRA", "LoraConfig", {"r": 4, "lora_alpha": 8, "init_lora_weights": False}),
    "dora": Method(
        "DoRA (`use_dora=True`)",
        "LoraConfig",
        {"r": 4, "lora_alpha": 8, "use_dora": True, "init_lora_weights": False},
    ),
    "rslora": Method(
        "rsLoRA (`use_rslora=True`)",
        "LoraConfig",
        {"r": 4, "lora_alpha": 8, "use_rslora": True, "init_lora_weights": False},
    ),
    "pissa": Method(
        'PiSSA (`init_lora_weights="pissa"`)',
        "LoraConfig",
        {"r": 4, "lora_alpha": 4, "init_lora_weights": "pissa"},
    ),
    "olora": Method(
        'OLoRA (`init_lora_weights="olora"`)',
        "LoraConfig",
        {"r": 4, "lora_alpha": 4, "init_lora_weights": "olora"},
    ),
    "ia3": Method("IA3", "IA3Config", {"init_ia3_weights": False}),
    "loha": Method("LoHa", "LoHaConfig", {"r": 2, "alpha": 4, "init_weights": False}),
    "lokr": Method("LoKr", "LoKrConfig", {"r": 2, "alpha": 4, "init_weights": False}),
    "vera": Method("VeRA", "VeraConfig", {"r": 4, "init_weights": False}),
    "adalora": Method(
        "AdaLoRA",
        "AdaLoraConfig",
        {"init_r": 4, "lora_alpha": 8, "total_step": 10, "init_lora_weights": False},
    ),
    "boft": Method("BOFT", "BOFTConfig", {"boft_block_size": 4, "init_weights": False}),
    "oft": Method("OFT", "OFTConfig", {"oft_block_size": 4, "init_weights": False}),
    "soft": Method("prompt tuning", "PromptTuningConfig", {"num_virtual_tokens": 3}, prompt_learning=True),
    "pfx": Method("prefix tuning", "PrefixTuningConfig", {"num_virtual_tokens": 3}, prompt_learning=True),
    "ptuning": Method(
        "P-tuning",
        "PromptEncoderConfig",
        {"num_virtual_tokens": 3, "encoder_hidden_size": 16},
        prompt_learning=True,
    ),
    # LoRA's per-module rank and alpha (a regular expression: v_proj on OPT, value on RoBERTa) and its
    # layer selection; LoRA on the token embedding
    "lora_patterns": Method(
        "LoRA (`rank_pattern`, `alpha_pattern`, `layers_to_transform`)",
        "LoraConfig",
        {
            "r": 4,
            "lora_alpha": 8,
            "rank_pattern": {"v_proj|value": 2},
            "alpha_pattern": {"v_proj|value": 3},
            "layers_to_transform": [0],
            "init_lora_weights": False,
        },
    ),
    "lora_embedding": Method(
        "LoRA on the token embedding",
        "LoraConfig",
        {"r": 4, "lora_alpha": 8, "init_lora_weights": False},
        adapts="embedding",
    ),
    "hra": Method("HRA", "HRAConfig", {"r": 2, "init_weights": False}),
    "fourierft": Method("FourierFT", "FourierFTConfig", {"n_frequency": 16, "scaling": 1.0}),
    "miss": Method("MiSS", "MissConfig", {"r": 2, "init_weights": False}),
    "randlora": Method("RandLoRA", "RandLoraConfig", {"r": 4, "randlora_alpha": 8, "init_weights": False}),
    "shira": Method("SHiRA", "ShiraConfig", {"r": 2, "random_seed": 0, "init_weights": False}),
    "delora": Method("DeLoRA", "DeloraConfig", {"r": 2, "init_weights": False}),
    "trainable_tokens": Method(
        "trainable tokens",
        "TrainableTokensConfig",
        {"token_indices": [1, 2, 3]},
        adapts="embedding",
        covered=False,
    ),
    "ln_tuning": Method("LN tuning", "LNTuningConfig", adapts="norm", covered=False),
}


def save_method(name: str, method: str, model_folder: Path, root: Path, seed: int, **config) -> Path:
    """PEFT's `method` adapter on the saved model `name`, every trained tensor random (seeded, small), saved
    to root/name-method. `config`: Method.config's arguments. Returns the adapter folder."""
    import transformers
    from peft import get_peft_model

    quiet()
    torch.manual_seed(seed)
    model = getattr(transformers, ARCHITECTURES[name].model_class).from_pretrained(model_folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, METHODS[method].config(**config))
    generator = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():  # random at a scale where ΔW is a small part of W, as a trained adapter's
        for p in peft_model.parameters():
            if p.requires_grad:
                p.copy_(0.05 * torch.randn(p.shape, generator=generator))
    peft_model.save_pretrained(root / f"{name}-{method}")
    return root / f"{name}-{method}"
