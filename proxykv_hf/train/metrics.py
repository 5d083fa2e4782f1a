"""Top-K retention metrics for score vectors (pure torch; shared by training and the eval harness).

All functions take rows of scores ``(..., N)`` (higher means keep) and an optional ``mask`` of real tokens,
either the same shape or ``(B, N)`` broadcast over the middle dimensions of ``(B, ..., N)``. Per row,
``K = ceil(keep_ratio * N_valid)`` and ties break by position (earlier token wins), as in selection.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["expand_mask", "mass_recovery", "order_desc", "rank_desc", "topk_count", "topk_mask", "topk_recall"]


def expand_mask(mask: Tensor | None, like: Tensor) -> Tensor:
    """Boolean mask shaped like ``like`` ``(..., N)``; accepts ``None``, the same shape, or ``(B, N)``."""
    if mask is None:
        return torch.ones_like(like, dtype=torch.bool)
    mask = mask.bool()
    if mask.shape != like.shape and mask.dim() == 2 and like.dim() > 2 and mask.shape[0] == like.shape[0]:
        mask = mask.view(mask.shape[0], *([1] * (like.dim() - 2)), mask.shape[-1])  # (B, 1, ..., N)
    try:
        return mask.expand_as(like)
    except RuntimeError:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not fit scores {tuple(like.shape)}") from None


def topk_count(n_valid: Tensor, keep_ratio: float) -> Tensor:
    """``ceil(keep_ratio * n_valid)`` per row, robust to float error (0.1 * 30 gives 3, not 4)."""
    if not 0 < keep_ratio <= 1:
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio}")
    return torch.ceil(n_valid.double() * keep_ratio - 1e-9).long().clamp_min(0)


def order_desc(scores: Tensor, valid: Tensor) -> Tensor:
    """Token indices of each row sorted best first: real tokens before padding, ties by position.

    Args:
        scores: ``(R, N)``.
        valid: ``(R, N)`` bool.

    Returns:
        ``(R, N)`` long, ``order[r, k]`` = token at rank ``k`` of row ``r``.
    """
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices  # (R, N)
    by_valid = torch.sort(valid.gather(-1, order).to(torch.uint8), dim=-1, descending=True, stable=True).indices
    return order.gather(-1, by_valid)  # (R, N)


def rank_desc(scores: Tensor, valid: Tensor) -> Tensor:
    """Inverse of :func:`order_desc`: ``(R, N)`` rank of each token in its row (0 = best)."""
    return ranks_of(order_desc(scores, valid))


def ranks_of(order: Tensor) -> Tensor:
    """Inverse permutation of ``order`` (e.g. from :func:`order_desc`): ``(R, N)`` rank of each token (0 = first)."""
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return ranks


def topk_mask(scores: Tensor, keep_ratio: float, mask: Tensor | None = None) -> Tensor:
    """Boolean ``(..., N)``: the ``ceil(keep_ratio * N_valid)`` highest-scoring real tokens of each row."""
    valid = expand_mask(mask, scores)
    flat, fvalid = scores.reshape(-1, scores.shape[-1]), valid.reshape(-1, scores.shape[-1])  # (R, N)
    k = topk_count(fvalid.sum(-1), keep_ratio)  # (R,)
    kept = (rank_desc(flat.detach(), fvalid) < k[:, None]) & fvalid
    return kept.view(scores.shape)


def _reduce(values: Tensor, ok: Tensor, reduction: str) -> Tensor:
    if reduction == "none":
        return values
    if reduction != "mean":
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    return values[ok].mean() if ok.any() else values.new_tensor(float("nan"))


def mass_recovery(pred_scores: Tensor, target: Tensor, keep_ratio: float, mask: Tensor | None = None, *,
                  relative: bool = False, reduction: str = "mean") -> Tensor:
    """Share of the oracle's score mass that falls inside the predicted Top-K set (the paper's training metric,
    not its task-accuracy recovery).

    Args:
        pred_scores: ``(..., N)`` predicted scores (logits are fine: only their order matters).
        target: ``(..., N)`` non-negative oracle scores.
        keep_ratio: fraction kept per row, in (0, 1].
        mask: real tokens, ``(..., N)`` or ``(B, N)``.
        relative: divide by the oracle's own Top-K mass instead of its total mass (1.0 = oracle selection).
        reduction: ``"mean"`` over rows with positive mass (NaN if none), or ``"none"`` for ``(...)`` per row.

    Returns:
        Scalar, or ``(...)`` per row (NaN where the denominator is 0).
    """
    valid = expand_mask(mask, target)
    mass = target.masked_fill(~valid, 0)
    captured = (mass * topk_mask(pred_scores, keep_ratio, valid)).sum(-1)  # (...)
    if relative:
        denom = (mass * topk_mask(target, keep_ratio, valid)).sum(-1)
    else:
        denom = mass.sum(-1)
    values = captured / denom
    return _reduce(values, denom > 0, reduction)


def topk_recall(pred_scores: Tensor, target: Tensor, keep_ratio: float, mask: Tensor | None = None, *,
                reduction: str = "mean") -> Tensor:
    """Fraction of the oracle's Top-K tokens that are also in the predicted Top-K (same K per row).

    Args:
        pred_scores: ``(..., N)`` predicted scores.
        target: ``(..., N)`` oracle scores.
        keep_ratio: fraction kept per row, in (0, 1].
        mask: real tokens, ``(..., N)`` or ``(B, N)``.
        reduction: ``"mean"`` over rows with at least one real token, or ``"none"``.

    Returns:
        Scalar, or ``(...)`` per row (NaN for rows without real tokens).
    """
    valid = expand_mask(mask, target)
    oracle = topk_mask(target, keep_ratio, valid)
    k = oracle.sum(-1)  # (...)
    values = (oracle & topk_mask(pred_scores, keep_ratio, valid)).sum(-1) / k
    return _reduce(values, k > 0, reduction)
