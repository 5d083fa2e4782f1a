"""What a mapper dataset directory is built with and what it records: :class:`DataConfig` (how texts become
crops) and :class:`Manifest` (the ``manifest.json`` beside the shards: specs, counts, shards, texts done)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..mapper._fields import DTYPES as STORAGE_DTYPES, check_known_fields
from ..mapper.checkpoint import TargetSpec
from ..mapper.proxy import PROXY_KINDS, ProxySpec, check_self_layers
from ..attention.statistics import check_statistics

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
FLOAT16_MAX = 65504
# Fields that may change between a build and its resumption without changing the data.
_RESUME_FREE = ("shard_size",)


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """How texts become mapper training crops.

    Attributes:
        crop_len: tokens per training crop (paper: 2048).
        stride: offset between crops of one text (paper: 1024); the last crop is aligned to the text's end.
        shard_size: target crops per shard file; shards end at text boundaries, so one may hold more.
        max_length: texts are truncated to their first ``max_length`` tokens before the proxy and oracle run.
        min_length: texts with fewer tokens are skipped (counted in the manifest).
        proxy_kind: ``"model"`` (a separate proxy model sharing the tokenizer), ``"layers"`` (a subset of the
            target's layers) or ``"self"`` (the target's own full-attention layers); see :mod:`proxykv_hf.mapper.proxy`.
        proxy_model_id: id or path of the proxy model (kind ``"model"``); stored in the checkpoint so that
            ``ProxyKVCache.from_pretrained`` can load it. Default: the passed proxy's ``name_or_path``.
        proxy_layers: target layer indices of a ``"layers"`` proxy; default ``every_kth_layer(L, layer_stride)``.
        layer_stride: ``k`` of the default ``"layers"`` proxy.
        proxy_statistics: per-key statistics of the proxy's attention stored as features (``ProxySpec.statistics``):
            ``["sum"]`` (the paper) or ``["sum", "max"]``.
        target_model_id: recorded in the manifest and checkpoint; default: the target's ``name_or_path``.
        chat_template: tokenize string texts as the chat-formatted prefix that ends with the text (template
            header + user turn opening + text, nothing after), when the tokenizer has a template: exactly what
            ``ProxyKVPipeline.ask`` prefills and compresses at inference. The header tokens are attention sinks
            whose features the mapper should see in training too. Token-id texts are used as they are.
        feature_chunk_size: queries per chunk when accumulating the proxy's attention.
        oracle_kwargs: extra keyword arguments for the oracle (e.g. KVzip's chunk size).
        dtype: storage dtype of X and Y. ``"float16"`` halves the disk of float32 and keeps 11 mantissa bits
            (bfloat16 keeps 8, which creates ties in Y's ranking); X is an attention sum bounded by the text
            length, so float16 requires ``max_length <= 65504``.
    """

    crop_len: int = 2048
    stride: int = 1024
    shard_size: int = 64
    max_length: int = 32768
    min_length: int = 16
    proxy_kind: str = "layers"
    proxy_model_id: str | None = None
    proxy_layers: tuple[int, ...] | None = None
    layer_stride: int = 3
    proxy_statistics: tuple[str, ...] = ("sum",)
    target_model_id: str | None = None
    chat_template: bool = True
    feature_chunk_size: int = 256
    oracle_kwargs: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float16"

    def __post_init__(self) -> None:
        for name in ("crop_len", "stride", "shard_size", "max_length", "min_length", "layer_stride",
                     "feature_chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.stride > self.crop_len:
            raise ValueError(f"stride must be <= crop_len ({self.crop_len}), got {self.stride}")
        if self.min_length > self.max_length:
            raise ValueError(f"min_length ({self.min_length}) must be <= max_length ({self.max_length})")
        if self.proxy_kind not in PROXY_KINDS:
            raise ValueError(f"proxy_kind must be one of {PROXY_KINDS}, got {self.proxy_kind!r}")
        if self.proxy_layers is not None:
            layers = tuple(self.proxy_layers)
            if not layers or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers):
                raise ValueError(f"proxy_layers must be a non-empty sequence of layer indices, got {layers!r}")
            object.__setattr__(self, "proxy_layers", layers)
        object.__setattr__(self, "proxy_statistics", check_statistics(self.proxy_statistics))
        if self.dtype not in STORAGE_DTYPES:
            raise ValueError(f"dtype must be one of {tuple(STORAGE_DTYPES)}, got {self.dtype!r}")
        if self.dtype == "float16" and self.max_length > FLOAT16_MAX:
            raise ValueError(f"float16 storage needs max_length <= {FLOAT16_MAX} (X is an attention sum bounded by "
                             f"the length), got {self.max_length}; use dtype='float32'")
        try:
            if not isinstance(self.oracle_kwargs, dict):
                raise TypeError
            json.dumps(self.oracle_kwargs)
        except TypeError:
            raise ValueError(f"oracle_kwargs must be a JSON-serialisable dict (it is stored in the manifest), "
                             f"got {self.oracle_kwargs!r}") from None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable field dict."""
        d = dataclasses.asdict(self)
        d["proxy_layers"] = None if self.proxy_layers is None else list(self.proxy_layers)
        d["proxy_statistics"] = list(self.proxy_statistics)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DataConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        check_known_fields(cls, data)
        data = dict(data)
        if data.get("proxy_layers") is not None:
            data["proxy_layers"] = tuple(data["proxy_layers"])
        if "proxy_statistics" in data:
            data["proxy_statistics"] = tuple(data["proxy_statistics"])
        return cls(**data)


@dataclass(kw_only=True)
class Manifest:
    """What ``manifest.json`` of a dataset directory records.

    Attributes:
        target: :class:`~proxykv_hf.mapper.checkpoint.TargetSpec` fields of the target the oracle ran on.
        proxy: :class:`~proxykv_hf.mapper.proxy.ProxySpec` fields of the proxy the features came from.
        tokenizer: the tokenizer's ``name_or_path`` (and vocabulary size).
        data_config: :class:`DataConfig` fields.
        oracle: dotted name of the oracle function.
        texts, tokens, crops: texts with crops, their real tokens (after truncation), crops written.
        skipped_short, truncated: texts below ``min_length``; texts cut to ``max_length``.
        sources: texts per source (task name, file stem, dataset name).
        shards: per shard ``{"file", "crops", "tokens", "bytes"}``.
        done: hashes of the texts whose crops are all in written shards (resume skips them).
        disk_bytes: bytes of all shards.
    """

    target: dict
    proxy: dict
    tokenizer: dict
    data_config: dict
    oracle: str = ""
    texts: int = 0
    tokens: int = 0
    crops: int = 0
    skipped_short: int = 0
    truncated: int = 0
    sources: dict[str, int] = field(default_factory=dict)
    shards: list[dict] = field(default_factory=list)
    done: list[str] = field(default_factory=list)
    disk_bytes: int = 0
    created: str = ""
    updated: str = ""
    version: int = MANIFEST_VERSION

    @property
    def tasks(self) -> list[str]:
        """Sorted source names."""
        return sorted(self.sources)

    def target_spec(self) -> TargetSpec:
        return TargetSpec(**self.target)

    def proxy_spec(self) -> ProxySpec:
        return ProxySpec.from_dict(self.proxy)

    def config(self) -> DataConfig:
        return DataConfig.from_dict(self.data_config)

    def with_statistics(self, statistics: Sequence[str]) -> Manifest:
        """This manifest as seen through a subset of its proxy statistics (e.g. ``["sum"]`` of a sum+max dataset:
        what a mapper trained on those rows records as its proxy), or ``ValueError``."""
        statistics = list(check_statistics(statistics))
        stored = self.proxy_spec().statistics
        if any(s not in stored for s in statistics):
            raise ValueError(f"the dataset holds the proxy statistics {list(stored)}, not {statistics}")
        return dataclasses.replace(self, proxy={**self.proxy, "statistics": statistics},
                                   data_config={**self.data_config, "proxy_statistics": statistics})

    def with_proxy_layers(self, indices: Sequence[int]) -> Manifest:
        """This manifest as seen through a subset of its stored proxy layers (``indices`` into them, increasing):
        what a mapper trained on those layers records as its proxy, or ``ValueError``. Only for a ``"self"``
        proxy, whose layers' statistics are independent of each other (a model's later layers depend on the earlier
        ones it would no longer run)."""
        spec = self.proxy_spec()
        if spec.kind != "self":
            raise ValueError(f"a subset of proxy layers needs a dataset of a 'self' proxy, this one's is {spec.kind!r}")
        indices = [int(i) for i in indices]
        if not indices or indices != sorted(set(indices)) or indices[0] < 0 or indices[-1] >= spec.num_layers:
            raise ValueError(f"proxy layers must be increasing, distinct indices in [0, {spec.num_layers}), got "
                             f"{indices}")
        stored = spec.layer_list()
        layers = [stored[i] for i in indices]
        check_self_layers(layers, self.target["num_layers"])
        return dataclasses.replace(self, proxy={**self.proxy, "layers": layers, "num_layers": len(layers)})

    def summary(self) -> dict[str, Any]:
        """The data part of a checkpoint's ``training`` record."""
        return {"texts": self.texts, "crops": self.crops, "tokens": self.tokens, "tasks": self.tasks,
                "crop_len": self.data_config["crop_len"], "stride": self.data_config["stride"],
                "oracle": self.oracle}

    def mismatch(self, other: Manifest) -> str | None:
        """What differs between this dataset's target, proxy, tokenizer or data config and ``other``'s (the shard
        size aside), or None."""
        def filled(m: Manifest) -> Manifest:  # fields added since it was written: their defaults
            return dataclasses.replace(m, proxy=m.proxy_spec().to_dict(),
                                       data_config=DataConfig.from_dict(m.data_config).to_dict())

        old, new = filled(self), filled(other)
        for name in ("target", "proxy", "tokenizer"):
            if getattr(old, name) != getattr(new, name):
                return f"{name} {getattr(old, name)}, not {getattr(new, name)}"
        a = {k: v for k, v in old.data_config.items() if k not in _RESUME_FREE}
        b = {k: v for k, v in new.data_config.items() if k not in _RESUME_FREE}
        if a != b:
            diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
            return f"another data config (field: (old, new)) {diff}"
        return None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["counts"] = {"texts": self.texts, "tokens": self.tokens, "crops": self.crops, "shards": len(self.shards),
                       "skipped_short": self.skipped_short, "truncated": self.truncated}
        return d

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``manifest.json`` atomically (temporary file + rename)."""
        self.updated = time.strftime("%Y-%m-%dT%H:%M:%S")
        path = Path(directory) / MANIFEST_NAME
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Manifest:
        path = Path(directory) / MANIFEST_NAME
        if not path.is_file():
            raise FileNotFoundError(f"{directory} is not a ProxyKV dataset: no {MANIFEST_NAME}")
        data = json.loads(path.read_text())
        data.pop("counts", None)
        if data.get("version") != MANIFEST_VERSION:
            raise ValueError(f"unsupported manifest version {data.get('version')!r} in {path}")
        return cls(**data)
