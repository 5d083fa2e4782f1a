"""TrainConfig: the optimisation settings of :func:`~proxykv_hf.train.loop.train_mapper`, the paper's by default.

A module of its own so that the training loop (:mod:`.loop`) and the parts it steps and saves with (:mod:`.optim`,
:mod:`.resume`) import it without importing each other; :mod:`.loop` re-exports it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ..mapper._fields import check_known_fields
from ..attention.statistics import check_statistics
from .losses import LossConfig

__all__ = ["MIXED_PRECISION", "TrainConfig"]

MIXED_PRECISION = ("bf16", "fp16", "no")


@dataclass(kw_only=True)
class TrainConfig:
    """Optimisation settings of :func:`~proxykv_hf.train.loop.train_mapper`; defaults are the paper's.

    Attributes:
        lr, weight_decay: AdamW.
        warmup_steps: linear warmup from ``lr / warmup_steps`` to ``lr``; afterwards ``ReduceLROnPlateau``
            (``plateau_factor``, ``plateau_patience`` epochs) on the validation loss owns the learning rate.
        plateau_factor: ``ReduceLROnPlateau``'s factor, in (0, 1).
        plateau_patience: epochs without a better validation loss before the learning rate drops.
        batch_size: crops per optimizer step and process.
        grad_clip: max global gradient norm (None: no clipping).
        val_fraction: share of the crops held out (by whole texts when ``split_by_text``; see ``split_dataset``).
        split_by_text: hold out whole texts, so that no crop of a validation text is trained on.
        epochs: passes over the training crops.
        max_steps: stop after this many optimizer steps in total (smoke runs); None = ``epochs`` decide.
        seed: model init, data order (a seeded permutation per epoch) and pair sampling of the loss.
        mixed_precision: autocast dtype on CUDA (``"bf16"``, ``"fp16"`` or ``"no"``); CPU always runs float32.
        cpu: train on the CPU even when CUDA is there.
        num_workers: DataLoader workers.
        eval_ratios: keep ratios of the validation mass recovery and Top-K recall.
        eval_batch_size: validation batch size (default ``batch_size``).
        loss: the hybrid loss coefficients.
        init_from: start from the weights of this mapper checkpoint (directory or Hub id; fine-tuning on new
            data); its mapper config must equal the one trained (but for the number of proxy layers, on which no
            weight depends). Optimizer, schedule and step count start fresh. Ignored when resuming a run from
            ``out_dir/last``.
        layers_per_step: train each step on this many target layers drawn at random (the mapper is shared by
            all layers, so this is an unbiased estimate of the full loss at a fraction of the cost; the
            validation always scores every layer, or every one of ``target_layers``); None = all layers.
        target_layers: train and validate on these target layers alone (0-based), e.g. a mapper meant to score
            some layers of a checkpoint whose layers are scored by several mappers
            (:attr:`~proxykv_hf.mapper.checkpoint.Checkpoint.layer_mappers`); ``layers_per_step`` then draws among them.
            None = all.
        statistics: train on these proxy statistics of the dataset (a subset, e.g. ``("sum",)`` of a sum+max
            dataset; :class:`~proxykv_hf.train.dataset.MapperDataset`); None = all it holds. The mapper config
            must read as many (:func:`~proxykv_hf.train.mapper_init.mapper_config_for` with the same ``statistics``).
        proxy_layers: train on these of the dataset's proxy layers (indices into them, increasing; a ``"self"``
            proxy's dataset only): the statistics are then computed on those target layers alone at inference
            (:func:`~proxykv_hf.mapper.proxy.check_self_layers`); None = all. The mapper config must read as many
            (:func:`~proxykv_hf.train.mapper_init.mapper_config_for` with the same ``proxy_layers``).
        log_every: steps between ``"step"`` records of ``log.jsonl`` (each the mean over those steps).
        progress: tqdm bars (main process only).
    """

    lr: float = 2e-4
    weight_decay: float = 1e-4
    warmup_steps: int = 1000
    plateau_factor: float = 0.5
    plateau_patience: int = 3
    batch_size: int = 8
    grad_clip: float | None = 1.0
    val_fraction: float = 0.05
    split_by_text: bool = True
    epochs: int = 30
    max_steps: int | None = None
    seed: int = 0
    mixed_precision: str = "bf16"
    cpu: bool = False
    num_workers: int = 0
    eval_ratios: tuple[float, ...] = (0.1, 0.3, 0.5)
    eval_batch_size: int | None = None
    loss: LossConfig = field(default_factory=LossConfig)
    layers_per_step: int | None = None
    target_layers: tuple[int, ...] | None = None
    init_from: str | None = None
    statistics: tuple[str, ...] | None = None
    proxy_layers: tuple[int, ...] | None = None
    log_every: int = 50
    progress: bool = True

    def __post_init__(self) -> None:
        self.eval_ratios = tuple(self.eval_ratios)
        for name in ("lr", "weight_decay"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        for name, low in (("warmup_steps", 0), ("plateau_patience", 0), ("batch_size", 1), ("epochs", 1),
                          ("seed", 0), ("num_workers", 0), ("log_every", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        for name in ("max_steps", "eval_batch_size", "layers_per_step"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        if not 0 < self.plateau_factor < 1:
            raise ValueError(f"plateau_factor must be in (0, 1), got {self.plateau_factor!r}")
        if self.grad_clip is not None and not 0 < self.grad_clip < math.inf:
            raise ValueError(f"grad_clip must be > 0 or None, got {self.grad_clip!r}")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction!r}")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"mixed_precision must be one of {MIXED_PRECISION}, got {self.mixed_precision!r}")
        if not self.eval_ratios or any(not 0 < r <= 1 for r in self.eval_ratios):
            raise ValueError(f"eval_ratios must be values in (0, 1], got {self.eval_ratios!r}")
        if self.statistics is not None:
            self.statistics = check_statistics(self.statistics)
        if self.target_layers is not None:
            self.target_layers = tuple(sorted(set(self.target_layers)))
            if not self.target_layers or any(type(i) is not int or i < 0 for i in self.target_layers):
                raise ValueError(f"target_layers must be a non-empty list of ints >= 0 or None, "
                                 f"got {self.target_layers!r}")
        if self.proxy_layers is not None:
            self.proxy_layers = tuple(self.proxy_layers)
            if not self.proxy_layers or any(isinstance(i, bool) or not isinstance(i, int) for i in self.proxy_layers):
                raise ValueError(f"proxy_layers must be a non-empty list of ints or None, got {self.proxy_layers!r}")
        if not isinstance(self.loss, LossConfig):
            raise ValueError(f"loss must be a LossConfig, got {type(self.loss).__name__}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable field dict."""
        return {**dataclasses.asdict(self), "loss": self.loss.to_dict(), "eval_ratios": list(self.eval_ratios),
                "statistics": None if self.statistics is None else list(self.statistics),
                "proxy_layers": None if self.proxy_layers is None else list(self.proxy_layers)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        check_known_fields(cls, data)
        data = dict(data)
        if isinstance(data.get("loss"), dict):
            data["loss"] = LossConfig.from_dict(data["loss"])
        return cls(**data)
