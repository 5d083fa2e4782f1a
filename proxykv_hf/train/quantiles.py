"""The global budget's quantile table of a mapper, fitted on a built dataset's oracle scores
(:mod:`proxykv_hf.mapper.calibration`): ``proxykv train`` stores it in every checkpoint it writes, and
``proxykv calibrate`` adds it to a checkpoint trained before (a new directory; the checkpoint is left as it is)."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch

from ..mapper.calibration import GRID, fit_quantiles
from ..mapper.checkpoint import Checkpoint
from ..models.file_errors import reading
from .manifest import Manifest
from .shards import open_shard

logger = logging.getLogger(__name__)


def _crops(data_dir: Path, manifest: Manifest) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for shard in manifest.shards:
        with open_shard(data_dir / shard["file"], shard["crops"]) as f, reading(data_dir / shard["file"], "shard"):
            y, mask = f.get_tensor("y"), f.get_tensor("mask")
        yield from zip(y.unbind(0), mask.unbind(0))


def dataset_quantiles(data_dir: str | os.PathLike, n: int = GRID) -> torch.Tensor:
    """The quantile table ``(L_l, H_kv, n)`` of the oracle scores of every crop of a dataset."""
    data_dir = Path(data_dir)
    return fit_quantiles(_crops(data_dir, Manifest.load(data_dir)), n)


def calibrated(ckpt: Checkpoint, data_dir: str | os.PathLike) -> Checkpoint:
    """``ckpt`` with the quantile table of ``data_dir``'s oracle scores, which must be of the checkpoint's target
    (same model, layers and KV heads); a new Checkpoint sharing the mappers."""
    target = Manifest.load(Path(data_dir)).target_spec()
    if replace(target, model_id=ckpt.target.model_id) != ckpt.target:
        raise ValueError(f"the dataset's oracle scores are of {target}, the mapper scores {ckpt.target}: calibrate "
                         "on a dataset built for the mapper's target")
    if target.model_id != ckpt.target.model_id:
        logger.warning("the dataset's oracle is %r, the mapper's target %r: the same shape, so calibrating on it; "
                       "make sure they are the same model", target.model_id, ckpt.target.model_id)
    return replace(ckpt, global_quantiles=dataset_quantiles(data_dir))
