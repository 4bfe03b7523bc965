"""Where every parameter and buffer of a model lives, and its sums per module and device.

One record per tensor (the columns of `placement.parquet`, PLACEMENT_COLUMNS, then a few extra ones)
with its device *with index*, dtype and bytes, the layer (module) it belongs to, its role and its
adapter; per adapter, the devices PEFT's `get_layer_status()` reports (types only) next to the
devices with their indices.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: a worker samples its own start before any heavy import
    import pandas as pd

PLACEMENT_COLUMNS = ("name", "module", "role", "adapter", "device", "dtype", "bytes")
# Extra placement columns (after the required ones): what kind of tensor, its size, the name it
# shares storage with (tied weights count once, on the first name), and PEFT's own device view.
PLACEMENT_EXTRA = ("kind", "layer", "numel", "shared_with", "layer_status")

PEFT_PREFIX = "base_model.model."
# Path parts that hold the wrapped base module inside a PEFT layer (its parameters are base).
BASE_HOLDERS = ("base_layer", "original_module")


def normalize_device(device: str) -> str:
    """`cuda` (PEFT's bare inference, the current device) → `cuda:0`; others unchanged."""
    return "cuda:0" if device == "cuda" else device


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
