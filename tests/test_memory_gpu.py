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


# torch's own ways to release and size cuBLAS's workspace (torch 2.11–2.13 have both; guarded all the same)
CAN_RELEASE = hasattr(torch._C, "_cuda_clearCublasWorkspaces")
WORKSPACE_SIZE = getattr(torch.backends.cuda, "cublas_workspace_size", None)


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
    # a matmul makes cuBLAS's workspace (one an earlier test's matmul left is released first); releasing
    # it gives back exactly that, once, and leaves the tensors
    probe.release_workspaces()
    before = probe.allocated(0)
    y = x @ x
    torch.cuda.synchronize()
    released = probe.release_workspaces()
    if CAN_RELEASE:
        assert released[0] == WORKSPACE_SIZE() if WORKSPACE_SIZE else released[0] > 0
        assert probe.release_workspaces()[0] == 0
        assert probe.allocated(0) == before + y.numel() * 4
    else:
        assert released is None
    del x, y


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
        assert after["allocated"] == 0  # every tensor given back, and cuBLAS's workspace released
        if CAN_RELEASE:
            # DoRA's weight norm is the first matmul: cuBLAS's workspace appears with it, in its own column
            dora = part[part["stage"] == memory.adapter_stage("dora")].iloc[0]
            assert dora["workspace"] == WORKSPACE_SIZE() if WORKSPACE_SIZE else dora["workspace"] > 0
            assert loaded["workspace"] == 0 and after["workspace"] == 0 and after["reserved"] == 0
    # torch_device passed: every tensor and every byte on the target, nothing stray (the run's CPU
    # reference target has a placement of its own, on the CPU)
    placement = placement[placement["target"] == f"{target}/float32"]
    assert set(placement[placement["variant"] == "torch_device"]["device"]) == {target}
    rows = record.metrics()
    rows = rows[rows["target"] == f"{target}/float32"]
    passed = rows[(rows["check"] == "memory") & (rows["variant"] == "torch_device")]
    assert set(passed["verdict"]) == {"identical"}, passed[["rule", "explanation"]]
    if target != "cuda:0":
        # not passed: PEFT loads the adapter state dict onto bare "cuda" (cuda:0) first
        stray = rows[(rows["variant"] == "no_torch_device") & (rows["rule"] == "stray device")]
        assert "cuda:0" in set(stray["device"]), rows[["variant", "rule", "device", "explanation"]]


def test_a_tensor_kept_past_cleanup_is_a_leak(tmp_path, demo_workspace, monkeypatch):
    """A tensor the code keeps alive past del, gc.collect() and empty_cache() (here the embedding weight,
    kept at each adapter load as a cache of the user's would) is `broken`, to the byte, while cuBLAS's
    workspace beside it is not. In-process, so that the tensor outlives the load."""
    from core.checks import memory as memory_check
    from core.engine.runners import InProcessRunner

    kept = []
    attach = memory_check.MemoryCheck._attach

    def attach_and_keep(self, model, adapter, target, variant):
        loaded, notes = attach(self, model, adapter, target, variant)
        kept.append(loaded.get_input_embeddings().weight)
        return loaded, notes

    monkeypatch.setattr(memory_check.MemoryCheck, "_attach", attach_and_keep)
    engine = Engine(tmp_path, runner=InProcessRunner())
    job = engine.submit(demo_spec(demo_workspace, ["lora", "dora"], ["cuda:0/float32"], ["memory"]))
    assert job.wait(600)
    assert job.state == "succeeded", job.error
    rows = engine.store.open(job.run_id).metrics()
    # the CPU reference target's rows, in this process, see the cuda target's memory as stray: not ours
    rows = rows[(rows["check"] == "memory") & (rows["target"] == "cuda:0/float32")]
    assert sorted(rows["variant"]) == ["no_torch_device", "torch_device"], rows[["rule", "explanation"]]
    assert set(rows["rule"]) == {"leak"} and set(rows["device"]) == {"cuda:0"}
    # one embedding per strategy (both adapters share it); the allocator counts it in 512-byte blocks
    held = -(-kept[0].untyped_storage().nbytes() // 512) * 512
    assert held == 65_536  # tiny-llama's embedding, float32
    for explanation in rows["explanation"]:
        assert explanation.startswith(f"cuda:0 still has {held:,} bytes allocated by tensors"), explanation
    kept.clear()
