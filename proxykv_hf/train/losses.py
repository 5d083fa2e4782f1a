"""Multi-granularity hybrid loss (paper section "Multi-granularity hybrid loss").

``L = l_bin * L_bin + l_mse * L_mse + l_fine * L_fine + l_global * L_global + l_cos * L_cos`` over rows of scores:
every leading index of ``(..., N)`` (e.g. one (batch, target layer, KV head)) is one row. The raw logit ``x`` feeds
a sigmoid head ``sigmoid(x)`` (BCE, cosine) and a magnitude head ``sigmoid(x) * s_max`` (MSE); the two pairwise
ranking terms act on logit differences ``x_i - x_j``.

Pairs for the ranking terms are drawn per row: all of them when a row has at most ``max_pairs`` candidate
(ordered) pairs, otherwise ``max_pairs`` uniform samples with replacement from ``generator``; memory is
``O(rows * max_pairs)`` whatever N is.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..mapper._fields import check_known_fields
from .metrics import expand_mask, order_desc, ranks_of, topk_count

COS_INPUTS = ("sigmoid", "logits")
TERMS = ("bin", "mse", "fine", "global", "cos")


@dataclass(kw_only=True, frozen=True)
class LossConfig:
    """Coefficients and knobs of :func:`hybrid_loss`; defaults are the paper's. A zero lambda skips the term.

    Choices the paper leaves open:

    * ``rank_ratio = 0.2``: the Top-K set of ``L_fine`` / ``L_global`` is the target's top 20% of real tokens,
      the regime (rho <= 0.2) the paper says ``L_fine`` serves.
    * ``cos_input = "sigmoid"``: the paper writes ``1 - cos(Y_hat, Y)``. The cosine is taken on ``sigmoid(x)``
      (direction of the magnitude head, which the MSE also compares with Y) rather than on raw logits: Y is
      non-negative and BCE drives non-kept logits strongly negative, so a cosine on logits would fight BCE.
      ``"logits"`` gives the literal reading.
    * ``L_fine`` weights are ``|Y_i - Y_j|`` over their mean across all kept pairs of the batch, so the term is
      ``sum(|dY| * softplus) / sum(|dY|)``; ``L_global`` is a plain mean of weighted hinges over kept pairs.
    * ``pair_filter`` drops pairs with ``|Y_i - Y_j| < pair_filter * max(Y_row)`` from both ranking terms.
    """

    lambda_bin: float = 10.0
    lambda_mse: float = 20.0
    lambda_fine: float = 3.0
    lambda_global: float = 2.0
    lambda_cos: float = 0.5
    ratios: tuple[float, ...] = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5)
    gamma: float = 1.0
    r_min: float = 0.05
    mse_eps: float = 0.1
    mse_alpha: float = 1.5
    rank_ratio: float = 0.2
    pair_filter: float = 0.01
    max_pairs: int = 4096
    margin: float = 1.0
    global_weight_max: float = 5.0
    cos_input: str = "sigmoid"

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratios", tuple(self.ratios))
        for name in ("lambda_bin", "lambda_mse", "lambda_fine", "lambda_global", "lambda_cos", "gamma", "mse_eps",
                     "mse_alpha", "margin"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not self.ratios or any(isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1
                                  for r in self.ratios):
            raise ValueError(f"ratios must be a non-empty sequence of values in (0, 1], got {self.ratios!r}")
        for name in ("r_min", "rank_ratio"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        if not 0 <= self.pair_filter < 1:
            raise ValueError(f"pair_filter must be in [0, 1), got {self.pair_filter!r}")
        if isinstance(self.max_pairs, bool) or not isinstance(self.max_pairs, int) or self.max_pairs < 1:
            raise ValueError(f"max_pairs must be a positive int, got {self.max_pairs!r}")
        if not 1 <= self.global_weight_max < math.inf:
            raise ValueError(f"global_weight_max must be finite and >= 1, got {self.global_weight_max!r}")
        if self.cos_input not in COS_INPUTS:
            raise ValueError(f"cos_input must be one of {COS_INPUTS}, got {self.cos_input!r}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable field dict (``ratios`` as a list)."""
        return {**dataclasses.asdict(self), "ratios": list(self.ratios)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LossConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        check_known_fields(cls, data)
        return cls(**data)


def bin_loss(x: Tensor, y: Tensor, valid: Tensor, order: Tensor, cfg: LossConfig) -> Tensor:
    """Multi-ratio BCE: ``sum_r (r_min / r)^gamma * mean_valid BCE(sigmoid(x), M_r*)``. All ``(R, N)``."""
    ranks = ranks_of(order)
    n_valid = valid.sum(-1)  # (R,)
    total = x.new_zeros(())
    for r in cfg.ratios:
        m_r = (ranks < topk_count(n_valid, r)[:, None]) & valid  # (R, N) oracle top-ceil(r N) mask
        bce = F.binary_cross_entropy_with_logits(x, m_r.to(x.dtype), reduction="none")
        total = total + (cfg.r_min / r) ** cfg.gamma * bce[valid].mean()
    return total


def mse_loss(x: Tensor, y: Tensor, valid: Tensor, cfg: LossConfig) -> Tensor:
    """Value-weighted MSE of ``sigmoid(x) * s_max`` against Y, weights ``(Y + eps)^alpha``. All ``(R, N)``."""
    s_max = y[valid].max()
    w = (y + cfg.mse_eps).clamp_min(0).pow(cfg.mse_alpha)
    return (w * (torch.sigmoid(x) * s_max - y).square())[valid].mean()


def sample_pairs(y: Tensor, valid: Tensor, order: Tensor, cfg: LossConfig, kind: str,
                 generator: torch.Generator | None) -> tuple[Tensor, Tensor, Tensor]:
    """Token pairs per row for the ranking terms, after the ``pair_filter``.

    ``kind="fine"``: ordered pairs ``i != j`` inside the target's Top-K. ``kind="global"``: ``i`` in Top-K,
    ``j`` a real token outside it. K = ``ceil(rank_ratio * N_valid)``.

    Returns:
        ``(i, j, ok)``, each ``(R, M)``: token indices and a bool of pairs to use.
    """
    n_valid = valid.sum(-1)  # (R,)
    k = topk_count(n_valid, cfg.rank_ratio)  # (R,)
    other = (k - 1) if kind == "fine" else (n_valid - k)  # candidates per first element
    count = k * other.clamp_min(0)  # (R,)
    exhaustive = count <= cfg.max_pairs
    m = int(min(cfg.max_pairs, count.max().item())) if bool(exhaustive.all()) else cfg.max_pairs
    if m == 0:
        empty = order.new_zeros(order.shape[0], 0)
        return empty, empty, empty.bool()
    t = torch.arange(m, device=y.device).expand(order.shape[0], m)  # (R, M) pair index within the row
    if not bool(exhaustive.all()):
        u = torch.rand(order.shape[0], m, generator=generator, device=y.device, dtype=torch.float64)
        drawn = torch.minimum((u * count[:, None]).long(), (count - 1).clamp_min(0)[:, None])
        t = torch.where(exhaustive[:, None], t, drawn)
    ok = t < count[:, None]
    div = other.clamp_min(1)[:, None]
    a, b = t // div, t % div  # first rank, offset of the second
    b = b + (b >= a).long() if kind == "fine" else b + k[:, None]
    n = order.shape[-1]
    i = order.gather(-1, a.clamp(0, n - 1))  # (R, M)
    j = order.gather(-1, b.clamp(0, n - 1))  # (R, M)
    row_max = y.masked_fill(~valid, -math.inf).amax(-1, keepdim=True)  # (R, 1)
    ok = ok & ((y.gather(-1, i) - y.gather(-1, j)).abs() >= cfg.pair_filter * row_max)
    return i, j, ok


def fine_loss(x: Tensor, y: Tensor, i: Tensor, j: Tensor, ok: Tensor) -> Tensor:
    """Intra-Top-K softplus rank loss, weighted by ``|Y_i - Y_j|`` / its mean over kept pairs."""
    dy = y.gather(-1, i) - y.gather(-1, j)
    w = dy.abs() * ok
    if not bool((w > 0).any()):
        return x.sum() * 0
    sp = F.softplus(-torch.sign(dy) * (x.gather(-1, i) - x.gather(-1, j)))
    return (w * sp).sum() / w.sum()


def global_loss(x: Tensor, y: Tensor, valid: Tensor, i: Tensor, j: Tensor, ok: Tensor,
                cfg: LossConfig) -> Tensor:
    """Margin hinge over (Top-K, non-Top-K) pairs, weights ``clip(1 + |yn_i - yn_j|, 1, max)``."""
    if not bool(ok.any()):
        return x.sum() * 0
    lo = y.masked_fill(~valid, math.inf).amin(-1, keepdim=True)
    hi = y.masked_fill(~valid, -math.inf).amax(-1, keepdim=True)
    y_norm = (y - lo) / (hi - lo).clamp_min(1e-12)  # (R, N) min-max per row
    w = (1 + (y_norm.gather(-1, i) - y_norm.gather(-1, j)).abs()).clamp(1, cfg.global_weight_max)
    hinge = F.relu(cfg.margin - (x.gather(-1, i) - x.gather(-1, j)))
    return (w * hinge)[ok].mean()


def cos_loss(x: Tensor, y: Tensor, valid: Tensor, cfg: LossConfig) -> Tensor:
    """``1 - cos(pred, Y)`` per row over real tokens, averaged over rows with real tokens."""
    pred = torch.sigmoid(x) if cfg.cos_input == "sigmoid" else x
    cos = F.cosine_similarity(pred * valid, y * valid, dim=-1, eps=1e-8)  # (R,)
    return (1 - cos)[valid.any(-1)].mean()


def hybrid_loss(logits: Tensor, target: Tensor, mask: Tensor | None = None, config: LossConfig | None = None,
                *, generator: torch.Generator | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The paper's composite loss ``sum_k lambda_k L_k`` on rows of scores.

    Args:
        logits: ``(..., N)`` mapper logits, e.g. ``(B, L_l, H_l, N)``.
        target: ``(..., N)`` non-negative oracle scores Y, same shape.
        mask: real tokens, ``(..., N)`` or ``(B, N)`` (broadcast over the middle dims); ``None`` = all real.
        config: coefficients and knobs; ``LossConfig()`` (paper values) by default.
        generator: RNG for pair sampling, on the logits' device; ``None`` uses the global RNG.

    Returns:
        ``(total, terms)``: the scalar loss and the unweighted terms ``{"bin", "mse", "fine", "global",
        "cos"}`` (a disabled term is a detached 0).
    """
    cfg = config if config is not None else LossConfig()
    if logits.shape != target.shape:
        raise ValueError(f"logits and target shapes differ: {tuple(logits.shape)} vs {tuple(target.shape)}")
    n = logits.shape[-1]
    valid = expand_mask(mask, target).reshape(-1, n)  # (R, N)
    x = logits.reshape(-1, n).float()  # (R, N)
    y = target.reshape(-1, n).detach().float()  # (R, N)
    zero = x.new_zeros(())
    terms = {name: zero for name in TERMS}
    lambdas = {"bin": cfg.lambda_bin, "mse": cfg.lambda_mse, "fine": cfg.lambda_fine,
               "global": cfg.lambda_global, "cos": cfg.lambda_cos}
    if not bool(valid.any()):
        return x.sum() * 0, terms
    needs_order = lambdas["bin"] or lambdas["fine"] or lambdas["global"]
    order = order_desc(y, valid) if needs_order else None  # (R, N) tokens by target score, best first
    if lambdas["bin"]:
        terms["bin"] = bin_loss(x, y, valid, order, cfg)
    if lambdas["mse"]:
        terms["mse"] = mse_loss(x, y, valid, cfg)
    if lambdas["fine"]:
        terms["fine"] = fine_loss(x, y, *sample_pairs(y, valid, order, cfg, "fine", generator))
    if lambdas["global"]:
        terms["global"] = global_loss(x, y, valid, *sample_pairs(y, valid, order, cfg, "global", generator), cfg)
    if lambdas["cos"]:
        terms["cos"] = cos_loss(x, y, valid, cfg)
    total = sum((lambdas[name] * terms[name] for name in TERMS if lambdas[name]), x.sum() * 0)
    return total, terms
