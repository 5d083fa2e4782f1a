"""Refitting a trained mapper's direct path with everything else frozen (``proxykv refit-direct``).

The direct path (:class:`~proxykv_hf.mapper_blocks.DirectPath`) is the only part of a mapper with weights of its
own per target layer: the stem, the encoder and the head stage are shared by all layers. During training each step
sees ``layers_per_step`` of the target layers, so each layer's direct weights are updated in a fraction of the
steps, and weights on statistics added by widening start at zero. Here the frozen part's logits and the direct
path's inputs are computed once per crop; the direct weights are then fitted with the hybrid loss on every target
layer at every step, which costs a small fraction of a training step.

How to run me::

    from proxykv_hf.train.direct_fit import DirectFitConfig, refit_direct_path
    ckpt = refit_direct_path("runs/my-mapper", "data/train", "runs/my-mapper-refit", DirectFitConfig(epochs=40))
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .._fields import check_known_fields
from ..hub import Checkpoint, load_checkpoint, save_checkpoint
from ..mapper import HybridAxialMapper
from .dataset import MapperDataset, split_dataset
from .evaluate import logit_metrics
from .losses import LossConfig, hybrid_loss
from .manifest import Manifest
from .mapper_init import check_mapper_fits, init_mapper_from

__all__ = ["DirectFitConfig", "refit_direct_path"]

logger = logging.getLogger(__name__)

LOG_NAME = "refit_log.jsonl"


@dataclass(kw_only=True)
class DirectFitConfig:
    """Settings of :func:`refit_direct_path`.

    Attributes:
        epochs: passes over the training crops (every target layer at every step).
        lr: AdamW learning rate of the direct weights and biases.
        weight_decay: AdamW weight decay.
        batch_size: crops per step.
        val_fraction: share of the crops held out (whole texts, as in training); the epoch with the lowest
            validation loss is kept, and the checkpoint as it was if no epoch beats it.
        seed: the split, the data order and the pair sampling of the loss.
        loss: the hybrid loss (the paper's coefficients by default).
        eval_ratios: keep ratios of the validation metrics.
        progress: a progress bar over the epochs.
        direct_context: refit with the direct path also reading this many proxy layers before the paired one
            (``MapperConfig.direct_context``); weights on layers the checkpoint did not read start at zero. None:
            the checkpoint's own.
    """

    epochs: int = 40
    lr: float = 1e-2
    weight_decay: float = 0.0
    batch_size: int = 8
    val_fraction: float = 0.1
    seed: int = 0
    loss: LossConfig = field(default_factory=LossConfig)
    eval_ratios: tuple[float, ...] = (0.1, 0.3, 0.5)
    progress: bool = True
    direct_context: int | None = None

    def __post_init__(self) -> None:
        if self.direct_context is not None and (isinstance(self.direct_context, bool)
                                                or not isinstance(self.direct_context, int) or self.direct_context < 0):
            raise ValueError(f"direct_context must be None or an int >= 0, got {self.direct_context!r}")
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError(f"epochs and batch_size must be >= 1, got {self.epochs}, {self.batch_size}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if isinstance(self.loss, dict):
            self.loss = LossConfig.from_dict(self.loss)
        self.eval_ratios = tuple(self.eval_ratios)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "loss": self.loss.to_dict(), "eval_ratios": list(self.eval_ratios)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DirectFitConfig:
        check_known_fields(cls, data)
        return cls(**data)


@torch.no_grad()
def _frozen_parts(mapper, dataset) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per crop: the logits without the direct path ``(n, L_l, H_l, C)``, the direct path's inputs of every proxy
    layer ``(n, L_s, F, C)``, the oracle ``(n, L_l, H_l, C)`` and the mask ``(n, C)``."""
    direct, mapper.direct = mapper.direct, None
    base, feats, ys, masks = [], [], [], []
    try:
        for i in range(len(dataset)):
            item = dataset[i]
            x, mask = item["x"][None], item["mask"][None]
            base.append(mapper(x, attention_mask=mask.long())[0])
            feats.append(torch.stack([direct.features(x[:, p], mask) for p in range(x.shape[1])], dim=1)[0])
            ys.append(item["y"])
            masks.append(item["mask"])
    finally:
        mapper.direct = direct
    return torch.stack(base), torch.stack(feats), torch.stack(ys), torch.stack(masks)


def _direct_logits(weight: Tensor, bias: Tensor, feats: Tensor, sources: Tensor) -> Tensor:
    """Direct-path logits of every target layer: weight ``(L_l, H_l, K * F)``, feats ``(B, L_s, F, C)``, sources
    ``(L_l, K)`` the proxy layers each target layer reads (:meth:`MapperConfig.direct_sources`; -1: zeros) ->
    ``(B, L_l, H_l, C)``."""
    padded = torch.cat([feats, feats.new_zeros(feats[:, :1].shape)], dim=1)  # row L_s: the zeros for -1
    inputs = padded[:, sources.where(sources >= 0, feats.shape[1])].flatten(2, 3)  # (B, L_l, K * F, C)
    return torch.einsum("lhf,blfc->blhc", weight, inputs) + bias[None, :, :, None]


def _with_context(mapper: HybridAxialMapper, context: int | None) -> HybridAxialMapper:
    """``mapper``, or a copy whose direct path reads ``context`` earlier proxy layers (new weights at zero)."""
    if context is None or context == mapper.config.direct_context:
        return mapper
    if context < mapper.config.direct_context:
        raise ValueError(f"direct_context {context} is below the checkpoint's ({mapper.config.direct_context}): "
                         "a refit can widen the direct path, not narrow it")
    wide = HybridAxialMapper(dataclasses.replace(mapper.config, direct_context=context))
    init_mapper_from(wide, mapper, "the checkpoint")
    return wide.float().eval()


def refit_direct_path(checkpoint: str | os.PathLike, data_dir: str | os.PathLike, out_dir: str | os.PathLike,
                      config: DirectFitConfig | None = None) -> Checkpoint:
    """Fit the direct path of a trained mapper anew, the rest of it frozen, and save the result to ``out_dir``.

    Args:
        checkpoint: a mapper with ``direct_path`` on (a directory or a Hub id); its direct weights are the start.
        data_dir: a dataset from ``proxykv build-data`` for the checkpoint's proxy and target.
        out_dir: where the refitted checkpoint goes (``proxykv_config.json``, ``model.safetensors``, a model card)
            with :data:`LOG_NAME` (one record per epoch).
        config: :class:`DirectFitConfig`.

    Returns:
        The refitted checkpoint, loaded back from ``out_dir``; its ``training`` records the refit under
        ``"direct_refit"`` and its ``metrics`` are the validation metrics of the kept epoch.

    The frozen part is run once per crop in eval mode with the checkpoint's own windows (``stride`` included: what
    inference computes), and its outputs are held in memory: ``4 x C x (2 x L_l x H_l + L_s x F)`` bytes a crop.
    """
    from tqdm.auto import tqdm

    cfg = config or DirectFitConfig()
    ckpt = load_checkpoint(checkpoint)
    mapper = ckpt.only_mapper("refit-direct").float().eval()
    if mapper.direct is None:
        raise ValueError(f"{checkpoint} has no direct path (MapperConfig.direct_path is off): nothing to refit")
    mapper = _with_context(mapper, cfg.direct_context)
    dataset = MapperDataset(data_dir, statistics=ckpt.proxy.statistics, proxy_layers=_stored_indices(ckpt, data_dir))
    check_mapper_fits(mapper.config, dataset.manifest)
    for name, want, got in (("target", ckpt.target.model_id, dataset.manifest.target_spec().model_id),
                            ("proxy kind", ckpt.proxy.kind, dataset.manifest.proxy_spec().kind)):
        if want != got:
            raise ValueError(f"{data_dir} was built for {name} {got!r}, the checkpoint reads {want!r}")
    train_set, val_set = split_dataset(dataset, cfg.val_fraction, cfg.seed)
    if len(train_set) == 0:
        raise ValueError(f"{data_dir} holds no training crops")
    base, feats, ys, masks = _frozen_parts(mapper, train_set)
    val_parts = _frozen_parts(mapper, val_set) if len(val_set) else None
    sources = torch.tensor(mapper.config.direct_sources())
    weight = mapper.direct.weight.detach().clone().requires_grad_(True)
    bias = mapper.direct.bias.detach().clone().requires_grad_(True)
    optimizer = torch.optim.AdamW([weight, bias], lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)

    def validate() -> dict[str, float]:
        if val_parts is None:
            return {}
        vb, vf, vy, vm = val_parts
        with torch.no_grad():
            batches = ((vb[s:s + cfg.batch_size] + _direct_logits(weight, bias, vf[s:s + cfg.batch_size], sources),
                        vy[s:s + cfg.batch_size], vm[s:s + cfg.batch_size]) for s in range(0, vb.shape[0], cfg.batch_size))
            return logit_metrics(batches, cfg.eval_ratios, cfg.loss, seed=cfg.seed)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / LOG_NAME
    start = validate()
    best = {"epoch": 0, "metrics": start, "monitor": start.get("loss", float("inf")),
            "weight": weight.detach().clone(), "bias": bias.detach().clone()}
    records = [{"epoch": 0, **{f"val_{k}": v for k, v in start.items()}}]
    n = base.shape[0]
    bar = tqdm(range(1, cfg.epochs + 1), desc="refit direct path", disable=not cfg.progress)
    for epoch in bar:
        order = torch.randperm(n, generator=gen)
        total_loss = 0.0
        for s in range(0, n, cfg.batch_size):
            idx = order[s:s + cfg.batch_size]
            logits = base[idx] + _direct_logits(weight, bias, feats[idx], sources)
            loss, _ = hybrid_loss(logits, ys[idx], masks[idx], cfg.loss, generator=gen)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total_loss += float(loss.detach()) * len(idx)
        metrics = validate()
        records.append({"epoch": epoch, "train_loss": total_loss / n, **{f"val_{k}": v for k, v in metrics.items()}})
        monitor = metrics.get("loss", total_loss / n)
        if monitor < best.get("monitor", float("inf")):
            best = {"epoch": epoch, "metrics": metrics, "monitor": monitor, "weight": weight.detach().clone(),
                    "bias": bias.detach().clone()}
        bar.set_postfix(val_loss=f"{monitor:.4f}", best_epoch=best["epoch"], refresh=False)
    log_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with torch.no_grad():
        mapper.direct.weight.copy_(best["weight"])
        mapper.direct.bias.copy_(best["bias"])
    refit = {"from": str(checkpoint), "data_dir": str(data_dir), "train_crops": len(train_set),
             "val_crops": len(val_set), "best_epoch": best["epoch"], "config": cfg.to_dict(),
             "val_loss_before": start.get("loss"), "val_loss_after": best["metrics"].get("loss")}
    training = {**(ckpt.training or {}), "direct_refit": refit}
    metrics = {k: v for k, v in best["metrics"].items() if k != "crops"}
    logger.info("direct path refit: validation loss %.4f -> %.4f (epoch %d)", refit["val_loss_before"] or 0.0,
                refit["val_loss_after"] or 0.0, best["epoch"])
    save_checkpoint(dataclasses.replace(ckpt, mapper=mapper, training=training, metrics=metrics), out)
    return load_checkpoint(out)


def _stored_indices(ckpt, data_dir) -> list[int] | None:
    """Where a self proxy's checkpoint reads a subset of layers, their indices among the dataset's stored ones."""
    if ckpt.proxy.kind != "self" or ckpt.proxy.layers is None:
        return None
    spec = Manifest.load(data_dir).proxy_spec()
    stored = spec.layer_list()
    missing = [l for l in ckpt.proxy.layers if l not in stored]
    if missing:
        raise ValueError(f"{data_dir} holds no features of the layers {missing} that the checkpoint reads")
    return [stored.index(l) for l in ckpt.proxy.layers]
