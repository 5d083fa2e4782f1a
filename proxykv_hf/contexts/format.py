"""Compressed contexts on disk: a filled :class:`~proxykv_hf.cache.ProxyKVCache` saved once, loaded in any process.

ProxyKV and KVzip compress a context without knowing the question, so a compressed context can be reused: saved
after its first prefill, it answers later questions at the cost of their own tokens only. A context is a directory
of two files:

* ``context.json``, the header: :data:`FORMAT_VERSION`, the library version, the model (its name, a fingerprint of
  its config, a probe of its weights: :mod:`proxykv_hf.models.fingerprints`), the tokenizer's fingerprint (when one was
  given), the K/V dtype, the cache's settings (``keep_ratio``, ``budget``, ``n_sink``, ``n_recent``), the scorer's
  :meth:`~proxykv_hf.scorers.base.Scorer.settings`, each layer's scalar state, the size and SHA-256 of the
  tensor file, and the SHA-256 of all of that (checked, then every field, by :mod:`proxykv_hf.contexts.header`).
* ``context.safetensors``: every tensor the cache holds, as stored: each layer's K/V (uniform ``(B, H_kv, K + t, D)``
  or the global budget's packed ``(1, 1, N, D)``), the kept positions, budgets, spare-slot masks and packed indices,
  a sliding layer's window, the token ids held (prompt and everything appended), the prompt's padding mask, and
  optionally the context's text.

:func:`save_context` writes both into a temporary directory beside the target and renames it into place
(:func:`~proxykv_hf.contexts.directory.write_directory`), so a crash never leaves a half context; only an empty
directory or a saved context is ever replaced. :func:`read_context` (behind
``ProxyKVCache.load_context``) checks everything before it builds the cache, and refuses with a ``ValueError`` naming
the file: another model (config fingerprint, or weights probe), another tokenizer, another dtype (unless
``dtype="convert"``), a newer format, a truncated or corrupt file.
Design notes: docs/design.md, "Compressed contexts on disk".
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers.cache_utils import DynamicSlidingWindowLayer

from ..attention import wrapper as attention
from .directory import HEADER_NAME, TENSORS_NAME, normalize, write_directory
from .header import (CHECKSUM, LAYER_SCALARS, MAX_HEADER_BYTES, check_header, check_layer_tensors,
                     header_checksum, parse_header)
from ..models.file_errors import writing
from ..models.fingerprints import describe_model, dtype_name, library_version, model_mismatch, tokenizer_fingerprint
from ..cache.layer import INDEX_DTYPE, ProxyKVLayer
from ..scorers.base import Prompt

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2
"""The version this library writes, and the newest it reads."""
DTYPE_POLICIES = ("refuse", "convert")
_LAYER_SCALARS = LAYER_SCALARS


# ------------------------------------------------------------------------------------------------ writing
def _to_cpu(tensors: dict[str, torch.Tensor], name: str, tensor: torch.Tensor) -> None:
    """``tensors[name]``: ``tensor`` on the CPU, contiguous and owning exactly its storage (safetensors writes no
    views or shared storage)."""
    t = tensor.detach().to("cpu")
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size() or any(
            t.untyped_storage().data_ptr() == o.untyped_storage().data_ptr() for o in tensors.values()):
        t = t.clone(memory_format=torch.contiguous_format)
    tensors[name] = t


def _layer_state(i: int, layer, tensors: dict[str, torch.Tensor]) -> dict:
    """One layer's scalars (returned) and tensors (into ``tensors``)."""
    if not getattr(layer, "is_initialized", False) or getattr(layer, "keys", None) is None:
        raise ValueError(f"layer {i} of the cache holds nothing; save a cache after its first prefill")
    if isinstance(layer, ProxyKVLayer):
        if not layer.compacted:
            raise ValueError(f"layer {i} of the cache is not compacted yet; save a cache after its first prefill")
        state = {"kind": "proxykv", **{name: getattr(layer, name) for name in _LAYER_SCALARS}}
        saved = layer.saved_tensors()
        for name, value in saved.items():
            _to_cpu(tensors, f"layers.{i}.{name}", value)
        state["tensors"] = list(saved)
        return state
    if isinstance(layer, DynamicSlidingWindowLayer):
        _to_cpu(tensors, f"layers.{i}.keys", layer.keys)
        _to_cpu(tensors, f"layers.{i}.values", layer.values)
        return {"kind": "sliding", "cumulative_length": int(layer.cumulative_length),
                "sliding_window": int(layer.sliding_window), "tensors": ["keys", "values"]}
    raise ValueError(f"cannot save layer {i} of the cache: a {type(layer).__name__} (ProxyKV layers and "
                     "transformers' sliding-window layers are saved)")


def save_context(cache, path: str | os.PathLike, tokenizer=None, *, text: str | None = None,
                 overwrite: bool = True) -> Path:
    """Write what ``cache`` holds to the directory ``path`` (see the module docstring), whole or not at all.

    Args:
        cache: a :class:`~proxykv_hf.cache.ProxyKVCache` after its first prefill (compressed, possibly continued).
        path: the directory to write; an existing saved context there is replaced.
        tokenizer: the model's tokenizer, whose fingerprint :func:`read_context` then compares.
        text: the context's text, kept beside the ids (a pipeline's compressed context, to tokenize questions).
        overwrite: replace a context saved at ``path`` before; False keeps it (two writers of one context store
            entry: the first wins, :func:`write_directory`).

    Returns:
        ``path``.

    Raises:
        ValueError: the cache is empty, in the middle of compressing, or does not know the model that filled it.
        FileExistsError: ``path`` is a file or a directory that is not a saved context.
    """
    if cache.compressing():
        raise ValueError("cannot save a ProxyKVCache in the middle of compressing its prompt; save it after the "
                         "first prefill")
    if cache.prompt is None or cache.get_seq_length() == 0:
        raise ValueError("nothing to save: the ProxyKVCache is empty; save it after its first prefill")
    model = cache.model_description()
    if model is None:
        raise ValueError("this ProxyKVCache does not know the model that filled it, so a context saved from it could "
                         "not be checked on load; save a cache filled by this version of proxykv_hf")
    tensors: dict[str, torch.Tensor] = {}
    layers = [_layer_state(i, layer, tensors) for i, layer in enumerate(cache.layers)]
    ids = cache.conversation.ids()
    for name, value in (("conversation.ids", ids), ("prompt.input_ids", cache.prompt.input_ids),
                        ("prompt.valid", cache.prompt.valid)):
        if value is not None:
            _to_cpu(tensors, name, value)
    if text is not None:
        data = bytearray(text.encode("utf-8"))
        tensors["text"] = torch.frombuffer(data, dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    kv = next(layer.keys for layer in cache.layers if getattr(layer, "keys", None) is not None)
    settings = cache.settings()
    header = {
        "format": "proxykv_hf context", "format_version": FORMAT_VERSION, "library_version": library_version(),
        "model": model, "tokenizer_fingerprint": None if tokenizer is None else tokenizer_fingerprint(tokenizer),
        "dtype": dtype_name(kv.dtype),
        "cache": {"keep_ratio": cache.keep_ratio, "budget": cache.budget, "n_sink": settings["n_sink"],
                  "n_recent": settings["n_recent"], "fuse_statistics": settings["fuse_statistics"],
                  "held_n_sink": cache.n_sink, "held_n_recent": cache.n_recent},
        "scorer": None if cache.scorer is None else cache.scorer.settings(),
        "state": {"batch": int(cache.prompt.valid.shape[0]), "length": len(cache.conversation),
                  "prompt_length": cache.prompt.length, "ids_known": ids is not None, "text": text is not None,
                  "layers": layers},
    }

    def fill(tmp: Path) -> None:
        with writing(path / TENSORS_NAME):  # a full disk: the OSError, naming the file
            save_file(tensors, str(tmp / TENSORS_NAME), metadata={"format": "pt"})
        header["tensors"] = {"file": TENSORS_NAME, "bytes": (tmp / TENSORS_NAME).stat().st_size,
                             "sha256": _file_sha256(tmp / TENSORS_NAME),
                             "payload_bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
        body = json.loads(json.dumps(header, default=str))  # as read back, then covered by the checksum
        body[CHECKSUM] = header_checksum(body)
        (tmp / HEADER_NAME).write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
        for name in (TENSORS_NAME, HEADER_NAME):
            with open(tmp / name, "rb+") as f:
                os.fsync(f.fileno())

    path = normalize(path)
    if write_directory(path, fill, overwrite=overwrite):
        logger.info("saved a context of %d tokens to %s", len(cache.conversation), path)
    return path


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ reading
def read_header(path: str | os.PathLike) -> dict:
    """The header of the context at ``path``, checked for its format and version.

    Raises:
        FileNotFoundError: no such directory, or no ``context.json`` in it.
        ValueError: the header is not valid JSON, not a context header, of another format version, not matching
            its checksum, or holding a field of the wrong type or range (names the file).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"saved context directory {str(path)!r} does not exist")
    file = path / HEADER_NAME
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a saved context: it has no {HEADER_NAME}")
    if file.stat().st_size > MAX_HEADER_BYTES:
        raise ValueError(f"{file} holds {file.stat().st_size} bytes, more than a context header can "
                         f"({MAX_HEADER_BYTES}); the context is damaged")
    try:
        header = parse_header(file.read_text(), file)
    except UnicodeDecodeError as err:
        raise ValueError(f"{file} is not valid JSON ({err}); the context is damaged") from err
    if not isinstance(header, dict) or header.get("format") != "proxykv_hf context":
        raise ValueError(f"{file} is not the header of a saved proxykv_hf context")
    version = header.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError(f"{file} has an invalid format_version {version!r}")
    if version > FORMAT_VERSION:
        raise ValueError(f"{file} has format_version {version} (written by proxykv_hf "
                         f"{header.get('library_version')}), newer than the {FORMAT_VERSION} this proxykv_hf "
                         f"({library_version()}) reads: upgrade proxykv_hf")
    if version < FORMAT_VERSION:
        raise ValueError(f"{file} has format_version {version} (written by proxykv_hf "
                         f"{header.get('library_version')}), older than the {FORMAT_VERSION} this proxykv_hf reads "
                         "(it identifies the model by fewer of its weights): compress the context again")
    check_header(header, file)  # the checksum, then every field's type and range
    return header


def check_fits(header: dict, file: Path, model, tokenizer=None, *, scorer=None, dtype: str = "refuse") -> dict:
    """Raise a ``ValueError`` naming ``file`` when the context of ``header`` does not fit ``model`` (config
    fingerprint; weights probe where the dtypes agree, weights sketch within rounding where they do not: also under
    ``dtype="convert"``), ``tokenizer`` (when both sides have one), the model's dtype
    (unless ``dtype="convert"``) or ``scorer`` (its settings, when one is given). Returns :func:`describe_model`
    of ``model``."""
    if dtype not in DTYPE_POLICIES:
        raise ValueError(f"dtype must be one of {DTYPE_POLICIES}, got {dtype!r}")
    mine, saved = describe_model(model), header["model"]
    if saved.get("config_fingerprint") != mine["config_fingerprint"]:
        theirs = saved.get("config") or {}
        diff = [f"{k} {theirs.get(k)!r} vs {mine['config'].get(k)!r}" for k in sorted(set(theirs) | set(mine["config"]))
                if theirs.get(k) != mine["config"].get(k)]
        raise ValueError(f"{file} was saved from another model: {saved.get('name') or 'a model'!r} (config "
                         f"fingerprint {saved.get('config_fingerprint')}) against {mine['name'] or 'this model'!r} "
                         f"({mine['config_fingerprint']}); they differ in {'; '.join(diff[:6]) or 'their config'}")
    if header["dtype"] != mine["dtype"] and dtype == "refuse":
        raise ValueError(f"{file} holds {header['dtype']} K/V, but the model runs in {mine['dtype']}: load the model "
                         f"in {header['dtype']}, or pass dtype='convert' to cast the K/V to {mine['dtype']} (answers "
                         "may then differ from the saved cache's by the rounding)")
    other = model_mismatch(saved, mine, convert=True)  # the weights: the probe, or the sketch across dtypes
    if other is not None:
        raise ValueError(f"{file} {other}")
    want = header.get("tokenizer_fingerprint")
    if tokenizer is not None and want is not None and tokenizer_fingerprint(tokenizer) != want:
        raise ValueError(f"{file} was saved with another tokenizer (fingerprint {want}, this one's "
                         f"{tokenizer_fingerprint(tokenizer)}: vocabulary, special tokens or chat template differ), "
                         "so its token ids would not mean the same text")
    if scorer is not None and json.loads(json.dumps(scorer.settings(), sort_keys=True, default=str)) != \
            header.get("scorer"):
        raise ValueError(f"{file} was compressed by {(header.get('scorer') or {}).get('class', 'no scorer')} with "
                         f"other settings than the scorer given ({type(scorer).__name__}); pass the scorer it was "
                         "compressed with, or none")
    return mine


def _read_tensors(path: Path, header: dict) -> dict[str, torch.Tensor]:
    """The tensors of the context, after checking the file's size and SHA-256 against the header."""
    file = path / TENSORS_NAME
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a whole saved context: it has no {TENSORS_NAME}")
    want = header["tensors"]
    size = file.stat().st_size
    if size != want.get("bytes"):
        raise ValueError(f"{file} holds {size} bytes, its header {HEADER_NAME} says {want.get('bytes')}: the file is "
                         "truncated or damaged")
    if _file_sha256(file) != want.get("sha256"):
        raise ValueError(f"{file} does not match the SHA-256 in its header {HEADER_NAME}: the file is corrupt")
    try:
        return load_file(str(file), device="cpu")
    except SafetensorError as err:
        raise ValueError(f"{file} is not a readable safetensors file ({err}); the context is damaged") from err


@dataclass
class LoadedContext:
    """A context read back: the ``cache``, its ``header`` and the ``text`` saved with it (None when none was)."""

    cache: Any
    header: dict
    text: str | None


def read_context(path: str | os.PathLike, model, tokenizer=None, *, cache_class, scorer=None,
                 dtype: str = "refuse") -> LoadedContext:
    """Read the context saved at ``path`` into a new cache on ``model`` (``ProxyKVCache.load_context``).

    Args:
        path: a directory written by :func:`save_context`.
        model: the model it was saved from (:func:`check_fits`).
        tokenizer: compared with the saved tokenizer's fingerprint when both are known.
        cache_class: the cache class to build (``ProxyKVCache`` or a subclass).
        scorer: the scorer it was compressed with (same :meth:`~proxykv_hf.scorers.base.Scorer.settings`), for a
            cache that compresses again after ``reset()``; None: the cache keeps the saved settings, no scorer.
        dtype: ``"refuse"`` a model of another dtype than the saved K/V, or ``"convert"`` the K/V to it.

    Returns:
        the cache, the header and the saved text (None when none was saved).

    Raises:
        FileNotFoundError: no such directory, or a file of it missing.
        ValueError: whatever does not fit or cannot be read (:func:`read_header`, :func:`check_fits`, a truncated or
            corrupt tensor file, tensors that do not fit the header), naming the file. The model is left untouched.
    """
    path = normalize(path)
    header = read_header(path)
    file = path / HEADER_NAME
    try:
        mine = check_fits(header, file, model, tokenizer, scorer=scorer, dtype=dtype)
        try:
            tensors = _read_tensors(path, header)
        except (FileNotFoundError, ValueError):
            again = read_header(path)  # the directory was replaced between the two reads: read the new one once
            if again == header:
                raise
            header = again
            mine = check_fits(header, file, model, tokenizer, scorer=scorer, dtype=dtype)
            tensors = _read_tensors(path, header)
        state, settings = header["state"], header["cache"]
        want = {f"layers.{i}.{name}" for i, layer in enumerate(state["layers"]) for name in layer["tensors"]}
        want |= {"prompt.valid"} | ({"conversation.ids"} if state["ids_known"] else set())
        want |= {"text"} if state.get("text") else set()
        missing, extra = sorted(want - set(tensors)), sorted(set(tensors) - want - {"prompt.input_ids"})
        if missing or extra:
            raise ValueError(f"{path / TENSORS_NAME} does not hold what {file} lists (missing {missing}, "
                             f"unexpected {extra})")
        cache = cache_class(scorer, settings["keep_ratio"] if scorer is not None else 1.0, n_sink=settings["n_sink"],
                            n_recent=settings["n_recent"], config=model.config,
                            fuse_statistics=settings["fuse_statistics"], budget=settings["budget"])
        cache.keep_ratio = settings["keep_ratio"]  # what it was compressed to (without a scorer it compresses no more)
        cache.n_sink, cache.n_recent = settings["held_n_sink"], settings["held_n_recent"]
        _fill(cache, state, tensors, model, header["dtype"] if dtype == "refuse" else mine["dtype"], file)
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{file} is malformed ({type(err).__name__}: {err})") from err
    cache.set_model(model, mine)
    attention.use_proxykv_attention(model)  # spare slots and the packed layout need the wrapper
    text = bytes(tensors["text"].numpy()).decode("utf-8") if "text" in tensors else None
    return LoadedContext(cache, header, text)


def _layer_devices(model, n: int) -> list[torch.device]:
    """Where each decoder layer's K/V live: its weights' device (a model spread over devices), else the model's."""
    try:
        layers = model.get_decoder().layers
        return [next(layers[i].parameters()).device for i in range(n)]
    except (AttributeError, IndexError, StopIteration, TypeError):
        return [model.device] * n


def _fill(cache, state: dict, tensors: dict[str, torch.Tensor], model, dtype: str, file: Path) -> None:
    """Put the saved state into a fresh cache laid out from the model's config."""
    saved = state["layers"]
    kinds = ["proxykv" if isinstance(l, ProxyKVLayer) else "sliding" if isinstance(l, DynamicSlidingWindowLayer)
             else type(l).__name__ for l in cache.layers]
    if kinds != [layer["kind"] for layer in saved]:
        raise ValueError(f"{file} lists layers {[layer['kind'] for layer in saved]}, but the model's cache lays out "
                         f"{kinds}")
    kv_dtype = getattr(torch, dtype)
    length, batch = state["length"], state["batch"]
    text = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    n_kv = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None)
    for i, (layer, info, device) in enumerate(zip(cache.layers, saved, _layer_devices(model, len(saved)))):
        own = {name: tensors[f"layers.{i}.{name}"] for name in info["tensors"]}
        if info["kind"] == "proxykv":  # names, dtypes, shapes and index ranges, before anything is set on the layer
            check_layer_tensors(i, info, own, batch=batch, n_kv_heads=n_kv, head_dim=head_dim, file=file)
        keys, values = own.pop("keys").to(device, kv_dtype), own.pop("values").to(device, kv_dtype)
        if keys.dim() != 4 or keys.shape[:3] != values.shape[:3] or info["cumulative_length"] != length:
            raise ValueError(f"{file}: layer {i} holds K/V of shapes {tuple(keys.shape)} / {tuple(values.shape)} "
                             f"over {info['cumulative_length']} tokens, not a layer of this {length}-token context")
        layer.keys, layer.values = keys, values
        layer.dtype, layer.device, layer.is_initialized = kv_dtype, device, True
        layer.cumulative_length = info["cumulative_length"]
        if info["kind"] == "sliding":
            if info["sliding_window"] != layer.sliding_window:
                raise ValueError(f"{file}: layer {i} has a sliding window of {info['sliding_window']}, the model's "
                                 f"{layer.sliding_window}")
            if isinstance(getattr(layer, "_sliding_window_tensor", None), torch.Tensor):
                layer._sliding_window_tensor = layer._sliding_window_tensor.to(device)
            continue
        for name in _LAYER_SCALARS[1:]:
            setattr(layer, name, info[name])
        for name, value in own.items():
            setattr(layer, name, value if name == "budgets" else  # budgets live on the CPU
                    value.to(device, INDEX_DTYPE) if name in ("owner", "position") else value.to(device))
        if (keys.shape[0] != batch) if not layer.ragged else (keys.shape[:2] != (1, 1) or
                                                              layer.owner.shape[0] != keys.shape[2]):
            raise ValueError(f"{file}: layer {i} holds K/V of shape {tuple(keys.shape)}, not of a batch of {batch}")
    valid = tensors["prompt.valid"].to(model.device)
    ids = tensors.get("conversation.ids")
    prompt_ids = tensors.get("prompt.input_ids")
    if valid.shape != (batch, state["prompt_length"]) or (ids is not None and ids.shape != (batch, length)):
        raise ValueError(f"{file}: the token ids {None if ids is None else tuple(ids.shape)} and padding mask "
                         f"{tuple(valid.shape)} do not fit {batch} rows of {length} tokens")
    cache.prompt = Prompt(input_ids=None if prompt_ids is None else prompt_ids.to(model.device), valid=valid)
    cache.conversation.append(None if ids is None else ids.to(model.device), length)
