"""Training the mapper on a dataset built by :func:`proxykv_hf.train.data.build_dataset`.

How to run me (library; the CLI wraps it)::

    from proxykv_hf.train.loop import TrainConfig, mapper_config_for, train_mapper
    ckpt = train_mapper("data/smol", "runs/smol", mapper_config_for("data/smol", "small"), TrainConfig(epochs=30))
    # multi-GPU: the same call under `accelerate launch script.py`

The paper's protocol ("Training procedure" and appendix): AdamW (lr 2e-4, weight decay 1e-4), 1,000 linear warmup
steps, then ``ReduceLROnPlateau`` (factor 0.5, patience 3) on the validation loss once per epoch, batch size 8,
grad-clip 1.0, 5% of the crops held out, 30 epochs. ``accelerate`` places the model and the batches, runs bf16
autocast on CUDA (none on CPU) and shards the batches across processes.

``out_dir`` receives the best mapper (lowest validation loss) in the directory format of
:mod:`proxykv_hf.mapper.checkpoint`, ``last/`` (the training state, rewritten after every epoch and when ``max_steps``
stops a run; a later call resumes from it), ``log.jsonl`` (``"step"`` records every ``log_every`` steps, ``"epoch"``
records with the validation metrics) and ``training.png`` (loss and validation mass recovery against the step; redrawn
at the end of a run and every few minutes during one).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from ..mapper.checkpoint import CONFIG_NAME, WEIGHTS_NAME, Checkpoint, save_checkpoint
from .quantiles import dataset_quantiles
from ..models.file_errors import writing
from ..mapper.hub import load_checkpoint
from ..mapper.model import HybridAxialMapper, MapperConfig
from .config import TrainConfig
from .dataset import MapperDataset, split_dataset
from .evaluate import evaluate_mapper, plot_training, read_log
from .losses import hybrid_loss
from .mapper_init import check_mapper_fits, init_mapper_from, mapper_config_for
from .optim import EpochSampler, WarmupPlateau, param_groups
from .resume import LAST_DIR, TrainState, find_last, load_last, save_last

# what the CLI and the how-to above import; TrainConfig lives in config.py (optim.py and resume.py read it too)
__all__ = ["TrainConfig", "mapper_config_for", "train_mapper"]

logger = logging.getLogger(__name__)

LOG_NAME = "log.jsonl"
PLOT_NAME = "training.png"
PLOT_INTERVAL_S = 300.0


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
    quantiles = dataset_quantiles(data_dir) if main else None  # the global budget's table, in every checkpoint
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
        raise ValueError(f"target_layers {list(cfg.target_layers)}: the mapper scores "
                         f"{mapper_config.num_target_layers} target layers")
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
                with writing(out / WEIGHTS_NAME):  # a full disk: an OSError naming the file
                    save_checkpoint(Checkpoint(mapper=unwrapped, proxy=manifest.proxy_spec(),
                                               target=manifest.target_spec(), training=training,
                                               metrics={k: v for k, v in metrics.items() if k != "crops"},
                                               global_quantiles=quantiles), out)
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
