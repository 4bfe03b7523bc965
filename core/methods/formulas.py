"""Adapter math along two independent paths.

(a) :func:`reference_deltas` computes, per adapted module, the effective weight change
    ``ΔW = W_merged - W`` from the checkpoint tensors alone (adapter file + base weights), in float64
    on the CPU, with each method's merge rule written out here (HRA, MiSS, RandLoRA and DeLoRA in
    `core.methods.formulas_more`) rather than taken from PEFT's layers.
(b) `core.methods.peft_path.peft_delta` computes the same ``ΔW`` on a loaded PEFT layer, in the
    layer's dtype and on its device, with PEFT's own functions, exactly as PEFT's (unsafe, default)
    merge would, without touching the layer.

Comparing the two measures how far a device/dtype drifts from the exact math. Semantics follow the
installed PEFT 0.21.2 (``peft/tuners/<method>/layer.py``). Besides weight
deltas, a bias the adapter trained (``bias="all"``/``"lora_only"``) is a change ``Δb`` under the name
``<module>.bias``; ``lora_bias`` (LoRA's own bias on B) and IA3 scaling the bias of non-feedforward layers are
outside them.

Module names are base-model module paths as they appear in the base state dict without the
``.weight`` suffix, e.g. ``model.layers.0.self_attn.q_proj``; how checkpoint keys map to them, and the
config values per module, are in `core.methods.adapter_keys`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from core.methods import formulas_more
from core.methods.adapter_keys import (
    ADAPTER_TYPES,
    BIAS_SUFFIX,
    MERGED_TWICE,
    PARAMETER_LAYOUT,
    AdapterModule,
    UnreplicatedBase,
    _base_weight,
    _check_shape,
    _ia3_is_feedforward,
    _lora_rank_and_scaling,
    _need,
    _need_projections,
    _no_fan_in_fan_out,
    _pattern_value,
    _t,
    adapter_module_keys,
    adapter_type,
    bias_module,
    replicated_layers,
    saved_module_names,
)

ADDITIVE = ("lora", "loha", "lokr", "vera", "adalora", "fourierft", "shira", "randlora", "delora")
"""Layer kinds whose merge adds PEFT's ``get_delta_weight`` to W as it is (ΔW does not depend on W)."""


# --------------------------------------------------------------------------------------------------
# (a) Reference formulas, float64, checkpoint tensors only
# --------------------------------------------------------------------------------------------------


def _lora_embedding_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """LoRA on ``nn.Embedding``: ``(B@A)ᵀ·s`` with A ``(r, num_embeddings)`` and B ``(dim, r)``.

    Same as PEFT's ``lora.Embedding.get_delta_weight`` (which transposes unconditionally:
    fan_in_fan_out plays no part for embeddings).
    """
    a = _need(mod, "lora_embedding_A", tensors)
    b = _need(mod, "lora_embedding_B", tensors)
    r, scaling = _lora_rank_and_scaling(config, mod.module)
    num_embeddings, dim = weight.shape
    _check_shape(mod, "lora_embedding_A", a.shape, (r, num_embeddings))
    _check_shape(mod, "lora_embedding_B", b.shape, (dim, r))
    return (b @ a).T * scaling


def _lora_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """``s·B@A``, transposed for fan_in_fan_out; shapes checked against the config rank and the base."""
    if "lora_embedding_A" in mod.keys or "lora_embedding_B" in mod.keys:
        return _lora_embedding_delta(config, mod, tensors, weight)
    if "lora_B.bias" in mod.keys:
        raise ValueError(
            f"module {mod.module}: lora_bias changes the bias, which reference_deltas does not cover"
        )
    a = _need(mod, "lora_A.weight", tensors)
    b = _need(mod, "lora_B.weight", tensors)
    r, scaling = _lora_rank_and_scaling(config, mod.module)
    layout = config.get(PARAMETER_LAYOUT) or {}
    if mod.module in layout and weight.ndim == 3:
        return formulas_more.lora_experts_delta(mod, a, b, r, scaling, weight, layout[mod.module])
    if weight.ndim > 2:
        return _lora_conv_delta(mod, a, b, r, scaling, weight)
    fifo = bool(config.get("fan_in_fan_out"))
    out_f, in_f = _t(weight, fifo).shape
    _check_shape(mod, "lora_A.weight", a.shape, (r, in_f))
    _check_shape(mod, "lora_B.weight", b.shape, (out_f, r))
    return _t(scaling * (b @ a), fifo)


def _lora_conv_delta(
    mod: AdapterModule, a: torch.Tensor, b: torch.Tensor, r: int, scaling: float, weight: torch.Tensor
) -> torch.Tensor:
    """LoRA on a convolution: A is a convolution with W's kernel (r, in, *k), B a 1×1 one (out, r, 1…), so
    ``ΔW[o, i, …] = s·Σ_r B[o, r]·A[r, i, …]`` (PEFT's Conv get_delta_weight, a convolution of A by B)."""
    out_f, in_f, *kernel = weight.shape
    _check_shape(mod, "lora_A.weight", a.shape, (r, in_f, *kernel))
    _check_shape(mod, "lora_B.weight", b.shape, (out_f, r, *[1] * len(kernel)))
    return scaling * torch.einsum("or,ri...->oi...", b.reshape(out_f, r), a)


def _dora_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """``m ⊙ (W + sBA) / ‖W + sBA‖_row − W`` (the norm of each output row over the input dim).

    Same as PEFT's DoRA merge for Linear: the norm is taken of the unmerged weight plus the LoRA
    delta and is a constant there (detached), which changes nothing for the value.
    """
    if "lora_embedding_A" in mod.keys:
        raise ValueError(f"module {mod.module}: DoRA on embeddings is not supported by reference_deltas")
    fifo = bool(config.get("fan_in_fan_out"))
    lora = _t(_lora_delta(config, mod, tensors, weight), fifo)  # (out, in)
    w = _t(weight, fifo)
    magnitude = _need(mod, "lora_magnitude_vector", tensors)
    _check_shape(mod, "lora_magnitude_vector", magnitude.shape, (w.shape[0],))
    v = w + lora
    norm = torch.linalg.vector_norm(v, dim=1)
    merged = (magnitude / norm).unsqueeze(1) * v
    return _t(merged - w, fifo)


def _cayley_exact(skew: torch.Tensor) -> torch.Tensor:
    """``(I − S)(I + S)^{-1}`` for a batch of skew-symmetric matrices (solve, not an inverse)."""
    eye = torch.eye(skew.shape[-1], dtype=skew.dtype).expand_as(skew)
    # X (I + S) = (I − S)  <=>  (I + S)^T X^T = (I − S)^T
    return torch.linalg.solve((eye + skew).mT, (eye - skew).mT).mT


def _boft_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """BOFT: ``W' = (R @ Wᵀ)ᵀ · s`` with R the product of permuted block-diagonal Cayley rotations.

    The butterfly depth is read from ``boft_R``'s shape (N, blocks, size, size), not from the config:
    PEFT silently builds N = 1 when its ``fbd_cuda`` extension cannot be compiled (any CPU-only
    install), whatever ``boft_n_butterfly_factor`` says, so the tensor records what was trained.
    """
    from peft.tuners.boft.layer import BOFTLayer  # integer permutation structure only

    if config.get("fan_in_fan_out"):
        raise ValueError(
            f"module {mod.module}: BOFT with fan_in_fan_out is not supported by reference_deltas"
        )
    rot = _need(mod, "boft_R", tensors)
    scale = _need(mod, "boft_s", tensors)
    if rot.ndim != 4 or rot.shape[2] != rot.shape[3]:
        raise ValueError(
            f"module {mod.module}: boft_R has shape {tuple(rot.shape)}, expected (N, blocks, b, b)"
        )
    n_factors, n_blocks, size, _ = rot.shape
    out_f, in_f = weight.shape
    if n_blocks * size != in_f:
        raise ValueError(
            f"module {mod.module}: boft_R has shape {tuple(rot.shape)}, i.e. {n_blocks}x{size} = "
            f"{n_blocks * size} rotated features, but the base weight has in_features {in_f}; "
            "was this adapter made for a different base model?"
        )
    _check_shape(mod, "boft_s", scale.shape, (out_f, 1))

    skew = 0.5 * (rot - rot.mT)
    blocks = _cayley_exact(skew.reshape(-1, size, size)).reshape(n_factors, n_blocks, size, size)
    total = torch.eye(in_f, dtype=torch.float64)
    for i in range(n_factors):
        block_diag = torch.block_diag(*blocks[i])
        # perm2mat(idx) = P with P[j, idx[j]] = 1, so P M Pᵀ = M[idx][:, idx]
        idx = BOFTLayer.block_butterfly_perm(None, in_f, n_blocks // 2**i, size // 2, n_factors - 1)
        factor = block_diag[idx][:, idx]
        total = factor @ total  # PEFT: mat = batch[i] @ mat
    merged = (total @ weight.T).T * scale
    return merged - weight


def _oft_project(vec: torch.Tensor, size: int, eps: float) -> torch.Tensor:
    """COFT's projection: shrink each skew block to Frobenius norm ≤ eps/sqrt(#blocks)."""
    skew = _skew_from_upper(vec, size)
    bound = eps / math.sqrt(skew.shape[0])
    norm = torch.linalg.matrix_norm(skew).reshape(-1, 1, 1)
    projected = torch.where(norm <= bound, skew, bound * skew / norm)
    rows, cols = torch.triu_indices(size, size, 1)
    return projected[:, rows, cols]


def _skew_from_upper(vec: torch.Tensor, size: int) -> torch.Tensor:
    """Skew-symmetric matrices whose strict upper triangle (row-major) is ``vec``."""
    rows, cols = torch.triu_indices(size, size, 1)
    mat = torch.zeros(vec.shape[0], size, size, dtype=vec.dtype)
    mat[:, rows, cols] = vec
    return mat - mat.mT


def _oft_rotation(q: torch.Tensor, neumann: bool, terms: int) -> torch.Tensor:
    """OFT block rotations from skew blocks ``q``, as PEFT 0.21's ``OFTRotationModule._cayley_batch``.

    Exact: ``(I − Q)(I + Q)^{-1}``. Neumann: PEFT's truncated series
    ``I + 2Q + 2Q² + … + 2Q^k + Q^{k+1}`` with ``k = max(2, terms − 2)`` (terms ≥ 3), ``I + 2Q``
    (terms = 2), ``I`` (terms ≤ 1). It approximates ``(I + Q)(I − Q)^{-1}``, the transpose of the exact
    form: the two settings rotate in opposite directions for the same parameters, and terms = 3 and
    terms = 4 give the same matrix. Both quirks are PEFT's and reproduced on purpose.
    """
    eye = torch.eye(q.shape[-1], dtype=q.dtype).expand_as(q)
    if not neumann:
        return _cayley_exact(q)
    if terms <= 1:
        return eye.clone()
    result = eye + 2.0 * q
    if terms == 2:
        return result
    top = max(2, terms - 2)
    power = q
    for _ in range(2, top + 1):
        power = power @ q
        result = result + 2.0 * power
    return result + power @ q


def _oft_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """OFT: ``W' = (R @ Wᵀ)ᵀ`` with R block-diagonal (one shared block repeated with ``block_share``).

    The block size is read from the number of upper-triangle entries per row of ``oft_R.weight``
    (PEFT may have adjusted ``oft_block_size`` per layer). With ``coft`` the projection is applied
    first: PEFT's ``get_weight`` (hence merge) applies it too, not only the training forward.
    """
    if config.get("fan_in_fan_out"):
        raise ValueError(f"module {mod.module}: OFT with fan_in_fan_out is not supported by reference_deltas")
    vec = _need(mod, "oft_R.weight", tensors)
    out_f, in_f = weight.shape
    if vec.ndim != 2:
        raise ValueError(
            f"module {mod.module}: oft_R.weight has shape {tuple(vec.shape)}, expected (blocks, n)"
        )
    size = int(round((1 + math.sqrt(1 + 8 * vec.shape[1])) / 2))
    if size * (size - 1) // 2 != vec.shape[1] or size < 2 or in_f % size:
        raise ValueError(
            f"module {mod.module}: oft_R.weight has shape {tuple(vec.shape)}, which is no block size "
            f"dividing in_features {in_f}; was this adapter made for a different base model?"
        )
    n_blocks = in_f // size
    share = bool(config.get("block_share"))
    _check_shape(mod, "oft_R.weight", vec.shape, (1 if share else n_blocks, size * (size - 1) // 2))
    if config.get("coft"):
        vec = _oft_project(vec, size, float(config.get("eps", 6e-5)))
    rot = _oft_rotation(
        _skew_from_upper(vec, size),
        bool(config.get("use_cayley_neumann", True)),
        int(config.get("num_cayley_neumann_terms", 5)),
    )
    blocks = [rot[0]] * n_blocks if share else list(rot)
    full = torch.block_diag(*blocks)
    merged = (full @ weight.T).T
    return merged - weight


def _ia3_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """IA3: ``W' = W ⊙ l``, ``l`` broadcast over the input dim for feedforward modules, else the output dim."""
    vec = _need(mod, "ia3_l", tensors)
    fifo = bool(config.get("fan_in_fan_out"))
    out_f, in_f = _t(weight, fifo).shape
    want = (1, in_f) if _ia3_is_feedforward(config, mod.module) else (out_f, 1)
    _check_shape(mod, "ia3_l", vec.shape, want)
    return weight * _t(vec, fifo) - weight


def _lycoris_scaling(config: Mapping[str, Any], module: str) -> tuple[int, float]:
    """LoHa/LoKr rank and scaling ``alpha / r`` (config keys ``r``, ``alpha``, their patterns honoured)."""
    r = int(_pattern_value(config.get("rank_pattern"), module, config.get("r", 8)))
    alpha = float(_pattern_value(config.get("alpha_pattern"), module, config.get("alpha", 8)))
    return r, alpha / r


def _no_conv(mod: AdapterModule, params: tuple[str, ...]) -> None:
    """ValueError for the Tucker (conv) tensors of LoHa/LoKr: only Linear layers are covered."""
    found = [p for p in params if p in mod.keys]
    if found:
        raise ValueError(
            f"module {mod.module}: {', '.join(found)} belong to a convolution, "
            "which reference_deltas does not cover"
        )


def _loha_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """LoHa: ``(W1a @ W1b) ⊙ (W2a @ W2b) · alpha/r`` (Hadamard product of two rank-r products)."""
    _no_conv(mod, ("hada_t1", "hada_t2"))
    w1a, w1b = _need(mod, "hada_w1_a", tensors), _need(mod, "hada_w1_b", tensors)
    w2a, w2b = _need(mod, "hada_w2_a", tensors), _need(mod, "hada_w2_b", tensors)
    r, scaling = _lycoris_scaling(config, mod.module)
    out_f, in_f = weight.shape
    for name, t, want in (
        ("hada_w1_a", w1a, (out_f, r)),
        ("hada_w1_b", w1b, (r, in_f)),
        ("hada_w2_a", w2a, (out_f, r)),
        ("hada_w2_b", w2b, (r, in_f)),
    ):
        _check_shape(mod, name, t.shape, want)
    return (w1a @ w1b) * (w2a @ w2b) * scaling


def _lokr_factor(mod: AdapterModule, tensors: Mapping[str, torch.Tensor], which: str) -> torch.Tensor:
    """LoKr factor ``which`` (``w1``/``w2``): stored whole, or as the product of its two low-rank halves."""
    if f"lokr_{which}" in mod.keys:
        return _need(mod, f"lokr_{which}", tensors)
    a, b = _need(mod, f"lokr_{which}_a", tensors), _need(mod, f"lokr_{which}_b", tensors)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(
            f"module {mod.module}: lokr_{which}_a {tuple(a.shape)} and lokr_{which}_b {tuple(b.shape)} "
            "do not multiply"
        )
    return a @ b


def _lokr_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """LoKr: ``(W1 ⊗ W2) · alpha/r``, each factor stored whole or as a rank-r product.

    The Kronecker product is written out as ``ΔW[i·p + k, j·q + l] = W1[i, j] · W2[k, l]`` for W2 of
    shape (p, q), not taken from ``torch.kron``.
    """
    _no_conv(mod, ("lokr_t2",))
    w1, w2 = _lokr_factor(mod, tensors, "w1"), _lokr_factor(mod, tensors, "w2")
    _, scaling = _lycoris_scaling(config, mod.module)
    (a, c), (p, q) = w1.shape, w2.shape
    _check_shape(mod, "lokr_w1 ⊗ lokr_w2", (a * p, c * q), tuple(weight.shape))
    kron = (w1[:, None, :, None] * w2[None, :, None, :]).reshape(a * p, c * q)
    return kron * scaling


def _vera_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """VeRA: ``(λb · B[:out]) @ (λd · A[:, :in])``, transposed for fan_in_fan_out.

    A (r, ≥in) and B (≥out, r) are the random projections all modules share, sliced to this module;
    λb (out) and λd (r) are its own trained vectors, scaling B's rows and A's rows.
    """
    _need_projections(mod, "vera")
    proj_a, proj_b = _need(mod, "vera_A", tensors), _need(mod, "vera_B", tensors)
    lambda_b, lambda_d = _need(mod, "vera_lambda_b", tensors), _need(mod, "vera_lambda_d", tensors)
    fifo = bool(config.get("fan_in_fan_out"))
    out_f, in_f = _t(weight, fifo).shape
    r = lambda_d.shape[0]
    if proj_a.ndim != 2 or proj_a.shape[0] != r or proj_a.shape[1] < in_f:
        raise ValueError(
            f"module {mod.module}: vera_A has shape {tuple(proj_a.shape)}, expected ({r}, ≥{in_f}); "
            "was this adapter made for a different base model?"
        )
    if proj_b.ndim != 2 or proj_b.shape[1] != r or proj_b.shape[0] < out_f:
        raise ValueError(
            f"module {mod.module}: vera_B has shape {tuple(proj_b.shape)}, expected (≥{out_f}, {r}); "
            "was this adapter made for a different base model?"
        )
    _check_shape(mod, "vera_lambda_b", lambda_b.shape, (out_f,))
    delta = (lambda_b[:, None] * proj_b[:out_f]) @ (lambda_d[:, None] * proj_a[:, :in_f])
    return _t(delta, fifo)


def _adalora_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """AdaLoRA: ``B @ (A ⊙ E) · s / (init_r + 1e-5)``, transposed for fan_in_fan_out.

    ``s`` is ``lora_alpha`` (the stored rank where lora_alpha ≤ 0). The divisor is PEFT's ``ranknum``,
    which it never saves: it is ``init_r`` whatever rank the budget left the module (PEFT copies the old
    ranknum over when it prunes to ``rank_pattern``), plus PEFT's 1e-5.
    """
    a, b, e = _need(mod, "lora_A", tensors), _need(mod, "lora_B", tensors), _need(mod, "lora_E", tensors)
    fifo = bool(config.get("fan_in_fan_out"))
    out_f, in_f = _t(weight, fifo).shape
    r = a.shape[0]
    _check_shape(mod, "lora_A", a.shape, (r, in_f))
    _check_shape(mod, "lora_B", b.shape, (out_f, r))
    _check_shape(mod, "lora_E", e.shape, (r, 1))
    alpha = float(config.get("lora_alpha", 8))
    scaling = alpha if alpha > 0 else float(r)
    ranknum = float(config.get("init_r", 12))
    return _t(b @ (a * e), fifo) * scaling / (ranknum + 1e-5)


def _fourierft_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """FourierFT: the real part of the inverse 2-D DFT of a spectrum that is zero but at n frequencies,
    times ``scaling``: ``ΔW[m, n] = s/(MN)·Σ_k c_k·cos(2π(m·u_k/M + n·v_k/N))``, written as cosines and
    sines (no FFT). The frequencies (u_k, v_k) are not saved: PEFT draws them as the first n of
    ``randperm(M·N)`` from ``random_loc_seed``, which this reproduces."""
    _no_fan_in_fan_out(config, mod, "FourierFT")
    spectrum = _need(mod, "fourierft_spectrum", tensors)
    rows, cols = weight.shape
    n = int(_pattern_value(config.get("n_frequency_pattern"), mod.module, config.get("n_frequency", 1000)))
    _check_shape(mod, "fourierft_spectrum", spectrum.shape, (n,))
    generator = torch.Generator().manual_seed(int(config.get("random_loc_seed", 777)))
    flat = torch.randperm(rows * cols, generator=generator)[:n]
    u, v = (flat // cols).double(), (flat % cols).double()
    a = 2 * math.pi * torch.outer(torch.arange(rows, dtype=torch.float64), u) / rows  # (M, n)
    b = 2 * math.pi * torch.outer(torch.arange(cols, dtype=torch.float64), v) / cols  # (N, n)
    # cos(a + b) = cos a cos b − sin a sin b, summed over the frequencies with their coefficients
    total = (torch.cos(a) * spectrum) @ torch.cos(b).T - (torch.sin(a) * spectrum) @ torch.sin(b).T
    return total * float(config.get("scaling", 150.0)) / (rows * cols)


def _shira_delta(
    config: Mapping[str, Any], mod: AdapterModule, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor
) -> torch.Tensor:
    """SHiRA: a sparse ΔW, ``shira_weight`` at the positions ``shira_indices`` (2, k) lists, zero elsewhere
    (PEFT's scale, 1 on load, is not saved)."""
    _no_fan_in_fan_out(config, mod, "SHiRA")
    values = _need(mod, "shira_weight", tensors)
    index = tensors[mod.keys["shira_indices"]].long() if "shira_indices" in mod.keys else None
    if index is None or index.shape != (2, values.shape[0]):
        raise ValueError(f"module {mod.module}: shira_indices missing or not (2, {values.shape[0]})")
    delta = torch.zeros(weight.shape, dtype=torch.float64)
    return delta.index_put_((index[0], index[1]), values, accumulate=True)  # repeated positions add up


_FORMULAS = {
    "lora": _lora_delta,
    "pissa": _lora_delta,
    "dora": _dora_delta,
    "boft": _boft_delta,
    "oft": _oft_delta,
    "ia3": _ia3_delta,
    "loha": _loha_delta,
    "lokr": _lokr_delta,
    "vera": _vera_delta,
    "adalora": _adalora_delta,
    "fourierft": _fourierft_delta,
    "shira": _shira_delta,
    "hra": formulas_more.hra_delta,
    "miss": formulas_more.miss_delta,
    "randlora": formulas_more.randlora_delta,
    "delora": formulas_more.delora_delta,
}


def reference_deltas(
    adapter_config: Mapping[str, Any],
    adapter_tensors: Mapping[str, torch.Tensor],
    base_weights: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Per adapted module, ``ΔW = W_merged − W`` in float64 on the CPU, from checkpoint tensors only.

    ``adapter_config`` is the ``adapter_config.json`` dict, ``adapter_tensors`` the adapter file as
    ``safetensors.torch.load_file`` returns it, ``base_weights`` the base model's state dict. Keys of
    the result are module paths (``model.layers.0.self_attn.q_proj``), and ``<module>.bias`` for a bias the
    adapter trained (`formulas_more.bias_delta`: Δb, read against the base's ``<module>.bias``). Rules:

    * LoRA / PiSSA: ``s·B@A``, ``s = alpha/r`` (``alpha/sqrt(r)`` with rsLoRA), rank_pattern and
      alpha_pattern honoured, transposed with fan_in_fan_out; on embeddings ``s·(B@A)ᵀ`` from
      ``lora_embedding_A``/``lora_embedding_B``; on convolutions ``s·Σ_r B[:, r]·A[r]`` over the kernel; on
      a parameter (``target_parameters``, keyed by its path) ``s·B@A``, per expert for a stack of experts.
      For PiSSA this is the change relative to
      the *residual* base PEFT computes in memory when it loads the adapter (``W − top-r SVD``), which
      is what PEFT's ``get_delta_weight`` and merge add; see :func:`merged_weights`.
    * DoRA: ``m ⊙ (W + sBA)/‖W + sBA‖ − W`` with a per-output-row norm.
    * BOFT: ``(R Wᵀ)ᵀ·s − W``; OFT: ``(R Wᵀ)ᵀ − W`` (see the private helpers for the rotations).
    * IA3: ``W ⊙ l − W``.
    * LoHa ``(W1a W1b) ⊙ (W2a W2b)·alpha/r``; LoKr ``(W1 ⊗ W2)·alpha/r``; VeRA ``(λb·B)(λd·A)`` with the
      shared projections sliced to the module; AdaLoRA ``B(A ⊙ E)·alpha/(init_r + 1e-5)`` (Linear only).
    * FourierFT: the real inverse DFT of its sparse spectrum, times ``scaling``; SHiRA: its sparse values.
    * HRA ``W·H − W`` (H: Householder reflections); MiSS its block added to W's input slices (``bat``:
      ``W_ac·B_a + B_a`` per block); RandLoRA the scaled shared random bases' product; DeLoRA
      ``B·diag(λ/(r‖A‖‖B‖))·A`` scaled per input column by the saved norms of W (`core.methods.formulas_more`).

    Raises ``ValueError`` naming the module and key when a tensor is missing, a shape does not fit
    the base weight (an adapter made for another base), or the method is not supported.
    """
    kind = adapter_type(adapter_config)
    formula = _FORMULAS.get(kind)
    if formula is None:
        raise ValueError(f"adapter type '{kind}' is not supported (supported: {', '.join(ADAPTER_TYPES)})")
    modules = adapter_module_keys(adapter_tensors, saved_module_names(adapter_config))
    if not modules:
        raise ValueError("adapter checkpoint holds no adapter tensors")
    base_weights = _as_loaded(adapter_config, base_weights)
    out = {}
    with torch.no_grad():
        for name, mod in modules.items():
            if mod.bias_key is not None:
                out[name + BIAS_SUFFIX] = formulas_more.bias_delta(mod, adapter_tensors, base_weights)
            if not mod.changes_weight:
                continue
            weight = _module_base_weight(mod, adapter_tensors, base_weights)
            # a convolution's (and a stack of experts') ΔW is written out for plain LoRA; the other rules are for
            # Linear layers
            if weight.ndim != 2 and (kind != "lora" or base_rewriting_init(adapter_config)):
                raise ValueError(
                    f"module {mod.module}: only 2-d (Linear) weights are supported for {kind}, "
                    f"got {tuple(weight.shape)}"
                )
            out[name] = formula(adapter_config, mod, adapter_tensors, weight)
    return out


def _as_loaded(
    adapter_config: Mapping[str, Any], base_weights: Mapping[str, torch.Tensor]
) -> Mapping[str, torch.Tensor]:
    """The base weights by the names the adapter's model has: a LoRA with ``layer_replication`` sees the
    base's layers expanded (each copy reads the layer it copies), any other the base's own names."""
    order = replicated_layers(adapter_config)
    return UnreplicatedBase(base_weights, order) if order else base_weights


def _module_base_weight(
    mod: AdapterModule, adapter_tensors: Mapping[str, torch.Tensor], base_weights: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """The float64 W the adapter is applied to: the adapter's own copy of the base layer when it saved
    one (PEFT loads that copy over the base's), else the base checkpoint's weight."""
    if "base_layer.weight" in mod.keys:
        return _need(mod, "base_layer.weight", adapter_tensors)
    return _base_weight(mod, base_weights)


def pissa_residual(weight: torch.Tensor, r: int) -> torch.Tensor:
    """``W`` minus its best rank-``r`` approximation (exact SVD, float64): PiSSA's residual base weight.

    PEFT computes the same in float32 (``init_lora_weights="pissa"``) or with a randomized
    ``svd_lowrank`` (``"pissa_niter_K"``), so its residual differs from this at float32 level or by
    the randomized approximation error. Sign ambiguities of singular vectors cancel in the product.
    """
    w = weight.detach().to(device="cpu", dtype=torch.float64)
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    return w - u[:, :r] @ torch.diag(s[:r]) @ vh[:r]


def olora_residual(weight: torch.Tensor, r: int, scaling: float) -> torch.Tensor:
    """``W − scaling·Q_r R_r`` from the QR decomposition ``W = QR`` (float64): OLoRA's residual base weight.

    PEFT (``init_lora_weights="olora"``) computes the same in float32. A sign flip of a column of Q
    comes with the same flip of that row of R, so the product does not depend on it.
    """
    w = weight.detach().to(device="cpu", dtype=torch.float64)
    q, rr = torch.linalg.qr(w)
    return w - scaling * (q[:, :r] @ rr[:r])


def base_rewriting_init(adapter_config: Mapping[str, Any]) -> str | None:
    """``pissa`` or ``olora`` for a LoRA whose init rewrites the base weight on load, else None."""
    init = adapter_config.get("init_lora_weights")
    if not isinstance(init, str):
        return None
    init = init.lower()
    return "pissa" if init.startswith("pissa") else "olora" if init == "olora" else None


# What a base-rewriting init computes on the load device when PEFT loads the adapter, in words
_REWRITES = {"pissa": "SVD on the load device", "olora": "QR on the load device"}


def base_rewrite(adapter_config: Mapping[str, Any]) -> str | None:
    """How a LoRA whose init rewrites the base weight at load computes the new one, in words
    (``SVD on the load device``); None for an adapter that leaves the base as the checkpoint has it."""
    init = base_rewriting_init(adapter_config)
    if init is None:
        return None
    if "_niter_" in str(adapter_config.get("init_lora_weights")):
        return "randomised SVD on the load device"
    return _REWRITES[init]


def rewritten_base(adapter_config: Mapping[str, Any], module: str, weight: torch.Tensor) -> torch.Tensor:
    """The weight PEFT writes into ``module``'s base layer when it loads the adapter, in float64 from
    the checkpoint's ``weight``: PiSSA's residual (exact SVD; ``pissa_niter_K``'s randomised SVD
    differs from it by its approximation error) or OLoRA's. ValueError for an init that rewrites none."""
    init = base_rewriting_init(adapter_config)
    fifo = bool(adapter_config.get("fan_in_fan_out"))
    r, scaling = _lora_rank_and_scaling(adapter_config, module)
    w = _t(weight.to(torch.float64), fifo)
    if init == "pissa":
        return _t(pissa_residual(w, r), fifo)
    if init == "olora":
        return _t(olora_residual(w, r, scaling), fifo)
    raise ValueError(
        f"the adapter's init ({adapter_config.get('init_lora_weights')!r}) rewrites no base weight"
    )


def merged_weights(
    adapter_config: Mapping[str, Any],
    adapter_tensors: Mapping[str, torch.Tensor],
    base_weights: Mapping[str, torch.Tensor],
    deltas: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Per adapted module, the merged weight ``W + ΔW`` in float64 (keys as :func:`reference_deltas`).

    For PiSSA, ``W`` is the residual :func:`pissa_residual` of the given base weight (what PEFT puts
    in the base layer when it loads a PiSSA adapter), for OLoRA :func:`olora_residual`, so the result
    is what ``merge_and_unload`` gives.
    ``deltas``: :func:`reference_deltas` of the same inputs, where the caller has already computed them.
    """
    if deltas is None:
        deltas = reference_deltas(adapter_config, adapter_tensors, base_weights)
    kind = adapter_type(adapter_config)
    fifo = bool(adapter_config.get("fan_in_fan_out"))
    modules = adapter_module_keys(adapter_tensors, saved_module_names(adapter_config))
    base_weights = _as_loaded(adapter_config, base_weights)
    out: dict[str, torch.Tensor] = {}
    for name, delta in deltas.items():
        module = bias_module(name)
        if module is not None:  # the merged bias is the trained one, which PEFT loaded over the base's
            out[name] = adapter_tensors[modules[module].bias_key].detach().to("cpu", torch.float64)
            continue
        weight = _module_base_weight(modules[name], adapter_tensors, base_weights)
        if kind == "pissa":
            r, _ = _lora_rank_and_scaling(adapter_config, name)
            weight = _t(pissa_residual(_t(weight, fifo), r), fifo)
        elif kind == "lora" and base_rewriting_init(adapter_config) == "olora":
            r, scaling = _lora_rank_and_scaling(adapter_config, name)
            weight = _t(olora_residual(_t(weight, fifo), r, scaling), fifo)
        # nn.MultiheadAttention's out_proj: PEFT adds its ΔW twice (adapter_keys.OUT_PROJ_TWICE)
        out[name] = weight + 2 * delta if name in adapter_config.get(MERGED_TWICE, ()) else weight + delta
    return out


def sequential_merged_weights(
    adapters: list[tuple[Mapping[str, Any], Mapping[str, torch.Tensor]]],
    base_weights: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Merged weights after merging several adapters one after another, in float64.

    ``adapters`` is a list of ``(adapter_config, adapter_tensors)`` in merge order. Each adapter's
    merge rule is applied to the weight the previous merges left (``W₁ = W₀ + ΔW₁(W₀)``,
    ``W₂ = W₁ + ΔW₂(W₁)``, …), which is what merging them into one model does: the multiplicative
    methods (DoRA, BOFT, OFT, IA3) rotate or scale the already merged weight. Keys are the modules
    any of the adapters adapts; PiSSA is refused because its residual base would have to be taken
    of an already merged weight, which no PEFT load does.
    """
    current = dict(base_weights)
    touched: set[str] = set()
    for config, tensors in adapters:
        if base_rewriting_init(config):
            raise ValueError(
                f"{base_rewriting_init(config)} cannot be merged after another adapter: its base is a residual of W"
            )
        merged = merged_weights(config, tensors, current)
        for name, weight in merged.items():
            current[_base_name(name)] = weight
            touched.add(name)
    return {name: current[_base_name(name)] for name in sorted(touched)}


def _base_name(name: str) -> str:
    """The base tensor a merged name stands for: a bias change's name is the bias, a module's its weight."""
    return name if bias_module(name) is not None else name + ".weight"
