"""The run's fixed probe: the keyword arguments a model's forward is called with, chosen from the
forward's signature and the config, drawn from the run's seed on the CPU."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from core.models.checkpoint import LoadError
from core.spec import ModelRef, ProbeInputs

# Where a config says neither: the side of the images most vision checkpoints are trained on.
DEFAULT_IMAGE_SIDE = 224


def vocab_size(config) -> int:
    """The vocabulary size of a config (of its text part, for multimodal configs)."""
    return int(getattr(config, "vocab_size", None) or config.get_text_config().vocab_size)


def _vision_config(config):
    """The config that describes the images: the model's own, or its vision tower's (CLIP-style)."""
    vision = getattr(config, "vision_config", None)
    return vision if vision is not None and getattr(config, "num_channels", None) is None else config


def _image_shape(config) -> tuple[int, int, int] | None:
    """(channels, height, width) of a probe image; None when the config names no channel count.

    A config without `image_size` (ResNet: convolutions and a global pool take any size) gets
    DEFAULT_IMAGE_SIDE."""
    vision = _vision_config(config)
    channels = getattr(vision, "num_channels", None)
    if channels is None:
        return None
    side = getattr(vision, "image_size", None) or DEFAULT_IMAGE_SIDE
    h, w = (side, side) if isinstance(side, int) else tuple(side)
    return int(channels), int(h), int(w)


def waveform_length(config, frames: int) -> int | None:
    """Samples of raw audio whose convolutional feature encoder (`conv_kernel`, `conv_stride`: Wav2Vec2,
    HuBERT, WavLM, …) yields exactly `frames` frames: each layer maps L samples to (L − k) // s + 1, so
    the inverse, layer by layer from the last, is (frames − 1)·s + k. None for a config without them."""
    kernels = getattr(config, "conv_kernel", None)
    strides = getattr(config, "conv_stride", None)
    if not kernels or not strides or len(kernels) != len(strides):
        return None
    length = frames
    for k, s in zip(reversed(kernels), reversed(strides), strict=True):
        length = (length - 1) * int(s) + int(k)
    return length


def probe_inputs(
    config, cls: type, probe: ProbeInputs, seed: int, base: ModelRef | None = None
) -> dict[str, torch.Tensor]:
    """The run's fixed probe, as keyword arguments of the model's forward, on the CPU.

    What the model's forward takes decides the inputs: token ids (the prompts through `base`'s own
    tokenizer, `prompt_inputs`; explicit ids; or drawn from the seed),
    with pixel values beside them for a model that needs both (CLIP-style: `pixel_values` in its
    signature and no image token to place in the ids; Llava-style: an image token, `image_seq_length` of
    them placed before each row's ids); pixel values (`num_channels` × `image_size`²,
    standard normal, of the vision tower's config where there is one); audio features (`num_mel_bins`
    × twice `max_source_positions` frames, as Whisper's encoder requires, with decoder ids beside them);
    a raw waveform (`input_values`: standard normal, as a feature extractor's normalisation leaves it,
    of the length the convolutional feature encoder turns into `seq_len` frames), or a spectrogram
    (`input_values` of `max_length` × `num_mel_bins`, as the Audio Spectrogram Transformer takes).
    Float inputs are drawn in float32, so every dtype's model sees the same values (a float64 model
    gets them widened, exactly). LoadError when the model takes none of these, or explicit ids or
    prompts were given for a model that takes no ids.
    """
    takes = inspect.signature(cls.forward).parameters
    g = torch.Generator().manual_seed(seed)
    name = type(config).__name__
    shape = (probe.batch, probe.seq_len)
    if "input_ids" in takes:
        if probe.prompts:
            if base is None:
                raise LoadError("prompts were given, but no model folder to find their tokenizer in")
            inputs = prompt_inputs(base, probe.prompts, vocab_size(config))
        else:
            inputs = {"input_ids": probe_input_ids(probe, vocab_size(config), g)}
            inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        if getattr(config, "is_encoder_decoder", False):
            inputs["decoder_input_ids"] = inputs["input_ids"]
        image = _image_shape(config) if "pixel_values" in takes else None
        # a generative vision-language model reads pixels only where its image tokens sit in the ids
        token = next(
            (
                t
                for a in ("image_token_id", "image_token_index")
                if (t := getattr(config, a, None)) is not None
            ),
            None,
        )
        if image is not None and token is None:
            inputs["pixel_values"] = torch.randn(len(inputs["input_ids"]), *image, generator=g)
        elif image is not None and getattr(config, "image_seq_length", None) and not probe.prompts:
            inputs = _with_image_tokens(
                inputs["input_ids"], int(token), int(config.image_seq_length), vocab_size(config)
            )
            inputs["pixel_values"] = torch.randn(len(inputs["input_ids"]), *image, generator=g)
        return inputs
    if probe.input_ids or probe.prompts:
        what = "prompts were" if probe.prompts else "probe input ids were"
        raise LoadError(f"{what} given, but {cls.__name__} takes no token ids")
    if "pixel_values" in takes:
        image = _image_shape(config)
        if image is None:
            raise LoadError(f"{name} has no num_channels to make a probe image of")
        return {"pixel_values": torch.randn(probe.batch, *image, generator=g)}
    if "input_features" in takes:
        mels = getattr(config, "num_mel_bins", None)
        positions = getattr(config, "max_source_positions", None)
        if mels is None or positions is None:
            raise LoadError(f"{name} has no num_mel_bins or max_source_positions to make probe audio of")
        # Whisper's encoder convolves with stride 2 and requires exactly 2 × max_source_positions frames.
        inputs = {"input_features": torch.randn(probe.batch, mels, 2 * positions, generator=g)}
        if "decoder_input_ids" in takes:
            inputs["decoder_input_ids"] = torch.randint(0, vocab_size(config), shape, generator=g)
        return inputs
    if "input_values" in takes:
        samples = waveform_length(config, probe.seq_len)
        if samples is not None:
            return {"input_values": torch.randn(probe.batch, samples, generator=g)}
        frames, mels = getattr(config, "max_length", None), getattr(config, "num_mel_bins", None)
        if frames is not None and mels is not None:
            return {"input_values": torch.randn(probe.batch, frames, mels, generator=g)}
        raise LoadError(
            f"{name} has neither conv_kernel and conv_stride (a waveform encoder) nor max_length and "
            "num_mel_bins (a spectrogram) to size probe audio by"
        )
    raise LoadError(
        f"{cls.__name__} takes neither token ids, pixel values, audio features nor raw audio; "
        "no probe input can be made for it"
    )


def _with_image_tokens(ids: torch.Tensor, token: int, count: int, vocab: int) -> dict[str, torch.Tensor]:
    """Token ids of a Llava-style model with one image per row: the `count` image tokens its processor puts
    where the image goes (`image_seq_length`), first, then the row's ids (an id that is the image token
    replaced by the next one: the model would look for a second image there)."""
    text = torch.where(ids == token, (token + 1) % vocab, ids)
    full = torch.cat([torch.full((len(ids), count), token, dtype=ids.dtype), text], dim=1)
    return {"input_ids": full, "attention_mask": torch.ones_like(full)}


def probe_input_ids(probe: ProbeInputs, vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    """The run's fixed probe token ids (explicit, or drawn from `generator` on the CPU)."""
    if probe.input_ids:
        ids = torch.tensor(probe.input_ids, dtype=torch.long)
        if int(ids.max()) >= vocab_size:
            raise LoadError(f"probe input id {int(ids.max())} is outside the vocabulary (size {vocab_size})")
        return ids
    return torch.randint(0, vocab_size, (probe.batch, probe.seq_len), generator=generator)


# Files one of which a folder has when it holds a tokenizer AutoTokenizer can load without remote code.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model")


def load_tokenizer(base: ModelRef, required: bool = True):
    """The checkpoint's own tokenizer (`AutoTokenizer`, never its remote code), or None where it has
    none and `required` is False; LoadError with a sentence where it is required and missing."""
    from transformers import AutoTokenizer

    folder = Path(base.path).expanduser()
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        if not required:
            return None
        raise LoadError(
            f"{base.path} has no tokenizer ({', '.join(TOKENIZER_FILES)}): prompts need the checkpoint's "
            "own tokenizer; leave out --prompt to probe with token ids drawn from the seed"
        )
    try:
        return AutoTokenizer.from_pretrained(base.path, revision=base.revision, trust_remote_code=False)
    except Exception as e:  # a broken or remote-code-only tokenizer: a sentence, not a traceback
        if not required:
            return None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LoadError(f"{base.path}: its tokenizer does not load without remote code ({first})") from e


def prompt_inputs(base: ModelRef, prompts: tuple[str, ...], vocab: int) -> dict[str, torch.Tensor]:
    """The prompts through `base`'s tokenizer as one batch, padded on the tokenizer's own side with an
    attention mask (a tokenizer without a pad token pads with its end-of-sequence token, as
    generation does). LoadError for an empty prompt, or ids outside the model's vocabulary."""
    tokenizer = load_tokenizer(base)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        batch = tokenizer(list(prompts), padding=True, return_tensors="pt")
    except ValueError as e:  # no pad token for prompts of different lengths
        raise LoadError(f"{base.path}: its tokenizer cannot batch these prompts ({e})") from e
    ids, mask = batch["input_ids"].to(torch.long), batch["attention_mask"].to(torch.long)
    empty = [i for i, n in enumerate(mask.sum(dim=1).tolist()) if n == 0]
    if empty:
        raise LoadError(f"prompt {empty[0] + 1} gives no tokens: give text for every prompt")
    if int(ids.max()) >= vocab:
        raise LoadError(
            f"{base.path}: its tokenizer gives id {int(ids.max())}, outside the model's vocabulary (size {vocab})"
        )
    return {"input_ids": ids, "attention_mask": mask}


def prompt_rows(probe: dict[str, torch.Tensor]) -> list[list[int]]:
    """Each probe row's token ids without its padding (the attention mask's zeros), on either side."""
    ids = probe["input_ids"]
    mask = probe.get("attention_mask", torch.ones_like(ids))
    return [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
