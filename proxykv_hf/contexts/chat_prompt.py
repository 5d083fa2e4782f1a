"""A chat-formatted prompt of a context and a question, split token-exactly into the context part (what a cache
prefills and compresses alone) and the question part (what continues the same cache)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def split_chat_prompt(tokenizer: Any, context: str, question: str, answer_prefix: str = "", *,
                      name: str = "prompt") -> tuple[str, str]:
    """A prompt as two strings ``(context part, question part)`` that tokenize token-exactly on their own.

    With a chat template, the user message ``context + "\\n\\n" + question`` goes through the template once (with
    the generation prompt), ``answer_prefix`` is appended, and the string is split between the context and the
    question, at the first whitespace position where tokenizing the two parts separately gives the tokens of the
    whole. Without a template: ``bos + context`` and ``"\\n\\n" + question + "\\n" + answer_prefix``.

    Raises:
        ValueError: the template changed the context, or no split point tokenizes exactly (see
            :func:`encode_sample`, which falls back to splitting the tokens of the whole).
    """
    text, ctx_end, q_start = _chat_text(tokenizer, context, question, answer_prefix, name)
    encode = _encoder(tokenizer)
    full = encode(text)
    for p in range(ctx_end, q_start + 1):
        head = encode(text[:p])
        if full[:len(head)] == head and full[len(head):] == encode(text[p:]):
            return text[:p], text[p:]
    raise ValueError(f"no split point of the {name!r} prompt between its context and question tokenizes "
                     f"token-exactly with {type(tokenizer).__name__}; use encode_sample(), which splits the tokens")


def encode_chat_prompt(tokenizer: Any, context: str, question: str, answer_prefix: str = "", *,
                       name: str = "prompt") -> tuple[list[int], list[int]]:
    """``(context_ids, question_ids)`` of a chat-formatted prompt; together they are the tokens of the whole.

    The context ids are what is prefilled (and compressed) alone; the question ids continue the same cache. Uses
    :func:`split_chat_prompt`; when no string split is token-exact (e.g. a SentencePiece tokenizer that prefixes
    every encoded string with a space), the tokens of the whole prompt are split at the context's end offset.
    """
    try:
        ctx, q = split_chat_prompt(tokenizer, context, question, answer_prefix, name=name)
    except ValueError:
        text, ctx_end, _ = _chat_text(tokenizer, context, question, answer_prefix, name)
        try:
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except (TypeError, ValueError, NotImplementedError) as err:
            raise ValueError(f"cannot split the {name!r} prompt token-exactly with "
                             f"{type(tokenizer).__name__}: no string split works and it gives no offsets") from err
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        k = 0
        while k < len(offsets) and offsets[k][1] <= ctx_end:
            k += 1
        logger.debug("split the %r prompt by token offsets at token %d", name, k)
        return ids[:k], ids[k:]
    encode = _encoder(tokenizer)
    return encode(ctx), encode(q)


def _encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    encode = getattr(tokenizer, "encode", None)
    if encode is None:
        raise ValueError(f"building prompts needs a tokenizer with encode(), got {type(tokenizer).__name__}")
    return lambda text: list(encode(text, add_special_tokens=False))


def _chat_text(tokenizer: Any, context: str, question: str, answer_prefix: str, name: str) -> tuple[str, int, int]:
    """``(full prompt string, end of the context, start of the question)``."""
    if getattr(tokenizer, "chat_template", None):
        message = context + "\n\n" + question
        text = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                             add_generation_prompt=True) + answer_prefix
        start = text.find(context)
        q_start = text.find(question, start + len(context)) if start >= 0 else -1
        if q_start < 0:
            raise ValueError(f"the chat template of {type(tokenizer).__name__} altered the context or question of "
                             f"the {name!r} prompt; pass a tokenizer whose template keeps the user text as is")
        return text, start + len(context), q_start
    bos = getattr(tokenizer, "bos_token", None) or ""
    head = bos + context
    text = head + "\n\n" + question + "\n" + answer_prefix
    return text, len(head), len(head) + 2
