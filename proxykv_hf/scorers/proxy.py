"""ProxyKV: a small proxy's attention, mapped to target scores by a learned HybridAxialMapper (the ProxyKV paper)."""

from __future__ import annotations

import copy
import functools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..mapper.calibration import table_as_list
from ..models.fingerprints import digest, weights_digest
from ..mapper.proxy import check_self_layers, proxy_features
from ..models.layout import full_attention_layers
from ..attention.statistics import CHUNK_SIZE, FusedStatistics, attention_sums
from .base import BackgroundScorer, LayerInputs, Prompt

if TYPE_CHECKING:
    from ..mapper.checkpoint import Checkpoint

_worker: ThreadPoolExecutor | None = None
_worker_lock = threading.Lock()


def side_worker() -> ThreadPoolExecutor:
    """The one thread that launches every ProxyKV proxy and mapper onto their side streams. It lives as long as the
    process, so that what the CUDA libraries keep per thread (cuBLAS handles, the plans of cuDNN's attention) is
    built once rather than for every prompt; proxies of prompts prefilled at once from several threads queue."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="proxykv-proxy")
        return _worker


def bfloat16_is_fast(device: torch.device) -> bool:
    """Whether bfloat16 matmuls beat float32 on ``device``: CUDA, or a CPU with AVX512-BF16 or AMX instructions
    (elsewhere the CPU emulates bfloat16 and runs slower than float32)."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and _cpu_has_bfloat16()


@functools.cache
def _cpu_has_bfloat16() -> bool:
    """Asked once per process: the mapper asks :func:`bfloat16_is_fast` once per layer."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private in torch.cpu; absent means no
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


@dataclass(kw_only=True)
class ProxyScorer(BackgroundScorer):
    """Scores from a trained mapper checkpoint (see :mod:`proxykv_hf.mapper.checkpoint`), ranked as the mapper gives
    them; under the global budget through the checkpoint's quantile table (:meth:`global_scores`).

    Two algorithms, one subclass each: :class:`SeparateProxyScorer` runs a proxy (a separate small model, or a subset
    of the target's layers) and the mapper beside the target's prefill; :class:`SelfProxyScorer` maps the target's
    own attention statistics layer by layer. ``ProxyScorer(checkpoint, ...)`` and :meth:`from_pretrained` return the
    one the checkpoint's proxy kind needs; :meth:`settings` names ``ProxyScorer`` for both.

    On CUDA, and on CPUs with native bfloat16 arithmetic (AVX512-BF16 or AMX), the mapper runs under bfloat16
    autocast (``mapper_autocast``, :func:`bfloat16_is_fast`); its logits come back in float32.

    Attributes:
        checkpoint: a loaded :class:`~proxykv_hf.mapper.checkpoint.Checkpoint` (may be given by position).
        proxy_model: the proxy model for kind ``"model"`` checkpoints (:meth:`from_pretrained` loads it).
        proxy_device: where the proxy and mapper run (e.g. ``"cuda:1"``); default: the target's device.
        chunk_size: queries per chunk in the attention accumulation (PyTorch path).
        n_sink: first tokens always kept (the KVzip teacher protects its sinks the same way).
        mapper_autocast: run the mapper under bfloat16 autocast where :func:`bfloat16_is_fast`.
        overlap: let the target finish its whole prefill while the proxy still runs, and compact all layers at the
            end (the target's full K/V is then held until the end of the prefill, a higher peak memory). None
            (default): only when the proxy runs on another device than the target. With ``False`` the first
            compacted layer's stream waits on the proxy's event and every layer is compacted as soon as its
            attention has run. A self proxy has no side work to overlap.
        fused: how a ``"self"`` proxy's statistics come with the attention (the cache's own
            :class:`~proxykv_hf.attention.statistics.FusedStatistics` is used where the cache computes them).
        compile_mapper: compile the mapper's time encoder with ``torch.compile`` (its forward, in place on the
            checkpoint's mapper, so every scorer sharing that checkpoint runs it compiled; the weights and the state
            dict stay as they are). On a GPU it fuses the encoder's element-wise work (docs/performance.md); the
            first calls pay the compilation (seconds to a minute), so it pays for long-running processes.
        needs_input_ids: the proxy reads the prompt's token ids (all but a self proxy; set by the subclass).
        statistics: the statistics a self proxy reads from the target's attention (set by the subclass).
    """

    checkpoint: Checkpoint = field(kw_only=False, repr=False)
    proxy_model: torch.nn.Module | None = field(default=None, repr=False)
    proxy_device: torch.device | str | None = None
    chunk_size: int = CHUNK_SIZE
    n_sink: int = 4
    mapper_autocast: bool = True
    overlap: bool | None = None
    fused: FusedStatistics | None = field(default=None, repr=False, compare=False)
    compile_mapper: bool = field(default=False, compare=False)  # how fast it scores, not what: not a setting
    needs_input_ids: bool = field(init=False)
    statistics: tuple[str, ...] = field(init=False)
    _padded: bool = field(default=True, init=False, repr=False, compare=False)  # the prompt has padding

    def __new__(cls, *args, **kwargs):
        """``ProxyScorer(checkpoint, ...)``: the subclass of the checkpoint's proxy kind."""
        if cls is ProxyScorer:
            checkpoint = args[0] if args else kwargs.get("checkpoint")
            kind = getattr(getattr(checkpoint, "proxy", None), "kind", None)
            cls = SelfProxyScorer if kind == "self" else SeparateProxyScorer
        return super().__new__(cls)

    def __post_init__(self):
        if not isinstance(self.compile_mapper, bool):
            raise ValueError(f"compile_mapper must be a bool, got {self.compile_mapper!r}")
        self._check_checkpoint()
        self.proxy_device = None if self.proxy_device is None else torch.device(self.proxy_device)
        self.fused = self.fused or FusedStatistics()
        for encoder in (m.time_encoder for m in self.checkpoint.mappers if self.compile_mapper):
            if not hasattr(encoder.forward, "_torchdynamo_orig_callable"):
                encoder.forward = torch.compile(encoder.forward)

    def _check_checkpoint(self) -> None:
        """Refuse a checkpoint of another proxy kind; set what the kind decides (``needs_input_ids``, ...)."""
        raise NotImplementedError(f"{type(self).__name__}._check_checkpoint")

    @classmethod
    def settings_class(cls) -> str:
        return f"{__name__}.ProxyScorer"  # both kinds, as saved contexts and context store keys have it

    @classmethod
    def from_pretrained(cls, name_or_path, *, proxy=None, proxy_device=None, revision: str | None = None,
                        cache_dir=None, token=None, local_files_only: bool | None = None, **kwargs) -> "ProxyScorer":
        """The scorer of a trained mapper checkpoint: a local directory, a Hub repository id, or a
        :class:`~proxykv_hf.mapper.checkpoint.Checkpoint` already in memory (used as it is, moved to ``proxy_device`` if
        given).

        Args:
            name_or_path: checkpoint directory or Hub id (``huggingface_hub``; ``HF_HUB_OFFLINE`` honoured), or a
                :class:`~proxykv_hf.mapper.checkpoint.Checkpoint`.
            proxy: an already loaded proxy model for checkpoints whose proxy is a separate model (else it is loaded
                from the id the checkpoint names).
            proxy_device: device for the proxy and the mapper (e.g. ``"cuda:1"``); default: the target's.
            revision, cache_dir, token, local_files_only: passed to ``huggingface_hub.snapshot_download``.
            **kwargs: the constructor's options (``chunk_size``, ``overlap``, ``mapper_autocast``, ...).
        """
        from ..mapper.checkpoint import Checkpoint
        from ..mapper.hub import load_checkpoint

        if isinstance(name_or_path, Checkpoint):
            ckpt = name_or_path if proxy_device is None else name_or_path.to(proxy_device)
        else:
            ckpt = load_checkpoint(name_or_path, map_location=proxy_device or "cpu", revision=revision,
                                   cache_dir=cache_dir, token=token, local_files_only=local_files_only)
        if proxy is not None and ckpt.proxy.kind != "model":
            raise ValueError(f"proxy= was given, but the checkpoint {_name(name_or_path)} reads the target's own "
                             f"attention (proxy kind {ckpt.proxy.kind!r}) and uses no separate proxy model: leave "
                             "proxy= out")
        if ckpt.proxy.kind == "model" and proxy is None:
            from ..models.loading import load_model

            proxy = load_model(ckpt.proxy.model_id, device=proxy_device or "cpu")
        if proxy is not None and ckpt.proxy.kind == "model":
            got = getattr(proxy.config, "num_attention_heads", None)
            layers = proxy.config.num_hidden_layers
            if (layers, got) != (ckpt.proxy.num_layers, ckpt.proxy.num_heads):
                raise ValueError(f"proxy has {layers} layers and {got} heads, the mapper expects "
                                 f"{ckpt.proxy.num_layers} layers and {ckpt.proxy.num_heads} heads")
        return cls(ckpt, proxy_model=proxy, proxy_device=proxy_device, **kwargs)

    @property
    def spec(self):
        """The checkpoint's :class:`~proxykv_hf.mapper.proxy.ProxySpec`: what the mapper reads."""
        return self.checkpoint.proxy

    @property
    def mapper(self):
        """The checkpoint's (first) mapper; a checkpoint of several mappers scores some layers with others
        (:meth:`~proxykv_hf.mapper.checkpoint.Checkpoint.mapper_for`)."""
        return self.checkpoint.mapper

    def _fresh_state(self) -> dict:
        """The state of a prompt being scored, as before any prompt (by attribute name)."""
        return {}

    def fresh(self) -> "ProxyScorer":
        clone = copy.copy(self)
        clone.__dict__.update(self._fresh_state())
        return clone

    def __getstate__(self) -> dict:
        """Pickled without the state of a prompt being scored (side-stream handles, features, scores)."""
        return {**self.__dict__, **self._fresh_state()}

    def settings(self) -> dict:
        """The base settings (``n_sink``, ``chunk_size``, ...) and the checkpoint's: proxy, target, mapper config,
        the mapper of each layer and a digest of every mapper's weights, so that two different mappers never share a
        saved context's key."""
        ckpt = self.checkpoint
        out = super().settings()
        out["checkpoint"] = {"proxy": ckpt.proxy.to_dict(), "target": ckpt.target.to_dict(),
                             "mapper": ckpt.mapper.config.to_dict(), "layer_mappers": ckpt.layer_mappers,
                             "weights": weights_digest(ckpt.mappers)}
        if ckpt.global_quantiles is not None:  # what the global budget keeps depends on it
            out["checkpoint"]["global_quantiles"] = digest(table_as_list(ckpt.global_quantiles))
        return out  # a separate proxy model is in the base settings: its name and a digest of its weights

    @property
    def default_budget(self) -> str:  # global where the checkpoint's quantile table makes heads comparable
        return "uniform" if self.checkpoint.global_quantiles is None else "global"

    def global_scores(self, scores: dict[int, torch.Tensor], valid: torch.Tensor) -> dict[int, torch.Tensor]:
        """Comparable across layers and heads through the checkpoint's quantile table
        (:meth:`~proxykv_hf.mapper.checkpoint.Checkpoint.global_scores`)."""
        return self.checkpoint.global_scores(scores, valid)

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write the mapper checkpoint this scorer scores with (all its mappers, where its layers are scored by
        several) to ``directory``, so that :meth:`from_pretrained` on it scores the same way. The options a
        checkpoint does not hold (``n_sink``, ``chunk_size``, ``mapper_autocast``, ``proxy_device``, the proxy model
        itself) are passed to ``from_pretrained`` again.

        Returns:
            the directory.
        """
        from ..mapper.checkpoint import save_checkpoint

        return save_checkpoint(self.checkpoint, directory)

    def push_to_hub(self, repo_id: str, *, private: bool = False, token=None,
                    commit_message: str = "Upload ProxyKV mapper") -> str:
        """Upload the mapper checkpoint to the Hub repository ``repo_id`` (created if needed), as
        :meth:`save_pretrained` writes it; returns the commit URL."""
        from ..mapper.hub import push_to_hub

        return push_to_hub(self.checkpoint, repo_id, private=private, token=token, commit_message=commit_message)

    def _check(self, prompt: Prompt) -> None:
        model = prompt.model
        self.checkpoint.check_target(model.config)
        if self.proxy_model is not None:
            got, want = self.proxy_model.config.vocab_size, model.config.vocab_size
            # embedding tables may be padded differently within a family; the prompt's ids must fit the proxy's
            top = -1 if got >= want else int(prompt.input_ids.max())
            if top >= got:
                raise ValueError(f"proxy and target must share a tokenizer: token id {top} is outside the proxy's "
                                 f"vocabulary ({got} rows; the target has {want})")

    def _start(self, prompt: Prompt) -> None:
        """What :meth:`prepare` does first for either kind: check the prompt, forget the previous one's state."""
        self._check(prompt)
        self.__dict__.update(self._fresh_state())
        # no mask for an unpadded prompt: the proxy's attention stays causal-only (fused attention sums) and the
        # mapper's encoder runs without a padding mask (flash attention); a self proxy's mapper reads this per layer
        self._padded = not bool(prompt.valid.all())

    def _map(self, fn, device: torch.device) -> torch.Tensor:
        on = self.mapper_autocast and bfloat16_is_fast(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=on):
            return fn().float()

    def features(self, runner, ids, mask) -> torch.Tensor:
        """The proxy features this scorer's mapper reads: ``runner`` (its layers) on the prompt, its statistics."""
        raise NotImplementedError(f"{type(self).__name__}.features")


@dataclass(kw_only=True)
class SeparateProxyScorer(ProxyScorer):
    """ProxyKV with a proxy that runs as a forward of its own: a separate small model (kind ``"model"``,
    ``proxy_model``) or a subset of the target's layers (``"layers"``).

    On the target's first prefill, :meth:`prepare` runs the proxy and the mapper; on CUDA they run on a side stream
    (or on ``proxy_device``) while the target prefills. The cache compacts each layer as soon as the scores are in
    (:meth:`ready` polls the side stream's event without blocking); layers prefilled before that are compacted
    together at the end of the prefill, after the target's stream waits on the event (never a device-wide sync).
    Options: :class:`ProxyScorer`'s.
    """

    _same_device: bool = field(default=True, init=False, repr=False, compare=False)
    _scores: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)  # (B, L_l, H_l, T)
    _event: object = field(default=None, init=False, repr=False, compare=False)
    _future: Future | None = field(default=None, init=False, repr=False, compare=False)  # the side work's launches
    _error: BaseException | None = field(default=None, init=False, repr=False, compare=False)

    def _check_checkpoint(self) -> None:
        if self.spec.kind == "self":
            raise ValueError("SeparateProxyScorer runs a proxy of its own, but this checkpoint's proxy kind is "
                             "'self' (the target's own attention): use SelfProxyScorer, or ProxyScorer(checkpoint)")
        if self.spec.kind == "model" and self.proxy_model is None:
            raise ValueError("this checkpoint needs its proxy model; pass proxy=... or let from_pretrained load it")
        self.needs_input_ids, self.statistics = True, ()

    def _fresh_state(self) -> dict:
        return {"_scores": None, "_event": None, "_future": None, "_error": None}

    def prepare(self, prompt: Prompt) -> None:
        self._start(prompt)
        runner = self.proxy_model if self.spec.kind == "model" else prompt.model
        device = self.proxy_device or prompt.input_ids.device
        self._same_device = _same_device(device, prompt.input_ids.device)
        ids = prompt.input_ids.to(device, non_blocking=True)
        mask = prompt.valid.to(device, non_blocking=True).long() if self._padded else None
        self.checkpoint.to(device)
        if device.type != "cuda":
            self._scores = self._run(runner, ids, mask)
            return
        # On CUDA the proxy and mapper are launched from a worker thread onto a side stream, so that the target's
        # prefill is launched at once on its own stream, and a host sync inside the proxy (e.g. a mask check in
        # transformers) blocks only the worker. The worker lives as long as the process (:func:`side_worker`).
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # the prompt tensors were made there
        self._event = torch.cuda.Event()

        def work():
            try:
                with torch.cuda.device(device), torch.cuda.stream(stream):
                    self._scores = self._run(runner, ids, mask)
                    self._event.record(stream)
            except BaseException as exc:  # re-raised on the caller's thread by score()
                self._error = exc

        self._future = side_worker().submit(work)

    def ready(self) -> bool:
        overlap = not self._same_device if self.overlap is None else self.overlap
        if not overlap:
            return True  # score() now: the target's stream waits on the proxy's event (the host does not)
        if self._future is not None and not self._future.done():
            return False
        return self._event is None or self._error is not None or self._event.query()

    def _wait(self, device: torch.device) -> None:
        """Make ``device``'s current stream wait for the side work (the host only waits for the launches)."""
        if self._future is not None:
            self._future.result()  # ``work`` keeps its own exception
            self._future = None
            if self._error is not None:
                raise RuntimeError("the ProxyKV proxy failed on its side stream") from self._error
            torch.cuda.current_stream(device).wait_event(self._event)
            if self._scores.device == device:  # read on this stream from now on: keep the allocator from reusing it
                self._scores.record_stream(torch.cuda.current_stream(device))

    @torch.no_grad()
    def features(self, runner, ids, mask) -> torch.Tensor:
        return proxy_features(runner, ids, mask, layers=self.spec.layers, chunk_size=self.chunk_size,
                              statistics=self.spec.statistics, fused=self.fused)

    @torch.no_grad()
    def _run(self, runner, ids, mask) -> torch.Tensor:
        x = self.features(runner, ids, mask)
        return self._map(lambda: self.checkpoint.map_features(x, mask), ids.device)  # (B, L_l, H_l, N)

    @torch.no_grad()
    def score(self, inputs: LayerInputs) -> torch.Tensor:
        device = inputs.keys.device
        self._wait(device)
        scores = self._scores[:, inputs.compact_index].to(device, non_blocking=True)
        if inputs.compact_index == self.checkpoint.target.num_layers - 1:
            self._scores, self._event = None, None  # free once the last layer has its scores
        return scores


@dataclass(kw_only=True)
class SelfProxyScorer(ProxyScorer):
    """ProxyKV with a ``"self"`` proxy: the target's own prefill attention statistics, on the layers its mapper reads
    (``ProxySpec.layers``), mapped layer by layer as the prefill reaches each layer. There is no forward of its own
    and no side work (:meth:`ready` is always True); the cache may compute the statistics in the attention's own
    pass. Options: :class:`ProxyScorer`'s (``proxy_model`` must be None).
    """

    # the compacted layers whose statistics the mapper reads -> their proxy layer index
    _proxy_of: dict[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    _features: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)
    # (mapper, proxy layer, the layer's encoding by it), shared by the target layers paired with that layer
    _encoded: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def _check_checkpoint(self) -> None:
        if self.spec.kind != "self":
            raise ValueError(f"SelfProxyScorer reads the target's own attention, but this checkpoint's proxy kind is "
                             f"{self.spec.kind!r}: use SeparateProxyScorer, or ProxyScorer(checkpoint)")
        if self.proxy_model is not None:
            raise ValueError("a 'self' proxy checkpoint reads the target's own attention and runs no proxy model; "
                             f"got proxy_model={type(self.proxy_model).__name__}: leave it out")
        self.needs_input_ids, self.statistics = False, tuple(self.spec.statistics)
        layers = check_self_layers(self.spec.layers, self.checkpoint.target.num_layers)
        self._proxy_of = {l: p for p, l in enumerate(layers)}

    def _fresh_state(self) -> dict:
        return {"_features": {}, "_encoded": None}

    def statistics_for(self, compact_index: int) -> tuple[str, ...]:
        """The statistics read from one compacted layer's attention: those the mapper reads, on the layers it
        reads (``ProxySpec.layers``); none elsewhere (those layers run the model's own attention)."""
        return self.statistics if compact_index in self._proxy_of else ()

    def prepare(self, prompt: Prompt) -> None:
        self._start(prompt)

    @torch.no_grad()
    def features(self, runner, ids, mask) -> torch.Tensor:
        """The statistics of the target's layers that the mapper reads (``runner`` being the target)."""
        full = full_attention_layers(runner)
        return proxy_features(runner, ids, mask, chunk_size=self.chunk_size, statistics=self.spec.statistics,
                              fused=self.fused, statistics_layers=[full[l] for l in self._proxy_of])

    @torch.no_grad()
    def score(self, inputs: LayerInputs) -> torch.Tensor:
        device = inputs.keys.device
        layer = inputs.compact_index
        if layer in self._proxy_of:
            x = inputs.statistics  # (B, S * H, T), computed in the attention's own pass, or here:
            if x is None:
                x = attention_sums(inputs.queries, inputs.keys, inputs.attention_mask, inputs.scaling,
                                   query_valid=inputs.query_valid.to(device),
                                   chunk_size=self.chunk_size, statistics=self.spec.statistics)
            self._features[self._proxy_of[layer]] = x
        self.checkpoint.to(device)
        mask = inputs.valid.to(device).long() if self._padded else None
        return self._map(lambda: self._self_scores(layer, mask), device)

    def _self_scores(self, layer: int, mask: torch.Tensor) -> torch.Tensor:
        """A self proxy's scores of compacted layer ``layer`` from the features of the proxy layer paired with it
        and, through the direct path, of the ones before it (``MapperConfig.direct_context``); the encoding of a
        proxy layer serves every target layer paired with it (and scored by the same mapper,
        :meth:`~proxykv_hf.mapper.checkpoint.Checkpoint.mapper_for`). Drops the features no later layer reads."""
        mapper = self.checkpoint.mapper_for(layer)
        paired, *earlier = mapper.direct_layers(layer) if mapper.direct is not None else [mapper.pairing()[layer]]
        missing = [q for q in (paired, *earlier) if q not in self._features]
        if missing:
            raise RuntimeError(f"layer {layer}'s mapper reads the statistics of proxy layers {[paired, *earlier]}, "
                               f"but {missing} were not scored before it in this prefill (layers must come in order, "
                               "one prompt at a time; start each prompt on a fresh or reset cache)")
        x = self._features[paired]
        if self._encoded is None or self._encoded[:2] != (mapper, paired):
            self._encoded = (mapper, paired, mapper.encode(x, mask))
        scores = mapper.forward_layer(x, layer, mask, earlier=[self._features[q] for q in earlier],
                                      encoded=self._encoded[2])
        for q in [q for q in self._features if q < paired - mapper.config.direct_context]:
            del self._features[q]  # later layers read this proxy layer or later ones, and as far back as this one
        return scores


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are the same device when device 0 is the current one."""
    index = lambda d: d.index if d.index is not None or d.type != "cuda" else torch.cuda.current_device()  # noqa
    return a.type == b.type and index(a) == index(b)


def _name(name_or_path) -> str:
    """How an error names a checkpoint: its path or id, quoted; one in memory by what it holds."""
    return "in memory" if not isinstance(name_or_path, (str, os.PathLike)) else repr(str(name_or_path))
