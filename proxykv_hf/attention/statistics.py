"""Attention probabilities summed over queries, accumulated in query chunks (never an N x N matrix).

``X[b, h, n] = sum_q softmax(Q K^T * scaling + mask)[b, h, q, n]``

This is the proxy feature of the ProxyKV paper (one row per layer and query head) and the raw material of
several scorers. Beside the sum, the same pass can return the *maximum* probability a key receives from any query
other than its own position (statistic ``"max"``): a needle that one later query looks at hard but few others do
stands out there more than in the sum (KVzip's oracle is a maximum too).
Statistic ``"lookback"`` is read on the query side: the largest probability the token at each position, as a query,
gives to any key at least :data:`LOOKBACK_GAP` positions back (the row's first :data:`LOOKBACK_SINKS` real tokens,
the attention sinks, left out). Text the model has seen before (a repeated sentence, a recurring name) is read by
copying from its earlier occurrence and scores high; a token with nothing to look back to (a new number, a code)
scores low. KVzip keeps exactly such tokens, and the sum and max rank them last when the text around them repeats.

The chunked PyTorch path (:mod:`proxykv_hf.attention.statistics_torch`) is the reference; its memory is ``O(B * H *
chunk * T)``, on a CPU ``O(B * H / H_kv * chunk * T)`` per thread (one KV head's query heads at a time, the chunks
split between single-threaded workers). On a GPU, the causal unmasked case (an unpadded prompt) takes the fused Triton
kernels of :mod:`proxykv_hf.attention.kernels`, which never write the probabilities to memory. This module checks the
arguments, picks the path and reduces the query heads of each KV head. The statistics of a layer's own unpadded prefill
can also come with that attention's output (:func:`causal_attention_with_statistics`): on a CPU from the same softmax,
so the attention runs once, not once in sdpa and again here; on a GPU from flash attention, whose row log-sum-exp
spares the fused kernels their first pass.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from . import kernels
from .statistics_torch import LOOKBACK_GAP, LOOKBACK_SINKS, _torch_statistics

__all__ = ["BACKENDS", "CHUNK_SIZE", "LOOKBACK_GAP", "LOOKBACK_SINKS", "STATISTICS", "FusedStatistics",
           "attention_sums", "causal_attention_with_statistics", "check_statistics", "fuses_with_attention",
           "recomputations"]

logger = logging.getLogger(__name__)

_REDUCTIONS = ("none", "mean", "sum", "max")
BACKENDS = ("auto", "torch", "triton")
# queries per chunk of the PyTorch path (why 128: docs/performance.md, "One KV head per pass, query chunks of 128")
CHUNK_SIZE = 128
STATISTICS = ("sum", "max", "lookback")  # LOOKBACK_GAP and LOOKBACK_SINKS: beside the chunked path that reads them


@dataclass
class FusedStatistics:
    """How a pass over a layer's own prefill computes the statistics a scorer reads along with the attention output.

    One instance belongs to one cache (or one proxy scorer); nothing is process-wide.

    Attributes:
        enabled: compute the statistics in the attention's own pass where that pays (CPU: one softmax for the output
            and the statistics; GPU: flash attention's log-sum-exp instead of the fused kernels' first pass). False:
            the model's own attention runs, then the statistics.
        flash_lse: whether flash attention's log-sum-exp may stand in for the fused kernels' first pass. None: not
            known yet; the first such call checks that the probabilities it gives sum to one per query row and
            keeps the answer here (False also after a flash call that raised: sdpa and both fused passes then run).
    """

    enabled: bool = True
    flash_lse: bool | None = None


def fuses_with_attention(query: torch.Tensor, fused: FusedStatistics | None = None) -> bool:
    """Whether the statistics of ``query``'s own prefill attention should come with its output
    (:func:`causal_attention_with_statistics`): always where the fused Triton kernels do not run (one softmax), and
    on their path where flash attention can hand over its log-sum-exp; never with ``fused.enabled`` False."""
    fused = fused or FusedStatistics()
    if not fused.enabled:
        return False
    return not kernels.available(query) or (fused.flash_lse is not False and kernels.flash_lse_supported(query))


def recomputations(query: torch.Tensor, fused: FusedStatistics | None = None) -> int:
    """How many times the statistics of a causal prefill with queries like ``query`` recompute ``Q K^T`` beyond the
    attention itself: 0 on the chunked PyTorch path with the attention (one softmax for output and statistics), 1
    for flash attention + pass 2 or for sdpa + the PyTorch statistics, 2 for sdpa + both fused passes."""
    if fuses_with_attention(query, fused):
        return int(kernels.available(query))
    return 2 if kernels.available(query) else 1


def check_statistics(statistics) -> tuple[str, ...]:
    """``statistics`` as a tuple of distinct names from :data:`STATISTICS`, or ``ValueError``."""
    statistics = tuple(statistics)
    if not statistics or len(set(statistics)) != len(statistics) or any(s not in STATISTICS for s in statistics):
        raise ValueError(f"statistics must be distinct names from {STATISTICS}, got {statistics!r}")
    return statistics


@torch.no_grad()  # statistics for selection: never differentiated, whatever the caller's grad mode
def attention_sums(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    *,
    query_valid: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
    group_reduce: str = "none",
    backend: str = "auto",
    statistics: tuple[str, ...] | list[str] = ("sum",),
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
        backend: ``"torch"`` (the reference), ``"triton"`` (fused kernels; needs ``attention_mask=None`` and a GPU
            or Triton's interpreter) or ``"auto"``: Triton where it applies, else torch.
        statistics: which per-key statistics over the queries, in this order: ``"sum"`` (the probabilities summed
            over queries) and/or ``"max"`` (their maximum over the queries other than the key's own position,
            i.e. query ``q`` never counts for key ``q + T - Q``; 0 where no other query sees the key) and/or
            ``"lookback"`` (query-side: at each query's own position, the largest probability it gives to a key at
            least :data:`LOOKBACK_GAP` positions earlier and past the row's first :data:`LOOKBACK_SINKS` real
            tokens; 0 at positions that are not queries of this call, at padding and where no such key exists).

    Returns:
        float32 `(B, S * H, T)` or `(B, S * H_kv, T)` for ``S = len(statistics)``: statistic-major, so with the
        default ``("sum",)`` the sums `(B, H, T)` or `(B, H_kv, T)`.
    """
    statistics = check_statistics(statistics)
    if group_reduce not in _REDUCTIONS:
        raise ValueError(f"group_reduce must be one of {_REDUCTIONS}, got {group_reduce!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _check_heads_and_chunk(query, key, chunk_size)
    B, H, Q, D = query.shape
    _, H_kv, T, _ = key.shape
    G = H // H_kv
    if attention_mask is None and T < Q:
        raise ValueError(f"without a mask the queries are the last Q of the T key positions: need T >= Q, got Q={Q}, "
                         f"T={T}")
    scaling = D**-0.5 if scaling is None else scaling
    fused = attention_mask is None and kernels.available(query) and "lookback" not in statistics
    if backend == "triton" and not fused:
        raise ValueError("the triton backend needs attention_mask=None (causal), T >= Q, a GPU with Triton and no "
                         "'lookback' statistic")
    if fused and backend != "torch":
        found = _fused_statistics(query, key, scaling, query_valid, statistics)
        return torch.cat([_reduce(found[s].view(B, H_kv, G, T), group_reduce) for s in statistics], dim=1)
    found, _ = _torch_statistics(query, key, attention_mask, scaling, query_valid, chunk_size, statistics)
    return torch.cat([_reduce(found[s], group_reduce) for s in statistics], dim=1)


@torch.no_grad()  # statistics for selection: never differentiated, whatever the caller's grad mode
def causal_attention_with_statistics(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None = None,
    *,
    query_valid: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
    statistics: tuple[str, ...] | list[str] = ("sum",),
    backend: str = "auto",
    fused: FusedStatistics | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention and its per-key statistics, without computing the attention twice.

    What an sdpa call followed by :func:`attention_sums` returns, in one of two ways:

    * ``"torch"`` (the reference, and the path off the GPU): each query chunk's logits and softmax are computed
      once, for the output and the statistics; on a CPU that saves most of the attention's own cost
      (docs/performance.md).
    * ``"triton"`` (where the fused kernels run, for ``Q == T``): flash attention for the output, whose row
      log-sum-exp lets the fused statistics skip their first pass (:func:`kernels.flash_attention_with_lse`).
      The first such call for a ``fused`` checks that the probabilities sum to one per query row; if that fails,
      or flash attention refuses the inputs, a warning says so and calls with that ``fused`` go back to sdpa +
      both passes.

    Args:
        query: `(B, H, Q, D)` queries (after RoPE), the last ``Q`` of the ``T`` positions.
        key, value: `(B, H_kv, T, D)` with ``T >= Q``; ``H`` a multiple of ``H_kv``.
        scaling, query_valid, chunk_size, statistics: as in :func:`attention_sums` (no mask: causal).
        backend: ``"torch"``, ``"triton"`` (raises ``ValueError`` where it does not apply) or ``"auto"``: Triton
            where it applies, else torch.
        fused: where the flash check's answer is kept (:class:`FusedStatistics`); None checks on this call only.

    Returns:
        the attention output `(B, H, Q, D)` in ``query``'s dtype, and the statistics `(B, S * H, T)` float32
        (statistic-major, as :func:`attention_sums` with ``group_reduce="none"``).
    """
    statistics = check_statistics(statistics)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _check_heads_and_chunk(query, key, chunk_size)
    B, H, Q, D = query.shape
    T = key.shape[2]
    if T < Q or value.shape[:3] != key.shape[:3]:
        raise ValueError(f"need T >= Q and values shaped like the keys; got query {tuple(query.shape)}, key "
                         f"{tuple(key.shape)}, value {tuple(value.shape)}")
    scaling = D**-0.5 if scaling is None else scaling
    fusable = "lookback" not in statistics and kernels.available(query)
    if backend != "torch" and Q == T and fusable and (fused := fused or FusedStatistics()).flash_lse is not False:
        found = _flash_statistics(query, key, value, scaling, query_valid, statistics, fused)
        if found is not None:
            return found
    if backend == "triton":
        raise ValueError("the triton backend needs Q == T, a GPU with Triton (or Triton's interpreter), no 'lookback' "
                         "statistic and inputs that PyTorch's flash attention takes (kernels.flash_lse_supported)")
    found, output = _torch_statistics(query, key, None, scaling, query_valid, chunk_size, statistics, value=value)
    return output, torch.cat([_reduce(found[s], "none") for s in statistics], dim=1)


def _flash_statistics(query, key, value, scaling, query_valid, statistics, fused: FusedStatistics):
    """Flash attention's output and log-sum-exp, then pass 2 of the fused kernels: ``(output, statistics)``, or
    None where flash attention does not take the inputs or its log-sum-exp failed the check (see
    :func:`causal_attention_with_statistics`)."""
    try:
        flash = kernels.flash_attention_with_lse(query, key, value, scaling)
    except (RuntimeError, NotImplementedError) as err:  # a flash build that refuses what the checks let through
        logger.warning("flash attention with its log-sum-exp failed (%s); the attention statistics use sdpa and "
                       "both passes of the fused kernels", err)
        fused.flash_lse = False
        return None
    if flash is None:
        return None
    output, lse = flash
    found = _fused_statistics(query, key, scaling, query_valid, statistics, lse=lse)
    if fused.flash_lse is None:  # once per ``fused``: every query row's probabilities must sum to one
        rows = found["sum"].sum(-1)  # (B, H)
        want = (torch.full_like(rows, query.shape[2]) if query_valid is None
                else query_valid.to(rows).sum(-1, keepdim=True).expand_as(rows))
        fused.flash_lse = bool(torch.allclose(rows, want, rtol=1e-2, atol=1e-2))
        if not fused.flash_lse:
            logger.warning("flash attention's log-sum-exp does not normalise the fused kernels' probabilities "
                           "(row sums %s, expected %s); the attention statistics use sdpa and both passes of the "
                           "fused kernels", rows.flatten()[:4].tolist(), want.flatten()[:4].tolist())
            return None
    return output, torch.cat([found[s] for s in statistics], dim=1)


def _fused_statistics(query, key, scaling, query_valid, statistics, lse=None) -> dict:
    """The fused kernels' ``{"sum": (B, H, T), "max": (B, H, T) or None}``; the maxima only where asked for."""
    if "max" not in statistics:
        return {"sum": kernels.causal_attention_sums(query, key, scaling, query_valid, lse=lse), "max": None}
    total, peak = kernels.causal_attention_sums(query, key, scaling, query_valid, with_max=True, lse=lse)
    return {"sum": total, "max": peak}


def _check_heads_and_chunk(query: torch.Tensor, key: torch.Tensor, chunk_size: int) -> None:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"query heads ({query.shape[1]}) must be a multiple of key heads ({key.shape[1]})")


def _reduce(out: torch.Tensor, group_reduce: str) -> torch.Tensor:
    """`(B, H_kv, G, T)` -> `(B, H, T)` or the group reduced to `(B, H_kv, T)`."""
    if group_reduce == "none":
        return out.flatten(1, 2)
    if group_reduce == "mean":
        return out.mean(dim=2)
    if group_reduce == "sum":
        return out.sum(dim=2)
    return out.amax(dim=2)
