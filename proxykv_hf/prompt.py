"""The prompt a cache compresses: found in the calling frames of ``generate`` or given explicitly, then checked.

A ProxyKV cache needs its first prefill's token ids and padding before the first layer runs. Inside
``model.generate`` it looks them up once in the calling frames (:func:`find_prompt`, CPython); anywhere else the
caller hands them over with ``ProxyKVCache.prepare``. :func:`check_prompt` refuses what the cache cannot compress
exactly (right padding, empty rows, an unsupported model family).
"""

from __future__ import annotations

import sys

import torch
from transformers import PreTrainedModel

from .scorers.base import Prompt, Scorer

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma3_text")


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


def find_prompt() -> Prompt | None:
    """Look up the calling frames for the prompt of the running forward (CPython).

    Prefers ``GenerationMixin._prefill`` (the full prompt even with ``prefill_chunk_size``); else the outermost
    ``PreTrainedModel.forward`` frame that has ``input_ids`` and ``attention_mask``.
    """
    frame = sys._getframe(2)
    found = None
    while frame is not None:
        loc = frame.f_locals
        owner = loc.get("self")
        if isinstance(owner, PreTrainedModel):
            if frame.f_code.co_name == "_prefill" and "model_kwargs" in loc:
                ids = loc.get("input_ids")
                # the chunked path keeps the full mask in a local and slices model_kwargs' copy per chunk
                masks = (loc.get("attention_mask"), loc["model_kwargs"].get("attention_mask"))
                mask = next((m for m in masks if m is not None and m.shape[-1] == ids.shape[-1]), None)
                return make_prompt(ids, mask, owner)
            if "input_ids" in loc and "attention_mask" in loc and loc["input_ids"] is not None:
                found = make_prompt(loc["input_ids"], loc["attention_mask"], owner)
        frame = frame.f_back
    return found


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


def check_continuation(old: Prompt) -> None:
    """On a later multi-token forward, make sure the new prompt continues the compressed one ``old``."""
    found = find_prompt()
    if found is None or found.input_ids is None or old.input_ids is None:
        return
    ids, old_ids = found.input_ids, old.input_ids
    n = old_ids.shape[1]
    if ids.shape[1] > n and ids.shape[0] == old_ids.shape[0] and not torch.equal(ids[:, :n].to(old_ids.device),
                                                                                   old_ids):
        raise ValueError(
            "this ProxyKVCache already holds a different compressed prompt; generate() on the same cache "
            "continues a conversation. Use a new cache (or cache.reset()) for an unrelated prompt."
        )
