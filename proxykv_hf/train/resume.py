"""The resumable state of a training run: ``out_dir/last`` holds the mapper's weights and ``state.pt`` (optimizer,
schedule, :class:`TrainState` counters, RNG states, the mapper config and the fields the data order depends on),
written as a whole after every epoch (:func:`save_last`) and read back to resume (:func:`find_last`,
:func:`load_last`)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..mapper.checkpoint import WEIGHTS_NAME
from ..models.file_errors import reading, writing
from ..mapper.model import MapperConfig
from .config import TrainConfig
from .optim import WarmupPlateau

logger = logging.getLogger(__name__)

LAST_DIR = "last"


@dataclass
class TrainState:
    """Counters of a run, saved with it: where it is and its best validation result so far."""

    epoch: int = 0  # current epoch (0-based)
    epoch_step: int = 0  # batches done in the current epoch
    step: int = 0  # optimizer steps in total
    best: float = math.inf
    best_epoch: int = -1
    best_step: int = -1
    wall_s: float = 0.0


_ORDER_FIELDS = ("batch_size", "seed", "val_fraction", "split_by_text")  # what the data order depends on


def save_last(out: Path, mapper, optimizer, scheduler: WarmupPlateau, state: TrainState, gen: torch.Generator,
              config: MapperConfig, train_config: TrainConfig) -> None:
    """Write ``out/last`` as a whole: a temporary directory, then two renames."""
    tmp, last, old = out / (LAST_DIR + ".tmp"), out / LAST_DIR, out / (LAST_DIR + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with writing(last / WEIGHTS_NAME):
        save_file({k: v.detach().contiguous().cpu() for k, v in mapper.state_dict().items()},
                  str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "loss_pairs": gen.get_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "state": dataclasses.asdict(state), "rng": rng, "mapper_config": config.to_dict(),
                "order": {k: getattr(train_config, k) for k in _ORDER_FIELDS},
                "statistics": train_config.statistics, "proxy_layers": train_config.proxy_layers},
               tmp / "state.pt")
    if last.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(last, old)
    os.replace(tmp, last)
    shutil.rmtree(old, ignore_errors=True)


def find_last(out: Path) -> Path | None:
    """The saved state of the run in ``out``, or None."""
    for name in (LAST_DIR, LAST_DIR + ".old"):  # .old: interrupted between the two renames
        if (out / name / "state.pt").is_file() and (out / name / WEIGHTS_NAME).is_file():
            return out / name
    return None


def load_last(path: Path, mapper, optimizer, scheduler: WarmupPlateau, gen: torch.Generator,
              config: MapperConfig, train_config: TrainConfig) -> TrainState:
    """Restore weights, optimizer, schedule and RNG states from ``path`` (:func:`find_last`); raise ``ValueError``
    when it holds a run with another mapper config or other statistics."""
    saved = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    changed = {k: (v, getattr(train_config, k)) for k, v in saved.get("order", {}).items()
               if getattr(train_config, k) != v}
    if changed:
        logger.warning("resuming %s with other %s (saved, new): the data order differs from the saved run's",
                       path, changed)
    if saved.get("statistics") != train_config.statistics:  # same count, other rows: the mapper config would pass
        raise ValueError(f"{path} holds a run on the statistics {saved.get('statistics') or 'all'}, not "
                         f"{train_config.statistics or 'all'}; use another out_dir or resume=False")
    if saved.get("proxy_layers") != train_config.proxy_layers:  # same count, other layers: as the statistics
        raise ValueError(f"{path} holds a run on the proxy layers {saved.get('proxy_layers') or 'all'}, not "
                         f"{train_config.proxy_layers or 'all'}; use another out_dir or resume=False")
    if saved["mapper_config"] != config.to_dict():
        diff = {k: (saved["mapper_config"].get(k), v) for k, v in config.to_dict().items()
                if saved["mapper_config"].get(k) != v}
        raise ValueError(f"{path} holds a run with another mapper config (field: (saved, new)) {diff}; "
                         "use another out_dir or resume=False")
    with reading(path / WEIGHTS_NAME, "saved training state"):
        weights = load_file(str(path / WEIGHTS_NAME), device=str(next(mapper.parameters()).device))
    mapper.load_state_dict(weights)
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    rng = saved["rng"]
    torch.set_rng_state(rng["torch"])
    random.setstate(_as_tuple(rng["python"]))
    gen.set_state(rng["loss_pairs"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return TrainState(**saved["state"])


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x
