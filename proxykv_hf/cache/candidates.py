"""Candidate-verifying decoding (assisted generation, prompt lookup) on a ProxyKV cache.

transformers verifies candidate tokens by feeding them with the prompt: the first verification forward of a call
holds the prompt **and** the candidates (the whole conversation, also on a cache that already holds its beginning).
A ProxyKV cache compresses the prompt alone, and its later tokens must see the compressed prompt as they do in plain
decoding. transformers announces this decoding by calling ``cache.activate_past_recording()`` before the first
forward; the cache then arms a :class:`FirstVerification` on the model: one-shot forward hooks that split that
forward into the part the cache does not hold yet (on an empty cache: the prompt, run as its own forward and
compressed) and the candidates, and put the prompt's last logits back in front of the candidates' logits. The
candidates then attend to exactly what plain decoding's tokens attend to, and can be cropped.
"""

from __future__ import annotations

import torch

from ..attention.compat import cache_of
from .conversation import START_OVER


class FirstVerification:
    """One-shot hooks on ``model`` that split the first verification forward run with ``cache``.

    Args:
        cache: the ProxyKV cache.
        model: the model the ``generate`` call runs.
        length: tokens in the call's prompt (what the cache holds and the new prompt tokens).
    """

    def __init__(self, cache, model, length: int):
        self.cache, self.length = cache, length
        self.logits: torch.Tensor | None = None
        self._inner = False
        # before the cache's own hook (prompt.ForwardHooks), which must see the forward as split
        self._pre = model.register_forward_pre_hook(self._before, with_kwargs=True, prepend=True)
        self._post = model.register_forward_hook(self._after, with_kwargs=True)

    @classmethod
    def arm(cls, cache, call) -> "FirstVerification":
        old = cache.calls.split
        if old is not None:
            old.remove()
        return cls(cache, call.model, call.length)

    def remove(self) -> None:
        self._pre.remove()
        self._post.remove()
        if self.cache.calls.split is self:
            self.cache.calls.split = None

    def _before(self, module, args, kwargs):
        if cache_of(kwargs) is not self.cache:
            return None  # another cache's forward (e.g. a helper model's): not ours to split
        self._pre.remove()
        ids, held = kwargs.get("input_ids"), self.cache.get_seq_length()
        if args or ids is None or ids.dim() != 2:
            self.remove()
            return None
        n, fed = self.length, ids.shape[1]
        if held == 0 and fed > n:  # an empty cache: compress the prompt on its own, then verify the candidates
            if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
                self.remove()
                raise ValueError("candidate-verifying decoding (assisted, prompt lookup) on an empty ProxyKVCache "
                                 "cannot return attentions or hidden states for its first forward; prefill the "
                                 "prompt first (a generate call with max_new_tokens=1), then decode on the cache")
            self._inner = True  # the prompt's own forward passes _after untouched
            try:
                first = module(**_positions(kwargs, 0, n, logits=1))
            finally:
                self._inner = False
            self.logits = first.logits[:, -1:]
            return args, _positions(kwargs, n, fed, logits=fed - n)
        self._post.remove()
        self.cache.calls.split = None
        if 0 < held < fed:  # a used cache: transformers feeds the whole conversation again; feed what is new
            have = self.cache.conversation.ids()
            if have is None or not torch.equal(ids[:, :held].to(have.device), have):
                raise ValueError("the first forward of candidate-verifying decoding does not start with the "
                                 f"conversation this ProxyKVCache holds ({held} tokens). {START_OVER}")
            return args, _positions(kwargs, held, fed, logits=kwargs.get("logits_to_keep"))
        return None

    def _after(self, module, args, kwargs, output):
        if self._inner or cache_of(kwargs) is not self.cache:
            return None
        self.remove()
        if self.logits is not None:
            output.logits = torch.cat([self.logits.to(output.logits.dtype), output.logits], dim=1)
            self.logits = None
        return output


def _positions(kwargs: dict, start: int, end: int, *, logits) -> dict:
    """``kwargs`` of a forward restricted to its tokens ``start:end`` (ids and positions; the 2-D attention mask
    covers the cache and the new tokens, so it is cut at ``end``)."""
    out = dict(kwargs)
    out["input_ids"] = kwargs["input_ids"][:, start:end]
    position_ids = kwargs.get("position_ids")
    if position_ids is not None:
        out["position_ids"] = position_ids[..., start:end]
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        out["attention_mask"] = mask[:, :end]
    if "logits_to_keep" in kwargs or logits is not None:
        out["logits_to_keep"] = logits if isinstance(logits, int) and logits > 0 else kwargs.get("logits_to_keep", 0)
    return out
