"""The orthogonal methods, BOFT and OFT (PEFT's ``peft/tuners/boft/`` and ``peft/tuners/oft/``): W rotated by
block-diagonal rotations made from trained skew-symmetric blocks, as float64 ΔW, the checkpoint parameters
they save, and how PEFT's layers give their rotations.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
from collections.abc import Mapping
from pathlib import Path
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


# --------------------------------------------------------------------------------------------------
# PEFT's fbd_cuda build: attempted once per machine while it fails
# --------------------------------------------------------------------------------------------------

FBD_CUDA_SOURCES = ("fbd/fbd_cuda.cpp", "fbd/fbd_cuda_kernel.cu")
"""PEFT's sources of the extension, under ``peft/tuners/boft/``."""


def fbd_cuda_build_key() -> str:
    """sha256 of what decides whether PEFT's ``fbd_cuda`` JIT build succeeds: torch, CUDA and PEFT
    versions, the extension's sources, the Python headers, and the compilers and ninja torch would
    find (path, size, mtime), with the environment variables torch's build reads."""
    import peft.tuners.boft.layer as boft_layer

    def stat(path: str | None) -> list[Any] | None:
        try:
            st = os.stat(path) if path else None
        except OSError:
            return None
        return None if st is None else [os.path.realpath(path), st.st_size, st.st_mtime_ns]

    # where torch's cpp_extension looks for nvcc (its _find_cuda_home)
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else shutil.which("nvcc")
    nvcc = nvcc or "/usr/local/cuda/bin/nvcc"
    here = Path(boft_layer.__file__).parent
    sources = [
        hashlib.sha256((here / s).read_bytes()).hexdigest() if (here / s).is_file() else None
        for s in FBD_CUDA_SOURCES
    ]
    env = ("TORCH_CUDA_ARCH_LIST", "TORCH_EXTENSIONS_DIR", "TORCH_DONT_CHECK_COMPILER_ABI", "MAX_JOBS")
    blob = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "peft": getattr(sys.modules.get("peft"), "__version__", None),
        "python": sysconfig.get_paths().get("include"),
        "sources": sources,
        "nvcc": stat(nvcc),
        "gcc": stat(shutil.which("gcc")),
        "ninja": stat(shutil.which("ninja")),
        "env": {k: os.environ.get(k) for k in env},
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


FBD_CUDA_MARKERS = Path("~/.cache/weightdrift/fbd_cuda")
"""Where `remember_fbd_cuda_failure` keeps its markers (beside the kernel's numba cache)."""


def remember_fbd_cuda_failure(marker_dir: Path | None = None) -> None:
    """Let PEFT attempt its ``fbd_cuda`` build once per machine while it fails, not once per BOFT layer.

    Each BOFT layer PEFT builds calls ``get_fbd_cuda()``; a failed build leaves PEFT's cache at None,
    so the next layer compiles again (on an H200 machine whose nvcc rejects PEFT 0.21.2's kernel under
    torch 2.11: 5.7–8.7 s per BOFT adapter load, in every task). Here the first failure in a process is
    kept as PEFT's cache (False: the same ``torch.block_diag`` path for every later layer) and written
    as a marker under ``marker_dir`` keyed by `fbd_cuda_build_key`; a process that finds its key's
    marker takes that path without compiling. A build that succeeds is PEFT's as before. Idempotent."""
    import peft.tuners.boft.layer as boft_layer

    if boft_layer._FBD_CUDA is not None or getattr(boft_layer.get_fbd_cuda, "remembers_failure", False):
        return
    try:
        directory = (marker_dir or FBD_CUDA_MARKERS).expanduser()
        marker: Path | None = directory / f"{fbd_cuda_build_key()}.failed"
        if marker.is_file():
            boft_layer._FBD_CUDA = False
            return
    except (OSError, RuntimeError):  # no home, or a cache it may not read: remembered in this process only
        marker = None
    attempt = boft_layer.get_fbd_cuda

    def get_fbd_cuda():
        if boft_layer._FBD_CUDA is not None:
            return boft_layer._FBD_CUDA
        extension = attempt()
        if extension is None:  # PEFT's build failed (it warned why): keep the answer
            boft_layer._FBD_CUDA = False
            if marker is not None:
                try:
                    marker.parent.mkdir(parents=True, exist_ok=True)
                    tmp = marker.with_suffix(f".{os.getpid()}")
                    tmp.write_text("PEFT's fbd_cuda build failed for this key; delete to build again\n")
                    tmp.replace(marker)
                except OSError:
                    pass  # a read-only cache: every process attempts once
        return extension

    get_fbd_cuda.remembers_failure = True
    boft_layer.get_fbd_cuda = get_fbd_cuda
