"""The orthogonal methods, BOFT and OFT (PEFT's ``peft/tuners/boft/`` and ``peft/tuners/oft/``): W rotated by
block-diagonal rotations made from trained skew-symmetric blocks, as float64 ΔW, the checkpoint parameters
they save, and how PEFT's layers give their rotations.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from core.methods.reading import AdapterModule, check_shape, holds, need, require_linear

PARAMS = ("oft_R.weight", "boft_R", "boft_s")
"""The parameter names OFT and BOFT save per module."""
SHARED_KEYS: dict[str, str] = {}
ADDITIVE = ()
"""None: both rotate W (their ΔW depends on it)."""


# --------------------------------------------------------------------------------------------------
# Float64 ΔW from the adapter file
# --------------------------------------------------------------------------------------------------


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
    rot = need(mod, "boft_R", tensors)
    scale = need(mod, "boft_s", tensors)
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
    check_shape(mod, "boft_s", scale.shape, (out_f, 1))

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
    skew = skew_from_upper(vec, size)
    bound = eps / math.sqrt(skew.shape[0])
    norm = torch.linalg.matrix_norm(skew).reshape(-1, 1, 1)
    projected = torch.where(norm <= bound, skew, bound * skew / norm)
    rows, cols = torch.triu_indices(size, size, 1)
    return projected[:, rows, cols]


def skew_from_upper(vec: torch.Tensor, size: int) -> torch.Tensor:
    """Skew-symmetric matrices whose strict upper triangle (row-major) is ``vec``."""
    rows, cols = torch.triu_indices(size, size, 1)
    mat = torch.zeros(vec.shape[0], size, size, dtype=vec.dtype)
    mat[:, rows, cols] = vec
    return mat - mat.mT


def oft_rotation(q: torch.Tensor, neumann: bool, terms: int) -> torch.Tensor:
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
    vec = need(mod, "oft_R.weight", tensors)
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
    check_shape(mod, "oft_R.weight", vec.shape, (1 if share else n_blocks, size * (size - 1) // 2))
    if config.get("coft"):
        vec = _oft_project(vec, size, float(config.get("eps", 6e-5)))
    rot = oft_rotation(
        skew_from_upper(vec, size),
        bool(config.get("use_cayley_neumann", True)),
        int(config.get("num_cayley_neumann_terms", 5)),
    )
    blocks = [rot[0]] * n_blocks if share else list(rot)
    full = torch.block_diag(*blocks)
    merged = (full @ weight.T).T
    return merged - weight


FORMULAS = {"boft": _boft_delta, "oft": _oft_delta}
"""Adapter type → its float64 ΔW."""


# --------------------------------------------------------------------------------------------------
# PEFT's layers
# --------------------------------------------------------------------------------------------------


def layer_kind(layer: nn.Module, adapter: str) -> str | None:
    """``boft`` or ``oft`` where ``layer`` is PEFT's BOFT or OFT layer holding ``adapter``, else None; a
    ValueError for one that is not Linear."""
    from peft.tuners.boft import layer as boft
    from peft.tuners.oft import layer as oft

    if holds(layer, adapter, "boft.layer.BOFTLayer", "boft_R"):
        return require_linear(layer, "boft", (boft.Linear,))
    if holds(layer, adapter, "oft.layer.OFTLayer", "oft_R"):
        return require_linear(layer, "oft", (oft.Linear,))
    return None


def peft_delta(layer: nn.Module, adapter_name: str, kind: str, weight: torch.Tensor) -> torch.Tensor:
    """BOFT's ``get_delta_weight`` → (rotation, scale) applied to W, OFT's → rotation applied to W, W upcast
    exactly to the adapter's dtype; OFT's coft parameters, which its ``get_weight`` writes back projected,
    restored."""
    if kind == "boft":
        rotation, scale = layer.get_delta_weight(adapter_name)
        w = weight.to(rotation.dtype)
        return torch.mm(rotation, w.t()).t() * scale - w
    module = layer.oft_R[adapter_name]
    # with coft, get_weight writes the projected parameters back: restore them afterwards
    saved = module.weight.detach().clone() if module.coft else None
    try:
        rotation = layer.get_delta_weight(adapter_name)
    finally:
        if saved is not None:
            module.weight.copy_(saved)
    w = weight.to(rotation.dtype)
    return torch.mm(rotation, w.t()).t() - w


def peft_source(layer: nn.Module, adapter: str, kind: str) -> str:
    """Which PEFT functions :func:`peft_delta` uses for this layer and adapter, in words."""
    if kind == "boft":
        how = "fbd_cuda" if getattr(layer, "fbd_cuda_available", False) else "torch.block_diag"
        return f"boft.get_delta_weight (rotation, scale) applied to W, block diagonal via {how}"
    module = layer.oft_R[adapter]
    if module.use_cayley_neumann:
        how = f"Cayley-Neumann series, {module.num_cayley_neumann_terms} terms"
    else:
        how = "exact Cayley (linalg.solve)"
    coft = ", coft projection" if module.coft else ""
    return f"oft.get_delta_weight rotation ({how}{coft}) applied to W"
