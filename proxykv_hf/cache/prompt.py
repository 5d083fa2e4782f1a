"""Where a cache learns what it is given: each forward's tokens and the running ``generate`` call's prompt.

A cache's ``update`` sees keys and values, not token ids. Each forward's ``input_ids`` / ``attention_mask`` reach it
through :class:`ForwardHooks`: a forward pre-hook on the top-level model, registered once the cache knows the model
(from ``prepare``, from the ``generate`` call it runs in, or from the first forward it sees). The prompt of a
``generate`` call (expanded for beams / ``num_return_sequences``, with its padding) is seen nowhere else: the
drop-in ``model.generate(..., cache=cache)`` hands the cache nothing but its forwards. So, when ``generate``
announces a call (:mod:`.calls`), :func:`running_forward` looks it up in the calling frames (CPython): once per
call, plus once for a forward that arrives while the cache knows no model (a hand-written loop without
``prepare``). It is the one place that reads transformers' frames; what it reads is public API (``forward``'s
``input_ids`` / ``attention_mask`` / ``inputs_embeds`` parameters, ``generate``'s prompt ``input_ids`` and its
``model_kwargs``), tested in ``tests/test_transformers_contract.py``.

:func:`check_prompt` refuses what the cache cannot compress exactly (right padding, empty rows, an unsupported
model family).
"""

from __future__ import annotations

import inspect
import sys
import weakref
from dataclasses import dataclass
from functools import partial

import torch
from transformers import PreTrainedModel
from transformers.generation.utils import GenerationMixin

from ..attention.compat import cache_of
from ..scorers.base import Prompt, Scorer

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
    """The running forward (its outermost ``PreTrainedModel.forward``) and the innermost running ``generate``
    call, looked up in the calling frames (``depth``: frames to skip). Frames are told apart by their code's name and
    variables, and only candidate frames' locals are read."""
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


class ForwardHooks:
    """The forwards that run with one cache, seen by hooks on the models that run them.

    A forward pre-hook (``with_kwargs``) on each model the cache is told of records, for every forward that carries
    this cache (positionally or by keyword, under either cache name), the model and the ``input_ids`` /
    ``attention_mask`` it is given; a forward hook (``always_call``, so also after an exception) ends it. While one
    forward runs, the forwards nested in it (the model's own base model, another hooked model) do not count: only
    the outermost does. A forward with another cache (a helper model's, e.g. an assistant's) is not recorded. The
    hooks hold the cache weakly, so that a model never keeps it alive, and are removed by :meth:`close` or when
    the cache is garbage-collected. Never copied or pickled with the cache.

    Attributes:
        current: the running forward that carries the cache (None between forwards, or for one no hook saw).
    """

    def __init__(self, cache):
        self.current: Forward | None = None
        self._cache = weakref.ref(cache)
        self._models: list[weakref.ref] = []
        self._handles: list = []
        self._close = weakref.finalize(cache, _remove, self._handles)

    def watch(self, model) -> None:
        """Hook ``model``'s forwards (once per model)."""
        if any(m() is model for m in self._models) or not self._close.alive:
            return
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        names = tuple(n for n, p in inspect.signature(model.forward).parameters.items() if p.kind in kinds)
        self._models.append(weakref.ref(model))
        self._handles += [model.register_forward_pre_hook(partial(self._before, names), with_kwargs=True),
                          model.register_forward_hook(partial(self._after, names), with_kwargs=True, always_call=True)]

    def close(self) -> None:
        """Remove the hooks (the cache was reset)."""
        self._close()
        self._models.clear()
        self.current = None

    def _mine(self, names: tuple[str, ...], args: tuple, kwargs: dict) -> dict | None:
        """The forward's arguments by name, when it carries this cache."""
        given = {**dict(zip(names, args)), **kwargs} if args else kwargs
        cache = self._cache()
        return given if cache is not None and cache_of(given) is cache else None

    def _before(self, names: tuple[str, ...], module, args: tuple, kwargs: dict):
        if self.current is None:  # else nested in a forward that counts
            given = self._mine(names, args, kwargs)
            if given is not None:
                self.current = Forward(module, given.get("input_ids"), given.get("attention_mask"))
        return None

    def _after(self, names: tuple[str, ...], module, args: tuple, kwargs: dict, output):
        # another thread may run the same model with another cache meanwhile: only this cache's forward ends it
        if self.current is not None and self.current.model is module and self._mine(names, args, kwargs) is not None:
            self.current = None
        return None


def _remove(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


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
