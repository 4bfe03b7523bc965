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

A snapshot is a file someone sent, so `read_snapshot` treats it as untrusted: the manifest records
every member's size and xxh3-128 content hash, and before a run is made each member's declared size
must match it and stay under a ceiling relative to the file's own size (`MAX_RATIO`), each member is
read once to check its CRC and hash, and is parsed as what it claims to be (JSON of a capture's
shape, safetensors headers whose byte ranges fit, sketch arrays that are the ones the rows name).
See docs/snapshots.md.

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
import shutil
import socket
import time
import zipfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from core.capture import FORMAT as CAPTURE_FORMAT
from core.capture import Capture, capture_folder_name, capture_problem
from core.models.checkpoint import CheckpointError, read_header
from core.models.checkpoint_hashes import CheckpointHashes, HashingReader, file_hash
from core.spec import AdapterRef, ModelRef, ProbeSpec, SpecError, Target, valid_machine

FORMAT = "weightdrift-snapshot/1"
SUFFIX = ".wdsnap"
MANIFEST = "snapshot.json"
CAPTURE_FILES = ("capture.json", "tensors.safetensors", "sketches.safetensors")
# Which files of a model or adapter folder the hashes cover: what loading reads to build the model.
# In an imported run's captures folder: where each imported capture came from.
IMPORTED = "imported.json"
# The most a snapshot's members may unpack to, as a multiple of the file's own size, each and all
# together. Deflate reaches ~1000:1 on zeros; captures do not compress much: measured on demo snapshots,
# whole files unpack to 1.24–1.67× their size, and the best-compressed member (the capture.json of a
# run whose weights all equal the checkpoint) is 25.6:1 (docs/snapshots.md). A file that claims more
# than this is refused before anything is read.
MAX_RATIO = 64
# A JSON member (the manifest, a capture.json) is parsed in memory: no larger than this.
MAX_JSON = 128 * 2**20
# How members are compressed: what write_snapshot writes (deflate), or stored.
_METHODS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)


class SnapshotError(SpecError):
    """A snapshot that cannot be made, read or compared; the message names the file and the reason."""


@dataclass(frozen=True)
class SnapshotCapture:
    """One capture in a snapshot: its folder in the archive and what it captured."""

    folder: str
    target: str  # as written on the machine that made it (`cpu/float32`)
    check: str = ""  # an own-worker check's name, empty for the shared load loop
    variant: str = ""


@dataclass(frozen=True)
class Member:
    """A capture file in a snapshot as the manifest records it when the snapshot is made."""

    size: int  # bytes, unpacked
    xxh3_128: str  # content hash of those bytes (the zip's CRC finds damage, not an edit)

    @staticmethod
    def of(path: Path) -> Member:
        """The size and hash of the file at `path`."""
        return Member(path.stat().st_size, file_hash(path))


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
    members: dict[str, Member] = field(default_factory=dict)  # archive name → what the manifest records

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
    members = {
        f"captures/{e.folder}/{name}": Member.of(captures_dir / e.folder / name)
        for e in entries
        for name in CAPTURE_FILES
    }
    manifest = {
        "format": FORMAT,
        "capture_format": CAPTURE_FORMAT,
        "machine": machine,
        "created": time.time(),
        "source_run": Path(run_dir).name,
        "spec": spec.to_dict(),
        "checkpoint_hashes": CheckpointHashes.of(spec.base, spec.adapters).to_dict(),
        "captures": [e.__dict__ for e in entries],
        "members": {name: m.__dict__ for name, m in members.items()},
    }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{secrets.token_hex(4)}.tmp")
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as z:
            z.writestr(MANIFEST, json.dumps(manifest, indent=2, sort_keys=True))
            for name in members:
                z.write(captures_dir / name.removeprefix("captures/"), name)
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
    """Read and verify a snapshot file before anything of it is stored.

    Checked in this order, each from what the one before established: the members' names against the
    manifest (none missing, none extra), their declared sizes against the manifest's and against
    `MAX_RATIO` × the file's size (nothing is unpacked yet), then each member read once: its CRC,
    its content hash against the manifest's, and its content as what it claims to be (capture.json
    of a capture's shape, safetensors headers whose byte ranges fit, sketch arrays the rows name).
    SnapshotError, naming the file, the member and the reason, for anything else (a truncated copy,
    another kind of file, a newer format, an edited member).
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise SnapshotError(f"snapshot {path} does not exist (or is not a file)")
    try:
        with zipfile.ZipFile(path) as z:
            return _read(z, path, path.stat().st_size)
    except SnapshotError:
        raise
    except zipfile.BadZipFile as e:
        raise _damaged(path, f"not a complete zip archive ({e}); a truncated copy reads like this") from e
    except (OSError, ValueError, EOFError) as e:
        raise _damaged(path, f"{type(e).__name__}: {e}") from e


def _read(z: zipfile.ZipFile, path: Path, size: int) -> Snapshot:
    infos = _infos(z, path)
    if MANIFEST not in infos:
        raise _damaged(path, f"it has no {MANIFEST}: not a WeightDrift snapshot")
    _bounded(path, infos[MANIFEST], size, MAX_JSON)
    manifest = json.loads(_member(z, path, infos[MANIFEST], None, lambda f: f.read()))
    snapshot = _manifest(path, manifest)
    expected = {f"captures/{c.folder}/{n}" for c in snapshot.captures for n in CAPTURE_FILES}
    if set(snapshot.members) != expected:
        odd = sorted(set(snapshot.members) ^ expected)[0]
        raise _damaged(path, f"its manifest's member list does not match its captures (at {odd})")
    extra = sorted(set(infos) - expected - {MANIFEST})
    if extra:
        raise _damaged(path, f"member {extra[0]} is not in the manifest")
    for c in snapshot.captures:
        missing = [n for n in CAPTURE_FILES if f"captures/{c.folder}/{n}" not in infos]
        if missing:
            raise _damaged(path, f"capture {c.folder} lacks {', '.join(missing)}")
    # every size before any member is read: what the zip declares is what unpacking would write
    for name in sorted(expected):
        if infos[name].file_size != snapshot.members[name].size:
            raise _damaged(
                path,
                f"member {name} declares {infos[name].file_size} bytes, the manifest records "
                f"{snapshot.members[name].size}",
            )
        _bounded(path, infos[name], size, MAX_JSON if name.endswith(".json") else None)
    total = sum(i.file_size for i in infos.values())
    if total > MAX_RATIO * size:
        largest = max(infos.values(), key=lambda i: i.file_size)
        raise _damaged(
            path,
            f"its members unpack to {total} bytes in all, more than {MAX_RATIO} × its own {size} bytes "
            f"(the largest, member {largest.filename}, {largest.file_size} bytes)",
        )
    for c in snapshot.captures:
        _check_capture(z, snapshot, infos, c)
    return snapshot


def _infos(z: zipfile.ZipFile, path: Path) -> dict[str, zipfile.ZipInfo]:
    """The archive's members by name: each once, unencrypted, stored or deflated."""
    infos: dict[str, zipfile.ZipInfo] = {}
    for info in z.infolist():
        if info.filename in infos:
            raise _damaged(path, f"member {info.filename} is in it twice")
        if info.flag_bits & 0x1:
            raise _damaged(path, f"member {info.filename} is encrypted")
        if info.compress_type not in _METHODS:
            raise _damaged(
                path, f"member {info.filename} is compressed with method {info.compress_type}, not deflate"
            )
        infos[info.filename] = info
    return infos


def _bounded(path: Path, info: zipfile.ZipInfo, size: int, most: int | None) -> None:
    """Refuse a member whose declared size is beyond `MAX_RATIO` × the file's size (or `most`)."""
    if info.file_size > MAX_RATIO * size:
        raise _damaged(
            path,
            f"member {info.filename} declares {info.file_size} bytes, more than {MAX_RATIO} × the "
            f"snapshot's own {size} bytes (a compression ratio no capture reaches)",
        )
    if most is not None and info.file_size > most:
        raise _damaged(
            path,
            f"member {info.filename} declares {info.file_size} bytes, more than a JSON member may hold ({most})",
        )


def _manifest(path: Path, manifest: Any) -> Snapshot:
    """The snapshot its manifest describes, its members' sizes and hashes included."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise _damaged(path, f"its format is {found!r}, this version reads {FORMAT!r}")
    if "members" not in manifest:
        raise SnapshotError(
            f"snapshot {path} was made by an older version of WeightDrift: its manifest does not record its "
            "members' sizes and content hashes, which an import checks. Make it again with this version "
            "(python -m core snapshot …)"
        )
    try:
        captures = tuple(SnapshotCapture(**c) for c in manifest["captures"])
        members = {str(k): Member(**v) for k, v in manifest["members"].items()}
        snapshot = Snapshot(
            path=path,
            machine=str(manifest["machine"]),
            created=float(manifest["created"]),
            spec=ProbeSpec.from_dict(manifest["spec"]),
            hashes=CheckpointHashes.from_dict(manifest["checkpoint_hashes"]),
            captures=captures,
            source_run=str(manifest.get("source_run", "")),
            members=members,
        )
        for c in captures:
            Target.parse(c.target)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise _damaged(path, f"its manifest is incomplete ({type(e).__name__}: {e})") from e
    for name, m in members.items():
        if type(m.size) is not int or m.size < 0 or not isinstance(m.xxh3_128, str):
            raise _damaged(path, f"its manifest records member {name} as {m!r:.120}, not a size and a hash")
    if not valid_machine(snapshot.machine):
        raise _damaged(path, f"machine name {snapshot.machine!r} is not a valid name")
    for c in captures:
        # names come from a file someone sent: nothing may point outside its capture folder
        if not isinstance(c.folder, str) or "/" in c.folder or c.folder.startswith(".") or not c.folder:
            raise _damaged(path, f"capture folder {c.folder!r} is not a plain name")
    return snapshot


def _member(
    z: zipfile.ZipFile,
    path: Path,
    info: zipfile.ZipInfo,
    expected: Member | None,
    consume: Callable[[Any], Any],
) -> Any:
    """Read one member once through `consume` (given a reader of its bytes), then the rest of it: its
    CRC (a damaged copy), then its content hash against `expected` (an edited member), then what
    `consume` found wrong (a member that is not what it claims to be), in that order."""
    name = info.filename
    try:
        with z.open(info) as raw:
            reader = HashingReader(raw)
            try:
                value, problem = consume(reader), None
            except CheckpointError as e:  # its message names the member
                value, problem = None, e
            digest = reader.drain()
    except zipfile.BadZipFile as e:
        why = "CRC mismatch" if str(e).startswith("Bad CRC") else str(e)
        raise _damaged(path, f"member {name} is damaged ({why})") from e
    except (EOFError, zlib.error) as e:
        raise _damaged(path, f"member {name} is damaged ({type(e).__name__}: {e})") from e
    if expected is not None and (reader.n != expected.size or digest != expected.xxh3_128):
        raise _damaged(
            path,
            f"member {name} is not the file the snapshot was made with: its content hash differs from the "
            "manifest's (edited after the snapshot was made)",
        )
    if problem is not None:
        raise _damaged(path, f"member {problem}") from problem
    return value


def _check_capture(
    z: zipfile.ZipFile, snapshot: Snapshot, infos: dict[str, zipfile.ZipInfo], c: SnapshotCapture
) -> None:
    """Read one capture's three members and check they make the capture the manifest lists."""
    prefix = f"captures/{c.folder}/"

    def member(name: str, consume: Callable[[Any], Any]) -> Any:
        return _member(z, snapshot.path, infos[prefix + name], snapshot.members[prefix + name], consume)

    def header(name: str) -> Callable[[Any], Any]:
        return lambda f: read_header(f, infos[prefix + name].file_size, Path(prefix + name))

    raw = member("capture.json", lambda f: f.read())
    tensors = member("tensors.safetensors", header("tensors.safetensors"))
    sketches = member("sketches.safetensors", header("sketches.safetensors"))
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise _damaged(snapshot.path, f"member {prefix}capture.json is not JSON ({e})") from e
    problem = capture_problem(doc, tensors, sketches)
    if problem is None and (doc["target"], doc["check"], doc["variant"]) != (c.target, c.check, c.variant):
        found, listed = (
            Capture(target=t, check=k, variant=v).label
            for t, k, v in ((doc["target"], doc["check"], doc["variant"]), (c.target, c.check, c.variant))
        )
        problem = f"capture.json is of {found}, the manifest lists {listed}"
    if problem is not None:
        raise _damaged(snapshot.path, f"member {prefix}{problem}")


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


def check_room(snapshots: Sequence[Snapshot], home: Path) -> None:
    """Refuse snapshots whose captures, unpacked, would not fit in the free space of `home`'s disk."""
    need = sum(m.size for s in snapshots for m in s.members.values())
    where = Path(home).expanduser()
    while not where.exists() and where != where.parent:
        where = where.parent  # the home may not be made yet: the disk it will be on
    free = shutil.disk_usage(where).free
    if need > free:
        names = ", ".join(str(s.path) for s in snapshots)
        raise SnapshotError(
            f"snapshot{'s' if len(snapshots) > 1 else ''} {names} unpack{'' if len(snapshots) > 1 else 's'} to "
            f"{need} bytes ({need / 2**20:.1f} MiB) and the disk of {home} has {free} bytes "
            f"({free / 2**20:.1f} MiB) free: free some space, or choose another home (--home or WEIGHTDRIFT_HOME)"
        )


def comparison(
    snapshots: Sequence[Snapshot],
    local_targets: Sequence[Target] = (),
    base: ModelRef | None = None,
    adapters: Sequence[AdapterRef] | None = None,
    home: Path | None = None,
    peers: bool = True,
) -> tuple[ProbeSpec, Callable[[Path], None]]:
    """The spec of a run comparing `snapshots` (and `local_targets`, run here), and the function
    that puts the snapshots' captures into its run folder (`Engine.submit`'s `install`).

    Local targets need the base and adapters here: `base`/`adapters`, or the paths the first
    snapshot recorded; their files must hash as the snapshot's did. Without local targets nothing is
    loaded here, and the model files need not be here at all. With `home`, the captures must fit in
    its disk's free space (`check_room`). `peers`: judge targets against their peers (`ProbeSpec.peers`).
    """
    if not snapshots:
        raise SnapshotError("no snapshot given")
    if home is not None:
        check_room(snapshots, home)
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
        local = CheckpointHashes.of(spec_base, spec_adapters, snapshots[0].hashes.version)
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
        # the snapshots' peers are among their targets; `Engine.submit` adds one only where none is
        peers=peers,
        added_peers=(),
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
                    with open(folder / name, "wb") as dst:
                        _unpack(z, s, f"captures/{c.folder}/{name}", dst.write)
                raw = bytearray()
                _unpack(z, s, f"captures/{c.folder}/capture.json", raw.extend)
                doc = json.loads(raw)
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


def _unpack(z: zipfile.ZipFile, snapshot: Snapshot, name: str, write: Callable[[bytes], Any]) -> None:
    """Copy a member `read_snapshot` checked, checking again that it is that member (its declared size,
    then its hash): the file could have been replaced since."""
    expected = snapshot.members[name]
    info = z.getinfo(name)
    if info.file_size != expected.size:
        raise _damaged(snapshot.path, f"member {name} changed since it was checked")

    def copy(f: Any) -> None:
        while block := f.read(1 << 24):
            write(block)

    _member(z, snapshot.path, info, expected, copy)


def read_imported(run_dir: Path) -> list[dict[str, Any]]:
    """Where an imported run's captures came from (`import_captures`); empty for a local run."""
    try:
        doc = json.loads((Path(run_dir) / "captures" / IMPORTED).read_text())
    except (OSError, ValueError):
        return []
    return doc if isinstance(doc, list) else []
