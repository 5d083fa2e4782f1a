"""Per text, what a mapper dataset stores: its token ids, the proxy's features X and the oracle's scores Y; and
the checks and specs of the models that produce them (:func:`target_spec_of`, :func:`resolve_proxy`)."""

from __future__ import annotations

import hashlib
import json
from typing import Callable, Sequence

import torch
from torch import Tensor

from ..mapper.checkpoint import TargetSpec
from ..mapper.proxy import ProxySpec, every_kth_layer, proxy_features
from ..models.layout import full_attention_layers
from .manifest import DataConfig

Oracle = Callable[..., Tensor]  # (model, input_ids, attention_mask=None, tokenizer=None, **kw) -> (L_l, B, H_kv, T)


def _text_config(model):
    """The decoder text config of ``model`` (its config itself where there is no nested one)."""
    cfg = model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def target_spec_of(model, model_id: str | None = None) -> TargetSpec:
    """The :class:`TargetSpec` of a loaded target (full-attention layers, KV heads, heads)."""
    cfg = _text_config(model)
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
    cfg = _text_config(target)
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
        from ..models.loading import load_model

        proxy = load_model(config.proxy_model_id)
    model_id = config.proxy_model_id or getattr(proxy, "name_or_path", "") or "unknown"
    target_id = config.target_model_id or getattr(target, "name_or_path", "") or "target"
    check_shared_tokenizer(target, proxy, tokenizer, names=(model_id, target_id))
    pcfg = _text_config(proxy)
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
