"""Devices that exist here, the numerics flags of a target, and environment provenance.

`apply_flags` changes process-global torch state: call it only inside a worker process
(or the in-process runner used by unit tests), never in the dashboard's server process.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any

from core.spec import SpecError, Target


@dataclass(frozen=True)
class Device:
    """One device this machine has, as torch sees it."""

    name: str  # "cpu", "cuda:0", "mps"
    kind: str
    description: str
    compute_capability: str | None = None
    sm_count: int | None = None
    total_memory: int | None = None


def discover_devices() -> list[Device]:
    """cpu, every cuda:N (name, capability, SM count, memory) and mps where present."""
    import torch

    devices = [Device(name="cpu", kind="cpu", description=cpu_model())]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            devices.append(
                Device(
                    name=f"cuda:{i}",
                    kind="cuda",
                    description=p.name,
                    compute_capability=f"{p.major}.{p.minor}",
                    sm_count=p.multi_processor_count,
                    total_memory=p.total_memory,
                )
            )
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices.append(Device(name="mps", kind="mps", description="Apple Metal"))
    return devices


def check_targets_exist(targets: list[Target] | tuple[Target, ...], devices: list[Device]) -> None:
    """Refuse targets on devices that do not exist, listing the ones that do."""
    names = {d.name for d in devices}
    missing = sorted({t.device for t in targets if t.device not in names})
    if missing:
        raise SpecError(
            f"device {', '.join(missing)} does not exist on this machine; available: {', '.join(sorted(names))}"
        )
    for t in targets:
        if t.tf32 and t.device_type != "cuda":
            raise SpecError(f"target {t}: tf32 applies to CUDA devices only")


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux, platform otherwise)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def apply_flags(target: Target) -> None:
    """Set the process-global numerics flags of `target` (worker processes only)."""
    import torch

    if target.threads is not None:
        torch.set_num_threads(target.threads)
    torch.backends.cuda.matmul.allow_tf32 = target.tf32
    torch.backends.cudnn.allow_tf32 = target.tf32
    if target.matmul_precision is not None:
        torch.set_float32_matmul_precision(target.matmul_precision)
    elif target.tf32:
        torch.set_float32_matmul_precision("high")
    else:
        torch.set_float32_matmul_precision("highest")
    if target.deterministic:
        # cuBLAS needs this workspace setting before its first use to be deterministic.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    else:
        torch.use_deterministic_algorithms(False)


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def environment(device: str | None = None) -> dict[str, Any]:
    """Provenance of the process it runs in: versions, numerics flags, CPU, GPU, OS."""
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "peft": _version("peft"),
        "safetensors": _version("safetensors"),
        "accelerate": _version("accelerate"),
        "cuda_runtime": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "num_threads": torch.get_num_threads(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "os": platform.platform(),
        "hostname": platform.node(),
        "device": device,
        "gpu_name": None,
        "gpu_capability": None,
        "gpu_sm_count": None,
        "gpu_memory": None,
        "driver": None,
    }
    if device and device.startswith("cuda") and torch.cuda.is_available():
        index = int(device.split(":")[1]) if ":" in device else 0
        p = torch.cuda.get_device_properties(index)
        env.update(
            gpu_name=p.name,
            gpu_capability=f"{p.major}.{p.minor}",
            gpu_sm_count=p.multi_processor_count,
            gpu_memory=p.total_memory,
            driver=_nvidia_driver(),
        )
    return env


def _nvidia_driver() -> str | None:
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
            first = f.readline()
        for token in first.split():
            if token[:1].isdigit() and "." in token:
                return token
    except OSError:
        pass
    return None


def devices_report() -> dict[str, Any]:
    """Devices and the environment of the calling process, for `python -m core devices`."""
    return {"devices": [asdict(d) for d in discover_devices()], "environment": environment()}


def devices_lines(info: dict[str, Any]) -> list[str]:
    """`devices_report` as the text `python -m core devices` prints."""
    lines = ["devices:"]
    for d in info["devices"]:
        extra = ""
        if d["kind"] == "cuda":
            extra = f" (capability {d['compute_capability']}, {d['sm_count']} SMs, {d['total_memory'] / 2**30:.1f} GiB)"
        lines.append(f"  {d['name']:8s} {d['description']}{extra}")
    lines.append("environment:")
    lines += [f"  {k:26s} {v}" for k, v in info["environment"].items()]
    return lines
