"""How a training run steps: AdamW parameter groups (:func:`param_groups`), the learning-rate schedule
(:class:`WarmupPlateau`) and the data order (:class:`EpochSampler`)."""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torch.utils.data import Sampler

from ..mapper.model import HybridAxialMapper
from .config import TrainConfig


DIRECT_PATH_LR_MULT = 50.0
"""Learning-rate multiplier of the mapper's direct path (``MapperConfig.direct_path``, beyond the paper): a few
hundred linear weights that start at zero, so at the encoder's learning rate they would move ~``lr`` per step (the
bundled mapper was trained with it; warmup and plateau decay apply to them alike)."""


def param_groups(mapper: HybridAxialMapper, cfg: TrainConfig) -> list[dict]:
    """AdamW parameter groups: the direct path (if any) at ``lr * DIRECT_PATH_LR_MULT``, the rest at ``lr``."""
    named = list(mapper.named_parameters())
    groups = [{"params": [p for n, p in named if not n.startswith("direct.")]}]
    direct = [p for n, p in named if n.startswith("direct.")]
    if direct:
        groups.append({"params": direct, "lr": cfg.lr * DIRECT_PATH_LR_MULT})
    return groups


class EpochSampler(Sampler[int]):
    """A seeded random permutation of ``range(n)`` per epoch (reproducible across resumes).

    The epoch is set by the loop through :meth:`use_epoch`; there is deliberately no ``set_epoch``, which
    ``accelerate``'s loaders call with their own iteration counter (reset by ``skip_first_batches``).
    """

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed, self.epoch = n, seed, 0

    def use_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.n, generator=gen).tolist())

    def __len__(self) -> int:
        return self.n


class WarmupPlateau:
    """Linear warmup per step, then ``ReduceLROnPlateau`` per epoch (only once warmup is over)."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_steps: int, factor: float, patience: int):
        self.optimizer, self.warmup_steps = optimizer, warmup_steps
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=factor,
                                                                  patience=patience)
        self.steps = 0
        self._apply()

    def _apply(self) -> None:
        if self.steps < self.warmup_steps:  # the (steps+1)-th update uses lr * (steps+1) / warmup
            for g, base in zip(self.optimizer.param_groups, self.base_lrs):
                g["lr"] = base * (self.steps + 1) / self.warmup_steps

    def step(self) -> None:
        """After each optimizer step."""
        self.steps += 1
        self._apply()

    def epoch_end(self, metric: float) -> None:
        """After each full epoch, with the validation loss."""
        if self.steps >= self.warmup_steps and math.isfinite(metric):
            self.plateau.step(metric)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict:
        return {"steps": self.steps, "base_lrs": self.base_lrs, "plateau": self.plateau.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.base_lrs = state["steps"], list(state["base_lrs"])
        self.plateau.load_state_dict(state["plateau"])
