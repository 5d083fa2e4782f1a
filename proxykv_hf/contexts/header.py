"""What a saved context's header (``context.json``, :mod:`proxykv_hf.contexts`) may hold, checked field by field.

A header is covered by ``header_sha256``: the SHA-256 of its other fields as canonical JSON (keys sorted, no
spaces), so a flipped digit or a hand edit is found before any value is used. Every field is then checked for its
type and range (:func:`check_header`), and each layer's tensors for their names and shapes against the model
(:func:`check_layer_tensors`). Any failure is a ``ValueError`` naming the file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..cache.layer import LAYER_TENSORS
from ..cache.selection import BUDGETS

MAX_HEADER_BYTES = 64 << 20
"""A larger ``context.json`` is refused unread (a header holds scalars and a few digests: kilobytes)."""
CHECKSUM = "header_sha256"
LAYER_SCALARS = ("cumulative_length", "compacted", "compacted_at", "ragged", "n_kv_heads", "freed")
_INDEX_DTYPES = (torch.int32, torch.int64)


def header_checksum(header: dict) -> str:
    """The SHA-256 of ``header`` without its :data:`CHECKSUM` field, as canonical JSON."""
    body = {k: v for k, v in header.items() if k != CHECKSUM}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def parse_header(text: str, file: Path) -> object:
    """``json.loads(text)``; a nesting too deep for the parser is a ``ValueError`` naming ``file``."""
    try:
        return json.loads(text)
    except RecursionError as err:
        raise ValueError(f"{file} is nested too deeply to be a context header; the context is damaged") from err
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        raise ValueError(f"{file} is not valid JSON ({err}); the context is damaged") from err


def _is_int(value, lo: int = 0, hi: int | None = None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= lo and (hi is None or value <= hi)


def _is_str(value, optional: bool = False) -> bool:
    return isinstance(value, str) or (optional and value is None)


def check_header(header: dict, file: Path) -> None:
    """Check the checksum and every field of a header whose format and version are already known to be read."""
    def bad(what: str, value) -> ValueError:
        return ValueError(f"{file} is malformed: {what} is {str(value)[:80]!r}")

    if header.get(CHECKSUM) != header_checksum(header):
        raise ValueError(f"{file} does not match the checksum it holds ({CHECKSUM}): the header is damaged or was "
                         "edited; compress the context again")
    model = header.get("model")
    if not isinstance(model, dict) or not all(_is_str(model.get(k)) for k in ("name", "config_fingerprint")) or \
            not isinstance(model.get("config"), dict) or not _is_str(model.get("weights_probe"), True) or \
            not _is_str(model.get("dtype"), True):
        raise bad("'model'", model)
    sketch = model.get("weights_sketch")
    if sketch is not None and not (isinstance(sketch, list) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in sketch)):
        raise bad("'model.weights_sketch'", sketch)
    dtype = header.get("dtype")
    if not isinstance(dtype, str) or not isinstance(getattr(torch, dtype, None), torch.dtype) or \
            not getattr(torch, dtype).is_floating_point:
        raise bad("'dtype' (not a floating torch dtype)", dtype)
    if not _is_str(header.get("tokenizer_fingerprint"), True):
        raise bad("'tokenizer_fingerprint'", header.get("tokenizer_fingerprint"))
    if header.get("scorer") is not None and not isinstance(header["scorer"], dict):
        raise bad("'scorer'", header["scorer"])
    cache = header.get("cache")
    if not isinstance(cache, dict):
        raise bad("'cache'", cache)
    ratio = cache.get("keep_ratio")
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 < ratio <= 1:
        raise bad("'cache.keep_ratio'", ratio)
    if cache.get("budget") not in BUDGETS:
        raise bad("'cache.budget'", cache.get("budget"))
    for name in ("n_sink", "n_recent", "held_n_sink", "held_n_recent"):
        if not _is_int(cache.get(name)):
            raise bad(f"'cache.{name}'", cache.get(name))
    if not isinstance(cache.get("fuse_statistics"), bool):
        raise bad("'cache.fuse_statistics'", cache.get("fuse_statistics"))
    tensors = header.get("tensors")
    if not isinstance(tensors, dict) or not _is_int(tensors.get("bytes")) or not _is_int(tensors.get("payload_bytes")) \
            or not (isinstance(tensors.get("sha256"), str) and len(tensors["sha256"]) == 64):
        raise bad("'tensors'", tensors)
    _check_state(header.get("state"), bad)


def _check_state(state, bad) -> None:
    if not isinstance(state, dict):
        raise bad("'state'", state)
    batch, length, prompt = state.get("batch"), state.get("length"), state.get("prompt_length")
    if not _is_int(batch, 1) or not _is_int(length, 1) or not _is_int(prompt, 1, length):
        raise bad("'state' (batch, length, prompt_length)", [batch, length, prompt])
    for name in ("ids_known", "text"):
        if not isinstance(state.get(name), bool):
            raise bad(f"'state.{name}'", state.get(name))
    layers = state.get("layers")
    if not isinstance(layers, list) or not layers:
        raise bad("'state.layers'", layers)
    for i, layer in enumerate(layers):
        where = f"'state.layers[{i}]'"
        if not isinstance(layer, dict) or layer.get("kind") not in ("proxykv", "sliding"):
            raise bad(where, layer)
        names = layer.get("tensors")
        allowed = LAYER_TENSORS if layer["kind"] == "proxykv" else ("keys", "values")
        if not isinstance(names, list) or len(set(map(str, names))) != len(names) or \
                not {"keys", "values"} <= set(names) <= set(allowed):
            raise bad(f"{where}.tensors (known: {', '.join(allowed)})", names)
        if layer.get("cumulative_length") != length:
            raise bad(f"{where}.cumulative_length (the context holds {length} tokens)", layer.get("cumulative_length"))
        if layer["kind"] == "sliding":
            if not _is_int(layer.get("sliding_window"), 1):
                raise bad(f"{where}.sliding_window", layer.get("sliding_window"))
            continue
        if layer.get("compacted") is not True or not isinstance(layer.get("ragged"), bool):
            raise bad(f"{where} (compacted, ragged)", [layer.get("compacted"), layer.get("ragged")])
        if not _is_int(layer.get("compacted_at"), 1, length) or not _is_int(layer.get("freed")) or \
                not _is_int(layer.get("n_kv_heads"), 1 if layer["ragged"] else 0):  # set by the packed layout
            raise bad(f"{where} (compacted_at, freed, n_kv_heads)",
                      [layer.get("compacted_at"), layer.get("freed"), layer.get("n_kv_heads")])
        packed = {"owner", "position", "budgets"} <= set(names) and not {"kept_positions", "slot_valid"} & set(names)
        if packed != layer["ragged"] or (not packed and {"owner", "position"} & set(names)):
            raise bad(f"{where}.tensors (the packed layout holds owner, position and budgets)", names)


def check_layer_tensors(i: int, info: dict, own: dict[str, torch.Tensor], *, batch: int, n_kv_heads: int,
                        head_dim: int | None, file: Path) -> None:
    """Check a ProxyKV layer's saved tensors (``own``, K/V included) against its header entry ``info`` and the
    model (``n_kv_heads``, ``head_dim`` where known): dtypes, shapes and index ranges."""
    def bad(what: str) -> ValueError:
        return ValueError(f"{file}: layer {i} {what}, not a layer of this model's context (batch {batch}, "
                          f"{n_kv_heads} KV heads)")

    keys, values = own["keys"], own["values"]
    if info["n_kv_heads"] not in ((n_kv_heads,) if info["ragged"] else (0, n_kv_heads)):
        raise bad(f"lists {info['n_kv_heads']} KV heads")
    if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != values.shape[:3] or \
            (head_dim is not None and keys.shape[-1] != head_dim):
        raise bad(f"holds K/V of shapes {tuple(keys.shape)} / {tuple(values.shape)}")
    length, at = info["cumulative_length"], info["compacted_at"]
    if info["ragged"]:
        owner, position, budgets = own["owner"], own["position"], own["budgets"]
        N = keys.shape[2]
        if keys.shape[:2] != (1, 1) or owner.shape != (N,) or position.shape != (N,) or \
                owner.dtype not in _INDEX_DTYPES or position.dtype not in _INDEX_DTYPES or \
                budgets.shape != (batch, n_kv_heads):
            raise bad(f"holds a packed layout of shapes {tuple(keys.shape)}, owner {tuple(owner.shape)}, position "
                      f"{tuple(position.shape)}, budgets {tuple(budgets.shape)}")
        if N and (int(owner.min()) < 0 or int(owner.max()) >= batch * n_kv_heads or int(position.min()) < 0
                  or int(position.max()) >= length):
            raise bad("holds packed indices out of range")
        return
    if keys.shape[:2] != (batch, n_kv_heads):
        raise bad(f"holds K/V of shape {tuple(keys.shape)}")
    kept = own.get("kept_positions")
    if kept is not None:
        K = kept.shape[-1] if kept.dim() == 3 else -1
        if kept.shape[:2] != (batch, n_kv_heads) or kept.dtype not in _INDEX_DTYPES or K > at or \
                keys.shape[2] != K + length - at or (K and (int(kept.min()) < 0 or int(kept.max()) >= at)):
            raise bad(f"keeps positions of shape {tuple(kept.shape)} that do not fit its K/V {tuple(keys.shape)}")
    elif keys.shape[2] != length:
        raise bad(f"holds K/V of shape {tuple(keys.shape)} over {length} tokens, keeping every entry")
    budgets, slots = own.get("budgets"), own.get("slot_valid")
    if budgets is not None and (budgets.shape != (batch,) or kept is None or
                                int(budgets.min()) < 0 or int(budgets.max()) > kept.shape[-1]):
        raise bad(f"has budgets of shape {tuple(budgets.shape)}")
    if slots is not None and (kept is None or slots.dtype != torch.bool or slots.shape != (batch, kept.shape[-1])):
        raise bad(f"has spare-slot masks of shape {tuple(slots.shape)}")
