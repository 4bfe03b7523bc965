import errno
import json
import os
import subprocess
import sys
import threading
import time

import pandas as pd
import pytest

from core.engine import store as store_module
from core.engine.jobs import Engine
from core.engine.runners import InProcessRunner
from core.engine.store import Store, StoreError, atomic_write_json
from core.spec import ModelRef, ProbeSpec, Target

SPEC = ProbeSpec(base=ModelRef("/m"), adapters=(), targets=(Target.parse("cpu/float32"),))


def test_atomic_write_leaves_no_temporary_files(tmp_path):
    path = tmp_path / "a" / "x.json"
    atomic_write_json(path, {"a": 1})
    atomic_write_json(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]


def test_create_update_open_list_delete(tmp_path):
    store = Store(tmp_path)
    rec = store.create_run(SPEC)
    assert store.open(rec.run_id).status == "queued"  # this process is alive: still queued
    store.update(rec.run_id, status="succeeded")
    # succeeded without a metrics table is not a result
    assert store.open(rec.run_id).status == "failed"
    store.write_metrics(rec.run_id, pd.DataFrame({"verdict": ["identical"]}))
    opened = store.open(rec.run_id)
    assert opened.status == "succeeded" and opened.spec == SPEC
    assert list(opened.metrics()["verdict"]) == ["identical"]
    assert [r.run_id for r in store.list_runs()] == [rec.run_id]
    with pytest.raises(StoreError, match="is being executed by process"):
        store.delete(rec.run_id)  # this process still owns it
    store.release(rec.run_id)
    store.delete(rec.run_id)
    assert store.list_runs() == []


def test_run_of_a_crashed_process_reads_as_failed(tmp_path):
    store = Store(tmp_path)
    rec = store.create_run(SPEC)
    # a run stored before owner locks: its owner's pid tells
    store.release(rec.run_id)
    (rec.run_dir / ".owner.lock").unlink()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    info = json.loads((rec.run_dir / "run.json").read_text())
    info["status"] = "running"
    info["owner"]["pid"] = int(dead.stdout)
    (rec.run_dir / "run.json").write_text(json.dumps(info))
    opened = store.open(rec.run_id)
    assert opened.status == "failed"
    assert "interrupted" in opened.error


def test_damaged_run_folder_is_listed_not_dropped(tmp_path):
    store = Store(tmp_path)
    good = store.create_run(SPEC)
    bad = tmp_path / "runs" / "20000101-000000-badbad"
    bad.mkdir()
    (bad / "run.json").write_text("{not json")
    runs = {r.run_id: r for r in store.list_runs()}
    assert runs[bad.name].status == "damaged"
    assert runs[bad.name].error.startswith("run.json is unreadable (")
    assert good.run_id in runs
    assert os.path.exists(good.run_dir / "spec.json")


# --- case 1: a run.json that is JSON but not a run's record -----------------------------------

FINISHED = {
    "run_id": "x",
    "status": "succeeded",
    "created": 1.0,
    "started": 1.0,
    "finished": 2.0,
    "duration_s": 1.0,
    "error": None,
    "owner": {"pid": 1, "host": "h"},
    "targets": {},
}


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ([], "run.json holds a JSON list, not an object"),
        (None, "run.json holds a JSON NoneType, not an object"),
        ("x", "run.json holds a JSON str, not an object"),
        ({**FINISHED, "created": "yesterday"}, "run.json 'created' is 'yesterday', not a number"),
        ({**FINISHED, "duration_s": "12"}, "run.json 'duration_s' is '12', not a number"),
        (
            {**FINISHED, "status": "running", "owner": {"pid": "abc", "host": "h"}},
            "run.json 'owner.pid' is 'abc', not a process id",
        ),
        ({**FINISHED, "status": "done"}, "run.json status 'done' is not one of"),
    ],
)
def test_a_run_json_that_is_no_record_is_listed_damaged_and_can_be_deleted(tmp_path, content, reason):
    store = Store(tmp_path)
    good = store.create_run(SPEC)
    bad = store.create_run(SPEC)
    store.release(bad.run_id)
    (bad.run_dir / "run.json").write_text(json.dumps(content))
    runs = {r.run_id: r for r in store.list_runs()}
    assert runs[good.run_id].status == "queued"
    assert runs[bad.run_id].status == "damaged"
    assert runs[bad.run_id].error.startswith(reason), runs[bad.run_id].error
    assert "Delete the run" in runs[bad.run_id].error
    assert store.open(bad.run_id).status == "damaged"  # it opens, to show why
    store.delete(bad.run_id)
    assert [r.run_id for r in store.list_runs()] == [good.run_id]


def test_cli_runs_lists_a_home_with_a_damaged_run(tmp_path):
    store = Store(tmp_path)
    good = store.create_run(SPEC)
    store.update(good.run_id, status="failed", error="x")
    store.release(good.run_id)
    bad = tmp_path / "runs" / "20000101-000000-badbad"
    bad.mkdir()
    (bad / "run.json").write_text("[]")
    proc = subprocess.run(
        [sys.executable, "-m", "core", "runs", "--home", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=store_module.__file__.rsplit("/core/", 1)[0],
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"{good.run_id}  failed")
    assert lines[1].startswith("20000101-000000-badbad  damaged    unknown")
    assert "run.json holds a JSON list, not an object" in lines[1]


# --- case 4: writes that fail leave nothing behind, and a failed run.json write ends the job ----


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failed_write_leaves_no_temporary_file_and_the_old_content(tmp_path, monkeypatch):
    path = tmp_path / "x.json"
    atomic_write_json(path, {"a": 1})
    monkeypatch.setattr(store_module.os, "fsync", _disk_full)
    with pytest.raises(OSError):
        atomic_write_json(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_a_run_folder_that_cannot_be_made_leaves_nothing(tmp_path, monkeypatch):
    store = Store(tmp_path)
    monkeypatch.setattr(store_module.os, "fsync", _disk_full)
    with pytest.raises(
        StoreError, match=r"cannot create the run folder .*No space left on device \(the disk is full"
    ):
        store.create_run(SPEC)
    assert list((tmp_path / "runs").iterdir()) == []


def test_a_failed_table_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    store = Store(tmp_path)
    rec = store.create_run(SPEC)
    monkeypatch.setattr(pd.DataFrame, "to_parquet", _disk_full)
    with pytest.raises(StoreError, match="cannot write .*metrics.parquet: No space left on device"):
        store.write_metrics(rec.run_id, pd.DataFrame({"a": [1]}))
    assert sorted(p.name for p in rec.run_dir.iterdir()) == [".owner.lock", "run.json", "spec.json"]


def test_the_sweep_removes_leftovers_of_killed_writes_only(tmp_path):
    store = Store(tmp_path)
    done = store.create_run(SPEC)
    store.release(done.run_id)
    running = store.create_run(SPEC)  # still owned (locked) by this process
    half = tmp_path / "runs" / ".20000101-000000-aaaaaa.creating"
    half.mkdir()
    (half / ".spec.json.1234abcd.tmp").write_text("{")
    only_tmp = tmp_path / "runs" / "20000101-000000-bbbbbb"  # as the store made folders before
    only_tmp.mkdir()
    (only_tmp / ".spec.json.1234abcd.tmp").write_text("{")
    assert {r.run_id: r.status for r in store.list_runs()}[only_tmp.name] == "damaged"
    for run_dir in (done.run_dir, running.run_dir):
        (run_dir / ".run.json.1234abcd.tmp").write_text("{")
        (run_dir / "captures" / "cpu__float32").mkdir(parents=True)
        (run_dir / "captures" / "cpu__float32" / ".capture.json.1234abcd.tmp").write_text("{")
    assert store.sweep(min_age_s=300) == []  # too young: may be a write in progress
    removed = store.sweep(min_age_s=0)
    assert sorted(str(p.relative_to(tmp_path)) for p in removed) == [
        "runs/.20000101-000000-aaaaaa.creating",
        "runs/20000101-000000-bbbbbb",
        "runs/20000101-000000-bbbbbb/.spec.json.1234abcd.tmp",
        f"runs/{done.run_id}/.run.json.1234abcd.tmp",
        f"runs/{done.run_id}/captures/cpu__float32/.capture.json.1234abcd.tmp",
    ]
    assert (running.run_dir / ".run.json.1234abcd.tmp").exists()
    assert {r.run_id for r in store.list_runs()} == {running.run_id, done.run_id}


def test_a_disk_full_run_json_fails_the_job_with_the_reason(tmp_path, monkeypatch):
    crashed: list = []
    monkeypatch.setattr(threading, "excepthook", lambda args: crashed.append(args))
    engine = Engine(tmp_path, runner=InProcessRunner())
    real_update = Store.update

    def update(self, run_id, **changes):
        if changes.get("status") == "queued":
            return real_update(self, run_id, **changes)
        # from the first state change on, the disk is full
        raise StoreError(
            f"cannot update {tmp_path}/run.json: No space left on device (the disk is full: free some space)"
        )

    monkeypatch.setattr(Store, "update", update)
    monkeypatch.setattr(engine, "validate", lambda *args: None)
    job = engine.submit(SPEC)
    assert job.wait(60)
    snap = job.snapshot()
    assert snap["state"] == "failed"
    assert snap["error"].startswith("cannot update ") and "No space left on device" in snap["error"]
    assert snap["store_error"] == snap["error"]
    assert crashed == []  # no thread died with a traceback
    assert not store_module.lock_held(job.run_dir)  # ownership given up


# --- case 5: a metrics table that does not open --------------------------------------------------


def _finished_run(store):
    rec = store.create_run(SPEC)
    store.write_metrics(rec.run_id, pd.DataFrame({"verdict": ["identical"] * 500, "max_abs": range(500)}))
    store.update(rec.run_id, status="succeeded", duration_s=1.0)
    store.release(rec.run_id)
    return rec


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda b: b[: len(b) // 2], id="truncated"),
        pytest.param(lambda b: b"", id="empty"),
        pytest.param(lambda b: b[:200] + bytes([b[200] ^ 0x10]) + b[201:], id="bit-flipped"),
    ],
)
def test_a_damaged_metrics_table_reads_as_damaged(tmp_path, damage):
    store = Store(tmp_path)
    rec = _finished_run(store)
    assert store.open(rec.run_id).status == "succeeded"
    path = rec.run_dir / "metrics.parquet"
    data = path.read_bytes()
    time.sleep(0.01)
    path.write_bytes(damage(data))
    opened = store.open(rec.run_id)
    assert opened.status == "damaged"
    assert opened.error.startswith("metrics.parquet is damaged (")
    assert opened.info["created"] == rec.info["created"]
    assert [r.status for r in store.list_runs()] == ["damaged"]
    with pytest.raises(StoreError, match="metrics.parquet is damaged"):
        opened.metrics()


# --- case 2: ownership across processes ----------------------------------------------------------

OWNER = """
import sys, time
from core.spec import ModelRef, ProbeSpec, Target
from core.engine.store import Store
spec = ProbeSpec(base=ModelRef("/m"), adapters=(), targets=(Target.parse("cpu/float32"),))
rec = Store(sys.argv[1]).create_run(spec)
print(rec.run_id, flush=True)
time.sleep(60)
"""


def test_a_run_owned_by_another_live_process_cannot_be_deleted_and_a_dead_owner_is_seen(tmp_path):
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=store_module.__file__.rsplit("/core/", 1)[0],
    )
    try:
        run_id = owner.stdout.readline().strip()
        store = Store(tmp_path)
        assert store.in_use(run_id)
        with pytest.raises(StoreError, match=f"run {run_id} is being executed by process {owner.pid}"):
            store.delete(run_id)
        assert store.open(run_id).status == "queued"
    finally:
        owner.kill()
        owner.wait()
    # the same pid reused by some other process would not matter: the lock went with the owner
    assert not store.in_use(run_id)
    assert store.open(run_id).status == "failed" and "interrupted" in store.open(run_id).error
    store.delete(run_id)
    assert store.list_runs() == []


def test_a_copied_run_folder_lists_opens_and_deletes_as_itself(tmp_path, capsys):
    """The folder's name is the run's identity: a copy keeps the original's id in its run.json."""
    import shutil

    from core import cli

    store = Store(tmp_path)
    original = store.create_run(SPEC)
    store.write_metrics(original.run_id, pd.DataFrame({"verdict": ["identical"]}))
    store.update(original.run_id, status="succeeded")
    store.release(original.run_id)
    copy = "20991231-000000-c0c0c0"  # newer than the original: listed first
    shutil.copytree(original.run_dir, tmp_path / "runs" / copy)
    store.write_metrics(copy, pd.DataFrame({"verdict": ["drift"]}))  # the copy changed after copying
    assert json.loads((tmp_path / "runs" / copy / "run.json").read_text())["run_id"] == original.run_id
    listed = store.list_runs()
    assert [(r.run_id, r.info["run_id"], r.run_dir.name) for r in listed] == [
        (copy, copy, copy),
        (original.run_id, original.run_id, original.run_id),
    ]
    note = f"its run.json names run {original.run_id}: this folder was copied or renamed, and is the run {copy} here"
    assert [r.id_note for r in listed] == [note, None]
    opened = store.open(copy)
    assert opened.status == "succeeded" and opened.run_dir == tmp_path / "runs" / copy
    assert list(opened.metrics()["verdict"]) == ["drift"]
    assert list(store.open(original.run_id).metrics()["verdict"]) == ["identical"]
    assert cli.main(["runs", "--home", str(tmp_path), "--json"]) == 0
    assert [r["run_id"] for r in json.loads(capsys.readouterr().out)] == [copy, original.run_id]
    assert cli.main(["runs", "--home", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{copy}  succeeded") and lines[0].endswith(f"  — note: {note}")
    assert lines[1].startswith(f"{original.run_id}  succeeded") and "note" not in lines[1]
    store.delete(copy)
    assert [r.run_id for r in store.list_runs()] == [original.run_id]
    assert list(store.open(original.run_id).metrics()["verdict"]) == ["identical"]


def test_a_capture_json_is_parsed_once_per_version_and_a_new_version_is_read(tmp_path, monkeypatch):
    """environments() and notes() (the Overview asks three times a render) parse each version of a
    capture.json once; a rewritten file is read again, and no reader shares another's dict."""
    store = Store(tmp_path)
    rec = store.create_run(SPEC)
    path = rec.run_dir / "captures" / "cpu_float32" / "capture.json"
    path.parent.mkdir(parents=True)
    atomic_write_json(path, {"target": "cpu/float32", "environment": {"torch": "2.13.0"}, "notes": ["a"]})
    parsed = []
    real_loads = json.loads
    monkeypatch.setattr(
        store_module.json, "loads", lambda text, **kw: parsed.append(len(text)) or real_loads(text, **kw)
    )
    opened = store.open(rec.run_id)
    for _ in range(3):
        assert opened.environments() == {"cpu/float32": {"torch": "2.13.0"}}
        assert opened.notes() == ["a"]
    opened.environments()["cpu/float32"]["torch"] = "changed by a reader"
    assert store.open(rec.run_id).environments() == {"cpu/float32": {"torch": "2.13.0"}}
    size = path.stat().st_size
    assert parsed.count(size) == 1  # the file's text, parsed once for the nine reads and a second record
    atomic_write_json(
        path, {"target": "cpu/float32", "environment": {"torch": "2.13.0"}, "notes": ["a", "b"]}
    )
    assert opened.notes() == ["a", "b"]
    assert parsed.count(path.stat().st_size) == 1 and path.stat().st_size != size
    store.release(rec.run_id)


def test_a_capture_json_that_is_no_object_is_skipped_and_odd_fields_read_as_none(tmp_path):
    store = Store(tmp_path)
    rec = store.create_run(SPEC)
    captures = rec.run_dir / "captures"
    for folder, text in {
        "cpu_bfloat16": "{ not json",
        "cpu_float16": "[1, 2]",
        "cpu_float32": json.dumps({"environment": ["not", "a", "dict"], "notes": "not a list"}),
        "cpu_float64": json.dumps(
            {"target": "cpu/float64", "environment": {"torch": "2.13.0"}, "notes": ["n"]}
        ),
    }.items():
        (captures / folder).mkdir(parents=True)
        (captures / folder / "capture.json").write_text(text)
    opened = store.open(rec.run_id)
    assert opened.environments() == {"cpu/float64": {"torch": "2.13.0"}}
    assert opened.notes() == ["n"]
    store.release(rec.run_id)
