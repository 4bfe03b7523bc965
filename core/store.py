"""Runs on disk: one folder per run under `$WEIGHTDRIFT_HOME/runs`.

    <run_id>/spec.json                 the ProbeSpec
    <run_id>/run.json                  status, timings, per-target progress, errors, owner pid
    <run_id>/captures/<target>/        capture.json + tensors.safetensors (the snapshot format)
    <run_id>/captures/<target>@<check>-<variant>/   the same, for a check run in its own worker
    <run_id>/logs/<target>.log         worker stderr
    <run_id>/metrics.parquet           the metrics table
    <run_id>/<name>.parquet            a check's own tables (memory_timeline, placement, …)

Every file is written to a temporary name and renamed into place, so a reader sees either the
old or the new content. A run whose owning process is gone while it was still queued or running
reads as failed: a half-written run is never shown as a result.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from core.spec import ProbeSpec

ACTIVE_STATES = ("queued", "running")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same folder and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: Path, obj: Any) -> None:
    """JSON variant of atomic_write_bytes."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def new_run_id() -> str:
    """Sortable, unique: `20261122-193012-3fa9c2`."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class RunRecord:
    """A stored run as read back: its spec, its status and where it lives."""

    run_id: str
    run_dir: Path
    info: dict[str, Any] = field(default_factory=dict)
    spec: ProbeSpec | None = None

    @property
    def status(self) -> str:
        return self.info.get("status", "failed")

    @property
    def error(self) -> str | None:
        return self.info.get("error")

    def metrics(self) -> pd.DataFrame:
        """The metrics table (empty if the run has none)."""
        path = self.run_dir / "metrics.parquet"
        if not path.exists():
            return pd.DataFrame()
        return pd.read_parquet(path)

    def table(self, name: str) -> pd.DataFrame:
        """A check's own table `<name>.parquet` (empty if the run has none)."""
        path = self.run_dir / f"{name}.parquet"
        if not path.exists():
            return pd.DataFrame()
        return pd.read_parquet(path)

    def environments(self) -> dict[str, dict[str, Any]]:
        """Each captured target's environment provenance (target string → dict), reading only JSON."""
        envs: dict[str, dict[str, Any]] = {}
        for path in sorted((self.run_dir / "captures").glob("*/capture.json")):
            try:
                doc = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            envs[doc.get("target", path.parent.name)] = doc.get("environment", {})
        return envs

    def notes(self) -> list[str]:
        """What the workers noted while capturing (e.g. how a reference was made), each once."""
        notes: dict[str, None] = {}
        for path in sorted((self.run_dir / "captures").glob("*/capture.json")):
            try:
                notes.update(dict.fromkeys(json.loads(path.read_text()).get("notes", [])))
            except (OSError, json.JSONDecodeError):
                continue
        return list(notes)


class Store:
    """Reads and writes runs under `home/runs`."""

    def __init__(self, home: Path):
        self.home = Path(home)
        self.runs_dir = self.home / "runs"
        self.runs_dir.mkdir(parents=True, exist_ok=True)

    def create_run(self, spec: ProbeSpec, run_id: str | None = None) -> RunRecord:
        """A new run folder with its spec and a `queued` run.json owned by this process."""
        run_id = run_id or new_run_id()
        run_dir = self.runs_dir / run_id
        run_dir.mkdir(parents=True, exist_ok=False)
        atomic_write_bytes(run_dir / "spec.json", spec.to_json().encode())
        info = {
            "run_id": run_id,
            "status": "queued",
            "created": time.time(),
            "started": None,
            "finished": None,
            "duration_s": None,
            "error": None,
            "owner": {"pid": os.getpid(), "host": socket.gethostname()},
            "targets": {},
        }
        atomic_write_json(run_dir / "run.json", info)
        return RunRecord(run_id=run_id, run_dir=run_dir, info=info, spec=spec)

    def update(self, run_id: str, **changes: Any) -> dict[str, Any]:
        """Merge `changes` into run.json (atomically) and return the new info."""
        path = self.runs_dir / run_id / "run.json"
        info = json.loads(path.read_text())
        info.update(changes)
        atomic_write_json(path, info)
        return info

    def write_metrics(self, run_id: str, table: pd.DataFrame) -> Path:
        """Store the metrics table as Parquet (atomically)."""
        return self.write_table(run_id, "metrics", table)

    def write_table(self, run_id: str, name: str, table: pd.DataFrame) -> Path:
        """Store a table of the run as `<name>.parquet` (atomically)."""
        path = self.runs_dir / run_id / f"{name}.parquet"
        tmp = path.with_name(f".{name}.{secrets.token_hex(4)}.tmp")
        table.to_parquet(tmp, index=False)
        os.replace(tmp, path)
        return path

    def open(self, run_id: str) -> RunRecord:
        """Read a run back; a run abandoned mid-way (owner gone, results missing) reads as failed."""
        run_dir = self.runs_dir / run_id
        if not (run_dir / "run.json").exists():
            raise KeyError(f"no run {run_id!r} in {self.runs_dir}")
        try:
            info = json.loads((run_dir / "run.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            info = {"run_id": run_id, "status": "failed", "error": f"run.json unreadable: {e}"}
        try:
            spec = ProbeSpec.from_json((run_dir / "spec.json").read_text())
        except Exception as e:  # a damaged spec must not hide the run
            spec = None
            if info.get("status") == "succeeded":
                info = {**info, "status": "failed", "error": f"spec.json unreadable: {e}"}
        info = self._effective(info, run_dir)
        return RunRecord(run_id=run_id, run_dir=run_dir, info=info, spec=spec)

    @staticmethod
    def _effective(info: dict[str, Any], run_dir: Path) -> dict[str, Any]:
        status = info.get("status")
        if status in ACTIVE_STATES:
            owner = info.get("owner") or {}
            same_host = owner.get("host") == socket.gethostname()
            if same_host and not _pid_alive(int(owner.get("pid", -1))):
                return {
                    **info,
                    "status": "failed",
                    "error": info.get("error")
                    or "interrupted: the process that ran this job is gone (crash or shutdown); results incomplete",
                }
        if status == "succeeded" and not (run_dir / "metrics.parquet").exists():
            return {
                **info,
                "status": "failed",
                "error": "metrics.parquet is missing: the run did not finish writing",
            }
        return info

    def list_runs(self) -> list[RunRecord]:
        """All runs, newest first; unreadable folders are listed as failed, never dropped."""
        records = []
        for run_dir in sorted(self.runs_dir.iterdir(), reverse=True):
            if run_dir.is_dir() and not run_dir.name.startswith("."):
                try:
                    records.append(self.open(run_dir.name))
                except KeyError:
                    records.append(
                        RunRecord(
                            run_id=run_dir.name,
                            run_dir=run_dir,
                            info={"status": "failed", "error": "run.json missing"},
                        )
                    )
        return records

    def delete(self, run_id: str) -> None:
        """Remove a run folder."""
        shutil.rmtree(self.runs_dir / run_id)
