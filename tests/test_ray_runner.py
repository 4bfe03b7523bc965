"""The Ray runner on a local Ray started here (CPU only, 2 CPUs): the demo gives the same metrics
table as the process runner, a killed Ray worker fails its job with a reason, and cancel works.

The tests on a real Ray are skipped where Ray is not installed (it is optional: requirements-ray.txt);
the others run without it. One Ray for the module: starting it takes seconds, and its tests share it.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from core.engine.ray_runner import pack_tree, restore_process_env, unpack_tree
from core.spec import AdapterRef, ModelRef, ProbeSpec, SpecError, Target


def test_restore_process_env_gives_back_what_the_worker_started_with():
    # Ray set both for its task; the node's worker had CUDA_VISIBLE_DEVICES=0,1 and no thread count
    env = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "1", "PATH": "/bin"}
    ray_set = restore_process_env(env, {"CUDA_VISIBLE_DEVICES": "0,1", "PATH": "/bin"})
    assert env == {"CUDA_VISIBLE_DEVICES": "0,1", "PATH": "/bin"}
    assert ray_set == {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "1"}
    unknown = {"OMP_NUM_THREADS": "1"}
    restore_process_env(unknown, None)  # where the start environment cannot be read: left alone
    assert unknown == {"OMP_NUM_THREADS": "1"}


def test_archive_round_trip_and_unsafe_paths(tmp_path):
    src = tmp_path / "src"
    (src / "captures" / "cpu_float32").mkdir(parents=True)
    (src / "captures" / "cpu_float32" / "capture.json").write_text("{}")
    (src / "logs").mkdir()
    (src / "logs" / "cpu_float32.log").write_text("log")
    pack_tree(src, tmp_path / "a.zip")
    dest = tmp_path / "run"
    assert sorted(unpack_tree(tmp_path / "a.zip", dest)) == [
        "captures/cpu_float32/capture.json",
        "logs/cpu_float32.log",
    ]
    assert (dest / "logs" / "cpu_float32.log").read_text() == "log"
    import zipfile

    with zipfile.ZipFile(tmp_path / "bad.zip", "w") as z:
        z.writestr("../outside", "x")
    with pytest.raises(ValueError, match="unsafe path"):
        unpack_tree(tmp_path / "bad.zip", dest)
    assert not (tmp_path / "outside").exists()


def test_node_flag_parses_and_the_local_runner_refuses_it(tmp_path, demo_workspace):
    from core.engine.jobs import Engine
    from core.engine.runners import InProcessRunner
    from core.models.targets import Device

    t = Target.parse("cuda:0/float32+tf32+node=gpu-a6000")
    assert t.node == "gpu-a6000" and str(t) == "cuda:0/float32+tf32+node=gpu-a6000"
    assert t.slug != Target.parse("cuda:0/float32+tf32+node=gpu-4090").slug  # two capture folders
    with pytest.raises(SpecError, match="node=NAME"):
        Target.parse("cpu/float32+node=a/b")
    engine = Engine(tmp_path, runner=InProcessRunner(), devices=[Device("cpu", "cpu", "x")])
    spec = ProbeSpec(
        base=ModelRef(demo_workspace["models"]["tiny-llama"]),
        adapters=(),
        targets=(Target.parse("cpu/float32+node=elsewhere"),),
        checks=("weights",),
    )
    with pytest.raises(SpecError, match="only the Ray runner places targets on nodes"):
        engine.submit(spec)


def test_kill_all_cancels_the_running_and_the_prepared_tasks_and_forgets_the_prepared(monkeypatch):
    """When the runner stops, a task made ready ahead (waiting at its gate) is killed as a running one is:
    its worker would otherwise wait for a turn that never comes."""
    from core.engine import ray_runner

    cancelled = []

    class FakeRay:
        @staticmethod
        def cancel(gen, force=False):
            cancelled.append((gen, force))
            if gen == "gone":
                raise ValueError("a task that ended already")  # one that cannot be cancelled: the rest go on

    monkeypatch.setattr(ray_runner, "import_ray", lambda: FakeRay)
    runner = ray_runner.RayRunner()
    runner._generators = {"run:cpu/float32": "running"}
    runner._prepared = {"run:cpu/bfloat16": "gone", "run:compare": "ready"}
    runner.kill_all()
    assert cancelled == [("running", True), ("gone", True), ("ready", True)]
    assert runner._prepared == {}
    cancelled.clear()
    ray_runner.RayRunner().kill_all()  # nothing started: Ray is not even imported
    assert cancelled == []


def test_runner_options_refused_without_ray(monkeypatch, capsys, tmp_path):
    import sys

    from core.cli import main
    from core.engine.ray_runner import RayUnavailable, make_runner

    argv = ["run", "--demo", "--home", str(tmp_path), "--target", "cpu/float32", "--ray-address", "auto"]
    assert main(argv) == 2
    assert "--ray-address needs --runner ray" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(RayUnavailable, match="pip install -r requirements-ray.txt"):
        make_runner("ray")


# --- on a real local Ray -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_engine(tmp_path_factory):
    """A local Ray (2 CPUs, no GPU, no dashboard) and an engine with the Ray runner, for the module;
    every test that uses it is skipped where Ray is not installed (the tests above still run)."""
    ray = pytest.importorskip(
        "ray", reason="Ray is optional: pip install -r requirements-ray.txt", exc_type=ImportError
    )

    from core.engine.jobs import Engine
    from core.engine.ray_runner import RayRunner

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    runner = RayRunner(grace_s=10)
    try:
        yield Engine(tmp_path_factory.mktemp("ray-home"), runner=runner)
    finally:
        runner.kill_all()
        ray.shutdown()


def _spec(demo, targets, checks=("weights", "deltas", "outputs"), adapters=("lora", "ia3")):
    return ProbeSpec(
        base=ModelRef(demo["models"]["tiny-llama"]),
        adapters=tuple(AdapterRef(demo["adapters"][a]["path"], a) for a in adapters),
        targets=tuple(map(Target.parse, targets)),
        checks=checks,
    )


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.e2e
def test_demo_gives_the_process_runners_metrics_table(ray_engine, demo_workspace, tmp_path):
    import pandas as pd

    from core.engine.jobs import Engine
    from core.engine.runners import ProcessRunner

    spec = _spec(demo_workspace, ["cpu/float32"])
    local = Engine(tmp_path, runner=ProcessRunner())
    # both at once: their worker processes' imports overlap on the 2 cores
    ray_job, local_job = ray_engine.submit(spec), local.submit(spec)
    assert ray_job.wait(120) and local_job.wait(120)
    assert ray_job.state == "succeeded", ray_job.error
    assert local_job.state == "succeeded", local_job.error
    # the same progress events streamed back: stage by stage, step k of n
    stages = [(e["task"], e["stage"], e["step"], e["of"]) for e in ray_job.events]
    assert stages == [(e["task"], e["stage"], e["step"], e["of"]) for e in local_job.events] or sorted(
        stages
    ) == sorted((e["task"], e["stage"], e["step"], e["of"]) for e in local_job.events)
    by_ray = ray_engine.store.open(ray_job.run_id).metrics()
    by_process = local.store.open(local_job.run_id).metrics()
    keys = ["check", "target", "reference", "adapter", "tensor"]
    by_ray = by_ray.sort_values(keys, kind="stable").reset_index(drop=True)
    by_process = by_process.sort_values(keys, kind="stable").reset_index(drop=True)
    assert len(by_ray) == len(by_process) > 0
    pd.testing.assert_frame_equal(by_ray, by_process)  # row by row, every column, exactly
    # where Ray ran it, kept in the capture
    capture = ray_engine.store.open(ray_job.run_id).run_dir / "captures" / "cpu_float32" / "capture.json"
    import json

    assert json.loads(capture.read_text())["meta"]["ray"]["pid"] > 0


@pytest.mark.e2e
def test_killed_ray_worker_fails_the_job_with_a_reason(ray_engine, demo_workspace):
    runner = ray_engine.runner
    job = ray_engine.submit(_spec(demo_workspace, ["cpu/float32"], checks=("weights",)))
    key = f"{job.run_id}:cpu/float32"
    worker = _wait_for(lambda: runner.workers.get(key), 60, "the Ray worker to start")
    os.kill(worker["pid"], signal.SIGKILL)
    assert job.wait(60)
    assert job.state == "failed"
    assert f"the Ray worker (pid {worker['pid']}" in job.error and "died while running the task" in job.error
    assert job.error.startswith("cpu/float32: ")
    assert ray_engine.store.open(job.run_id).status == "failed"
    assert runner.workers == {}  # the engine goes on: the next test's jobs run on it


@pytest.mark.e2e
def test_cancel_stops_the_ray_task(ray_engine, demo_workspace):
    import psutil

    job = ray_engine.submit(_spec(demo_workspace, ["cpu/float32"], checks=("weights",)))
    _wait_for(lambda: job.events, 60, "the first progress event")
    worker = ray_engine.runner.workers.get(f"{job.run_id}:cpu/float32")
    job.cancel()
    assert job.wait(30)
    # it stopped when asked, not killed past the grace period (however long a loaded machine took)
    assert f"{job.run_id}:cpu/float32" not in ray_engine.runner.forced
    assert job.state == "cancelled"
    assert ray_engine.store.open(job.run_id).status == "cancelled"
    if worker is not None:  # a fresh worker per task: it goes away with its task
        _wait_for(lambda: not psutil.pid_exists(worker["pid"]), 20, "the Ray worker to exit")
    assert not any((job.run_dir / "captures").glob("*/capture.json"))  # nothing half-made was kept


@pytest.mark.e2e
def test_the_forms_ray_choice_sends_the_run_to_ray(ray_engine, demo_workspace, monkeypatch):
    from pathlib import Path

    from apptest import make_app, no_exceptions

    from core.engine.ray_runner import RayRunner
    from dashboard import state

    home = Path(demo_workspace["models"]["tiny-llama"]).parents[2]  # the demo is there already
    at = make_app(home, monkeypatch)
    at.run()
    no_exceptions(at)
    at.sidebar.radio(key="form.runner").set_value("ray").run()
    no_exceptions(at)
    assert not at.sidebar.error
    assert at.sidebar.selectbox(key="form.new.device").options == ["cpu"]  # the local Ray's devices
    at.sidebar.multiselect(key="form.adapters").set_value([demo_workspace["adapters"]["lora"]["path"]])
    at.sidebar.multiselect(key="form.targets").set_value(["cpu/float32"])
    at.sidebar.multiselect(key="form.checks").set_value(["weights"])
    at.sidebar.button(key="form.run").click().run()
    job = state.engine().jobs()[0]
    try:
        assert isinstance(job.runner, RayRunner)  # the app's engine, the form's runner
    finally:
        job.cancel()
        assert job.wait(30)
        state.engine().store.delete(job.run_id)  # the demo's home is the session's: leave it as found


def test_node_names_resolve_on_the_cluster(ray_engine, demo_workspace):
    import socket

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from core.engine.tasks import Task

    runner = ray_engine.runner
    here = ray.get_runtime_context().get_node_id()
    assert runner.resolve_node(socket.gethostname().split(".")[0]) == here
    task = Task(kind="capture", run_dir="/x/run", spec={}, target="cpu/float32+node=" + socket.gethostname())
    strategy = runner._options(task)["scheduling_strategy"]
    assert isinstance(strategy, NodeAffinitySchedulingStrategy) and strategy.node_id == here
    assert "num_gpus" not in runner._options(task)
    gpu = Task(kind="capture", run_dir="/x/run", spec={}, target="cuda:1/float32")
    assert runner._options(gpu)["num_gpus"] == 1  # Ray counts the GPU; the task uses the node's cuda:1
    # a node the cluster does not have: the job fails at once, naming the nodes it has
    job = ray_engine.submit(_spec(demo_workspace, ["cpu/float32+node=nowhere"], checks=("weights",)))
    assert job.wait(30)
    assert job.state == "failed"
    assert "no live Ray node is called 'nowhere'; the cluster's nodes: " in job.error
