"""The float64 reference of a model too large for float64: held narrow, forward in float64 block by block."""

from __future__ import annotations

import pytest
import torch

from core.checks.outputs import forward_output
from core.models.loading import FLOAT64_FORWARD, forward_units, load_isolated
from core.spec import AdapterRef, ModelRef, Target

F64 = Target.parse("cpu/float64")


def _outputs(base: str, adapters: tuple[AdapterRef, ...], offload: bool, monkeypatch) -> list:
    # A negative headroom makes every model "too large for float64".
    monkeypatch.setattr("core.models.checkpoint.FLOAT64_HEADROOM", -(1 << 40) if offload else 1 << 40)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    out = []
    for loaded in load_isolated(ModelRef(base), adapters, F64):
        inner = loaded.model.get_base_model() if loaded.adapter else loaded.model
        assert getattr(inner, FLOAT64_FORWARD, False) == offload
        dtypes = {p.dtype for p in loaded.model.parameters()}
        if offload:
            assert (
                torch.float64 not in dtypes or loaded.adapter is not None and "pissa" in loaded.adapter.name
            )
        out.append(
            (loaded.adapter.name if loaded.adapter else "-", forward_output(loaded.model, {"input_ids": ids}))
        )
        # the forward leaves the weights as they were held
        assert {p.dtype for p in loaded.model.parameters()} == dtypes
    return out


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-bert"])
def test_block_by_block_equals_float64_bitwise(model, demo_workspace, monkeypatch):
    ws = demo_workspace
    names = [
        n
        for n, a in ws["adapters"].items()
        if a["base"] == model and n in ("lora", "dora", "boft", "pissa", "ia3", "bert-lora")
    ]
    adapters = tuple(AdapterRef(ws["adapters"][n]["path"], n) for n in names)
    assert len(names) >= (5 if model == "tiny-llama" else 1)
    full = _outputs(ws["models"][model], adapters, False, monkeypatch)
    held = _outputs(ws["models"][model], adapters, True, monkeypatch)
    assert [n for n, _ in full] == [n for n, _ in held] == ["-", *names]
    for (name, (_, a)), (_, (_, b)) in zip(full, held, strict=True):
        assert a.dtype == b.dtype == torch.float64, name
        assert torch.equal(a, b), f"{name}: max |Δ| {(a - b).abs().max().item()}"


def test_real_encoder_block_by_block_equals_float64_bitwise(minilm, monkeypatch):
    adapters = (AdapterRef(str(minilm["lora"]), "lora"),)
    full = _outputs(str(minilm["base"]), adapters, False, monkeypatch)
    held = _outputs(str(minilm["base"]), adapters, True, monkeypatch)
    for (_, (_, a)), (_, (_, b)) in zip(full, held, strict=True):
        assert torch.equal(a, b)


def test_forward_units_are_blocks_and_top_level_pieces(demo_workspace):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_workspace["models"]["tiny-llama"])
    units = forward_units(model)
    layers = list(model.model.layers)
    assert all(any(u is layer for u in units) for layer in layers)
    assert any(u is model.model.embed_tokens for u in units) and any(u is model.lm_head for u in units)
    # every parameter belongs to exactly one unit
    owned = [id(p) for u in units for p in u.parameters()]
    assert sorted(set(owned)) == sorted({id(p) for p in model.parameters()})
