"""VeRA's shared random projections and RandLoRA's shared random bases, regenerated from the adapter config
as PEFT does when an adapter was saved without them (``save_projection=False``).

Such a file holds only each module's trained vectors; PEFT draws the shared pair again at load, from a CPU
``torch.Generator`` seeded with ``projection_prng_key``, sized by the largest (out, in) over the modules it
adapts. This module writes those draws out from PEFT 0.21.2's ``peft/tuners/vera/model.py``
(``_kaiming_init``, ``_init_vera_A_vera_B``) and ``peft/tuners/randlora/model.py`` (``_kaiming_init``,
``_init_randlora_A_randlora_B``, its sparse variant), with its own code: the same shapes, draw order, dtypes
and arithmetic, so that the tensors equal PEFT's bit for bit (tests/test_methods.py shows it). The result is
keyed as a file saved with ``save_projection=True`` holds them (``base_model.vera_A``, ...), so the float64
formulas read regenerated and saved projections alike.

One dependence on the machine remains: RandLoRA's default (dense) bases are drawn in bfloat16 where
accelerate's ``is_bf16_available()`` says so (every CPU-only process, GPUs since Ampere) and in float16
elsewhere (older GPUs). They are regenerated here in bfloat16; :func:`matches_loaded` tells a check whether a
loaded model's bases are these, so that where PEFT drew float16 ones the module is reported not covered
rather than compared with bases it does not use.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

# method -> (its shared pair's keys in a file saved with save_projection=True)
KEYS = {
    "vera": ("base_model.vera_A", "base_model.vera_B"),
    "randlora": ("base_model.randlora_A", "base_model.randlora_B"),
}
# The dtype RandLoRA's dense bases are drawn in where bfloat16 is available (see the module docstring).
RANDLORA_DTYPE = torch.bfloat16

REGENERATED = (
    "its shared projections not saved (save_projection=False): regenerated from projection_prng_key as "
    "PEFT does"
)
"""The note on a ΔW whose reference used regenerated projections."""


def regenerated(kind: str, config: Mapping[str, Any]) -> bool:
    """Whether PEFT regenerates this adapter's shared pair at load (VeRA, RandLoRA: ``save_projection=False``)."""
    return kind in KEYS and not config.get("save_projection", True)


def unsaved(kind: str, config: Mapping[str, Any], names: Iterable[str]) -> bool:
    """Whether an adapter of `kind` needs shared projections that its file (tensor `names`) lacks: VeRA or
    RandLoRA saved with ``save_projection=False``, whose pair PEFT regenerates at load."""
    keys = KEYS.get(kind)
    if keys is None or config.get("save_projection", True):
        return False
    present = set(names)
    return not all(k in present for k in keys)


def largest_shape(shapes: Iterable[tuple[int, ...]], fan_in_fan_out: bool) -> tuple[int, int]:
    """The largest (out, in), dimension by dimension, over the adapted modules' weights `shapes` as stored
    ((in, out) with `fan_in_fan_out`, GPT-2's Conv1D): the size PEFT's ``_find_dim`` gives the shared pair."""
    oriented = [tuple(s[::-1]) if fan_in_fan_out else tuple(s) for s in shapes]
    if not oriented:
        raise ValueError("no adapted module: the shared projections' size is unknown")
    if any(len(s) != 2 for s in oriented):
        raise ValueError(f"shared projections need 2-d (Linear) weights, got shapes {sorted(set(oriented))}")
    return max(s[0] for s in oriented), max(s[1] for s in oriented)


def _vera_kaiming(shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """PEFT's VeRA ``_kaiming_init``: uniform on ±√3·(√2/√fan_in) with fan_in = shape[1], written with
    PEFT's operations in PEFT's order so that the bound is the same float. float32: PEFT makes the tensor
    with ``torch.empty`` in the default dtype, which nothing in loading changes from float32."""
    std = math.sqrt(2) / math.sqrt(shape[1])
    bound = math.sqrt(3.0) * std
    return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)


def vera(config: Mapping[str, Any], largest: tuple[int, int]) -> dict[str, torch.Tensor]:
    """VeRA's ``vera_A`` (r, in) then ``vera_B`` (out, r), `largest` = (out, in), from one generator."""
    out_f, in_f = largest
    r = int(config.get("r", 256))
    generator = torch.Generator(device="cpu").manual_seed(int(config.get("projection_prng_key", 0)))
    a = _vera_kaiming((r, in_f), generator)
    b = _vera_kaiming((out_f, r), generator)
    return dict(zip(KEYS["vera"], (a, b), strict=True))


def _randlora_kaiming(shape: tuple[int, int, int], generator: torch.Generator) -> torch.Tensor:
    """``kaiming_uniform_(a=√5)`` as torch writes it (gain √(2/(1+a²)), fan_in = shape[1]·shape[2]) on a
    tensor of PEFT's RandLoRA dtype."""
    a = math.sqrt(5)
    gain = math.sqrt(2.0 / (1 + a**2))
    std = gain / math.sqrt(shape[1] * shape[2])
    bound = math.sqrt(3.0) * std
    return torch.empty(shape, dtype=RANDLORA_DTYPE).uniform_(-bound, bound, generator=generator)


def randlora(config: Mapping[str, Any], largest: tuple[int, int]) -> dict[str, torch.Tensor]:
    """RandLoRA's ``randlora_A`` (r, 1, min) and ``randlora_B`` (max, n, r), n = ⌈min/r⌉, `largest` =
    (out, in): dense (default), ``sparse`` or ``very_sparse`` as the config says."""
    r = int(config.get("r", 32))
    max_dim, min_dim = max(largest), min(largest)
    generator = torch.Generator(device="cpu").manual_seed(int(config.get("projection_prng_key", 0)))
    # PEFT's float division and test, not math.ceil: the same n for every size a model has
    ratio = min_dim / r
    num_bases = int(ratio) if ratio.is_integer() else int(ratio) + 1
    if config.get("very_sparse") or config.get("sparse"):
        # very_sparse wins where both are set, as in PEFT's _pre_injection_hook
        sparsity = math.sqrt(min_dim) if config.get("very_sparse") else 3
        a = torch.rand((r, 1, min_dim), generator=generator, dtype=torch.float32)
        b = torch.rand((max_dim, num_bases, r), generator=generator, dtype=torch.float32)
        a_sparse, b_sparse = _signed(a, sparsity), _signed(b, sparsity)
        pair = (a_sparse / a_sparse.std(), b_sparse / b_sparse.std())
    else:
        a = _randlora_kaiming((r, 1, min_dim), generator)
        # one (max, 1, r) draw per basis, in order, side by side
        b = torch.cat([_randlora_kaiming((max_dim, 1, r), generator) for _ in range(num_bases)], dim=1)
        # normalised in their own dtype, as PEFT does
        pair = (a / a.std(), b / b.std())
    return dict(zip(KEYS["randlora"], pair, strict=True))


def _signed(draws: torch.Tensor, sparsity: float) -> torch.Tensor:
    """−1 where a uniform draw is below 1/(2·sparsity), +1 where above 1 − 1/(2·sparsity), 0 elsewhere (PEFT's
    sparse bases, before their normalisation)."""
    signed = torch.zeros(draws.shape)
    signed[draws < 1 / (2 * sparsity)] = -1
    signed[draws > 1 - 1 / (2 * sparsity)] = 1
    return signed


def regenerate(
    kind: str, config: Mapping[str, Any], shapes: Iterable[tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """The shared pair of a `kind` (``vera``/``randlora``) adapter saved without it, keyed as a saved file
    holds it; `shapes`: the stored weights of every module the adapter adapts (all of them: the pair's size
    is their largest)."""
    largest = largest_shape(shapes, bool(config.get("fan_in_fan_out")))
    if kind == "vera":
        return vera(config, largest)
    if kind == "randlora":
        return randlora(config, largest)
    raise ValueError(f"adapter type '{kind}' has no shared projections")


def machine_dependent(kind: str, config: Mapping[str, Any]) -> bool:
    """Whether PEFT draws this adapter's pair in a dtype that depends on the machine (RandLoRA's dense bases)."""
    return kind == "randlora" and not (config.get("sparse") or config.get("very_sparse"))


def matches_loaded(regenerated: Mapping[str, torch.Tensor], loaded: Mapping[str, torch.Tensor]) -> str | None:
    """None where each loaded projection (a PEFT model's buffer, by the same key) holds the regenerated
    values exactly, or rounded to a half precision; else why not, naming the tensor.

    On a bfloat16 or float16 target PEFT rounds the pair to the model's dtype when it attaches the adapter
    (and may keep it in a float32 buffer): the pair it uses is then the regenerated one rounded, which the
    target's ΔW shows like any rounding of its weights, not a different draw."""
    for key, want in regenerated.items():
        name = key.rsplit(".", 1)[-1]
        got = loaded.get(key)
        if got is None:
            return f"the loaded model has no {name}"
        if tuple(got.shape) != tuple(want.shape):
            return f"the loaded {name} has shape {tuple(got.shape)}, regenerated {tuple(want.shape)}"
        # float64 holds every float32, bfloat16 and float16 value: equal here is equal bit for bit
        held = got.detach().to("cpu", torch.float64)
        roundings = (want.dtype, got.dtype, torch.bfloat16, torch.float16)
        if not any(torch.equal(held, want.to(d).to(got.dtype).to(torch.float64)) for d in roundings):
            return f"the loaded {name} differs from the one regenerated here"
    return None


def loaded_mismatch(
    kind: str,
    config: Mapping[str, Any],
    layers: Mapping[str, tuple[torch.nn.Module, list[str]]],
    adapter: str,
    subject: str = "ΔW",
) -> str | None:
    """Why the shared pair a loaded PEFT model regenerated for `adapter` (saved without it) is not the one
    regenerated here, or None where it is, bit for bit. `layers`: `adapter_keys.adapted_modules` of the
    model; `subject`: what the reason says is not covered. A check compares a ΔW with a reference from
    regenerated projections only where this is None: the reference is computed elsewhere (the float64
    target, the drill-down), and PEFT's RandLoRA draws differ between machines (float16 without bfloat16)."""
    mine = [layer for layer, names in layers.values() if adapter in names]
    if not mine:
        return None
    # PEFT sizes the pair by the tuner layers' (out, in), Conv1D's included: oriented already
    shapes = [(int(layer.out_features), int(layer.in_features)) for layer in mine]
    want = regenerate(kind, {**config, "fan_in_fan_out": False}, shapes)
    loaded = {
        key: getattr(mine[0], f"{kind}_{ab}")[adapter] for key, ab in zip(KEYS[kind], "AB", strict=True)
    }
    why = matches_loaded(want, loaded)
    if why is None:
        return None
    if machine_dependent(kind, config):
        why += (
            "; PEFT draws RandLoRA's bases in bfloat16 where accelerate finds it available and in float16 "
            "elsewhere, and they are regenerated here in bfloat16"
        )
    return (
        f"{adapter} is a {kind} adapter saved without its shared projections (save_projection=False), and "
        f"{why}: its {subject} is not covered; its weights and outputs are compared"
    )
