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


def run(home, demo, targets, adapters, checks):
    engine = Engine(home, runner=ProcessRunner())
    spec = ProbeSpec(
        base=ModelRef(demo["models"]["tiny-llama"]),
        adapters=tuple(AdapterRef(demo["adapters"][n]["path"], n) for n in adapters),
        targets=tuple(map(Target.parse, targets)),
        checks=tuple(checks),
    )
    job = engine.submit(spec)
    assert job.wait(600)
    assert job.state == "succeeded", job.error
    return engine.store.open(job.run_id).metrics()


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
