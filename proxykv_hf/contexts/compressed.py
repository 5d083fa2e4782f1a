"""A compressed context as the pipeline uses it: a filled cache, the text it was compressed from, and its tokenizer.

:meth:`ProxyKVPipeline.compress <proxykv_hf.contexts.pipeline.ProxyKVPipeline.compress>` makes one, and
:meth:`ProxyKVPipeline.ask <proxykv_hf.contexts.pipeline.ProxyKVPipeline.ask>` answers questions from it (each from a
snapshot of the cache, so the context is left as it was). :meth:`CompressedContext.save` /
:meth:`CompressedContext.load` put it on disk in the format of :mod:`proxykv_hf.contexts`, the text included, so that
questions are tokenized against it exactly as they would be against the original text.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..cache.proxykv_cache import ProxyKVCache
from .format import read_context, save_context

PLACEHOLDER_QUESTION = "?"
"""The question a context is encoded with when it is compressed alone; each real question then checks that the chat
template renders the context to the same ids (:meth:`CompressedContext.question_ids`)."""


def encode_context(tokenizer: Any, text: str, question: str = PLACEHOLDER_QUESTION) -> tuple[list[int], list[int]]:
    """``(context ids, question ids)`` of the chat-formatted prompt of ``text`` and ``question``
    (:func:`~proxykv_hf.contexts.chat_prompt.encode_chat_prompt`: the context part is what is compressed)."""
    from .chat_prompt import encode_chat_prompt

    return encode_chat_prompt(tokenizer, text, question)


@dataclass
class CompressedContext:
    """A context compressed once (query-agnostic), ready to answer questions.

    Attributes:
        cache: the filled :class:`~proxykv_hf.cache.ProxyKVCache`, holding the context's ids `(1, N)`.
        text: the context's text (None for a context saved without it, e.g. by ``ProxyKVCache.save_context``:
            questions then cannot be tokenized against it).
        tokenizer: the tokenizer it was encoded with (fingerprinted on save).
    """

    cache: ProxyKVCache
    text: str | None
    tokenizer: Any = None

    @property
    def ids(self) -> torch.Tensor:
        """`(1, N)` the token ids the cache holds."""
        ids = self.cache.conversation.ids()
        if ids is None:
            raise ValueError("this compressed context's token ids are unknown (it was filled from inputs_embeds)")
        return ids

    @property
    def num_tokens(self) -> int:
        """Tokens of the context (per row)."""
        return len(self.cache.conversation)

    @property
    def nbytes(self) -> int:
        """Bytes of memory the cache holds (:meth:`ProxyKVCache.nbytes <proxykv_hf.cache.ProxyKVCache.nbytes>`: the
        kept K/V and their indices; on disk, :meth:`save` adds the token ids and the text)."""
        return self.cache.nbytes()

    def question_ids(self, question: str) -> list[int]:
        """The ids of ``question`` (and the assistant header) that continue this context.

        Raises:
            ValueError: the context has no text, or the chat template renders it to other ids with this question.
        """
        if self.text is None or self.tokenizer is None:
            raise ValueError("this compressed context holds no text (or no tokenizer), so questions cannot be "
                             "tokenized against it; compress it with ProxyKVPipeline.compress")
        context, question_ids = encode_context(self.tokenizer, self.text, question)
        held = self.ids[0].tolist()
        if len(held) > len(context) and held[:len(context)] == context:
            raise ValueError(f"this compressed context's cache holds {len(held)} tokens, {len(held) - len(context)} "
                             f"after the context's {len(context)}: it was continued (a conversation generated on "
                             "its cache); ask questions on the context as compressed or loaded, not on a continued "
                             "cache")
        if context != held:
            raise ValueError(f"the chat template renders the context to other ids with the question {question!r} "
                             "than the compressed ones; ask it on the uncompressed text")
        return question_ids

    def save(self, path: str | os.PathLike) -> Path:
        """Write the context (cache, text, tokenizer fingerprint) to the directory ``path``, whole or not at all
        (:func:`~proxykv_hf.contexts.save_context`)."""
        return save_context(self.cache, path, self.tokenizer, text=self.text)

    @classmethod
    def load(cls, path: str | os.PathLike, model, tokenizer=None, *, dtype: str = "refuse") -> "CompressedContext":
        """The context saved at ``path``, on ``model`` (:func:`~proxykv_hf.contexts.read_context`: another model,
        tokenizer or dtype, a newer format or a damaged file is refused with a ``ValueError`` naming the file)."""
        loaded = read_context(path, model, tokenizer, cache_class=ProxyKVCache, dtype=dtype)
        return cls(loaded.cache, loaded.text, tokenizer)
