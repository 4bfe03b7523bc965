"""What a language-model head's logits say, against a reference's: the KL divergence of the next-token
distributions, top-1 agreement and top-5 overlap per position (the convention of llama.cpp's
`perplexity --kl-divergence`), in float64, over the positions a mask keeps (padding excluded)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOP_K = 5  # the k of `top5_overlap`


@dataclass(frozen=True)
class Behaviour:
    """Per position (the mask's kept ones, row by row): KL(p_ref ‖ p_target), whether the argmaxes
    agree, and how many of the reference's top-5 tokens are among the target's top 5."""

    kl: torch.Tensor  # float64, one per kept position
    top1: torch.Tensor  # bool
    top5: torch.Tensor  # int64, 0 … 5
    rows: torch.Tensor  # int64: the probe row of each kept position
    positions: torch.Tensor  # int64: its position in the row
    k: int = TOP_K  # fewer where the vocabulary has fewer tokens

    def summary(self) -> dict[str, float]:
        """`kl_mean`, `kl_max`, `top1_agree` (share of positions) and `top5_overlap`
        (mean |top5_ref ∩ top5_target| / 5) — the columns of an outputs row."""
        return {
            "kl_mean": float(self.kl.mean()),
            "kl_max": float(self.kl.max()),
            "top1_agree": float(self.top1.double().mean()),
            "top5_overlap": float(self.top5.double().mean() / self.k),
        }


def next_token_behaviour(
    reference: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None
) -> Behaviour:
    """Compare (batch, positions, vocab) logits position by position where `mask` (batch, positions)
    is non-zero: KL(p_ref ‖ p_target) = Σ p_ref (log p_ref − log p_target) of the softmax
    distributions, both computed in float64 (a zero-probability reference token adds nothing).

    ValueError when the shapes differ, the logits are not 3-D, or the mask keeps no position.
    """
    if reference.shape != target.shape or reference.dim() != 3:
        raise ValueError(
            f"logits of shape {tuple(reference.shape)} and {tuple(target.shape)}: expected the same "
            "(batch, positions, vocab) shape"
        )
    if mask is None:
        mask = torch.ones(reference.shape[:2], dtype=torch.long)
    keep = mask.to(torch.bool).cpu()
    if keep.shape != reference.shape[:2] or not bool(keep.any()):
        raise ValueError(f"the mask of shape {tuple(keep.shape)} keeps no position of these logits")
    rows, positions = keep.nonzero(as_tuple=True)
    ref = reference.detach().cpu()[rows, positions].to(torch.float64)
    tgt = target.detach().cpu()[rows, positions].to(torch.float64)
    log_ref = torch.log_softmax(ref, dim=-1)
    log_tgt = torch.log_softmax(tgt, dim=-1)
    p_ref = log_ref.exp()
    # where p_ref underflows to 0 its term is 0 (0 · log 0 = 0), whatever log p_target is
    terms = torch.where(p_ref > 0, p_ref * (log_ref - log_tgt), torch.zeros_like(p_ref))
    kl = terms.sum(dim=-1)
    k = min(TOP_K, ref.shape[-1])
    top_ref = ref.topk(k, dim=-1).indices
    top_tgt = tgt.topk(k, dim=-1).indices
    overlap = (top_ref.unsqueeze(-1) == top_tgt.unsqueeze(-2)).any(dim=-1).sum(dim=-1)
    return Behaviour(
        kl=kl,
        top1=ref.argmax(dim=-1) == tgt.argmax(dim=-1),
        top5=overlap.to(torch.int64),
        rows=rows,
        positions=positions,
        k=k,
    )
