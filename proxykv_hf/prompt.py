"""Where a cache learns what it is given: the running forward's tokens and the running ``generate`` call's prompt.

A cache's ``update`` sees keys and values, not token ids. At the start of every forward (its first layer) the cache
looks up, in the calling frames (CPython), the outermost ``PreTrainedModel.forward`` (the tokens this forward feeds)
and the innermost ``generate`` call (the prompt it was given, expanded for beams / ``num_return_sequences``, with
its padding). :func:`running_forward` is the one place that reads transformers' frames; what it reads is public
API (``forward``'s ``input_ids`` / ``attention_mask`` / ``inputs_embeds`` parameters, ``generate``'s prompt
``input_ids`` and its ``model_kwargs``), tested in ``tests/test_transformers_contract.py``. Outside ``generate``
(a hand-written loop) the caller names the prompt with ``ProxyKVCache.prepare``.

:func:`check_prompt` refuses what the cache cannot compress exactly (right padding, empty rows, an unsupported
model family).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.generation.utils import GenerationMixin

from .scorers.base import Prompt, Scorer

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma3_text")


@dataclass
class Forward:
    """One forward of a model, as its outermost ``PreTrainedModel.forward`` was called.

    Attributes:
        model: the model whose ``forward`` it is.
        input_ids: `(B, q)` the tokens it feeds, or None (``inputs_embeds``).
        attention_mask: its 2-D mask `(B, past + q)`, or None.
    """

    model: PreTrainedModel
    input_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None


@dataclass
class GenerateCall:
    """A running ``generate`` call.

    Attributes:
        model: the model ``generate`` runs.
        input_ids: `(B, N)` its whole prompt (expanded for beams / ``num_return_sequences``), or None when it was
            given ``inputs_embeds`` only.
        attention_mask: `(B, N)` its padding mask, or None (no padding).
        batch: rows in the prompt (``B``).
        length: tokens in the prompt (``N``, also for ``inputs_embeds``).
    """

    model: PreTrainedModel
    input_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None
    batch: int
    length: int


def make_prompt(input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, model,
                shape: tuple[int, int] | None = None) -> Prompt:
    """A :class:`Prompt` from ids (or, for ``inputs_embeds``, the ``(B, T)`` ``shape``) and an optional mask."""
    if input_ids is None and shape is None:
        raise ValueError("the prompt needs input_ids or, with inputs_embeds, its (B, T) shape")
    if attention_mask is not None:
        valid = attention_mask.to(torch.bool)
    elif input_ids is not None:
        valid = torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device)
    else:
        valid = torch.ones(shape, dtype=torch.bool)
    return Prompt(input_ids=input_ids, valid=valid, model=model)


def _has(code, *names: str) -> bool:
    return all(n in code.co_varnames for n in names)


def running_forward(depth: int = 2) -> tuple[Forward | None, GenerateCall | None]:
    """The running forward and ``generate`` call, looked up in the calling frames (``depth``: frames to skip).

    Cheap enough for every forward (a decode step): frames are told apart by their code's name and variables, and
    only candidate frames' locals are read.
    """
    frame = sys._getframe(depth)
    forward = call = None
    while frame is not None:
        code = frame.f_code
        if code.co_name == "forward" and _has(code, "self", "input_ids", "attention_mask"):
            loc = frame.f_locals
            model = loc.get("self")
            if isinstance(model, PreTrainedModel):
                forward = Forward(model, loc.get("input_ids"), loc.get("attention_mask"))  # the outermost wins
        elif code.co_name == "generate" and _has(code, "self", "input_ids", "model_kwargs"):
            loc = frame.f_locals
            model, kwargs = loc.get("self"), loc.get("model_kwargs")
            if isinstance(model, GenerationMixin) and isinstance(kwargs, dict):
                call = _generate_call(model, loc.get("input_ids"), kwargs)
                if call is not None:
                    break  # the innermost generate call: every forward of interest runs below it
        frame = frame.f_back
    return forward, call


def _generate_call(model, input_ids, kwargs: dict) -> GenerateCall | None:
    embeds = kwargs.get("inputs_embeds")
    if not isinstance(input_ids, torch.Tensor) and embeds is None:
        return None  # generate has not reached its prompt yet
    mask = kwargs.get("attention_mask")
    mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
    ids = input_ids if isinstance(input_ids, torch.Tensor) and input_ids.shape[-1] > 0 else None
    if ids is None and embeds is None:
        return None
    batch, length = (embeds.shape[0], embeds.shape[1]) if embeds is not None else ids.shape
    if ids is not None and ids.shape[-1] != length:
        ids = None  # ids and embeddings of different lengths: only the embeddings are the prompt
    return GenerateCall(model, ids, mask, batch, length)


def check_prompt(prompt: Prompt, scorer: Scorer | None) -> torch.Tensor:
    """``ValueError`` for a prompt the cache cannot compress; else the real tokens per row `(B,)`."""
    model = prompt.model
    if model is None:
        raise ValueError("ProxyKVCache needs the model; call cache.prepare(model, input_ids, attention_mask)")
    family = getattr(model.config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"model_type {family!r} is not supported by ProxyKVCache; supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    valid = prompt.valid
    if valid.dim() != 2:
        raise ValueError(f"attention_mask must be 2-D (B, T), got shape {tuple(valid.shape)}")
    n_real = valid.sum(-1)
    if bool((n_real == 0).any()):
        rows = torch.nonzero(n_real == 0).flatten().tolist()
        raise ValueError(f"batch rows {rows} of the prompt are all padding")
    # Left padding only: once a row has a real token, every later token is real.
    if bool((valid.long().cummax(-1).values.bool() & ~valid).any()):
        raise ValueError("ProxyKVCache needs left padding (tokenizer.padding_side = 'left')")
    if scorer is not None and scorer.needs_input_ids and prompt.input_ids is None:
        raise ValueError(f"{type(scorer).__name__} needs the prompt's input_ids; call the model with "
                         "input_ids, or cache.prepare(model, input_ids, attention_mask)")
    return n_real
