"""Float64 ΔW formulas of HRA, MiSS, RandLoRA and DeLoRA, of LoRA on a stack of experts (``target_parameters``) and
of a trained bias (Δb), path (a) of `core.methods.formulas` (which
dispatches to these): from the adapter file's tensors (and W where the method applies the adapter to it),
written out from the methods' definitions in the installed PEFT 0.21.2
(``peft/tuners/{hra,miss,randlora,delora}/layer.py``), not taken from PEFT's layers.

Each returns ``ΔW = W_merged − W`` for a Linear weight W stored (out, in) (RandLoRA also (in, out) with
``fan_in_fan_out``, for GPT-2's Conv1D).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from core.methods.adapter_keys import (
    BIAS_SUFFIX,
    AdapterModule,
    _check_shape,
    _need,
    _need_projections,
    _pattern_value,
    _t,
)


def _rank(config: Mapping[str, Any], module: str, default: int = 8) -> int:
    return int(_pattern_value(config.get("rank_pattern"), module, config.get("r", default)))


def hra_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """HRA: ``W' = W·H`` with H a product of r Householder reflections of the input space, so ΔW = W·H − W.

    ``hra_u`` (in, r) holds the r vectors. Without ``apply_GS``, H = (I − 2û₁û₁ᵀ)(I − 2û₂û₂ᵀ)…(I − 2û_rû_rᵀ)
    with ûᵢ = uᵢ/‖uᵢ‖, applied here to W one reflection at a time (never forming H): W ← W − 2(Wûᵢ)ûᵢᵀ.
    With ``apply_GS`` the vectors are orthonormalised first (PEFT: Gram–Schmidt; here the Q of a float64
    QR, the same basis up to signs, which ``QQᵀ`` does not see), and H = I − 2QQᵀ, i.e. ΔW = −2(WQ)Qᵀ.
    """
    u = _need(mod, "hra_u", tensors)
    out_f, in_f = weight.shape
    _check_shape(mod, "hra_u", u.shape, (in_f, _rank(config, mod.module)))
    if config.get("apply_GS"):
        q, _ = torch.linalg.qr(u)
        return -2.0 * (weight @ q) @ q.T
    merged = weight.clone()
    for i in range(u.shape[1]):
        unit = u[:, i] / torch.linalg.vector_norm(u[:, i])
        merged = merged - 2.0 * torch.outer(merged @ unit, unit)
    return merged - weight


def miss_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """MiSS, by its ``init_weights``:

    * default (True/False): ``miss_block`` B (r, out) is added to every r-wide slice of W's inputs,
      ``ΔW[o, j] = B[j mod r, o]`` (the last, narrower slice takes B's first rows): ΔW does not depend on W;
    * ``"mini"``: B (r, mini_r) repeated along the outputs, ``ΔW[o, j] = B[j mod r, o mod mini_r]``;
    * ``"bat"``: B (out/r, r, r), one r×r block per block row of W: each r×r block W_ac of W (block row a,
      block column c) becomes ``W_ac + W_ac·B_a + B_a``, so ΔW_ac = W_ac·B_a + B_a depends on W.
    """
    block = _need(mod, "miss_block", tensors)
    out_f, in_f = weight.shape
    r = _rank(config, mod.module)
    init = config.get("init_weights", True)
    if init == "bat":
        if out_f % r or in_f % r:
            raise ValueError(
                f"module {mod.module}: MiSS 'bat' needs W {tuple(weight.shape)} in {r}×{r} blocks"
            )
        _check_shape(mod, "miss_block", block.shape, (out_f // r, r, r))
        blocks = weight.reshape(out_f // r, r, in_f // r, r)  # [a, i, c, k] = W[a·r + i, c·r + k]
        delta = torch.einsum("aick,akl->aicl", blocks, block) + block[:, :, None, :]
        return delta.reshape(out_f, in_f)
    rows = torch.arange(in_f) % r
    if init == "mini":
        mini_r = int(config.get("mini_r", 1))
        if out_f % mini_r:
            raise ValueError(
                f"module {mod.module}: MiSS 'mini' needs out_features {out_f} divisible by {mini_r}"
            )
        _check_shape(mod, "miss_block", block.shape, (r, mini_r))
        cols = torch.arange(out_f) % mini_r
        return block[rows][:, cols].T
    _check_shape(mod, "miss_block", block.shape, (r, out_f))
    return block[rows].T


def randlora_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """RandLoRA: ``ΔW = (alpha/r)·Σ_f B̄[:, f] ⊗ Ā[f, :]`` over f < n·r, oriented (out, in), with n =
    ⌈min(in, out)/r⌉ bases of rank r, transposed for fan_in_fan_out.

    The shared random bases A (r, 1, ≥m) and B (≥M, ≥n, r), m = min(in, out) and M = max(in, out), are
    saved in the adapter file (save_projection=True, PEFT's default; each module's copy and the top-level
    pair) or regenerated as PEFT does (`core.methods.projections`). The trained λ (r, n) and γ (n, m) scale A: Ā[f, j] = λ[k, b]·A[k, 0, j]·γ[b, j] with
    (k, b) = divmod(f, n), while B̄[:, f] = B[:, b', k'] with (b', k') = divmod(f, r): PEFT flattens the
    scaled A rank-major and B basis-major, and pairs them by the flat index f. The product B̄Ā is
    (M, m): ΔW when in ≤ out, its transpose otherwise.
    """
    _need_projections(mod, "randlora")
    lam, gamma = _need(mod, "randlora_lambda", tensors), _need(mod, "randlora_gamma", tensors)
    base_a, base_b = _need(mod, "randlora_A", tensors), _need(mod, "randlora_B", tensors)
    fifo = bool(config.get("fan_in_fan_out"))
    out_f, in_f = _t(weight, fifo).shape
    r = int(config.get("r", 32))
    small, large = min(in_f, out_f), max(in_f, out_f)
    n = math.ceil(small / r)
    _check_shape(mod, "randlora_lambda", lam.shape, (r, n))
    _check_shape(mod, "randlora_gamma", gamma.shape, (n, small))
    if base_a.ndim != 3 or base_a.shape[0] != r or base_a.shape[2] < small:
        raise ValueError(
            f"module {mod.module}: randlora_A has shape {tuple(base_a.shape)}, expected ({r}, 1, ≥{small})"
        )
    if base_b.ndim != 3 or base_b.shape[0] < large or base_b.shape[1] < n or base_b.shape[2] != r:
        raise ValueError(
            f"module {mod.module}: randlora_B has shape {tuple(base_b.shape)}, expected (≥{large}, ≥{n}, {r})"
        )
    flat = torch.arange(n * r)
    k, b = flat // n, flat % n  # the scaled A's row f
    a_bar = lam[k, b][:, None] * base_a[k, 0, :small] * gamma[b]  # (n·r, m)
    b_bar = base_b[:large, flat // r, flat % r]  # (M, n·r): column f is B[:, f // r, f % r]
    product = b_bar @ a_bar  # (M, m)
    delta = product if in_f == small else product.T
    return _t(delta, fifo) * float(config.get("randlora_alpha", 640)) / r


def delora_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """DeLoRA: ``ΔW = Σ_i λ/(r·‖Aᵢ‖·‖Bⁱ‖) · Bⁱ ⊗ Aᵢ``, each input column j then scaled by ``w_norm[j]``.

    Aᵢ is row i of ``delora_A`` (r, in), Bⁱ column i of ``delora_B`` (out, r), both norms clamped below at
    1e-4 as PEFT does; λ is the trained ``delora_lambda``; ``delora_w_norm`` (in) is ‖W[:, j]‖ of the W the
    adapter was created on, saved with it: ΔW does not depend on the W it is loaded onto.
    """
    a, b = _need(mod, "delora_A", tensors), _need(mod, "delora_B", tensors)
    lam, w_norm = _need(mod, "delora_lambda", tensors), _need(mod, "delora_w_norm", tensors)
    out_f, in_f = weight.shape
    r = _rank(config, mod.module)
    _check_shape(mod, "delora_A", a.shape, (r, in_f))
    _check_shape(mod, "delora_B", b.shape, (out_f, r))
    _check_shape(mod, "delora_lambda", lam.shape, (1,))
    _check_shape(mod, "delora_w_norm", w_norm.shape, (in_f,))
    a_norm = torch.linalg.vector_norm(a, dim=1).clamp(min=1e-4)
    b_norm = torch.linalg.vector_norm(b, dim=0).clamp(min=1e-4)
    per_rank = lam / r / (a_norm * b_norm)  # (r,)
    return ((b * per_rank) @ a) * w_norm


def lora_experts_delta(
    mod: AdapterModule,
    a: torch.Tensor,
    b: torch.Tensor,
    r: int,
    scaling: float,
    weight: torch.Tensor,
    out_in: bool,
) -> torch.Tensor:
    """LoRA on a 3-d parameter (``target_parameters``: a stack of E experts' weights): one rank-r pair per
    expert, A (E·r, in) read expert-major (row e·r + k) and B (out, r·E) rank-major (column k·E + e), as
    PEFT's ``ParamWrapper`` reshapes them: ``ΔW[e] = s·Σ_k B[:, k·E + e] ⊗ A[e·r + k]``, laid out (E, out, in)
    where PEFT reads the parameter so (``out_in``), else (E, in, out)."""
    experts = weight.shape[0]
    in_f, out_f = (weight.shape[2], weight.shape[1]) if out_in else (weight.shape[1], weight.shape[2])
    _check_shape(mod, "lora_A.weight", a.shape, (r * experts, in_f))
    _check_shape(mod, "lora_B.weight", b.shape, (out_f, r * experts))
    per_a = a.reshape(experts, r, in_f)  # [e, k, i]
    per_b = b.reshape(out_f, r, experts)  # [o, k, e]
    return scaling * torch.einsum("oke,eki->eoi" if out_in else "oke,eki->eio", per_b, per_a)


def bias_delta(
    mod: AdapterModule, adapter_tensors: Mapping[str, torch.Tensor], base_weights: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """``Δb = b_adapter − b_base`` in float64: the bias an adapter trained (``bias="all"``/``"lora_only"``),
    which PEFT loads over the base's, less the base checkpoint's. Exact: the difference of two float32 (or
    bfloat16, float16) numbers is a float64 number unless their exponents lie more than 29 binades apart."""
    key = mod.module + BIAS_SUFFIX
    if key not in base_weights:
        raise ValueError(
            f"module {mod.module}: the adapter saves a trained bias but the base has no '{key}'; "
            "was this adapter made for a different base model?"
        )
    trained = adapter_tensors[mod.bias_key].detach().to(device="cpu", dtype=torch.float64)
    base = base_weights[key].detach().to(device="cpu", dtype=torch.float64)
    _check_shape(mod, "bias", trained.shape, tuple(base.shape))
    return trained - base
