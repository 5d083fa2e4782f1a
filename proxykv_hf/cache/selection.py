"""Scores -> kept indices: the budget maths and the head-wise Top-K.

One convention for the whole package: **scores are `(B, H_kv, T)` floats, higher means keep**. Every scorer
returns that shape; this module turns it into the indices each KV head keeps.

Rules (see ``docs/design.md``):

* ``keep_ratio`` (the paper's rho) is the fraction of a row's *real* (non-padding) tokens kept per KV head:
  ``K = ceil(keep_ratio * T_real)``, raised to the protected tokens that fit (``n_sink`` first and ``n_recent``
  last real tokens), never above ``T_real``.
* Padding is never kept. Protected tokens are always kept. Ties are broken by position: the earlier token wins.
* A padded batch is compacted to the largest row's K. The spare slots of shorter rows come first, are marked
  invalid in ``slot_valid`` and hidden from attention by the cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from numbers import Real

import torch
import torch.nn.functional as F


def check_keep_ratio(keep_ratio: object, *, scored: bool = True, fix: str = "a scorer") -> float:
    """Validate ``keep_ratio`` and return it as a Python float.

    Accepts a Python or numpy real number or a 0-d (non-bool) torch tensor. A value held in a narrower float type
    than a Python float (numpy ``float32`` / ``float16``, a ``float32`` / ``float16`` / ``bfloat16`` tensor) becomes
    the shortest decimal that rounds to the same value in that type, so ``np.float32(0.3)`` and
    ``torch.tensor(0.3)`` mean 0.3 (``0.30000001192...`` would keep 4 of 10 tokens instead of 3).

    Args:
        keep_ratio: the value to check.
        scored: whether a scorer will choose what to keep; without one only 1 is allowed (nothing would prune).
        fix: what the error for an unscored ratio below 1 tells the user to pass.

    Raises:
        ValueError: if it is not such a number, not in (0, 1], or below 1 with ``scored`` False.
    """
    value = _real_value(keep_ratio)
    if not (0.0 < value <= 1.0) or math.isnan(value):
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio!r}")
    if not scored and value < 1:
        raise ValueError(f"keep_ratio={value} needs a scorer to choose what to keep, and none was given: pass {fix} "
                         "(without a scorer nothing is pruned: keep_ratio 1)")
    return value


def _real_value(keep_ratio: object) -> float:
    """``keep_ratio`` as a float, narrow floats read as their shortest decimal (:func:`check_keep_ratio`)."""
    if isinstance(keep_ratio, torch.Tensor):
        if keep_ratio.dim() != 0 or keep_ratio.dtype == torch.bool or keep_ratio.is_complex() or keep_ratio.is_meta:
            raise ValueError(f"keep_ratio must be a number in (0, 1] (a Python or numpy scalar, or a 0-d real "
                             f"tensor), got a tensor of shape {tuple(keep_ratio.shape)} and dtype {keep_ratio.dtype}: "
                             f"{keep_ratio!r}")
        held = keep_ratio.detach().cpu()
        value = float(held.item())
        if held.is_floating_point() and held.dtype != torch.float64:
            value = _shortest_decimal(value, lambda c: bool(torch.tensor(c, dtype=held.dtype) == held))
        return value
    if isinstance(keep_ratio, bool) or not isinstance(keep_ratio, Real):
        raise ValueError(f"keep_ratio must be a number in (0, 1], got {keep_ratio!r}")
    value = float(keep_ratio)
    dtype = getattr(keep_ratio, "dtype", None)  # numpy scalars: np.float32(0.3) is 0.30000001192092896 as a float
    if getattr(dtype, "kind", None) == "f" and getattr(dtype, "itemsize", 8) < 8:
        value = _shortest_decimal(value, lambda c: bool(type(keep_ratio)(c) == keep_ratio))
    return value


def _shortest_decimal(value: float, same: Callable[[float], bool]) -> float:
    """The decimal of ``value`` with the fewest significant digits that ``same`` maps to the same narrow float."""
    if not math.isfinite(value):
        return value
    for digits in range(1, 18):
        candidate = float(f"{value:.{digits}g}")
        if same(candidate):
            return candidate
    return value


def keep_counts(n_real: torch.Tensor, keep_ratio: float, n_protected: int = 0) -> torch.Tensor:
    """Per-row budget ``K = clamp(ceil(rho * T_real), min(n_protected, T_real), T_real)``.

    Args:
        n_real: `(B,)` number of real tokens per row.
        keep_ratio: fraction kept, in (0, 1].
        n_protected: tokens that must be kept (sinks + recent window).

    Returns:
        `(B,)` int64 budgets.
    """
    n_real = n_real.to(torch.int64)
    # ceil(rho * n) computed in float64 with a small guard so that e.g. 0.3 * 10 gives 3, not 4.
    k = torch.ceil(n_real.double() * keep_ratio - 1e-9).to(torch.int64)
    k = torch.maximum(k, torch.clamp(n_real, max=n_protected))
    return torch.minimum(k, n_real)


def check_kernel_size(kernel_size: object, name: str = "kernel_size") -> int:
    """``kernel_size`` as an int, or a ``ValueError`` if it is not a positive odd int."""
    if not isinstance(kernel_size, int) or isinstance(kernel_size, bool) or kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"{name} must be a positive odd int, got {kernel_size!r}")
    return kernel_size


def smooth_scores(scores: torch.Tensor, valid: torch.Tensor, kernel_size: int, *,
                  keep_peaks: bool = False) -> torch.Tensor:
    """Average-pool `(B, H, T)` scores along the tokens over the real tokens of each window (a padded row pools
    exactly as it would alone; what padding positions get does not matter, the selection never keeps them).
    ``kernel_size`` 1 returns ``scores`` as is.

    Pooling keeps a token's neighbours with it: a fact spelled over several tokens (a number split into digits)
    tends to survive the Top-K whole instead of losing single tokens to noise in the scores. With ``keep_peaks``
    a token gets the larger of its own score and its window's mean: a span's weak tokens are lifted, but a lone
    high score is not averaged away.
    """
    check_kernel_size(kernel_size)
    if kernel_size == 1:
        return scores
    valid = valid.to(scores.device)
    weight = valid.to(scores.dtype)[:, None, :]  # (B, 1, T)
    B, H, T = scores.shape
    pool = dict(kernel_size=kernel_size, stride=1, padding=kernel_size // 2)
    summed = F.avg_pool1d(scores.masked_fill(~valid[:, None, :], 0).reshape(B * H, 1, T), **pool).view(B, H, T)
    pooled = summed / F.avg_pool1d(weight, **pool).clamp_min(1e-6)
    return torch.maximum(scores, pooled) if keep_peaks else pooled


def protected_mask(valid: torch.Tensor, n_sink: int, n_recent: int) -> torch.Tensor:
    """`(B, T)` bool: the first ``n_sink`` and the last ``n_recent`` real tokens of each row."""
    rank = valid.long().cumsum(-1)  # 1-based rank of each real token, (B, T)
    n_real = rank[:, -1:]
    sink = rank <= n_sink
    recent = rank > n_real - n_recent
    return valid & (sink | recent)


def select_topk(
    scores: torch.Tensor,
    keep_ratio: float,
    valid: torch.Tensor | None = None,
    n_sink: int = 0,
    n_recent: int = 0,
    *,
    k_row: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Head-wise Top-K of ``scores`` under the rules of this module.

    Args:
        scores: `(B, H_kv, T)` importance scores, higher = keep. NaN is treated as lowest.
        keep_ratio: fraction of each row's real tokens kept per head, in (0, 1].
        valid: `(B, T)` bool, True for real tokens (left or right padding both work). None = all real.
        n_sink: always keep the first ``n_sink`` real tokens.
        n_recent: always keep the last ``n_recent`` real tokens.
        k_row: `(B,)` the budgets :func:`keep_counts` gives for ``valid``, when the caller already has them on the
            CPU (a cache computes them once per prompt): then nothing here waits for the GPU.

    Returns:
        indices: `(B, H_kv, K_max)` int64 positions into T. Per row, the spare slots (``K_max - K_row``) come first,
            then the kept positions in increasing order.
        slot_valid: `(B, K_max)` bool, False on spare slots.

    Raises:
        ValueError: if a row has no real token.
    """
    keep_ratio = check_keep_ratio(keep_ratio)
    B, H, T = scores.shape
    if valid is None:
        valid = torch.ones(B, T, dtype=torch.bool, device=scores.device)
    valid = valid.to(device=scores.device, dtype=torch.bool)
    if k_row is None:
        n_real = valid.sum(-1)  # (B,)
        if bool((n_real == 0).any()):
            rows = torch.nonzero(n_real == 0).flatten().tolist()
            raise ValueError(f"batch rows {rows} contain only padding; nothing can be kept")
        k_row = keep_counts(n_real, keep_ratio, n_sink + n_recent)  # (B,)
    k_max = int(k_row.max())
    k_row = k_row.to(scores.device, non_blocking=True)

    # Rank key: protected first, then score, padding last; a stable sort keeps earlier positions first on ties.
    s = torch.nan_to_num(scores.float(), nan=-math.inf)
    s = s.masked_fill(protected_mask(valid, n_sink, n_recent)[:, None, :], math.inf)
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :k_max]  # (B, H, K_max)
    # Among equal +inf / -inf keys the stable sort already orders by position.
    rank = torch.arange(k_max, device=scores.device)
    keep = rank[None, :] < k_row[:, None]  # (B, K_max), True for the K_row best of each row
    # Sort the kept ones by position; spare slots get key -1 so they come first (their content is never attended).
    pos = torch.where(keep[:, None, :], order, torch.full_like(order, -1))
    pos = pos.sort(dim=-1).values
    n_spare = (k_max - k_row)[:, None]  # (B, 1)
    slot_valid = rank[None, :] >= n_spare  # (B, K_max)
    indices = pos.clamp_min(0)  # spare slots point at position 0 (finite data, masked)
    return indices, slot_valid


BUDGETS = ("uniform", "global")
HEAD_FLOOR = 0.2
"""Under the global budget, every KV head keeps at least this share of the uniform per-head budget."""


def select_global(
    scores: list[torch.Tensor],
    keep_ratio: float,
    valid: torch.Tensor | None = None,
    n_sink: int = 0,
    n_recent: int = 0,
    *,
    head_floor: float = HEAD_FLOOR,
) -> list[torch.Tensor]:
    """One Top-K per row over the entries of every layer and KV head together (a global, non-uniform budget).

    Row ``b`` keeps ``L * H_kv * K_b`` entries in all, ``K_b`` being the uniform per-head budget of
    :func:`keep_counts`: the protected tokens of every head, then in every head its best entries up to
    ``ceil(head_floor * K_b)`` (so that no head is emptied), then the best of all remaining entries of all layers
    and heads. Scores must be comparable across layers and heads. Ties go to the earlier layer, head and position.

    Args:
        scores: one `(B, H_kv, T)` tensor per compacted layer, higher = keep. NaN is treated as lowest.
        keep_ratio, valid, n_sink, n_recent: as for :func:`select_topk`.
        head_floor: each head's minimum, as a share of ``K_b``, in [0, 1].

    Returns:
        one `(B, H_kv, T)` bool keep mask per layer; padding is never kept.
    """
    keep_ratio = check_keep_ratio(keep_ratio)
    if not 0.0 <= head_floor <= 1.0:
        raise ValueError(f"head_floor must be in [0, 1], got {head_floor!r}")
    x = torch.stack([s.float() for s in scores], dim=1)  # (B, L, H_kv, T)
    B, L, H, T = x.shape
    valid = torch.ones(B, T, dtype=torch.bool) if valid is None else valid.to(torch.bool)
    valid = valid.to(x.device)
    n_real = valid.sum(-1)
    if bool((n_real == 0).any()):
        raise ValueError(f"batch rows {torch.nonzero(n_real == 0).flatten().tolist()} contain only padding")
    k_row = keep_counts(n_real, keep_ratio, n_sink + n_recent).cpu()  # (B,) per-head uniform budgets
    protected = protected_mask(valid, n_sink, n_recent)  # (B, T)
    n_protected = protected.sum(-1).cpu()
    finite = torch.finfo(torch.float32)
    x = torch.nan_to_num(x, nan=finite.min, neginf=finite.min, posinf=finite.max)
    keep = protected[:, None, None, :].expand(B, L, H, T).clone()  # (B, L, H, T)
    for b in range(B):
        free = valid[b] & ~protected[b]  # (T,)
        s = x[b].masked_fill(~free, -math.inf)  # (L, H, T)
        floor = min(math.ceil(head_floor * int(k_row[b]) - 1e-9), int(k_row[b])) - int(n_protected[b])
        if floor > 0:  # never more than the free tokens: k_row <= n_real
            best = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :floor]  # (L, H, floor)
            keep[b].scatter_(-1, best, True)
        left = int(k_row[b]) * L * H - int(keep[b].sum())
        if left > 0:
            rest = s.masked_fill(keep[b], -math.inf).flatten()  # (L * H * T), layer-major
            best = torch.sort(rest, descending=True, stable=True).indices[:left]
            keep[b].view(-1)[best] = True
    keep &= valid[:, None, None, :]
    return list(keep.unbind(1))


def global_keep(scorer, scores: dict[int, torch.Tensor], valid: torch.Tensor, keep_ratio: float, n_sink: int,
                n_recent: int) -> dict[int, torch.Tensor]:
    """``{layer: (B, H_kv, T) keep mask}`` of the global budget (:func:`select_global`), from each layer's scores
    made comparable by the scorer (:meth:`~proxykv_hf.scorers.base.Scorer.global_scores`)."""
    layers = sorted(scores)
    device = scores[layers[0]].device
    comparable = scorer.global_scores({i: scores[i] for i in layers}, valid.to(device))
    keep = select_global([comparable[i] for i in layers], keep_ratio, valid.to(device), n_sink, n_recent)
    return dict(zip(layers, keep))
