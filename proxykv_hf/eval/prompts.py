"""Chat-formatted prompts of task samples, split token-exactly into a context part and a question part (the split
itself: :mod:`proxykv_hf.contexts.chat_prompt`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..contexts.chat_prompt import _chat_text, encode_chat_prompt, split_chat_prompt

if TYPE_CHECKING:
    from .haystack import Sample

__all__ = ["build_prompt", "encode_chat_prompt", "encode_sample", "prompt_texts", "split_chat_prompt", "token_spans"]

_PARTS = ("context", "question", "full")


def prompt_texts(sample: Sample, tokenizer: Any) -> tuple[str, str]:
    """The prompt of ``sample`` as two strings ``(context part, question part)`` that tokenize token-exactly on
    their own (:func:`split_chat_prompt`)."""
    return split_chat_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix, name=sample.task)


def encode_sample(sample: Sample, tokenizer: Any) -> tuple[list[int], list[int]]:
    """``(context_ids, question_ids)`` with ``context_ids + question_ids == build_prompt(sample, tok, part="full")``
    (:func:`encode_chat_prompt` of the sample's context, question and answer prefix)."""
    return encode_chat_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix, name=sample.task)


def build_prompt(sample: Sample, tokenizer: Any, *, part: str = "full") -> list[int]:
    """Token ids of the chat-formatted prompt: ``part`` is ``"context"``, ``"question"`` or ``"full"``.

    ``build_prompt(s, t, part="context") + build_prompt(s, t, part="question") == build_prompt(s, t, part="full")``.
    """
    if part not in _PARTS:
        raise ValueError(f"part must be one of {_PARTS}, got {part!r}")
    ctx, question = encode_sample(sample, tokenizer)
    return {"context": ctx, "question": question, "full": ctx + question}[part]


def _full_text(sample: Sample, tokenizer: Any) -> tuple[str, int, int]:
    """``(full prompt string, end of the context, start of the question)`` of ``sample``."""
    return _chat_text(tokenizer, sample.context, sample.question, sample.answer_prefix, sample.task)


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
