"""Memory samples of this process at each load stage: RSS, and per CUDA index PyTorch's allocator
figures, the driver's view of this process on that device and whether it has a CUDA context.

RSS comes from psutil; `memory_allocated`/`memory_reserved` from PyTorch; the driver's figure from
NVML (through `nvidia-ml-py`, which also counts the CUDA context the allocator does not see); the
context state from the driver API (asked without creating one). Without a GPU, or without NVML,
those values are None and `CudaProbe.notes` says why. Records have the columns of
`memory_timeline.parquet` (TIMELINE_COLUMNS).
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

TIMELINE_COLUMNS = ("stage", "order", "device", "allocated", "reserved", "driver_used", "rss", "context")
# Extra timeline columns (after the required ones): the part of `allocated` that library workspaces
# held at the sample (cuBLAS's and cuBLASLt's: torch keeps them per handle and stream, releases them
# together and by default shares one between the two). None on the CPU and where torch cannot tell.
TIMELINE_EXTRA = ("workspace",)

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


def rss_bytes() -> int:
    """The resident set size of this process, in bytes."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def sample_process(stage: str) -> None:
    """This process's RSS now, as stage `stage`, into PROCESS_SAMPLES (the memory check reads them)."""
    PROCESS_SAMPLES.append({"stage": stage, "time": time.time(), "rss": rss_bytes()})


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

    def release_workspaces(self) -> dict[int, int] | None:
        """Release PyTorch's library workspaces; per CUDA index, the allocated bytes that gave back.

        None where this torch cannot release them (then they stay counted as tensor memory).
        """
        before = {index: self.allocated(index) for index in self.indices}
        if not clear_library_workspaces():
            self._note(
                "this torch cannot release cuBLAS's workspace (no torch._C._cuda_clearCublasWorkspaces): "
                "it counts as tensor memory, after cleanup too"
            )
            return None
        return {index: before[index] - self.allocated(index) for index in self.indices}

    def allocated(self, index: int) -> int:
        import torch

        # Both read 0 before CUDA is initialised, without initialising it.
        return int(torch.cuda.memory_allocated(index))

    def reserved(self, index: int) -> int:
        import torch

        return int(torch.cuda.memory_reserved(index))


def clear_library_workspaces() -> bool:
    """Give back the workspaces PyTorch keeps for cuBLAS and cuBLASLt on every device (one per handle and
    stream, made by the first matmul there and otherwise kept to the process's end); False where this
    torch has no way to. cuDNN's workspace needs nothing: torch takes it per call and gives it back."""
    import torch

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return False
    if torch.cuda.is_initialized():  # before that none exists; asking would not create a context either
        clear()
    return True


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
    workspace: int | None = None,
) -> dict[str, Any]:
    """One row of the timeline (the columns of `memory_timeline.parquet`); `workspace` is the part of
    `allocated` that library workspaces held."""
    return {
        "stage": stage,
        "order": order,
        "device": device,
        "allocated": allocated,
        "reserved": reserved,
        "driver_used": driver_used,
        "rss": rss,
        "context": context,
        "workspace": workspace,
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
        allocated = {index: self.probe.allocated(index) for index in self.probe.indices}
        # Library workspaces are released at every sample, not only at cleanup, so that each stage shows
        # those its own work made (the first matmul, DoRA's weight norm, a forward, a merge) apart from
        # the tensors. That changes no number a check computes, and the next cuBLAS call takes its
        # workspace again from the allocator's cache (reserved does not move); `allocated` is read before,
        # as the process held it, so it lacks a workspace only at a stage that ran no matmul since the last.
        workspace = self.probe.release_workspaces()
        for index in self.probe.indices:
            context = self.probe.context(index)
            self.records.append(
                timeline_record(
                    stage,
                    order,
                    f"cuda:{index}",
                    allocated=allocated[index],
                    reserved=self.probe.reserved(index),
                    driver_used=self.probe.driver_used(index, context),
                    context=context,
                    workspace=None if workspace is None else workspace[index],
                )
            )
