"""A snapshot made in one WeightDrift home compares with local targets of another (issue 40, section 3):
the checkpoint hashes cover what loading reads as the model — weights, tokenizer files, and configs by
their fields with the base's path normalised to the base's own hashes — not the absolute path an
adapter_config.json records. A changed weight or config field is still refused with its sentence."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from core import cli
from core.demo.build import build_demo
from core.engine.snapshot import read_snapshot
from core.engine.store import Store
from core.models.checkpoint_hashes import CheckpointHashes, file_hash, folder_hashes
from core.spec import AdapterRef, ModelRef

ADAPTERS = ("lora", "pissa")


@pytest.fixture(scope="module")
def homes(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """The demo built in two homes, and a snapshot of each (cpu/float32, weights and outputs)."""
    made = {}
    for name in ("a", "b"):
        home = tmp_path_factory.mktemp(f"home-{name}")
        manifest = build_demo(home)
        out = home / f"{name}.wdsnap"
        code = cli.main(
            ["snapshot", *_models(manifest), "--target", "cpu/float32", "--check", "weights", "outputs"]
            + ["-o", str(out), "--home", str(home), "--in-process", "--no-peers"]
        )
        assert code == 0
        made[name] = (home, manifest)
    return made


def _models(manifest: dict, adapters: dict[str, str] | None = None) -> list[str]:
    paths = adapters or {n: manifest["adapters"][n]["path"] for n in ADAPTERS}
    return ["--base", manifest["models"]["tiny-llama"], "--adapter", *(f"{p}={n}" for n, p in paths.items())]


def _compare(capfd, snapshot: Path, home: Path, manifest: dict, adapters=None) -> tuple[int, str]:
    capfd.readouterr()
    code = cli.main(
        [
            "compare",
            str(snapshot),
            "--target",
            "cpu/bfloat16",
            *_models(manifest, adapters),
            "--home",
            str(home),
        ]
        + ["--in-process", "--no-peers"]
    )
    return code, capfd.readouterr().err


def test_each_homes_snapshot_compares_with_the_other_homes_local_targets(homes, capfd):
    for mine, theirs in (("a", "b"), ("b", "a")):
        home, manifest = homes[theirs]
        snapshot = homes[mine][0] / f"{mine}.wdsnap"
        # the adapter configs name different absolute base paths, so their bytes differ …
        config = Path(manifest["adapters"]["lora"]["path"]) / "adapter_config.json"
        assert str(home) in json.loads(config.read_text())["base_model_name_or_path"]
        before = {r.run_id for r in Store(home).list_runs()}
        code, err = _compare(capfd, snapshot, home, manifest)
        assert code in (0, 1), err  # … and the comparison runs: drift (1) is bf16's finding
        (run_id,) = {r.run_id for r in Store(home).list_runs()} - before
        record = Store(home).open(run_id)
        assert record.status == "succeeded"
        targets = {str(t) for t in record.spec.targets}
        assert "cpu/bfloat16" in targets and any(t.endswith("/cpu/float32") for t in targets)


def test_the_hashes_normalise_the_base_path_and_cover_the_tokenizer(homes):
    (home_a, a), (_, b) = homes["a"], homes["b"]
    hashes = [
        CheckpointHashes.of(
            ModelRef(m["models"]["tiny-llama"]), [AdapterRef(m["adapters"]["lora"]["path"], "lora")]
        )
        for m in (a, b)
    ]
    assert hashes[0] == hashes[1] and hashes[0].version == 2
    assert {"tokenizer.json", "tokenizer_config.json", "model.safetensors", "config.json"} <= set(
        hashes[0].base
    )
    # the way a snapshot made before took them: configs as bytes, no tokenizer, the paths in them
    old = [
        CheckpointHashes.of(
            ModelRef(m["models"]["tiny-llama"]), [AdapterRef(m["adapters"]["lora"]["path"], "lora")], 1
        )
        for m in (a, b)
    ]
    config = Path(a["adapters"]["lora"]["path"]) / "adapter_config.json"
    assert old[0].adapters["lora"]["adapter_config.json"] == file_hash(config)
    assert "tokenizer.json" not in old[0].base
    assert old[0].difference(old[1]) == "adapter lora differs (files adapter_config.json differ)"
    assert hashes[0].difference(old[0]) == (
        "their checkpoint files were hashed by different versions of WeightDrift (configs as bytes, or by "
        "their fields): make the older snapshot again with this version"
    )
    # a snapshot records the new way, and reads back as it
    recorded = read_snapshot(home_a / "a.wdsnap").hashes
    assert recorded.version == 2 and recorded.base == hashes[0].base
    assert recorded.adapters["lora"] == hashes[0].adapters["lora"]


@pytest.mark.parametrize(
    ("change", "file"),
    [("weight", "adapter_model.safetensors"), ("config field", "adapter_config.json")],
)
def test_a_changed_weight_or_config_field_is_still_refused(homes, tmp_path, capfd, change, file):
    home, manifest = homes["b"]
    changed = tmp_path / "lora"
    shutil.copytree(manifest["adapters"]["lora"]["path"], changed)
    if change == "weight":
        weights = changed / file
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0x01  # the last byte of the last tensor
        weights.write_bytes(bytes(data))
    else:
        config = json.loads((changed / file).read_text())
        config["lora_alpha"] += 1
        (changed / file).write_text(json.dumps(config, indent=2))
    # a reformatted config with the same fields is the same config
    same = tmp_path / "same"
    shutil.copytree(manifest["adapters"]["lora"]["path"], same)
    (same / "adapter_config.json").write_text(
        json.dumps(json.loads((same / "adapter_config.json").read_text()))
    )
    base = (Path(manifest["models"]["tiny-llama"]).resolve(), "x")
    assert folder_hashes(str(same), base) == folder_hashes(manifest["adapters"]["lora"]["path"], base)
    snapshot = homes["a"][0] / "a.wdsnap"
    paths = {"lora": str(changed), "pissa": manifest["adapters"]["pissa"]["path"]}
    before = {r.run_id for r in Store(home).list_runs()}
    code, err = _compare(capfd, snapshot, home, manifest, paths)
    assert code == 2
    assert err.strip() == (
        f"error: the local base and adapters are not those snapshot {snapshot} was made from: adapter lora "
        f"differs (files {file} differ)"
    )
    assert {r.run_id for r in Store(home).list_runs()} == before
