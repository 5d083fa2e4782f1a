"""Attention probabilities summed over queries, accumulated in query chunks (never an N x N matrix).

``X[b, h, n] = sum_q softmax(Q K^T * scaling + mask)[b, h, q, n]``

This is the proxy feature of the ProxyKV paper (one row per layer and query head) and the raw material of
several scorers. Memory is ``O(B * H * chunk * T)``.
"""

from __future__ import annotations

import torch

_REDUCTIONS = ("none", "mean", "sum", "max")


def _chunk_bias(
    attention_mask: torch.Tensor | None, q0: int, q1: int, Q: int, T: int, device: torch.device
) -> torch.Tensor:
    """Additive float bias `(B or 1, 1, C, T)` for query rows ``q0:q1`` (0 = visible, -inf = hidden).

    ``attention_mask`` is what transformers hands to an attention function: a bool mask (True = attend, sdpa), a
    float additive mask (eager) of shape `(B, 1, Q, T)`, or None, which means causal with the queries at the last
    ``Q`` key positions.
    """
    if attention_mask is None:
        qpos = torch.arange(q0, q1, device=device) + (T - Q)  # absolute position of each query, (C,)
        hidden = torch.arange(T, device=device)[None, :] > qpos[:, None]  # (C, T)
        return torch.zeros(1, 1, q1 - q0, T, device=device).masked_fill(hidden, float("-inf"))
    m = attention_mask[:, :, q0:q1, :T]
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, device=device).masked_fill(~m, float("-inf"))
    return m.float()


def attention_sums(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    *,
    query_valid: torch.Tensor | None = None,
    chunk_size: int = 256,
    group_reduce: str = "none",
) -> torch.Tensor:
    """Sum of softmax attention probabilities over queries, per head and key.

    Args:
        query: `(B, H, Q, D)` queries (after RoPE); ``H`` is a multiple of ``H_kv``.
        key: `(B, H_kv, T, D)` keys (after RoPE); the queries are the last ``Q`` of the ``T`` positions when the mask
            is None.
        attention_mask: bool / additive `(B or 1, 1, Q, T)` mask as transformers passes it, or None (causal).
        scaling: softmax scale, default ``D ** -0.5``.
        query_valid: `(B, Q)` bool; rows of padding queries contribute nothing.
        chunk_size: queries per chunk.
        group_reduce: how the ``G = H // H_kv`` query heads of a KV head are combined: ``"none"`` returns
            `(B, H, T)`; ``"mean"``, ``"sum"`` or ``"max"`` return `(B, H_kv, T)`.

    Returns:
        float32 sums `(B, H, T)` or `(B, H_kv, T)`.
    """
    if group_reduce not in _REDUCTIONS:
        raise ValueError(f"group_reduce must be one of {_REDUCTIONS}, got {group_reduce!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    B, H, Q, D = query.shape
    _, H_kv, T, _ = key.shape
    if H % H_kv:
        raise ValueError(f"query heads ({H}) must be a multiple of key heads ({H_kv})")
    G = H // H_kv
    scaling = D**-0.5 if scaling is None else scaling
    k = key.float()
    out = torch.zeros(B, H_kv, G, T, dtype=torch.float32, device=query.device)
    for q0 in range(0, Q, chunk_size):
        q1 = min(q0 + chunk_size, Q)
        q = query[:, :, q0:q1].float().view(B, H_kv, G, q1 - q0, D)  # (B, H_kv, G, C, D)
        logits = torch.einsum("bhgcd,bhtd->bhgct", q, k) * scaling  # (B, H_kv, G, C, T)
        bias = _chunk_bias(attention_mask, q0, q1, Q, T, query.device)  # (B|1, 1, C, T)
        logits = logits + bias[:, :, None]  # broadcast over (H_kv, G)
        probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # fully masked rows -> 0
        if query_valid is not None:
            probs = probs * query_valid[:, None, None, q0:q1, None].to(probs.dtype)
        out += probs.sum(dim=3)
    if group_reduce == "none":
        return out.view(B, H, T)
    if group_reduce == "mean":
        return out.mean(dim=2)
    if group_reduce == "sum":
        return out.sum(dim=2)
    return out.amax(dim=2)
