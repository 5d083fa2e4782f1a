"""KVzip+IAM: KVzip scores computed on a proxy, mapped to the target by a fixed alignment, no learned mapper.

The ProxyKV paper's static-alignment baseline ("IAM's static layer-to-layer alignment adapted to KVzip"; IAM is
Zhao et al., 2025, cited by the paper). The paper does not give the exact rule, so this module fixes one:

* **Proxy**: a separate small model of the family, or a subset of the target's own layers (every 3rd by default).
* **Proxy scores**: KVzip's reconstruction scores, computed on the proxy exactly as :mod:`.kvzip` does on the target.
* **Layer alignment**: target layer ``l`` (1-based) reads proxy layer ``ceil(l * L_s / L_l)`` (depth-proportional);
  or, after :meth:`KVzipIAMScorer.calibrate`, the proxy layer whose KVzip scores correlate best (Pearson over
  tokens, mean over rows and heads) with that target layer's on calibration prompts.
* **Head alignment**: target KV head ``h`` reads proxy KV head ``floor(h * H_s / H_l)``; after calibration, the
  proxy head of the aligned layer that correlates best with it.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field, replace

import torch

from ..mapper.config import layer_pairing
from ..mapper.proxy import every_kth_layer, layer_subset
from .base import LayerInputs, LayerScorer, Prompt, chunk_size_spelling
from ..models.layout import full_attention_layers
from .kvzip import N_SINK, kvzip_scores


def _pearson(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Correlation over the last axis."""
    a = a - a.mean(-1, keepdim=True)
    b = b - b.mean(-1, keepdim=True)
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-12)


@dataclass(kw_only=True)
class KVzipIAMScorer(LayerScorer):
    """KVzip on a proxy + a static layer/head alignment.

    Attributes:
        tokenizer: the (shared) tokenizer, for KVzip's repeat prompts.
        proxy: a separate proxy model; None runs a subset of the target's layers.
        layers: target layers of the layer-subset proxy (default every 3rd); ignored with ``proxy``.
        context_chunk: KVzip's reconstruction chunk (context tokens per forward).
        n_sink: first tokens always kept (KVzip's sinks).
        layer_map: compacted target layer -> proxy layer, as :meth:`calibrate` sets it; None: the
            depth-proportional default (filled in by each compression).
        head_map: ``[target layer][target KV head] -> proxy KV head``, as :meth:`calibrate` sets it; None: the
            default.

    ``tokenizer`` may be given by position.
    """

    needs_input_ids = True

    tokenizer: object = field(default=None, kw_only=False, repr=False)
    proxy: torch.nn.Module | None = field(default=None, repr=False)
    layers: list[int] | None = None
    context_chunk: int = 2048
    n_sink: int = N_SINK
    layer_map: list[int] | None = None
    head_map: list[list[int]] | None = None
    chunk_size: InitVar[int | None] = None  # the deprecated spelling of context_chunk
    _scores: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    # (layer_map, head_map) as prepare() filled them in: the default alignment, not a setting
    _filled: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self, chunk_size: int | None = None):
        chunk_size_spelling(self, chunk_size)
        if self.proxy is not None and not isinstance(self.proxy, torch.nn.Module):
            raise ValueError(f"proxy must be a loaded model or None, got {type(self.proxy).__name__}")

    def fresh(self) -> "KVzipIAMScorer":
        clone = replace(self)
        clone._filled = self._filled
        return clone

    def settings(self) -> dict:
        """The base settings (the proxy model named by a digest of its weights) with ``layer_map`` and ``head_map``
        as calibration set them, None when the default alignment applies (filled in by each compression, it is not
        a setting), so that the settings are the same before and after a compression."""
        out = super().settings()
        if not self._aligned():
            out["layer_map"] = out["head_map"] = None
        return out

    def _aligned(self) -> bool:
        """Whether ``layer_map`` / ``head_map`` were set (by :meth:`calibrate` or by hand), not filled in by default."""
        return self.layer_map is not None and (self.layer_map, self.head_map) != self._filled

    def _runner(self, target):
        if self.proxy is not None:
            return self.proxy
        layers = self.layers or every_kth_layer(target.config.num_hidden_layers, 3)
        return layer_subset(target, layers)

    def proxy_scores(self, target, input_ids, attention_mask=None) -> torch.Tensor:
        """KVzip scores `(L_s, B, H_s, T)` on the proxy's full-attention layers."""
        runner = self._runner(target)
        scores = kvzip_scores(runner, input_ids.to(next(runner.parameters()).device), attention_mask,
                              tokenizer=self.tokenizer, context_chunk=self.context_chunk, n_sink=self.n_sink)
        return scores[full_attention_layers(runner)]

    def _default_maps(self, n_target: int, h_target: int, n_proxy: int, h_proxy: int) -> None:
        self.layer_map = layer_pairing(n_proxy, n_target)
        self.head_map = [[h * h_proxy // h_target for h in range(h_target)] for _ in range(n_target)]
        self._filled = (self.layer_map, self.head_map)

    @torch.no_grad()
    def calibrate(self, target, input_ids: torch.Tensor,
                  attention_mask: torch.Tensor | None = None) -> "KVzipIAMScorer":
        """Fix the alignment from calibration prompts: KVzip on target and proxy, best-correlated layer and head."""
        y_t = kvzip_scores(target, input_ids, attention_mask, tokenizer=self.tokenizer,
                           context_chunk=self.context_chunk, n_sink=self.n_sink)
        y_t = y_t[full_attention_layers(target)]  # (L_t, B, H_t, T)
        y_s = self.proxy_scores(target, input_ids, attention_mask).to(y_t.device)  # (L_s, B, H_s, T)
        a = y_t[:, None, :, :, None, :]  # (L_t, 1, B, H_t, 1, T)
        b = y_s[None, :, :, None, :, :]  # (1, L_s, B, 1, H_s, T)
        corr = _pearson(a, b).mean(dim=2)  # (L_t, L_s, H_t, H_s), averaged over rows
        layer_score = corr.amax(-1).mean(-1)  # (L_t, L_s): best proxy head per target head, mean over heads
        self.layer_map = layer_score.argmax(-1).tolist()
        self.head_map = [corr[l, self.layer_map[l]].argmax(-1).tolist() for l in range(corr.shape[0])]
        return self

    def prepare(self, prompt: Prompt) -> None:
        target = prompt.model
        ids, mask = prompt.input_ids, prompt.valid.long()
        self._scores = self.proxy_scores(target, ids, mask)  # (L_s, B, H_s, T)
        if not self._aligned():  # the default alignment, for this target and proxy
            n_target = len(full_attention_layers(target))
            text = target.config.get_text_config(decoder=True)
            self._default_maps(n_target, text.num_key_value_heads, self._scores.shape[0], self._scores.shape[2])

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        li = inputs.compact_index
        heads = torch.tensor(self.head_map[li], device=self._scores.device)
        out = self._scores[self.layer_map[li]].index_select(1, heads)  # (B, H_kv, T)
        return out.to(inputs.keys.device)
