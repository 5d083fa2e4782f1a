"""Crops and shards of a mapper dataset: where the crops of a text start (:func:`crop_starts`), writing them as
safetensors shards (:class:`ShardWriter`), reading the oracle scores back per text (:func:`stored_scores`) and
merging datasets built apart (:func:`merge_datasets`).

A shard ``shard-00000.safetensors`` holds ``x (S, L_s, H_s, C)``, ``y (S, L_l, H_kv, C)``, ``mask (S, C)``
bool, and ``length``, ``start``, ``text`` ``(S,)``; crops shorter than ``crop_len`` are right-padded.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from ..contexts.directory import normalize, temp_name
from ..models.file_errors import reading, writing
from ..mapper.model import window_starts
from .manifest import FLOAT16_MAX, MANIFEST_NAME, STORAGE_DTYPES, DataConfig, Manifest

SHARD_TENSORS = ("x", "y", "mask", "length", "start", "text")

logger = logging.getLogger(__name__)


T = TypeVar("T")


def crop_starts(n: int, crop_len: int, stride: int) -> list[int]:
    """Start offsets of the crops of an ``n``-token text: every ``stride``, the last one ending at ``n``.

    The same windows as the mapper's encoder at inference (:func:`proxykv_hf.mapper.window_starts`).
    """
    return window_starts(n, crop_len, stride)


class ShardWriter:
    """Buffers crops and writes them as shards, updating the manifest after each one."""

    def __init__(self, out: Path, manifest: Manifest, config: DataConfig):
        self.out, self.manifest, self.config = out, manifest, config
        self.crops: list[tuple[Tensor, Tensor, int, int, int]] = []  # x, y, length, start, text id
        self.pending: list[tuple[str, str | None, int]] = []  # key, source (None: skipped), tokens

    def add(self, key: str, source: str | None, n_tokens: int, x: Tensor | None = None, y: Tensor | None = None):
        text_id = self.manifest.texts + sum(s is not None for _, s, _ in self.pending)
        if x is not None:
            c = self.config.crop_len
            for s in crop_starts(n_tokens, c, self.config.stride):
                n = min(c, n_tokens - s)
                self.crops.append((x[..., s:s + n], y[..., s:s + n], n, s, text_id))
        self.pending.append((key, source, n_tokens))
        if len(self.crops) >= self.config.shard_size:
            self.flush()

    def flush(self) -> None:
        m, c = self.manifest, self.config.crop_len
        if self.crops:
            dtype = STORAGE_DTYPES[self.config.dtype]
            pad = lambda t: torch.nn.functional.pad(t, (0, c - t.shape[-1]))  # noqa: E731  right-pad to C
            x = torch.stack([pad(cr[0]) for cr in self.crops])  # (S, L_s, H_s, C)
            y = torch.stack([pad(cr[1]) for cr in self.crops])  # (S, L_l, H_kv, C)
            length = torch.tensor([cr[2] for cr in self.crops], dtype=torch.int32)  # (S,)
            mask = torch.arange(c)[None, :] < length[:, None]  # (S, C)
            if self.config.dtype == "float16":
                x = x.clamp_max(FLOAT16_MAX)
            name = f"shard-{len(m.shards):05d}.safetensors"
            tmp = self.out / (name + ".tmp")
            with writing(self.out / name):
                save_file({"x": x.to(dtype).contiguous(), "y": y.to(dtype).contiguous(), "mask": mask,
                           "length": length, "start": torch.tensor([cr[3] for cr in self.crops], dtype=torch.int64),
                           "text": torch.tensor([cr[4] for cr in self.crops], dtype=torch.int64)},
                          str(tmp), metadata={"format": "pt"})
            os.replace(tmp, self.out / name)
            size = (self.out / name).stat().st_size
            m.shards.append({"file": name, "crops": len(self.crops), "tokens": int(length.sum()), "bytes": size})
            m.crops += len(self.crops)
            m.disk_bytes += size
            logger.info("wrote %s: %d crops, %.1f MB (dataset: %d crops, %.1f MB)", name, len(self.crops),
                        size / 2**20, m.crops, m.disk_bytes / 2**20)
        for key, source, n_tokens in self.pending:
            m.done.append(key)
            if source is None:
                m.skipped_short += 1
                continue
            m.texts += 1
            m.tokens += n_tokens
            m.sources[source] = m.sources.get(source, 0) + 1
        if self.pending:
            m.save(self.out)
        self.crops, self.pending = [], []


def stored_scores(data_dir: str | os.PathLike) -> tuple[dict[str, Tensor], Manifest]:
    """The oracle scores Y ``(L_l, H_kv, N)`` (float32) of every text of a built dataset, reassembled from its
    crops and keyed by text hash (:func:`~proxykv_hf.train.features.text_key`), with its manifest: a new dataset
    of the same texts with other proxy features can reuse them (``build_dataset(..., scores_from=...)``) instead
    of running the oracle again. All of them are held in memory (float32, ``L_l * H_kv * 4`` bytes a token)."""
    data_dir = Path(data_dir)
    manifest = Manifest.load(data_dir)
    if manifest.skipped_short:
        raise ValueError(f"{data_dir} skipped {manifest.skipped_short} short texts, so its text numbers do not map to "
                         "its text hashes; rebuild it with a smaller min_length to reuse its scores")
    crops: dict[int, list[tuple[int, int, Tensor]]] = {}
    for shard in manifest.shards:
        with open_shard(data_dir / shard["file"], shard["crops"]) as f, reading(data_dir / shard["file"], "shard"):
            y, text, start, length = (f.get_tensor(k) for k in ("y", "text", "start", "length"))
        for i in range(len(text)):
            crops.setdefault(int(text[i]), []).append((int(start[i]), int(length[i]), y[i]))
    out = {}
    for t, parts in crops.items():
        full = torch.zeros(*parts[0][2].shape[:2], max(s + n for s, n, _ in parts))
        for s, n, y in parts:
            full[:, :, s:s + n] = y[:, :, :n].float()
        out[manifest.done[t]] = full  # done lists the texts in build order: text number t is its t-th entry
    return out, manifest


def merge_datasets(sources: Sequence[str | os.PathLike], out_dir: str | os.PathLike) -> Manifest:
    """Merge datasets built apart (e.g. by parallel ``build-data`` runs) into a new directory ``out_dir``.

    The sources must share target, proxy, tokenizer and data config (``crop_len``, ``stride``, ...; the shard
    size may differ) and hold no text twice. Shards are copied with their text ids offset, so that a split by text
    (:func:`~proxykv_hf.train.split_dataset`) still keeps every crop of a text on one side.

    Returns:
        The merged manifest (also written to ``out_dir``).

    Every source and every shard is checked before the first byte is written, and ``out_dir`` appears whole or
    not at all (:func:`write_whole`).

    Raises:
        ValueError: fewer than two sources, mismatched sources, a text in two sources, a damaged shard, or a
            non-empty ``out_dir``.
        FileNotFoundError: a source or a shard its manifest lists is missing.
    """
    if len(sources) < 2:
        raise ValueError(f"merge needs at least two datasets, got {len(sources)}")
    out = normalize(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} is not empty; merge into a new directory")
    return write_whole(out, lambda tmp: merge_into(sources, tmp))


def write_whole(out: Path, fill: Callable[[Path], T]) -> T:
    """Write the new or empty directory ``out`` whole or not at all: ``fill(tmp)`` writes into a temporary directory
    beside it (inside it, when it exists), which then becomes ``out`` (a rename; the files moved into an existing
    ``out``, the manifest last). On any error nothing is left, and an ``OSError`` names the file in ``out``."""
    out = normalize(out)
    exists = out.is_dir()
    if not exists:
        out.parent.mkdir(parents=True, exist_ok=True)
    tmp = (out if exists else out.parent) / temp_name(out.name)
    tmp.mkdir()
    moved: list[Path] = []
    try:
        result = fill(tmp)
        if exists:
            for name in sorted(os.listdir(tmp), key=lambda n: n == MANIFEST_NAME):  # until it lands, no dataset
                os.replace(tmp / name, out / name)
                moved.append(out / name)
            tmp.rmdir()
        else:
            os.rename(tmp, out)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        for path in moved:
            path.unlink(missing_ok=True)
        if isinstance(err, OSError) and isinstance(err.filename, str) and err.filename.startswith(str(tmp)):
            err.filename = str(out) + err.filename[len(str(tmp)):]
        raise
    return result


def open_shard(path: str | os.PathLike, crops: int | None = None):
    """The shard ``path`` opened (``safe_open``, tensors read lazily), checked: its header is whole and lists the
    tensors of a shard, of ``crops`` rows (the manifest's count) where given.

    Raises:
        FileNotFoundError: the shard is missing.
        ValueError: the shard is damaged, truncated or not a shard; the message names it.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: its dataset's {MANIFEST_NAME} lists it")
    with reading(path, "shard"):
        f = safe_open(str(path), framework="pt")
        names = set(f.keys())
        rows = f.get_slice("text").get_shape()[0] if "text" in names else None
    missing = [n for n in SHARD_TENSORS if n not in names]
    if missing or (crops is not None and rows != crops):
        what = f"no tensor {missing[0]!r}" if missing else f"{rows} crops, where its {MANIFEST_NAME} lists {crops}"
        raise ValueError(f"{path} is not a whole shard ({what}): the dataset is damaged")
    return f


def merge_into(sources: Sequence[str | os.PathLike], out_dir: str | os.PathLike) -> Manifest:
    """:func:`merge_datasets` without its checks on ``out_dir``: one source or more, written as ``shard-*`` and
    ``manifest.json`` into ``out_dir`` beside what it holds (a distributed build merges its ranks' directories
    into their parent). ``out_dir`` must hold no shards or manifest of its own."""
    from safetensors.torch import load_file

    if not sources:
        raise ValueError("merge needs at least one dataset, got none")
    out = Path(out_dir)
    manifests = [Manifest.load(s) for s in sources]
    first = manifests[0]
    for src, m in zip(sources[1:], manifests[1:]):
        problem = first.mismatch(m)
        if problem:
            raise ValueError(f"{src} cannot merge with {sources[0]}: it was built with {problem}")
    seen: dict[str, str] = {}
    for src, m in zip(sources, manifests):
        for key in m.done:
            if key in seen:
                raise ValueError(f"text {key} is in both {seen[key]} and {src}; merging would count it twice")
            seen[key] = str(src)
    for src, m in zip(sources, manifests):  # every shard whole, before the first byte is written
        for shard in m.shards:
            with open_shard(Path(src) / shard["file"], shard["crops"]):
                pass
    out.mkdir(parents=True, exist_ok=True)
    merged = dataclasses.replace(first, texts=0, tokens=0, crops=0, skipped_short=0, truncated=0,
                                 sources={}, shards=[], done=[], disk_bytes=0,
                                 created=time.strftime("%Y-%m-%dT%H:%M:%S"))
    if any(m.oracle != first.oracle for m in manifests):
        merged.oracle = "mixed: " + ", ".join(sorted({m.oracle for m in manifests}))
    for src, m in zip(sources, manifests):
        for shard in m.shards:
            with reading(Path(src) / shard["file"], "shard"):
                tensors = load_file(str(Path(src) / shard["file"]))
            tensors["text"] = tensors["text"] + merged.texts
            name = f"shard-{len(merged.shards):05d}.safetensors"
            with writing(out / name):
                save_file(tensors, str(out / name), metadata={"format": "pt"})
            size = (out / name).stat().st_size
            merged.shards.append({**shard, "file": name, "bytes": size})
            merged.disk_bytes += size
        merged.texts += m.texts
        merged.tokens += m.tokens
        merged.crops += m.crops
        merged.skipped_short += m.skipped_short
        merged.truncated += m.truncated
        merged.done += m.done
        for name, n in m.sources.items():
            merged.sources[name] = merged.sources.get(name, 0) + n
    merged.save(out)
    logger.info("merged %d datasets into %s: %d texts, %d crops, %.1f MB", len(sources), out, merged.texts,
                merged.crops, merged.disk_bytes / 2**20)
    return merged
