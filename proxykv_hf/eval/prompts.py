"""Chat-formatted prompts (of task samples, or of any context and question), split token-exactly into a context
part and a question part."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .haystack import Sample

logger = logging.getLogger(__name__)

_PARTS = ("context", "question", "full")


def prompt_texts(sample: Sample, tokenizer: Any) -> tuple[str, str]:
    """The prompt of ``sample`` as two strings ``(context part, question part)`` that tokenize token-exactly on
    their own (:func:`split_chat_prompt`)."""
    return split_chat_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix, name=sample.task)


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


def encode_sample(sample: Sample, tokenizer: Any) -> tuple[list[int], list[int]]:
    """``(context_ids, question_ids)`` with ``context_ids + question_ids == build_prompt(sample, tok, part="full")``
    (:func:`encode_chat_prompt` of the sample's context, question and answer prefix)."""
    return encode_chat_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix, name=sample.task)


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
    """``(full prompt string, end of the context, start of the question)`` of ``sample``."""
    return _chat_text(tokenizer, sample.context, sample.question, sample.answer_prefix, sample.task)


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


def token_spans(tokenizer: Any, ids: list[int], text: str) -> list[list[int]]:
    """Per occurrence of ``text`` in the decoded ``ids`` (overlapping ones included, in order), the positions of the
    tokens that spell it: those whose decoded piece overlaps the occurrence. An empty ``text`` has none."""
    pieces = [tokenizer.decode([t]) for t in ids]
    starts, at = [], 0
    for piece in pieces:
        starts.append(at)
        at += len(piece)
    decoded = "".join(pieces)
    spans, k = [], decoded.find(text) if text else -1
    while k >= 0:
        spans.append([j for j, s in enumerate(starts) if s < k + len(text) and s + len(pieces[j]) > k])
        k = decoded.find(text, k + 1)
    return spans
