"""The memory check's flag rules on timeline and placement records: stray device, leak after cleanup,
mixed placement inside one layer."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from core.models.memory.placement import device_sort_key, normalize_device
from core.models.memory.sampling import BASE_LOADED, CLEANED_UP

if TYPE_CHECKING:
    import pandas as pd

FLAG_RULES = ("stray device", "leak", "mixed placement", "forward failed", "merge failed")
# What `leak_figures` gives per device: each figure after cleanup minus its baseline, and `tensors`,
# allocated less the library workspaces (the whole of allocated where a run did not tell them apart).
LEAK_COLUMNS = [
    "device",
    "baseline_stage",
    "allocated",
    "workspace",
    "tensors",
    "reserved",
    "driver_used",
    "rss",
]


@dataclass(frozen=True)
class Flag:
    """One finding: a rule that fired, where (device, stage, module) and why, in words."""

    rule: str  # one of FLAG_RULES
    device: str | None
    stage: str
    explanation: str
    module: str | None = None
    adapter: str | None = None
    tensor: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _uses_device(record: Mapping[str, Any]) -> bool:
    """Whether a CUDA timeline record shows anything on its device: memory or a context."""
    for col in ("allocated", "reserved", "driver_used"):
        v = record.get(col)
        if v is not None and v == v and v > 0:
            return True
    return bool(record.get("context"))


def _size(n: float | None) -> str:
    """Bytes in words: MiB from 1 MiB on, exact bytes below (a leak of a few KiB is no "0.0 MiB")."""
    if n is None or n != n:
        return "?"
    return f"{n / 2**20:.1f} MiB" if abs(n) >= 2**20 else f"{int(n):,} bytes"


def stray_devices(timeline: Iterable[Mapping[str, Any]], requested: Iterable[str]) -> list[Flag]:
    """Each CUDA index that holds memory or a context although no target asked for it, once,
    at the first stage (lowest `order`) where it appeared."""
    asked = {normalize_device(d) for d in requested}
    first: dict[str, Mapping[str, Any]] = {}
    for rec in sorted(timeline, key=lambda r: r["order"]):
        device = rec["device"]
        if device == "cpu" or device in asked or device in first:
            continue
        if _uses_device(rec):
            first[device] = rec
    flags = []
    for device, rec in sorted(first.items(), key=lambda kv: device_sort_key(kv[0])):
        what = [f"{c} {_size(rec.get(c))}" for c in ("allocated", "reserved", "driver_used") if rec.get(c)]
        if rec.get("context"):
            what.append("a CUDA context")
        flags.append(
            Flag(
                rule="stray device",
                device=device,
                stage=rec["stage"],
                explanation=(
                    f"{device} holds {', '.join(what)} from stage '{rec['stage']}' on, "
                    f"though only {', '.join(sorted(asked)) or 'the CPU'} was asked for"
                ),
            )
        )
    return flags


def stray_placement(
    placement: Iterable[Mapping[str, Any]], requested: Iterable[str], stage: str
) -> list[Flag]:
    """Per module, tensors that live on a device no target asked for (one flag per module and device)."""
    asked = {normalize_device(d) for d in requested}
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for rec in placement:
        if rec["device"] not in asked and rec["device"] != "meta":
            groups.setdefault((rec["module"], rec["device"]), []).append(rec)
    flags = []
    for (module, device), recs in groups.items():
        roles = ", ".join(dict.fromkeys(_role_label(r) for r in recs))
        adapters = {r["adapter"] for r in recs}
        flags.append(
            Flag(
                rule="stray device",
                device=device,
                stage=stage,
                module=module,
                adapter=next(iter(adapters)) if len(adapters) == 1 else None,
                tensor=recs[0]["name"] if len(recs) == 1 else None,
                explanation=(
                    f"{roles} of {module or '(root)'} on {device} ({sum(r['bytes'] for r in recs)} bytes), "
                    f"not on {', '.join(sorted(asked))} as asked"
                ),
            )
        )
    return flags


def _role_label(rec: Mapping[str, Any]) -> str:
    return rec["role"] if rec.get("adapter") is None else f"{rec['role']}[{rec['adapter']}]"


def mixed_placement(
    placement: Iterable[Mapping[str, Any]], stage: str, requested: Iterable[str] | None = None
) -> list[Flag]:
    """Each layer whose tensors live on more than one device (with index): a forward or merge
    through it mixes devices. With `requested`, devices nobody asked for are marked so."""
    asked = None if requested is None else {normalize_device(d) for d in requested}
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for rec in placement:
        if rec["device"] != "meta":
            groups.setdefault(rec["module"], []).append(rec)
    flags = []
    for module, recs in groups.items():
        devices = sorted({r["device"] for r in recs}, key=device_sort_key)
        if len(devices) < 2:
            continue
        where = "; ".join(
            f"{', '.join(dict.fromkeys(_role_label(r) for r in recs if r['device'] == d))} on {d}"
            + (" (not asked for)" if asked is not None and d not in asked else "")
            for d in devices
        )
        flags.append(
            Flag(
                rule="mixed placement",
                device=", ".join(devices),
                stage=stage,
                module=module,
                explanation=f"{module or '(root)'} spans {len(devices)} devices: {where}",
            )
        )
    return flags


def placement_flags(
    placement: Iterable[Mapping[str, Any]], requested: Iterable[str], stage: str
) -> list[Flag]:
    """Stray-device and mixed-placement flags of one placement map, one finding per layer: a layer
    split across devices is a mixed placement that names its stray part, not also a stray device."""
    records = list(placement)
    requested = list(requested)
    mixed = mixed_placement(records, stage, requested)
    split = {f.module for f in mixed}
    stray = [f for f in stray_placement(records, requested, stage) if f.module not in split]
    return stray + mixed


def leak_figures(timeline: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """Per device: what is still held after cleanup, against the last sample before the base load.

    Columns LEAK_COLUMNS (bytes after cleanup minus baseline; None where the figure is unknown). The
    baseline is the stage right before BASE_LOADED (imports done); on CUDA the tensor memory should
    return to it. Timelines recorded before library workspaces had a column of their own have no
    `workspace`: their tensors are all of allocated, as they were judged then.
    """
    import pandas as pd

    def known(value: Any) -> int | None:
        return None if value is None or pd.isna(value) else int(value)

    table = pd.DataFrame(list(timeline))
    if table.empty or CLEANED_UP not in set(table["stage"]):
        return pd.DataFrame(columns=LEAK_COLUMNS)
    end_order = table.loc[table["stage"] == CLEANED_UP, "order"].max()
    base_order = table.loc[table["stage"] == BASE_LOADED, "order"]
    rows = []
    for device, group in table.groupby("device", sort=False):
        end = group[group["order"] == end_order]
        before = group[group["order"] < (base_order.min() if len(base_order) else end_order)]
        if end.empty:
            continue
        start = before.loc[before["order"].idxmax()] if len(before) else None
        row: dict[str, Any] = {"device": device, "baseline_stage": None if start is None else start["stage"]}
        for col in ("allocated", "workspace", "reserved", "driver_used", "rss"):
            after = known(end.iloc[0].get(col))
            base = None if start is None else known(start.get(col))
            row[col] = None if after is None else after - (base or 0)
        allocated, workspace = row["allocated"], row["workspace"]
        row["tensors"] = None if allocated is None else allocated - (workspace or 0)
        rows.append(row)
    out = pd.DataFrame(rows, columns=LEAK_COLUMNS)
    return out.iloc[sorted(range(len(out)), key=lambda i: device_sort_key(out["device"].iloc[i]))]


def leak_flags(leaks: pd.DataFrame) -> list[Flag]:
    """A CUDA device whose allocator still holds tensor memory after cleanup (tensors kept alive).

    Library workspaces are no leak: cleanup releases them, and `tensors` leaves them out. RSS is
    reported, never flagged: the C allocator keeps freed pages and imported libraries stay loaded,
    so the CPU's figure does not return to its baseline even without a leak.
    """
    flags = []
    for row in leaks.to_dict(orient="records"):
        if row["device"] == "cpu":
            continue
        held = row.get("tensors")
        if held is not None and held == held and held > 0:
            flags.append(
                Flag(
                    rule="leak",
                    device=row["device"],
                    stage=CLEANED_UP,
                    explanation=(
                        f"{row['device']} still has {_size(held)} allocated by tensors after del, "
                        f"gc.collect() and empty_cache() (reserved {_size(row.get('reserved'))})"
                    ),
                )
            )
    return flags
