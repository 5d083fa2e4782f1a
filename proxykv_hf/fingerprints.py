"""What identifies the model and tokenizer a compressed context belongs to (:mod:`proxykv_hf.contexts`).

A context records, and a load compares, a fingerprint of the model's config (the fields that decide what its K/V
mean), a probe of its weights (a few rows of its input embeddings, so that two models of one config are told apart),
its dtype, and a fingerprint of the tokenizer (vocabulary, special tokens, chat template). Each is a 16-hex-digit
SHA-256 prefix of a JSON text with sorted keys, so it is the same in every process and on every machine.
:func:`weights_digest` hashes whole state dicts the same way, for what a scorer's settings record of its weights.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from operator import itemgetter
from typing import Any

import torch

CONFIG_FIELDS = ("architectures", "model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "hidden_size", "vocab_size", "rope_parameters", "rope_theta", "rope_scaling",
                 "layer_types", "sliding_window", "use_sliding_window", "max_window_layers")
"""The config fields whose values the model fingerprint hashes (those absent from a config are left out)."""
PROBE_ROWS = 64
"""Rows of the input embeddings (spread over the vocabulary) whose bytes make the weights probe."""
_TOKENIZER_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def digest(value: Any) -> str:
    """A stable 16-hex-digit SHA-256 prefix of a JSON-able value (dict keys sorted)."""
    text = json.dumps(value, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def config_fields(config) -> dict:
    """The fields of ``config`` (its text decoder's, for multimodal configs) that decide what the K/V mean:
    :data:`CONFIG_FIELDS`, JSON-normalised."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    fields = {"architectures": getattr(config, "architectures", None)}
    for name in CONFIG_FIELDS[1:]:
        value = getattr(text, name, None)
        if value is not None:
            fields[name] = value
    return json.loads(json.dumps(fields, sort_keys=True, default=str))


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's raw bytes, read on the CPU in row-major order."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def weights_probe(model) -> str | None:
    """A digest of :data:`PROBE_ROWS` rows of the model's input embeddings, in its own dtype: tells two models of
    one config apart (another seed, a fine-tune) at the cost of a few kilobytes. None where there are none."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embed, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.device.type == "meta":
        return None
    with torch.no_grad():
        rows = weight[:: max(1, weight.shape[0] // PROBE_ROWS)][:PROBE_ROWS]
        return hashlib.sha256(str(rows.dtype).encode() + _tensor_bytes(rows)).hexdigest()[:16]


def weights_digest(modules) -> str:
    """A 16-hex-digit SHA-256 prefix of the whole state dicts of ``modules`` (names, dtypes, shapes and bytes):
    what a scorer's settings record of its mappers or proxy model."""
    h = hashlib.sha256()
    for i, module in enumerate(modules):
        for name, tensor in sorted(module.state_dict().items()):
            h.update(f"{i}.{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
            h.update(_tensor_bytes(tensor))
    return h.hexdigest()[:16]


def describe_model(model) -> dict:
    """What a context records of the model that filled it: ``name`` (``config.name_or_path``), ``config`` (the
    :func:`config_fields`), ``config_fingerprint`` (their :func:`digest`), ``weights_probe``
    (:func:`weights_probe`) and ``dtype``."""
    fields = config_fields(model.config)
    return {"name": str(getattr(model.config, "name_or_path", "") or ""), "config": fields,
            "config_fingerprint": digest(fields), "weights_probe": weights_probe(model),
            "dtype": dtype_name(getattr(model, "dtype", None))}


def tokenizer_fingerprint(tokenizer) -> str:
    """A :func:`digest` of what decides a tokenizer's ids: its vocabulary (added tokens included), its special
    tokens (bos, eos, unk and the additional ones; the pad token is a runtime choice and left out) and its chat
    template. Remembered per tokenizer object (reading a large vocabulary takes a fraction of a second) for as long as
    its length, special tokens and chat template stay the same."""
    special = {name: str(getattr(tokenizer, name, None)) for name in ("bos_token", "eos_token", "unk_token")}
    special["all"] = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []) if t != tokenizer.pad_token)
    template = getattr(tokenizer, "chat_template", None)
    key = (len(tokenizer), json.dumps([special, template], sort_keys=True, default=str))
    try:
        memo = _TOKENIZER_MEMO.get(tokenizer)
    except TypeError:  # not weakly referenceable or not hashable: no memo
        memo = None
    if memo is not None and memo[0] == key:
        return memo[1]
    vocab = sorted(tokenizer.get_vocab().items(), key=itemgetter(1))
    found = digest({"vocab": vocab, "special": special, "chat_template": template})
    try:
        _TOKENIZER_MEMO[tokenizer] = (key, found)
    except TypeError:
        pass
    return found


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def library_version() -> str:
    """The installed proxykv_hf's version (``"unknown"`` when it is not installed as a package)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("proxykv_hf")
    except PackageNotFoundError:
        return "unknown"
