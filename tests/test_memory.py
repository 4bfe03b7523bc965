"""core.models.memory: the placement map on tiny models, stage sampling, and the flag rules on
constructed timeline and placement records."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from core.models import memory
from core.models.loading import attach_adapter, load_base
from core.spec import AdapterRef, ModelRef, Target

CPU = Target.parse("cpu/float32")


@pytest.fixture(scope="module")
def llama_lora(demo_workspace):
    base = load_base(ModelRef(demo_workspace["models"]["tiny-llama"]), CPU)
    lora = AdapterRef(demo_workspace["adapters"]["lora"]["path"], "lora")
    dora = AdapterRef(demo_workspace["adapters"]["dora"]["path"], "dora")
    model = attach_adapter(base, lora, CPU)
    model = attach_adapter(model, dora, CPU)
    return model


def test_placement_map_is_exact_per_module(llama_lora):
    from peft.tuners.tuners_utils import BaseTunerLayer

    records = memory.placement_map(llama_lora, ["lora", "dora"], memory.peft_layer_devices(llama_lora))
    table = pd.DataFrame(records)
    assert set(table[table["adapter"].notna()]["layer_status"]) == {"cpu"}
    assert table[table["adapter"].isna()]["layer_status"].isna().all()
    assert list(table.columns[: len(memory.PLACEMENT_COLUMNS)]) == list(memory.PLACEMENT_COLUMNS)
    assert set(table["device"]) == {"cpu"}
    per_module = table.groupby("module")["bytes"].sum()
    layers = 0
    for name, module in llama_lora.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        layers += 1
        expected = sum(p.numel() * p.element_size() for p in module.parameters())
        expected += sum(b.numel() * b.element_size() for b in module.buffers())
        assert per_module[name.removeprefix(memory.PEFT_PREFIX)] == expected, name
    assert layers > 0
    # every tensor the model holds, once: tied lm_head is an alias of embed_tokens
    unique = {
        t.data_ptr(): t.numel() * t.element_size() for t in [*llama_lora.parameters(), *llama_lora.buffers()]
    }
    assert table["bytes"].sum() == sum(unique.values())
    lm_head = table[table["name"].str.endswith("lm_head.weight")].iloc[0]
    assert lm_head["bytes"] == 0 and lm_head["shared_with"].endswith("embed_tokens.weight")


def test_placement_labels_role_adapter_and_module(llama_lora):
    table = pd.DataFrame(memory.placement_map(llama_lora, ["lora", "dora"]))
    q0 = table[table["module"] == "model.layers.0.self_attn.q_proj"]
    labels = set(zip(q0["role"], q0["adapter"].fillna("-"), strict=True))
    assert {("base", "-"), ("lora_A", "lora"), ("lora_B", "lora"), ("lora_A", "dora")} <= labels
    assert ("lora_magnitude_vector", "dora") in labels
    assert set(table[table["kind"] == "buffer"]["role"]) == {"buffer"}
    assert (table[table["adapter"].notna()]["layer"].notna()).all()
    assert set(table["dtype"]) == {"float32"}


def test_split_name_handles_peft_and_plain_names():
    split = memory.placement._split_name
    adapters = {"default", "b"}
    assert split("base_model.model.model.layers.1.mlp.up_proj.lora_B.b.weight", adapters) == (
        "model.layers.1.mlp.up_proj",
        "lora_B",
        "b",
    )
    assert split("base_model.model.model.layers.1.mlp.up_proj.base_layer.weight", adapters) == (
        "model.layers.1.mlp.up_proj",
        "base",
        None,
    )
    assert split("base_model.model.x.lora_embedding_A.default", adapters) == (
        "x",
        "lora_embedding_A",
        "default",
    )
    assert split("model.norm.weight", adapters) == ("model.norm", "base", None)
    assert split("base_model.model.score.modules_to_save.b.weight", adapters) == (
        "score",
        "modules_to_save",
        "b",
    )
    assert split("base_model.model.score.original_module.weight", adapters) == ("score", "base", None)


def test_peft_devices_reports_types_only(llama_lora):
    assert memory.peft_devices(llama_lora) == {"dora": ["cpu"], "lora": ["cpu"]}
    assert memory.peft_devices(torch.nn.Linear(2, 2)) is None


class FakeProbe:
    """Two CUDA indices; cuda:0 gains memory and a context at the second sample."""

    indices = [0, 1]

    def __init__(self):
        self.calls = 0

    def context(self, index):
        return index == 0 and self.calls > 0

    def allocated(self, index):
        return 512 if index == 0 and self.calls > 0 else 0

    def reserved(self, index):
        self.calls += index == 1  # one tick per stage, after both devices were read
        return 2048 if index == 0 and self.calls > 0 else 0

    def driver_used(self, index, context=None):
        return 500 * 2**20 if context else 0

    def release_workspaces(self):
        # read after `allocated`, before `reserved`: cuda:0's matmul made a workspace from the second stage on
        return {0: 256 if self.calls > 0 else 0, 1: 0}


def test_stage_sampling_records_every_stage_in_order():
    rss = iter(range(100, 10_000, 100))
    sampler = memory.StageSampler(probe=FakeProbe(), rss=lambda: next(rss))
    sampler.add_process_samples(
        [{"stage": memory.PROCESS_START, "time": 0.0, "rss": 10}, {"stage": memory.IMPORT_TORCH, "rss": 20}]
    )
    later = memory.stage_names(["a", "b"])[2:]
    for stage in later:
        sampler.sample(stage)
    table = pd.DataFrame(sampler.records)
    assert list(table.columns) == [*memory.TIMELINE_COLUMNS, *memory.TIMELINE_EXTRA]
    assert sampler.stages == memory.stage_names(["a", "b"])
    order = table.drop_duplicates("order").sort_values("order")
    assert list(order["stage"]) == sampler.stages and list(order["order"]) == list(range(len(sampler.stages)))
    # process samples: RSS only; sampled stages: cpu plus one row per CUDA index
    assert list(table[table["order"] == 0]["device"]) == ["cpu"]
    assert list(table[table["order"] == 3]["device"]) == ["cpu", "cuda:0", "cuda:1"]
    cpu = table[table["device"] == "cpu"]
    assert cpu["rss"].is_monotonic_increasing and cpu["allocated"].isna().all()
    assert cpu["workspace"].isna().all()
    # allocated as the process held it, workspace its part that the release gave back
    cuda0 = table[table["device"] == "cuda:0"]
    assert list(cuda0["allocated"]) == [0] + [512] * (len(later) - 1)
    assert list(cuda0["workspace"]) == [0] + [256] * (len(later) - 1)
    assert set(table[table["device"] == "cuda:1"]["workspace"]) == {0}


def test_release_workspaces_measures_what_clearing_gave_back(monkeypatch):
    workspace = 32 * 2**20
    tensors, workspaces = {0: 4096, 1: 0}, {0: workspace, 1: 0}
    calls = []

    def clear():  # as torch's: every device's workspaces go back to the allocator
        calls.append("clear")
        workspaces.update(dict.fromkeys(workspaces, 0))

    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", clear, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    probe = memory.CudaProbe()
    monkeypatch.setattr(probe, "_count", 2)
    monkeypatch.setattr(probe, "allocated", lambda index: tensors[index] + workspaces[index])
    assert probe.release_workspaces() == {0: workspace, 1: 0}
    assert probe.release_workspaces() == {0: 0, 1: 0} and len(calls) == 2
    # a torch without the function: unknown, said once, never a crash
    monkeypatch.delattr(torch._C, "_cuda_clearCublasWorkspaces")
    assert probe.release_workspaces() is None and probe.release_workspaces() is None
    assert [n for n in probe.notes if "cannot release" in n] == [
        "this torch cannot release cuBLAS's workspace (no torch._C._cuda_clearCublasWorkspaces): "
        "it counts as tensor memory, after cleanup too"
    ]


def test_cleanup_releases_library_workspaces_before_emptying_the_cache(monkeypatch):
    from core.checks.memory import cleanup

    calls = []
    monkeypatch.setattr(
        torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("clear workspaces"), raising=False
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    cleanup()
    assert calls == ["clear workspaces", "empty_cache"]
    # CUDA never initialised: nothing to release, nothing asked of the driver
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    cleanup()
    assert memory.clear_library_workspaces() is True and calls == ["clear workspaces", "empty_cache"]


def test_sampling_without_cuda_records_real_rss():
    sampler = memory.StageSampler(probe=None)
    sampler.sample("now")
    assert sampler.records == [memory.timeline_record("now", 0, "cpu", rss=sampler.records[0]["rss"])]
    assert sampler.records[0]["rss"] > 10 * 2**20


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only path")
def test_cuda_probe_without_gpu_has_no_indices():
    probe = memory.CudaProbe()
    assert probe.indices == []


def test_uuid_text_matches_nvml_spelling():
    raw = bytes(range(16))
    assert memory.sampling._uuid_text(raw) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


def rec(stage, order, device, **kw):
    return memory.timeline_record(stage, order, device, **kw)


def test_memory_on_cuda0_while_target_is_cuda1_is_flagged():
    timeline = [
        rec("import torch", 1, "cpu", rss=100),
        rec("base loaded", 3, "cuda:0", allocated=0, reserved=0, driver_used=0, context=False),
        rec("base loaded", 3, "cuda:1", allocated=10, reserved=20, driver_used=30, context=True),
        rec(
            "adapter a loaded",
            4,
            "cuda:0",
            allocated=0,
            reserved=2 * 2**20,
            driver_used=400 * 2**20,
            context=True,
        ),
        rec("adapter a loaded", 4, "cuda:1", allocated=11, reserved=20, driver_used=30, context=True),
        rec(
            "first forward",
            5,
            "cuda:0",
            allocated=0,
            reserved=2 * 2**20,
            driver_used=400 * 2**20,
            context=True,
        ),
    ]
    flags = memory.stray_devices(timeline, ["cuda:1"])
    assert [(f.rule, f.device, f.stage) for f in flags] == [("stray device", "cuda:0", "adapter a loaded")]
    assert "400.0 MiB" in flags[0].explanation and "a CUDA context" in flags[0].explanation
    assert memory.stray_devices(timeline, ["cuda:0", "cuda:1"]) == []
    # a bare "cuda" request means the current device, cuda:0
    assert [f.device for f in memory.stray_devices(timeline, ["cuda"])] == ["cuda:1"]


def test_a_context_alone_is_stray_and_a_cpu_target_flags_every_gpu():
    timeline = [
        rec("base loaded", 3, "cuda:0", allocated=0, reserved=0, driver_used=None, context=True),
        rec("base loaded", 3, "cuda:1", allocated=0, reserved=0, driver_used=None, context=False),
    ]
    flags = memory.stray_devices(timeline, ["cpu"])
    assert [(f.device, f.stage) for f in flags] == [("cuda:0", "base loaded")]


def place(name, module, role, adapter, device, nbytes=16):
    return {
        "name": name,
        "module": module,
        "role": role,
        "adapter": adapter,
        "device": device,
        "dtype": "float32",
        "bytes": nbytes,
    }


PLACED = [
    place("m.q.base_layer.weight", "m.q", "base", None, "cuda:1", 64),
    place("m.q.lora_A.a.weight", "m.q", "lora_A", "a", "cuda:0", 8),
    place("m.q.lora_B.a.weight", "m.q", "lora_B", "a", "cuda:1", 8),
    place("m.v.base_layer.weight", "m.v", "base", None, "cuda:1", 64),
    place("m.v.lora_A.a.weight", "m.v", "lora_A", "a", "cuda:1", 8),
]


def test_mixed_placement_inside_one_layer_is_flagged():
    flags = memory.mixed_placement(PLACED, stage="adapter a loaded")
    assert [(f.rule, f.module, f.device) for f in flags] == [("mixed placement", "m.q", "cuda:0, cuda:1")]
    assert "lora_A[a] on cuda:0" in flags[0].explanation
    assert "base, lora_B[a] on cuda:1" in flags[0].explanation


def test_tensor_on_a_device_nobody_asked_for_is_flagged_per_module():
    flags = memory.stray_placement(PLACED, ["cuda:1"], stage="adapter a loaded")
    assert [(f.rule, f.module, f.device, f.adapter, f.tensor) for f in flags] == [
        ("stray device", "m.q", "cuda:0", "a", "m.q.lora_A.a.weight")
    ]
    assert memory.stray_placement(PLACED, ["cuda:0", "cuda:1"], stage="x") == []


def test_a_split_layer_is_one_finding_that_names_its_stray_part():
    whole_on_0 = [place("m.o.base_layer.weight", "m.o", "base", None, "cuda:0")]
    flags = memory.placement_flags(PLACED + whole_on_0, ["cuda:1"], stage="s")
    assert sorted((f.rule, f.module) for f in flags) == [("mixed placement", "m.q"), ("stray device", "m.o")]
    mixed = next(f for f in flags if f.rule == "mixed placement")
    assert "lora_A[a] on cuda:0 (not asked for)" in mixed.explanation


def test_adapter_summary_shows_what_get_layer_status_hides():
    summary = memory.adapter_device_summary(pd.DataFrame(PLACED), {"a": ["cuda"]})
    row = summary.iloc[0]
    assert row["get_layer_status"] == "cuda"
    assert row["devices"] == "cuda:0, cuda:1"
    assert row["bytes_by_device"] == "cuda:0: 8, cuda:1: 16"
    assert bool(row["hidden"]) and row["tensors"] == 3
    # one device, but not the index asked for: PEFT's "cuda" hides it too
    only0 = pd.DataFrame([place("m.q.lora_A.a.weight", "m.q", "lora_A", "a", "cuda:0")])
    assert bool(memory.adapter_device_summary(only0, {"a": ["cuda"]}, requested=["cuda:1"])["hidden"].iloc[0])
    assert not memory.adapter_device_summary(only0, {"a": ["cuda"]}, requested=["cuda:0"])["hidden"].iloc[0]
    # PEFT's view read from the placement's own column
    with_status = pd.DataFrame([{**p, "layer_status": "cuda"} for p in PLACED])
    assert memory.adapter_device_summary(with_status)["get_layer_status"].iloc[0] == "cuda"


def test_module_device_bytes():
    grid = memory.module_device_bytes(pd.DataFrame(PLACED))
    assert list(grid.index) == ["m.q", "m.v"] and list(grid.columns) == ["cuda:0", "cuda:1"]
    assert (
        grid.loc["m.q", "cuda:0"] == 8 and grid.loc["m.q", "cuda:1"] == 72 and grid.loc["m.v", "cuda:0"] == 0
    )
    kinds = memory.module_device_bytes(pd.DataFrame(PLACED), by="kind")
    assert list(kinds.index) == ["q", "v"]


def test_device_order_is_numeric():
    assert sorted(["cuda:10", "cuda:2", "cpu", "cuda:0"], key=memory.device_sort_key) == [
        "cpu",
        "cuda:0",
        "cuda:2",
        "cuda:10",
    ]


def test_leak_figures_and_flags():
    timeline = [
        rec(memory.IMPORT_LIBS, 2, "cpu", rss=1000),
        rec(memory.IMPORT_LIBS, 2, "cuda:0", allocated=0, reserved=0, driver_used=0, context=False),
        rec(memory.BASE_LOADED, 3, "cpu", rss=5000),
        rec(memory.BASE_LOADED, 3, "cuda:0", allocated=4096, reserved=8192, driver_used=9000, context=True),
        rec(memory.CLEANED_UP, 6, "cpu", rss=1500),
        rec(memory.CLEANED_UP, 6, "cuda:0", allocated=1024, reserved=2048, driver_used=3000, context=True),
    ]
    leaks = memory.leak_figures(timeline)
    assert list(leaks["device"]) == ["cpu", "cuda:0"]
    cpu, gpu = leaks.to_dict(orient="records")
    assert cpu["rss"] == 500 and cpu["baseline_stage"] == memory.IMPORT_LIBS
    assert (gpu["allocated"], gpu["reserved"], gpu["driver_used"]) == (1024, 2048, 3000)
    flags = memory.leak_flags(leaks)
    assert [(f.rule, f.device, f.stage) for f in flags] == [("leak", "cuda:0", memory.CLEANED_UP)]
    # everything returned: no flag
    timeline[-1] = rec(
        memory.CLEANED_UP, 6, "cuda:0", allocated=0, reserved=0, driver_used=3000, context=True
    )
    assert memory.leak_flags(memory.leak_figures(timeline)) == []
    assert memory.leak_figures([]).empty
    assert list(memory.leak_figures([]).columns) == memory.LEAK_COLUMNS


def test_a_library_workspace_is_no_leak_and_a_tensor_beside_it_is():
    workspace = 32 * 2**20

    def timeline(end_allocated, end_workspace, base_allocated=0, base_workspace=0):
        return [
            rec(memory.IMPORT_LIBS, 2, "cuda:0", allocated=base_allocated, workspace=base_workspace),
            rec(memory.BASE_LOADED, 3, "cuda:0", allocated=base_allocated + 4096, workspace=0),
            rec(memory.CLEANED_UP, 4, "cuda:0", allocated=end_allocated, reserved=0, workspace=end_workspace),
        ]

    # sampled before its release (as the H200 run did): allocated, all of it a workspace
    leaks = memory.leak_figures(timeline(workspace, workspace))
    assert leaks[["allocated", "workspace", "tensors"]].iloc[0].tolist() == [workspace, workspace, 0]
    assert memory.leak_flags(leaks) == []
    # a 2 KiB tensor kept alive beside it
    (flag,) = memory.leak_flags(memory.leak_figures(timeline(workspace + 2048, workspace)))
    assert (flag.rule, flag.device, flag.stage) == ("leak", "cuda:0", memory.CLEANED_UP)
    assert flag.explanation == (
        "cuda:0 still has 2,048 bytes allocated by tensors after del, gc.collect() and empty_cache() "
        "(reserved 0 bytes)"
    )
    # a workspace the baseline held and cleanup released (a process that ran matmuls before): no leak
    leaks = memory.leak_figures(timeline(0, 0, base_allocated=workspace, base_workspace=workspace))
    assert leaks[["allocated", "workspace", "tensors"]].iloc[0].tolist() == [-workspace, -workspace, 0]
    assert memory.leak_flags(leaks) == []
    # no workspace figure (a run recorded before the column, or a torch that cannot release it): all of
    # allocated counts as tensors, as it was judged then
    old = [{k: v for k, v in r.items() if k != "workspace"} for r in timeline(workspace, workspace)]
    leaks = memory.leak_figures(old)
    assert leaks["workspace"].isna().all() and leaks["tensors"].tolist() == [workspace]
    assert [f.rule for f in memory.leak_flags(leaks)] == ["leak"]


# ---------------------------------------------------------------------------------------------
# The rules on what a real GPU recorded: `core run --scenario memory-placement --target cuda:0/float32`
# on an H200 (tests/data/h200-2026-11-28/README.md), made before workspaces had a column of their own

H200 = Path(__file__).parent / "data" / "h200-2026-11-28" / "memory-placement"
CUBLAS_WORKSPACE = 33_554_432  # 32 MiB, cuBLAS's default on Hopper


def recorded(target, variant):
    """One capture's timeline records as the memory check stored them (None where a figure is unknown)."""
    table = pd.read_parquet(H200 / "memory_timeline.parquet")
    part = table[(table["target"] == target) & (table["variant"] == variant)]
    part = part[[c for c in part.columns if c not in ("variant", "target", "requested")]]
    return part.astype(object).where(part.notna(), None).to_dict(orient="records")


def recorded_rows(target, variant, timeline):
    from core.capture import Capture
    from core.checks.memory import MemoryCheck

    capture = Capture(target=target, check="memory", variant=variant)
    capture.meta["memory"] = {
        "variant": variant,
        "requested": [Target.parse(target).device],
        "timeline": timeline,
    }
    return pd.DataFrame(MemoryCheck().flag_rows(capture))


def with_workspace(timeline):
    """The recorded timeline as a run now records it: cuda:0's workspace in a column of its own from the
    stage DoRA's weight norm made it, and released by cleanup."""
    out = []
    for r in timeline:
        if r["device"] == "cuda:0":
            held = CUBLAS_WORKSPACE if r["allocated"] >= CUBLAS_WORKSPACE else 0
            r = {**r, "workspace": held}
            if r["stage"] == memory.CLEANED_UP:
                r = {
                    **r,
                    "allocated": r["allocated"] - held,
                    "reserved": r["reserved"] - held,
                    "workspace": 0,
                }
        out.append(r)
    return out


@pytest.mark.parametrize("variant", ["torch_device", "no_torch_device"])
def test_recorded_h200_run_reads_as_it_was_judged(variant):
    """Without the workspace column the rule is the old one: the run's stored rows come out again."""
    stored = pd.read_parquet(H200 / "metrics.parquet")
    stored = stored[(stored["target"] == "cuda:0/float32") & (stored["variant"] == variant)]
    rows = recorded_rows("cuda:0/float32", variant, recorded("cuda:0/float32", variant))
    assert rows[["rule", "stage", "device", "explanation"]].values.tolist() == (
        stored[["rule", "stage", "device", "explanation"]].values.tolist()
    )
    assert rows["explanation"].tolist() == [
        "cuda:0 still has 32.0 MiB allocated by tensors after del, gc.collect() and empty_cache() "
        "(reserved 32.0 MiB)"
    ]


@pytest.mark.parametrize("variant", ["torch_device", "no_torch_device"])
def test_recorded_h200_workspace_is_no_leak_and_a_kept_tensor_is(variant):
    timeline = with_workspace(recorded("cuda:0/float32", variant))
    cuda0 = {r["stage"]: r for r in timeline if r["device"] == "cuda:0"}
    assert [s for s, r in cuda0.items() if r["workspace"]] == [
        memory.adapter_stage("dora"),
        memory.FIRST_FORWARD,
        memory.MERGED,
    ]
    rows = recorded_rows("cuda:0/float32", variant, timeline)
    assert rows[["verdict", "rule"]].values.tolist() == [["identical", "as asked"]]
    # the same, sampled before the release (the figures as the H200 recorded them, the column added)
    before = [
        {
            **r,
            "workspace": CUBLAS_WORKSPACE
            if r["device"] == "cuda:0" and r["allocated"] >= CUBLAS_WORKSPACE
            else r.get("workspace"),
        }
        for r in recorded("cuda:0/float32", variant)
    ]
    assert recorded_rows("cuda:0/float32", variant, before)["rule"].tolist() == ["as asked"]
    # a tensor of the model's (its 65,536-byte embedding) kept past cleanup: broken, to the byte
    kept = [
        {**r, "allocated": r["allocated"] + 65_536}
        if r["device"] == "cuda:0" and r["stage"] == memory.CLEANED_UP
        else r
        for r in timeline
    ]
    rows = recorded_rows("cuda:0/float32", variant, kept)
    assert rows[["verdict", "rule", "stage", "device"]].values.tolist() == [
        ["broken", "leak", memory.CLEANED_UP, "cuda:0"]
    ]
    assert rows["explanation"].iloc[0].startswith("cuda:0 still has 65,536 bytes allocated by tensors")
    assert memory.leak_figures(kept).set_index("device").loc["cuda:0", "tensors"] == 65_536


def test_recorded_h200_stray_context_says_why():
    """A cpu/float32 target whose adapter loads without torch_device: 2 MiB and a context on cuda:0, from
    the first adapter on, with PEFT's reason; with torch_device nothing touches the GPU."""
    stored = pd.read_parquet(H200 / "metrics.parquet")
    stored = stored[(stored["target"] == "cpu/float32") & (stored["variant"] == "no_torch_device")].iloc[0]
    rows = recorded_rows("cpu/float32", "no_torch_device", recorded("cpu/float32", "no_torch_device"))
    assert rows[["verdict", "rule", "stage", "device"]].values.tolist() == [
        ["broken", "stray device", memory.adapter_stage("lora"), "cuda:0"]
    ]
    assert stored["explanation"] == (
        "cuda:0 holds reserved 2.0 MiB, driver_used 520.0 MiB, a CUDA context from stage 'adapter lora "
        "loaded' on, though only cpu was asked for"
    )
    assert rows["explanation"].iloc[0] == stored["explanation"] + (
        "; PEFT, given no torch_device, loads the adapter file onto the device it infers (`cuda`, i.e. "
        "cuda:0, wherever CUDA exists) before copying it into the model: pass torch_device to keep it off"
    )
    asked = recorded_rows("cpu/float32", "torch_device", recorded("cpu/float32", "torch_device"))
    assert asked["rule"].tolist() == ["as asked"]


# ---------------------------------------------------------------------------------------------
# The `memory` check: variants, stages, tables and metric rows


def memory_spec(demo, adapters, target="cpu/float32"):
    from core.spec import ProbeSpec

    return ProbeSpec(
        base=ModelRef(demo["models"]["tiny-llama"]),
        adapters=tuple(AdapterRef(demo["adapters"][n]["path"], n) for n in adapters),
        targets=(Target.parse(target),),
        checks=("memory",),
    )


def run_memory(home, spec, runner):
    from core.engine.jobs import Engine

    engine = Engine(home, runner=runner)
    job = engine.submit(spec)
    assert job.wait(300)
    snap = job.snapshot()
    assert snap["state"] == "succeeded", snap["error"]
    return engine.store.open(job.run_id), snap


def test_variants_groups_and_stage_count(demo_workspace):
    from core.checks.memory import MemoryCheck, adapter_groups

    check = MemoryCheck()
    assert check.variants(memory_spec(demo_workspace, []), CPU) == ("",)
    spec = memory_spec(demo_workspace, ["lora", "dora", "boft", "lora_b"])
    assert check.variants(spec, CPU)[:2] == ("torch_device", "no_torch_device")
    groups = adapter_groups(spec.adapters)
    assert [[a.name for a in g] for g in groups] == [["lora", "dora"], ["boft"], ["lora_b"]]
    # three bases, four adapters, forward, merge, cleanup
    assert check.run_stages(spec, CPU, "torch_device") == 3 + 4 + 3


def test_memory_check_in_process_writes_its_tables_and_rows(tmp_path, demo_workspace):
    from core.checks.memory import MemoryCheck
    from core.engine.runners import InProcessRunner

    spec = memory_spec(demo_workspace, ["lora", "dora"])
    record, snap = run_memory(tmp_path, spec, InProcessRunner())
    assert {"cpu/float32 · memory:torch_device", "cpu/float32 · memory:no_torch_device"} <= set(snap["tasks"])
    task = snap["tasks"]["cpu/float32 · memory:torch_device"]
    assert task["step"] == task["of"] == 1 + MemoryCheck().run_stages(spec, CPU, "torch_device") + 1

    timeline = record.table("memory_timeline")
    assert list(timeline.columns[:8]) == list(memory.TIMELINE_COLUMNS)
    for variant in ("torch_device", "no_torch_device"):
        part = timeline[timeline["variant"] == variant].sort_values("order")
        # in-process: no process-start samples, every later stage in order
        assert list(part["stage"]) == memory.stage_names(["lora", "dora"])[2:]
        assert set(part["device"]) == {"cpu"} and (part["rss"] > 0).all()

    placement = record.table("placement")
    assert list(placement.columns[:7]) == list(memory.PLACEMENT_COLUMNS)
    assert set(placement["device"]) == {"cpu"}
    one = placement[placement["variant"] == "torch_device"]
    assert set(one["adapter"].dropna()) == {"lora", "dora"}
    per_module = one.groupby("module")["bytes"].sum()
    assert per_module["lm_head"] == 0  # tied to embed_tokens: its bytes are counted there
    assert (per_module.drop("lm_head") > 0).all()

    rows = record.metrics()
    rows = rows[rows["check"] == "memory"]
    assert len(rows) == 2 and set(rows["verdict"]) == {"identical"}
    assert rows["note"].str.contains("not a fresh worker process").all()


def test_pissa_on_a_float64_target_loads_through_float32_with_a_note(tmp_path, demo_workspace):
    from core.engine.runners import InProcessRunner

    # PEFT refuses to initialise PiSSA in float64: the load goes through float32, as in every strategy
    spec = memory_spec(demo_workspace, ["pissa"], target="cpu/float64")
    record, _ = run_memory(tmp_path, spec, InProcessRunner())
    placement = record.table("placement")
    assert set(placement.loc[placement["adapter"] == "pissa", "dtype"]) == {"float64"}
    assert any("pissa: PiSSA cannot be initialised in float64" in n for n in record.notes())


def test_a_misplaced_load_is_flagged_at_the_stage_it_appeared(tmp_path, demo_workspace, monkeypatch):
    """As if the target were cuda:1: every tensor on the CPU is on a device nobody asked for."""
    from core.checks import memory as memory_check
    from core.engine.runners import InProcessRunner

    monkeypatch.setattr(memory_check, "requested_devices", lambda target, variant: ["cuda:1"])
    spec = memory_spec(demo_workspace, ["lora"])
    record, _ = run_memory(tmp_path, spec, InProcessRunner())
    rows = record.metrics()
    rows = rows[(rows["check"] == "memory") & (rows["variant"] == "torch_device")]
    assert set(rows["verdict"]) == {"broken"} and set(rows["rule"]) == {"stray device"}
    assert set(rows["device"]) == {"cpu"}
    # base layers appeared with the base; none is reported again at the adapter's stage
    q0 = rows[rows["module"] == "model.layers.0.self_attn.q_proj"]
    assert list(q0["stage"]) == [memory.BASE_LOADED]
    assert q0["layer"].tolist() == [0]


def flagged_capture(target="cuda:1/float32"):
    from core.capture import Capture

    capture = Capture(target=target, check="memory", variant="no_torch_device")
    capture.meta["memory"] = {
        "variant": "no_torch_device",
        "requested": ["cuda:1"],
        "timeline": [
            rec(memory.BASE_LOADED, 3, "cuda:0", allocated=0, reserved=0, driver_used=0, context=False),
            rec(memory.BASE_LOADED, 3, "cuda:1", allocated=9, reserved=9, driver_used=9, context=True),
            rec(memory.adapter_stage("a"), 4, "cuda:0", allocated=0, reserved=2, driver_used=3, context=True),
            rec(memory.CLEANED_UP, 5, "cuda:0", allocated=0, reserved=0, driver_used=3, context=True),
            rec(memory.CLEANED_UP, 5, "cuda:1", allocated=0, reserved=0, driver_used=9, context=True),
        ],
        "placement": PLACED,
        "placement_flags": [
            f.as_dict() for f in memory.placement_flags(PLACED, ["cuda:1"], "adapter a loaded")
        ],
        "notes": [],
    }
    return capture


def test_flags_become_broken_metric_rows():
    from core.checks.memory import MemoryCheck

    rows = MemoryCheck().compare(None, [flagged_capture()], None, lambda s: None)
    table = pd.DataFrame(rows)
    assert set(table["verdict"]) == {"broken"} and set(table["check"]) == {"memory"}
    got = set(zip(table["rule"], table["stage"], table["device"], table["module"].fillna("-"), strict=True))
    assert got == {
        ("stray device", "adapter a loaded", "cuda:0", "-"),  # from the timeline: a context on cuda:0
        ("mixed placement", "adapter a loaded", "cuda:0, cuda:1", "m.q"),
    }
    assert (table["reference"] == "requested placement (cuda:1)").all()


def test_tables_have_the_required_columns_first():
    from core.checks.memory import MemoryCheck

    tables = MemoryCheck().tables(None, [flagged_capture()])
    timeline, placement = tables["memory_timeline"], tables["placement"]
    assert list(timeline.columns) == [
        *memory.TIMELINE_COLUMNS,
        *memory.TIMELINE_EXTRA,
        "variant",
        "target",
        "requested",
    ]
    assert timeline["workspace"].isna().all()  # recorded without the column: unknown, not 0
    assert list(placement.columns[:7]) == list(memory.PLACEMENT_COLUMNS)
    assert list(timeline["requested"]) == [False, True, False, False, True]


@pytest.mark.parametrize("spare", [False, True], ids=["spawned with its task", "a warm runner's spare"])
def test_rss_timeline_of_a_fresh_worker_process_is_real(tmp_path, demo_workspace, spare):
    """A real `python -m core.engine.worker` process: process start and import torch come from the worker,
    and after the base load RSS exceeds the process-start figure by at least the model's bytes. The same
    where the timeline's interpreter was started by `warm` before the run and imported ahead."""
    from core.engine.runners import ProcessRunner

    runner = ProcessRunner()
    if spare:
        runner.warm(fresh=1)
        (waiting,) = runner._spares
    record, snap = run_memory(tmp_path, memory_spec(demo_workspace, []), runner)
    if spare:  # the timeline ran in the spare: it took the task and ended
        assert not runner._spares and waiting.wait(60) == 0
    runner.kill_all()
    assert set(snap["tasks"]) == {"cpu/float32 · memory", "compare"}
    timeline = record.table("memory_timeline").sort_values("order")
    assert list(timeline["stage"]) == memory.stage_names([])
    rss = dict(zip(timeline["stage"], timeline["rss"], strict=True))
    model_bytes = int(record.table("placement")["bytes"].sum())
    assert model_bytes > 500_000  # tiny-llama: ~640 KiB of float32 parameters (lm_head tied)
    assert (
        rss[memory.PROCESS_START]
        < rss[memory.IMPORT_TORCH]
        < rss[memory.IMPORT_LIBS]
        < rss[memory.BASE_LOADED]
    )
    assert rss[memory.BASE_LOADED] - rss[memory.PROCESS_START] >= model_bytes
    rows = record.metrics()
    assert not rows["note"].str.contains("not a fresh").any()
