"""Devices that exist here, the numerics flags of a target, environment provenance, and a quantized
target's bitsandbytes layers.

Quantized bases (`DEVICE/nf4`, `DEVICE/fp4`, `DEVICE/int8`): a target means bitsandbytes' call with its
defaults; only what the target's flags name departs from them (`+compute=`, `+double_quant`, `+portable`).
Dequantization is PEFT's own (`dequantize_bnb_weight`), the one its merge runs, so a weight row reads
what merging starts from; a weight bitsandbytes has repacked for its fused CPU kernel is read from the
layout it is in. torch is imported where it is used: the CLI imports this module before its
first worker has started.

`apply_flags` changes process-global torch state: call it only inside a worker process
(or the in-process runner used by unit tests), never in the dashboard's server process.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any

from core.spec import SpecError, Target

if TYPE_CHECKING:
    import torch


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
        if t.portable and t.device_type != "cpu":
            raise SpecError(
                f"target {t}: portable applies to the CPU only (bitsandbytes' fused kernel is a CPU one)"
            )


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


# --- quantized targets (bitsandbytes) ---------------------------------------------------------


def quantization_config(target: Target):
    """`BitsAndBytesConfig` for a quantized target: `load_in_4bit` with its `bnb_4bit_quant_type`, or
    `load_in_8bit`, everything else at bitsandbytes' default unless a flag names it."""
    import torch
    from transformers import BitsAndBytesConfig

    if target.dtype == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    kwargs = {"load_in_4bit": True, "bnb_4bit_quant_type": target.dtype}
    if target.compute is not None:
        kwargs["bnb_4bit_compute_dtype"] = getattr(torch, target.compute)
    if target.double_quant:
        kwargs["bnb_4bit_use_double_quant"] = True
    return BitsAndBytesConfig(**kwargs)


def _quantized_weight(module: torch.nn.Module) -> bool:
    return type(getattr(module, "weight", None)).__name__ in ("Params4bit", "Int8Params")


def quantized_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Module path → each bitsandbytes layer holding a quantized weight (`Linear4bit`, `Linear8bitLt`)."""
    return {name: m for name, m in model.named_modules() if _quantized_weight(m)}


def dequantize(module: torch.nn.Module) -> torch.Tensor:
    """The float weight a bitsandbytes layer holds, as PEFT dequantizes it to merge (`dequantize_bnb_weight`);
    a 4-bit weight bitsandbytes has repacked for its fused CPU kernel (`repacked`) is read from that layout
    (`_dequantize_repacked`), where PEFT would read it as the plain one."""
    from peft.utils.integrations import dequantize_bnb_weight

    if repacked(module):
        return _dequantize_repacked(module.weight)
    return dequantize_bnb_weight(module.weight, state=getattr(module, "state", None))


def repacked(module: torch.nn.Module) -> bool:
    """Whether a `Linear4bit` holds its weight in the layout of bitsandbytes' fused CPU kernel, which it
    repacks into at its first forward on a CPU with AVX512-BF16 (unless `+portable` turned that off)."""
    quant_state = getattr(getattr(module, "weight", None), "quant_state", None)
    return bool(getattr(quant_state, "packing_format_for_cpu", False))


def _dequantize_repacked(weight) -> torch.Tensor:
    """The values a repacked 4-bit weight multiplies with: its 4-bit codes unpacked by bitsandbytes' own
    inverse (on copies: the layer keeps its layout) times its block scales, which the repacking rounded
    to bfloat16 and stores (blocks per row, rows): put back in row order here, where bitsandbytes 0.50.2's
    inverse leaves them in the packed order."""
    import copy

    import torch
    from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse, dequantize_4bit

    state = copy.deepcopy(weight.quant_state)
    state.original_nested = False  # the inverse would quantize the scales again: they are read as they are
    data, state = _convert_weight_packed_for_cpu_inverse(weight.data.clone(), state)
    state.absmax = weight.quant_state.absmax.T.reshape(-1).to(torch.float32)
    return dequantize_4bit(data, state)


FUSED_4BIT_NOTE = (
    "bitsandbytes' fused 4-bit CPU kernel ran (this CPU has AVX512-BF16; bitsandbytes' default): each "
    "4-bit weight is repacked at its first forward, its block scales rounded to bfloat16, and multiplies "
    "in bfloat16; `+portable` names the path other CPUs run"
)
NO_FUSED_4BIT_NOTE = (
    "this CPU lacks AVX512-BF16: bitsandbytes' 4-bit layers run their portable path, by default as with "
    "+portable (its fused kernel, and the repacking of each weight at the first forward, do not run here)"
)
PORTABLE_4BIT_NOTE = (
    "bitsandbytes' fused 4-bit CPU kernel (AVX512-BF16) is off (+portable): the portable path runs, as on "
    "a CPU without AVX512-BF16"
)


def cpu_4bit_path(model: torch.nn.Module, target: Target) -> list[str]:
    """Give `model`'s 4-bit layers the CPU path `target` names, and the note saying which ran (CPU targets
    with 4-bit layers only): bitsandbytes' default, its fused kernel where the CPU has AVX512-BF16, or with
    `+portable` the portable path (`support_avx512bf16_for_cpu` off on every `Linear4bit`); on a CPU without
    AVX512-BF16 the portable path either way, and the note says the CPU lacks it."""
    layers = [m for m in model.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
    if target.device_type != "cpu" or not layers:
        return []
    fused = [m for m in layers if m.support_avx512bf16_for_cpu]
    if not fused:
        return [NO_FUSED_4BIT_NOTE]
    if not target.portable:
        return [FUSED_4BIT_NOTE]
    for m in fused:
        m.support_avx512bf16_for_cpu = False
    return [PORTABLE_4BIT_NOTE]


def format_note(module: torch.nn.Module) -> str:
    """What a dequantized weight is: its format and block size (4-bit), or LLM.int8's per-row scale."""
    quant_state = getattr(module.weight, "quant_state", None)
    if quant_state is None:
        return "int8 (LLM.int8), one absmax scale per output row; dequantized by PEFT's dequantize_bnb_weight"
    nested = ", double-quantized absmax" if getattr(quant_state, "nested", False) else ""
    return (
        f"{quant_state.quant_type} (bitsandbytes), block size {quant_state.blocksize}{nested}; dequantized "
        f"to {str(quant_state.dtype).removeprefix('torch.')} by PEFT's dequantize_bnb_weight"
    )


def dequantized_state(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The model's state dict with each quantized weight dequantized under its own name, and the
    entries that only hold quantization state (absmax, quant_map, SCB, …) left out; with a note per
    dequantized weight (`format_note`). A model without bitsandbytes layers: its state dict, no notes."""
    state = model.state_dict()
    modules = quantized_modules(model)
    if not modules:
        return state, {}
    out: dict[str, torch.Tensor] = {}
    notes: dict[str, str] = {}
    for name, tensor in state.items():
        owner, _, leaf = name.rpartition(".")
        prefix = next((p for p in modules if name.startswith(f"{p}.")), None)
        if prefix is None:
            out[name] = tensor
        elif owner == prefix and leaf == "weight":
            out[name] = dequantize(modules[prefix])
            notes[name] = format_note(modules[prefix])
        elif owner == prefix and leaf == "bias":
            out[name] = tensor
        # anything else under a quantized layer is its quantization state: part of the weight above
    return out, notes


HELD = "_weightdrift_held"  # `base_state` key of a layer's Held


def is_quantized_layer(layer: torch.nn.Module) -> bool:
    """Whether `layer` (a tuner layer's base layer) holds a bitsandbytes weight."""
    return _quantized_weight(layer)


@dataclass
class Held:
    """A quantized layer's weight as loaded, to put back after a merge: the Parameter itself (PEFT's merge
    into a bitsandbytes layer builds a new one and never writes into the old) and LLM.int8's layer state
    (merging resets it; it holds the int8 weight's row scales once the layer has run)."""

    weight: torch.nn.Parameter
    state: dict[str, Any] | None


def hold(layer: torch.nn.Module) -> Held:
    """What `put_back` needs to give `layer` its loaded quantized weight again."""
    state = getattr(layer, "state", None)
    return Held(weight=layer.weight, state=None if state is None else dict(vars(state)))


def put_back(layer: torch.nn.Module, held: Held) -> None:
    """Give `layer` the weight (and int8 state) `hold` took, whatever merges did since."""
    layer.weight = held.weight
    if held.state is not None:
        vars(layer.state).update(held.state)
