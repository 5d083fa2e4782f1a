"""Greedy decoding from a filled cache with fixed-size K/V buffers, replayable as one CUDA graph per token.

Eager decoding in ``transformers`` spends more host time per token on a large model (Python, kernel launches) than
the GPU's own work for that token (docs/performance.md). Timed eagerly, every cache size
decodes at the host's speed and a smaller cache cannot show what it saves. :class:`StaticDecoder` copies a cache's
K/V into buffers with room for the new tokens and runs each step with device-side state only (the write slot, the
position, the valid-slot mask, the next input id), so a whole step can be captured once and replayed: the GPU then
runs back to back and the per-token time is the device's.

The model sees a boolean 4-D mask over the buffer (``transformers`` passes a 4-D mask through as is) and explicit
``position_ids``; the cache object answers ``update`` only, which is all the attention layers ask of it. Every layer
must hold the same number of tokens (true of ProxyKV's and the baselines' per-layer budgets); sliding-window
layers are not supported.
"""

from __future__ import annotations

import torch

from ..attention.compat import with_cache


class SlotCache:
    """Per-layer K/V buffers of ``length + extra`` slots; ``update`` writes the new token at ``slot`` (a device tensor)
    and returns the whole buffers (unwritten slots are masked out by :class:`StaticDecoder`)."""

    def __init__(self, cache, extra: int):
        layers = list(cache.layers)
        if any(getattr(layer, "is_sliding", False) for layer in layers):
            raise ValueError("static decoding does not support sliding-window layers")
        lengths = {layer.keys.shape[-2] for layer in layers}
        if len(lengths) != 1:
            raise ValueError(f"static decoding needs the same cached length in every layer, got {sorted(lengths)}")
        (self.length,) = lengths

        def grow(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros(*t.shape[:-2], self.length + extra, t.shape[-1])
            out[..., : self.length, :] = t
            return out

        self.keys = [grow(layer.keys) for layer in layers]
        self.values = [grow(layer.values) for layer in layers]
        self.slot = torch.tensor([self.length], device=self.keys[0].device)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.slot, key_states.to(keys.dtype))
        values.index_copy_(2, self.slot, value_states.to(values.dtype))
        return keys, values


class StaticDecoder:
    """Greedy decoding of up to ``max_new_tokens`` after ``cache``'s prefill, starting from ``first_token`` (B, 1).

    ``graph=True`` (CUDA only) captures one step as a CUDA graph; ``graph=False`` runs the same step eagerly (any
    device; the reference the graph is tested against). ``run(n)`` decodes ``n`` more tokens; ``tokens`` holds them.
    """

    def __init__(self, model, cache, first_token: torch.Tensor, max_new_tokens: int, *, graph: bool = False):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.model, self.max_new_tokens = model, max_new_tokens
        self.cache = SlotCache(cache, max_new_tokens)
        device, batch = self.cache.keys[0].device, first_token.shape[0]
        if graph and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA cache, got {device}")
        size = self.cache.length + max_new_tokens
        self.mask = torch.zeros(batch, 1, 1, size, dtype=torch.bool, device=device)
        self.mask[..., : self.cache.length] = True
        self.ids = first_token.to(device).clone()
        self.pos = torch.full((batch, 1), cache.get_seq_length(), dtype=torch.long, device=device)
        self.tokens = torch.zeros(batch, max_new_tokens, dtype=torch.long, device=device)
        self.step_index = torch.zeros(1, dtype=torch.long, device=device)
        self.done = 0
        self.graph = self._capture() if graph else None

    @torch.no_grad()
    def _step(self) -> None:
        self.mask.index_fill_(-1, self.cache.slot, True)  # the slot this step writes becomes visible
        logits = self.model(input_ids=self.ids, position_ids=self.pos, attention_mask=self.mask,
                            **with_cache(self.cache), use_cache=True, logits_to_keep=1).logits
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        self.ids.copy_(nxt)
        self.tokens.index_copy_(1, self.step_index, nxt)
        for t in (self.cache.slot, self.pos, self.step_index):
            t.add_(1)

    def _state(self) -> list[torch.Tensor]:
        return [t.clone() for t in (self.mask, self.ids, self.pos, self.cache.slot, self.step_index)]

    def _restore(self, state: list[torch.Tensor]) -> None:
        for t, saved in zip((self.mask, self.ids, self.pos, self.cache.slot, self.step_index), state):
            t.copy_(saved)

    def _capture(self) -> torch.cuda.CUDAGraph:
        state = self._state()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (allocator, lazy inits) off the capture, as CUDA graphs require
            for _ in range(min(2, self.max_new_tokens)):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        self._restore(state)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step()
        self._restore(state)  # capture does not run the step, but leave no doubt
        return graph

    def run(self, n: int) -> torch.Tensor:
        """Decode ``n`` more tokens; returns all tokens decoded so far, (B, done)."""
        if self.done + n > self.max_new_tokens:
            raise ValueError(f"{self.done} + {n} tokens exceed max_new_tokens={self.max_new_tokens}")
        for _ in range(n):
            if self.graph is not None:
                self.graph.replay()
            else:
                self._step()
        self.done += n
        return self.tokens[:, : self.done]
