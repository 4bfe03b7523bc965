"""`outputs`: logits (or last hidden states) on the fixed probe inputs, each target against
`cpu/float64`, with health flags (NaN/Inf, all-zero, all rows identical)."""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING, Any

import torch

from core.capture import BASE, Capture, TensorKey
from core.checks.base import REFERENCE_TARGET, CaptureContext, Check, Reference, add_note
from core.models.loading import FLOAT64_FORWARD, Loaded, float32_fallbacks, float64_forward
from core.numerics import metrics
from core.numerics.behaviour import Behaviour, next_token_behaviour
from core.spec import ProbeSpec, Target

if TYPE_CHECKING:
    import pandas as pd

# The columns an LM head's logits row gains (`core.numerics.behaviour`); the capture says it has one.
BEHAVIOUR_COLUMNS = ("kl_mean", "kl_max", "top1_agree", "top5_overlap")
LM_HEAD = "lm_head"


def forward_output(model, probe: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
    """Run the model on the probe (`probes.probe_inputs`); return the first of `forward_outputs`:
    ("logits", …), ("start_logits", …) or ("last_hidden_state", …)."""
    return next(iter(forward_outputs(model, probe).items()))


def forward_outputs(model, probe: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run the model on the probe (`probes.probe_inputs`); the outputs its users look at, by name
    (`output_tensors`): a head's logits (a question-answering head's start and end logits, CLIP's
    logits per image and per text and its embeddings, …), or a bare model's last hidden state and,
    where it pools, its pooled output.

    Float inputs (pixel values, audio features, waveforms) are cast to the dtype the model computes
    in: its parameters', or float64 for a model held narrow for a float64 forward. In float64, an op
    with no float64 kernel runs in float32 (`loading.float32_fallbacks`), named by
    `float32_fallback_notes`.
    """
    param = next(model.parameters())
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    dtype = torch.float64 if getattr(inner, FLOAT64_FORWARD, False) else param.dtype
    kwargs: dict[str, Any] = {
        name: t.to(param.device, dtype=dtype if t.is_floating_point() else t.dtype)
        for name, t in probe.items()
    }
    # a reference's op without a float64 kernel runs in float32 rather than failing the run
    fallback = float32_fallbacks(model) if dtype == torch.float64 else contextlib.nullcontext()
    with torch.no_grad(), float64_forward(model), fallback:
        out = model(**kwargs)
    return output_tensors(out)


def output_tensors(out: Any) -> dict[str, torch.Tensor]:
    """Every floating tensor field of a model's output object, by its field name, in its order; where
    the model has a head (a field named `…logits`), the hidden states beside it (an encoder-decoder's
    `encoder_last_hidden_state`) are left out: they are the head's input, which `activations` follows.

    Nested outputs (CLIP's `text_model_output`), caches and loss-free `None` fields are not outputs of
    their own. ValueError when the object holds no floating tensor at all.
    """
    fields = out.items() if isinstance(out, dict) else [("logits", out)] if torch.is_tensor(out) else []
    tensors = {k: v for k, v in fields if torch.is_tensor(v) and v.is_floating_point()}
    if any(k.endswith("logits") for k in tensors):
        tensors = {k: v for k, v in tensors.items() if not _HIDDEN.search(k)}
    if not tensors:
        raise ValueError(f"the model's output ({type(out).__name__}) holds no floating tensor to compare")
    return tensors


# A field holding hidden states: `last_hidden_state`, `encoder_last_hidden_state`, `hidden_states`.
_HIDDEN = re.compile(r"hidden_states?$")


class OutputsCheck(Check):
    name = "outputs"
    description = "model outputs on the probe inputs against cpu/float64, with health flags"
    against = REFERENCE_TARGET

    def capture(self, ctx: CaptureContext, loaded: Loaded, out: Capture) -> None:
        adapter = BASE if loaded.adapter is None else loaded.adapter.name
        for kind, tensor in forward_outputs(loaded.model, ctx.probe).items():
            out.add(TensorKey(self.name, adapter, kind), tensor)
        # a language-model head's logits are next-token distributions: `rows` adds what they say,
        # over the positions the attention mask keeps (a batch of prompts is padded)
        if has_lm_head(loaded.model):
            out.meta[LM_HEAD] = True
            if "attention_mask" in ctx.probe:
                out.meta["attention_mask"] = ctx.probe["attention_mask"].tolist()

    def reference(
        self, spec: ProbeSpec, keys: list[TensorKey], reference_capture: Capture | None
    ) -> Reference:
        if reference_capture is None:
            return Reference(label=str(spec.reference), tensors={}, notes={})
        load_notes = reference_capture.meta.get("load_notes", {})
        notes = {
            k.encode(): "reference: " + "; ".join(load_notes[k.adapter])
            for k in keys
            if k.adapter in load_notes
        }
        tensors = {
            k.encode(): reference_capture.tensors[k.encode()]
            for k in keys
            if k.encode() in reference_capture.tensors
        }
        return Reference(label=str(spec.reference), tensors=tensors, notes=notes)

    def describe(self, key: TensorKey) -> dict[str, Any]:
        return {"layer": None, "module": key.name, "role": "output"}

    def rows(self, spec: ProbeSpec, capture: Capture, reference: Reference) -> list[dict[str, Any]]:
        rows = super().rows(spec, capture, reference)
        target = Target.parse(capture.target)
        flags = target.flags
        for row in rows:
            # Identical rows are a collapse only where they also miss the reference beyond tolerance: rows
            # the reference tells apart by less than that (a classifier's logits 1e-8 apart) may well
            # round to the same values in bfloat16, which is within tolerance, not broken.
            if row.pop(_ROWS_COLLAPSED, False) and row["verdict"] == "drift":
                row["verdict"] = "broken"
                row["explanation"] = (
                    f"all output rows are identical while the reference's are not · {row['explanation']}"
                )
            if row["verdict"] in ("identical", "within tolerance"):
                continue
            how = f"forward pass in {target.dtype}" + (f" with {', '.join(flags)}" if flags else "")
            add_note(row, f"{how} against {reference.label}")
        by_key = {(row["adapter"] or BASE, row["tensor"]): row for row in rows}
        for key, found in behaviours(capture, reference.tensors):
            by_key[(key.adapter, key.name)].update(found.summary())
        return rows

    def tables(
        self, spec: ProbeSpec, captures: list[Capture], reference_capture: Capture | None = None
    ) -> dict[str, pd.DataFrame]:
        """`kl_positions`: KL(p_ref ‖ p_target) at every kept position of an LM head's logits, per
        target and adapter (what the Outputs page draws over position)."""
        import pandas as pd

        ref = reference_capture
        if ref is None:
            return {}
        found = [
            {
                "target": capture.target,
                "adapter": None if key.adapter == BASE else key.adapter,
                "tensor": key.name,
                "row": int(r),
                "position": int(p),
                "kl": float(kl),
            }
            for capture in captures
            if capture.target != ref.target
            for key, b in behaviours(capture, ref.tensors)
            for r, p, kl in zip(b.rows.tolist(), b.positions.tolist(), b.kl.tolist(), strict=True)
        ]
        return {"kl_positions": pd.DataFrame(found)} if found else {}

    def extra_columns(self, key: TensorKey, tensor: torch.Tensor, ref: torch.Tensor | None) -> dict[str, Any]:
        h = metrics.health(tensor)
        cols: dict[str, Any] = {
            "health_nan": h.n_nan,
            "health_inf": h.n_inf,
            "health_all_zero": h.all_zero,
            "health_identical_rows": h.identical_rows,
        }
        if ref is not None and h.identical_rows and not h.all_zero and not metrics.health(ref).identical_rows:
            cols[_ROWS_COLLAPSED] = True  # judged in `rows`, against the row's tolerance verdict
        cols.update(nonfinite_output(h))
        return cols


def has_lm_head(model) -> bool:
    """Whether the model's logits are next-token (or masked-token) distributions over its vocabulary:
    it has output embeddings (an LM head), as `generate` and masked-LM models do."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    getter = getattr(inner, "get_output_embeddings", None)
    return callable(getter) and getter() is not None


def behaviours(capture: Capture, reference: dict[str, torch.Tensor]) -> list[tuple[TensorKey, Behaviour]]:
    """`next_token_behaviour` of each of the capture's LM-head logits against the reference's (by
    encoded key), over the positions its attention mask keeps; none for a model without an LM head."""
    if not capture.meta.get(LM_HEAD):
        return []
    mask = capture.meta.get("attention_mask")
    found = []
    for key in capture.keys(OutputsCheck.name):
        tensor, ref = capture.get(key), reference.get(key.encode())
        if (
            key.name != "logits"
            or tensor is None
            or ref is None
            or ref.shape != tensor.shape
            or tensor.dim() != 3
        ):
            continue
        keep = None if mask is None else _probe_positions(torch.tensor(mask), tensor.shape[:2])
        if mask is None or keep is not None:
            found.append((key, next_token_behaviour(ref, tensor, keep)))
    return found


def _probe_positions(mask: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor | None:
    """The probe's attention mask over logits of (batch, positions) `shape`: prompt learning puts its
    virtual tokens first, and their positions are no probe position (kept out); None where the two
    cannot be lined up."""
    extra = shape[1] - mask.shape[1]
    if mask.shape[0] != shape[0] or extra < 0:
        return None
    return torch.cat([torch.zeros(shape[0], extra, dtype=mask.dtype), mask], dim=1)


# A row's private mark from `extra_columns` for `rows`: its rows are identical, the reference's are not.
_ROWS_COLLAPSED = "_rows_collapsed"


def nonfinite_output(h: metrics.Health) -> dict[str, Any]:
    """A `broken` verdict for outputs holding NaN/Inf, even where the reference holds the same.

    The tolerance rule counts NaN == NaN as equal (assert_close's equal_nan); for weights that is
    right (the file holds them), for a model's outputs it never is.
    """
    if not (h.n_nan or h.n_inf):
        return {}
    return {
        "verdict": "broken",
        "explanation": f"the outputs hold {h.n_nan} NaN and {h.n_inf} Inf: a weight or adapter tensor "
        "is not finite, or the forward pass overflowed",
    }
