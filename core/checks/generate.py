"""`generate`: greedy decoding (`model.generate(do_sample=False)`) of `max_new_tokens` tokens per target
and adapter from each prompt (from the probe's first row without prompts), and the first generated
position where a target's tokens part from the reference's. An encoder-decoder whose encoder takes no
token ids (Whisper: `input_features`) decodes from each probe row's encoder inputs, from its decoder
start token, by transformers' generic greedy loop (`encoder_greedy_tokens`).

The tokens live in each capture's metadata (`GENERATIONS`), so snapshots carry them to another machine;
`generations.parquet` holds them with their decoded text, and the metrics table one row per target,
adapter and prompt (`identical` where the tokens are the reference's, `drift` where they part).
A generation has no rel_l2: its rows are not judged against a peer's."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from core.capture import BASE, Capture, TensorKey
from core.checks.base import REFERENCE_TARGET, CaptureContext, Check, Reference
from core.models.loading import FLOAT64_FORWARD, Loaded, float32_fallbacks, float64_forward
from core.models.probes import load_tokenizer, prompt_rows
from core.spec import ProbeSpec

if TYPE_CHECKING:
    import pandas as pd

NAME = "generate"
GENERATIONS = "generations"  # capture.meta[GENERATIONS][adapter] = [{"prompt", "tokens", "text"}, …]
TABLE_COLUMNS = ("target", "adapter", "prompt", "tokens", "text", "first_divergence")


def greedy_tokens(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """The tokens `model.generate` decodes greedily after `ids` (one unpadded prompt) on the model's own
    device and dtype (a model held for a float64 forward generates in float64): only the new ones."""
    param = next(model.parameters())
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(inner, "config", None)
    input_ids = torch.tensor([ids], dtype=torch.long, device=param.device)
    kwargs: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "do_sample": False,
        "num_beams": 1,
        "max_new_tokens": max_new_tokens,
    }
    kwargs.update(_pad_token(inner))
    wide = getattr(inner, FLOAT64_FORWARD, False)
    fallback = float32_fallbacks(model) if wide or param.dtype == torch.float64 else contextlib.nullcontext()
    with torch.no_grad(), float64_forward(model), fallback, warnings.catch_warnings():
        # a checkpoint's generation_config may hold sampling settings that do_sample=False ignores
        warnings.simplefilter("ignore")
        out = model.generate(**kwargs)
    tokens = out[0].tolist()
    # a decoder-only model returns the prompt first; an encoder-decoder its decoder start token
    return tokens[1:] if getattr(config, "is_encoder_decoder", False) else tokens[len(ids) :]


def encoder_greedy_tokens(model, inputs: dict[str, torch.Tensor], max_new_tokens: int) -> list[int]:
    """The tokens greedy decoding gives from one probe row's encoder inputs (`encoder_rows`) of an
    encoder-decoder whose encoder takes no token ids (Whisper's `input_features`), from the decoder start
    token alone: only the new ones, as `greedy_tokens` returns an encoder-decoder's.

    transformers' generic greedy loop (`GenerationMixin.generate`) runs on PEFT's base model (which holds
    the adapter's layers), not the model's own `generate`: Whisper's detects a language, forces task and
    timestamp tokens, may fall back to sampling at higher temperatures and drops its start tokens from
    what it returns; the plain loop decodes the same way on every target. The generation config's token
    suppression applies as in any `generate`. Float inputs are cast as the outputs check casts them."""
    from transformers import GenerationMixin

    param = next(model.parameters())
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    start = decoder_start_token(inner)
    if start is None:
        raise ValueError("neither the generation config nor the config names a decoder_start_token_id")
    wide = getattr(inner, FLOAT64_FORWARD, False)
    dtype = torch.float64 if wide else param.dtype
    kwargs: dict[str, Any] = {
        name: t.to(param.device, dtype=dtype if t.is_floating_point() else t.dtype)
        for name, t in inputs.items()
    }
    kwargs.update(
        decoder_input_ids=torch.tensor([[start]], dtype=torch.long, device=param.device),
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
    )
    kwargs.update(_pad_token(inner))
    fallback = float32_fallbacks(model) if dtype == torch.float64 else contextlib.nullcontext()
    with torch.no_grad(), float64_forward(model), fallback, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = GenerationMixin.generate(inner, **kwargs)
    return out[0].tolist()[1:]  # the start token we gave, then the new ones


def decoder_start_token(model) -> int | None:
    """The token an encoder-decoder's decoder starts from: its generation config's, else its config's."""
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        start = getattr(source, "decoder_start_token_id", None)
        if isinstance(start, list):
            start = start[0] if start else None
        if isinstance(start, int):
            return start
    return None


def _pad_token(inner) -> dict[str, int]:
    """A pad token where the generation config has none but an end-of-sequence token (as generate would
    pick, silently)."""
    generation = getattr(inner, "generation_config", None)
    if generation is not None and generation.pad_token_id is None and generation.eos_token_id is not None:
        eos = generation.eos_token_id
        return {"pad_token_id": eos[0] if isinstance(eos, list) else eos}
    return {}


def encoder_rows(probe: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Each probe row's encoder inputs (Whisper's `input_features`): every probe tensor but the decoder's
    (`decoder_…`, whose ids the probe draws for the forward), one row each."""
    encoder = {k: t for k, t in probe.items() if not k.startswith("decoder_")}
    rows = len(next(iter(encoder.values()))) if encoder else 0
    return [{k: t[i : i + 1] for k, t in encoder.items()} for i in range(rows)]


def _row_label(inputs: dict[str, torch.Tensor], i: int) -> str:
    """What a row of encoder inputs is, for the generations table's prompt column."""
    shapes = ", ".join(f"{k} {'×'.join(str(n) for n in t.shape[1:])}" for k, t in inputs.items())
    return f"probe row {i + 1} ({shapes}, drawn from the seed)"


def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    """The first generated position whose token differs from the reference's (where one stopped
    early, the position the other goes on at); None where the two are the same."""
    for i, (a, b) in enumerate(zip(tokens, reference, strict=False)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def _config(model):
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(inner, "config", None)


def _is_encoder_decoder(model) -> bool:
    return bool(getattr(_config(model), "is_encoder_decoder", False))


def _virtual_tokens(model) -> int:
    """How many virtual tokens a prompt-learning PEFT model puts before the input (0 for any other)."""
    config = getattr(model, "active_peft_config", None)
    if config is None or not getattr(config, "is_prompt_learning", False):
        return 0
    return int(getattr(config, "num_virtual_tokens", 0) or 0)


def position_limit(model) -> tuple[int, str] | None:
    """How many positions the model's (decoder's) config says it holds, and the field that says so; None
    where it names none (relative positions, a state-space model). Decoding past it fails in a model with
    a table of learned positions (GPT-2, OPT: an index error), so `generate` stops there."""
    config = _config(model)
    if config is None:
        return None
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    for field in ("max_target_positions", "n_positions", "max_position_embeddings"):
        value = getattr(config, field, None)
        if isinstance(value, int) and value > 0:
            return value, field
    return None


def can_generate(model) -> str | None:
    """None where `model.generate` can decode; else why not, in a sentence."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    check = getattr(inner, "can_generate", None)
    if not callable(check) or not check():
        return f"{type(inner).__name__} has no generation head: nothing to decode (outputs are compared)"
    return None


class GenerateCheck(Check):
    name = NAME
    description = (
        "greedy decoding per target and adapter; where each target's text parts from the reference's"
    )
    against = REFERENCE_TARGET
    judged = None  # token agreement, no rel_l2 to set against a peer's

    def capture(self, ctx: CaptureContext, loaded: Loaded, out: Capture) -> None:
        adapter = BASE if loaded.adapter is None else loaded.adapter.name
        why = can_generate(loaded.model)
        # an encoder-decoder whose encoder takes no token ids decodes from its encoder inputs
        from_encoder = "input_ids" not in ctx.probe and _is_encoder_decoder(loaded.model)
        if why is None and "input_ids" not in ctx.probe and not from_encoder:
            why = "the model takes no token ids: nothing to decode from"
        if why is None and from_encoder and _virtual_tokens(loaded.model):
            why = (
                "prompt learning on an encoder that takes no token ids: the greedy loop runs on PEFT's base "
                "model, which holds no virtual tokens, so nothing is decoded"
            )
        if why is not None:
            out.notes.append(f"generate · {_who(adapter)}: {why}")
            return
        prompts = ctx.spec.probe.prompts
        rows: list = encoder_rows(ctx.probe) if from_encoder else prompt_rows(ctx.probe)
        rows = rows if prompts else rows[:1]
        tokenizer = load_tokenizer(ctx.spec.base, required=False)
        limit = position_limit(loaded.model)
        found, capped = [], []
        for i, ids in enumerate(rows):
            budget = ctx.spec.max_new_tokens
            if limit is not None:
                # positions the generation starts from: the prompt, or an encoder-decoder's decoder start
                # token; and prompt learning's virtual tokens, which take positions before them
                used = (1 if _is_encoder_decoder(loaded.model) else len(ids)) + _virtual_tokens(loaded.model)
                if limit[0] - used < budget:
                    budget = max(limit[0] - used, 0)
                    capped.append(f"{budget} for prompt {i + 1}")
            decode = encoder_greedy_tokens if from_encoder else greedy_tokens
            try:
                tokens = decode(loaded.model, ids, budget) if budget else []
            except Exception as e:  # a model whose generate fails is noted, not a failed run
                out.notes.append(f"generate · {_who(adapter)}: generate failed ({type(e).__name__}: {e})")
                return
            if from_encoder:
                prompt = _row_label(ids, i)
            else:
                prompt = prompts[i] if prompts else _decode(tokenizer, ids) or f"token ids {ids}"
            found.append({"prompt": prompt, "tokens": tokens, "text": _decode(tokenizer, tokens)})
        out.meta.setdefault(GENERATIONS, {})[adapter] = found
        if capped:
            out.notes.append(
                f"generate · {_who(adapter)}: {', '.join(capped)} new tokens, not {ctx.spec.max_new_tokens}: "
                f"the model holds {limit[0]} positions ({limit[1]}), the prompt's (and virtual tokens') included"
            )

    def reference(
        self, spec: ProbeSpec, keys: list[TensorKey], reference_capture: Capture | None
    ) -> Reference:
        return Reference(label=str(spec.reference), tensors={}, notes={})

    def compare(
        self,
        spec: ProbeSpec,
        captures: list[Capture],
        reference_capture: Capture | None,
        progress: Callable[[str], None],
    ) -> list[dict[str, Any]]:
        """One row per target, adapter and prompt: its tokens against the reference's."""
        rows: list[dict[str, Any]] = []
        for capture in captures:
            progress(f"compare {self.name} on {capture.label}")
            for g in generations(capture, reference_capture):
                rows.append(self._row(spec, g))
        return rows

    def _row(self, spec: ProbeSpec, g: dict[str, Any]) -> dict[str, Any]:
        at, n = g["first_divergence"], len(g["tokens"])
        same = at is None and g["has_reference"]
        if not g["has_reference"]:
            verdict, explanation = "broken", "the reference generated nothing for this prompt to compare with"
        elif same:
            verdict, explanation = "identical", f"the same {n} greedy tokens as the reference"
        else:
            verdict, explanation = "drift", f"parts from the reference's generation at generated token {at}"
        return {
            "check": self.name,
            "target": g["target"],
            "reference": str(spec.reference),
            "adapter": g["adapter"],
            "tensor": f"prompt {g['index'] + 1}",
            "layer": None,
            "module": None,
            "role": "generation",
            "dtype": None,
            "shape": str(n),
            "numel": n,
            "bitwise_equal": same,
            "n_mismatch": None
            if at is None
            else sum(a != b for a, b in zip(g["tokens"], g["reference_tokens"], strict=False))
            + abs(n - len(g["reference_tokens"])),
            "verdict": verdict,
            "explanation": explanation,
            "note": "",
            "first_divergence": at,
        }

    def tables(
        self, spec: ProbeSpec, captures: list[Capture], reference_capture: Capture | None = None
    ) -> dict[str, pd.DataFrame]:
        """`generations`: every target's tokens and text per adapter and prompt, with its first divergence."""
        import pandas as pd

        # the reference's own generations first (it need not be among the targets)
        ref = reference_capture
        every = ([ref] if ref is not None else []) + [
            c for c in captures if ref is None or c.target != ref.target
        ]
        found = [{k: g[k] for k in TABLE_COLUMNS} for c in every for g in generations(c, ref)]
        table = pd.DataFrame(found, columns=list(TABLE_COLUMNS))
        table["first_divergence"] = table["first_divergence"].astype("Int64")
        return {GENERATIONS: table}


def generations(capture: Capture, reference: Capture | None) -> list[dict[str, Any]]:
    """The capture's generations, each with its target, adapter (None for the bare base), prompt index
    and first divergence from the reference's generation of the same adapter and prompt."""
    theirs = reference.meta.get(GENERATIONS, {}) if reference is not None else {}
    found = []
    for adapter, gens in capture.meta.get(GENERATIONS, {}).items():
        for i, g in enumerate(gens):
            ref = theirs.get(adapter, [])
            ref_tokens = ref[i]["tokens"] if i < len(ref) else None
            found.append(
                {
                    "target": capture.target,
                    "adapter": None if adapter == BASE else adapter,
                    "index": i,
                    **g,
                    "reference_tokens": ref_tokens or [],
                    "has_reference": ref_tokens is not None,
                    "first_divergence": None
                    if ref_tokens is None
                    else first_divergence(g["tokens"], ref_tokens),
                }
            )
    return found


def _who(adapter: str) -> str:
    return "base" if adapter == BASE else adapter


def divergence_sentences(table: pd.DataFrame) -> dict[str, str]:
    """{target: where its generation parts from the reference's} from the metrics table's `generate`
    rows: the earliest divergence over its models and prompts, and how many of them part."""
    if not len(table) or NAME not in set(table["check"]):
        return {}
    rows = table[(table["check"] == NAME) & (table["target"] != table["reference"])]
    found: dict[str, str] = {}
    for target, group in rows.groupby("target", sort=False):
        parted = group[group["first_divergence"].notna()]
        if not len(parted):
            found[target] = f"{target}: generates the reference's tokens for every model and prompt"
            continue
        first = parted.sort_values("first_divergence", kind="stable").iloc[0]
        who = first["adapter"] if isinstance(first["adapter"], str) else "base"
        found[target] = (
            f"{target}: its generation parts from the reference's at generated token "
            f"{int(first['first_divergence'])} ({who}, {first['tensor']}); "
            f"{len(parted)} of {len(group)} generations part"
        )
    return found


def _decode(tokenizer, tokens: list[int]) -> str | None:
    """The text of `tokens` (special tokens left out), or None without a tokenizer."""
    if tokenizer is None:
        return None
    try:
        return tokenizer.decode(tokens, skip_special_tokens=True)
    except Exception:  # ids a tokenizer cannot decode (outside its vocabulary): the tokens still say it
        return None
