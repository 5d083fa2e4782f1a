"""Training data for the mapper: proxy features X and oracle scores Y, cut into crops and stored as shards.

How to run me (library; the CLI wraps it)::

    from proxykv_hf.train import DataConfig, build_dataset, texts_from_tasks
    manifest = build_dataset(texts_from_tasks(["niah_single_2", "cwe"], 50, 4096, tok, seed=0), target, tok,
                             "data/smol", DataConfig(proxy_kind="layers", layer_stride=3))

Per text (paper, "Training procedure"): one proxy forward gives ``X (L_s, H_s, N)`` and one teacher-forced oracle
pass (KVzip by default) gives ``Y (L_l, H_kv, N)``; both are cut into sliding crops of ``crop_len`` tokens with
``stride`` (the last crop ends at the text's end; a text shorter than ``crop_len`` is one short crop, right-padded).
Features are computed on the whole text first, so a crop's X and Y are exactly what the mapper and the oracle see
at inference inside a long prompt.

On disk, ``out_dir`` holds ``shard-00000.safetensors, ...`` (tensors ``x (S, L_s, H_s, C)``, ``y (S, L_l, H_kv,
C)``, ``mask (S, C)`` bool, ``length``, ``start``, ``text`` (S,)) and ``manifest.json``. A shard ends at a text
boundary (so ``shard_size`` is a target, not a cap) and the manifest is rewritten atomically after each shard with
the hashes of the texts it completed: an interrupted build resumes by skipping them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from safetensors.torch import save_file
from torch import Tensor

from .._fields import DTYPES as STORAGE_DTYPES, check_known_fields
from ..hub import TargetSpec
from ..mapper import window_starts
from ..proxy import PROXY_KINDS, ProxySpec, every_kth_layer, proxy_features
from ..scorers.kvzip import full_attention_layers
from ..scoring import check_statistics

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
FLOAT16_MAX = 65504
# Fields that may change between a build and its resumption without changing the data.
_RESUME_FREE = ("shard_size",)

Oracle = Callable[..., Tensor]  # (model, input_ids, attention_mask=None, tokenizer=None, **kw) -> (L_l, B, H_kv, T)
TextItem = str | Sequence[int] | dict


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
            target's layers) or ``"self"`` (the target's own full-attention layers); see :mod:`proxykv_hf.proxy`.
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


def crop_starts(n: int, crop_len: int, stride: int) -> list[int]:
    """Start offsets of the crops of an ``n``-token text: every ``stride``, the last one ending at ``n``.

    The same windows as the mapper's encoder at inference (:func:`proxykv_hf.mapper.window_starts`).
    """
    return window_starts(n, crop_len, stride)


# ------------------------------------------------------------------------------------------------ manifest
@dataclass(kw_only=True)
class Manifest:
    """What ``manifest.json`` of a dataset directory records.

    Attributes:
        target: :class:`~proxykv_hf.hub.TargetSpec` fields of the target the oracle ran on.
        proxy: :class:`~proxykv_hf.proxy.ProxySpec` fields of the proxy the features came from.
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

    def summary(self) -> dict[str, Any]:
        """The data part of a checkpoint's ``training`` record."""
        return {"texts": self.texts, "crops": self.crops, "tokens": self.tokens, "tasks": self.tasks,
                "crop_len": self.data_config["crop_len"], "stride": self.data_config["stride"],
                "oracle": self.oracle}

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


# ------------------------------------------------------------------------------------------------ models
def target_spec_of(model, model_id: str | None = None) -> TargetSpec:
    """The :class:`TargetSpec` of a loaded target (full-attention layers, KV heads, heads)."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    n_full = len(full_attention_layers(model))
    heads = cfg.num_attention_heads
    return TargetSpec(model_id=model_id or getattr(model, "name_or_path", "") or "unknown",
                      model_type=cfg.model_type, num_layers=n_full,
                      num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads, num_heads=heads)


def check_shared_tokenizer(target, proxy, tokenizer=None, proxy_tokenizer=None, *, names: tuple[str, str] | None = None
                           ) -> None:
    """Raise ``ValueError`` naming both models unless ``proxy`` can read the target's token ids.

    The proxy's embedding table must hold every target token (sizes may differ: families pad them differently,
    e.g. Qwen2.5-7B has 152064 rows and Qwen2.5-1.5B 151936 for the same 151665-token tokenizer), the special token
    ids of the two configs must agree, and, when both tokenizers are given, they must encode a probe string alike.
    """
    names = names or (getattr(proxy, "name_or_path", "") or "proxy", getattr(target, "name_or_path", "") or "target")
    prefix = f"proxy {names[0]!r} and target {names[1]!r} must share a tokenizer"
    pc, tc = proxy.config, target.config
    if pc.vocab_size != tc.vocab_size:  # padded embedding tables differ within a family (Qwen2.5-7B vs -1.5B)
        n = len(tokenizer) if tokenizer is not None else tc.vocab_size
        if pc.vocab_size < n:
            raise ValueError(f"{prefix}: the proxy's vocabulary ({pc.vocab_size}) cannot hold the target's {n} "
                             f"tokens (vocab sizes {pc.vocab_size} vs {tc.vocab_size})")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        a, b = getattr(pc, name, None), getattr(tc, name, None)
        if a is not None and b is not None and a != b:
            raise ValueError(f"{prefix}: {name} {a} vs {b}")
    if tokenizer is not None and proxy_tokenizer is not None:
        probe = "The quick brown fox: 12,345 jumps! \u00e9t\u00e9 \u4e2d\u6587"
        a, b = proxy_tokenizer.encode(probe), tokenizer.encode(probe)
        if len(proxy_tokenizer) != len(tokenizer) or a != b:
            raise ValueError(f"{prefix}: the tokenizers encode differently ({len(proxy_tokenizer)} vs "
                             f"{len(tokenizer)} tokens; probe ids {a[:8]} vs {b[:8]})")


def resolve_proxy(target, config: DataConfig, proxy=None, tokenizer=None):
    """The model that runs as proxy, the layers it runs (or None), and its :class:`ProxySpec`."""
    cfg = target.config.get_text_config(decoder=True) if hasattr(target.config, "get_text_config") else target.config
    stats = list(config.proxy_statistics)
    if config.proxy_kind == "self":
        full = full_attention_layers(target)
        return target, None, ProxySpec(kind="self", num_layers=len(full), num_heads=cfg.num_attention_heads,
                                       statistics=stats)
    if config.proxy_kind == "layers":
        layers = list(config.proxy_layers or every_kth_layer(cfg.num_hidden_layers, config.layer_stride))
        bad = [i for i in layers if i >= cfg.num_hidden_layers]
        if bad:
            raise ValueError(f"proxy_layers {bad} out of range for a target with {cfg.num_hidden_layers} layers")
        return target, layers, ProxySpec(kind="layers", num_layers=len(layers), num_heads=cfg.num_attention_heads,
                                         layers=layers, statistics=stats)
    if proxy is None:
        if not config.proxy_model_id:
            raise ValueError("proxy_kind='model' needs a proxy model: pass proxy=... or set proxy_model_id")
        from ..models import load_model

        proxy = load_model(config.proxy_model_id)
    model_id = config.proxy_model_id or getattr(proxy, "name_or_path", "") or "unknown"
    target_id = config.target_model_id or getattr(target, "name_or_path", "") or "target"
    check_shared_tokenizer(target, proxy, tokenizer, names=(model_id, target_id))
    pcfg = proxy.config.get_text_config(decoder=True) if hasattr(proxy.config, "get_text_config") else proxy.config
    return proxy, None, ProxySpec(kind="model", num_layers=pcfg.num_hidden_layers,
                                  num_heads=pcfg.num_attention_heads, model_id=model_id, statistics=stats)


def default_oracle() -> Oracle:
    """KVzip's teacher-forced scores (:func:`proxykv_hf.scorers.kvzip.kvzip_scores`)."""
    from ..scorers.kvzip import kvzip_scores

    return kvzip_scores


def encode(text: str | Sequence[int], tokenizer, config: DataConfig) -> list[int]:
    """Token ids of one text (see ``DataConfig.chat_template``)."""
    if not isinstance(text, str):
        return [int(t) for t in text]
    if config.chat_template and getattr(tokenizer, "chat_template", None):
        marker = "\u2063PROXYKV_END\u2063"
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text + marker}], tokenize=False,
                                                 add_generation_prompt=True)
        if marker not in rendered:
            raise ValueError("could not find the text in the rendered chat template; use chat_template=False")
        return list(tokenizer(rendered.split(marker)[0], add_special_tokens=False)["input_ids"])
    return list(tokenizer(text)["input_ids"])


def text_key(text: str | Sequence[int]) -> str:
    """Stable hash of a text (or of its token ids) used to skip it on resume."""
    if isinstance(text, str):
        return "s" + hashlib.sha1(text.encode("utf-8")).hexdigest()
    return "i" + hashlib.sha1(json.dumps([int(t) for t in text]).encode()).hexdigest()


def _qualname(fn) -> str:
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _unpack(item: TextItem) -> tuple[str | Sequence[int], str]:
    if isinstance(item, dict):
        text = item.get("text", item.get("input_ids"))
        if text is None:
            raise ValueError(f"a text dict needs 'text' or 'input_ids', got keys {sorted(item)}")
        return text, str(item.get("source", "unknown"))
    if isinstance(item, (str, list, tuple)) or isinstance(item, Tensor):
        return (item.tolist() if isinstance(item, Tensor) else item), "unknown"
    raise ValueError(f"a text must be a str, a list of token ids or a dict, got {type(item).__name__}")


@torch.no_grad()
def features_and_scores(ids: list[int], target, runner, layers, spec: ProxySpec, oracle: Oracle, tokenizer,
                        config: DataConfig, target_spec: TargetSpec) -> tuple[Tensor, Tensor]:
    """X ``(L_s, S * H_s, N)`` and Y ``(L_l, H_kv, N)`` (float32, CPU) of one tokenized text."""
    dev = next(runner.parameters()).device
    input_ids = torch.tensor([ids], device=dev)  # (1, N)
    mask = torch.ones_like(input_ids)
    x = proxy_features(runner, input_ids, mask, layers=layers, chunk_size=config.feature_chunk_size,
                       statistics=spec.statistics)
    if spec.kind == "self":
        x = x[:, full_attention_layers(target)]
    x = x[0].float().cpu()  # (L_s, H_s, N)
    tdev = next(target.parameters()).device
    y = oracle(target, input_ids.to(tdev), mask.to(tdev), tokenizer=tokenizer, **config.oracle_kwargs)
    full = full_attention_layers(target)
    if y.shape[0] != target_spec.num_layers and y.shape[0] > max(full):  # one row per layer: keep the full ones
        y = y[full]
    want = (target_spec.num_layers, 1, target_spec.num_kv_heads, len(ids))
    if tuple(y.shape) != want:
        raise ValueError(f"oracle returned scores of shape {tuple(y.shape)}, expected (L_l, B, H_kv, T) = {want}")
    y = y[:, 0].float().cpu()  # (L_l, H_kv, N)
    want = (spec.num_layers, spec.num_features, len(ids))
    if tuple(x.shape) != want:
        raise ValueError(f"proxy features of shape {tuple(x.shape)}, expected (L_s, S * H_s, N) = {want}")
    return x, y


# ------------------------------------------------------------------------------------------------ building
class _ShardWriter:
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


def _mismatch(old: Manifest, new: Manifest) -> str | None:
    """What differs between two datasets' target, proxy, tokenizer or data config (the shard size aside), or None."""
    old = dataclasses.replace(old, proxy=old.proxy_spec().to_dict(),  # fields added since it was written: defaults
                              data_config=DataConfig.from_dict(old.data_config).to_dict())
    new = dataclasses.replace(new, proxy=new.proxy_spec().to_dict(),
                              data_config=DataConfig.from_dict(new.data_config).to_dict())
    for name in ("target", "proxy", "tokenizer"):
        if getattr(old, name) != getattr(new, name):
            return f"{name} {getattr(old, name)}, not {getattr(new, name)}"
    a = {k: v for k, v in old.data_config.items() if k not in _RESUME_FREE}
    b = {k: v for k, v in new.data_config.items() if k not in _RESUME_FREE}
    if a != b:
        diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
        return f"another data config (field: (old, new)) {diff}"
    return None


def _check_resumable(old: Manifest, new: Manifest, out: Path) -> None:
    problem = _mismatch(old, new)
    if problem:
        raise ValueError(f"{out} was built with {problem}; use another out_dir or resume=False to rebuild")


def stored_scores(data_dir: str | os.PathLike) -> tuple[dict[str, Tensor], Manifest]:
    """The oracle scores Y ``(L_l, H_kv, N)`` (float32) of every text of a built dataset, reassembled from its
    crops and keyed by text hash (:func:`text_key`), with its manifest: a new dataset of the same texts with other
    proxy features can reuse them (``build_dataset(..., scores_from=...)``) instead of running the oracle again.
    All of them are held in memory (float32, ``L_l * H_kv * 4`` bytes a token: 0.4 MB per 1k tokens for SmolLM2)."""
    from safetensors import safe_open

    data_dir = Path(data_dir)
    manifest = Manifest.load(data_dir)
    if manifest.skipped_short:
        raise ValueError(f"{data_dir} skipped {manifest.skipped_short} short texts, so its text numbers do not map to "
                         "its text hashes; rebuild it with a smaller min_length to reuse its scores")
    crops: dict[int, list[tuple[int, int, Tensor]]] = {}
    for shard in manifest.shards:
        with safe_open(str(data_dir / shard["file"]), "pt") as f:
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


def build_dataset(texts: Iterable[TextItem], target, tokenizer, out_dir: str | os.PathLike,
                  config: DataConfig | None = None, *, proxy=None, oracle: Oracle | None = None,
                  scores_from: str | os.PathLike | None = None, resume: bool = True,
                  progress: bool = True) -> Manifest:
    """Run proxy and oracle over ``texts`` and write crops of (X, Y) as shards to ``out_dir``.

    Args:
        texts: strings, token-id lists, or dicts ``{"text" | "input_ids", "source"}`` (as the ``texts_from_*``
            helpers yield; ``source`` is counted in the manifest).
        target: the target model (a ``PreTrainedModel``) the oracle runs on.
        tokenizer: the target's tokenizer (and the proxy's: a ``"model"`` proxy must share it).
        out_dir: dataset directory (created).
        config: :class:`DataConfig`; default ``DataConfig()``.
        proxy: the proxy model for ``config.proxy_kind == "model"`` (default: ``load_model(proxy_model_id)``).
        oracle: ``oracle(model, input_ids, attention_mask, tokenizer=..., **config.oracle_kwargs)`` returning
            ``(L_l, B, H_kv, T)`` scores for every full-attention layer (or ``(L, B, H_kv, T)`` for every layer,
            of which the full-attention ones are kept); default KVzip's ``kvzip_scores``.
        scores_from: a dataset built before for the same target (:func:`stored_scores`): texts it holds take
            their oracle scores from it (e.g. to store other proxy features without another oracle pass); the
            others run ``oracle``. Its manifest's oracle name is recorded when it served every text.
        resume: continue an existing build in ``out_dir`` (skip its done texts); False deletes it first.
        progress: show a tqdm bar.

    Returns:
        The final :class:`Manifest` (also in ``out_dir/manifest.json``).
    """
    from tqdm.auto import tqdm

    config = config or DataConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tspec = target_spec_of(target, config.target_model_id)
    runner, layers, pspec = resolve_proxy(target, config, proxy, tokenizer)
    oracle = oracle or default_oracle()
    stored, stored_from = ({}, None) if scores_from is None else stored_scores(scores_from)
    if stored_from is not None and stored_from.target != tspec.to_dict():
        raise ValueError(f"scores_from={scores_from} was built for target {stored_from.target}, not {tspec.to_dict()}")
    now = time.strftime("%Y-%m-%dT%H:%M:%S")
    manifest = Manifest(target=tspec.to_dict(), proxy=pspec.to_dict(), data_config=config.to_dict(),
                        tokenizer={"name": getattr(tokenizer, "name_or_path", "") or "unknown",
                                   "vocab_size": len(tokenizer)},
                        oracle=_qualname(oracle), created=now)
    if (out / MANIFEST_NAME).exists():
        if resume:
            old = Manifest.load(out)
            _check_resumable(old, manifest, out)
            old.data_config = manifest.data_config
            manifest = old
            listed = {sh["file"] for sh in manifest.shards}
            for p in out.glob("shard-*.safetensors*"):  # written before a crash, never listed: redone below
                if p.name not in listed:
                    p.unlink()
            logger.info("resuming %s: %d texts, %d crops already done", out, manifest.texts, manifest.crops)
        else:
            for p in out.glob("shard-*.safetensors*"):
                p.unlink()
            (out / MANIFEST_NAME).unlink()
    done = set(manifest.done)
    writer = _ShardWriter(out, manifest, config)
    seen: set[str] = set()
    skipped = reused = 0
    bar = tqdm(texts, desc="build data", unit="text", disable=not progress)
    for item in bar:
        text, source = _unpack(item)
        key = text_key(text)
        if key in done or key in seen:
            skipped += 1
            continue
        seen.add(key)
        ids = encode(text, tokenizer, config)
        if len(ids) < config.min_length:
            writer.add(key, None, len(ids))
            continue
        if len(ids) > config.max_length:
            ids = ids[:config.max_length]
            manifest.truncated += 1
        use = oracle
        if key in stored:
            kept = stored[key]
            if kept.shape[-1] != len(ids):
                raise ValueError(f"scores_from holds {kept.shape[-1]} tokens of a text that now encodes to "
                                 f"{len(ids)}; build both datasets with the same tokenizer and data config")
            use = lambda *args, _y=kept, **kwargs: _y[:, None]  # noqa: E731  (L_l, 1, H_kv, T), as an oracle returns
            reused += 1
        x, y = features_and_scores(ids, target, runner, layers, pspec, use, tokenizer, config, tspec)
        writer.add(key, source, len(ids), x, y)
        bar.set_postfix(crops=manifest.crops + len(writer.crops), refresh=False)
    writer.flush()
    if stored_from is not None:
        logger.info("%d texts took their scores from %s", reused, scores_from)
        if reused == manifest.texts:  # every text's scores came from there
            manifest.oracle = stored_from.oracle
            manifest.save(out)
    if skipped:
        logger.info("skipped %d texts already in %s (or repeated)", skipped, out)
    if not manifest.shards:
        manifest.save(out)
    logger.info("dataset %s: %d texts, %d tokens, %d crops in %d shards, %.1f MB", out, manifest.texts,
                manifest.tokens, manifest.crops, len(manifest.shards), manifest.disk_bytes / 2**20)
    return manifest


def merge_datasets(sources: Sequence[str | os.PathLike], out_dir: str | os.PathLike) -> Manifest:
    """Merge datasets built apart (e.g. by parallel ``build-data`` runs) into a new directory ``out_dir``.

    The sources must share target, proxy, tokenizer and data config (``crop_len``, ``stride``, ...; the shard
    size may differ) and hold no text twice. Shards are copied with their text ids offset, so that a split by text
    (:func:`~proxykv_hf.train.split_dataset`) still keeps every crop of a text on one side.

    Returns:
        The merged manifest (also written to ``out_dir``).

    Raises:
        ValueError: fewer than two sources, mismatched sources, a text in two sources, or a non-empty ``out_dir``.
    """
    from safetensors.torch import load_file

    if len(sources) < 2:
        raise ValueError(f"merge needs at least two datasets, got {len(sources)}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty; merge into a new directory")
    manifests = [Manifest.load(s) for s in sources]
    first = manifests[0]
    for src, m in zip(sources[1:], manifests[1:]):
        problem = _mismatch(first, m)
        if problem:
            raise ValueError(f"{src} cannot merge with {sources[0]}: it was built with {problem}")
    seen: dict[str, str] = {}
    for src, m in zip(sources, manifests):
        for key in m.done:
            if key in seen:
                raise ValueError(f"text {key} is in both {seen[key]} and {src}; merging would count it twice")
            seen[key] = str(src)
    out.mkdir(parents=True, exist_ok=True)
    merged = dataclasses.replace(first, texts=0, tokens=0, crops=0, skipped_short=0, truncated=0,
                                 sources={}, shards=[], done=[], disk_bytes=0,
                                 created=time.strftime("%Y-%m-%dT%H:%M:%S"))
    if any(m.oracle != first.oracle for m in manifests):
        merged.oracle = "mixed: " + ", ".join(sorted({m.oracle for m in manifests}))
    for src, m in zip(sources, manifests):
        for shard in m.shards:
            tensors = load_file(str(Path(src) / shard["file"]))
            tensors["text"] = tensors["text"] + merged.texts
            name = f"shard-{len(merged.shards):05d}.safetensors"
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
