"""ProxyKV: a small proxy's attention, mapped to target scores by a learned HybridAxialMapper (the ProxyKV paper)."""

from __future__ import annotations

import copy
import logging

import torch

from ..proxy import decoder_of, proxy_features
from ..scoring import attention_sums
from .base import LayerInputs, Prompt, Scorer

logger = logging.getLogger(__name__)


class ProxyScorer(Scorer):
    """Scores from a trained mapper checkpoint (see :mod:`proxykv_hf.hub`).

    On the target's first prefill, :meth:`prepare` runs the proxy and the mapper; on CUDA they run on a side stream
    (or on ``proxy_device``) while the target prefills, and each layer's Top-K waits on an event, not a device-wide
    sync. With a ``"self"`` proxy the features are the target's own attention sums, mapped layer by layer.

    Args:
        checkpoint: a loaded :class:`~proxykv_hf.hub.Checkpoint`.
        proxy_model: the proxy model for kind ``"model"`` checkpoints (loaded by ``ProxyKVCache.from_pretrained``).
        proxy_device: where the proxy and mapper run; default: the target's device.
        chunk_size: queries per chunk in the attention accumulation.
        n_sink: first tokens always kept (the KVzip teacher protects its sinks the same way).
    """

    def __init__(self, checkpoint, *, proxy_model=None, proxy_device=None, chunk_size: int = 256, n_sink: int = 4):
        self.checkpoint = checkpoint
        self.spec = checkpoint.proxy
        if self.spec.kind == "model" and proxy_model is None:
            raise ValueError("this checkpoint needs its proxy model; pass proxy=... or let from_pretrained load it")
        self.proxy_model = proxy_model
        self.proxy_device = None if proxy_device is None else torch.device(proxy_device)
        self.chunk_size = chunk_size
        self.n_sink = n_sink
        self.needs_input_ids = self.spec.kind != "self"
        self._scores: torch.Tensor | None = None
        self._event = None

    @property
    def mapper(self):
        return self.checkpoint.mapper

    def fresh(self) -> "ProxyScorer":
        clone = copy.copy(self)
        clone._scores, clone._event = None, None
        return clone

    def _check(self, model) -> None:
        self.checkpoint.check_target(model.config)
        if self.proxy_model is not None:
            got, want = self.proxy_model.config.vocab_size, model.config.vocab_size
            if got != want:
                raise ValueError(f"proxy and target must share a tokenizer: proxy vocab {got} != target vocab {want}")

    def prepare(self, prompt: Prompt) -> None:
        self._check(prompt.model)
        self._scores, self._event = None, None
        if self.spec.kind == "self":
            return
        runner = self.proxy_model if self.spec.kind == "model" else prompt.model
        device = self.proxy_device or prompt.input_ids.device
        ids = prompt.input_ids.to(device, non_blocking=True)
        mask = prompt.valid.to(device, non_blocking=True).long()
        self.mapper.to(device)
        if device.type == "cuda":
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))  # the prompt tensors were made there
            with torch.cuda.stream(stream):
                self._scores = self._run(runner, ids, mask)
            self._event = stream.record_event()
        else:
            self._scores = self._run(runner, ids, mask)

    @torch.no_grad()
    def _run(self, runner, ids, mask) -> torch.Tensor:
        x = proxy_features(runner, ids, mask, layers=self.spec.layers, chunk_size=self.chunk_size)
        return self.mapper(x, attention_mask=mask)  # (B, L_l, H_l, N)

    @torch.no_grad()
    def score(self, inputs: LayerInputs) -> torch.Tensor:
        device = inputs.keys.device
        if self.spec.kind == "self":
            x = attention_sums(inputs.queries, inputs.keys, inputs.attention_mask, inputs.scaling,
                               query_valid=inputs.valid[:, -inputs.queries.shape[2]:].to(device),
                               chunk_size=self.chunk_size)  # (B, H, T)
            self.mapper.to(device)
            return self.mapper.forward_layer(x, inputs.compact_index, inputs.valid.to(device).long())
        if self._event is not None:
            torch.cuda.current_stream(device).wait_event(self._event)
        scores = self._scores[:, inputs.compact_index].to(device, non_blocking=True)
        if inputs.compact_index == self.checkpoint.target.num_layers - 1:
            self._scores, self._event = None, None  # free once the last layer has its scores
        return scores


def describe_runner(model) -> str:
    """Short description of a proxy model for logs."""
    d = decoder_of(model)
    return f"{type(model).__name__}({len(d.layers)} layers)"
