"""Runs on disk: one folder per run under `$WEIGHTDRIFT_HOME/runs`.

    <run_id>/spec.json                 the ProbeSpec
    <run_id>/run.json                  status, timings, per-target progress, errors, owner pid
    <run_id>/captures/<target>/        capture.json + tensors.safetensors (the snapshot format)
    <run_id>/captures/<target>@<check>-<variant>/   the same, for a check run in its own worker
    <run_id>/logs/<target>.log         worker stderr
    <run_id>/metrics.parquet           the metrics table
    <run_id>/partial/<check>.parquet   while the run goes on: the rows of each check compared so far
                                       (removed once metrics.parquet holds them all)
    <run_id>/<name>.parquet            a check's own tables (memory_timeline, placement, …)

Every file is written to a temporary name and renamed into place, so a reader sees either the
old or the new content; a failed write removes its temporary file, and `Store.sweep()` removes what
a killed process left. A run folder is made under a hidden name and renamed into place once its
spec and run.json are written.

The process that executes a run holds an exclusive lock on `<run_id>/.owner.lock` until the run
ends (`fcntl.flock`: the OS drops it when that process dies, whatever kills it). So any process
on this machine can tell a run being executed from one whose owner is gone, and a run being
executed cannot be deleted. A run whose owner is gone while it was still queued or running reads
as failed: a half-written run is never shown as a result.

Reading never fails because of one run folder: a run.json that is not a run's record, a spec that
does not parse or a metrics table that does not open reads as `damaged`, with the reason; such a
run can still be opened (to see why) and deleted.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import os
import secrets
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq

from core.spec import ProbeSpec, file_version

ACTIVE_STATES = ("queued", "running")
STATES = (*ACTIVE_STATES, "succeeded", "failed", "cancelled")
DAMAGED = "damaged"  # read back only: the folder does not hold a readable run
PARTIAL_DIR = "partial"  # per-check rows written while a run goes on (`Store.write_partial`)
LOCK_NAME = ".owner.lock"
# Leftovers (temporary files, half-made run folders) younger than this may belong to a write in
# progress in a process that does not hold the run's lock (a worker): the sweep leaves them.
LEFTOVER_AGE_S = 300.0


class StoreError(Exception):
    """A run that cannot be written or deleted; the message names the file and what to do."""


def io_advice(e: OSError) -> str:
    """What to do about a failed write, in words (empty when there is nothing general to say)."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "the disk is full: free some space"
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return "the folder is not writable: make it writable, or choose another home (--home or WEIGHTDRIFT_HOME)"
    return "check the folder and the disk"


def _cant(what: str, path: Path, e: OSError) -> StoreError:
    return StoreError(f"cannot {what} {path}: {e.strerror or e} ({io_advice(e)})")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same folder and a rename; a failed
    write leaves neither the temporary file nor a changed `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    """JSON variant of atomic_write_bytes."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def new_run_id() -> str:
    """Sortable, unique: `20261122-193012-3fa9c2`."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lock_held(run_dir: Path) -> bool | None:
    """Whether some process holds the run's owner lock; None for a run without a lock file
    (stored before locks, or never started)."""
    try:
        fd = os.open(run_dir / LOCK_NAME, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError:
        return True  # cannot tell: err on the side of "in use"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the lock we may have taken
    return False


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def info_problem(info: Any) -> str | None:
    """Why a parsed run.json is not a run's record (None when it is one)."""
    if not isinstance(info, dict):
        return f"holds a JSON {type(info).__name__}, not an object"
    if info.get("status") not in STATES:
        return f"status {info.get('status')!r} is not one of {', '.join(STATES)}"
    for key in ("created", "started", "finished", "duration_s"):
        if info.get(key) is not None and not _is_number(info[key]):
            return f"{key!r} is {info[key]!r}, not a number"
    if info.get("error") is not None and not isinstance(info["error"], str):
        return f"'error' is {info['error']!r}, not text"
    owner = info.get("owner")
    if owner is not None:
        if not isinstance(owner, dict):
            return f"'owner' is {owner!r}, not an object"
        if owner.get("pid") is not None and (
            not isinstance(owner["pid"], int) or isinstance(owner["pid"], bool)
        ):
            return f"'owner.pid' is {owner['pid']!r}, not a process id"
    targets = info.get("targets")
    if targets is not None:
        if not isinstance(targets, dict) or not all(isinstance(t, dict) for t in targets.values()):
            return "'targets' is not an object of per-target objects"
        for name, t in targets.items():
            if not isinstance(t.get("state", ""), str):
                return f"'targets.{name}.state' is not text"
            for key in ("step", "of"):
                if t.get(key) is not None and not _is_number(t[key]):
                    return f"'targets.{name}.{key}' is {t[key]!r}, not a number"
    return None


def damaged_info(run_id: str, reason: str) -> dict[str, Any]:
    """What a run folder that holds no readable run reads as: `damaged`, with what to do."""
    return {
        "run_id": run_id,
        "status": DAMAGED,
        "created": None,
        "started": None,
        "finished": None,
        "duration_s": None,
        "error": f"{reason}. Delete the run (Runs page, or remove its folder) or restore the file.",
        "targets": {},
    }


_VERIFIED: dict[tuple[str, tuple[str, int, int]], str | None] = {}


def table_problem(path: Path) -> str | None:
    """Why a stored Parquet table does not open (None when it does). Read whole, with the page
    checksums the store writes, once per file version: a truncated, emptied or bit-flipped file
    is found here, not in a page."""
    try:
        version = file_version(path)
    except OSError as e:
        return f"{path.name} cannot be read: {e.strerror or e}"
    key = (str(path), version)
    if key not in _VERIFIED:
        try:
            pq.read_table(path, page_checksum_verification=True)
            _VERIFIED[key] = None
        except Exception as e:  # pyarrow raises several kinds for a damaged file
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            _VERIFIED[key] = f"{path.name} is damaged ({version[1]} bytes; {first})"
    return _VERIFIED[key]


# In a run's captures folder when its reference could not run and another target stood in for it.
REFERENCE_FALLBACK = "reference_fallback.json"


def write_reference_fallback(run_dir: Path, reference: str, instead_of: str, error: str) -> None:
    """Record that `reference` stands in for `instead_of`, which failed with `error` (its first line)."""
    first = error.strip().splitlines()[0] if error.strip() else "no reason given"
    atomic_write_json(
        run_dir / "captures" / REFERENCE_FALLBACK,
        {"reference": reference, "instead_of": instead_of, "error": first},
    )


def read_reference_fallback(run_dir: Path) -> dict[str, str] | None:
    """The run's reference fallback (`write_reference_fallback`), or None when its reference ran."""
    path = run_dir / "captures" / REFERENCE_FALLBACK
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def reference_fallback_note(fallback: dict[str, str]) -> str:
    """The warning on the rows and the page of a run compared against a stand-in reference."""
    return (
        f"the reference {fallback.get('instead_of')} did not run ({fallback.get('error')}); compared against "
        f"{fallback.get('reference')}, the next-best target, instead"
    )


# In a run's captures folder: the capture tasks killed at their time limit (their rows read `broken`).
TIMED_OUT = "timed_out.json"
_TIMED_OUT_LOCK = threading.Lock()  # lanes end at once


def write_timed_out(run_dir: Path, target: str, checks: list[str], variant: str | None, finding: str) -> None:
    """Record that the task capturing `checks` (an own-worker check's `variant`) on `target` was killed
    at its time limit: `finding` ("timed out after N s in stage S") is what its rows read."""
    path = run_dir / "captures" / TIMED_OUT
    entry = {"target": target, "checks": list(checks), "variant": variant, "finding": finding}
    with _TIMED_OUT_LOCK:
        before = json.loads(path.read_text()) if path.exists() else []
        atomic_write_json(path, [*before, entry])


def read_timed_out(run_dir: Path) -> dict[tuple[str, str, str | None], str]:
    """What the run's capture tasks killed at their time limit left unmeasured (`write_timed_out`):
    (target, check, variant: None for the shared load loop) -> the finding its rows read."""
    try:
        doc = json.loads((run_dir / "captures" / TIMED_OUT).read_text())
    except (OSError, ValueError):
        return {}
    return {(e["target"], c, e["variant"]): e["finding"] for e in doc for c in e["checks"]}


def metrics_table(rows: list[dict[str, Any]] | list):
    """The long-format metrics table with the design's columns first, in a fixed order: from rows, or
    from the tables of several checks (each made by this function) one after another."""
    from core.checks.base import METRIC_COLUMNS

    if rows and all(isinstance(r, pd.DataFrame) for r in rows):
        # as records, not pd.concat: a column one check lacks reads NaN in a float column, as from rows
        rows = [record for frame in rows for record in frame.to_dict(orient="records")]
    table = pd.DataFrame(rows)
    for col in METRIC_COLUMNS:
        if col not in table.columns:
            table[col] = None
    rest = [c for c in table.columns if c not in METRIC_COLUMNS]
    table = table[list(METRIC_COLUMNS) + rest]
    if "layer" in table:
        table["layer"] = table["layer"].astype("Int64")
    return table


def partial_path(run_dir: Path, check: str) -> Path:
    """Where a check's rows wait while the run goes on (`Store.write_partial`)."""
    return run_dir / PARTIAL_DIR / f"{check}.parquet"


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

    @property
    def id_note(self) -> str | None:
        """What to say of a folder whose run.json names another run (it was copied or renamed); None
        otherwise. The folder's name is the run's identity: it is listed, opened and deleted by it."""
        recorded = self.info.get("recorded_id")
        if recorded is None:
            return None
        return (
            f"its run.json names run {recorded}: this folder was copied or renamed, and is the run "
            f"{self.run_id} here"
        )

    def metrics(self) -> pd.DataFrame:
        """The metrics table (empty if the run has none); StoreError if it does not open.

        While the run goes on: the rows of the checks compared so far (`compared`), in the run's
        check order."""
        if (self.run_dir / "metrics.parquet").exists() or self.status not in ACTIVE_STATES:
            return self.table("metrics")
        frames = [self.table(f"{PARTIAL_DIR}/{path.stem}") for path in self.partial_tables()]
        return metrics_table(frames) if frames else pd.DataFrame()

    def judgement(self, table: pd.DataFrame | None = None):
        """Agreement groups and anomalies of this run (`core.judgement.judge`) from its tables."""
        from core.checks import get_checks
        from core.judgement import judge

        table = self.metrics() if table is None else table
        spec = self.spec
        targets = [str(t) for t in spec.targets if t != spec.reference] if spec else []
        # checks whose captures hold tensors to group by (generate's tokens are in its own rows)
        grouped = [c.name for c in get_checks(spec.checks) if not c.own_worker and c.judged] if spec else []
        return judge(
            table, self.table("pairwise"), targets, grouped, spec.peers if spec else True, self.environments()
        )

    def answer(self, table: pd.DataFrame | None = None) -> list[str]:
        """The run's answer in sentences, as `weightdrift run` prints it above the counts: agreement groups
        and anomalies (`judgement`), an adapter served on another precision than its quantized base
        (`core.report.served_elsewhere`), where each target parts from the reference (activations,
        generate)."""
        from core.checks.activations import divergence_sentences as modules
        from core.checks.generate import divergence_sentences as generations
        from core.report import served_elsewhere

        table = self.metrics() if table is None else table
        parts = [*modules(table).values(), *generations(table).values()]
        return self.judgement(table).lines() + served_elsewhere(self.table("pairwise")) + parts

    def partial_tables(self) -> list[Path]:
        """While the run goes on: the files of the checks compared so far (`compared`), in its order."""
        return [partial_path(self.run_dir, check) for check in self.compared()]

    def compared(self) -> list[str]:
        """The checks whose rows are in: every check of a finished run's table; while the run goes on,
        those its partial compares have written (`partial/<check>.parquet`), in the run's order."""
        if (self.run_dir / "metrics.parquet").exists():
            return list(self.spec.checks) if self.spec is not None else []
        done = {p.stem for p in (self.run_dir / PARTIAL_DIR).glob("*.parquet")}
        order = list(self.spec.checks) if self.spec is not None else sorted(done)
        return [c for c in order if c in done]

    def table(self, name: str) -> pd.DataFrame:
        """A table of the run, `<name>.parquet` (empty if the run has none); StoreError, naming the
        file, if it does not open."""
        path = self.run_dir / f"{name}.parquet"
        if not path.exists():
            return pd.DataFrame()
        problem = table_problem(path)
        if problem is not None:
            raise StoreError(f"run {self.run_id}: {problem}; delete the run or run it again")
        return pd.read_parquet(path)

    def _capture_facts(self) -> list[CaptureFacts]:
        """What environments() and notes() read of each capture.json, in folder order; each version of a
        file is parsed once (`capture_facts`)."""
        facts = []
        for path in sorted((self.run_dir / "captures").glob("*/capture.json")):
            try:
                found = capture_facts(str(path), file_version(path))
            except OSError:
                continue
            if found is not None:
                facts.append(found)
        return facts

    def environments(self) -> dict[str, dict[str, Any]]:
        """Each captured target's environment provenance (target string → dict), reading only JSON."""
        return {
            f.target: json.loads(f.environment) for f in self._capture_facts() if f.environment is not None
        }

    def imported(self) -> list[dict[str, Any]]:
        """Where the captures of a run made from snapshots came from (`core.engine.snapshot`); empty otherwise."""
        from core.engine.snapshot import read_imported

        return read_imported(self.run_dir)

    def notes(self) -> list[str]:
        """What the workers noted while capturing (e.g. how a reference was made), each once."""
        notes: dict[str, None] = {}
        fallback = read_reference_fallback(self.run_dir)
        if fallback is not None:
            notes[reference_fallback_note(fallback)] = None
        for facts in self._capture_facts():
            notes.update(dict.fromkeys(facts.notes))
        return list(notes)


@dataclass(frozen=True)
class CaptureFacts:
    """What a run's pages read of a capture.json besides its rows: its target, its environment (as JSON
    text, so that no reader shares a dict) and its notes."""

    target: str
    environment: str | None
    notes: tuple[str, ...]


@functools.lru_cache(maxsize=256)
def capture_facts(path: str, version: tuple[str, int, int]) -> CaptureFacts | None:
    """`CaptureFacts` of one version (`file_version`) of a capture.json; None where it is no JSON object.
    A large model's capture.json takes a while to parse, and the Overview asks for it three times a render."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    env, notes = doc.get("environment", {}), doc.get("notes", [])
    return CaptureFacts(
        target=str(doc.get("target", Path(path).parent.name)),
        environment=json.dumps(env) if isinstance(env, dict) else None,
        notes=tuple(str(n) for n in notes) if isinstance(notes, list) else (),
    )


class Store:
    """Reads and writes runs under `home/runs`."""

    def __init__(self, home: Path):
        self.home = Path(home)
        self.runs_dir = self.home / "runs"
        try:
            self.runs_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _cant("create the runs folder", self.runs_dir, e) from e
        self._locks: dict[str, int] = {}  # run_id → fd of the owner lock this process holds

    def create_run(self, spec: ProbeSpec, run_id: str | None = None) -> RunRecord:
        """A new run folder with its spec and a `queued` run.json, owned (locked) by this process
        until `release`. The folder appears complete or not at all; StoreError if it cannot be made."""
        run_id = run_id or new_run_id()
        run_dir = self.runs_dir / run_id
        if run_dir.exists():
            raise StoreError(f"run {run_id} already exists in {self.runs_dir}")
        making = self.runs_dir / f".{run_id}.creating"
        fd = None
        try:
            making.mkdir(parents=True)
            fd = os.open(making / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            atomic_write_bytes(making / "spec.json", spec.to_json().encode())
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
            atomic_write_json(making / "run.json", info)
            os.rename(making, run_dir)
        except OSError as e:
            if fd is not None:
                os.close(fd)
            shutil.rmtree(making, ignore_errors=True)
            raise _cant("create the run folder", run_dir, e) from e
        self._locks[run_id] = fd
        return RunRecord(run_id=run_id, run_dir=run_dir, info=info, spec=spec)

    def release(self, run_id: str) -> None:
        """Give up this process's ownership of a run (it has ended)."""
        fd = self._locks.pop(run_id, None)
        if fd is not None:
            os.close(fd)

    def update(self, run_id: str, **changes: Any) -> dict[str, Any]:
        """Merge `changes` into run.json (atomically) and return the new info; StoreError, naming
        the file and what to do, if it cannot be read or written."""
        path = self.runs_dir / run_id / "run.json"
        try:
            info = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise StoreError(f"{path} is gone (the run was deleted while it ran)") from e
        except (OSError, ValueError) as e:
            raise StoreError(f"cannot read {path}: {e}") from e
        if not isinstance(info, dict):
            raise StoreError(f"{path} {info_problem(info)}")
        info.update(changes)
        try:
            atomic_write_json(path, info)
        except OSError as e:
            raise _cant("update", path, e) from e
        return info

    def write_metrics(self, run_id: str, table: pd.DataFrame) -> Path:
        """Store the metrics table as Parquet (atomically)."""
        return self.write_table(run_id, "metrics", table)

    def write_partial(self, run_id: str, check: str, table: pd.DataFrame) -> Path:
        """Store one check's rows before the run ends (`partial/<check>.parquet`), for pages to show
        while the other checks go on."""
        (self.runs_dir / run_id / PARTIAL_DIR).mkdir(exist_ok=True)
        return self.write_table(run_id, f"{PARTIAL_DIR}/{check}", table)

    def read_partial(self, run_id: str, check: str) -> pd.DataFrame | None:
        """One check's rows as its partial compare wrote them; None when it has none (or it does not open)."""
        path = partial_path(self.runs_dir / run_id, check)
        if not path.exists() or table_problem(path) is not None:
            return None
        return pd.read_parquet(path)

    def drop_partials(self, run_id: str) -> None:
        """Remove the partial tables once metrics.parquet holds every row."""
        shutil.rmtree(self.runs_dir / run_id / PARTIAL_DIR, ignore_errors=True)

    def write_table(self, run_id: str, name: str, table: pd.DataFrame) -> Path:
        """Store a table of the run as `<name>.parquet` (atomically, with page checksums so that a
        damaged file is found when read)."""
        path = self.runs_dir / run_id / f"{name}.parquet"
        tmp = path.with_name(f".{path.stem}.{secrets.token_hex(4)}.tmp")
        try:
            table.to_parquet(tmp, index=False, write_page_checksum=True)
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise _cant("write", path, e) from e
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        return path

    def open(self, run_id: str) -> RunRecord:
        """Read a run back, whatever its folder holds: a run abandoned mid-way (owner gone, results
        missing) reads as failed, a folder that holds no readable run as damaged. KeyError only
        when there is no such folder."""
        run_dir = self.runs_dir / run_id
        if not run_dir.is_dir():
            raise KeyError(f"no run {run_id!r} in {self.runs_dir}")
        try:
            info = json.loads((run_dir / "run.json").read_text())
            problem = info_problem(info)
            if problem is not None:
                info = damaged_info(run_id, f"run.json {problem}")
            elif info.get("run_id", run_id) != run_id:
                # the folder's name is the run's identity: a copied or renamed folder keeps the old id inside
                info = {**info, "run_id": run_id, "recorded_id": info["run_id"]}
        except FileNotFoundError:
            info = damaged_info(run_id, "run.json is missing")
        except (OSError, ValueError) as e:
            info = damaged_info(run_id, f"run.json is unreadable ({e})")
        try:
            spec = ProbeSpec.from_json((run_dir / "spec.json").read_text())
        except Exception as e:  # a damaged spec must not hide the run
            spec = None
            if info["status"] != DAMAGED:
                info = damaged_info(run_id, f"spec.json is unreadable ({type(e).__name__}: {e})")
        info = self._effective(info, run_dir)
        return RunRecord(run_id=run_id, run_dir=run_dir, info=info, spec=spec)

    @staticmethod
    def _effective(info: dict[str, Any], run_dir: Path) -> dict[str, Any]:
        status = info.get("status")
        if status in ACTIVE_STATES:
            held = lock_held(run_dir)
            if held is None:  # a run stored before owner locks: its pid on this host
                owner = info.get("owner") or {}
                same_host = owner.get("host") == socket.gethostname()
                held = not same_host or _pid_alive(int(owner.get("pid") or -1))
            if not held:
                return {
                    **info,
                    "status": "failed",
                    "error": info.get("error")
                    or "interrupted: the process that ran this job is gone (crash or shutdown); results incomplete",
                }
        if status == "succeeded":
            path = run_dir / "metrics.parquet"
            if not path.exists():
                return {
                    **info,
                    "status": "failed",
                    "error": "metrics.parquet is missing: the run did not finish writing",
                }
            problem = table_problem(path)
            if problem is not None:
                return {
                    **damaged_info(info.get("run_id", run_dir.name), problem),
                    "created": info.get("created"),
                }
        return info

    def list_runs(self) -> list[RunRecord]:
        """All runs, newest first; a damaged folder is listed as damaged, never dropped."""
        records = []
        for run_dir in sorted(self.runs_dir.iterdir(), reverse=True):
            if run_dir.name.startswith("."):
                continue  # a run folder being made, or left half-made (the sweep removes those)
            with contextlib.suppress(KeyError):  # removed since iterdir
                records.append(self.open(run_dir.name))
        return records

    def in_use(self, run_id: str) -> bool:
        """Whether a process on this machine is executing the run (it holds the run's lock)."""
        run_dir = self.runs_dir / run_id
        held = lock_held(run_dir)
        if held is None:
            return self.open(run_id).status in ACTIVE_STATES
        return held

    def delete(self, run_id: str) -> None:
        """Remove a run folder; StoreError when a process (this one or another) is executing it."""
        run_dir = self.runs_dir / run_id
        if not run_dir.is_dir():
            raise KeyError(f"no run {run_id!r} in {self.runs_dir}")
        fd = None
        with contextlib.suppress(FileNotFoundError):  # a run stored before owner locks
            fd = os.open(run_dir / LOCK_NAME, os.O_RDONLY)
        try:
            if fd is not None:
                try:
                    # held while removing, so no process can take the run up meanwhile
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    owner = self.open(run_id).info.get("owner") or {}
                    raise StoreError(
                        f"run {run_id} is being executed by process {owner.get('pid', '?')} on "
                        f"{owner.get('host', 'this machine')}: cancel it first (Ctrl-C or the Cancel button), "
                        "then delete it"
                    ) from None
            elif self.open(run_id).status in ACTIVE_STATES:
                raise StoreError(f"run {run_id} is still running: cancel it first, then delete it")
            try:
                shutil.rmtree(run_dir)
            except OSError as e:
                raise _cant("delete", run_dir, e) from e
        finally:
            if fd is not None:
                os.close(fd)

    def sweep(self, min_age_s: float = LEFTOVER_AGE_S) -> list[Path]:
        """Remove what killed or failed writes left: half-made run folders and temporary files in
        runs no process executes, when older than `min_age_s`. Returns what was removed."""
        removed: list[Path] = []
        now = time.time()

        def old(path: Path) -> bool:
            try:
                return now - path.lstat().st_mtime >= min_age_s
            except OSError:
                return False

        try:
            entries = list(self.runs_dir.iterdir())
        except OSError:
            return removed
        for entry in entries:
            if entry.name.startswith(".") and entry.name.endswith(".creating") and old(entry):
                if not lock_held(entry):
                    shutil.rmtree(entry, ignore_errors=True)
                    removed.append(entry)
            elif entry.is_dir() and not entry.name.startswith(".") and not lock_held(entry):
                folder_old = old(entry)  # before removing files in it changes its time
                for tmp in entry.rglob(".*.tmp"):
                    if old(tmp):
                        with contextlib.suppress(OSError):
                            tmp.unlink()
                            removed.append(tmp)
                # a folder that held nothing but a killed write's temporary files (made before run
                # folders were made under a hidden name) is no run
                with contextlib.suppress(OSError):
                    if folder_old and not any(entry.iterdir()):
                        entry.rmdir()
                        removed.append(entry)
        return removed
