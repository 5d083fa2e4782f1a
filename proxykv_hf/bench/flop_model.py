"""Matmul FLOPs of a prefill, per method: the compute floor that a TTFT ratio can be read against.

On one GPU the target's prefill keeps every SM busy, so whatever ProxyKV adds (the proxy's forward, the statistics
of its attention, the mapper) costs its own arithmetic and cannot hide. Its FLOPs over the target's are therefore
the lowest TTFT ratio that one device can reach, were every kernel as efficient as the target's own prefill.

What is counted: the matmul-class work (linear layers, convolutions, attention's ``Q K^T`` and ``P V``) at two
FLOPs per multiply-add, as :class:`torch.utils.flop_counter.FlopCounterMode` counts it; norms, activations,
softmax and reductions are not. Causal attention counts the query-key pairs that a causal kernel computes (one
triangle; a sliding-window layer only its band). The tests hold these formulas to ``FlopCounterMode`` on small
models (with attention counted dense, as that counter does).

* full: the target's prefill (the decoder stack; ``generate`` computes the logits of the last token only).
* proxykv: the full prefill, plus the proxy's forward (a separate model or a subset of the target's layers; none
  for a ``"self"`` proxy), plus ``statistics_passes`` recomputations of each proxy layer's ``Q K^T`` for the
  per-key statistics (:func:`proxykv_hf.attention.statistics.recomputations`: none on the chunked PyTorch path, which
  computes each chunk's probabilities once for the attention and the statistics; one where flash attention supplies the
  row log-sum-exp; two with sdpa and both fused passes), plus the mapper.
* snapkv: the full prefill, plus ``Q K^T`` of the observation window's queries.
* kvzip: the full prefill, plus one repeat forward per chunk over the whole context, plus the scoring softmax's
  matmuls; kvzip_iam: the same KVzip on the proxy, after the proxy's own prefill.
"""

from __future__ import annotations

from ..mapper.model import MapperConfig, window_starts

GATED_MLP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma3_text")


def attention_shape(config) -> tuple[int, int, int]:
    """``(query heads, KV heads, head dim)`` of a transformers config."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv, head_dim


def causal_pairs(n: int, window: int | None = None) -> int:
    """Query-key pairs a causal prompt of ``n`` tokens attends over: ``n (n + 1) / 2``, or with a sliding window of
    ``window`` keys (the query's own included) ``sum_q min(q + 1, window)``."""
    if window is None or window >= n:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def _layer_window(config, layer: int) -> int | None:
    types = getattr(config, "layer_types", None)
    if types is not None and types[layer] != "sliding_attention":
        return None
    return getattr(config, "sliding_window", None) if types is not None or config.model_type == "mistral" else None


def decoder_flops(config, n: int, *, layers: list[int] | None = None, causal: bool = True) -> dict[str, int]:
    """FLOPs of one ``n``-token prompt through the decoder layers of a model with ``config`` (no LM head).

    Args:
        config: a transformers config of a gated-MLP family (:data:`GATED_MLP_FAMILIES`).
        n: prompt tokens (batch 1).
        layers: only these layer indices (a layer-subset proxy); None = all.
        causal: count the causal triangle (what flash kernels compute); False counts every query-key pair, as
            ``FlopCounterMode`` does for attention.

    Returns:
        ``{"linear": ..., "attention": ..., "qk": ...}``: the projections and MLPs, attention's two matmuls, and
        ``Q K^T`` alone (what one recomputation of the probabilities costs).
    """
    if config.model_type not in GATED_MLP_FAMILIES:
        raise ValueError(f"FLOP counts cover the gated-MLP families {GATED_MLP_FAMILIES}, got {config.model_type!r}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    heads, kv, head_dim = attention_shape(config)
    hidden, inner = config.hidden_size, config.intermediate_size
    per_token = hidden * (heads + 2 * kv) * head_dim + heads * head_dim * hidden + 3 * hidden * inner
    chosen = range(config.num_hidden_layers) if layers is None else layers
    pairs = sum(causal_pairs(n, _layer_window(config, i)) if causal else n * n for i in chosen)
    qk = 2 * heads * head_dim * pairs
    return {"linear": 2 * n * per_token * len(chosen), "attention": 2 * qk, "qk": qk}


def kvzip_flops(config, n: int, *, first_extra: int, later_extra: int, context_chunk: int = 2048, n_sink: int = 4,
                query_block: int = 128, causal: bool = True, layers: list[int] | None = None) -> dict[str, int]:
    """FLOPs of KVzip's scoring after the prefill (:class:`~proxykv_hf.scorers.kvzip.KVzipScorer`): one repeat
    forward per ``context_chunk`` context tokens over the whole context, and the scoring softmax of every layer.

    Args:
        config: the target's config (no sliding-window layers: the repeat's key ranges there are not counted).
        n: context tokens.
        first_extra: template tokens of the first chunk's repeat input (prompt + postfix).
        later_extra: template tokens of every later chunk's (prompt + quoted tail of the previous chunk + postfix).
        context_chunk, n_sink: as in ``KVzipScorer``.
        query_block: repeat queries per scoring block (``kvzip._QUERY_BLOCK``).
        causal: count each repeat token's keys as the mask shows them (the context and the repeat up to itself);
            False counts the dense rectangle an eager attention computes.
        layers: only these layers run and are scored (KVzip+IAM on a layer subset); None = all.

    Returns:
        ``{"repeat": ..., "scoring": ...}``: the repeat forwards (linear layers and attention) and the scoring
        matmuls.
    """
    chosen = list(range(config.num_hidden_layers)) if layers is None else list(layers)
    if any(_layer_window(config, i) for i in chosen):
        raise ValueError("KVzip FLOP counts cover models without sliding-window layers")
    heads, _, head_dim = attention_shape(config)
    repeat = scoring = 0
    for i, start in enumerate(range(0, n, context_chunk)):
        length = min(context_chunk, n - start)
        q = (first_extra if i == 0 else later_extra) + length
        pairs = q * n + (q * (q + 1) // 2 if causal else q * q)
        forward = decoder_flops(config, q, layers=chosen)  # the linear layers of q tokens
        repeat += forward["linear"] + len(chosen) * 4 * heads * head_dim * pairs
        keys = min(n_sink, start) + length  # the sinks and the chunk, then the repeat keys up to the block's end
        for q0 in range(0, q, query_block):
            end = min(q0 + query_block, q)
            scoring += len(chosen) * 2 * heads * head_dim * (end - q0) * (keys + end)
    return {"repeat": repeat, "scoring": scoring}


def kvzip_prefill_flops(target_config, n: int, *, first_extra: int, later_extra: int, scored_config=None,
                        context_chunk: int = 2048, n_sink: int = 4) -> dict[str, int]:
    """FLOPs of one ``n``-token prefill with KVzip, or with KVzip+IAM where ``scored_config`` (the proxy's config,
    or a layer subset's) is given: ``{"target", ["proxy",] "repeat", "scoring", "total"}``, the proxy's own prefill
    counted under ``"proxy"``. Template sizes and chunking as in :func:`kvzip_flops`."""
    target = decoder_flops(target_config, n)
    parts = {"target": target["linear"] + target["attention"]}
    scored = target_config
    if scored_config is not None:
        scored = scored_config
        proxy = decoder_flops(scored, n)
        parts["proxy"] = proxy["linear"] + proxy["attention"]
    parts.update(kvzip_flops(scored, n, first_extra=first_extra, later_extra=later_extra, context_chunk=context_chunk,
                             n_sink=n_sink))
    return {**parts, "total": sum(parts.values())}


def kvzip_template_tokens(scorer, tokenizer=None) -> tuple[int, int]:
    """``(first_extra, later_extra)`` of :func:`kvzip_flops` for a ``KVzipScorer`` and its tokenizer."""
    first, later, postfix = scorer.templates(tokenizer or scorer.tokenizer)
    quoted = min(scorer.prev_postfix_size, scorer.context_chunk)
    return len(first) + len(postfix), len(later) + quoted + len(postfix)


def snapkv_flops(config, n: int, window: int = 64, *, causal: bool = True) -> int:
    """FLOPs of SnapKV's scoring: ``Q K^T`` of the last ``window`` queries over the keys they see, every layer
    (``causal=False``: the whole ``window x n`` block, as the chunked PyTorch path computes it in one chunk)."""
    heads, _, head_dim = attention_shape(config)
    w = min(window, n)
    pairs = w * n - (w * (w - 1) // 2 if causal else 0)
    return config.num_hidden_layers * 2 * heads * head_dim * pairs


def mapper_flops(config: MapperConfig, n: int) -> int:
    """FLOPs of the mapper in eval mode on ``n`` tokens: stages 1-2 and stage 3 once per distinct paired proxy layer
    (each token through the encoder once per window covering it), the direct path per target layer."""
    d, feats = config.d_time, config.num_features
    stem = 6 * (feats * config.stem_hidden + config.stem_hidden * d)
    window = min(n, config.crop_len)
    processed = len(window_starts(n, config.crop_len, config.stride)) * window
    # q, k, v, out projections, the FFN, then attention over the window
    encoder = config.num_encoder_layers * (2 * (4 + 2 * config.ffn_mult) * d * d + 4 * window * d)
    h_s, h_l, d_head = config.num_proxy_heads, config.num_target_heads, config.d_head
    head = 4 * d * h_s * d_head + 4 * h_l * h_s * d_head + 2 * h_l * d_head
    proxy_layers = len(set(config.pairing()))
    direct = 2 * config.num_target_heads * feats * config.num_target_layers if config.direct_path else 0
    return proxy_layers * (n * stem + processed * encoder) + n * (proxy_layers * head + direct)


def prefill_flops(target_config, n: int, *, proxy_kind: str | None = None, proxy_config=None,
                  proxy_layers: list[int] | None = None, mapper_config: MapperConfig | None = None,
                  statistics_passes: int = 1) -> dict[str, int]:
    """FLOPs of one ``n``-token prefill: the full cache's (``proxy_kind=None``) or ProxyKV's, by part.

    Args:
        target_config: the target's transformers config.
        n: prompt tokens.
        proxy_kind: ``"model"``, ``"layers"`` or ``"self"`` (:class:`~proxykv_hf.mapper.proxy.ProxySpec`); None = the
            full cache.
        proxy_config: the proxy model's config (kind ``"model"``).
        proxy_layers: the target layers the proxy runs (kind ``"layers"``), or whose statistics a ``"self"`` proxy
            reads (None: all).
        mapper_config: the mapper's shape (needed with a proxy).
        statistics_passes: recomputations of ``Q K^T`` per proxy layer for the statistics.

    Returns:
        ``{"target", "proxy", "statistics", "mapper", "total"}``.
    """
    target = decoder_flops(target_config, n)
    parts = {"target": target["linear"] + target["attention"], "proxy": 0, "statistics": 0, "mapper": 0}
    if proxy_kind is None:
        return {**parts, "total": parts["target"]}
    if mapper_config is None:
        raise ValueError("a ProxyKV count needs the mapper's config")
    if proxy_kind == "self":  # the statistics of the target's own attention, on every layer or on proxy_layers
        proxy = target if proxy_layers is None else decoder_flops(target_config, n, layers=proxy_layers)
    elif proxy_kind == "layers":
        proxy = decoder_flops(target_config, n, layers=proxy_layers)
    elif proxy_kind == "model":
        if proxy_config is None:
            raise ValueError("a 'model' proxy needs the proxy's config")
        proxy = decoder_flops(proxy_config, n)
    else:
        raise ValueError(f"proxy_kind must be 'model', 'layers', 'self' or None, got {proxy_kind!r}")
    if proxy_kind != "self":
        parts["proxy"] = proxy["linear"] + proxy["attention"]
    parts["statistics"] = statistics_passes * proxy["qk"]
    parts["mapper"] = mapper_flops(mapper_config, n)
    return {**parts, "total": sum(parts.values())}
