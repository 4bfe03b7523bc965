"""core.models.checkpoint: lazy, exact reads of safetensors (single, sharded) and weights-only .bin files."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.models.checkpoint import Checkpoint, CheckpointError, LoadError, read_checkpoint


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "f64": torch.randn(3, 5, generator=g, dtype=torch.float64),
        "f32": torch.randn(17, 9, generator=g),
        "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
        "f16": torch.randn(4, 4, 2, generator=g).to(torch.float16),
        "i64": torch.arange(512).reshape(1, 512),
        "i8": torch.tensor([-3, 0, 7], dtype=torch.int8),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5),
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise: same dtype, shape and bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def test_reads_every_dtype_bitwise(tmp_path):
    tensors = _tensors()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ck = Checkpoint.open(tmp_path)
    assert sorted(ck.names()) == sorted(tensors)
    assert ck.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    reference = load_file(str(tmp_path / "model.safetensors"))
    for name, t in reference.items():
        assert _same(ck.read(name), t), name
        assert ck.info(name).shape == tuple(t.shape)
    assert "f32" in ck and "nope" not in ck
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        ck.read("nope")


def test_read_flat_and_chunks(tmp_path):
    t = torch.randn(1000, 7)
    save_file({"w": t}, str(tmp_path / "m.safetensors"))
    ck = Checkpoint.open(tmp_path)
    assert torch.equal(ck.read_flat("w", 123, 4567), t.reshape(-1)[123:4567])
    pieces = list(ck.iter_flat("w", 999))
    assert [s for s, _ in pieces] == list(range(0, 7000, 999))
    # The buffer is reused, so each chunk is checked as it comes.
    for start, chunk in ck.iter_flat("w", 999):
        assert torch.equal(chunk, t.reshape(-1)[start : start + 999])
    with pytest.raises(IndexError):
        ck.read_flat("w", 10, 7001)


def test_sharded_with_index(tmp_path):
    a, b = {"x.weight": torch.randn(4, 4)}, {"y.weight": torch.randn(2, 3), "y.bias": torch.randn(2)}
    save_file(a, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(b, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {"x.weight": "model-00001-of-00002.safetensors"}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in b})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ck = Checkpoint.open(tmp_path)
    assert sorted(ck.names()) == ["x.weight", "y.bias", "y.weight"]
    assert torch.equal(ck.read("y.weight"), b["y.weight"])
    assert read_checkpoint(tmp_path, names={"x.weight"}).keys() == {"x.weight"}
    # An index naming a shard that is not there, or pointing outside the folder, is refused.
    weight_map["z"] = "model-00003-of-00003.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="model-00003-of-00003.safetensors"):
        Checkpoint.open(tmp_path)
    weight_map["z"] = "../elsewhere.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="plain file names"):
        Checkpoint.open(tmp_path)


def test_corrupt_files_name_the_file(tmp_path):
    save_file({"w": torch.randn(64, 64)}, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated: tensor 'w'"):
        Checkpoint.open(tmp_path)
    with pytest.raises(LoadError, match="truncated"):
        read_checkpoint(tmp_path)
    header = json.dumps([1, 2]).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(CheckpointError, match="header is a JSON list"):
        Checkpoint.open(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(CheckpointError, match="header length"):
        Checkpoint.open(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="shorter than"):
        Checkpoint.open(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors or \\*.bin"):
        Checkpoint.open(tmp_path)


def test_a_header_whose_byte_ranges_overlap_is_refused(tmp_path):
    """Two tensors said to share bytes (and the file's last bytes owned by none): what safetensors
    itself refuses, and what a lying header in a snapshot would be."""
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    }
    text = json.dumps(header).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(len(text).to_bytes(8, "little") + text + bytes(16))
    start = 8 + len(text)
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(tmp_path)
    assert str(e.value) == (
        f"{path}: corrupt: tensor 'b' starts at byte {start}, where the tensors before it end at byte "
        f"{start + 8} (its header's byte ranges overlap or leave a gap)"
    )
    header["b"]["data_offsets"] = [8, 16]  # the same file, told the truth
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + bytes(16))
    assert sorted(Checkpoint.open(tmp_path).names()) == ["a", "b"]


def test_bin_weights_only(tmp_path):
    tensors = {"a": torch.randn(3, 3), "b": torch.arange(4)}
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    ck = Checkpoint.open(tmp_path)
    assert sorted(ck.names()) == ["a", "b"]
    assert torch.equal(ck.read("a"), tensors["a"]) and torch.equal(ck.read_flat("b", 1, 3), tensors["b"][1:3])
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a zip archive")
    with pytest.raises(CheckpointError, match="not a loadable weights-only checkpoint"):
        Checkpoint.open(tmp_path)


def test_adapter_prefix(tmp_path):
    save_file({"base.w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    save_file({"lora_A": torch.zeros(2)}, str(tmp_path / "adapter_model.safetensors"))
    assert Checkpoint.open(tmp_path, prefix="adapter_model").names() == ["lora_A"]


def test_scratch_reads_share_one_buffer_and_plain_reads_do_not(tmp_path):
    tensors = {
        "big": torch.arange(64, dtype=torch.float32).reshape(8, 8),
        "small": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ckpt = Checkpoint.open(tmp_path)
    assert Checkpoint.open(tmp_path) is ckpt  # indexed once while the files are unchanged
    a = ckpt.read("big", scratch=True)
    assert torch.equal(a, tensors["big"])
    b = ckpt.read("small", scratch=True)
    assert torch.equal(b, tensors["small"]) and b.dtype == torch.bfloat16
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # the same buffer, reused
    assert not torch.equal(a.reshape(-1)[:1], tensors["big"].reshape(-1)[:1])  # overwritten by the next
    c, d = ckpt.read("big"), ckpt.read("big")
    assert torch.equal(c, d) and c.untyped_storage().data_ptr() != d.untyped_storage().data_ptr()
    # a file that changes is indexed anew
    save_file({"big": tensors["big"] * 2}, str(tmp_path / "model.safetensors"))
    assert torch.equal(Checkpoint.open(tmp_path).read("big"), tensors["big"] * 2)
