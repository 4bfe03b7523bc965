"""Memory per device index at each load stage, and where every parameter and buffer lives.

Pure pieces of the `memory` check (core/checks/memory.py), each testable on its own, in three parts:

- `sampling`: the stages of a load and what is sampled at each (RSS; per CUDA index the allocator's
  figures, the driver's view of this process and whether a context exists);
- `placement`: the placement map (one record per parameter and buffer, its device with index) and
  its sums per module, device and adapter;
- `rules`: the flag rules on timeline and placement records (stray device, leak after cleanup,
  mixed placement inside one layer).

Callers use the names below from this package (`from core.models import memory`); the parts import
only the standard library at load, so a worker can sample its own start before any heavy import.
"""

from core.models.memory.placement import (
    BASE_HOLDERS,
    PEFT_PREFIX,
    PLACEMENT_COLUMNS,
    PLACEMENT_EXTRA,
    adapter_device_summary,
    device_sort_key,
    module_device_bytes,
    normalize_device,
    peft_devices,
    peft_devices_from,
    peft_layer_devices,
    placement_map,
)
from core.models.memory.rules import (
    FLAG_RULES,
    LEAK_COLUMNS,
    Flag,
    leak_figures,
    leak_flags,
    mixed_placement,
    placement_flags,
    stray_devices,
    stray_placement,
)
from core.models.memory.sampling import (
    BASE_LOADED,
    CLEANED_UP,
    FIRST_FORWARD,
    IMPORT_LIBS,
    IMPORT_TORCH,
    MERGED,
    PROCESS_SAMPLES,
    PROCESS_START,
    TIMELINE_COLUMNS,
    TIMELINE_EXTRA,
    CudaProbe,
    StageSampler,
    adapter_stage,
    base_again_stage,
    clear_library_workspaces,
    rss_bytes,
    sample_process,
    stage_names,
    timeline_record,
)

__all__ = [
    "BASE_HOLDERS",
    "BASE_LOADED",
    "CLEANED_UP",
    "FIRST_FORWARD",
    "FLAG_RULES",
    "LEAK_COLUMNS",
    "IMPORT_LIBS",
    "IMPORT_TORCH",
    "MERGED",
    "PEFT_PREFIX",
    "PLACEMENT_COLUMNS",
    "PLACEMENT_EXTRA",
    "PROCESS_SAMPLES",
    "PROCESS_START",
    "TIMELINE_COLUMNS",
    "TIMELINE_EXTRA",
    "CudaProbe",
    "Flag",
    "StageSampler",
    "adapter_device_summary",
    "adapter_stage",
    "base_again_stage",
    "clear_library_workspaces",
    "device_sort_key",
    "leak_figures",
    "leak_flags",
    "mixed_placement",
    "module_device_bytes",
    "normalize_device",
    "peft_devices",
    "peft_devices_from",
    "peft_layer_devices",
    "placement_map",
    "placement_flags",
    "rss_bytes",
    "sample_process",
    "stage_names",
    "stray_devices",
    "stray_placement",
    "timeline_record",
]
