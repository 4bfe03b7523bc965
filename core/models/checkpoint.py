"""Checkpoint files read lazily: an index of every tensor, and one tensor (or one slice) at a time.

A real base model is 8–16 GB in a few safetensors shards. Comparing what a target loaded against
the file must never hold the file in memory, so `Checkpoint` parses only the shards' headers and
reads a tensor's bytes on demand with plain positioned reads into a fresh buffer (no mmap: pages
of a mapped file count in the process's resident memory for as long as the map lives, and a
worker that walks an 8 GB file through a map looks like it holds 8 GB). `read_flat` reads any
contiguous run of elements, so a tensor larger than memory can be compared chunk by chunk.

`.bin` checkpoints (pickles) are read with ``torch.load(weights_only=True, mmap=True)``; they are
the exception, kept for older models.

Below the index: what a model or adapter folder's files say for the loaders (`read_checkpoint`, the
model's config, `adapter_config.json` and what it implies, the heads adapters save, whether a float64
target fits in memory), with LoadError, the loaders' one-line error.
"""

from __future__ import annotations

import functools
import json
import math
import os
import threading
import warnings
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, BinaryIO

import torch

from core.spec import AdapterRef, InputError, ModelRef, adapter_folder, file_version

__all__ = ["Checkpoint", "CheckpointError", "TensorInfo", "SAFETENSORS_DTYPES", "read_header"]

# safetensors dtype codes → torch dtypes (little-endian on disk, as on every host torch runs on)
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
}

# A header larger than this is not a safetensors header but a corrupt length field.
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read, with a message naming the file and what is wrong."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file, dtype, shape and byte range (absolute offsets)."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the first element in `file`
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _parse_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, from its header alone (validated against the file size)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            return read_header(f, size, path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from e


def read_header(f: BinaryIO, size: int, path: Path) -> dict[str, TensorInfo]:
    """The tensors of a safetensors file of `size` bytes that `f` reads from its start (a file, or a
    member of a snapshot), from its header alone: CheckpointError, naming `path`, unless every
    tensor's byte range fits its dtype and shape and the ranges tile the data exactly."""
    head = f.read(8)
    if len(head) < 8:
        raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
    n = int.from_bytes(head, "little")
    if n > _MAX_HEADER or 8 + n > size:
        raise CheckpointError(f"{path}: not a safetensors file (header length {n} does not fit the file)")
    raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a safetensors file (its header is not JSON: {e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{path}: not a safetensors file (its header is a JSON {type(header).__name__}; expected a JSON "
            "object of tensor names, each with its dtype, shape and data_offsets)"
        )
    data_start = 8 + n
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            shape = tuple(int(s) for s in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"{path}: tensor {name!r} has a malformed header entry ({entry!r:.200})"
            ) from e
        nbytes = math.prod(shape) * dtype.itemsize
        if begin < 0 or end - begin != nbytes or any(s < 0 for s in shape):
            raise CheckpointError(
                f"{path}: tensor {name!r} claims {end - begin} bytes for shape {list(shape)} of "
                f"{entry['dtype']} ({nbytes} bytes)"
            )
        if data_start + end > size:
            raise CheckpointError(
                f"{path}: truncated: tensor {name!r} ends at byte {data_start + end}, the file has {size}"
            )
        tensors[name] = TensorInfo(name, path, dtype, shape, data_start + begin, nbytes)
    # as safetensors itself requires: each tensor's bytes start where the one before ends (a header
    # whose ranges overlap or leave holes lies about where its tensors are)
    end = data_start
    for t in sorted(tensors.values(), key=lambda t: (t.start, t.nbytes)):
        if t.start != end:
            raise CheckpointError(
                f"{path}: corrupt: tensor {t.name!r} starts at byte {t.start}, where the tensors before it "
                f"end at byte {end} (its header's byte ranges overlap or leave a gap)"
            )
        end += t.nbytes
    if end != size:
        raise CheckpointError(
            f"{path}: truncated or corrupt: its tensors end at byte {end}, the file has {size}"
        )
    return tensors


def _read_into(path: Path, offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor `out` with the bytes of `path` starting at `offset`."""
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        done = 0
        while done < len(view):
            got = f.readinto(view[done:])
            if not got:
                raise CheckpointError(f"{path}: truncated: ended {len(view) - done} bytes early")
            done += got


class Checkpoint:
    """The tensors of a model or adapter folder, indexed from the file headers and read on demand.

    `open` finds ``<prefix>*.safetensors`` (one file or shards; a ``*.safetensors.index.json``,
    when present, names the shards and is checked against them), else ``<prefix>*.bin``.
    """

    def __init__(self, folder: Path, tensors: dict[str, TensorInfo], pickled: dict[str, torch.Tensor]):
        self.folder = folder
        self._tensors = tensors
        self._pickled = pickled  # .bin checkpoints only: memory-mapped tensors by name
        self._scratch: torch.Tensor | None = None  # `read(scratch=True)`'s buffer, once touched

    @classmethod
    def open(cls, folder: str | Path, prefix: str = "") -> Checkpoint:
        """Index `folder`'s weights. CheckpointError names the file when one is missing or corrupt.

        A folder whose safetensors files have not changed (names, sizes, modification times) is
        indexed once per process: a worker reads its reference tensors one at a time.
        """
        folder = Path(folder)
        files = sorted(folder.glob(f"{prefix}*.safetensors"))
        if files:
            try:
                indexes = sorted(folder.glob(f"{prefix}*.safetensors.index.json"))
                signature = (str(folder.resolve()), prefix, tuple(map(file_version, files + indexes)))
            except OSError:
                signature = None
            with _OPENED_LOCK:  # the dashboard's sessions open checkpoints from several threads
                cached = _OPENED.get(signature) if signature is not None else None
            if cached is not None:
                return cached
            opened = cls._open_safetensors(folder, prefix, files)
            if signature is not None:
                with _OPENED_LOCK:
                    if len(_OPENED) >= 8:
                        _OPENED.pop(next(iter(_OPENED)))
                    _OPENED[signature] = opened
            return opened
        return cls._open_bin(folder, prefix)

    @classmethod
    def _open_safetensors(cls, folder: Path, prefix: str, files: list[Path]) -> Checkpoint:
        indexed = _index_shards(folder, prefix)
        if indexed is not None:
            missing = sorted(set(indexed.values()) - {f.name for f in files})
            if missing:
                raise CheckpointError(
                    f"{folder}: the shard index names {', '.join(missing)}, which the folder does not hold"
                )
            files = [f for f in files if f.name in set(indexed.values())]
        tensors: dict[str, TensorInfo] = {}
        for f in files:
            tensors.update(_parse_header(f))
        return cls(folder, tensors, {})

    @classmethod
    def _open_bin(cls, folder: Path, prefix: str) -> Checkpoint:
        bins = sorted(folder.glob(f"{prefix}*.bin"))
        if bins:
            pickled: dict[str, torch.Tensor] = {}
            for f in bins:
                try:
                    state = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
                except Exception as e:
                    raise CheckpointError(f"{f}: not a loadable weights-only checkpoint ({e})") from e
                if not isinstance(state, dict):
                    raise CheckpointError(f"{f}: holds a {type(state).__name__}, not a dict of tensors")
                pickled.update({k: v for k, v in state.items() if isinstance(v, torch.Tensor)})
            infos = {
                k: TensorInfo(k, f, v.dtype, tuple(v.shape), 0, v.numel() * v.element_size())
                for k, v in pickled.items()
            }
            return cls(folder, infos, pickled)
        raise CheckpointError(f"{folder}: no {prefix}*.safetensors or {prefix}*.bin weights found")

    def names(self) -> list[str]:
        """Every tensor name, in file order."""
        return list(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def info(self, name: str) -> TensorInfo:
        """Where `name` lives; KeyError naming the folder when the checkpoint has no such tensor."""
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"{self.folder}: no tensor {name!r} in the checkpoint") from None

    @property
    def nbytes(self) -> int:
        """The bytes of every tensor (what the checkpoint weighs without headers)."""
        return sum(t.nbytes for t in self._tensors.values())

    def read(self, name: str, scratch: bool = False) -> torch.Tensor:
        """The whole tensor `name`, as stored (dtype and values untouched), in a fresh CPU tensor.

        `scratch`: in one buffer this checkpoint keeps (as large as its largest tensor) instead, which
        the next scratch read overwrites: for a reference used once and dropped (a worker reads every
        tensor of a model once), it costs no fresh memory and no page faults per tensor.
        """
        info = self.info(name)
        if self._pickled:
            return self._pickled[name].clone()
        if scratch and info.nbytes:
            if self._scratch is None:
                self._scratch = torch.empty(max(t.nbytes for t in self._tensors.values()), dtype=torch.uint8)
            out = self._scratch[: info.nbytes].view(info.dtype).view(info.shape)
        else:
            out = torch.empty(info.shape, dtype=info.dtype)
        if info.nbytes:
            _read_into(info.file, info.start, out)
        return out

    def read_flat(self, name: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened tensor `name`, as stored.

        `out`, when given, is a reusable 1-D buffer of the tensor's dtype with at least
        ``stop - start`` elements; the result is a view of it.
        """
        info = self.info(name)
        if not 0 <= start <= stop <= info.numel:
            raise IndexError(f"{name}: elements [{start}, {stop}) outside 0..{info.numel}")
        if self._pickled:
            return self._pickled[name].reshape(-1)[start:stop]
        n = stop - start
        buf = torch.empty(n, dtype=info.dtype) if out is None else out[:n]
        if n:
            _read_into(info.file, info.start + start * info.dtype.itemsize, buf)
        return buf

    def iter_flat(self, name: str, chunk_elems: int) -> Iterator[tuple[int, torch.Tensor]]:
        """``(start, chunk)`` over the flattened tensor, `chunk_elems` at a time, one reused buffer."""
        info = self.info(name)
        buf = torch.empty(min(chunk_elems, info.numel), dtype=info.dtype)
        for start in range(0, info.numel, chunk_elems):
            yield start, self.read_flat(name, start, min(start + chunk_elems, info.numel), out=buf)

    def files(self) -> list[Path]:
        """The weight files behind this checkpoint."""
        return sorted({t.file for t in self._tensors.values()})


# Checkpoints indexed in this process, by folder, prefix and their files' signatures.
_OPENED: dict[tuple, Checkpoint] = {}
_OPENED_LOCK = threading.Lock()


def release_scratch() -> None:
    """Free every scratch buffer (`Checkpoint.read(scratch=True)`) of the checkpoints indexed here: a
    worker calls it when it is done reading one model's references, so the buffer does not add to
    what it holds afterwards."""
    with _OPENED_LOCK:
        for checkpoint in _OPENED.values():
            checkpoint._scratch = None


def _index_shards(folder: Path, prefix: str) -> dict[str, str] | None:
    """tensor → shard file name from ``<prefix>*.safetensors.index.json``, or None when there is none."""
    indexes = sorted(folder.glob(f"{prefix}*.safetensors.index.json"))
    if not indexes:
        return None
    path = indexes[0]
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable shard index ({e})") from e
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(
            f"{path}: not a shard index (expected an object with a 'weight_map' of file names)"
        )
    # Only plain file names: an index must not point outside its folder.
    bad = [v for v in weight_map.values() if os.path.basename(v) != v]
    if bad:
        raise CheckpointError(f"{path}: shard names must be plain file names, not {bad[0]!r}")
    return weight_map


def base_bytes(spec) -> int | None:
    """The run's base checkpoint's weight bytes; None for a hub id, or weights transformers finds elsewhere
    (callers take it as large)."""
    try:
        return Checkpoint.open(spec.base.path).nbytes
    except CheckpointError:
        return None


def keeps_tensors(spec) -> bool:
    """Whether this run keeps compared tensors whole: asked for, or a base model up to KEEP_TENSORS_UP_TO."""
    from core.spec import KEEP_TENSORS_UP_TO

    size = base_bytes(spec)
    return spec.keep_tensors or (size is not None and size <= KEEP_TENSORS_UP_TO)


# ---------------------------------------------------------------------------------------------
# What a model or adapter folder's files say, for the loaders (core.models.loading)


class LoadError(RuntimeError):
    """A model or adapter that cannot be loaded, with a one-line reason for the user."""


def _quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def load_config(model: ModelRef):
    """The model's transformers config; LoadError when the folder or hub id gives none."""
    import transformers

    _quiet_transformers()
    try:
        return transformers.AutoConfig.from_pretrained(
            model.path, revision=model.revision, trust_remote_code=model.trust_remote_code
        )
    except Exception as e:
        raise LoadError(f"{model.path}: not a model folder or reachable hub id ({exception_gist(e)})") from e


def read_checkpoint(
    folder: str | Path, prefix: str = "", names: Collection[str] | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of a model or adapter folder (or only `names`), as stored (dtype and values untouched).

    Through `core.models.checkpoint.Checkpoint`: safetensors (one file or shards) read tensor by tensor,
    so asking for a few names costs their bytes only; `.bin` only with `weights_only=True`.
    Raises LoadError naming the file when it is missing, truncated or corrupt.
    """
    try:
        checkpoint = Checkpoint.open(folder, prefix=prefix)
        wanted = checkpoint.names() if names is None else [n for n in checkpoint.names() if n in names]
        return {name: checkpoint.read(name) for name in wanted}
    except CheckpointError as e:
        raise LoadError(str(e)) from e


def adapters_task_type(adapters: Collection[AdapterRef]) -> str | None:
    """The task head the adapters were trained with (PEFT `task_type`); None when none names one.

    Every adapter of a run sits on one base model, so they must agree; LoadError when they do not.
    """
    kinds = {a.name: read_adapter_config(a).get("task_type") for a in adapters}
    named = {k for k in kinds.values() if k}
    if len(named) > 1:
        by = ", ".join(f"{n}: {k}" for n, k in kinds.items() if k)
        raise LoadError(
            f"the adapters were trained with different task heads ({by}); they cannot share one base"
        )
    return next(iter(named), None)


def saved_head_labels(config, cls: type, adapters: Collection[AdapterRef]) -> int | None:
    """The label count of the classifier head the adapters save whole (``modules_to_save``), where it
    differs from the config's `num_labels`; None where it does not, or the saved heads do not say.

    A base checkpoint without a head (an encoder saved bare) gets a fresh head of the config's
    `num_labels` (2 by default), which the saved head of a classifier trained with 5 labels does not
    fit. The count is read from the saved tensors' shapes where they differ from the fresh head's (built
    on the meta device, no memory) in a dimension of size `num_labels`.
    """
    from core.methods.adapter_keys import saved_module_names, split_saved_module_key

    labels = getattr(config, "num_labels", None)
    saved = {a: saved_module_names(read_adapter_config(a)) for a in adapters}
    if labels is None or not any(saved.values()):
        return None
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            shapes = {n: tuple(t.shape) for n, t in cls(config).state_dict().items()}
    except Exception:  # a class that cannot be built bare (remote code): the load goes on as configured
        return None
    found = set()
    for adapter, names in saved.items():
        if not names:
            continue
        try:
            checkpoint = Checkpoint.open(adapter.path, prefix="adapter_model")
        except CheckpointError:  # the adapter's own load says what is wrong with it
            continue
        for key in checkpoint.names():
            split = split_saved_module_key(key, names)
            fresh = shapes.get(f"{split[0]}.{split[1]}") if split else None
            stored = tuple(checkpoint.info(key).shape)
            if fresh is None or len(fresh) != len(stored):
                continue
            found |= {s for f, s in zip(fresh, stored, strict=True) if f != s and f == labels}
    return found.pop() if len(found) == 1 else None


# Set by `load_base` on the model: the loaded names of the tensors its checkpoint lacks.
NOT_IN_CHECKPOINT = "weightdrift_not_in_checkpoint"


# A float64 model may cost this much more memory than its checkpoint before it is held in the
# checkpoint's dtype and upcast one block at a time instead (a 1B float32 model needs 8 GB in float64).
FLOAT64_HEADROOM = 1 << 30


def float64_offload_dtype(model: ModelRef) -> torch.dtype | None:
    """The dtype to hold a float64 target's model in, when float64 does not fit; None when it does.

    Float64 fits when it costs at most FLOAT64_HEADROOM more than the checkpoint. Otherwise the
    model is held in the checkpoint's widest floating dtype (widening its values to float64 later is
    exact, so the forward computes on the very float64 weights a float64 load would have).
    """
    try:
        checkpoint = Checkpoint.open(model.path)
    except CheckpointError:
        return None  # a hub id: transformers loads it; no index to size it from here
    floating = [checkpoint.info(n) for n in checkpoint.names() if checkpoint.info(n).dtype.is_floating_point]
    if not floating:
        return None
    as_float64 = sum(t.numel * 8 for t in floating)
    if as_float64 <= checkpoint.nbytes + FLOAT64_HEADROOM:
        return None
    return max((t.dtype for t in floating), key=lambda d: d.itemsize)


# What a JSON value is called in a message ("holds a JSON list"), by its Python type.
_JSON_KINDS = {
    list: "list",
    str: "string",
    int: "number",
    float: "number",
    bool: "true/false",
    type(None): "null",
}


def read_json_object(path: Path, owner: str, holds: str) -> dict[str, Any]:
    """The JSON object in `path`; InputError naming `owner` and the file when it is not one.

    `holds` says what the object should hold, for the message (e.g. "the model's settings").
    """
    try:
        value = json.loads(path.read_bytes())
    except OSError as e:
        raise InputError(f"{owner}: {path.name} cannot be read ({e.strerror or e})") from e
    except ValueError as e:  # not JSON, or not UTF-8 text
        raise InputError(f"{owner}: {path.name} is not valid JSON ({e})") from e
    if not isinstance(value, dict):
        kind = _JSON_KINDS.get(type(value), type(value).__name__)
        raise InputError(f"{owner}: {path.name} holds a JSON {kind}; expected a JSON object of {holds}")
    return value


@functools.cache
def peft_types() -> tuple[str, ...]:
    """Every `peft_type` the installed PEFT can load (the values of its `PeftType`)."""
    from peft import PeftType

    return tuple(t.value for t in PeftType)


def check_adapter_config(adapter: AdapterRef, known_to_peft: bool = True) -> dict[str, Any]:
    """The adapter's `adapter_config.json`, which must be a JSON object naming a PEFT method PEFT knows.

    PEFT looks `peft_type` up as written (`LORA`, not `lora`), so the same spelling is required here.
    `known_to_peft=False`: the JSON object alone, for a compare reading the settings of adapters its
    captures loaded (asking PEFT imports it, transformers with it: ~4 CPU-s a compare needs for nothing
    else). The object is read once per version of the file and shared: callers read it, never change it.
    """
    config_path = adapter_folder(adapter) / "adapter_config.json"
    owner = f"adapter {adapter.name} ({adapter.path})"
    try:
        version = file_version(config_path)
    except OSError:  # read_json_object says why
        config = read_json_object(config_path, owner, _ADAPTER_SETTINGS)
    else:
        config = _adapter_settings(str(config_path), version, owner)
    if not known_to_peft:
        return config
    known = peft_types()
    if config.get("peft_type") in known:
        return config
    # the message only: reading a package's version parses its metadata (~1 ms, for every tensor's row)
    expected = f"one of {', '.join(known)} (the methods PEFT {metadata.version('peft')} loads)"
    if "peft_type" not in config:
        raise InputError(f"{owner}: adapter_config.json has no peft_type field; expected {expected}")
    raise InputError(
        f"{owner}: adapter_config.json field peft_type is {json.dumps(config['peft_type'])[:80]}; "
        f"expected {expected}"
    )


_ADAPTER_SETTINGS = "the adapter's settings, as PEFT saves them"


@functools.lru_cache(maxsize=1024)
def _adapter_settings(path: str, version: tuple[str, int, int], owner: str) -> dict[str, Any]:
    """`check_adapter_config`'s read of one version (`file_version`) of a file: the weights check
    asks for its adapter's settings at every tensor's row, thousands of times a run."""
    return read_json_object(Path(path), owner, _ADAPTER_SETTINGS)


def read_adapter_config(adapter: AdapterRef, known_to_peft: bool = True) -> dict:
    """The adapter's `adapter_config.json` as `check_adapter_config` reads it, for the loaders: LoadError
    saying what is wrong."""
    try:
        return check_adapter_config(adapter, known_to_peft)
    except InputError as e:
        raise LoadError(str(e)) from e


def is_pissa(adapter_config: dict) -> bool:
    init = adapter_config.get("init_lora_weights")
    return isinstance(init, str) and init.lower().startswith("pissa")


def float32_only_init(adapter_config: dict) -> str | None:
    """ "PiSSA" or "OLoRA" for a LoRA whose init PEFT runs on the base weight in float32 at most (an SVD,
    a QR: it refuses a float64 base), else None."""
    init = adapter_config.get("init_lora_weights")
    if is_pissa(adapter_config):
        return "PiSSA"
    return "OLoRA" if isinstance(init, str) and init.lower() == "olora" else None


def exception_gist(e: BaseException) -> str:
    """The gist of an exception in one line; a line ending in ':' takes the next one along."""
    lines = [ln.strip() for ln in (str(e).strip() or type(e).__name__).splitlines() if ln.strip()]
    text = lines[0]
    if text.endswith(":") and len(lines) > 1:
        text = f"{text} {lines[1]}"
    return text[:400]
