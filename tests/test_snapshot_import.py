"""A snapshot is a file someone sent: its import is bounded and validated before anything is stored.

The snapshots here are packed from a run folder made in the test (one capture with a row, its sketch
and a kept tensor): no model is loaded. Each crafted file is refused by `compare` before a run exists,
with a sentence naming the member, and leaves nothing in the home.
"""

import json
import struct
import sys
import time
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
import xxhash

from core import cli
from core.capture import Capture, TensorKey
from core.engine import snapshot as snapshot_module
from core.engine.snapshot import (
    MAX_RATIO,
    Member,
    SnapshotError,
    comparison,
    import_captures,
    machine_labels,
    read_snapshot,
    write_snapshot,
)
from core.numerics import metrics
from core.numerics.sketch import content_hash
from core.numerics.tolerance import default_tolerance
from core.spec import ModelRef, ProbeSpec, Target

SKETCHES = "captures/cpu_float32/sketches.safetensors"
CAPTURE_JSON = "captures/cpu_float32/capture.json"
ROW = TensorKey("weights", "-", "layers.0.weight")
GIB2 = 2 * 2**30


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """A snapshot of a run with one capture: a row measured in the worker (with its sketch) and a kept tensor."""
    tmp = tmp_path_factory.mktemp("good")
    run_dir = tmp / "run"
    reference = torch.arange(128, dtype=torch.float32).reshape(8, 16)
    target = reference + 0.5
    stats, sketch = metrics.measure(target, reference, default_tolerance(torch.float32))
    capture = Capture(target="cpu/float32", environment={"host": "box"})
    capture.results[ROW.encode()] = {
        "reference": "checkpoint",
        "note": "",
        "dtype": "float32",
        "row": metrics.stats_to_row(stats),
        "sketch": sketch.meta(),
        "hash": content_hash(target),
    }
    capture.sketches[ROW.encode()] = sketch
    capture.keep(TensorKey("outputs", "-", "logits"), torch.ones(2, 3))
    capture.save(run_dir / "captures" / "cpu_float32")
    spec = ProbeSpec(
        base=ModelRef(str(tmp / "no-model")), adapters=(), targets=(Target.parse("cpu/float32"),)
    )
    return write_snapshot(run_dir, spec, tmp / "good.wdsnap", machine="box")


def _members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {name: z.read(name) for name in z.namelist()}


def _manifest(members: dict[str, bytes]) -> dict:
    return json.loads(members["snapshot.json"])


def _with_manifest(members: dict[str, bytes], manifest: dict) -> dict[str, bytes]:
    return {**members, "snapshot.json": json.dumps(manifest).encode()}


def _recorded(members: dict[str, bytes], name: str, data: bytes) -> dict[str, bytes]:
    """`members` with `name` replaced by `data`, and the manifest's size and hash of it made to match:
    what someone who edits a member and its record sends."""
    manifest = _manifest(members)
    manifest["members"][name] = {"size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}
    return _with_manifest({**members, name: data}, manifest)


def _zip(path: Path, members: dict[str, bytes], raw: dict[str, tuple[int, int, bytes]] | None = None) -> Path:
    """A zip of `members` (deflated by zipfile: CRCs correct) plus `raw` members given as (crc, size,
    deflate stream), written by hand so that a 2 GiB member costs its compressed bytes only."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    if not raw:
        return path
    with zipfile.ZipFile(path) as z:
        entries = [(i, z.read(i.filename)) for i in z.infolist()]
    out, central = bytearray(), bytearray()
    items = [(i.filename, zlib.crc32(d), len(d), _deflate(d)) for i, d in entries]
    items += [(name, crc, size, stream) for name, (crc, size, stream) in raw.items()]
    for name, crc, size, stream in items:
        encoded = name.encode()
        fields = struct.pack("<HHHHHIII", 20, 0, 8, 0, 0, crc, len(stream), size)
        central += struct.pack("<IH", 0x02014B50, 20) + fields
        central += struct.pack("<HHHHHII", len(encoded), 0, 0, 0, 0, 0, len(out)) + encoded
        out += struct.pack("<I", 0x04034B50) + fields + struct.pack("<HH", len(encoded), 0) + encoded + stream
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(items), len(items), len(central), len(out), 0)
    path.write_bytes(bytes(out + central + end))
    return path


def _deflate(data: bytes) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    return c.compress(data) + c.flush()


def _zeros(chunks: int) -> tuple[int, int, bytes]:
    """(crc, size, raw deflate stream) of `chunks` × 64 MiB of zero bytes, made from one block: after a
    full flush the compressor starts afresh, so the block's stream repeats (about 64 KB a block)."""
    chunk = bytes(64 * 2**20)
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = c.compress(chunk) + c.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    for _ in range(chunks):
        crc = zlib.crc32(chunk, crc)
    return crc, chunks * len(chunk), block * chunks + c.flush()


@pytest.fixture(scope="module")
def zeros() -> tuple[int, int, bytes]:
    """2 GiB of zero bytes as a deflated member: about 2 MB."""
    return _zeros(GIB2 // (64 * 2**20))


def _refused(capfd, tmp_path, path: Path) -> str:
    """`compare` on `path`: exit 2 and one line naming the file; no run, nothing at all in the home."""
    home = tmp_path / "home"
    capfd.readouterr()
    code = cli.main(["compare", str(path), "--home", str(home), "--in-process"])
    err = capfd.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"error: snapshot {path} "), line
    assert [p for p in home.rglob("*") if p.is_file() or p.name != "runs"] == []
    return line.removeprefix(f"error: snapshot {path} ")


DAMAGED_TAIL = ". Copy it again from the machine that made it, or make it again (python -m core snapshot …)"


def test_a_snapshot_records_each_member_size_and_hash_and_unpacks_them_unchanged(good, tmp_path):
    snap = read_snapshot(good)
    run_dir = good.parent / "run"
    assert set(snap.members) == {
        f"captures/cpu_float32/{n}" for n in ("capture.json", "tensors.safetensors", "sketches.safetensors")
    }
    for name, member in snap.members.items():
        assert member == Member.of(run_dir / name)
    target = tmp_path / "imported"
    import_captures(machine_labels([snap]), target)
    for name in ("tensors.safetensors", "sketches.safetensors"):
        assert (target / "captures/box_cpu_float32" / name).read_bytes() == (
            run_dir / "captures/cpu_float32" / name
        ).read_bytes()
    # the imported capture reads back with its row's sketch
    imported = Capture.load(target / "captures/box_cpu_float32")
    assert imported.target == "box/cpu/float32" and imported.sketch(ROW).shape == (8, 16)


def test_a_2_gib_member_of_zeros_is_refused_from_its_declared_size(good, zeros, tmp_path, capfd, monkeypatch):
    members = _members(good)
    bad = _zip(
        tmp_path / "zeros.wdsnap", {k: v for k, v in members.items() if k != SKETCHES}, {SKETCHES: zeros}
    )
    assert 1.5e6 < bad.stat().st_size < 3e6  # a valid zip: every CRC and size is true
    with zipfile.ZipFile(bad) as z:
        assert z.getinfo(SKETCHES).file_size == GIB2
    opened = []
    real_open = zipfile.ZipFile.open

    def watched_open(self, name, *args, **kwargs):
        opened.append(getattr(name, "filename", name))
        return real_open(self, name, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "open", watched_open)
    started = time.monotonic()
    why = _refused(capfd, tmp_path, bad)
    assert time.monotonic() - started < 10
    recorded = _manifest(members)["members"][SKETCHES]["size"]
    assert why == (
        f"cannot be used: member {SKETCHES} declares {GIB2} bytes, the manifest records {recorded}"
        + DAMAGED_TAIL
    )
    assert SKETCHES not in opened  # refused from the declared size: not one byte of it was read


def test_an_honest_but_huge_member_is_refused_by_the_ceiling(good, zeros, tmp_path, capfd, monkeypatch):
    members = _members(good)
    manifest = _manifest(members)
    manifest["members"][SKETCHES] = {"size": GIB2, "xxh3_128": "0" * 32}
    rest = {k: v for k, v in _with_manifest(members, manifest).items() if k != SKETCHES}
    bad = _zip(tmp_path / "huge.wdsnap", rest, {SKETCHES: zeros})
    size = bad.stat().st_size
    assert MAX_RATIO * size < GIB2
    why = _refused(capfd, tmp_path, bad)
    assert why == (
        f"cannot be used: member {SKETCHES} declares {GIB2} bytes, more than {MAX_RATIO} × the snapshot's own "
        f"{size} bytes (a compression ratio no capture reaches)" + DAMAGED_TAIL
    )


def test_members_each_under_the_ceiling_are_refused_by_their_sum(good, tmp_path, capfd):
    members = _members(good)
    manifest = _manifest(members)
    block = _zeros(1)  # 64 MiB of zeros in ~64 KB: 18 of them make a file of ~1.2 MB
    folders = [f"c{i}" for i in range(6)]
    manifest["captures"] = [
        {"folder": f, "target": "cpu/float32", "check": "", "variant": ""} for f in folders
    ]
    names = [
        f"captures/{f}/{n}"
        for f in folders
        for n in ("capture.json", "tensors.safetensors", "sketches.safetensors")
    ]
    manifest["members"] = {name: {"size": block[1], "xxh3_128": "0" * 32} for name in names}
    text = json.dumps(manifest).encode()
    bad = _zip(tmp_path / "sum.wdsnap", {"snapshot.json": text}, dict.fromkeys(names, block))
    size = bad.stat().st_size
    assert block[1] <= MAX_RATIO * size < len(names) * block[1]
    assert _refused(capfd, tmp_path, bad) == (
        f"cannot be used: its members unpack to {len(names) * block[1] + len(text)} bytes in all, more than "
        f"{MAX_RATIO} × its own {size} bytes (the largest, member {names[0]}, {block[1]} bytes)"
        + DAMAGED_TAIL
    )


def _header(data: bytes) -> tuple[int, dict]:
    n = int.from_bytes(data[:8], "little")
    return n, json.loads(data[8 : 8 + n])


def _with_header(data: bytes, header: dict) -> bytes:
    n, _ = _header(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    return data[:8] + text.ljust(n) + data[8 + n :]  # the same length: only the byte ranges lie


@pytest.mark.parametrize("lie", ["past the end", "overlapping"])
def test_a_safetensors_header_that_lies_about_its_byte_ranges_is_refused(good, lie, tmp_path, capfd):
    members = _members(good)
    data = members[SKETCHES]
    n, header = _header(data)
    *_, before, last = sorted(
        (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"]
    )
    begin, end = header[last]["data_offsets"]
    if lie == "past the end":
        header[last]["data_offsets"] = [begin + 64, end + 64]
        expected = f"truncated: tensor {last!r} ends at byte {8 + n + end + 64}, the file has {len(data)}"
    else:  # the last tensor said to be where the one before it is (the same length): its own bytes unread
        header[last]["data_offsets"] = header[before]["data_offsets"]
        assert header[before]["data_offsets"] == [begin - (end - begin), begin]
        expected = (
            f"corrupt: tensor {last!r} starts at byte {8 + n + begin - (end - begin)}, where the tensors before "
            f"it end at byte {8 + n + begin} (its header's byte ranges overlap or leave a gap)"
        )
    bad = _zip(tmp_path / "lies.wdsnap", _recorded(members, SKETCHES, _with_header(data, header)))
    assert _refused(capfd, tmp_path, bad) == f"cannot be used: member {SKETCHES}: {expected}" + DAMAGED_TAIL


def test_an_edited_capture_json_with_its_crc_recomputed_is_refused(good, tmp_path, capfd):
    members = _members(good)
    # the worst difference said to be none: the same length, so only the content hash can tell
    edited = members[CAPTURE_JSON].replace(b'"max_abs": 0.5,', b'"max_abs": 0.0,')
    assert edited != members[CAPTURE_JSON] and len(edited) == len(members[CAPTURE_JSON])
    bad = _zip(tmp_path / "edited.wdsnap", {**members, CAPTURE_JSON: edited})  # zipfile writes its true CRC
    assert _refused(capfd, tmp_path, bad) == (
        f"cannot be used: member {CAPTURE_JSON} is not the file the snapshot was made with: its content hash "
        "differs from the manifest's (edited after the snapshot was made)" + DAMAGED_TAIL
    )


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda d: d.update(results=[]), "capture.json's 'results' is [], not a JSON dict"),
        (
            lambda d: d["results"].update({"logits": d["results"].pop(ROW.encode())}),
            "capture.json names row 'logits', which is not a tensor key (check::adapter::name)",
        ),
        (
            lambda d: d["results"][ROW.encode()].update(sketch=None),
            f"sketches.safetensors holds '{ROW.encode()}##col_starts', which no row of capture.json names",
        ),
        (
            lambda d: d.update(target="cpu/float16"),
            "capture.json is of cpu/float16, the manifest lists cpu/float32",
        ),
    ],
)
def test_a_capture_json_of_the_wrong_shape_is_refused_even_with_its_record_made_to_match(
    good, edit, expected, tmp_path, capfd
):
    members = _members(good)
    doc = json.loads(members[CAPTURE_JSON])
    edit(doc)
    bad = _zip(tmp_path / "shape.wdsnap", _recorded(members, CAPTURE_JSON, json.dumps(doc).encode()))
    assert (
        _refused(capfd, tmp_path, bad)
        == f"cannot be used: member captures/cpu_float32/{expected}" + DAMAGED_TAIL
    )


@pytest.mark.parametrize("extra", ["captures/cpu_float32/run.sh", "readme.txt"])
def test_a_member_not_in_the_manifest_is_refused(good, extra, tmp_path, capfd):
    bad = _zip(tmp_path / "extra.wdsnap", {**_members(good), extra: b"echo hello"})
    assert (
        _refused(capfd, tmp_path, bad)
        == f"cannot be used: member {extra} is not in the manifest" + DAMAGED_TAIL
    )


def test_a_snapshot_made_before_members_were_recorded_is_refused_with_what_to_do(good, tmp_path, capfd):
    members = _members(good)
    manifest = _manifest(members)
    del manifest["members"]
    bad = _zip(tmp_path / "old.wdsnap", _with_manifest(members, manifest))
    assert _refused(capfd, tmp_path, bad) == (
        "was made by an older version of WeightDrift: its manifest does not record its members' sizes and "
        "content hashes, which an import checks. Make it again with this version (python -m core snapshot …)"
    )


def test_a_snapshot_that_does_not_fit_in_the_home_is_refused_with_the_numbers(good, tmp_path, monkeypatch):
    need = sum(m.size for m in read_snapshot(good).members.values())

    class Usage:
        free = need - 1

    monkeypatch.setattr(snapshot_module.shutil, "disk_usage", lambda path: Usage)
    home = tmp_path / "home"
    with pytest.raises(SnapshotError) as e:
        comparison([read_snapshot(good)], home=home)
    assert str(e.value) == (
        f"snapshot {good} unpacks to {need} bytes ({need / 2**20:.1f} MiB) and the disk of {home} has "
        f"{need - 1} bytes ({(need - 1) / 2**20:.1f} MiB) free: free some space, or choose another home "
        "(--home or WEIGHTDRIFT_HOME)"
    )
    Usage.free = need
    spec, _ = comparison([read_snapshot(good)], home=home)
    assert [str(t) for t in spec.targets] == ["box/cpu/float32"]
    assert not home.exists()


def test_the_runs_page_shows_a_refused_snapshot_as_text(good, tmp_path, monkeypatch):
    sys.path.insert(0, str(Path(__file__).parent))
    from apptest import make_app, no_exceptions

    from dashboard.text import literal

    bad = _zip(tmp_path / "*extra*.wdsnap", {**_members(good), "[x](http://e.invalid)": b""})
    with pytest.raises(SnapshotError) as refused:
        read_snapshot(bad)
    assert "member [x](http://e.invalid) is not in the manifest" in str(refused.value)
    home = tmp_path / "dash"
    at = make_app(home, monkeypatch)
    at.switch_page("views/runs.py").run()
    at.text_area(key="runs.snapshot_paths").set_value(str(bad)).run()
    at.button(key="runs.compare").click().run()
    no_exceptions(at)
    # the sentence as text: the Markdown in the file's and the member's names is escaped, not rendered
    assert [e.value for e in at.error] == [literal(refused.value)]
    assert not (home / "runs").exists() or not any((home / "runs").iterdir())


def test_a_refused_upload_is_not_kept_in_the_home(good, tmp_path, monkeypatch):
    """The dashboard keeps an upload under <home>/snapshots/ to read it; refused, it is removed."""
    from dashboard import state
    from dashboard.text import literal

    shown = []
    monkeypatch.setenv("WEIGHTDRIFT_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(state.st, "error", lambda body, **kwargs: shown.append(body))
    data = _zip(tmp_path / "extra.wdsnap", {**_members(good), "readme.txt": b""}).read_bytes()
    state.start_comparison([], [("sent.wdsnap", data)])
    (message,) = shown
    assert message.endswith(literal("member readme.txt is not in the manifest" + DAMAGED_TAIL))  # as text
    assert [p for p in (tmp_path / "home").rglob("*") if p.is_file()] == []
