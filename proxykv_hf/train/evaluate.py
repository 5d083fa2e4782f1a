"""Validation metrics of a mapper and the training-dynamics figure, from a run's ``log.jsonl``."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Iterable, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from .losses import TERMS, LossConfig, hybrid_loss
from .metrics import mass_recovery, topk_recall

logger = logging.getLogger(__name__)


@torch.no_grad()
def evaluate_mapper(mapper: torch.nn.Module, dataset: Dataset, ratios: Sequence[float] = (0.1, 0.3, 0.5),
                    loss_config: LossConfig | None = None, *, batch_size: int = 8, device=None, seed: int = 0,
                    num_workers: int = 0, target_layers: Sequence[int] | None = None) -> dict[str, float]:
    """Validation metrics of ``mapper`` on ``dataset`` (items ``{"x", "y", "mask"}``), in eval mode, float32, over
    ``target_layers`` (0-based; None = all).

    Returns:
        ``{"loss", "loss_<term>" (unweighted hybrid-loss terms), "mass_recovery@<r>", "topk_recall@<r>", "crops"}``;
        losses are means over crops (batch means weighted by batch size), the retention metrics are computed per
        (crop, layer, KV head) row over its real tokens and averaged over rows. Empty ``dataset``: ``{}``.
    """
    if len(dataset) == 0:
        return {}
    device = torch.device(device) if device is not None else next(mapper.parameters()).device
    was_training = mapper.training
    mapper.eval()
    layers = None if target_layers is None else list(target_layers)

    def batches():
        loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers)
        for batch in loader:
            x, y, mask = (batch[k].to(device) for k in ("x", "y", "mask"))
            if layers is not None:
                y = y[:, layers]
            yield mapper(x, attention_mask=mask.long(), target_layers=layers).float(), y, mask  # (B, L_l, H_l, C)

    try:
        out = logit_metrics(batches(), ratios, loss_config, device=device, seed=seed)
    finally:
        mapper.train(was_training)
    out["crops"] = len(dataset)
    return out


@torch.no_grad()
def logit_metrics(batches: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                  ratios: Sequence[float] = (0.1, 0.3, 0.5), loss_config: LossConfig | None = None, *,
                  device=None, seed: int = 0) -> dict[str, float]:
    """The metrics of :func:`evaluate_mapper` (without ``"crops"``) from batches of ``(logits, y, mask)``: logits
    and oracle scores ``(B, L_l, H_l, C)``, mask ``(B, C)``."""
    cfg = loss_config or LossConfig()
    gen = None
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}

    def add(name: str, total: float, n: float) -> None:
        sums[name] = sums.get(name, 0.0) + total
        counts[name] = counts.get(name, 0.0) + n

    for logits, y, mask in batches:
        if gen is None:  # pair sampling: the same pairs at every evaluation
            gen = torch.Generator(device=device if device is not None else logits.device).manual_seed(seed)
        total, terms = hybrid_loss(logits, y, mask, cfg, generator=gen)
        b = logits.shape[0]
        add("loss", float(total) * b, b)
        for name in TERMS:
            add(f"loss_{name}", float(terms[name]) * b, b)
        for r in ratios:
            for name, fn in (("mass_recovery", mass_recovery), ("topk_recall", topk_recall)):
                v = fn(logits, y, r, mask, reduction="none")  # (B, L_l, H_l)
                ok = torch.isfinite(v)
                add(f"{name}@{r:g}", float(v[ok].sum()), float(ok.sum()))
    return {k: (sums[k] / counts[k] if counts[k] else float("nan")) for k in sums}


def plot_training(log_path: str | os.PathLike, out_path: str | os.PathLike) -> Path | None:
    """Total training loss (red) and validation mass recovery (blues) against the step, from ``log.jsonl``
    (the paper's training-dynamics figure). Returns None when matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        logger.warning("matplotlib is not installed: no %s (pip install matplotlib)", out_path)
        return None
    records = read_log(log_path)
    steps = [r for r in records if r["kind"] == "step"]
    epochs = [r for r in records if r["kind"] == "epoch"]
    fig = Figure(figsize=(7, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], color="tab:red", lw=1, label="train loss")
    ax.set_xlabel("step")
    ax.set_ylabel("total loss", color="tab:red")
    ax2 = ax.twinx()
    keys = sorted({k for r in epochs for k in r if k.startswith("val_mass_recovery@")})
    blues = ["#9ecae1", "#4292c6", "#08519c", "#08306b"]
    for i, k in enumerate(keys):
        pts = [(r["step"], r[k]) for r in epochs if r.get(k) is not None and math.isfinite(r[k])]
        ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, color=blues[i % len(blues)],
                 label=k.removeprefix("val_").replace("mass_recovery", "mass recovery "))
    ax2.set_ylabel("validation mass recovery", color="tab:blue")
    ax2.set_ylim(0, 1)
    if keys:
        ax2.legend(loc="lower right", fontsize=8)
    fig.savefig(out_path, dpi=120)
    return Path(out_path)


def read_log(path: str | os.PathLike) -> list[dict]:
    """The records of a ``log.jsonl``."""
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
