"""Pipelines: ``ProxyKVPipeline`` (context + questions, query-agnostic reuse) and ``pipeline("proxykv-generation")``.

``import proxykv_hf`` registers the task, after which::

    pipe = pipeline("proxykv-generation", model=model, tokenizer=tok, proxykv="org/mapper", keep_ratio=0.3)
    pipe([{"role": "user", "content": long_prompt}], max_new_tokens=32)

answers like ``text-generation`` does, with a fresh ProxyKV cache per call.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import torch
from transformers import AutoModelForCausalLM, TextGenerationPipeline

from ..cache.proxykv_cache import DEFAULT_KEEP_RATIO, ProxyKVCache
from ..attention.compat import with_cache
from .compressed import CompressedContext, encode_context
from ..models.fingerprints import describe_model, model_mismatch
from ..mapper.checkpoint import Checkpoint
from ..scorers.base import Scorer
from ..cache.selection import check_keep_ratio

logger = logging.getLogger(__name__)

TASK = "proxykv-generation"


def make_cache_factory(source: Any = None, keep_ratio: float | None = None, **kwargs) -> Callable[[], ProxyKVCache]:
    """Turn what a user passes into a function returning a fresh cache for each call.

    Args:
        source: a mapper checkpoint (directory, Hub id, or a :class:`~proxykv_hf.mapper.checkpoint.Checkpoint` in
            memory), a :class:`ProxyKVCache` template, a :class:`~proxykv_hf.scorers.base.Scorer`, a zero-argument
            callable returning a cache, or None (full cache).
        keep_ratio: the budget (ignored for a ready template or callable); None: :data:`DEFAULT_KEEP_RATIO
            <proxykv_hf.cache.DEFAULT_KEEP_RATIO>` (1.0 for the full cache).
        **kwargs: passed to :meth:`ProxyKVCache.from_pretrained` for checkpoints, to the constructor otherwise.
    """
    if callable(source) and not isinstance(source, (Scorer, ProxyKVCache)):
        return source
    if isinstance(source, ProxyKVCache):
        if keep_ratio is not None and keep_ratio != source.keep_ratio:
            raise ValueError(f"keep_ratio={keep_ratio} conflicts with the template cache's {source.keep_ratio}")
        return source.fresh
    ratio = 1.0 if keep_ratio is None and source is None else (DEFAULT_KEEP_RATIO if keep_ratio is None else
                                                                 keep_ratio)
    check_keep_ratio(ratio, scored=source is not None, fix="a mapper (proxykv= for the pipeline task, cache_source "
                     "for ProxyKVPipeline: a bundled name, a directory or a Hub id) or a Scorer such as SnapKVScorer()")
    if isinstance(source, (str, os.PathLike, Checkpoint)):
        template = ProxyKVCache.from_pretrained(source, ratio, **kwargs)
    elif source is None or isinstance(source, Scorer):
        template = ProxyKVCache(source, ratio, **kwargs)
    else:
        raise ValueError(f"cannot build a ProxyKV cache from {type(source).__name__}; pass a checkpoint (path, Hub "
                         "id or Checkpoint), a ProxyKVCache, a Scorer or a callable")
    return template.fresh


@torch.no_grad()
def compress_context(model, cache: ProxyKVCache, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor | None = None) -> ProxyKVCache:
    """Prefill ``input_ids`` (the context alone) into ``cache``; the cache compresses it on the way."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    cache.prepare(model, input_ids, attention_mask)
    model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **with_cache(cache),
          use_cache=True, logits_to_keep=1)
    return cache


@torch.no_grad()
def answer_from_cache(model, cache: ProxyKVCache, context_ids: torch.Tensor, question_ids: torch.Tensor,
                      **generate_kwargs) -> torch.Tensor:
    """Generate an answer to ``question_ids`` continuing a compressed context; the cache is left as it was.

    Args:
        context_ids: `(1, N)` the ids already in ``cache``.
        question_ids: `(1, Q)` the ids of the question (and assistant header).

    Returns:
        `(num_return_sequences, A)` generated ids, without the prompt.
    """
    state = cache.snapshot()
    ids = torch.cat([context_ids, question_ids.to(context_ids.device)], dim=1)
    try:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **with_cache(cache),
                             **generate_kwargs)
    finally:
        cache.restore(state)
    return out[:, ids.shape[1]:]


def _check_not_empty(ids: list[int], context: str) -> None:
    if not ids:
        raise ValueError(f"the context is empty: {context[:40]!r} gives no tokens before the question in the chat "
                         "template, so there is nothing to compress; give a non-empty context")


class ProxyKVPipeline:
    """Generation with a fresh ProxyKV cache per call; one compressed context can answer several questions.

    Args:
        model: a causal LM of a supported family.
        tokenizer: its tokenizer (left unmodified: batches are left-padded here, with its pad token or, where it has
            none, its end-of-sequence token).
        cache_source: see :func:`make_cache_factory`.
        keep_ratio: the budget, when ``cache_source`` is a checkpoint or a scorer.

    Example::

        pipe = ProxyKVPipeline(model, tok, SnapKVScorer(), keep_ratio=0.3)
        answers = pipe.ask(context, ["Who?", "When?"], max_new_tokens=16)
    """

    def __init__(self, model, tokenizer, cache_source=None, *, keep_ratio: float | None = None, **cache_kwargs):
        self.model, self.tokenizer = model, tokenizer
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.new_cache = make_cache_factory(cache_source, keep_ratio, **cache_kwargs)

    def _gen_kwargs(self, kwargs: dict) -> dict:
        kwargs.setdefault("do_sample", False)
        kwargs.setdefault("max_new_tokens", 64)
        kwargs.setdefault("pad_token_id", self.pad_token_id)
        return kwargs

    def __call__(self, prompts, **generate_kwargs) -> list[str]:
        """Answer plain prompts (a string or a list), batched with left padding; one cache per call."""
        single = isinstance(prompts, str)
        rows = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in ([prompts] if single else prompts)]
        n = max(map(len, rows))
        ids = torch.tensor([[self.pad_token_id] * (n - len(r)) + r for r in rows], device=self.model.device)
        mask = torch.tensor([[0] * (n - len(r)) + [1] * len(r) for r in rows], device=self.model.device)
        out = self.model.generate(input_ids=ids, attention_mask=mask, **with_cache(self.new_cache()),
                                  **self._gen_kwargs(generate_kwargs))
        texts = self.tokenizer.batch_decode(out[:, n:], skip_special_tokens=True)
        return texts[0] if single else texts

    def compress(self, context: str) -> CompressedContext:
        """Compress ``context`` once, as :meth:`ask` does (query-agnostic), into a :class:`CompressedContext` that
        answers any number of later questions through :meth:`ask`: here, or after ``.save(path)`` in another process
        (:meth:`load`)."""
        ids, _ = encode_context(self.tokenizer, context)
        _check_not_empty(ids, context)
        cache = compress_context(self.model, self.new_cache(), torch.tensor([ids], device=self.model.device))
        return CompressedContext(cache, context, self.tokenizer)

    def load(self, path, *, dtype: str = "refuse") -> CompressedContext:
        """The context saved at ``path`` (:meth:`CompressedContext.save`), on this pipeline's model and tokenizer
        (another model, tokenizer or dtype is refused: :meth:`CompressedContext.load`)."""
        return CompressedContext.load(path, self.model, self.tokenizer, dtype=dtype)

    def ask(self, context: str | CompressedContext, questions: str | list[str], **generate_kwargs) -> str | list[str]:
        """Answer each question from one compressed context: ``context`` compressed once here (query-agnostic), or a
        :class:`CompressedContext` (:meth:`compress`, :meth:`load`, a context store), which is left as it was.

        Returns:
            one answer per question (a string for a single question); with ``num_return_sequences`` > 1, a list of
            that many answers in place of each.
        """
        from .chat_prompt import encode_chat_prompt

        single = isinstance(questions, str)
        questions = [questions] if single else list(questions)
        if isinstance(context, CompressedContext):
            cache, ctx = context.cache, context.ids
            filled_by = cache.model_description()  # None: a cache that does not know its model (nothing to check)
            other = None if filled_by is None else model_mismatch(filled_by, describe_model(self.model))
            if other is not None:
                raise ValueError(f"this compressed context {other}; compress it with this pipeline's model")
            parts = [(None, context.question_ids(q)) for q in questions]
        else:
            parts = [encode_chat_prompt(self.tokenizer, context, q) for q in questions]  # (context, question ids)
            _check_not_empty(parts[0][0], context)
            ctx = torch.tensor([parts[0][0]], device=self.model.device)
            if any(c != parts[0][0] for c, _ in parts):
                raise ValueError("the chat template renders the context differently for different questions; ask "
                                 "them one at a time")
            cache = compress_context(self.model, self.new_cache(), ctx)
        kwargs = self._gen_kwargs(generate_kwargs)
        answers = []
        for _, question_ids in parts:
            q = torch.tensor([question_ids])
            ids = answer_from_cache(self.model, cache, ctx, q, **kwargs)
            texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
            answers.append(texts if kwargs.get("num_return_sequences", 1) > 1 else texts[0])
        return answers[0] if single else answers


class ProxyKVGenerationPipeline(TextGenerationPipeline):
    """``text-generation`` with a fresh ProxyKV cache for every forward.

    Extra arguments (at construction, through ``pipeline(...)``): ``proxykv`` (checkpoint path or Hub id, a
    ProxyKVCache template, a Scorer or a cache factory; None = full cache), ``keep_ratio``, ``proxykv_kwargs``.
    Sampling defaults are those of ``text-generation``; pass ``do_sample=False`` for deterministic answers.
    """

    def __init__(self, *args, proxykv=None, keep_ratio: float | None = None, proxykv_kwargs: dict | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.new_cache = make_cache_factory(proxykv, keep_ratio, **(proxykv_kwargs or {}))

    def _forward(self, model_inputs, **generate_kwargs):
        if {"cache", "past_key_values"} & set(generate_kwargs):
            raise ValueError("proxykv-generation builds its own cache; do not pass cache or past_key_values")
        return super()._forward(model_inputs, **with_cache(self.new_cache()), **generate_kwargs)


def register_pipeline() -> None:
    """Register ``"proxykv-generation"`` with transformers' pipeline registry (idempotent)."""
    from transformers.pipelines import PIPELINE_REGISTRY

    if TASK not in PIPELINE_REGISTRY.get_supported_tasks():
        PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=ProxyKVGenerationPipeline,
                                            pt_model=AutoModelForCausalLM, type="text")
