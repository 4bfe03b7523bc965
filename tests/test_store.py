import json
import os
import subprocess
import sys

import pandas as pd

from core.spec import ModelRef, ProbeSpec, Target
from core.store import Store, atomic_write_json

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
    store.delete(rec.run_id)
    assert store.list_runs() == []


def test_run_of_a_crashed_process_reads_as_failed(tmp_path):
    store = Store(tmp_path)
    rec = store.create_run(SPEC)
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
    runs = {r.run_id: r.status for r in store.list_runs()}
    assert runs[bad.name] == "failed"
    assert good.run_id in runs
    assert os.path.exists(good.run_dir / "spec.json")
