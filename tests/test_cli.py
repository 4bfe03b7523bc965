"""The CLI end to end on the demo workspace: real worker processes, exit codes, messages."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def cli(*args, home):
    return subprocess.run(
        [sys.executable, "-m", "core", *args, "--home", str(home)]
        if args[0] != "devices"
        else [sys.executable, "-m", "core", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )


def adapter_args(demo, names):
    return [f"{demo['adapters'][n]['path']}={n}" for n in names]


@pytest.fixture(scope="module")
def two_target_run(demo_workspace, tmp_path_factory):
    home = tmp_path_factory.mktemp("cli-home")
    names = ["lora", "dora", "pissa", "boft", "oft", "ia3"]
    proc = cli(
        "run",
        "--base",
        demo_workspace["models"]["tiny-llama"],
        "--adapter",
        *adapter_args(demo_workspace, names),
        "--target",
        "cpu/float32",
        "cpu/bfloat16",
        "--json",
        home=home,
    )
    return proc, home


@pytest.mark.e2e
def test_run_json_and_exit_code_1_on_bfloat16_drift(two_target_run):
    proc, home = two_target_run
    assert proc.returncode == 1, proc.stderr
    out = json.loads(proc.stdout)
    assert {"run_id", "run_dir", "status", "verdicts", "worst"} <= set(out)
    assert out["status"] == "succeeded"
    assert out["verdicts"]["drift"] > 0
    assert out["worst"][0]["verdict"] in ("drift", "broken")
    assert "Mismatched elements" in out["worst"][0]["explanation"]
    # progress went to stderr, with stage and step k of n
    assert "load adapter pissa" in proc.stderr and "/" in proc.stderr
    import pandas as pd

    table = pd.read_parquet(Path(out["run_dir"]) / "metrics.parquet")
    for col in (
        "check",
        "target",
        "reference",
        "layer",
        "module",
        "role",
        "dtype",
        "shape",
        "numel",
        "bitwise_equal",
        "n_mismatch",
        "max_abs",
        "mean_abs",
        "rmse",
        "rel_l2",
        "cos_sim",
        "max_ulp",
        "min_atol",
        "worst_index",
        "verdict",
    ):
        assert col in table.columns
    # one row per (check, target, tensor or output)
    assert not table.duplicated(["check", "target", "adapter", "tensor"]).any()

    # every loaded tensor is bitwise the file; PiSSA's rewritten base weights are computed at load
    weights32 = table[(table.check == "weights") & (table.target == "cpu/float32")]
    w32 = weights32[weights32.role != "rewritten base"]
    assert len(w32) > 100 and (w32.verdict == "identical").all() and w32.bitwise_equal.all()
    rewritten = weights32[weights32.role == "rewritten base"]
    assert len(rewritten) == 12 and set(rewritten.adapter) == {"pissa"}
    assert (rewritten.verdict == "within tolerance").all() and rewritten.rel_l2.max() < 1e-5

    wbf = table[(table.check == "weights") & (table.target == "cpu/bfloat16") & (table.role == "base")]
    cast = wbf[wbf.verdict != "identical"]
    assert len(cast) >= 28  # every Linear weight and the embedding are rounded to bfloat16
    assert (cast.verdict == "within tolerance").all()
    # rounding float32 → bfloat16: at most half an ulp, relative error of order 2^-9
    assert cast.max_ulp.max() <= 0.5
    assert 5e-4 < cast.rel_l2.median() < 3e-3
    assert cast.note.str.contains("cast float32 → bfloat16").all()

    out32 = table[(table.check == "outputs") & (table.target == "cpu/float32")]
    assert set(out32.adapter.fillna("-")) == {"-", "lora", "dora", "pissa", "boft", "oft", "ia3"}
    assert (out32.verdict == "within tolerance").all()
    assert out32.max_abs.max() < 1e-5
    outbf = table[(table.check == "outputs") & (table.target == "cpu/bfloat16")]
    assert outbf.max_abs.min() > 1e-3 and outbf.max_abs.max() < 5e-2
    pissa_ref = out32[out32.adapter == "pissa"].note.iloc[0]
    assert "PiSSA" in pissa_ref and "float32 and upcast" in pissa_ref

    d32 = table[(table.check == "deltas") & (table.target == "cpu/float32")]
    assert set(d32.adapter) == {"lora", "dora", "pissa", "boft", "oft", "ia3"}
    assert d32.verdict.isin(["identical", "within tolerance"]).all()
    assert d32.rel_l2.max() < 1e-5


@pytest.mark.e2e
def test_runs_lists_the_run_and_human_summary(two_target_run, demo_workspace, tmp_path, capsys):
    from core import cli as weightdrift

    proc, home = two_target_run
    run_id = json.loads(proc.stdout)["run_id"]
    listed = cli("runs", home=home)
    assert listed.returncode == 0 and run_id in listed.stdout and "succeeded" in listed.stdout
    # a float32-only weights run exits 0 and prints the human summary (the summary is the runner's
    # whatever runs the tasks: in this process, not another fork server's; two_target_run has the workers)
    code = weightdrift.main(
        [
            "run",
            "--base",
            demo_workspace["models"]["tiny-llama"],
            "--adapter",
            *adapter_args(demo_workspace, ["lora"]),
            "--target",
            "cpu/float32",
            "--check",
            "weights",
            "--in-process",
            "--home",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "verdicts per check and target" in out.out
    assert "bitwise identical" in out.out


def test_a_reader_that_stops_early_gets_no_traceback(two_target_run):
    """`weightdrift runs | head -1`: stdout's reader is gone before the listing is written."""
    _, home = two_target_run
    read_end, write_end = os.pipe()
    os.close(read_end)  # a reader that has already stopped: every write to the pipe fails
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "core", "runs", "--home", str(home)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert proc.stderr == "" and proc.returncode == 2, proc.stderr


def _one_line_error(proc, fragment):
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:") and fragment in lines[0], lines[0]
    assert "Traceback" not in proc.stderr


def test_bad_inputs_exit_2_with_one_line(demo_workspace, tmp_path):
    base = demo_workspace["models"]["tiny-llama"]
    lora = f"{demo_workspace['adapters']['lora']['path']}=lora"
    _one_line_error(
        cli("run", "--base", str(tmp_path / "nope"), "--target", "cpu/float32", home=tmp_path),
        "no such folder",
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_error(
        cli("run", "--base", str(empty), "--target", "cpu/float32", home=tmp_path),
        "not a model folder (no config.json)",
    )
    bert_adapter = f"{demo_workspace['adapters']['bert-lora']['path']}=bert"
    _one_line_error(
        cli("run", "--base", base, "--adapter", bert_adapter, "--target", "cpu/float32", home=tmp_path),
        "made for a different base model",
    )
    broken = tmp_path / "truncated"
    shutil.copytree(base, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    _one_line_error(cli("run", "--base", str(broken), "--target", "cpu/float32", home=tmp_path), "truncated")
    _one_line_error(
        cli(
            "run",
            "--base",
            base,
            "--adapter",
            lora,
            "--target",
            "cpu/float32",
            "--check",
            "nope",
            home=tmp_path,
        ),
        "unknown check nope",
    )
    _one_line_error(
        cli("run", "--base", base, "--target", "cuda:7/float32", home=tmp_path),
        "cuda:7 does not exist on this machine",
    )
    _one_line_error(cli("run", "--base", base, "--target", "cpu/int4", home=tmp_path), "unknown dtype")
    _one_line_error(cli("run", "--target", "cpu/float32", home=tmp_path), "--base is required")


def test_a_wrong_path_or_argument_is_answered_before_any_worker_starts(
    demo_workspace, tmp_path, monkeypatch, capsys
):
    """What the arguments and the folders alone show: no runner is made, no interpreter imports."""
    from core import cli
    from core.engine import ray_runner

    def no_runner(*args, **kwargs):
        raise AssertionError("a runner was made for arguments that cannot run")

    monkeypatch.setattr(ray_runner, "make_runner", no_runner)
    base = demo_workspace["models"]["tiny-llama"]
    gone = f"{tmp_path / 'gone'}=gone"
    cases = [
        (["--base", str(tmp_path / "nope"), "--target", "cpu/float32"], "no such folder"),
        (["--base", base, "--adapter", gone, "--target", "cpu/float32"], "no such folder"),
        (["--base", base, "--target", "cpu/int4"], "unknown dtype"),
        (["--target", "cpu/float32"], "--base is required"),
        (["--base", base, "--target", "cpu/float32", "--check", "weights", "nope"], "unknown check nope"),
    ]
    for argv, fragment in cases:
        assert cli.main(["run", *argv, "--home", str(tmp_path)]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error:") and fragment in err, err


def test_a_run_of_given_paths_warms_its_workers_for_the_quantized_targets_it_has(
    demo_workspace, tmp_path, monkeypatch, capsys
):
    """Given paths, the CLI knows the targets before its workers start: where none is quantized, its
    fork server imports no bitsandbytes (`ProcessRunner.warm`); the demo's are known only later."""
    from core import cli
    from core.engine import ray_runner
    from core.engine.runners import InProcessRunner

    warmed = []

    class Stop(Exception):
        pass

    class Recording(InProcessRunner):
        def warm(self, fresh=0, quantized=True):
            warmed.append(quantized)
            raise Stop("warmed")  # the run itself is not what is asked here

    monkeypatch.setattr(ray_runner, "make_runner", lambda *a, **k: Recording())
    base = demo_workspace["models"]["tiny-llama"]
    for argv in (
        ["--base", base, "--target", "cpu/float32"],
        ["--base", base, "--target", "cpu/nf4"],
        ["--demo"],
    ):
        assert cli.main(["run", *argv, "--check", "weights", "--home", str(tmp_path)]) == 2, argv
        assert "warmed" in capsys.readouterr().err
    assert warmed == [False, True, True]


def test_demo_json_and_devices(demo_workspace, tmp_path):
    # the session's demo home: `demo` finds its workspace (test_json_is_one_document… builds one by the CLI)
    proc = cli("demo", "--json", home=Path(demo_workspace["models"]["tiny-llama"]).parents[2])
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out == {key: json.loads(json.dumps(demo_workspace[key])) for key in out}  # what the build made
    assert set(out["models"]) == {"tiny-llama", "tiny-bert"}
    assert out["adapters"]["boft"]["type"] == "boft" and out["adapters"]["boft"]["base"] == "tiny-llama"
    assert Path(out["adapters"]["pissa"]["path"]).is_dir()
    dev = cli("devices", "--json", home=tmp_path)
    assert dev.returncode == 0
    info = json.loads(dev.stdout)
    assert info["devices"][0]["name"] == "cpu"
    assert info["environment"]["torch"].startswith("2.13.0")


@pytest.mark.e2e
def test_adapter_that_fails_in_the_worker_fails_the_job_with_its_reason(demo_workspace, tmp_path):
    bad = tmp_path / "badlora"
    shutil.copytree(demo_workspace["adapters"]["lora"]["path"], bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    config["r"] = 16  # the tensors hold rank 8: PEFT refuses them while loading
    (bad / "adapter_config.json").write_text(json.dumps(config))
    proc = cli(
        "run",
        "--base",
        demo_workspace["models"]["tiny-llama"],
        "--adapter",
        f"{bad}=bad",
        "--target",
        "cpu/float32",
        "--json",
        home=tmp_path,
    )
    assert proc.returncode == 2
    out = json.loads(proc.stdout)
    assert out["status"] == "failed"
    assert (
        "adapter bad" in out["error"]
        and "size mismatch" in out["error"]
        and "load adapter bad" in out["error"]
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: run") and "size mismatch" in last
    assert "Traceback" not in proc.stderr
    listed = cli("runs", "--json", home=tmp_path)
    assert json.loads(listed.stdout)[0]["status"] == "failed"


def _workers_of(home: Path) -> list:
    """Worker processes writing into `home` (their stderr is a log file of one of its runs)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "core.engine.worker" not in " ".join(proc.info["cmdline"] or []):
                continue
            if any(f.path.startswith(str(home)) for f in proc.open_files()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.mark.e2e
def test_sigterm_cancels_the_run_and_leaves_no_worker_and_a_running_run_cannot_be_deleted(
    demo_workspace, tmp_path
):
    import os
    import signal
    import time

    import psutil

    from core.engine.store import Store, StoreError

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "core",
            "run",
            "--base",
            demo_workspace["models"]["tiny-llama"],
            "--adapter",
            *adapter_args(demo_workspace, ["lora", "dora", "boft"]),
            "--target",
            "cpu/float32",
            "cpu/bfloat16",
            "--home",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        store = Store(tmp_path)
        deadline = time.monotonic() + 120
        run_id = None
        while time.monotonic() < deadline:
            runs = store.list_runs()
            if runs and runs[0].status == "running" and _workers_of(tmp_path):
                run_id = runs[0].run_id
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        assert run_id is not None, "the run never got a worker"
        # a second process (this one) cannot delete it while the CLI executes it
        with pytest.raises(StoreError, match=f"run {run_id} is being executed by process {proc.pid}"):
            store.delete(run_id)
        assert (tmp_path / "runs" / run_id / "run.json").exists()

        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 2, err
    assert f"cancelling run {run_id}: received SIGTERM; stopping its workers" in err
    assert (
        err.strip().splitlines()[-1] == f"error: run {run_id} cancelled: cancelled: the CLI received SIGTERM"
    )
    assert "Traceback" not in err
    time.sleep(0.5)
    assert [p.pid for p in _workers_of(tmp_path) if p.status() != psutil.STATUS_ZOMBIE] == []
    record = store.open(run_id)
    assert record.status == "cancelled"
    assert record.error == "cancelled: the CLI received SIGTERM"
    store.delete(run_id)  # its owner is gone: now it can go
    assert not os.path.exists(tmp_path / "runs" / run_id)


def test_a_run_json_that_cannot_be_written_fails_the_run_with_the_reason(
    demo_workspace, tmp_path, monkeypatch, capsys
):
    """Disk full while the run goes: one sentence naming run.json and what to do, exit 2, no traceback."""
    import errno

    from core import cli
    from core.engine import store as store_module

    real_write = store_module.atomic_write_json

    def write(path, obj):
        if path.name == "run.json" and obj.get("status") != "queued":  # the disk fills once it runs
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(path, obj)

    monkeypatch.setattr(store_module, "atomic_write_json", write)
    code = cli.main(
        [
            "run",
            "--base",
            demo_workspace["models"]["tiny-llama"],
            "--target",
            "cpu/float32",
            "--check",
            "weights",
            "--in-process",
            "--home",
            str(tmp_path),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    run_dir = next((tmp_path / "runs").iterdir())
    assert err.strip().splitlines()[-1] == (
        f"error: run {run_dir.name} failed: cannot update {run_dir / 'run.json'}: No space left on device "
        "(the disk is full: free some space)"
    )
    assert "Traceback" not in err and "None" not in err


# A library that talks on stdout, as PEFT does on a GPU machine (nvcc building BOFT's kernel at first use):
# when peft is imported and when an adapter's config is opened (written by the demo build, read at a
# load), it prints, writes to descriptor 1 without a newline, and runs a process that writes to its stdout.
CHATTY_LIBRARY = """
import os
import subprocess
import sys

said = set()


def say(when):
    if when not in said:
        said.add(when)
        print(f"chatter print {when}", flush=True)
        os.write(1, f"chatter fd1 {when} ".encode())
        subprocess.run(["/bin/sh", "-c", f"echo chatter child {when}"], check=True)


def hook(event, args):
    if event == "import" and args[0] == "peft":
        say("at import")
    elif event == "open" and str(args[0]).endswith("adapter_config.json"):
        say("at load")


sys.addaudithook(hook)
"""
# `python -m core` as on a machine with a GPU (`gpu_visible`): quantized targets' tasks are spawned
AS_ON_A_GPU_MACHINE = (
    "import core.engine.runners as r; r.gpu_visible = lambda *a, **k: True; "
    "from core.__main__ import entry; entry()"
)


def _chatter(text: str, when: str) -> set[str]:
    return {kind for kind in ("print", "fd1", "child") if f"chatter {kind} {when}" in text}


@pytest.mark.e2e
def test_json_is_one_document_whatever_a_library_prints(tmp_path):
    """stdout under --json is one JSON document, and the human answer is alone on stdout, though a library
    prints at import and at load in the CLI and in its workers: that goes to stderr or the task's log."""
    (tmp_path / "chatty").mkdir()
    (tmp_path / "chatty" / "sitecustomize.py").write_text(CHATTY_LIBRARY)  # loaded by every interpreter
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "chatty")}
    home = tmp_path / "home"

    def command(*args, python=("-m", "core")):
        proc = subprocess.run(
            [sys.executable, *python, *args, "--home", str(home)],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
            timeout=300,
        )
        assert proc.returncode in (0, 1), proc.stderr
        assert "chatter" not in proc.stdout, proc.stdout
        return proc

    demo = command("demo", "--json")  # builds the workspace here: peft is imported and adapters written
    manifest = json.loads(demo.stdout)
    assert _chatter(demo.stderr, "at import") == _chatter(demo.stderr, "at load") == {"print", "fd1", "child"}
    inputs = ["--base", manifest["models"]["tiny-llama"], "--adapter", manifest["adapters"]["lora"]["path"]]
    inputs += ["--target", "cpu/float32", "--check", "weights", "--no-peers"]

    # the GPU machine's case: there a quantized target's task is spawned (the fork server imports no
    # bitsandbytes), and the library talks inside that worker while it imports and loads
    quantized = [*inputs[:4], "--target", "cpu/nf4", *inputs[6:]]
    run = json.loads(command("run", *quantized, "--json", python=("-c", AS_ON_A_GPU_MACHINE)).stdout)
    assert run["status"] == "succeeded" and run["verdicts"]["identical"] > 0
    capture_log = Path(run["run_dir"], "logs", "cpu_nf4.log").read_text()
    assert _chatter(capture_log, "at import") == _chatter(capture_log, "at load") == {"print", "fd1", "child"}

    # tasks forked by the fork server (which imported peft: its chatter is in its own error file)
    snapshot_file = tmp_path / "here.wdsnap"
    snapshot = json.loads(command("snapshot", *inputs, "-o", str(snapshot_file), "--json").stdout)
    assert snapshot["snapshot"] == str(snapshot_file)
    capture_log = Path(snapshot["run_dir"], "logs", "cpu_float32.log").read_text()
    assert _chatter(capture_log, "at load") == {"print", "fd1", "child"}

    # in the CLI's process (--in-process): at load, into the CLI's own descriptor 1
    compare = command("compare", str(snapshot_file), "--json", "--in-process")
    assert json.loads(compare.stdout)["status"] == "succeeded"
    assert _chatter(compare.stderr, "at load") == {"print", "fd1", "child"}


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_the_answer_is_alone_on_stdout_in_either_form(json_flag, tmp_path, monkeypatch, capfd):
    """The human answer too: what a library prints while a command works goes to stderr, its lines stay
    whole and in order on stdout (here `runs`, listing through a store that talks, at the descriptors)."""
    from core import cli
    from core.engine.store import Store

    listed = Store.list_runs

    def talking(store):
        print("chatter print at load")
        os.write(1, b"chatter fd1 at load ")
        subprocess.run(["/bin/sh", "-c", "echo chatter child at load"], check=True)
        return listed(store)

    monkeypatch.setattr(Store, "list_runs", talking)
    capfd.readouterr()
    assert cli.main(["runs", "--home", str(tmp_path), *json_flag]) == 0
    out, err = capfd.readouterr()
    assert out == ("[]\n" if json_flag else f"no runs in {tmp_path / 'runs'}\n")
    assert _chatter(err, "at load") == {"print", "fd1", "child"}
