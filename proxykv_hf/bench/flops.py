"""Matmul FLOPs of one prefill with a built-in method's cache, by part, for ``proxykv bench``
(:mod:`proxykv_hf.bench.flop_model` holds the formulas; this module reads what they need off each scorer).

A scorer type without a counter here (a registered plug-in, the random and StreamingLLM baselines, the attention
statistics) is not counted: :func:`method_prefill_flops` gives None for it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .flop_model import attention_shape, kvzip_prefill_flops, kvzip_template_tokens, prefill_flops
from ..models.layout import full_attention_layers
from ..scorers.iam import KVzipIAMScorer
from ..scorers.kvzip import KVzipScorer
from ..scorers.proxy import ProxyScorer
from ..scorers.snapkv import SnapKVScorer
from ..attention.statistics import recomputations


def _proxykv(scorer: ProxyScorer, model, n: int) -> dict[str, float]:
    kind = scorer.spec.kind
    runner = scorer.proxy_model if kind == "model" else model
    heads, _, head_dim = attention_shape(runner.config)
    weight = next(runner.parameters())
    query = torch.empty(1, heads, 1, head_dim, dtype=weight.dtype, device=weight.device)
    layers = scorer.spec.layers
    if kind == "self" and layers is not None:
        full = full_attention_layers(model)
        layers = [full[l] for l in layers]  # compacted -> decoder layer indices
    return prefill_flops(model.config, n, proxy_kind=kind, proxy_config=runner.config if kind == "model" else None,
                         proxy_layers=layers, mapper_config=scorer.mapper.config,
                         statistics_passes=recomputations(query, scorer.fused))


def _kvzip(scorer: KVzipScorer, model, n: int) -> dict[str, float]:
    first, later = kvzip_template_tokens(scorer, scorer._tokenizer_for(model))
    return kvzip_prefill_flops(model.config, n, first_extra=first, later_extra=later,
                               context_chunk=scorer.context_chunk, n_sink=scorer.n_sink)


def _kvzip_iam(scorer: KVzipIAMScorer, model, n: int) -> dict[str, float]:
    first, later = kvzip_template_tokens(KVzipScorer(scorer.tokenizer, context_chunk=scorer.context_chunk))
    return kvzip_prefill_flops(model.config, n, first_extra=first, later_extra=later,
                               scored_config=scorer._runner(model).config, context_chunk=scorer.context_chunk,
                               n_sink=scorer.n_sink)


def _snapkv(scorer: SnapKVScorer, model, n: int) -> dict[str, float]:
    from .flop_model import snapkv_flops

    target = prefill_flops(model.config, n)["target"]
    extra = snapkv_flops(model.config, n, scorer.window)
    return {"target": target, "statistics": extra, "total": target + extra}


COUNTERS: dict[type, Callable] = {ProxyScorer: _proxykv, KVzipScorer: _kvzip, KVzipIAMScorer: _kvzip_iam,
                                  SnapKVScorer: _snapkv}
"""Scorer type -> ``(scorer, model, n_tokens) -> FLOPs by part``; looked up along the scorer's class hierarchy."""


def method_prefill_flops(scorer, model, n_tokens: int) -> dict[str, float] | None:
    """Matmul FLOPs of one ``n_tokens`` prefill of ``model`` with ``scorer``'s cache (None: the full cache), by part
    (``"target"``, what the method adds, ``"total"``); None where the method is not counted.

    Raises:
        ValueError: what :mod:`proxykv_hf.bench.flop_model` cannot count (e.g. sliding-window layers under KVzip).
    """
    if scorer is None:
        target = prefill_flops(model.config, n_tokens)["target"]
        return {"target": target, "total": target}
    counter = next((COUNTERS[c] for c in type(scorer).__mro__ if c in COUNTERS), None)
    return None if counter is None else counter(scorer, model, n_tokens)
