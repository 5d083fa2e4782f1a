"""Making a mapper's scores comparable across layers and heads, for the global budget.

A mapper ranks the tokens of one (target layer, KV head) row well, but its logits are trained per row (top-K
membership and ranks within the row, values relative to the row's maximum), so the logits of two heads do not say
which of them needs more of a shared budget. KVzip's raw scores do: some heads spread their attention over many
tokens, others over a few. The **quantile table** carries that shape over from the oracle: for each target layer and
KV head, the mean over training rows of the oracle's log-scores at fixed percentiles of the row (:data:`GRID`
points, denser near the top, where small budgets choose). Under the global budget a token's comparable score is the
table's value at its percentile within its row, ranked by the mapper's logits; one Top-K over all of them then gives
each head the share of the budget the oracle would typically give it.
"""

from __future__ import annotations

from typing import Iterable

import torch

GRID = 65
"""Points of a quantile table per row: percentiles ``1 - (1 - k / (GRID - 1))^2``, ``k = 0 .. GRID - 1``."""
FLOOR = 1e-8
"""Added to the oracle's scores before the logarithm (stored float16 scores underflow to 0)."""


def grid(n: int = GRID, device=None) -> torch.Tensor:
    """The percentiles of a table of ``n`` points, from 0 (the row's lowest score) to 1 (its highest)."""
    u = torch.linspace(0, 1, n, device=device, dtype=torch.float64)
    return (1 - (1 - u) ** 2).float()


def fit_quantiles(rows: Iterable[tuple[torch.Tensor, torch.Tensor]], n: int = GRID) -> torch.Tensor:
    """The quantile table ``(L, H, n)`` of oracle scores: ``rows`` yields ``(y, valid)`` with ``y`` of shape
    ``(L, H, N)`` (a crop's or a text's oracle scores) and ``valid`` ``(N,)``; each row's log-scores at the
    percentiles of :func:`grid`, averaged over everything ``rows`` yields."""
    total, count, points = None, 0, grid(n).double()
    for y, valid in rows:
        y = y[..., valid.bool()].double()
        if y.shape[-1] < 2:
            continue
        q = torch.quantile(torch.log(y.clamp_min(0) + FLOOR), points, dim=-1)  # (n, L, H)
        total = q if total is None else total + q
        count += 1
    if total is None:
        raise ValueError("no oracle rows of two or more tokens to fit a quantile table on")
    return (total / count).permute(1, 2, 0).float().contiguous()


def check_quantiles(table, layers: int, heads: int) -> torch.Tensor:
    """``table`` as a float32 tensor ``(layers, heads, n)``, finite and nondecreasing along the grid, or a
    ValueError saying what is wrong."""
    try:
        t = torch.as_tensor(table, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"global_quantiles must be a (layers, heads, points) table of numbers ({err})") from None
    if t.dim() != 3 or t.shape[:2] != (layers, heads) or t.shape[2] < 2:
        raise ValueError(f"global_quantiles must have shape ({layers}, {heads}, points >= 2) for this target, got "
                         f"{tuple(t.shape)}")
    if not bool(torch.isfinite(t).all()) or bool((t.diff(dim=-1) < 0).any()):
        raise ValueError("global_quantiles must be finite and nondecreasing along each row")
    return t


def table_as_list(table: torch.Tensor) -> list:
    """The table as nested lists of numbers rounded to 4 decimals, as ``proxykv_config.json`` stores it."""
    return [[[round(v, 4) for v in row] for row in layer] for layer in table.tolist()]


def percentiles(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each entry's percentile within its row of real tokens, ``(B, H, T)`` in [0, 1] (1 = the row's highest
    score; ties by position); padding gets 0."""
    x = scores.float().masked_fill(~valid[:, None, :], -torch.inf)
    x = torch.nan_to_num(x, nan=-torch.inf)
    rank = x.argsort(dim=-1, stable=True).argsort(dim=-1)  # 0 = lowest; padding ranks below every real token
    n_pad = (~valid).sum(-1)[:, None, None]
    n_real = valid.sum(-1)[:, None, None]
    p = (rank - n_pad).float() / (n_real - 1).clamp_min(1).float()
    return p.clamp(0, 1).masked_fill(~valid[:, None, :], 0.0)


def calibrate(scores: torch.Tensor, valid: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """One layer's scores ``(B, H, T)`` made comparable across layers and heads: each entry's percentile within
    its row (:func:`percentiles`) read off that head's row of ``table`` ``(H, n)``, interpolated linearly between
    grid points. Padding gets ``-inf``."""
    table = table.to(scores.device)
    n = table.shape[-1]
    p = percentiles(scores, valid)
    pos = (1 - torch.sqrt(1 - p)) * (n - 1)  # the inverse of grid()
    lo = pos.floor().long().clamp(0, n - 2)
    w = pos - lo
    rows = table[None].expand(scores.shape[0], -1, -1)  # (B, H, n)
    value = rows.gather(-1, lo) * (1 - w) + rows.gather(-1, lo + 1) * w
    return value.masked_fill(~valid[:, None, :], -torch.inf)
