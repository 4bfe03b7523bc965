"""Snapshots: made by one command per machine, compared by another, exactly like a local run.

In process (`--in-process`: no worker start-up), on the demo's tiny Llama with a LoRA and a PiSSA
(PiSSA's SVD is where `threads=1` shows).
"""

import json
import zipfile
from pathlib import Path

import pandas as pd
import pytest

from core import cli
from core.engine.snapshot import machine_name, read_snapshot
from core.engine.store import Store
from core.spec import SpecError, Target

ADAPTERS = ("lora", "pissa")


def _cli(capfd, *args) -> tuple[int, str, str]:
    capfd.readouterr()
    code = cli.main([*args, "--in-process"])
    out = capfd.readouterr()
    return code, out.out, out.err


def _base_args(demo) -> list[str]:
    return [
        "--base",
        demo["models"]["tiny-llama"],
        "--adapter",
        *(f"{demo['adapters'][n]['path']}={n}" for n in ADAPTERS),
    ]


@pytest.fixture(scope="module")
def made(demo_workspace, tmp_path_factory):
    """Two snapshots (cpu/float32, cpu/float32+threads=1) made by two commands, in their own homes."""
    tmp = tmp_path_factory.mktemp("snapshots")
    files = {}
    for name, target in (("a", "cpu/float32"), ("b", "cpu/float32+threads=1")):
        out = tmp / f"{name}.wdsnap"
        code = cli.main(
            ["snapshot", *_base_args(demo_workspace), "--target", target, "-o", str(out)]
            # each snapshot holds its one target (b's peer, cpu/float32, is a's)
            + ["--home", str(tmp / f"home-{name}"), "--json", "--in-process", "--no-peers"]
        )
        assert code == 0 and out.is_file()
        files[name] = out
    return tmp, files


def _canonical(table: pd.DataFrame, strip: str = "") -> pd.DataFrame:
    """Rows in a fixed order, with the machine part of target and reference names removed."""
    table = table.copy()
    for col in ("target", "reference", "other", "peer"):
        if col in table:
            table[col] = table[col].astype(str).str.replace(strip, "", regex=False)
    keys = [c for c in ("check", "target", "other", "adapter", "tensor") if c in table]
    return table.sort_values(keys, na_position="first").reset_index(drop=True)


def test_compare_of_two_snapshots_equals_one_local_run(made, demo_workspace, tmp_path, capfd):
    tmp, files = made
    home = tmp_path / "laptop"
    code, out, err = _cli(capfd, "compare", str(files["a"]), str(files["b"]), "--home", str(home), "--json")
    compared = json.loads(out)
    assert compared["status"] == "succeeded", err
    local_code, local_out, local_err = _cli(
        capfd,
        "run",
        *_base_args(demo_workspace),
        "--target",
        "cpu/float32",
        "cpu/float32+threads=1",
        "--home",
        str(home),
        "--json",
    )
    assert code == local_code
    local = json.loads(local_out)
    store = Store(home)
    a, b = store.open(compared["run_id"]), store.open(local["run_id"])
    machine = machine_name()
    assert {str(t) for t in a.spec.targets} == {f"{machine}/cpu/float32", f"{machine}/cpu/float32+threads=1"}
    assert {Target.parse(t).label for t in a.metrics()["target"]} == {
        f"{machine}/cpu·fp32",
        f"{machine}/cpu·fp32·threads=1",
    }
    # row by row: the same verdicts and the same numbers, once the machine is taken out of the names
    left, right = _canonical(a.metrics(), f"{machine}/"), _canonical(b.metrics())
    assert list(left.columns) == list(right.columns)
    pd.testing.assert_frame_equal(left, right)
    pairs_a, pairs_b = _canonical(a.table("pairwise"), f"{machine}/"), _canonical(b.table("pairwise"))
    pd.testing.assert_frame_equal(pairs_a, pairs_b)
    # loaded weights across the two snapshots: bitwise equal by their content hashes alone (PiSSA's
    # base, rewritten at load by an SVD whose rounding may follow the thread count, is measured apart)
    weights = pairs_a[(pairs_a["check"] == "weights") & (pairs_a["role"] != "rewritten base")]
    assert len(weights) and (weights["compared_by"] == "hash").all() and weights["bitwise_equal"].all()
    # the environment table holds both machines' targets, with their thread counts
    envs = a.environments()
    assert envs[f"{machine}/cpu/float32+threads=1"]["num_threads"] == 1
    assert f"{machine}/cpu/float64" in envs  # the reference the outputs were compared against


def test_two_snapshots_of_one_target_stay_two_targets(made, tmp_path, capfd):
    tmp, files = made
    code, out, err = _cli(
        capfd, "compare", str(files["a"]), str(files["a"]), "--home", str(tmp_path), "--json"
    )
    assert code == 0, err
    targets = {r["target"] for r in json.loads(out)["verdicts_by_check_target"]}
    machine = machine_name()
    assert targets == {f"{machine}/cpu/float32", f"{machine}-2/cpu/float32"}


def test_a_snapshot_of_another_base_is_refused(made, demo_workspace, tmp_path, capfd):
    tmp, files = made
    other = tmp_path / "bert.wdsnap"
    code, _, err = _cli(
        capfd,
        "snapshot",
        "--base",
        demo_workspace["models"]["tiny-bert"],
        "--target",
        "cpu/float32",
        "--check",
        "weights",
        "-o",
        str(other),
        "--home",
        str(tmp_path / "bert-home"),
    )
    assert code == 0, err
    home = tmp_path / "home"
    code, _, err = _cli(capfd, "compare", str(files["a"]), str(other), "--home", str(home))
    assert code == 2
    assert err.strip() == (
        f"error: snapshot {other} is not of the same base and adapters as {files['a']}: the base model "
        "differs (files config.json, generation_config.json, model.safetensors, tokenizer.json … differ)"
    )
    # local targets on another base: refused the same way, before anything runs
    code, _, err = _cli(
        capfd,
        "compare",
        str(files["a"]),
        "--target",
        "cpu/float32",
        "--base",
        demo_workspace["models"]["tiny-bert"],
        *("--adapter", *(f"{demo_workspace['adapters'][n]['path']}={n}" for n in ADAPTERS)),
        "--home",
        str(home),
    )
    assert code == 2 and "the local base and adapters are not those snapshot" in err
    assert "the base model differs" in err
    assert not (home / "runs").exists() or not any((home / "runs").iterdir())


def test_a_corrupt_or_truncated_snapshot_is_refused_and_no_stored_run_is_lost(made, tmp_path, capfd):
    tmp, files = made
    home = tmp / "home-a"  # holds the run snapshot a was made from
    before = {r.run_id: r.status for r in Store(home).list_runs()}
    data = files["a"].read_bytes()
    truncated = tmp_path / "truncated.wdsnap"
    truncated.write_bytes(data[: len(data) // 2])
    flipped = tmp_path / "flipped.wdsnap"
    middle = bytearray(data)
    middle[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(middle))
    text = tmp_path / "notes.wdsnap"
    text.write_text("not a snapshot")
    for path, why in (
        (truncated, "not a complete zip archive"),
        (flipped, "is damaged (CRC mismatch)"),
        (text, "not a complete zip archive"),
        (tmp_path / "missing.wdsnap", "does not exist"),
    ):
        code, out, err = _cli(capfd, "compare", str(files["b"]), str(path), "--home", str(home))
        assert code == 2, (path, err)
        line = err.strip().splitlines()[-1]
        assert line.startswith(f"error: snapshot {path} ") and why in line, line
        assert "Traceback" not in err
    assert {r.run_id: r.status for r in Store(home).list_runs()} == before
    # a zip that is no snapshot
    other = tmp_path / "other.wdsnap"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("readme.txt", "hello")
    with pytest.raises(SpecError, match="it has no snapshot.json: not a WeightDrift snapshot"):
        read_snapshot(other)


def test_a_snapshot_holds_every_capture_and_the_checkpoint_hashes(made, demo_workspace):
    _, files = made
    snap = read_snapshot(files["b"])
    assert snap.machine == machine_name()
    assert {c.target for c in snap.captures} == {"cpu/float32+threads=1", "cpu/float64"}
    assert set(snap.hashes.adapters) == set(ADAPTERS)
    assert "model.safetensors" in snap.hashes.base
    # small enough to attach to a bug report
    assert Path(files["b"]).stat().st_size < 8 * 2**20


def test_target_names_carry_their_machine():
    t = Target.parse("gpu-box/cuda:1/bf16+tf32")
    assert (t.machine, t.device, t.dtype, t.tf32) == ("gpu-box", "cuda:1", "bfloat16", True)
    assert str(t) == "gpu-box/cuda:1/bfloat16+tf32" and t.label == "gpu-box/cuda:1·bf16·tf32"
    assert t.local == Target.parse("cuda:1/bfloat16+tf32") and Target.parse(str(t)) == t
    assert t.slug != t.local.slug
    with pytest.raises(SpecError, match="machine 'a b' must be"):
        Target.parse("a b/cpu/float32")


def test_the_runs_page_imports_snapshots_and_every_page_renders_the_comparison(made, tmp_path, monkeypatch):
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from apptest import finished, make_app, no_exceptions, texts

    _, files = made
    home = tmp_path / "dash"
    at = make_app(home, monkeypatch)
    at.switch_page("views/runs.py").run()
    no_exceptions(at)
    at.text_area(key="runs.snapshot_paths").set_value(f"{files['a']}\n{files['b']}").run()
    at.button(key="runs.compare").click().run()
    no_exceptions(at)
    store = Store(home)
    (record,) = store.list_runs()
    record = finished(store, record.run_id, 60)
    assert record.status == "succeeded", record.error
    machine = machine_name()
    at.query_params["run"] = record.run_id
    for page in (
        "views/overview.py",
        "views/drift.py",
        "views/outputs.py",
        "views/merge.py",
        "views/runs.py",
    ):
        at.switch_page(page).run()
        no_exceptions(at)
    at.switch_page("views/overview.py").run()
    shown = texts(at)
    assert "Every target against every other" in shown and "Imported from snapshots" in shown
    assert "setting(s) differ between targets" in shown  # threads differ: highlighted
    (sources,) = [d.value for d in at.dataframe if "targets named" in d.value.columns]
    assert list(sources["targets"]) == [f"{machine}/cpu/float32", f"{machine}/cpu/float32+threads=1"]
    # a damaged file: said where the button is, nothing stored changes
    bad = tmp_path / "bad.wdsnap"
    bad.write_bytes(files["a"].read_bytes()[:1000])
    at.switch_page("views/runs.py").run()
    at.text_area(key="runs.snapshot_paths").set_value(str(bad)).run()
    at.button(key="runs.compare").click().run()
    assert "not a complete zip archive" in "\n".join(str(e.value) for e in at.error)
    assert [r.run_id for r in store.list_runs()] == [record.run_id]


def test_a_run_cannot_name_a_target_of_another_machine(demo_workspace, tmp_path, capfd):
    code, _, err = _cli(
        capfd,
        "run",
        *_base_args(demo_workspace),
        "--target",
        "gpu-box/cuda:0/float32",
        "--home",
        str(tmp_path),
    )
    assert code == 2
    assert (
        "target gpu-box/cuda:0/float32 names machine gpu-box: a target of another machine comes from" in err
    )


def test_snapshots_compare_where_the_model_files_are_not(made, tmp_path, capfd):
    """A laptop without the model: the snapshots' recorded paths do not exist here, and the rows
    are the same (every tensor was measured where it was captured)."""
    _, files = made
    moved = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}.wdsnap"
        with zipfile.ZipFile(files[name]) as src, zipfile.ZipFile(out, "w") as dst:
            for item in src.infolist():
                data = src.read(item)
                if item.filename == "snapshot.json":
                    manifest = json.loads(data)
                    manifest["spec"]["base"]["path"] = "/elsewhere/tiny-llama"
                    for a in manifest["spec"]["adapters"]:
                        a["path"] = f"/elsewhere/{a['name']}"
                    data = json.dumps(manifest).encode()
                dst.writestr(item, data)
        moved.append(str(out))
    home = tmp_path / "home"
    code, out, err = _cli(capfd, "compare", *moved, "--home", str(home), "--json")
    here_code, here_out, _ = _cli(
        capfd, "compare", str(files["a"]), str(files["b"]), "--home", str(home), "--json"
    )
    assert code == here_code and json.loads(out)["status"] == "succeeded", err
    store = Store(home)
    elsewhere, here = (store.open(json.loads(o)["run_id"]).metrics() for o in (out, here_out))
    pd.testing.assert_frame_equal(_canonical(elsewhere), _canonical(here))
