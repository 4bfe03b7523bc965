"""GPU scenarios: skipped without CUDA. Run them when a GPU is lent (see docs/gpu-validation.md)."""

import pytest
import torch

from core.engine.jobs import Engine
from core.engine.runners import ProcessRunner
from core.spec import AdapterRef, ModelRef, ProbeSpec, Target

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def run(home, demo, targets, adapters, checks, runner=None, record=None):
    engine = Engine(home, runner=runner or ProcessRunner())
    spec = ProbeSpec(
        base=ModelRef(demo["models"]["tiny-llama"]),
        adapters=tuple(AdapterRef(demo["adapters"][n]["path"], n) for n in adapters),
        targets=tuple(map(Target.parse, targets)),
        checks=tuple(checks),
    )
    job = engine.submit(spec)
    assert job.wait(600)
    assert job.state == "succeeded", job.error
    engine.shutdown("test over")
    if record is not None:
        record.update(engine.store.open(job.run_id).info)
    return engine.store.open(job.run_id).metrics()


def test_the_gpu_paths_fork_server_never_touches_cuda_and_its_tasks_give_spawned_rows_bit_for_bit(
    tmp_path, demo_workspace
):
    """Where a GPU is visible the fork server imports no bitsandbytes (whose import makes a CUDA context):
    it forks the float targets' tasks, CUDA ones included, and their rows are those of tasks each
    spawned when it came; a quantized target's task is spawned."""
    from pandas.testing import assert_frame_equal

    from core.engine.fork_server import ForkedProcess

    class Recording(ProcessRunner):
        def __init__(self, fork=True):
            super().__init__(fork=fork)
            self.started = []

        def _start(self, task, log_path):
            self.started.append(super()._start(task, log_path))
            return self.started[-1]

    args = (demo_workspace, ["cpu/float32", "cuda:0/float32", "cuda:0/bfloat16"], ["lora", "dora"])
    checks = ["weights", "outputs", "activations"]
    forked, info = Recording(), {}
    forked.warm()
    assert forked.workers_path == "gpu" and forked._server is not None
    rows = run(tmp_path / "forked", *args, checks, runner=forked, record=info)
    assert info["workers"] == "gpu"
    assert forked.started and all(isinstance(p, ForkedProcess) for p in forked.started)
    spawned = Recording(fork=False)
    assert_frame_equal(rows, run(tmp_path / "spawned", *args, checks, runner=spawned), check_exact=True)
    assert not any(isinstance(p, ForkedProcess) for p in spawned.started)
    nf4 = Recording()
    run(tmp_path / "nf4", demo_workspace, ["cuda:0/nf4"], ["lora"], ["weights", "outputs"], runner=nf4)
    assert any(not isinstance(p, ForkedProcess) for p in nf4.started)  # the quantized capture: spawned


def test_cuda_loads_are_bitwise_the_checkpoint(tmp_path, demo_workspace):
    table = run(
        tmp_path, demo_workspace, ["cpu/float32", "cuda:0/float32"], ["lora", "dora", "boft"], ["weights"]
    )
    assert (table.verdict == "identical").all(), table[table.verdict != "identical"][["target", "tensor"]]


def test_tf32_outputs_drift_more_than_plain_float32(tmp_path, demo_workspace):
    table = run(tmp_path, demo_workspace, ["cuda:0/float32", "cuda:0/float32+tf32"], ["lora"], ["outputs"])
    plain = table[table.target == "cuda:0/float32"].max_abs.max()
    tf32 = table[table.target == "cuda:0/float32+tf32"].max_abs.max()
    assert tf32 > plain


def test_boft_on_cuda_is_healthy_and_reports_its_path(tmp_path, demo_workspace):
    table = run(tmp_path, demo_workspace, ["cuda:0/float32"], ["boft"], ["deltas", "outputs"])
    outputs = table[table.check == "outputs"]
    assert not outputs.health_all_zero.any()
    assert (outputs.verdict != "broken").all()
    notes = table[table.check == "deltas"].note
    assert notes.str.contains("fbd_cuda|torch.block_diag").all()


def test_pissa_s_base_rewritten_on_cuda_is_measured_and_named_where_it_parts_from_the_cpu(
    tmp_path, demo_workspace
):
    engine = Engine(tmp_path, runner=ProcessRunner())
    spec = ProbeSpec(
        base=ModelRef(demo_workspace["models"]["tiny-llama"]),
        adapters=(AdapterRef(demo_workspace["adapters"]["pissa"]["path"], "pissa"),),
        targets=(Target.parse("cpu/float32"), Target.parse("cuda:0/float32")),
        checks=("weights", "outputs"),
    )
    job = engine.submit(spec)
    assert job.wait(600) and job.state == "succeeded", job.error
    record = engine.store.open(job.run_id)
    table = record.metrics()
    rewritten = table[table.role == "rewritten base"]
    assert rewritten.groupby("target").tensor.nunique().to_dict() == {"cpu/float32": 12, "cuda:0/float32": 12}
    # each within float32 rounding of the float64 rewrite (an SVD in float32, on either device)
    assert rewritten.rel_l2.max() < 1e-4, rewritten[["target", "tensor", "rel_l2"]]
    pairs = record.table("pairwise")
    mine = pairs[pairs.tensor.isin(set(rewritten.tensor))]
    differs = not mine.bitwise_equal.astype(bool).all()
    [rewrite] = record.judgement().rewrites
    assert (("cuda:0/float32", "cpu/float32") in rewrite.differing) == differs
    # the loaded tensors themselves stay bitwise the file on the GPU
    loaded = table[(table.check == "weights") & (table.role != "rewritten base")]
    assert (loaded.verdict == "identical").all()
