"""The run form's adapter scan: it never fails on what it cannot read and never walks a whole disk."""

from __future__ import annotations

import shutil
from pathlib import Path

from core.demo import workspace
from core.demo.workspace import find_adapters


def test_the_scan_skips_entries_it_cannot_read(demo_workspace, tmp_path, monkeypatch):
    base = Path(demo_workspace["models"]["tiny-llama"])
    tree = tmp_path / "models"
    shutil.copytree(base, tree / "a" / "tiny-llama")
    shutil.copytree(demo_workspace["adapters"]["lora"]["path"], tree / "b" / "lora")
    (tree / "c").mkdir()
    (tree / "c" / "fd0").mkdir()
    real_is_dir = Path.is_dir

    def is_dir(self):
        if self.name == "fd0":  # as /proc/1/fd/0 does for root in a container
            raise PermissionError(13, "Permission denied", str(self))
        return real_is_dir(self)

    monkeypatch.setattr(Path, "is_dir", is_dir)
    found = find_adapters(str(tree / "a" / "tiny-llama"))
    assert [(c.name, c.fits) for c in found] == [("lora", True)]


def test_a_top_level_base_does_not_walk_the_file_system(monkeypatch):
    walked = []
    monkeypatch.setattr(workspace, "_walk", lambda root, *a, **k: walked.append(root) or iter(()))
    assert find_adapters("/proc/1") == []
    assert find_adapters("/usr") == []
    assert walked == []  # their grandparent is / itself


def test_the_scan_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(workspace, "SCAN_BUDGET", 50)
    for i in range(200):
        (tmp_path / "wide" / f"d{i:03d}").mkdir(parents=True)
    (tmp_path / "wide" / "d199" / "adapter_config.json").write_text("{}")
    assert list(workspace._walk(tmp_path / "wide", "adapter_config.json", 3)) == []
    monkeypatch.setattr(workspace, "SCAN_BUDGET", 1000)
    assert len(list(workspace._walk(tmp_path / "wide", "adapter_config.json", 3))) == 1
