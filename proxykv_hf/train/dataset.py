"""Reading a built dataset: :class:`MapperDataset` (the crops of a dataset directory) and the train /
validation split."""

from __future__ import annotations

import bisect
import math
import os
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor
from torch.utils.data import Dataset, Subset

from .manifest import Manifest
from .shards import open_shard


class MapperDataset(Dataset):
    """The crops of a dataset directory; items are ``{"x" (L_s, S * H_s, C), "y" (L_l, H_kv, C), "mask" (C,)}``
    float32 / bool, read lazily from the safetensors shards (one row at a time, files memory-mapped).

    ``statistics`` reads a subset of the stored proxy statistics (default: all ``S`` of them, statistic-major
    along the head axis); :attr:`manifest` then describes that subset
    (:meth:`~proxykv_hf.train.manifest.Manifest.with_statistics`). ``proxy_layers`` reads a subset of the stored
    proxy layers of a ``"self"`` proxy's dataset, as indices into them
    (:meth:`~proxykv_hf.train.manifest.Manifest.with_proxy_layers`).
    """

    def __init__(self, data_dir: str | os.PathLike, statistics: Sequence[str] | None = None,
                 proxy_layers: Sequence[int] | None = None):
        self.root = Path(data_dir)
        self.manifest = Manifest.load(self.root)
        self._heads: Tensor | None = None
        self._layers: Tensor | None = None
        if proxy_layers is not None:
            self.manifest = self.manifest.with_proxy_layers(proxy_layers)
            self._layers = torch.tensor(list(proxy_layers))
        if statistics is not None:
            stored = self.manifest.proxy_spec().statistics
            self.manifest = self.manifest.with_statistics(statistics)
            if list(statistics) != list(stored):
                h = self.manifest.proxy["num_heads"]
                self._heads = torch.cat([torch.arange(h) + stored.index(s) * h for s in statistics])
        self.files = [s["file"] for s in self.manifest.shards]
        counts = [s["crops"] for s in self.manifest.shards]
        self.offsets = [0]
        for c in counts:
            self.offsets.append(self.offsets[-1] + c)
        self._handles: dict[int, Any] = {}
        self._text_ids: list[int] | None = None

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getstate__(self) -> dict:  # DataLoader workers reopen the files
        return {**self.__dict__, "_handles": {}}

    def _open(self, shard: int):
        if shard not in self._handles:  # a missing or damaged shard: an error naming it
            self._handles[shard] = open_shard(self.root / self.files[shard], self.manifest.shards[shard]["crops"])
        return self._handles[shard]

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} crops")
        index %= len(self)
        shard = bisect.bisect_right(self.offsets, index) - 1
        row = index - self.offsets[shard]
        f = self._open(shard)
        get = lambda name: f.get_slice(name)[row:row + 1][0]  # noqa: E731
        x = get("x") if self._layers is None else get("x")[self._layers]
        x = x if self._heads is None else x[:, self._heads]
        return {"x": x.float(), "y": get("y").float(), "mask": get("mask").bool()}

    @property
    def text_ids(self) -> list[int]:
        """Per crop, the index of the text it came from (crops of one text overlap)."""
        if self._text_ids is None:
            self._text_ids = [int(t) for i in range(len(self.files)) for t in self._open(i).get_tensor("text")]
        return self._text_ids


def split_dataset(dataset: MapperDataset, val_fraction: float = 0.05, seed: int = 0, *,
                  by_text: bool = True) -> tuple[Subset, Subset]:
    """Deterministic disjoint ``(train, val)`` split with about ``val_fraction`` of the crops in ``val``.

    With ``by_text`` whole texts go to one side (overlapping crops of one text would leak into validation):
    texts are taken in a seeded random order until ``ceil(val_fraction * crops)`` crops are reached. Without
    it, or with a single text, crops are split by a seeded permutation.
    """
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    n = len(dataset)
    n_val = min(n - 1, math.ceil(val_fraction * n - 1e-9)) if n > 1 else 0
    gen = torch.Generator().manual_seed(seed)
    text_ids = dataset.text_ids if by_text and hasattr(dataset, "text_ids") else None
    if text_ids is not None and len(set(text_ids)) > 1 and n_val > 0:
        groups: dict[int, list[int]] = {}
        for i, t in enumerate(text_ids):
            groups.setdefault(t, []).append(i)
        keys = sorted(groups)
        val: list[int] = []
        for g in torch.randperm(len(keys), generator=gen).tolist():
            if len(val) >= n_val:
                break
            if len(val) + len(groups[keys[g]]) < n:  # never leave train empty
                val += groups[keys[g]]
    else:
        val = torch.randperm(n, generator=gen)[:n_val].tolist()
    val_set = set(val)
    return Subset(dataset, [i for i in range(n) if i not in val_set]), Subset(dataset, sorted(val))
