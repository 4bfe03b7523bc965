"""The benchmark's quick pieces: the synthetic checkpoint generator, the naive statistics, the
RSS sampler, size parsing. The measurements themselves are run by `python -m bench`."""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from bench.checkpoints import ensure_checkpoint, spec_for
from bench.e2e import run_sampled, stage_timeline
from bench.kernel import format_size, make_case, naive_stats, naive_ulp, parse_size

SMALL_SHARDS = 120_000  # bytes: the tiny model (≈0.5 MB in float32) is split into several shards


def _file_hashes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "manifest.json"  # the manifest records times
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generator_is_deterministic_and_sharded(tmp_path: Path, dtype: str) -> None:
    spec = spec_for("tiny", dtype, max_shard_bytes=SMALL_SHARDS)
    a = ensure_checkpoint(spec, cache=tmp_path / "a")
    b = ensure_checkpoint(spec, cache=tmp_path / "b")
    assert _file_hashes(a.root) != {}
    # Same bytes, except the adapter config naming its own base folder.
    ha, hb = _file_hashes(a.root), _file_hashes(b.root)
    ha.pop("adapter/adapter_config.json"), hb.pop("adapter/adapter_config.json")
    assert ha == hb

    shards = sorted(a.model_dir.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1
    index = json.loads((a.model_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    from safetensors import safe_open

    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert all(f.get_tensor(k).dtype == getattr(torch, dtype) for k in f.keys())  # noqa: SIM118
    with safe_open(str(a.adapter_dir / "adapter_model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}  # noqa: SIM118
    assert a.model_bytes == sum(p.stat().st_size for p in shards)
    assert json.loads((a.model_dir / "config.json").read_text())["dtype"] == dtype


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transformers_and_peft_load_it_as_save_pretrained_writes_it(tmp_path: Path, dtype: str) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ck = ensure_checkpoint(spec_for("tiny", dtype, max_shard_bytes=SMALL_SHARDS), cache=tmp_path)
    model, info = AutoModelForCausalLM.from_pretrained(
        ck.model_dir, dtype=getattr(torch, dtype), output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    stored: dict[str, torch.Tensor] = {}
    for shard in ck.model_dir.glob("*.safetensors"):
        stored.update(load_file(str(shard)))
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in stored.items())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, stored once
    assert sum(p.numel() for p in model.parameters()) == ck.n_params

    # save_pretrained of the loaded model writes the same tensor names and shard files (which
    # tensor goes to which shard may differ: its packing is its own).
    model.save_pretrained(tmp_path / "resaved", max_shard_size=SMALL_SHARDS)
    ours = json.loads((ck.model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    theirs = json.loads((tmp_path / "resaved/model.safetensors.index.json").read_text())["weight_map"]
    assert ours.keys() == theirs.keys()
    assert set(ours.values()) == set(theirs.values())
    assert {p.name for p in (tmp_path / "resaved").iterdir()} == {p.name for p in ck.model_dir.iterdir()}

    ids = torch.tensor([[1, 5, 17, 42, 99, 128, 200, 255]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
        peft_model = PeftModel.from_pretrained(model, ck.adapter_dir)
        after = peft_model(input_ids=ids).logits
    lora_b = [p for n, p in peft_model.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 2 * 2  # q_proj and v_proj in both layers
    assert all(bool(p.abs().sum() > 0) for p in lora_b)  # a trained adapter: B is not zero
    assert not torch.equal(before, after)
    assert torch.isfinite(after).all()


def test_cache_is_reused_and_regenerated_when_stale(tmp_path: Path) -> None:
    spec = spec_for("tiny", "bfloat16")
    first = ensure_checkpoint(spec, cache=tmp_path)
    again = ensure_checkpoint(spec, cache=tmp_path, progress=lambda m: pytest.fail(f"regenerated: {m}"))
    assert again.manifest["generated_at"] == first.manifest["generated_at"]

    messages: list[str] = []
    reseeded = ensure_checkpoint(
        spec_for("tiny", "bfloat16", seed=7), cache=tmp_path, progress=messages.append
    )
    assert messages and reseeded.root == first.root
    assert reseeded.manifest["config_hash"] != first.manifest["config_hash"]

    # A truncated shard is not a cached checkpoint.
    shard = next(reseeded.model_dir.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:100])
    messages.clear()
    ensure_checkpoint(spec_for("tiny", "bfloat16", seed=7), cache=tmp_path, progress=messages.append)
    assert messages
    assert not list(tmp_path.glob(".build-*"))  # no half build left behind


def test_sizes_are_about_what_they_are_called() -> None:
    from bench.checkpoints import _meta_models

    for size, expected in (("100m", 100e6), ("400m", 400e6), ("1b", 1.1e9)):
        params, _ = _meta_models(spec_for(size))
        n = sum(math.prod(shape) for _, shape in params)
        assert 0.85 * expected < n < 1.15 * expected, (size, n)
    # Llama-3-8B's shapes, to the parameter (its model card's 8.03 B), drawn on the GPU where one is
    params, _ = _meta_models(spec_for("8b", "bfloat16"))
    assert sum(math.prod(shape) for _, shape in params) == 8_030_261_248


def test_a_checkpoint_drawn_on_the_gpu_has_a_key_and_folder_of_its_own() -> None:
    from bench.checkpoints import generator_device

    cpu, gpu = spec_for("8b", "bfloat16"), spec_for("8b", "bfloat16", generate_on="cuda")
    assert (cpu.folder_name, gpu.folder_name) == ("8b-bfloat16", "8b-bfloat16-cuda")
    assert cpu.config_hash() != gpu.config_hash()
    assert generator_device("100m") == "cpu"  # the small sizes are the CPU's bytes everywhere
    assert generator_device("8b") == ("cuda" if torch.cuda.is_available() else "cpu")


def test_naive_stats_follow_the_definitions() -> None:
    r = torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0])
    t = r.clone()
    t[0] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))  # 1 ulp up
    t[2] = 0.25  # far off
    t[3] = 1e-6  # within atol
    rtol, atol = 1.3e-6, 1e-5
    s = naive_stats(t, r, rtol, atol)
    d = t.double() - r.double()
    assert s["max_abs"] == 0.25 and s["worst_index"] == 2
    assert s["n_diff"] == 3
    assert s["n_mismatch"] == int((~torch.isclose(t, r, rtol=rtol, atol=atol)).sum()) == 1
    assert s["mean_abs"] == pytest.approx(float(d.abs().mean()))
    assert s["rmse"] == pytest.approx(math.sqrt(float((d * d).mean())))
    assert s["cos_sim"] == pytest.approx(
        float(torch.nn.functional.cosine_similarity(t.double(), r.double(), dim=0))
    )
    assert s["min_atol"] == pytest.approx(0.25 - rtol * 0.5)
    # ulp of float32 at 1.0 is 2^-23, at 0 the smallest subnormal 2^-149
    ulp = naive_ulp(torch.tensor([1.0, 0.0, 3.0], dtype=torch.float64), torch.float32)
    assert ulp.tolist() == [2.0**-23, 2.0**-149, 2.0**-22]
    # the largest is where the reference is 0: 1e-6 is ~2^129 subnormal spacings of float32
    assert s["max_ulp"] == float(t[3]) / 2.0**-149


def test_cases_are_what_they_say() -> None:
    t, r = make_case("identical-f32", 1000)
    assert torch.equal(t, r) and t.data_ptr() != r.data_ptr()
    t, r = make_case("f32-diff-1pct", 100_000)
    assert 500 < int((t != r).sum()) < 1500
    t, r = make_case("bf16-vs-f32", 1000)
    assert t.dtype == torch.bfloat16 and r.dtype == torch.float32


def test_size_parsing() -> None:
    assert parse_size("64MiB") == 64 << 20
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("500MB") == 500 * 10**6
    assert format_size(256 << 20) == "256MiB"
    with pytest.raises(ValueError):
        parse_size("lots")


def test_tree_sampler_sees_children() -> None:
    # The parent holds little; its child holds 200 MB: the tree's peak must include the child.
    child = "import time; x = bytearray(200_000_000); time.sleep(1.0)"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"
    m = run_sampled([sys.executable, "-c", parent], interval=0.05, timeout=60)
    assert m.returncode == 0
    assert m.max_procs >= 2
    assert m.peak_rss > 200_000_000
    assert m.max_process_hwm > 200_000_000


def test_stage_timeline_parses_the_cli_progress_lines() -> None:
    text = (
        "run 1: 2 target(s)\n"
        "cpu/float32                  [##########..........]  3/6  load base (12.5 s)\n"
        "garbage\n"
    )
    assert stage_timeline(text) == [
        {"task": "cpu/float32", "step": 3, "of": 6, "stage": "load base", "t": 12.5}
    ]


def _rep(index: int, heatmap: float | None, last: float | None, ready: float | None, ok: bool = True) -> dict:
    return {
        "index": index,
        "run_id": f"20261123-1200{index:02d}-abcdef",
        "ok": ok,
        "status": "succeeded" if ok else "failed",
        "error": None if ok else "run ended failed: boom",
        "first_heatmap_s": heatmap,
        "last_page_s": last,
        "weights_deltas_ready_s": ready,
        "run_started_after_click_s": 0.2,
        "status_at_first_heatmap": "running",
    }


def test_dashboard_summary_takes_medians_of_the_runs_that_succeeded() -> None:
    from bench.dashboard import dashboard_table, summarize

    runs = [
        _rep(1, 4.0, 30.0, 2.0),
        _rep(2, 6.0, 20.0, 3.0),
        _rep(3, 5.0, 25.0, 2.5),
        _rep(4, 5.5, None, 2.2),
    ]
    runs.append(_rep(5, 1.0, 1.0, 0.5, ok=False))  # a failed repetition counts as failed, not in the medians
    s = summarize(runs)
    assert (s["runs"], s["succeeded"], s["failed"]) == (5, 4, 1)
    assert s["first_heatmap_s"] == {"median": 5.25, "min": 4.0, "max": 6.0, "n": 4}
    assert s["last_page_s"] == {
        "median": 25.0,
        "min": 20.0,
        "max": 30.0,
        "n": 3,
    }  # a missing value is skipped
    assert s["weights_deltas_ready_s"]["median"] == 2.35
    assert summarize([])["first_heatmap_s"] is None

    table = dashboard_table({"runs": runs, "summary": s}).splitlines()
    assert len(table) == 2 + 5 + 1  # header, one row per repetition, the median row
    assert table[-1].startswith("| median (min–max) of 4 | **5.2** (4.0–6.0) | **25.0** (20.0–30.0) |")
    assert "4/5 succeeded" in table[-1]
    assert "✗ run ended failed: boom" in table[-2]


def test_dashboard_engine_timeline_finds_the_heatmaps_compare_task() -> None:
    from bench.dashboard import engine_timeline

    info = {
        "started": 1000.0,
        "targets": {
            "cpu/float32": {"started": 1000.1, "finished": 1004.0},
            "compare · weights, deltas": {"started": 1006.0, "finished": 1007.5},
            "compare · outputs, merge, activations": {"started": 1010.0, "finished": 1012.0},
            "compare": {"started": 1020.0, "finished": None},
        },
    }
    t = engine_timeline(info)
    assert t["weights_deltas_ready_s"] == 7.5
    assert list(t["task_finished_s"]) == [
        "cpu/float32",
        "compare · weights, deltas",
        "compare · outputs, merge, activations",
    ]
    assert engine_timeline({"started": None, "targets": {}})["weights_deltas_ready_s"] is None


def test_bench_parser_has_the_dashboard_options() -> None:
    from bench.__main__ import build_parser

    args = build_parser().parse_args([])
    assert (args.dashboard_runs, args.skip_dashboard) == (5, False)
    args = build_parser().parse_args(["--skip-kernel", "--skip-e2e", "--dashboard-runs", "3"])
    assert (args.dashboard_runs, args.skip_dashboard, args.skip_kernel, args.skip_e2e) == (
        3,
        False,
        True,
        True,
    )
    assert build_parser().parse_args(["--skip-dashboard"]).skip_dashboard
    args = build_parser().parse_args(["--cli-runs", "2", "--skip-cli"])
    assert (args.cli_runs, args.skip_cli) == (2, True)


def test_cli_demo_summary_takes_the_ratio_of_the_medians_of_the_runs_that_succeeded() -> None:
    from bench.cli_demo import cli_demo_table, summarize

    def rep(bare, run, ok=True):
        return {"bare_import": {"wall_s": bare}, "run": {"wall_s": run}, "ok": ok, "ratio": run / bare}

    runs = [rep(4.0, 12.0), rep(5.0, 20.0), rep(3.0, 15.0), rep(1.0, 100.0, ok=False)]
    s = summarize(runs)
    assert (s["repeats_ok"], s["failed"]) == (3, 1)
    assert (s["bare_import_median_s"], s["run_median_s"], s["ratio_of_medians"]) == (4.0, 15.0, 3.75)
    assert s["ratio_range"] == [3.0, 5.0] and s["met"]
    assert not summarize([rep(2.0, 9.0)])["met"]
    assert summarize([]) == {"repeats_ok": 0, "failed": 0}
    assert cli_demo_table({"runs": runs, "summary": s}).splitlines()[-1] == (
        "| 4.00 | 15.00 | 3.75 | 3.00–5.00 (3 ok, 1 failed) | ≤ 4× ✓ |"
    )
    assert cli_demo_table({"runs": [], "summary": summarize([]), "error": "no demo"}) == (
        "No repetition succeeded: no demo."
    )
