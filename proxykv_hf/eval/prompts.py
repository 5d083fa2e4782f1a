"""Chat-formatted prompts of task samples, split token-exactly into a context part and a question part."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .haystack import Sample

logger = logging.getLogger(__name__)

_PARTS = ("context", "question", "full")


def prompt_texts(sample: Sample, tokenizer: Any) -> tuple[str, str]:
    """The prompt as two strings ``(context part, question part)`` that tokenize token-exactly on their own.

    With a chat template, the user message ``context + "\\n\\n" + question`` goes through the template once (with
    the generation prompt), the answer prefix is appended, and the string is split between the context and the
    question, at the first whitespace position where tokenizing the two parts separately gives the tokens of the
    whole. Without a template: ``bos + context`` and ``"\\n\\n" + question + "\\n" + answer prefix``.

    Raises:
        ValueError: the template changed the context, or no split point tokenizes exactly (see
            :func:`encode_sample`, which falls back to splitting the tokens of the whole).
    """
    text, ctx_end, q_start = _full_text(sample, tokenizer)
    encode = _encoder(tokenizer)
    full = encode(text)
    for p in range(ctx_end, q_start + 1):
        head = encode(text[:p])
        if full[:len(head)] == head and full[len(head):] == encode(text[p:]):
            return text[:p], text[p:]
    raise ValueError(f"no split point of the {sample.task!r} prompt between its context and question tokenizes "
                     f"token-exactly with {type(tokenizer).__name__}; use encode_sample(), which splits the tokens")


def encode_sample(sample: Sample, tokenizer: Any) -> tuple[list[int], list[int]]:
    """``(context_ids, question_ids)`` with ``context_ids + question_ids == build_prompt(sample, tok, part="full")``.

    The context ids are what the harness prefills (and compresses) alone; the question ids continue the same cache.
    Uses :func:`prompt_texts`; when no string split is token-exact (e.g. a SentencePiece tokenizer that prefixes
    every encoded string with a space), the tokens of the whole prompt are split at the context's end offset.
    """
    try:
        ctx, question = prompt_texts(sample, tokenizer)
    except ValueError:
        text, ctx_end, _ = _full_text(sample, tokenizer)
        try:
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except (TypeError, ValueError, NotImplementedError) as err:
            raise ValueError(f"cannot split the {sample.task!r} prompt token-exactly with "
                             f"{type(tokenizer).__name__}: no string split works and it gives no offsets") from err
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        k = 0
        while k < len(offsets) and offsets[k][1] <= ctx_end:
            k += 1
        logger.debug("split the %r prompt by token offsets at token %d", sample.task, k)
        return ids[:k], ids[k:]
    encode = _encoder(tokenizer)
    return encode(ctx), encode(question)


def build_prompt(sample: Sample, tokenizer: Any, *, part: str = "full") -> list[int]:
    """Token ids of the chat-formatted prompt: ``part`` is ``"context"``, ``"question"`` or ``"full"``.

    ``build_prompt(s, t, part="context") + build_prompt(s, t, part="question") == build_prompt(s, t, part="full")``.
    """
    if part not in _PARTS:
        raise ValueError(f"part must be one of {_PARTS}, got {part!r}")
    ctx, question = encode_sample(sample, tokenizer)
    return {"context": ctx, "question": question, "full": ctx + question}[part]


def _encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    encode = getattr(tokenizer, "encode", None)
    if encode is None:
        raise ValueError(f"building prompts needs a tokenizer with encode(), got {type(tokenizer).__name__}")
    return lambda text: list(encode(text, add_special_tokens=False))


def _full_text(sample: Sample, tokenizer: Any) -> tuple[str, int, int]:
    """``(full prompt string, end of the context, start of the question)``."""
    if getattr(tokenizer, "chat_template", None):
        message = sample.context + "\n\n" + sample.question
        text = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                             add_generation_prompt=True) + sample.answer_prefix
        start = text.find(sample.context)
        q_start = text.find(sample.question, start + len(sample.context)) if start >= 0 else -1
        if q_start < 0:
            raise ValueError(f"the chat template of {type(tokenizer).__name__} altered the context or question of "
                             f"the {sample.task!r} sample; pass a tokenizer whose template keeps the user text as is")
        return text, start + len(sample.context), q_start
    bos = getattr(tokenizer, "bos_token", None) or ""
    head = bos + sample.context
    text = head + "\n\n" + sample.question + "\n" + sample.answer_prefix
    return text, len(head), len(head) + 2
