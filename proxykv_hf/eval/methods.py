"""The methods the harness compares, by name, and a scorer wrapper that records scores for reuse and fidelity.

A method is built once per run by :func:`build_method` and returns a :class:`RecordingScorer` (or None for the full
cache). Scores depend only on the prompt, so one scoring pass serves every keep ratio of a sample: the recorder
keeps the last prompt's per-layer scores and replays them when the same prompt comes again.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field

import torch

from ..scorers import RandomScorer, SnapKVScorer, StreamingLLMScorer
from ..scorers.base import LayerInputs, Prompt, Scorer

logger = logging.getLogger(__name__)

METHODS = ("full", "kvzip", "snapkv", "streaming", "random", "proxykv", "kvzip_iam", "attn_sum", "attn_max",
           "attn_novelty")
"""Method names. ``attn_sum`` / ``attn_max`` / ``attn_novelty``: the self proxy's statistics (sum, max, lookback)
used as scores with no mapper (:class:`~proxykv_hf.scorers.statistic.AttentionStatisticScorer`; pooled only with
``pool_kernel``)."""
_NO_MAPPER = {"attn_sum": "sum", "attn_max": "max", "attn_novelty": "lookback"}


def prompt_key(prompt: Prompt) -> str:
    """A hash of the prompt's ids and mask (identifies 'the same prompt again')."""
    h = hashlib.sha1()
    if prompt.input_ids is not None:
        h.update(prompt.input_ids.detach().cpu().numpy().tobytes())
    h.update(prompt.valid.detach().cpu().numpy().tobytes())
    return h.hexdigest()


class RecordingScorer(Scorer):
    """Wraps a scorer: computes scores once per prompt and replays them; keeps them for fidelity metrics.

    Attributes:
        scores: `{layer_idx: (B, H_kv, T)}` of the last prompt, on CPU.
    """

    def __init__(self, inner: Scorer):
        self.inner = inner
        self.n_sink, self.n_recent = inner.n_sink, inner.n_recent
        self.needs_input_ids = inner.needs_input_ids
        self.needs_all_layers = inner.needs_all_layers
        self.key: str | None = None
        self.scores: dict[int, torch.Tensor] = {}
        self._replay = False

    def prepare(self, prompt: Prompt) -> None:
        key = prompt_key(prompt)
        self._replay = key == self.key and bool(self.scores)
        if not self._replay:
            self.key, self.scores = key, {}
            self.inner.prepare(prompt)

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        if self._replay:
            return self.scores[inputs.layer_idx].to(inputs.keys.device)
        s = self.inner.score(inputs)
        self.scores[inputs.layer_idx] = s.detach().float().cpu()
        return s

    def score_all(self, prompt: Prompt, cache) -> dict[int, torch.Tensor]:
        if not self._replay:
            out = self.inner.score_all(prompt, cache)
            self.scores = {i: s.detach().float().cpu() for i, s in out.items()}
        return {i: s.to(prompt.valid.device) for i, s in self.scores.items()}


@dataclass(kw_only=True)
class MethodOptions:
    """What some methods need beyond the model.

    Attributes:
        tokenizer: the target's tokenizer (KVzip's repeat prompt).
        mapper: ProxyKV mapper checkpoint (directory or Hub id).
        proxy: a loaded proxy model for checkpoints whose proxy is a separate model.
        iam_proxy: the proxy model for KVzip+IAM (a separate model), or None to use a layer subset of the target.
        iam_layers: the target layers of the layer-subset proxy for KVzip+IAM.
        seed: for the random method.
        kvzip_chunk: KVzip's reconstruction chunk size.
        pool_kernel: ProxyKV's score pooling (see ``ProxyKVCache.from_pretrained``); None: the checkpoint's.
    """

    tokenizer: object = None
    mapper: str | None = None
    proxy: object = None
    iam_proxy: object = None
    iam_layers: list[int] | None = None
    seed: int = 0
    kvzip_chunk: int = 2048
    pool_kernel: int | None = None
    extra: dict = field(default_factory=dict)


def build_method(name: str, model, options: MethodOptions) -> RecordingScorer | None:
    """The scorer of method ``name`` (see :data:`METHODS`), wrapped for recording; None for the full cache."""
    if name == "full":
        return None
    if name == "snapkv":
        inner: Scorer = SnapKVScorer()
    elif name == "streaming":
        inner = StreamingLLMScorer()
    elif name == "random":
        inner = RandomScorer(options.seed)
    elif name == "kvzip":
        from ..scorers.kvzip import KVzipScorer

        inner = KVzipScorer(options.tokenizer, chunk_size=options.kvzip_chunk)
    elif name == "proxykv":
        if options.mapper is None:
            raise ValueError("method 'proxykv' needs a mapper checkpoint (--mapper)")
        from ..cache import ProxyKVCache

        inner = ProxyKVCache.from_pretrained(options.mapper, proxy=options.proxy,
                                             pool_kernel=options.pool_kernel).scorer
    elif name in _NO_MAPPER:
        from ..scorers.statistic import AttentionStatisticScorer

        inner = AttentionStatisticScorer(_NO_MAPPER[name], pool_kernel=options.pool_kernel or 1)
    elif name == "kvzip_iam":
        from ..scorers.iam import KVzipIAMScorer

        inner = KVzipIAMScorer(options.tokenizer, proxy=options.iam_proxy, layers=options.iam_layers,
                               chunk_size=options.kvzip_chunk)
    else:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    return RecordingScorer(inner)
