"""One dataset built by several processes (or GPUs): ``build-data`` under ``torchrun`` or ``accelerate launch``.

How to run me (the CLI wraps it)::

    torchrun --standalone --nproc-per-node 4 -m proxykv_hf.cli build-data --split train --out data/big

Every process draws the same texts (same tasks, files and seed), drops repeated ones, and builds texts ``i`` with
``i % world_size == rank`` into ``out_dir/rank-RRRRR-of-WWWWW/`` (resumable, as a single build is). Rank 0 then
waits until every rank's manifest lists all of that rank's texts and merges the rank directories, in rank order,
into ``out_dir``: the same format, texts and tensors as a single-process build (their order aside). No process
group is needed: ranks meet through the file system, which all of them must share.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from .data import TextItem, _unpack, build_dataset
from .features import text_key
from .manifest import MANIFEST_NAME, Manifest
from .shards import merge_into

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Launch:
    """This process's place in a launch: ``rank`` of ``world_size`` processes, ``local_rank`` on its machine."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if self.local_rank < 0:
            raise ValueError(f"local_rank must be >= 0, got {self.local_rank}")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Launch:
        """From ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` as ``torchrun`` and ``accelerate launch`` set them (one
        process of one when they are absent)."""
        env = os.environ if env is None else env
        raw = {"rank": env.get("RANK", "0"), "world_size": env.get("WORLD_SIZE", "1"),
               "local_rank": env.get("LOCAL_RANK", env.get("RANK", "0"))}
        if not all(v.strip().isdigit() for v in raw.values()):
            raise ValueError(f"RANK, WORLD_SIZE and LOCAL_RANK must be non-negative integers, got {raw}")
        return cls(**{name: int(value) for name, value in raw.items()})

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def device(self, device: str | None) -> str | None:
        """``cuda`` without an index becomes ``cuda:LOCAL_RANK`` in a distributed launch (one GPU a process)."""
        if self.distributed and device == "cuda":
            return f"cuda:{self.local_rank}"
        return device


def unique_texts(texts: Iterable[TextItem]) -> list[TextItem]:
    """``texts`` without repeats (by :func:`~proxykv_hf.train.features.text_key`), first occurrences in order."""
    seen: set[str] = set()
    out = []
    for item in texts:
        key = text_key(_unpack(item)[0])
        if key not in seen:
            seen.add(key)
            out.append(item)
    return out


def rank_texts(texts: Sequence[TextItem], rank: int, world_size: int) -> list[TextItem]:
    """The texts of ``rank``: every ``world_size``-th of ``texts`` from index ``rank``."""
    Launch(rank=rank, world_size=world_size)  # checks them
    return list(texts[rank::world_size])


def rank_dir(out_dir: str | os.PathLike, rank: int, world_size: int) -> Path:
    """Where ``rank`` builds its share: ``out_dir/rank-RRRRR-of-WWWWW``."""
    return Path(out_dir) / f"rank-{rank:05d}-of-{world_size:05d}"


def build_dataset_distributed(texts: Iterable[TextItem], target, tokenizer, out_dir: str | os.PathLike, config=None,
                              *, launch: Launch | None = None, timeout: float = 7 * 24 * 3600.,
                              poll_seconds: float = 2.0, **kwargs) -> Manifest | None:
    """:func:`~proxykv_hf.train.data.build_dataset` of this process's share of ``texts``, merged by rank 0.

    Args:
        texts, target, tokenizer, out_dir, config, kwargs: as for ``build_dataset`` (``resume=False`` rebuilds this
            rank's share only). Every rank must pass the same texts.
        launch: this process's rank (default: :meth:`Launch.from_env`); one process of one is a plain build.
        timeout: seconds rank 0 waits for the other ranks after its own share.
        poll_seconds: how often rank 0 looks at their manifests.

    Returns:
        On rank 0 the merged :class:`Manifest` (also in ``out_dir/manifest.json``); None on the other ranks.
    """
    launch = launch or Launch.from_env()
    if not launch.distributed:
        return build_dataset(texts, target, tokenizer, out_dir, config, **kwargs)
    out, world = Path(out_dir), launch.world_size
    if (out / MANIFEST_NAME).exists() and not any(out.glob("rank-*-of-*")):
        raise ValueError(f"{out} holds a single-process build; build with {world} processes into another directory")
    texts = unique_texts(texts)
    mine = rank_texts(texts, launch.rank, world)
    logger.info("rank %d of %d: %d of %d texts into %s", launch.rank, world, len(mine), len(texts),
                rank_dir(out, launch.rank, world))
    build_dataset(mine, target, tokenizer, rank_dir(out, launch.rank, world), config, **kwargs)
    if launch.rank != 0:
        return None
    ranks = [r for r in range(world) if rank_texts(texts, r, world)]  # a rank with no texts has nothing to merge
    deadline = time.monotonic() + timeout
    for r in ranks:
        expected = {text_key(_unpack(item)[0]) for item in rank_texts(texts, r, world)}
        while not _complete(rank_dir(out, r, world), expected):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {r} did not finish {rank_dir(out, r, world)} within {timeout:.0f} s")
            time.sleep(poll_seconds)
    sources = [rank_dir(out, r, world) for r in ranks]
    if (out / MANIFEST_NAME).exists():  # an earlier merge: kept if no rank has written since, else redone
        merged, written = Manifest.load(out), (out / MANIFEST_NAME).stat().st_mtime_ns
        if (merged.done == [key for src in sources for key in Manifest.load(src).done]
                and all((src / MANIFEST_NAME).stat().st_mtime_ns <= written for src in sources)):
            logger.info("%s already merges its %d ranks", out, len(ranks))
            return merged
        (out / MANIFEST_NAME).unlink()
    for p in out.glob("shard-*.safetensors*"):
        p.unlink()
    merged = merge_into(sources, out)
    logger.info("merged %d ranks into %s: %d texts, %d crops", len(ranks), out, merged.texts, merged.crops)
    return merged


def _complete(directory: Path, expected: set[str]) -> bool:
    """Whether the dataset in ``directory`` lists every text of ``expected`` as done."""
    if not (directory / MANIFEST_NAME).exists():
        return False
    try:
        done = set(Manifest.load(directory).done)
    except (OSError, ValueError):  # a manifest being replaced
        return False
    return expected <= done
