"""What a user can pick from: the demo's default selection, recent bases, adapters that fit a base.

The dashboard's run form and the CLI's `--demo` both start from here, so the demo means the same
thing in both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from core.engine.store import RunRecord
from core.spec import AdapterRef, ModelRef

DEMO_BASE = "tiny-llama"
# The adapters a demo run loads by default: one per method. pissa_init/pissa_lora serve the
# adapter-consistency scenario, bert-lora belongs to the other base.
DEMO_ADAPTERS = ("lora", "dora", "pissa", "boft", "oft", "ia3")
DEMO_TARGETS = ("cpu/float32", "cpu/bfloat16")


@dataclass(frozen=True)
class AdapterChoice:
    """An adapter folder found on disk, with its method and whether it fits the base."""

    name: str
    path: str
    type: str
    fits: bool
    reason: str = ""  # why it does not fit, when it does not


def demo_selection(manifest: dict) -> tuple[str, list[AdapterRef]]:
    """The demo's default base path and adapters (one per method)."""
    adapters = [
        AdapterRef(path=a["path"], name=name)
        for name, a in manifest["adapters"].items()
        if a["base"] == DEMO_BASE and name in DEMO_ADAPTERS
    ]
    return manifest["models"][DEMO_BASE], adapters


def recent_bases(records: list[RunRecord], limit: int = 10) -> list[str]:
    """Base model paths or hub ids of stored runs (`Store.list_runs()`, newest first), each once."""
    seen: dict[str, None] = {}
    for record in records:
        if record.spec is not None:
            seen.setdefault(record.spec.base.path, None)
        if len(seen) >= limit:
            break
    return list(seen)


def recent_adapters(records: list[RunRecord], base: str) -> list[AdapterRef]:
    """Adapters used with `base` in stored runs (`Store.list_runs()`, newest first), each path once."""
    seen: dict[str, AdapterRef] = {}
    for record in records:
        if record.spec is not None and record.spec.base.path == base:
            for a in record.spec.adapters:
                seen.setdefault(a.path, a)
    return list(seen.values())


def find_adapters(
    base: str, extra_roots: list[Path] | tuple[Path, ...] = (), depth: int = 3
) -> list[AdapterChoice]:
    """Adapter folders next to a local base (its parent's tree) and under `extra_roots`.

    Each is checked against the base's tensor shapes (no model load), so the list says which ones
    fit; those made for another base come last with the reason.
    """
    from core.methods.adapter_keys import adapter_type
    from core.models.checkpoint import check_adapter_config
    from core.models.validate import InputError, validate_adapter, validate_model

    base_path = Path(base).expanduser()
    roots = [*extra_roots]
    try:
        if base_path.is_dir():
            grandparent = base_path.resolve().parent.parent
            if grandparent != Path(grandparent.anchor):  # never the whole file system
                roots.insert(0, grandparent)
    except OSError:
        pass
    try:
        shapes = validate_model(ModelRef(path=base))
    except InputError:
        shapes = None
    found: dict[str, AdapterChoice] = {}
    for root in roots:
        root = Path(root)
        if not root.is_dir():
            continue
        for config_path in sorted(_walk(root, "adapter_config.json", depth)):
            folder = config_path.parent
            key = str(folder.resolve())
            if key in found:
                continue
            ref = AdapterRef(path=str(folder), name=folder.name)
            try:
                kind = adapter_type(check_adapter_config(ref))
            except InputError:
                continue  # not an adapter config PEFT can load (a JSON list, an unknown peft_type, …)
            try:
                validate_adapter(ref, shapes, base)
                fits, reason = True, ""
            except InputError as e:
                fits, reason = False, str(e)
            found[key] = AdapterChoice(folder.name, str(folder), kind, fits, reason)
    return sorted(found.values(), key=lambda c: (not c.fits, c.name))


# At most this many folder entries are looked at per scan: a base typed as a top-level or system
# path must not make every form change walk a large tree.
SCAN_BUDGET = 5000


def _walk(root: Path, filename: str, depth: int, budget: list[int] | None = None):
    """Files named `filename` under `root`, `depth` levels down, skipping what cannot be read."""
    budget = [SCAN_BUDGET] if budget is None else budget
    if depth < 0 or budget[0] <= 0:
        return
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return
    for entry in entries:
        budget[0] -= 1
        if budget[0] < 0:
            return
        try:  # /proc, broken links, folders this user may not read: not adapters
            if entry.name == filename and entry.is_file():
                yield entry
            elif not entry.name.startswith(".") and entry.is_dir():
                yield from _walk(entry, filename, depth - 1, budget)
        except OSError:
            continue
