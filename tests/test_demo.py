"""The offline demo workspace: contents, loadability, determinism, idempotence, atomicity."""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from pathlib import Path

import pytest
import torch

from core.demo.build import DEMO_VERSION, build_demo, load_manifest
from core.methods.adapter_keys import adapter_type

LLAMA_ADAPTERS = [
    "lora",
    "dora",
    "pissa_init",
    "pissa",
    "pissa_lora",
    "boft",
    "oft",
    "ia3",
    "lora_b",
    "lora_lm_head",
    "lora_embed",
    "lora_noop",
]
EXPECTED_TYPES = {
    "lora": "lora",
    "dora": "dora",
    "pissa_init": "pissa",
    "pissa": "pissa",
    "pissa_lora": "lora",
    "boft": "boft",
    "oft": "oft",
    "ia3": "ia3",
    "bert-lora": "lora",
    "lora_b": "lora",
    "lora_lm_head": "lora",
    "lora_embed": "lora",
    "lora_nan": "lora",
    "lora_noop": "lora",
    "lora_tie": "lora",
}
TOKENS = torch.tensor([[1, 5, 17, 42, 99, 128, 200, 255, 3, 64, 7, 31]])


def _hashes(root: Path) -> dict[str, str]:
    """sha256 of every safetensors and tokenizer file under ``root``, by relative path."""
    files = [*root.rglob("*.safetensors"), *root.rglob("tokenizer*.json")]
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(files)}


def _home(manifest: dict) -> Path:
    """The ``home`` a manifest was built under (its models live in home/demo/models)."""
    return Path(manifest["models"]["tiny-llama"]).parents[2]


def _load(cls_name: str, path: str) -> torch.nn.Module:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return getattr(transformers, cls_name).from_pretrained(path, dtype=torch.float32).eval()


def test_manifest_content(demo_workspace: dict) -> None:
    m = demo_workspace
    assert m["version"] == DEMO_VERSION
    assert set(m["models"]) == {"tiny-llama", "tiny-bert"}
    assert set(m["adapters"]) == set(EXPECTED_TYPES)
    root = _home(m) / "demo"
    for name, path in m["models"].items():
        assert Path(path).is_absolute() and Path(path) == root / "models" / name
        assert (Path(path) / "model.safetensors").is_file()
    for name, entry in m["adapters"].items():
        path = Path(entry["path"])
        assert path.is_absolute() and path == root / "adapters" / name
        assert entry["type"] == EXPECTED_TYPES[name]
        assert entry["base"] == ("tiny-bert" if name == "bert-lora" else "tiny-llama")
        config = json.loads((path / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == m["models"][entry["base"]]
        assert adapter_type(config) == entry["type"]
        assert (path / "adapter_model.safetensors").is_file()
    assert json.loads((root / "manifest.json").read_text()) == m
    assert load_manifest(_home(m)) == m


def test_model_configs_and_dtype(demo_workspace: dict) -> None:
    from safetensors.torch import load_file

    llama = json.loads((Path(demo_workspace["models"]["tiny-llama"]) / "config.json").read_text())
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    assert [llama[k] for k in sizes] == [256, 64, 128, 4]
    assert [llama[k] for k in ("num_attention_heads", "num_key_value_heads")] == [4, 2]
    assert llama["tie_word_embeddings"] is True
    bert = json.loads((Path(demo_workspace["models"]["tiny-bert"]) / "config.json").read_text())
    assert (bert["vocab_size"], bert["hidden_size"], bert["num_hidden_layers"]) == (256, 64, 2)
    for path in [p for p in _hashes(_home(demo_workspace) / "demo") if p.endswith(".safetensors")]:
        tensors = load_file(_home(demo_workspace) / "demo" / path)
        assert {t.dtype for t in tensors.values()} == {torch.float32}, path


def test_adapter_configs_as_specified(demo_workspace: dict) -> None:
    def config(name: str) -> dict:
        path = Path(demo_workspace["adapters"][name]["path"])
        return json.loads((path / "adapter_config.json").read_text())

    lora = config("lora")
    assert (lora["r"], lora["lora_alpha"], len(lora["target_modules"])) == (8, 16, 7)
    assert config("dora")["use_dora"] is True
    assert config("pissa")["init_lora_weights"] == "pissa" == config("pissa_init")["init_lora_weights"]
    assert (config("pissa")["r"], config("pissa")["lora_alpha"]) == (8, 8)
    assert (config("pissa_lora")["r"], config("pissa_lora")["lora_alpha"]) == (16, 16)  # rank doubles
    assert config("boft")["boft_block_size"] == 8
    oft = config("oft")
    assert (oft["use_cayley_neumann"], oft["num_cayley_neumann_terms"], oft["coft"]) == (True, 5, False)
    assert config("ia3")["feedforward_modules"] == ["down_proj"]
    assert config("lora_lm_head")["target_modules"] == ["lm_head", "q_proj"]
    assert config("lora_embed")["target_modules"] == ["embed_tokens", "q_proj"]


def test_the_demo_tokenizer_is_bytes_and_matches_the_vocabulary(demo_workspace: dict) -> None:
    from transformers import AutoTokenizer

    folder = Path(demo_workspace["models"]["tiny-llama"])
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in folder.iterdir()}
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    config = json.loads((folder / "config.json").read_text())
    assert len(tokenizer) == config["vocab_size"] == 256
    text = "Drift — naïve"
    assert tokenizer(text)["input_ids"] == list(text.encode())
    assert tokenizer.decode(list(text.encode())) == text
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.padding_side) == (0, 2, "left")


def test_scenario_adapters(demo_workspace: dict) -> None:
    from core.demo.build import NAN_MODULE
    from core.models.checkpoint import read_checkpoint

    def tensors(name: str) -> dict[str, torch.Tensor]:
        return read_checkpoint(demo_workspace["adapters"][name]["path"], prefix="adapter_model")

    nan = {k for k, t in tensors("lora_nan").items() if t.isnan().any()}
    assert nan == {f"base_model.model.{NAN_MODULE}.lora_B.weight"}
    assert int(tensors("lora_nan")[nan.pop()].isnan().sum()) == 1
    noop = tensors("lora_noop")
    assert all(not t.any() for k, t in noop.items() if ".lora_B." in k)
    assert any(t.any() for k, t in noop.items() if ".lora_A." in k)
    assert any("lora_embedding_A" in k for k in tensors("lora_embed"))


def test_every_adapter_loads_and_changes_the_output(demo_workspace: dict) -> None:
    from peft import PeftModel

    llama_path = demo_workspace["models"]["tiny-llama"]
    with torch.no_grad():
        reference = _load("AutoModelForCausalLM", llama_path)(TOKENS).logits
        for name in LLAMA_ADAPTERS:
            base = _load("AutoModelForCausalLM", llama_path)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = PeftModel.from_pretrained(base, demo_workspace["adapters"][name]["path"]).eval()
            diff = (model(TOKENS).logits - reference).abs().max().item()
            if name == "pissa_init":
                # PiSSA's starting point: residual base + principal part == the base model
                assert diff < 1e-4, (name, diff)
            elif name == "lora_noop":
                assert diff == 0, (name, diff)  # B = 0: the adapter is not applied at all
            else:
                assert diff > 1e-2, (name, diff)

        bert_path = demo_workspace["models"]["tiny-bert"]
        reference = _load("AutoModel", bert_path)(TOKENS).last_hidden_state
        model = PeftModel.from_pretrained(
            _load("AutoModel", bert_path), demo_workspace["adapters"]["bert-lora"]["path"]
        )
        assert (model.eval()(TOKENS).last_hidden_state - reference).abs().max().item() > 1e-2


def test_second_build_is_byte_identical_and_fast(demo_workspace: dict, tmp_path: Path) -> None:
    calls: list[tuple[str, int, int]] = []
    start = time.perf_counter()
    other = build_demo(tmp_path, progress=lambda stage, k, n: calls.append((stage, k, n)))
    elapsed = time.perf_counter() - start
    assert elapsed < 60, elapsed
    first = _hashes(_home(demo_workspace) / "demo")
    assert len(first) == 19  # 2 models + 15 adapters + the tiny Llama's 2 tokenizer files
    assert _hashes(tmp_path / "demo") == first
    assert other["models"]["tiny-llama"] == str(tmp_path.resolve() / "demo/models/tiny-llama")
    assert [k for _, k, _ in calls] == list(range(1, 18)) and {n for *_, n in calls} == {17}
    assert ("adapter dora", 4, 17) in calls


def test_existing_workspace_is_returned_untouched(demo_workspace: dict) -> None:
    root = _home(demo_workspace) / "demo"
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    calls: list[tuple[str, int, int]] = []
    again = build_demo(_home(demo_workspace), progress=lambda *a: calls.append(a))
    assert again == demo_workspace
    assert calls == []
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == before


def test_crash_mid_build_leaves_no_demo_folder(tmp_path: Path) -> None:
    def crash(stage: str, k: int, n: int) -> None:
        if stage == "adapter oft":
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        build_demo(tmp_path, progress=crash)
    assert list(tmp_path.iterdir()) == []  # neither demo/ nor the temporary build folder
    assert load_manifest(tmp_path) is None


def test_stale_workspace_is_rebuilt(tmp_path: Path) -> None:
    stale = tmp_path / "demo"
    (stale / "models").mkdir(parents=True)
    (stale / "manifest.json").write_text(json.dumps({"version": "0", "models": {}, "adapters": {}}))
    assert load_manifest(tmp_path) is None
    manifest = build_demo(tmp_path)
    assert manifest["version"] == DEMO_VERSION
    assert load_manifest(tmp_path) == manifest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]  # old copy and temp folder removed


def test_missing_folder_makes_the_workspace_incomplete(tmp_path: Path, demo_workspace: dict) -> None:
    manifest = dict(demo_workspace)
    manifest["adapters"] = dict(manifest["adapters"], ghost={"path": "/nonexistent", "type": "lora"})
    root = tmp_path / "demo"
    root.mkdir()
    (root / "manifest.json").write_text(json.dumps(manifest))
    assert load_manifest(tmp_path) is None
    assert load_manifest(tmp_path / "nowhere") is None
