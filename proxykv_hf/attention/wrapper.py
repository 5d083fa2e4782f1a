"""Registered attention functions that let a ProxyKV cache see each layer's queries.

transformers calls ``cache.update(...)`` and then, in the same thread, the layer's attention function. A ProxyKV
cache leaves a *pending call* in a thread-local slot from ``update``; the wrapper below takes it, lets the cache
adjust the mask (spare slots of padded rows) and, after computing the ordinary attention output, hands it the
queries so that it can score and compact the layer. With nothing pending the wrapper is a plain pass-through, so a
model opted into it behaves exactly as before with any other cache.

A pending call may also offer ``attend``: for a plain causal prefill (no mask, no dropout, window, softcap or other
extra; see :func:`plain_causal`) under sdpa, the wrapper then lets it compute the attention output itself, so that
it can take its statistics from the same softmax instead of running the attention twice (the CPU path of the
ProxyKV proxy). ``attend`` returns None to decline, and the ordinary path runs.

Nothing is registered on import: :func:`use_proxykv_attention` registers the two functions (``proxykv_sdpa``,
``proxykv_eager``) once and opts one model in.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Protocol

import torch

SUPPORTED_BASE = ("sdpa", "eager")
PREFIX = "proxykv_"

_local = threading.local()
_registered = False


class PendingCall(Protocol):
    """What a cache leaves for the next attention call of the same thread."""

    def before(self, module: torch.nn.Module, attention_mask: torch.Tensor | None, query: torch.Tensor,
               key: torch.Tensor) -> torch.Tensor | None: ...

    def after(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, scaling: float) -> None: ...

    # optional: ``attend(module, query, key, value, scaling) -> (B, H, Q, D) output or None`` (see module docstring)
    # optional: ``replace(module, query, key, value, scaling, *, weights) -> ((B, H, Q, D), probabilities or None)``:
    # always computes the attention (the probabilities when ``weights``, as eager attention returns them)


# the keyword arguments a plain causal attention call may carry (what Llama, Mistral, Qwen2/3 and Gemma3 pass)
_PLAIN_KWARGS = frozenset({"dropout", "scaling", "sliding_window", "position_ids", "use_cache", "cache_position",
                           "is_causal"})


def plain_causal(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, args: tuple, kwargs: dict) -> bool:
    """True for a causal prefill over its own unpadded keys with nothing else to honour: no mask, no dropout, no
    sliding window, no extra argument (softcap, attention sinks, position bias...)."""
    return (attention_mask is None and not args and query.shape[2] == key.shape[2] > 1
            and query.shape[-1] == value.shape[-1] and set(kwargs) <= _PLAIN_KWARGS and not kwargs.get("dropout")
            and kwargs.get("sliding_window") is None and kwargs.get("is_causal", True) is not False
            and getattr(module, "is_causal", True))


def set_pending(call: PendingCall | None) -> None:
    """Leave ``call`` for the next attention function that runs in this thread."""
    _local.pending = call


def _take_pending() -> PendingCall | None:
    call = getattr(_local, "pending", None)
    _local.pending = None
    return call


def _eager_for(module: torch.nn.Module) -> Callable:
    """The model's own eager attention (Gemma's softcapping etc. live there)."""
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise ValueError(f"{type(module).__name__} has no eager_attention_forward; use attn_implementation='sdpa'")
    return fn


def _scaling(module: torch.nn.Module, query: torch.Tensor, kwargs: dict) -> float:
    scaling = kwargs.get("scaling")
    return getattr(module, "scaling", query.shape[-1] ** -0.5) if scaling is None else scaling


def _make_wrapper(base: str) -> Callable:
    def proxykv_attention(module, query, key, value, attention_mask, *args: Any, **kwargs: Any):
        call = _take_pending()
        if call is not None and getattr(call, "replace", None) is not None:  # the call computes the attention
            out, weights = call.replace(module, query, key, value, _scaling(module, query, kwargs),
                                        weights=base == "eager")  # eager attention returns its probabilities
            return out.transpose(1, 2).contiguous(), weights  # (B, Q, H, D), as sdpa_attention_forward
        if call is not None:
            attention_mask = call.before(module, attention_mask, query, key)
            attend = getattr(call, "attend", None)
            if attend is not None and base == "sdpa" and plain_causal(module, query, key, value, attention_mask,
                                                                      args, kwargs):
                out = attend(module, query, key, value, _scaling(module, query, kwargs))
                if out is not None:
                    return out.transpose(1, 2).contiguous(), None  # (B, Q, H, D), as sdpa_attention_forward
        if base == "sdpa":
            from transformers.integrations.sdpa_attention import sdpa_attention_forward as fn
        else:
            fn = _eager_for(module)
        out = fn(module, query, key, value, attention_mask, *args, **kwargs)
        if call is not None:
            call.after(module, query, key, value, attention_mask, _scaling(module, query, kwargs))
        return out

    proxykv_attention.__name__ = f"proxykv_{base}_attention"
    return proxykv_attention


def register() -> None:
    """Register ``proxykv_sdpa`` and ``proxykv_eager`` with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    for base, mask_fn in (("sdpa", sdpa_mask), ("eager", eager_mask)):
        AttentionInterface.register(PREFIX + base, _make_wrapper(base))
        AttentionMaskInterface.register(PREFIX + base, mask_fn)
    _registered = True


def base_implementation(model: torch.nn.Module) -> str:
    """The attention implementation under the wrapper (``"sdpa"`` or ``"eager"``), validated.

    Raises:
        ValueError: for implementations ProxyKV cannot wrap (flash-attention, flex, custom kernels).
    """
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    base = impl[len(PREFIX):] if impl.startswith(PREFIX) else impl
    if base in SUPPORTED_BASE:
        return base
    hint = ""
    if "flash" in base and not torch.cuda.is_available():
        hint = " flash-attention needs a CUDA GPU, and none is available here."
    raise ValueError(
        f"attn_implementation {impl!r} is not supported by ProxyKVCache; load the model with "
        f"attn_implementation='sdpa' or 'eager'.{hint}"
    )


def use_proxykv_attention(model: torch.nn.Module) -> None:
    """Opt ``model`` into the ProxyKV attention wrapper of its current implementation (sdpa or eager)."""
    base = base_implementation(model)
    register()
    if model.config._attn_implementation != PREFIX + base:
        model.set_attn_implementation(PREFIX + base)
