"""Training the mapper on a dataset built by :func:`proxykv_hf.train.data.build_dataset`.

How to run me (library; the CLI wraps it)::

    from proxykv_hf.train.loop import TrainConfig, mapper_config_for, train_mapper
    ckpt = train_mapper("data/smol", "runs/smol", mapper_config_for("data/smol", "small"), TrainConfig(epochs=30))
    # multi-GPU: the same call under `accelerate launch script.py`

The paper's protocol ("Training procedure" and appendix): AdamW (lr 2e-4, weight decay 1e-4), 1,000 linear warmup
steps, then ``ReduceLROnPlateau`` (factor 0.5, patience 3) on the validation loss once per epoch, batch size 8,
grad-clip 1.0, 5% of the crops held out, 30 epochs. ``accelerate`` places the model and the batches, runs bf16
autocast on CUDA (none on CPU) and shards the batches across processes.

``out_dir`` receives the best mapper (lowest validation loss) in the Hub format of :mod:`proxykv_hf.hub`,
``last/`` (the training state, rewritten after every epoch and when ``max_steps`` stops a run; a later call
resumes from it), ``log.jsonl`` (``"step"`` records every ``log_every`` steps, ``"epoch"`` records with the
validation metrics) and ``training.png`` (loss and validation mass recovery against the step; redrawn at the
end of a run and every few minutes during one).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from .._fields import check_known_fields
from ..hub import CONFIG_NAME, Checkpoint, load_checkpoint, save_checkpoint
from ..mapper import HybridAxialMapper, MapperConfig
from ..scoring import check_statistics
from .dataset import MapperDataset, split_dataset
from .evaluate import evaluate_mapper, plot_training, read_log
from .losses import LossConfig, hybrid_loss
from .mapper_init import check_mapper_fits, init_mapper_from, mapper_config_for
from .optim import EpochSampler, WarmupPlateau, param_groups
from .resume import LAST_DIR, TrainState, find_last, load_last, save_last

__all__ = ["TrainConfig", "mapper_config_for", "train_mapper"]  # what the CLI and the how-to above import

logger = logging.getLogger(__name__)

LOG_NAME = "log.jsonl"
PLOT_NAME = "training.png"
MIXED_PRECISION = ("bf16", "fp16", "no")
PLOT_INTERVAL_S = 300.0


@dataclass(kw_only=True)
class TrainConfig:
    """Optimisation settings of :func:`train_mapper`; defaults are the paper's.

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
            data); its mapper config must equal the one trained, except that the new one may add parameters
            that start as a no-op (``direct_path``: those keep their zero initialisation). Optimizer, schedule
            and step count start fresh. Ignored when resuming a run from ``out_dir/last``.
        direct_path_lr_mult: learning-rate multiplier of the mapper's direct-path parameters
            (``MapperConfig.direct_path``, beyond the paper): they are a few hundred linear weights that start at
            zero, so at the encoder's learning rate they would move ~``lr`` per step; warmup and plateau decay
            apply to them alike.
        layers_per_step: train each step on this many target layers drawn at random (the mapper is shared by
            all layers, so this is an unbiased estimate of the full loss at a fraction of the cost; the
            validation always scores every layer, or every one of ``target_layers``); None = all layers.
        target_layers: train and validate on these target layers alone (0-based), e.g. a mapper meant to score
            some layers of a combined checkpoint (:func:`~proxykv_hf.hub.combine_checkpoints`); ``layers_per_step``
            then draws among them. None = all.
        statistics: train on these proxy statistics of the dataset (a subset, e.g. ``("sum",)`` of a sum+max
            dataset; :class:`~proxykv_hf.train.dataset.MapperDataset`); None = all it holds. The mapper config
            must read as many (:func:`mapper_config_for` with the same ``statistics``).
        proxy_layers: train on these of the dataset's proxy layers (indices into them, increasing; a ``"self"``
            proxy's dataset only): the statistics are then computed on those target layers alone at inference
            (:func:`~proxykv_hf.proxy.check_self_layers`); None = all. The mapper config must read as many
            (:func:`mapper_config_for` with the same ``proxy_layers``).
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
    direct_path_lr_mult: float = 1.0
    statistics: tuple[str, ...] | None = None
    proxy_layers: tuple[int, ...] | None = None
    log_every: int = 50
    progress: bool = True

    def __post_init__(self) -> None:
        self.eval_ratios = tuple(self.eval_ratios)
        for name in ("lr", "weight_decay", "direct_path_lr_mult"):
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



def train_mapper(data_dir: str | os.PathLike, out_dir: str | os.PathLike, mapper_config: MapperConfig,
                 train_config: TrainConfig | None = None, *, resume: bool = True) -> Checkpoint:
    """Train a :class:`HybridAxialMapper` on ``data_dir`` and save the best one to ``out_dir``.

    Args:
        data_dir: a dataset written by :func:`~proxykv_hf.train.data.build_dataset`.
        out_dir: run directory (see the module docstring for its contents).
        mapper_config: the mapper's shape and size; its shape fields must match the dataset
            (:func:`mapper_config_for` builds one).
        train_config: :class:`TrainConfig`; default ``TrainConfig()`` (the paper's settings).
        resume: continue from ``out_dir/last`` if present (same data order, optimizer, scheduler and RNG: the
            run ends where an uninterrupted one would); False starts over.

    Returns:
        The best checkpoint, as loaded back from ``out_dir`` (target and proxy specs from the data manifest,
        ``training``: data summary, steps, epochs, wall time, device; ``metrics``: validation metrics).
    """
    from accelerate import Accelerator
    from accelerate.utils import broadcast_object_list
    from tqdm.auto import tqdm

    cfg = train_config or TrainConfig()
    out = Path(out_dir)
    dataset = MapperDataset(data_dir, statistics=cfg.statistics, proxy_layers=cfg.proxy_layers)
    manifest = dataset.manifest
    check_mapper_fits(mapper_config, manifest)
    if len(dataset) == 0:
        raise ValueError(f"{data_dir} holds no crops; build the dataset first")
    train_set, val_set = split_dataset(dataset, cfg.val_fraction, cfg.seed, by_text=cfg.split_by_text)
    use_cuda = torch.cuda.is_available() and not cfg.cpu
    _fresh_accelerator_state()
    accelerator = Accelerator(cpu=not use_cuda, mixed_precision=cfg.mixed_precision if use_cuda else "no")
    main = accelerator.is_main_process
    if main:
        out.mkdir(parents=True, exist_ok=True)
        if not resume:
            for name in (LAST_DIR, LAST_DIR + ".old", LAST_DIR + ".tmp"):
                shutil.rmtree(out / name, ignore_errors=True)
            (out / LOG_NAME).unlink(missing_ok=True)
    accelerator.wait_for_everyone()

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    if cfg.target_layers is not None and cfg.target_layers[-1] >= mapper_config.num_target_layers:
        raise ValueError(f"target_layers {list(cfg.target_layers)}: the mapper scores {mapper_config.num_target_layers} "
                         "target layers")
    mapper = HybridAxialMapper(mapper_config)
    last = find_last(out) if resume else None
    if cfg.init_from is not None and last is None:  # a resumed run's own state wins
        init_mapper_from(mapper, load_checkpoint(cfg.init_from).only_mapper("--init-from"), cfg.init_from)
    optimizer = torch.optim.AdamW(param_groups(mapper, cfg), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sampler = EpochSampler(len(train_set), cfg.seed)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.num_workers,
                        pin_memory=use_cuda)
    model, optimizer, loader = accelerator.prepare(mapper, optimizer, loader)
    scheduler = WarmupPlateau(optimizer, cfg.warmup_steps, cfg.plateau_factor, cfg.plateau_patience)
    gen = torch.Generator(device=accelerator.device).manual_seed(cfg.seed + accelerator.process_index)
    unwrapped = accelerator.unwrap_model(model)

    state = TrainState()
    if last is not None:
        state = load_last(last, unwrapped, optimizer, scheduler, gen, mapper_config, cfg)
        logger.info("resuming %s at step %d (epoch %d, batch %d)", out, state.step, state.epoch, state.epoch_step)
        if main:  # drop log records of steps the saved state does not include
            kept = [r for r in read_log(out / LOG_NAME) if r["step"] <= state.step]
            (out / LOG_NAME).write_text("".join(json.dumps(r) + "\n" for r in kept))

    def log(record: dict) -> None:
        if main:
            with (out / LOG_NAME).open("a") as fh:
                fh.write(json.dumps(record) + "\n")

    def finished() -> bool:
        return state.epoch >= cfg.epochs or (cfg.max_steps is not None and state.step >= cfg.max_steps)

    steps_per_epoch = len(loader)
    summary = {**manifest.summary(), "train_crops": len(train_set), "val_crops": len(val_set),
               "data_dir": str(data_dir), "train_config": cfg.to_dict(),
               "device": torch.cuda.get_device_name(accelerator.device) if use_cuda else "cpu",
               "num_processes": accelerator.num_processes}
    logger.info("training on %d crops (%d validation), %d steps per epoch, %s x%d", len(train_set), len(val_set),
                steps_per_epoch, summary["device"], accelerator.num_processes)
    has_best = (out / CONFIG_NAME).is_file() and state.best_step >= 0
    last_plot = time.perf_counter()

    while not finished():
        t0 = time.perf_counter()
        sampler.use_epoch(state.epoch)
        batches = accelerator.skip_first_batches(loader, state.epoch_step) if state.epoch_step else loader
        model.train()
        window: list[dict[str, float]] = []
        epoch_loss, epoch_n = 0.0, 0
        bar = tqdm(total=steps_per_epoch, initial=state.epoch_step, desc=f"epoch {state.epoch + 1}/{cfg.epochs}",
                   disable=not (main and cfg.progress), leave=False)
        for batch in batches:
            y, layers = batch["y"], None if cfg.target_layers is None else list(cfg.target_layers)
            pool = layers or list(range(y.shape[1]))
            if cfg.layers_per_step is not None and cfg.layers_per_step < len(pool):
                drawn = torch.randperm(len(pool), generator=gen, device=gen.device)[:cfg.layers_per_step]
                layers = sorted(pool[i] for i in drawn.tolist())
            if layers is not None:
                y = y[:, layers]
            with accelerator.autocast():
                logits = model(batch["x"], attention_mask=batch["mask"].long(), target_layers=layers)
            total, terms = hybrid_loss(logits.float(), y, batch["mask"], cfg.loss, generator=gen)  # (B, L, H_l, C)
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(total)
            if cfg.grad_clip is not None:
                accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            lr = scheduler.lr
            optimizer.step()
            scheduler.step()
            state.step += 1
            state.epoch_step += 1
            value = float(total.detach())
            epoch_loss, epoch_n = epoch_loss + value, epoch_n + 1
            window.append({"loss": value, **{f"loss_{k}": float(v.detach()) for k, v in terms.items()}})
            bar.update(1)
            bar.set_postfix(loss=f"{value:.3f}", refresh=False)
            if state.step % cfg.log_every == 0:
                mean = {k: sum(w[k] for w in window) / len(window) for k in window[0]}
                log({"kind": "step", "step": state.step, "epoch": state.epoch, "lr": lr, **mean})
                window = []
            if cfg.max_steps is not None and state.step >= cfg.max_steps:
                break
        bar.close()
        complete = state.epoch_step >= steps_per_epoch
        if complete:
            state.epoch += 1
            state.epoch_step = 0

        metrics = None
        if main:
            metrics = evaluate_mapper(unwrapped, val_set, cfg.eval_ratios, cfg.loss,
                                      batch_size=cfg.eval_batch_size or cfg.batch_size, seed=cfg.seed,
                                      target_layers=cfg.target_layers)
        metrics = broadcast_object_list([metrics])[0]
        train_loss = epoch_loss / max(epoch_n, 1)
        monitor = metrics.get("loss", train_loss)  # no validation set: the training loss decides
        if complete:
            scheduler.epoch_end(monitor)
        improved = monitor < state.best
        if improved:
            state.best, state.best_epoch, state.best_step = monitor, state.epoch, state.step
        record = {"kind": "epoch", "epoch": state.epoch, "step": state.step, "complete": complete,
                  "train_loss": train_loss, "lr": scheduler.lr, "wall_s": state.wall_s,
                  **{f"val_{k}": v for k, v in metrics.items()}}
        log(record)
        logger.info("epoch %d step %d: train loss %.4f, val loss %.4f, mass recovery %s", state.epoch, state.step,
                    train_loss, metrics.get("loss", float("nan")),
                    {k.split("@")[1]: round(v, 4) for k, v in metrics.items() if k.startswith("mass_recovery")})
        state.wall_s += time.perf_counter() - t0
        if main:
            if improved or not has_best:
                training = {**summary, "steps": state.step, "epochs": _epochs(state, steps_per_epoch),
                            "wall_time_s": round(state.wall_s, 1), "best_epoch": state.epoch,
                            "best_step": state.step, "selected_by": "val loss" if metrics else "train loss"}
                save_checkpoint(Checkpoint(mapper=unwrapped, proxy=manifest.proxy_spec(),
                                           target=manifest.target_spec(), training=training,
                                           metrics={k: v for k, v in metrics.items() if k != "crops"}), out)
                has_best = True
            save_last(out, unwrapped, optimizer, scheduler, state, gen, mapper_config, cfg)
            if time.perf_counter() - last_plot > PLOT_INTERVAL_S:  # long runs: a fresh figure now and then
                plot_training(out / LOG_NAME, out / PLOT_NAME)
                last_plot = time.perf_counter()
        accelerator.wait_for_everyone()

    if main:
        plot_training(out / LOG_NAME, out / PLOT_NAME)
    if not (out / CONFIG_NAME).is_file():
        raise RuntimeError(f"no checkpoint in {out}: the run ended before its first evaluation")
    return load_checkpoint(out)


def _fresh_accelerator_state() -> None:
    """In a single process, forget the settings of an earlier ``Accelerator`` (a previous run with another
    ``mixed_precision`` or device in the same notebook), which ``accelerate`` would otherwise refuse to change. Under
    a distributed launch the state belongs to the launcher and stays."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _epochs(state: TrainState, steps_per_epoch: int) -> float:
    return round(state.epoch + state.epoch_step / max(steps_per_epoch, 1), 3)
