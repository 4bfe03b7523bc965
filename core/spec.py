"""What to inspect: the base model, adapters, targets, checks and probe inputs of a run.

Everything here is plain data that round-trips through JSON, so a spec can be stored with a
run, sent to a worker process, or written by hand.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "float64": "float64",
    "fp64": "float64",
    "f64": "float64",
    "double": "float64",
    "nf4": "nf4",
    "fp4": "fp4",
    "int8": "int8",
}
DTYPE_SHORT = {
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "float64": "fp64",
    "nf4": "nf4",
    "fp4": "fp4",
    "int8": "int8",
}
# Bases loaded through bitsandbytes (core.models.targets): the "dtype" names the storage format of the
# quantized linear layers; the layers' arithmetic and everything else run in a float dtype.
QUANTIZED_FORMATS = ("nf4", "fp4", "int8")
FOUR_BIT_FORMATS = ("nf4", "fp4")
# `+compute=`: bnb_4bit_compute_dtype, the float dtype a 4-bit layer dequantizes into and multiplies in
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
MATMUL_PRECISIONS = ("highest", "high", "medium")
# What a run checks unless told otherwise; merge, memory and adapters load models their own way
# and are asked for by name (or by a scenario).
DEFAULT_CHECKS = ("weights", "deltas", "outputs")
# Every check's name, in the registry's order (core.checks.CHECKS, which a test holds equal to this): the
# CLI answers a misspelt --check before it imports the checks (torch) or starts a worker.
CHECK_NAMES = ("weights", "deltas", "outputs", "memory", "merge", "adapters", "activations", "generate")
DEFAULT_MAX_NEW_TOKENS = 32


class SpecError(ValueError):
    """A spec, target string or option that cannot be used, with a message for the user."""


def known_checks(names: Iterable[str], available: Iterable[str] = CHECK_NAMES) -> tuple[str, ...]:
    """`names` as a tuple; SpecError naming the ones that are not `available` (the registry's, where it
    is imported: `core.checks.get_checks`)."""
    names, available = tuple(names), tuple(available)
    unknown = [n for n in names if n not in available]
    if unknown:
        raise SpecError(f"unknown check {', '.join(unknown)}; available: {', '.join(available)}")
    return names


class InputError(SpecError):
    """An input file or folder that cannot be used, with the reason."""


def model_folder(model: ModelRef) -> Path | None:
    """The base model's local folder, a folder with a config.json; None for a hub id (the worker resolves
    it). InputError naming what is wrong. Reads no library: a wrong path is answered before any import."""
    path = Path(model.path).expanduser()
    if not path.exists():
        if model.path.startswith(("/", ".", "~")) or model.path.count("/") != 1:
            raise InputError(f"base model {model.path}: no such folder")
        return None
    if not path.is_dir():
        raise InputError(f"base model {model.path}: not a folder")
    if not (path / "config.json").exists():
        raise InputError(f"base model {model.path}: not a model folder (no config.json)")
    return path


def file_version(path: Path) -> tuple[str, int, int]:
    """A file's name, size and modification time (ns): what a memo of what was read from it is keyed by,
    since another version of the file has another. OSError where it cannot be looked at."""
    st = path.stat()
    return path.name, st.st_size, st.st_mtime_ns


def adapter_folder(adapter: AdapterRef) -> Path:
    """The adapter's folder, a folder with an adapter_config.json; InputError naming what is wrong."""
    path = Path(adapter.path).expanduser()
    if not path.is_dir():
        raise InputError(f"adapter {adapter.name}: no such folder {adapter.path}")
    if not (path / "adapter_config.json").exists():
        raise InputError(
            f"adapter {adapter.name}: not an adapter folder (no adapter_config.json in {adapter.path})"
        )
    return path


def input_folders(spec: ProbeSpec) -> None:
    """`model_folder` of the base and `adapter_folder` of each adapter: InputError for the first wrong one.
    Reads no library."""
    model_folder(spec.base)
    for adapter in spec.adapters:
        adapter_folder(adapter)


@dataclass(frozen=True)
class ModelRef:
    """A base model: a local folder, or a hub id (works only where the hub or its cache is reachable)."""

    path: str
    revision: str | None = None
    trust_remote_code: bool = False

    @property
    def name(self) -> str:
        return Path(self.path.rstrip("/")).name


@dataclass(frozen=True)
class AdapterRef:
    """An adapter folder (with adapter_config.json) and the name it is loaded under."""

    path: str
    name: str

    @staticmethod
    def parse(text: str) -> AdapterRef:
        """Parse `PATH` or `PATH=NAME`; the name defaults to the folder's name.

        A path may hold `=` (`runs/lr=1e-4/lora`): the text is split at its last `=` only where what
        follows is a valid name and the whole text is not an existing path.
        """
        path, name = text, ""
        head, sep, tail = text.rpartition("=")
        if sep and head.strip() and _valid_name(tail.strip()) and not Path(text).expanduser().exists():
            path, name = head, tail
        path = path.strip()
        name = name.strip() or Path(path.rstrip("/")).name
        if not path:
            raise SpecError(f"adapter {text!r}: empty path")
        if not _valid_name(name):
            raise SpecError(
                f"adapter {text!r}: name {name!r} must be letters, digits, '-', '_' or '.' "
                "(give one as PATH=NAME)"
            )
        return AdapterRef(path=path, name=name)


# More CPU threads than any machine torch runs on has; torch takes a C int and a worker asked for
# billions of threads would fail while starting them.
MAX_THREADS = 1024


def _thread_count(value: str, text: str) -> int:
    """The N of a `threads=N` flag: ASCII digits (`str.isdigit` also takes `²`), 1 to MAX_THREADS."""
    digits = value.isascii() and value.isdigit() and len(value) <= len(str(MAX_THREADS))
    if not (digits and 1 <= int(value) <= MAX_THREADS):
        raise SpecError(
            f"target {text!r}: flag threads={value} is not a CPU thread count; expected threads=N "
            f"with N a whole number from 1 to {MAX_THREADS} written in digits 0-9"
        )
    return int(value)


def valid_machine(name: str) -> bool:
    """A machine name in a target: a host name's letters, digits, '-', '_' or '.' (no '/', '+')."""
    return bool(name) and name.isascii() and all(c.isalnum() or c in "-_." for c in name)


def _valid_name(name: str) -> bool:
    """An adapter name PEFT accepts: letters, digits, '-', '_' or '.', not starting with a digit."""
    return name.replace("-", "_").replace(".", "_").isidentifier()


@dataclass(frozen=True)
class Target:
    """Where and how a model is materialised: device, dtype and process-global numerics flags.

    Parsed from strings like `cpu/float32`, `cuda:1/float16+tf32`, `cpu/float32+threads=1`,
    `cuda:0/float32+deterministic`, `cuda:0/float32+matmul=high`, and with the Ray runner
    `cuda:0/float32+node=gpu-a6000` (that node's cuda:0).

    A quantized base names its bitsandbytes format as the dtype (`cpu/nf4`, `cuda:0/fp4`, `cpu/int8`):
    bitsandbytes' defaults, with flags for the departures: `+compute=bfloat16|float16|float32`
    (bnb_4bit_compute_dtype), `+double_quant` (bnb_4bit_use_double_quant) and, on the CPU, `+portable`
    (bitsandbytes' fused AVX512-BF16 kernel off: the portable path every other CPU runs), 4-bit formats only.

    A target captured on another machine (imported from a snapshot) names it first:
    `gpu-box/cuda:0/float32+tf32`; such a target is never run here, only compared.
    """

    device: str
    dtype: str
    tf32: bool = False
    deterministic: bool = False
    threads: int | None = None
    matmul_precision: str | None = None
    machine: str | None = None  # set only for a capture imported from a snapshot
    # `node=NAME`: the Ray node this target runs on (core.engine.ray_runner), so that cuda:0 of two machines
    # are two targets; the local runner refuses it
    node: str | None = None
    compute: str | None = None  # `compute=DTYPE`: a 4-bit format's bnb_4bit_compute_dtype
    double_quant: bool = False  # `double_quant`: a 4-bit format's bnb_4bit_use_double_quant
    # `portable`: a 4-bit format's layers with bitsandbytes' fused CPU kernel off (`support_avx512bf16_for_cpu`)
    portable: bool = False

    @staticmethod
    def parse(text: str) -> Target:
        """Parse a target string `DEVICE/DTYPE[+FLAG…]`; raises SpecError with the accepted forms."""
        raw = text.strip()
        head, *flags = raw.split("+")
        machine = None
        if head.count("/") == 2:  # MACHINE/DEVICE/DTYPE: a capture imported from a snapshot
            machine, head = head.split("/", 1)
            if not valid_machine(machine):
                raise SpecError(
                    f"target {text!r}: machine {machine!r} must be letters, digits, '-', '_' or '.'"
                )
        device, sep, dtype = head.partition("/")
        if not sep:
            raise SpecError(
                f"target {text!r}: expected DEVICE/DTYPE[+FLAG…], e.g. cpu/float32 or cuda:0/bfloat16+tf32"
            )
        device = normalise_device(device.strip(), text)
        dtype_name = DTYPE_ALIASES.get(dtype.strip().lower())
        if dtype_name is None:
            raise SpecError(
                f"target {text!r}: unknown dtype {dtype!r}; use one of float32, bfloat16, float16, float64, "
                f"or a bitsandbytes format: {', '.join(QUANTIZED_FORMATS)}"
            )
        kwargs: dict[str, Any] = {}
        for flag in flags:
            key, _, value = flag.strip().partition("=")
            key = key.lower()
            if key == "tf32" and not value:
                kwargs["tf32"] = True
            elif key == "deterministic" and not value:
                kwargs["deterministic"] = True
            elif key == "threads":
                kwargs["threads"] = _thread_count(value, text)
            elif key == "matmul" and value in MATMUL_PRECISIONS:
                kwargs["matmul_precision"] = value
            elif key in QUANTIZATION_FLAGS:
                kwargs.update(_quantization_flag(key, value, dtype_name, text))
            elif key == "node" and valid_machine(value):
                kwargs["node"] = value
            elif key == "node":
                raise SpecError(
                    f"target {text!r}: flag node={value} is not a node name; expected node=NAME, NAME being "
                    "letters, digits, '-', '_' or '.' (a Ray node's name, host name or IP address)"
                )
            elif key == "matmul":
                raise SpecError(
                    f"target {text!r}: flag matmul={value} is not a float32 matmul precision; expected "
                    f"matmul={'|'.join(MATMUL_PRECISIONS)}"
                )
            else:
                raise SpecError(
                    f"target {text!r}: unknown flag {flag!r}; flags are tf32, deterministic, threads=N, "
                    f"matmul={'|'.join(MATMUL_PRECISIONS)}, node=NAME, and for nf4/fp4 "
                    f"compute={'|'.join(COMPUTE_DTYPES)}, double_quant, portable"
                )
        return Target(device=device, dtype=dtype_name, machine=machine, **kwargs)

    @property
    def flags(self) -> list[str]:
        """The flags in canonical order, as written in a target string (`tf32`, `threads=1`, …)."""
        flags = []
        if self.tf32:
            flags.append("tf32")
        if self.deterministic:
            flags.append("deterministic")
        if self.threads is not None:
            flags.append(f"threads={self.threads}")
        if self.matmul_precision is not None:
            flags.append(f"matmul={self.matmul_precision}")
        if self.node is not None:
            flags.append(f"node={self.node}")
        if self.compute is not None:
            flags.append(f"compute={self.compute}")
        if self.double_quant:
            flags.append("double_quant")
        if self.portable:
            flags.append("portable")
        return flags

    def __str__(self) -> str:
        where = f"{self.machine}/{self.device}" if self.machine else self.device
        return "+".join([f"{where}/{self.dtype}", *self.flags])

    @property
    def label(self) -> str:
        """Human label like `cuda:1·bf16·tf32`, or `gpu-box/cuda:1·bf16·tf32` for an imported capture."""
        short = [_SHORT_FLAGS.get(f, f) for f in self.flags]
        label = "·".join([self.device, DTYPE_SHORT[self.dtype], *short])
        return f"{self.machine}/{label}" if self.machine else label

    @property
    def slug(self) -> str:
        """File-system safe name for this target's capture folder."""
        return str(self).replace("/", "_").replace(":", "").replace("+", "_").replace("=", "")

    @property
    def local(self) -> Target:
        """The same target without its machine (how it was written where it was captured)."""
        return replace(self, machine=None)

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    @property
    def is_reference(self) -> bool:
        return self == REFERENCE_TARGET

    @property
    def quantized(self) -> bool:
        """Whether the base is loaded through bitsandbytes (`nf4`, `fp4`, `int8`)."""
        return self.dtype in QUANTIZED_FORMATS

    @property
    def float_dtype(self) -> str:
        """The float dtype this target's numbers are judged in: its dtype, or for a quantized target its
        compute dtype (`+compute=`), float32 where none is named. The tolerance follows it, so the
        quantization error reads as drift; whether it is the format's own is its peer's judgement."""
        if self.quantized:
            return self.compute or "float32"
        return self.dtype


_SHORT_FLAGS = {"deterministic": "det", "double_quant": "dq"}


# The flags of a 4-bit format's bitsandbytes layers: what each sets, for the message refusing it elsewhere
QUANTIZATION_FLAGS = {
    "compute": "sets bnb_4bit_compute_dtype",
    "double_quant": "sets bnb_4bit_use_double_quant",
    "portable": "turns off bitsandbytes' fused 4-bit CPU kernel",
}


def _quantization_flag(key: str, value: str, dtype: str, text: str) -> dict[str, Any]:
    """The field of a `compute=DTYPE`, `double_quant` or `portable` flag; SpecError where the format has no
    such setting."""
    if dtype not in FOUR_BIT_FORMATS:
        raise SpecError(
            f"target {text!r}: flag {key} {QUANTIZATION_FLAGS[key]} and applies to "
            f"{' and '.join(FOUR_BIT_FORMATS)} only"
        )
    if key in ("double_quant", "portable") and not value:
        return {key: True}
    compute = DTYPE_ALIASES.get(value.lower())
    if key == "compute" and compute in COMPUTE_DTYPES:
        return {"compute": compute}
    raise SpecError(
        f"target {text!r}: flag {key}={value} is not understood; expected compute={'|'.join(COMPUTE_DTYPES)}, "
        "double_quant or portable"
    )


REFERENCE_TARGET = Target(device="cpu", dtype="float64")

# Base checkpoints up to this size keep every compared tensor whole in the captures, so the
# drill-down is element-wise (the demo's models are well under it); larger ones keep each tensor's
# metric row and bounded sketch, unless the run asks for `keep_tensors`.
KEEP_TENSORS_UP_TO = 256 * 1024 * 1024
# Base checkpoints up to this size are loaded once per pass: the checks compared against the
# checkpoint first (weights, deltas: their rows come in seconds), then those that run the model, so
# the first page fills without waiting for the slowest check. A larger base is loaded once for all.
CAPTURE_PASSES_UP_TO = 256 * 1024 * 1024


def normalise_device(device: str, context: str = "") -> str:
    """`cuda` → `cuda:0`, `gpu:1` is refused; the index is always explicit so placement is exact."""
    device = device.lower()
    if device == "cpu" or device == "mps":
        return device
    if device == "cuda":
        return "cuda:0"
    index = device[5:]
    if device.startswith("cuda:") and index.isascii() and index.isdigit():
        return f"cuda:{index.lstrip('0') or '0'}"  # as text: int() refuses over 4300 digits
    where = f"target {context!r}: " if context else ""
    raise SpecError(f"{where}unknown device {device!r}; use cpu, cuda:N or mps")


@dataclass(frozen=True)
class ToleranceOverride:
    """A user's tolerance for a run or a role; a field left None keeps the per-dtype default."""

    rtol: float | None = None
    atol: float | None = None


@dataclass(frozen=True)
class ProbeInputs:
    """Fixed probe inputs: prompts through the checkpoint's tokenizer (one row each), explicit token
    ids, or `batch` × `seq_len` ids drawn from the run's seed (in that order of precedence)."""

    batch: int = 2
    seq_len: int = 16
    input_ids: tuple[tuple[int, ...], ...] | None = None
    prompts: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProbeSpec:
    """A whole run: what to load, where, which checks, on which inputs, with which tolerances."""

    base: ModelRef
    adapters: tuple[AdapterRef, ...]
    targets: tuple[Target, ...]
    checks: tuple[str, ...] = DEFAULT_CHECKS
    probe: ProbeInputs = field(default_factory=ProbeInputs)
    # role (or "*") -> tolerance; overrides the per-dtype defaults
    tolerances: dict[str, ToleranceOverride] = field(default_factory=dict)
    seed: int = 0
    # Load strategies the `adapters` check runs side by side (`isolated` is its ground truth); every
    # other check loads by `isolated`.
    strategies: tuple[str, ...] = ("isolated",)
    # Adapters the `merge` check merges together (`adapter_names=`); empty: its own default.
    merge_subset: tuple[str, ...] = ()
    # Keep every compared tensor whole in the captures (the element-wise drill-down), whatever the
    # model's size; without it only models up to KEEP_TENSORS_UP_TO bytes keep theirs.
    keep_tensors: bool = False
    # What outputs are compared against (the `outputs` and `merge` checks): cpu/float64 unless the
    # user picks another target; every row names it.
    reference: Target = REFERENCE_TARGET
    # Judge each target's error against its peer's (`peer_of`): the engine adds a peer the run lacks
    # (`with_peers`), like the reference; False (`--no-peers`): no peers, no judgement.
    peers: bool = True
    # the peers the engine added (not asked for): listed so the pages can say why they are there
    added_peers: tuple[Target, ...] = ()
    # How many tokens the `generate` check decodes greedily per prompt.
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    # The longest one task of the run may take, in seconds, before its worker is killed and its rows read
    # `broken: timed out …`; None: the default from the checkpoint's size and the checks
    # (`core.engine.jobs.task_time_limit`).
    task_timeout_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["targets"] = [str(t) for t in self.targets]
        d["reference"] = str(self.reference)
        d["added_peers"] = [str(t) for t in self.added_peers]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ProbeSpec:
        probe = d.get("probe") or {}
        ids = probe.get("input_ids")
        return ProbeSpec(
            base=ModelRef(**d["base"]),
            adapters=tuple(AdapterRef(**a) for a in d.get("adapters", [])),
            targets=tuple(Target.parse(t) for t in d["targets"]),
            checks=tuple(d.get("checks", DEFAULT_CHECKS)),
            probe=ProbeInputs(
                batch=probe.get("batch", 2),
                seq_len=probe.get("seq_len", 16),
                input_ids=tuple(tuple(r) for r in ids) if ids else None,
                # specs stored before prompts existed have none
                prompts=tuple(probe.get("prompts") or ()),
            ),
            tolerances={k: ToleranceOverride(**v) for k, v in (d.get("tolerances") or {}).items()},
            seed=d.get("seed", 0),
            # runs stored before strategies became a list have a single `strategy`
            strategies=tuple(d.get("strategies") or [d.get("strategy", "isolated")]),
            merge_subset=tuple(d.get("merge_subset") or ()),
            keep_tensors=bool(d.get("keep_tensors", False)),
            reference=Target.parse(d["reference"]) if d.get("reference") else REFERENCE_TARGET,
            peers=bool(d.get("peers", True)),
            added_peers=tuple(Target.parse(t) for t in d.get("added_peers") or ()),
            max_new_tokens=int(d.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)),
            task_timeout_s=d.get("task_timeout_s"),
        )

    @staticmethod
    def from_json(text: str) -> ProbeSpec:
        return ProbeSpec.from_dict(json.loads(text))

    @property
    def loads_quantized(self) -> bool:
        """Whether a target or the reference loads its base through bitsandbytes (a peer has its
        target's dtype: none is quantized where no target is)."""
        return any(t.quantized for t in (*self.targets, self.reference))

    def peer_map(self) -> dict[Target, Target | None]:
        """Each target's peer (`peer_of`), the reference excluded; empty when the run has no peers."""
        if not self.peers:
            return {}
        can_add = any(t.machine is None for t in self.targets)
        return {
            t: peer_of(t, self.targets, self.reference, can_add) for t in self.targets if t != self.reference
        }

    def with_peers(self) -> ProbeSpec:
        """This spec with the peers its targets need and lack added as targets (`added_peers`)."""
        missing = [
            p for p in dict.fromkeys(self.peer_map().values()) if p is not None and p not in self.targets
        ]
        if not missing:
            return self
        return replace(self, targets=(*self.targets, *missing), added_peers=(*self.added_peers, *missing))

    def tolerance_for(self, role: str) -> ToleranceOverride | None:
        """The user's override for this role (or the run-wide one), None for the dtype default."""
        return self.tolerances.get(role) or self.tolerances.get("*")


def prompts_from_text(text: str) -> tuple[str, ...]:
    """Prompts written one a line (a prompt file, the form's box): each line, blank ones skipped."""
    return tuple(line for line in text.splitlines() if line.strip())


# How close a dtype's results come to float64's, for the next-best reference: float16 keeps more
# mantissa bits than bfloat16.
_DTYPE_CLOSENESS = {"float64": 3, "float32": 2, "float16": 1, "bfloat16": 0}


def next_best_reference(spec: ProbeSpec) -> Target | None:
    """The target that stands in for a reference that could not run: the widest dtype, on the CPU
    and without numerics flags where there is a choice. Never a quantized one (its weights are not the
    checkpoint's): None when the run has no other."""
    floats = [t for t in spec.targets if not t.quantized]
    if not floats:
        return None
    return max(floats, key=lambda t: (_DTYPE_CLOSENESS.get(t.dtype, -1), t.device == "cpu", not t.flags))


def peer_of(
    target: Target, targets: tuple[Target, ...] | list[Target], reference: Target, can_add: bool = True
) -> Target | None:
    """What `target`'s error is judged against: the CPU target of its dtype without flags on the machine
    that runs the comparison (`cuda:1/bfloat16+tf32` → `cpu/bfloat16`). A target imported from a snapshot
    takes the local one when the comparison has it, else the first snapshot's (in `targets`' order).
    None where there is none and none can be added (`can_add`: the model is here to run it), and for a
    dtype whose peer would be the reference itself (its rows already are the judgement). Flags are
    departures and the peer has none: `cpu/nf4+portable` is judged against `cpu/nf4`, bitsandbytes'
    default path on this CPU (the fused kernel where it has AVX512-BF16), what a user's script runs.
    """
    local = Target(device="cpu", dtype=target.dtype)
    if local == reference.local:
        return None
    if local in targets:
        return local
    if target.machine is not None:
        imported = next((t for t in targets if t.machine is not None and t.local == local), None)
        if imported is not None:
            return imported
    return local if can_add else None


def weightdrift_home(explicit: str | os.PathLike[str] | None = None) -> Path:
    """`--home`, else `$WEIGHTDRIFT_HOME`, else `~/.cache/weightdrift`."""
    if explicit:
        return Path(explicit).expanduser().resolve()
    env = os.environ.get("WEIGHTDRIFT_HOME")
    if env:
        return Path(env).expanduser().resolve()
    return Path("~/.cache/weightdrift").expanduser().resolve()
