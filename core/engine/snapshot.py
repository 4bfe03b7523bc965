"""Snapshots: one machine's captures in one portable file, and runs made from snapshots.

A snapshot is a zip archive (`.wdsnap`):

    snapshot.json                          the manifest: format, machine, when, the run's spec, the
                                           checkpoint files' hashes, and one entry per capture
    captures/<folder>/capture.json         each capture of the run, as the run folder holds it
    captures/<folder>/tensors.safetensors  (`core.capture`, format `weightdrift-capture/2`): metric
    captures/<folder>/sketches.safetensors rows, sketches and content hashes, kept tensors, logits,
                                           environment provenance, memory timelines

A zip because it is one file a bug report takes, every member carries a CRC (a truncated or
damaged file is found before anything is stored), and the capture folders go in unchanged: a
snapshot's capture is read by the same code as a local one.

Comparing snapshots makes an ordinary run whose targets are the snapshots' captures, each named by
its machine (`gpu-box/cuda:0/float32`, label `gpu-box/cuda:0·fp32`), plus any local targets: the
engine runs only the local ones, and the compare step is the one every run has. Checkpoint
hashes make sure that only captures of the same base and adapters meet.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import secrets
import socket
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from core.capture import FORMAT as CAPTURE_FORMAT
from core.capture import capture_folder_name
from core.spec import AdapterRef, ModelRef, ProbeSpec, SpecError, Target, valid_machine

FORMAT = "weightdrift-snapshot/1"
SUFFIX = ".wdsnap"
MANIFEST = "snapshot.json"
CAPTURE_FILES = ("capture.json", "tensors.safetensors", "sketches.safetensors")
# Which files of a model or adapter folder the hashes cover: what loading reads to build the weights.
HASHED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
HASHED_NAMES = ("config.json", "adapter_config.json", "generation_config.json")
# In an imported run's captures folder: where each imported capture came from.
IMPORTED = "imported.json"


class SnapshotError(SpecError):
    """A snapshot that cannot be made, read or compared; the message names the file and the reason."""


def file_hash(path: Path, chunk: int = 1 << 24) -> str:
    """xxh3-128 of a file's bytes, read a chunk at a time (a 1B model's shards are GBs)."""
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def folder_hashes(folder: str) -> dict[str, str] | None:
    """{file name: xxh3-128} of the files loading reads in a model or adapter folder; None when the
    folder is not here (a hub id): such a model cannot be proven the same, so it cannot be compared."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        return None
    return {
        f.name: file_hash(f)
        for f in sorted(path.iterdir())
        if f.is_file() and (f.suffix in HASHED_SUFFIXES or f.name in HASHED_NAMES)
    }


@dataclass(frozen=True)
class CheckpointHashes:
    """The hashes of the base's and each adapter's files, by adapter name."""

    base: dict[str, str] | None
    adapters: dict[str, dict[str, str] | None]

    @staticmethod
    def of(base: ModelRef, adapters: Sequence[AdapterRef]) -> CheckpointHashes:
        """Hash the files of `base` and `adapters` as they are on this machine now."""
        return CheckpointHashes(
            base=folder_hashes(base.path), adapters={a.name: folder_hashes(a.path) for a in adapters}
        )

    def to_dict(self) -> dict[str, Any]:
        """As stored in a snapshot's manifest."""
        return {"base": self.base, "adapters": self.adapters}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> CheckpointHashes:
        """Read back `to_dict`'s form."""
        return CheckpointHashes(base=d.get("base"), adapters=dict(d.get("adapters") or {}))

    def difference(self, other: CheckpointHashes) -> str | None:
        """Why `other` is not the same base and adapters (None when it is), in words."""
        if self.base is None or other.base is None:
            return (
                "the base model is not a local folder on both sides, so its files cannot be proven the same"
            )
        if self.base != other.base:
            return f"the base model differs ({_files_differ(self.base, other.base)})"
        if set(self.adapters) != set(other.adapters):
            return (
                f"the adapters differ: {', '.join(sorted(self.adapters)) or 'none'} against "
                f"{', '.join(sorted(other.adapters)) or 'none'}"
            )
        for name in sorted(self.adapters):
            mine, theirs = self.adapters[name], other.adapters[name]
            if mine is None or theirs is None or mine != theirs:
                why = "not a local folder" if mine is None or theirs is None else _files_differ(mine, theirs)
                return f"adapter {name} differs ({why})"
        return None


def _files_differ(a: dict[str, str], b: dict[str, str]) -> str:
    names = sorted(set(a) | set(b))
    changed = [n for n in names if a.get(n) != b.get(n)]
    return "files " + ", ".join(changed[:4]) + (" …" if len(changed) > 4 else "") + " differ"


@dataclass(frozen=True)
class SnapshotCapture:
    """One capture in a snapshot: its folder in the archive and what it captured."""

    folder: str
    target: str  # as written on the machine that made it (`cpu/float32`)
    check: str = ""  # an own-worker check's name, empty for the shared load loop
    variant: str = ""


@dataclass(frozen=True)
class Snapshot:
    """A snapshot file as read back (`read_snapshot`): its manifest; the captures stay in the file."""

    path: Path
    machine: str
    created: float
    spec: ProbeSpec
    hashes: CheckpointHashes
    captures: tuple[SnapshotCapture, ...]
    source_run: str = ""

    @property
    def name(self) -> str:
        """The file's name, as messages and the dashboard show it."""
        return self.path.name


def machine_name() -> str:
    """This machine's name as a target's machine part: the host name, cut at its first dot."""
    name = (platform.node() or socket.gethostname() or "machine").split(".")[0]
    cleaned = "".join(c if c.isascii() and (c.isalnum() or c in "-_") else "-" for c in name)
    return cleaned.strip("-") or "machine"


def write_snapshot(run_dir: Path, spec: ProbeSpec, out: Path, machine: str | None = None) -> Path:
    """Pack the captures of the finished run in `run_dir` into the snapshot file `out`.

    The checkpoint files are hashed now, from the paths of `spec`: the snapshot is made right after
    its run, on the machine that holds them. Written to a temporary name and renamed into place, so
    a failed write never leaves a half file under `out`.
    """
    machine = machine or machine_name()
    if not valid_machine(machine):
        raise SnapshotError(f"machine name {machine!r} must be letters, digits, '-', '_' or '.'")
    captures_dir = Path(run_dir) / "captures"
    entries = []
    for folder in sorted(p for p in captures_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        doc = json.loads((folder / "capture.json").read_text())
        entries.append(
            SnapshotCapture(folder.name, doc["target"], doc.get("check", ""), doc.get("variant", ""))
        )
    manifest = {
        "format": FORMAT,
        "capture_format": CAPTURE_FORMAT,
        "machine": machine,
        "created": time.time(),
        "source_run": Path(run_dir).name,
        "spec": spec.to_dict(),
        "checkpoint_hashes": CheckpointHashes.of(spec.base, spec.adapters).to_dict(),
        "captures": [e.__dict__ for e in entries],
    }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{secrets.token_hex(4)}.tmp")
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as z:
            z.writestr(MANIFEST, json.dumps(manifest, indent=2, sort_keys=True))
            for e in entries:
                for name in CAPTURE_FILES:
                    z.write(captures_dir / e.folder / name, f"captures/{e.folder}/{name}")
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return out


def _damaged(path: Path, why: str) -> SnapshotError:
    return SnapshotError(
        f"snapshot {path} cannot be used: {why}. Copy it again from the machine that made it, or make it again "
        "(python -m core snapshot …)"
    )


def read_snapshot(path: str | os.PathLike[str]) -> Snapshot:
    """Read and verify a snapshot file: every member's CRC, the manifest, and that every capture it
    lists is there. SnapshotError, naming the file and the reason, for anything else (a truncated
    copy, another kind of file, a newer format)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise SnapshotError(f"snapshot {path} does not exist (or is not a file)")
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()  # reads every member: a truncated or bit-flipped copy fails here
            if bad is not None:
                raise _damaged(path, f"member {bad} is damaged (CRC mismatch)")
            names = set(z.namelist())
            if MANIFEST not in names:
                raise _damaged(path, f"it has no {MANIFEST}: not a WeightDrift snapshot")
            manifest = json.loads(z.read(MANIFEST))
    except zipfile.BadZipFile as e:
        raise _damaged(path, f"not a complete zip archive ({e}); a truncated copy reads like this") from e
    except (OSError, ValueError, EOFError) as e:
        raise _damaged(path, f"{type(e).__name__}: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise _damaged(path, f"its format is {found!r}, this version reads {FORMAT!r}")
    try:
        captures = tuple(SnapshotCapture(**c) for c in manifest["captures"])
        snapshot = Snapshot(
            path=path,
            machine=str(manifest["machine"]),
            created=float(manifest["created"]),
            spec=ProbeSpec.from_dict(manifest["spec"]),
            hashes=CheckpointHashes.from_dict(manifest["checkpoint_hashes"]),
            captures=captures,
            source_run=str(manifest.get("source_run", "")),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise _damaged(path, f"its manifest is incomplete ({type(e).__name__}: {e})") from e
    if not valid_machine(snapshot.machine):
        raise _damaged(path, f"machine name {snapshot.machine!r} is not a valid name")
    for c in captures:
        # names come from a file someone sent: nothing may point outside its capture folder
        if "/" in c.folder or c.folder.startswith(".") or not c.folder:
            raise _damaged(path, f"capture folder {c.folder!r} is not a plain name")
        missing = [n for n in CAPTURE_FILES if f"captures/{c.folder}/{n}" not in names]
        if missing:
            raise _damaged(path, f"capture {c.folder} lacks {', '.join(missing)}")
    return snapshot


@dataclass(frozen=True)
class Imported:
    """One snapshot's place in a comparison: the machine name its targets carry there."""

    snapshot: Snapshot
    machine: str

    def target(self, captured: str) -> Target:
        """The target a capture of this snapshot is in the comparison (`gpu-box/cuda:0/float32`)."""
        return replace(Target.parse(captured), machine=self.machine)


def machine_labels(snapshots: Sequence[Snapshot]) -> list[Imported]:
    """Give each snapshot a machine name for its targets: its machine's, or `<machine>-2`, `-3`, …
    where an earlier snapshot already has a target of that name (two snapshots of one machine
    with the same target stay two targets)."""
    taken: set[str] = set()
    out = []
    for s in snapshots:
        targets = s.spec.targets  # its reference capture is not one of them (see `import_captures`)
        n, machine = 1, s.machine
        while any(str(replace(t, machine=machine)) in taken for t in targets):
            n += 1
            machine = f"{s.machine}-{n}"
        taken.update(str(replace(t, machine=machine)) for t in targets)
        out.append(Imported(s, machine))
    return out


# Spec fields two snapshots must share for their captures to be compared (same probe, same rules).
_SHARED_FIELDS = ("checks", "probe", "seed", "tolerances", "strategies", "merge_subset", "max_new_tokens")


def check_compatible(snapshots: Sequence[Snapshot], local: CheckpointHashes | None = None) -> None:
    """Refuse snapshots that are not of the same base and adapters (or probe, checks, tolerances) as
    the first one, and local checkpoints (`local`, for local targets) that are not the same files."""
    first = snapshots[0]
    for s in snapshots[1:]:
        why = first.hashes.difference(s.hashes)
        if why is not None:
            raise SnapshotError(
                f"snapshot {s.path} is not of the same base and adapters as {first.path}: {why}"
            )
        for name in _SHARED_FIELDS:
            if getattr(s.spec, name) != getattr(first.spec, name):
                raise SnapshotError(
                    f"snapshot {s.path} was made with other {name} than {first.path} "
                    f"({getattr(s.spec, name)!r} against {getattr(first.spec, name)!r}): make both with the same"
                )
        if s.spec.reference.local != first.spec.reference.local:
            raise SnapshotError(
                f"snapshot {s.path} compares outputs against {s.spec.reference}, {first.path} against "
                f"{first.spec.reference}: make both with the same --reference"
            )
    if local is not None:
        why = first.hashes.difference(local)
        if why is not None:
            raise SnapshotError(
                f"the local base and adapters are not those snapshot {first.path} was made from: {why}"
            )


def comparison(
    snapshots: Sequence[Snapshot],
    local_targets: Sequence[Target] = (),
    base: ModelRef | None = None,
    adapters: Sequence[AdapterRef] | None = None,
) -> tuple[ProbeSpec, Callable[[Path], None]]:
    """The spec of a run comparing `snapshots` (and `local_targets`, run here), and the function
    that puts the snapshots' captures into its run folder (`Engine.submit`'s `install`).

    Local targets need the base and adapters here: `base`/`adapters`, or the paths the first
    snapshot recorded; their files must hash as the snapshot's did. Without local targets nothing is
    loaded here, and the model files need not be here at all.
    """
    if not snapshots:
        raise SnapshotError("no snapshot given")
    first = snapshots[0].spec
    spec_base = base or first.base
    spec_adapters = tuple(adapters) if adapters is not None else first.adapters
    local = None
    if local_targets:
        if len(set(local_targets)) != len(local_targets):
            raise SnapshotError("a local target is given twice")
        by_name = {a.name: a for a in spec_adapters}
        if set(by_name) != {a.name for a in first.adapters}:
            raise SnapshotError(
                f"the snapshots hold adapters {', '.join(a.name for a in first.adapters) or 'none'}; give the same "
                f"names with --adapter PATH=NAME (given: {', '.join(by_name) or 'none'})"
            )
        spec_adapters = tuple(by_name[a.name] for a in first.adapters)
        local = CheckpointHashes.of(spec_base, spec_adapters)
    check_compatible(snapshots, local)
    placed = machine_labels(snapshots)
    imported = [p.target(c.target) for p in placed for c in p.snapshot.captures if not c.check]
    reference = placed[0].target(str(first.reference))
    # the first snapshot's reference capture is the run's; its own targets exclude it
    targets = [t for t in imported if not _is_reference_of(t, placed)]
    spec = replace(
        first,
        base=spec_base,
        adapters=spec_adapters,
        targets=(*targets, *local_targets),
        reference=reference,
    )

    def install(run_dir: Path) -> None:
        import_captures(placed, run_dir)

    return spec, install


def _is_reference_of(target: Target, placed: Sequence[Imported]) -> bool:
    """Whether `target` is a snapshot's own reference capture (not one of the targets it was asked for)."""
    for p in placed:
        if target.machine == p.machine:
            return (
                target.local == p.snapshot.spec.reference.local
                and target.local not in p.snapshot.spec.targets
            )
    return False


def import_captures(placed: Sequence[Imported], run_dir: Path) -> None:
    """Unpack each snapshot's captures into `run_dir/captures`, named and labelled by machine, and
    record where they came from (`imported.json`)."""
    captures_dir = Path(run_dir) / "captures"
    record = []
    for i, p in enumerate(placed):
        s = p.snapshot
        with zipfile.ZipFile(s.path) as z:
            for c in s.captures:
                target = p.target(c.target)
                folder = captures_dir / capture_folder_name(target.slug, c.check, c.variant)
                if i and folder.exists() and Target.parse(c.target) not in s.spec.targets:
                    # another snapshot of the same machine: the first one's reference is the run's
                    continue
                folder.mkdir(parents=True, exist_ok=False)
                for name in CAPTURE_FILES[1:]:
                    with z.open(f"captures/{c.folder}/{name}") as src, open(folder / name, "wb") as dst:
                        while block := src.read(1 << 24):
                            dst.write(block)
                doc = json.loads(z.read(f"captures/{c.folder}/capture.json"))
                if doc.get("format") != CAPTURE_FORMAT:
                    raise _damaged(s.path, f"capture {c.folder} is in format {doc.get('format')!r}")
                doc["target"] = str(target)  # rows and the environment table name the machine
                doc.setdefault("meta", {})["imported_from"] = {"snapshot": s.name, "machine": s.machine}
                (folder / "capture.json").write_text(json.dumps(doc, indent=2, sort_keys=True, default=str))
        record.append(
            {
                "snapshot": str(s.path),
                "machine": s.machine,
                "label": p.machine,
                "created": s.created,
                "source_run": s.source_run,
                "targets": [str(replace(t, machine=p.machine)) for t in s.spec.targets],
                "checkpoint_hashes": s.hashes.to_dict(),
            }
        )
    (captures_dir / IMPORTED).write_text(json.dumps(record, indent=2, sort_keys=True))


def read_imported(run_dir: Path) -> list[dict[str, Any]]:
    """Where an imported run's captures came from (`import_captures`); empty for a local run."""
    try:
        doc = json.loads((Path(run_dir) / "captures" / IMPORTED).read_text())
    except (OSError, ValueError):
        return []
    return doc if isinstance(doc, list) else []
