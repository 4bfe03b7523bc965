"""The hashes of what loading reads as a model: a checkpoint folder's weight files, its configs by their
fields (paths normalised) and its tokenizer files. A snapshot carries them, so that only captures of
the same base and adapters meet (`core.engine.snapshot`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from core.spec import AdapterRef, ModelRef

HASHED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
HASHED_NAMES = ("config.json", "adapter_config.json", "generation_config.json")
TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
TOKENIZER_NAMES += ("vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model")
# How the checkpoint hashes are taken (`CheckpointHashes.version`). 1: the files above as bytes, no
# tokenizer files; an adapter_config.json names its base by absolute path, so the same adapter saved in
# another home hashed differently. 2: tokenizer files too, and each JSON config by its fields with the
# fields that name a folder normalised (`config_hash`).
HASHING = 2
CONFIG_NAMES = (*HASHED_NAMES, "tokenizer_config.json")
# Config fields that name a folder: transformers' `_name_or_path` / `name_or_path`, PEFT's base model.
PATH_FIELDS = ("base_model_name_or_path", "_name_or_path", "name_or_path")


class HashingReader:
    """A reader that hashes (xxh3-128) and counts every byte read through it."""

    def __init__(self, f: BinaryIO):
        import xxhash

        self.f, self.n, self.h = f, 0, xxhash.xxh3_128()

    def read(self, k: int = -1) -> bytes:
        block = self.f.read(k)
        self.h.update(block)
        self.n += len(block)
        return block

    def drain(self, chunk: int = 1 << 24) -> str:
        """Read the rest, a chunk at a time; the hash of everything read."""
        while self.read(chunk):
            pass
        return self.h.hexdigest()


def file_hash(path: Path) -> str:
    """xxh3-128 of a file's bytes, read a chunk at a time (a 1B model's shards are GBs)."""
    with open(path, "rb") as f:
        return HashingReader(f).drain()


def folder_hashes(
    folder: str, base: tuple[Path, str] | None = None, version: int = HASHING
) -> dict[str, str] | None:
    """{file name: xxh3-128} of the files loading reads in a model or adapter folder; None when the
    folder is not here (a hub id): such a model cannot be proven the same, so it cannot be compared.
    `base`: the run's base folder and its hashes' digest, for the configs that name it (`config_hash`);
    `version`: how to hash (`HASHING`; 1 for a snapshot made before it)."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        return None
    names = HASHED_NAMES + (TOKENIZER_NAMES if version >= 2 else ())
    return {
        f.name: config_hash(f, base) if version >= 2 and f.name in CONFIG_NAMES else file_hash(f)
        for f in sorted(path.iterdir())
        if f.is_file() and (f.suffix in HASHED_SUFFIXES or f.name in names)
    }


def hashes_digest(hashes: dict[str, str]) -> str:
    """One xxh3-128 for a folder's file hashes (`folder_hashes`): what a config naming it is normalised to."""
    import xxhash

    return xxhash.xxh3_128(json.dumps(hashes, sort_keys=True).encode()).hexdigest()


def config_hash(path: Path, base: tuple[Path, str] | None = None) -> str:
    """xxh3-128 of a JSON config's fields (keys sorted, whitespace ignored) with each field that names a
    folder (`PATH_FIELDS`) normalised: its own folder to ".", the base's (`base`: the base folder and
    `hashes_digest` of its files) to that digest, so the same files saved in two homes hash the same.
    Another value (a hub id, a folder not here) stays as written; a file that is not a JSON object
    hashes as bytes."""
    import xxhash

    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return file_hash(path)
    if not isinstance(doc, dict):
        return file_hash(path)
    for key in PATH_FIELDS:
        value = doc.get(key)
        if not isinstance(value, str) or not value:
            continue
        named = Path(value).expanduser()
        if not named.is_dir():
            continue
        named = named.resolve()
        if named == path.parent.resolve():
            doc[key] = "."
        elif base is not None and named == base[0]:
            doc[key] = f"the base model, files {base[1]}"
    return xxhash.xxh3_128(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class CheckpointHashes:
    """The hashes of the base's and each adapter's files, by adapter name."""

    base: dict[str, str] | None
    adapters: dict[str, dict[str, str] | None]
    version: int = HASHING  # how they were taken (`HASHING`)

    @staticmethod
    def of(base: ModelRef, adapters: Sequence[AdapterRef], version: int = HASHING) -> CheckpointHashes:
        """Hash the files of `base` and `adapters` as they are on this machine now (`version`: the way a
        snapshot to compare with took its hashes)."""
        base_hashes = folder_hashes(base.path, version=version)
        anchor = None
        if base_hashes is not None:
            anchor = (Path(base.path).expanduser().resolve(), hashes_digest(base_hashes))
        return CheckpointHashes(
            base=base_hashes,
            adapters={a.name: folder_hashes(a.path, anchor, version) for a in adapters},
            version=version,
        )

    def to_dict(self) -> dict[str, Any]:
        """As stored in a snapshot's manifest."""
        return {"base": self.base, "adapters": self.adapters, "version": self.version}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> CheckpointHashes:
        """Read back `to_dict`'s form (a snapshot made before `version` hashed the version-1 way)."""
        return CheckpointHashes(
            base=d.get("base"), adapters=dict(d.get("adapters") or {}), version=int(d.get("version", 1))
        )

    def difference(self, other: CheckpointHashes) -> str | None:
        """Why `other` is not the same base and adapters (None when it is), in words."""
        if self.version != other.version:
            return (
                "their checkpoint files were hashed by different versions of WeightDrift (configs as bytes, "
                "or by their fields): make the older snapshot again with this version"
            )
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
