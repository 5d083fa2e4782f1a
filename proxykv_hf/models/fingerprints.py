"""What identifies the model and tokenizer a compressed context belongs to (:mod:`proxykv_hf.contexts`).

A context records, and a load compares, a fingerprint of the model's config (the fields that decide what its K/V
mean), a probe of its weights (a few rows of its embeddings, its output head and the projections of its first, middle
and last decoder layers, so that two models of one config are told apart, a fine-tune too),
its dtype, and a fingerprint of the tokenizer (vocabulary, special tokens, chat template). Each is a 16-hex-digit
SHA-256 prefix of a JSON text with sorted keys, so it is the same in every process and on every machine.
:func:`weights_digest` hashes whole state dicts the same way, for what a scorer's settings record of its weights.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import weakref
from operator import itemgetter
from typing import Any

import torch

CONFIG_FIELDS = ("architectures", "model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "hidden_size", "vocab_size", "rope_parameters", "rope_theta", "rope_scaling",
                 "layer_types", "sliding_window", "use_sliding_window", "max_window_layers")
"""The config fields whose values the model fingerprint hashes (those absent from a config are left out)."""
PROBE_ROWS = 8
"""Rows (spread over its first dimension) of each probed weight whose bytes make the weights probe."""
SKETCH_VALUES = 8
"""Values of each probed weight's probe rows that the weights sketch records as floats."""
SKETCH_RTOL, SKETCH_ATOL = 1e-2, 1e-4
"""How far a sketch value may move when the weights are cast to another dtype (bf16 rounds by at most 2**-9)."""
_TOKENIZER_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PROBE_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_DIGEST_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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


def probed_weights(model) -> list[tuple[str, torch.Tensor]]:
    """The weights the probe reads: the input embeddings, the output embeddings (lm_head) and every 2-D weight (the
    attention and MLP projections) of the first, middle and last decoder layers; where no decoder layers are found,
    up to 16 of the model's 2-D weights spread over it. Meta tensors are left out."""
    found: dict[int, tuple[str, torch.Tensor]] = {}

    def add(name: str, module) -> None:
        for sub, p in (module.named_parameters() if isinstance(module, torch.nn.Module) else ()):
            if p.dim() == 2 and p.device.type != "meta":
                found.setdefault(id(p), (f"{name}.{sub}", p))

    for name, get in (("embed", "get_input_embeddings"), ("lm_head", "get_output_embeddings")):
        try:
            add(name, getattr(model, get)())
        except (AttributeError, NotImplementedError, TypeError):
            pass
    try:
        layers = model.get_decoder().layers
    except (AttributeError, NotImplementedError, TypeError):
        layers = getattr(getattr(model, "model", None), "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers):
        for i in sorted({0, len(layers) // 2, len(layers) - 1}):
            add(f"layers.{i}", layers[i])
    elif isinstance(model, torch.nn.Module):
        matrices = [(n, p) for n, p in model.named_parameters() if p.dim() == 2 and p.device.type != "meta"]
        for n, p in matrices[:: max(1, len(matrices) // 16)][:16]:
            found.setdefault(id(p), (n, p))
    return list(found.values())


def _probe(model) -> tuple[str, list[float]] | None:
    """``(weights probe, weights sketch)`` of ``model``, remembered per model object for as long as the probed
    weights are the same tensors at the same version (an in-place update, ``load_state_dict`` or a move to another
    device or dtype computes them again)."""
    weights = probed_weights(model)
    if not weights:
        return None
    key = tuple((n, p.data_ptr(), p._version, p.dtype, p.device, tuple(p.shape)) for n, p in weights)
    return _remembered(_PROBE_MEMO, model, key, lambda: _compute_probe(weights))


def _compute_probe(weights) -> tuple[str, list[float]]:
    h, sketch = hashlib.sha256(), []
    with torch.no_grad():
        for name, p in weights:
            rows = p[:: max(1, p.shape[0] // PROBE_ROWS)][:PROBE_ROWS]  # (PROBE_ROWS, C)
            h.update(f"{name}:{p.dtype}:{tuple(p.shape)};".encode())
            h.update(_tensor_bytes(rows))
            flat = rows.reshape(-1)
            picks = flat[:: max(1, flat.numel() // SKETCH_VALUES)][:SKETCH_VALUES]
            sketch.extend(float(v) for v in picks.float().cpu())
    return h.hexdigest()[:16], sketch


def _remembered(memo, obj, key, compute):
    """``compute()``, remembered in the weak-keyed ``memo`` for ``obj`` while ``key`` (its tensors' identity and
    version) stays the same; objects that cannot be weakly referenced are computed every time."""
    try:
        hit = memo.get(obj)
    except TypeError:
        hit = None
    if hit is not None and hit[0] == key:
        return hit[1]
    found = compute()
    try:
        memo[obj] = (key, found)
    except TypeError:
        pass
    return found


def weights_probe(model) -> str | None:
    """A digest of :data:`PROBE_ROWS` rows of each of the model's :func:`probed_weights`, in its own dtype: tells two
    models of one config apart (another seed, a fine-tune of any layers, with or without its embeddings) at the cost
    of a few kilobytes read. None where the model has no weights to read."""
    found = _probe(model)
    return None if found is None else found[0]


def weights_sketch(model) -> list[float] | None:
    """:data:`SKETCH_VALUES` float values of each probed weight's probe rows: compared within rounding
    (:func:`sketches_agree`) where the dtypes differ and the exact probe cannot be."""
    found = _probe(model)
    return None if found is None else found[1]


def sketches_agree(a, b) -> bool:
    """Whether two :func:`weights_sketch` lists are of the same weights, up to a cast to another dtype."""
    return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(
        isinstance(x, (int, float)) and isinstance(y, (int, float)) and
        abs(x - y) <= SKETCH_ATOL + SKETCH_RTOL * max(abs(x), abs(y)) for x, y in zip(a, b))


def model_mismatch(saved: dict, mine: dict, *, convert: bool = False) -> str | None:
    """Why a context filled by the model ``saved`` (a :func:`describe_model`) does not fit the model ``mine``, or
    None when it does: another config, another dtype (unless ``convert``), other weights (the probe where the
    dtypes agree, the sketch within rounding where they differ). The text completes "the context ..."."""
    if saved.get("config_fingerprint") != mine["config_fingerprint"]:
        theirs = saved.get("config") if isinstance(saved.get("config"), dict) else {}
        diff = [f"{k} {theirs.get(k)!r} vs {mine['config'].get(k)!r}" for k in sorted(set(theirs) | set(mine["config"]))
                if theirs.get(k) != mine["config"].get(k)]
        return (f"was filled by another model: {saved.get('name') or 'a model'!r} (config fingerprint "
                f"{saved.get('config_fingerprint')}) against {mine['name'] or 'this model'!r} "
                f"({mine['config_fingerprint']}); they differ in {'; '.join(diff[:6]) or 'their config'}")
    if saved.get("dtype") != mine["dtype"] and not convert:
        return (f"holds {saved.get('dtype')} K/V, but the model runs in {mine['dtype']}: load the model in "
                f"{saved.get('dtype')}, or convert the K/V to {mine['dtype']} (answers may then differ by the "
                "rounding)")
    if saved.get("dtype") == mine["dtype"]:
        other = None not in (saved.get("weights_probe"), mine["weights_probe"]) and \
            saved["weights_probe"] != mine["weights_probe"]
    else:
        other = None not in (saved.get("weights_sketch"), mine["weights_sketch"]) and \
            not sketches_agree(saved["weights_sketch"], mine["weights_sketch"])
    if other:
        return (f"was filled by a model of the same config but other weights ({saved.get('name')!r}, weights probe "
                f"{saved.get('weights_probe')}, against {mine['name']!r}, {mine['weights_probe']}): its K/V mean "
                "nothing to this model")
    return None


def weights_digest(modules) -> str:
    """A 16-hex-digit SHA-256 prefix of the whole state dicts of ``modules`` (names, dtypes, shapes and bytes):
    what a scorer's settings record of its mappers or proxy model."""
    h = hashlib.sha256()
    for i, module in enumerate(modules):
        h.update(f"{i}:{_module_digest(module)};".encode())
    return h.hexdigest()[:16]


def _module_digest(module) -> str:
    """:func:`weights_digest` of one module, remembered per module object for as long as its tensors are the same
    storage at the same version (hashing a large proxy model takes seconds; checking the memo, microseconds)."""
    key = tuple((t.data_ptr(), t._version, t.dtype, t.device, t.shape)
                for t in itertools.chain(module.parameters(), module.buffers()))
    return _remembered(_DIGEST_MEMO, module, key, lambda: _state_digest(module))


def _state_digest(module) -> str:
    h = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in sorted(module.state_dict().items()):
            h.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
            h.update(_tensor_bytes(tensor))
    return h.hexdigest()


def describe_model(model) -> dict:
    """What a context records of the model that filled it: ``name`` (``config.name_or_path``), ``config`` (the
    :func:`config_fields`), ``config_fingerprint`` (their :func:`digest`), ``weights_probe``
    (:func:`weights_probe`), ``weights_sketch`` (:func:`weights_sketch`) and ``dtype``."""
    fields = config_fields(model.config)
    probe, sketch = _probe(model) or (None, None)
    return {"name": str(getattr(model.config, "name_or_path", "") or ""), "config": fields,
            "config_fingerprint": digest(fields), "weights_probe": probe, "weights_sketch": sketch,
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
