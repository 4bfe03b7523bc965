"""The Merge residuals page under AppTest, on a stored merge run (tied embeddings, NaN, LoRA)."""

from __future__ import annotations

import pytest
from apptest import make_app

from core.demo import build_demo
from core.engine import Engine, InProcessRunner
from core.scenarios import demo_spec


@pytest.fixture(scope="module")
def merge_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("merge-app")
    manifest = build_demo(home)
    spec = demo_spec(manifest, ["lora", "lora_embed", "lora_nan"], ["cpu/float32", "cpu/bfloat16"], ["merge"])
    job = Engine(home, runner=InProcessRunner()).submit(spec)
    assert job.wait(300) and job.state == "succeeded", job.error
    return home, job.run_id


@pytest.mark.parametrize("adapter", ["lora_embed", "lora_nan", "lora"])
def test_merge_page_renders(merge_home, monkeypatch, adapter):
    home, run_id = merge_home
    at = make_app(home, monkeypatch, run=run_id, adapter=adapter)
    at.switch_page("views/merge.py").run()
    assert not at.exception, [e.value for e in at.exception]
    text = "\n".join(
        str(e.value) for kind in ("error", "success", "warning", "subheader") for e in getattr(at, kind)
    )
    assert "Save round trip" in text or adapter == "lora_nan"
    if adapter == "lora_embed":
        assert "Tied weights" in text and "untie before merging" in text
        assert "Some tensors share memory" in text
    if adapter == "lora_nan":
        assert "model.layers.1.self_attn.v_proj" in text
    assert any(b.label.startswith("bfloat16 merge residual") for b in at.button)


def test_merge_page_without_merge_rows(tmp_path, monkeypatch):
    at = make_app(tmp_path, monkeypatch)
    at.switch_page("views/merge.py").run()
    assert not at.exception
