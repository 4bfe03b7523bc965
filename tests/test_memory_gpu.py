"""The memory check on real GPUs: skipped without CUDA. Run when a GPU is lent (docs/gpu-validation.md)."""

from __future__ import annotations

import pytest
import torch

from core.demo.scenarios import demo_spec
from core.engine.jobs import Engine
from core.engine.runners import ProcessRunner
from core.models import memory

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def last_gpu() -> str:
    return f"cuda:{torch.cuda.device_count() - 1}"


def run(home, demo, target):
    engine = Engine(home, runner=ProcessRunner())
    job = engine.submit(demo_spec(demo, ["lora", "dora"], [f"{target}/float32"], ["memory"]))
    assert job.wait(600)
    assert job.state == "succeeded", job.error
    return engine.store.open(job.run_id)


def test_probe_sees_this_processs_context_and_memory():
    probe = memory.CudaProbe()
    assert probe.indices == list(range(torch.cuda.device_count()))
    x = torch.ones(1024, 1024, device="cuda:0")
    torch.cuda.synchronize()
    assert probe.context(0) is True
    assert probe.allocated(0) >= x.numel() * 4
    used = probe.driver_used(0, True)
    # None only where the driver cannot name this process (a container's pid namespace)
    assert used is None or used >= probe.reserved(0)
    del x


@pytest.mark.parametrize("where", ["first", "last"])
def test_torch_device_comparison_on_a_gpu(tmp_path, demo_workspace, where):
    target = "cuda:0" if where == "first" else last_gpu()
    if where == "last" and target == "cuda:0":
        pytest.skip("one GPU: the last is the first")
    record = run(tmp_path, demo_workspace, target)
    timeline = record.table("memory_timeline")
    placement = record.table("placement")
    for variant in ("torch_device", "no_torch_device"):
        part = timeline[(timeline["variant"] == variant) & (timeline["device"] == target)]
        loaded = part[part["stage"] == memory.BASE_LOADED].iloc[0]
        assert bool(loaded["context"]) and loaded["allocated"] > 0
        after = part[part["stage"] == memory.CLEANED_UP].iloc[0]
        assert after["allocated"] == 0  # every tensor given back
    # torch_device passed: every tensor and every byte on the target, nothing stray
    assert set(placement[placement["variant"] == "torch_device"]["device"]) == {target}
    rows = record.metrics()
    passed = rows[(rows["check"] == "memory") & (rows["variant"] == "torch_device")]
    assert set(passed["verdict"]) == {"identical"}, passed[["rule", "explanation"]]
    if target != "cuda:0":
        # not passed: PEFT loads the adapter state dict onto bare "cuda" (cuda:0) first
        stray = rows[(rows["variant"] == "no_torch_device") & (rows["rule"] == "stray device")]
        assert "cuda:0" in set(stray["device"]), rows[["variant", "rule", "device", "explanation"]]
