"""Memory per device index at each load stage, and where every parameter and buffer lives.

Pure pieces of the `memory` check (core/checks/memory.py), each testable on its own:

- sampling: the process's RSS (psutil), and per CUDA index PyTorch's allocator figures
  (`memory_allocated`, `memory_reserved`), the driver's view of this process on that device
  (NVML through `nvidia-ml-py`, which also counts the CUDA context the allocator does not see)
  and whether the device has a CUDA context (the driver API's primary-context state, which
  asks without creating one). Without a GPU, or without NVML, those values are None and
  `CudaProbe.notes` says why.
- the placement map: one record per parameter and buffer with its device *with index*,
  dtype and bytes, the layer (module) it belongs to, its role and its adapter.
- aggregations: module × device bytes, and per adapter the devices PEFT's
  `get_layer_status()` reports (types only) next to the devices with their indices.
- flag rules on timeline and placement records: stray device, leak after cleanup, mixed
  placement inside one layer.

Timeline records have the columns of `memory_timeline.parquet` (TIMELINE_COLUMNS); placement
records those of `placement.parquet` (PLACEMENT_COLUMNS) followed by a few extra ones.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: a worker samples its own start before any heavy import
    import pandas as pd

TIMELINE_COLUMNS = ("stage", "order", "device", "allocated", "reserved", "driver_used", "rss", "context")
PLACEMENT_COLUMNS = ("name", "module", "role", "adapter", "device", "dtype", "bytes")
# Extra placement columns (after the required ones): what kind of tensor, its size, the name it
# shares storage with (tied weights count once, on the first name), and PEFT's own device view.
PLACEMENT_EXTRA = ("kind", "layer", "numel", "shared_with", "layer_status")

# Stage names, in the order a load goes through them (adapter stages are per adapter).
PROCESS_START = "process start"
IMPORT_TORCH = "import torch"
IMPORT_LIBS = "import transformers, peft"
BASE_LOADED = "base loaded"
FIRST_FORWARD = "first forward"
MERGED = "merged"
CLEANED_UP = "unloaded and cleaned up"

# Samples a worker process takes of itself before its task starts (process start, after importing
# torch), for the memory timeline; empty where tasks run in a process that existed before.
PROCESS_SAMPLES: list[dict[str, Any]] = []

PEFT_PREFIX = "base_model.model."
# Path parts that hold the wrapped base module inside a PEFT layer (its parameters are base).
BASE_HOLDERS = ("base_layer", "original_module")

FLAG_RULES = ("stray device", "leak", "mixed placement", "forward failed", "merge failed")


def adapter_stage(name: str) -> str:
    """The stage after adapter `name` was loaded."""
    return f"adapter {name} loaded"


def base_again_stage(adapter: str) -> str:
    """The stage after a fresh base was loaded for `adapter` (PEFT cannot stack its type on the last)."""
    return f"base loaded again for {adapter}"


def stage_names(adapters: Iterable[str]) -> list[str]:
    """Every stage a memory run samples, in order (process start and import torch come from
    the worker process itself)."""
    return [
        PROCESS_START,
        IMPORT_TORCH,
        IMPORT_LIBS,
        BASE_LOADED,
        *(adapter_stage(a) for a in adapters),
        FIRST_FORWARD,
        MERGED,
        CLEANED_UP,
    ]


# ---------------------------------------------------------------------------------------------
# Sampling


def rss_bytes() -> int:
    """The resident set size of this process, in bytes."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def sample_process(stage: str) -> None:
    """This process's RSS now, as stage `stage`, into PROCESS_SAMPLES (the memory check reads them)."""
    PROCESS_SAMPLES.append({"stage": stage, "time": time.time(), "rss": rss_bytes()})


def normalize_device(device: str) -> str:
    """`cuda` (PEFT's bare inference, the current device) → `cuda:0`; others unchanged."""
    return "cuda:0" if device == "cuda" else device


def _uuid_text(raw: bytes) -> str:
    """The driver API's 16 uuid bytes in NVML's spelling: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`."""
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


class CudaProbe:
    """Per CUDA index: allocator figures, the driver's figure for this process, and whether
    a CUDA context exists, each read without creating a context.

    CUDA indices here are the ones PyTorch uses (after CUDA_VISIBLE_DEVICES). They are mapped
    to NVML devices by UUID, since NVML numbers devices in PCI order and ignores
    CUDA_VISIBLE_DEVICES. Whatever is missing (no libcuda, no NVML, the driver does not list
    this process's pid, as in some containers) reads None, and `notes` says so once.
    """

    def __init__(self) -> None:
        self.notes: list[str] = []
        self._cuda: Any = None  # libcuda handle once cuInit succeeded
        self._nvml: Any = None  # the pynvml module once nvmlInit succeeded
        self._nvml_handles: dict[int, Any] = {}
        self._count = self._device_count()
        if self._count:
            self._init_driver()
            self._init_nvml()

    @property
    def indices(self) -> list[int]:
        """The CUDA device indices this process can see (empty without CUDA)."""
        return list(range(self._count))

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def _device_count(self) -> int:
        try:
            import torch

            # is_available/device_count ask the runtime for the count; neither creates a context.
            return torch.cuda.device_count() if torch.cuda.is_available() else 0
        except Exception as e:  # a broken driver install must not break a CPU run
            self._note(f"CUDA not usable here ({e}); no GPU figures")
            return 0

    def _init_driver(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            if lib.cuInit(0) != 0:
                raise OSError("cuInit failed")
            self._cuda = lib
        except OSError as e:
            self._note(f"CUDA driver API not available ({e}): which devices have a context is unknown")

    def _init_nvml(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as e:
            self._note(f"NVML not available ({e}): the driver's per-process figure is unknown")
            return
        self._nvml = pynvml
        by_uuid = {}
        try:
            for n in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(n)
                uuid = pynvml.nvmlDeviceGetUUID(handle)
                by_uuid[uuid.decode() if isinstance(uuid, bytes) else uuid] = handle
        except Exception as e:
            self._note(f"NVML could not list devices ({e})")
        for index in self.indices:
            uuid = self._uuid(index)
            if uuid in by_uuid:
                self._nvml_handles[index] = by_uuid[uuid]
            elif uuid is None and len(by_uuid) == self._count and "CUDA_VISIBLE_DEVICES" not in os.environ:
                # Without the driver API's UUIDs, the order is the same only when nothing is hidden.
                self._nvml_handles[index] = list(by_uuid.values())[index]
            else:
                self._note(f"cuda:{index} has no NVML device with the same UUID (MIG?): no driver figure")

    def _uuid(self, index: int) -> str | None:
        if self._cuda is None:
            return None
        dev = ctypes.c_int()
        raw = (ctypes.c_char * 16)()
        if self._cuda.cuDeviceGet(ctypes.byref(dev), index) != 0:
            return None
        if self._cuda.cuDeviceGetUuid(raw, dev) != 0:
            return None
        return _uuid_text(bytes(raw))

    def context(self, index: int) -> bool | None:
        """Whether device `index` has an active primary context (PyTorch's) in this process."""
        if self._cuda is None:
            return None
        dev = ctypes.c_int()
        flags, active = ctypes.c_uint(), ctypes.c_int()
        if self._cuda.cuDeviceGet(ctypes.byref(dev), index) != 0:
            return None
        if self._cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) != 0:
            return None
        return bool(active.value)

    def driver_used(self, index: int, context: bool | None = None) -> int | None:
        """This process's memory on device `index` as the driver reports it (context included)."""
        handle = self._nvml_handles.get(index)
        if handle is None:
            return None
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception as e:
            self._note(f"NVML could not list processes ({e})")
            return None
        pid = os.getpid()
        for p in procs:
            if p.pid == pid:
                used = p.usedGpuMemory
                return None if used is None else int(used)
        if procs and context:
            # Our context exists but the driver names other pids: a container's pid namespace.
            self._note("the driver does not list this process's pid (container?): no driver figure")
            return None
        return 0

    def allocated(self, index: int) -> int:
        import torch

        # Both read 0 before CUDA is initialised, without initialising it.
        return int(torch.cuda.memory_allocated(index))

    def reserved(self, index: int) -> int:
        import torch

        return int(torch.cuda.memory_reserved(index))


def timeline_record(
    stage: str,
    order: int,
    device: str,
    *,
    allocated: int | None = None,
    reserved: int | None = None,
    driver_used: int | None = None,
    rss: int | None = None,
    context: bool | None = None,
) -> dict[str, Any]:
    """One row of the timeline (the columns of `memory_timeline.parquet`)."""
    return {
        "stage": stage,
        "order": order,
        "device": device,
        "allocated": allocated,
        "reserved": reserved,
        "driver_used": driver_used,
        "rss": rss,
        "context": context,
    }


@dataclass
class StageSampler:
    """Samples every device at each stage and keeps the records in stage order.

    `probe` is None on a machine without CUDA (then only the CPU's RSS is recorded); tests
    pass a fake probe. `rss` reads the process's RSS (injectable for tests).
    """

    probe: CudaProbe | None = None
    rss: Callable[[], int] = rss_bytes
    records: list[dict[str, Any]] = field(default_factory=list)
    stages: list[str] = field(default_factory=list)

    def add_process_samples(self, samples: Iterable[Mapping[str, Any]]) -> None:
        """The worker's own samples taken before the task started (RSS only: no GPU was touched)."""
        for s in samples:
            self._cpu(s["stage"], int(s["rss"]))

    def _cpu(self, stage: str, rss: int) -> int:
        order = len(self.stages)
        self.stages.append(stage)
        self.records.append(timeline_record(stage, order, "cpu", rss=rss))
        return order

    def sample(self, stage: str) -> None:
        """Record the CPU's RSS and every CUDA index's figures now, as stage `stage`."""
        order = self._cpu(stage, self.rss())
        if self.probe is None:
            return
        for index in self.probe.indices:
            context = self.probe.context(index)
            self.records.append(
                timeline_record(
                    stage,
                    order,
                    f"cuda:{index}",
                    allocated=self.probe.allocated(index),
                    reserved=self.probe.reserved(index),
                    driver_used=self.probe.driver_used(index, context),
                    context=context,
                )
            )


# ---------------------------------------------------------------------------------------------
# Placement map


def _split_name(name: str, adapters: set[str]) -> tuple[str, str, str | None]:
    """(module, role, adapter) of a parameter or buffer name of a base or PEFT model.

    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight` →
    (`model.layers.0.self_attn.q_proj`, `lora_A`, `default`);
    `….q_proj.base_layer.weight` → (`….q_proj`, `base`, None). `module` is the layer the
    tensor belongs to, the unit the mixed-placement rule looks inside.
    """
    path = name[len(PEFT_PREFIX) :] if name.startswith(PEFT_PREFIX) else name
    parts = path.split(".")
    for i, part in enumerate(parts[1:], start=1):
        if part in adapters and parts[i - 1] not in BASE_HOLDERS:
            return ".".join(parts[: i - 1]), parts[i - 1], part
    for i, part in enumerate(parts):
        if part in BASE_HOLDERS:
            return ".".join(parts[:i]), "base", None
    return ".".join(parts[:-1]), "base", None


def placement_map(
    model: Any, adapters: Iterable[str] = (), layer_status: Mapping[tuple[str, str], list[str]] | None = None
) -> list[dict[str, Any]]:
    """One record per parameter and buffer of `model`: where it lives and what it is.

    With `layer_status` (`peft_layer_devices(model)`), adapter tensors also carry what PEFT's
    `get_layer_status()` says about their layer and adapter (`layer_status`, device types).

    Tensors that share storage (tied weights) appear under each name; the first name carries
    the bytes, later ones carry 0 bytes and name the first in `shared_with`, so that sums are
    the memory the model really holds.
    """
    from core.models.conversion import layer_of

    names = set(adapters)
    seen: dict[tuple, str] = {}
    records = []
    tensors = [("parameter", n, t) for n, t in model.named_parameters(remove_duplicate=False)]
    tensors += [("buffer", n, t) for n, t in model.named_buffers(remove_duplicate=False)]
    for kind, name, t in tensors:
        module, role, adapter = _split_name(name, names)
        if kind == "buffer" and role == "base":
            role = "buffer"
        size = t.numel() * t.element_size()
        shared_with = None
        if t.numel() and t.device.type != "meta":
            storage = (str(t.device), t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if storage in seen:
                shared_with, size = seen[storage], 0
            else:
                seen[storage] = name
        records.append(
            {
                "name": name,
                "module": module,
                "role": role,
                "adapter": adapter,
                "device": str(t.device),
                "dtype": str(t.dtype).removeprefix("torch."),
                "bytes": size,
                "kind": kind,
                "layer": layer_of(name),
                "numel": t.numel(),
                "shared_with": shared_with,
                "layer_status": None
                if adapter is None or layer_status is None or (module, adapter) not in layer_status
                else ", ".join(layer_status[(module, adapter)]),
            }
        )
    return records


def peft_layer_devices(model: Any) -> dict[tuple[str, str], list[str]] | None:
    """Per (layer, adapter), the devices PEFT's own `get_layer_status()` reports: device
    *types* only (`cuda`, never `cuda:1`). Layers are named as in the placement map.

    None when the model is no PEFT model or PEFT cannot tell.
    """
    try:
        from peft.peft_model import get_layer_status

        status = get_layer_status(model)
    except Exception:
        return None
    out: dict[tuple[str, str], list[str]] = {}
    for layer in status:
        # get_layer_status names modules inside the tuner (`model.` + the base model's path).
        module = layer.name.removeprefix("model.")
        for adapter, devices in layer.devices.items():
            out[(module, adapter)] = sorted(devices)
    return out


def peft_devices(model: Any) -> dict[str, list[str]] | None:
    """Per adapter, the union of what `get_layer_status()` reports over its layers (types only)."""
    return peft_devices_from(peft_layer_devices(model))


def peft_devices_from(layers: Mapping[tuple[str, str], list[str]] | None) -> dict[str, list[str]] | None:
    """`peft_devices` from an already taken `peft_layer_devices` mapping."""
    if layers is None:
        return None
    merged: dict[str, set[str]] = {}
    for (_, adapter), devices in layers.items():
        merged.setdefault(adapter, set()).update(devices)
    return {a: sorted(d) for a, d in sorted(merged.items())}


# ---------------------------------------------------------------------------------------------
# Aggregations


def module_device_bytes(placement: pd.DataFrame, by: str = "module") -> pd.DataFrame:
    """Bytes per module (rows, in model order) × device (columns); 0 where nothing lives.

    `by="module"` uses the full layer path; `by="kind"` its last part (`q_proj`, …), summed
    over layers, for models too large to show layer by layer.
    """
    import pandas as pd

    if placement.empty:
        return pd.DataFrame()
    table = placement.assign(module=placement["module"].fillna("").replace("", "(root)"))
    if by == "kind":
        table = table.assign(module=table["module"].str.rsplit(".", n=1).str[-1])
    order = list(dict.fromkeys(table["module"]))
    grid = table.pivot_table(index="module", columns="device", values="bytes", aggfunc="sum", fill_value=0)
    grid = grid.reindex(order)
    grid = grid[sorted(grid.columns, key=device_sort_key)]
    grid.columns.name = "device"
    return grid.astype("int64")


def device_sort_key(device: str) -> tuple[int, str, int]:
    """cpu first, then cuda:0, cuda:1, … by index (not as text: cuda:10 after cuda:9)."""
    kind, _, index = str(device).partition(":")
    return (0 if kind == "cpu" else 1, kind, int(index) if index.isdigit() else -1)


def adapter_device_summary(
    placement: pd.DataFrame,
    peft: Mapping[str, list[str]] | None = None,
    requested: Iterable[str] | None = None,
) -> pd.DataFrame:
    """Per adapter: what `get_layer_status()` shows next to where its tensors really are.

    `peft` is `peft_devices(model)`; without it, the placement's `layer_status` column is used.
    Columns: adapter, get_layer_status (device types, PEFT's view), devices (with index),
    bytes_by_device, tensors, hidden: True where PEFT's view cannot show what is wrong (one
    type on several indices, or a device of the asked-for type but another index).
    """
    import pandas as pd

    columns = ["adapter", "get_layer_status", "devices", "bytes_by_device", "tensors", "hidden"]
    if placement.empty or "adapter" not in placement:
        return pd.DataFrame(columns=columns)
    asked = None if requested is None else {normalize_device(d) for d in requested}
    rows = []
    for adapter, group in placement[placement["adapter"].notna()].groupby("adapter", sort=True):
        per_device = group.groupby("device")["bytes"].sum()
        devices = sorted(per_device.index, key=device_sort_key)
        if peft is not None:
            status = peft.get(adapter)
        elif "layer_status" in group and group["layer_status"].notna().any():
            status = sorted({t for v in group["layer_status"].dropna() for t in str(v).split(", ") if t})
        else:
            status = None
        types = sorted({d.split(":")[0] for d in devices})
        hidden = len(devices) > len(types)
        if asked is not None:
            asked_types = {d.split(":")[0] for d in asked}
            hidden |= any(d not in asked and d.split(":")[0] in asked_types for d in devices)
        rows.append(
            {
                "adapter": adapter,
                "get_layer_status": ", ".join(status) if status is not None else "(not available)",
                "devices": ", ".join(devices),
                "bytes_by_device": ", ".join(f"{d}: {int(per_device[d])}" for d in devices),
                "tensors": len(group),
                "hidden": hidden,
            }
        )
    return pd.DataFrame(rows, columns=columns)


# ---------------------------------------------------------------------------------------------
# Flag rules


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


def _mib(n: float | None) -> str:
    return "?" if n is None or n != n else f"{n / 2**20:.1f} MiB"


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
        what = [f"{c} {_mib(rec.get(c))}" for c in ("allocated", "reserved", "driver_used") if rec.get(c)]
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

    Columns: device, baseline_stage, allocated, reserved, driver_used, rss (bytes after cleanup
    minus baseline; None where the figure is unknown). The base-load baseline is the stage
    right before BASE_LOADED (imports done); on CUDA the allocator figures should return to 0.
    """
    import pandas as pd

    table = pd.DataFrame(list(timeline))
    columns = ["device", "baseline_stage", "allocated", "reserved", "driver_used", "rss"]
    if table.empty or CLEANED_UP not in set(table["stage"]):
        return pd.DataFrame(columns=columns)
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
        for col in ("allocated", "reserved", "driver_used", "rss"):
            after = end.iloc[0][col]
            if after is None or after != after:
                row[col] = None
                continue
            base = 0 if start is None or start[col] is None or start[col] != start[col] else start[col]
            row[col] = int(after - base)
        rows.append(row)
    out = pd.DataFrame(rows, columns=columns)
    return out.iloc[sorted(range(len(out)), key=lambda i: device_sort_key(out["device"].iloc[i]))]


def leak_flags(leaks: pd.DataFrame) -> list[Flag]:
    """A CUDA device whose allocator still holds tensor memory after cleanup (tensors kept alive).

    RSS is reported, never flagged: the C allocator keeps freed pages and imported libraries
    stay loaded, so the CPU's figure does not return to its baseline even without a leak.
    """
    flags = []
    for row in leaks.to_dict(orient="records"):
        if row["device"] == "cpu":
            continue
        held = row.get("allocated")
        if held is not None and held == held and held > 0:
            flags.append(
                Flag(
                    rule="leak",
                    device=row["device"],
                    stage=CLEANED_UP,
                    explanation=(
                        f"{row['device']} still has {_mib(held)} allocated by tensors after del, "
                        f"gc.collect() and empty_cache() (reserved {_mib(row.get('reserved'))})"
                    ),
                )
            )
    return flags
