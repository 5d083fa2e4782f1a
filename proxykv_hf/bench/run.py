"""Time to first token, peak memory and decode speed per method and context length.

``proxykv bench`` prints a table, a plot of TTFT and peak memory vs context length, and ends with one JSON line.
TTFT is prefill + scoring + compaction (one forward over the prompt with the method's cache), the median of
``repeats`` runs after a warm-up, the methods timed in turn (full, then each method, then full again...) so that a
drift in the machine's speed over the run touches every method alike. On CUDA it is timed with events; on CPU with
``perf_counter``. Peak memory is the CUDA allocator's peak during the prefill, or on CPU the peak resident set size
sampled every millisecond (``/proc/self/statm``) above the level at entry, after ``malloc_trim``. In one process that
CPU figure depends on what earlier prefills left in the allocator's heap; ``fresh_memory`` measures each point in a new
process instead (``proxykv bench --fresh-memory``; each row's ``peak_measure`` says which). Decode is the mean ms/token
over ``decode_tokens`` greedy steps after compaction; on CUDA the reported figure replays each step as a CUDA graph over
static buffers (``graph.py``: eager decoding is host-bound there, whatever the cache size), and the eager figure is
kept beside it.

Rows also carry their matmul FLOPs by part (``flops.py``) and ``flops_vs_full``: the TTFT ratio one device could
reach were every kernel as efficient as the target's prefill.

On CUDA, decode runs with PyTorch's flash / memory-efficient SDPA backends and not cuDNN's, whose per-call host
time on one-token queries (a new plan for every new key length) makes a large model's decode host-bound
(docs/performance.md).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field

import torch

from ..cache.proxykv_cache import DEFAULT_KEEP_RATIO, ProxyKVCache
from ..attention.compat import with_cache
from ..models.fingerprints import dtype_name
from .flop_model import GATED_MLP_FAMILIES
from ..scorers import registry
from ..cache.selection import BUDGETS, check_keep_ratio, select_topk
from .flops import method_prefill_flops

logger = logging.getLogger(__name__)

@dataclass(kw_only=True)
class BenchConfig:
    """A benchmark run.

    Attributes:
        methods: the methods to time: names of the scorer registry (:mod:`proxykv_hf.scorers.registry`; full is
            always added: the ratios need it).
        context_lengths: prompt lengths in tokens.
        keep_ratio: the budget of the compressing methods.
        repeats: timed runs per point (median reported).
        warmup: untimed runs before the first point.
        decode_tokens: greedy steps timed after compaction (0 = skip).
        decode_graphs: on CUDA, also time decoding as replayed CUDA graphs (the reported decode figure; the
            eager figure is kept as ``decode_eager_ms_per_token``).
        seed: for the random prompts (timing does not depend on the token values).
        budgets: ``"uniform"`` and/or ``"global"`` (``ProxyKVCache(budget=...)``); a method under the global
            budget is reported as ``<method>@global`` (a method may also be named so directly).
        fresh_memory: on the CPU, measure each point's peak prefill memory in a fresh process (after a short
            warm-up prefill of the same method there), so that no method inherits another's heap; CUDA's allocator
            peak needs no such care.
    """

    methods: list[str] = field(default_factory=lambda: ["full", "snapkv", "kvzip", "proxykv"])
    context_lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    keep_ratio: float = DEFAULT_KEEP_RATIO
    repeats: int = 3
    warmup: int = 1
    decode_tokens: int = 128
    decode_graphs: bool = True
    seed: int = 0
    fresh_memory: bool = False
    budgets: list[str] = field(default_factory=lambda: ["uniform"])

    def __post_init__(self):
        if not self.budgets or any(b not in BUDGETS for b in self.budgets):
            raise ValueError(f"budgets must be taken from {BUDGETS}, got {self.budgets!r}")
        bad = [m for m in self.methods if m.partition("@")[0] not in registry.names()
               or m.partition("@")[2] not in ("", *BUDGETS)]
        if bad:
            raise ValueError(f"unknown bench methods {bad}; choose from {', '.join(registry.names())}")
        if "full" not in self.methods:
            self.methods = ["full", *self.methods]  # ratios need the full-cache baseline of the same run
        lengths = self.context_lengths
        if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
            raise ValueError(f"context_lengths must be positive token counts, got {lengths!r}")
        for name, least in (("repeats", 1), ("warmup", 0), ("decode_tokens", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        check_keep_ratio(self.keep_ratio)


def _trim_heap() -> None:
    """glibc ``malloc_trim(0)``: return free heap pages to the OS (no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Peak memory (bytes) above the level at entry: CUDA allocator peak, or sampled RSS on CPU."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _poll(self):
        while not self._stop.is_set():
            self._max = max(self._max, self._rss())
            time.sleep(0.001)

    def __enter__(self):
        # garbage first: a cycle freed during the measured run (a decoder's CUDA graph holding a copied cache) would
        # lower the level the peak is read against
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _trim_heap()  # hand memory freed by earlier runs back to the OS, or the RSS would not grow
            self._base = self._max = self._rss()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self._max, self._rss()) - self._base


def _decode_attention(device: torch.device):
    """SDPA without cuDNN on CUDA (see the module docstring); nothing to choose elsewhere."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def timed(fn, device: torch.device, warmup: int = 0) -> tuple[object, float]:
    """Run ``fn()`` and return (result, seconds), with CUDA events on a GPU; ``warmup`` untimed calls first."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize(device)
        return out, start.elapsed_time(end) / 1000
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


class Bench:
    """Runs a :class:`BenchConfig` for one target (and the scorers built for it)."""

    def __init__(self, model, scorers: dict, config: BenchConfig, *, proxy_runner=None, memory_probe=None):
        """``memory_probe(method, context) -> bytes``: where given, the peak prefill memory of each point comes from
        it (e.g. a fresh process, :func:`proxykv_hf.bench.cli.fresh_memory_probe`) instead of this process."""
        self.model, self.scorers, self.config = model, scorers, config
        self.device = next(model.parameters()).device
        self.proxy_runner = proxy_runner  # the model the ProxyKV features come from, to time its breakdown
        self.memory_probe = memory_probe
        self.vocab = model.config.vocab_size
        if proxy_runner is not None:  # ids every model reads (Qwen2.5-1.5B's table is 128 rows shorter than 7B's)
            self.vocab = min(self.vocab, getattr(getattr(proxy_runner, "config", None), "vocab_size", self.vocab))

    def _prompt(self, n: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.config.seed + n)
        return torch.randint(10, self.vocab - 10, (1, n), generator=gen).to(self.device)

    def labels(self) -> list[str]:
        """The methods to run, each under each budget (``full`` once): ``snapkv``, ``snapkv@global``, ..."""
        cfg = self.config
        return list(dict.fromkeys(m if "@" in m or m == "full" or b == "uniform" else f"{m}@{b}"
                                  for m in cfg.methods for b in cfg.budgets))

    def _cache(self, label: str) -> ProxyKVCache:
        method, _, budget = label.partition("@")
        scorer = self.scorers.get(method)
        scorer = None if scorer is None else scorer.fresh()
        return ProxyKVCache(scorer, self.config.keep_ratio if method != "full" else 1.0, budget=budget or "uniform")

    @torch.no_grad()
    def _prefill(self, method: str, ids: torch.Tensor) -> ProxyKVCache:
        cache = self._cache(method).prepare(self.model, ids)
        self.model(input_ids=ids, **with_cache(cache), use_cache=True, logits_to_keep=1)
        return cache

    @torch.no_grad()
    def peak_once(self, method: str, n: int) -> int:
        """Peak memory (bytes) of one ``n``-token prefill with ``method``, after a short prefill of the same method
        (it loads lazily mapped weights and the method's own first-call allocations): what a fresh process
        reports for ``fresh_memory``."""
        self._prefill(method, self._prompt(min(n, 64)))
        ids = self._prompt(n)
        with PeakMemory(self.device) as mem:
            self._prefill(method, ids)
        return mem.peak

    @torch.no_grad()
    def _decode(self, cache: ProxyKVCache) -> dict:
        """ms/token over ``decode_tokens`` greedy steps: eager (the plain ``transformers`` loop) and, on CUDA with
        ``decode_graphs``, replayed CUDA graphs over static buffers (``graph.StaticDecoder``: the GPU's own time)."""
        steps = self.config.decode_tokens
        tok = torch.full((1, 1), 11, device=self.device)
        pos = cache.get_seq_length()
        out = {}
        if self.device.type == "cuda" and self.config.decode_graphs:
            from .graph import StaticDecoder

            with _decode_attention(self.device):
                dec = StaticDecoder(self.model, cache, tok, steps, graph=True)
                _, seconds = timed(lambda: dec.run(steps), self.device)
            del dec
            out["decode_ms_per_token"] = 1000 * seconds / steps

        def loop():
            nonlocal tok
            for i in range(steps):
                logits = self.model(input_ids=tok, **with_cache(cache), position_ids=torch.tensor(
                    [[pos + i]], device=self.device), use_cache=True).logits
                tok = logits[:, -1:].argmax(-1)

        with _decode_attention(self.device):
            _, seconds = timed(loop, self.device)
        out["decode_eager_ms_per_token"] = 1000 * seconds / steps
        out.setdefault("decode_ms_per_token", out["decode_eager_ms_per_token"])
        return out

    def _flops(self, method: str, n: int) -> dict | None:
        """Matmul FLOPs of one ``n``-token prefill with ``method`` by part (:mod:`proxykv_hf.bench.flop_model`): the
        target's prefill and what the method adds, with ``"total"``; None where the method or the model is not
        counted."""
        if self.model.config.model_type not in GATED_MLP_FAMILIES:
            return None
        try:
            return method_prefill_flops(self.scorers.get(method.partition("@")[0]), self.model, n)
        except ValueError:  # e.g. sliding-window layers under KVzip, or a proxy of another family
            return None

    @torch.no_grad()
    def _breakdown(self, ids: torch.Tensor, full: ProxyKVCache, plain_prefill_s: float) -> dict:
        scorer = self.scorers["proxykv"]
        mapper, kind = scorer.mapper, scorer.spec.kind
        # each part warmed up once on this thread first (cuDNN's attention plans, a compiled mapper's guards)
        x, t_proxy = timed(lambda: scorer.features(self.proxy_runner, ids, torch.ones_like(ids)),
                           self.device, warmup=1)  # what its mapper reads
        if kind == "self":  # features come out of the target's own prefill: only the attention sums are extra
            t_proxy = max(0.0, t_proxy - plain_prefill_s)
        dev = next(mapper.parameters()).device
        # as ProxyScorer runs it on an unpadded prompt: its autocast, no padding mask
        _, t_mapper = timed(lambda: scorer._map(lambda: scorer.checkpoint.map_features(x.to(dev)), dev), self.device,
                            warmup=1)
        scores = torch.rand(1, full.layers[0].keys.shape[1], ids.shape[1], device=self.device)

        def compact():
            for layer in full.layers:
                idx, _ = select_topk(scores, self.config.keep_ratio)
                layer.keys.gather(2, idx[..., None].expand(-1, -1, -1, layer.keys.shape[-1]))
                layer.values.gather(2, idx[..., None].expand(-1, -1, -1, layer.values.shape[-1]))

        _, t_compact = timed(compact, self.device)
        return {"proxy_kind": kind, "proxy_dtype": dtype_name(next(self.proxy_runner.parameters()).dtype),
                "proxy_s": t_proxy, "mapper_s": t_mapper, "compact_s": t_compact}

    def measured(self, done: list[dict]) -> dict[int, dict[str, dict]]:
        """The rows of ``done`` (an earlier run of this setting) at this run's context lengths, by length and method:
        a length may be partly measured (a run stopped between two methods)."""
        found: dict[int, dict[str, dict]] = {n: {} for n in self.config.context_lengths}
        labels = self.labels()
        for r in done:
            if r["context"] in found and r["method"] in labels:
                found[r["context"]][r["method"]] = r
        return found

    def run(self, progress=None, done: list[dict] = (), checkpoint=None) -> list[dict]:
        """One row per (context length, method), lengths in order.

        Args:
            progress: called with each new row.
            done: rows of an earlier run of this setting: the (length, method) points they hold are not measured
                again (their rows are returned as they are).
            checkpoint: called with the rows so far after each method's row (to save a long run as it goes).
        """
        cfg, labels = self.config, self.labels()
        earlier = self.measured(done)
        pending = [n for n in cfg.context_lengths if len(earlier[n]) < len(labels)]
        ids0 = self._prompt(min(pending)) if pending else None
        for _ in range(cfg.warmup if pending else 0):
            for method in labels:
                self._prefill(method, ids0)
        rows: list[dict] = []
        for n in cfg.context_lengths:
            have = earlier[n]
            todo = [m for m in labels if m not in have]
            ids = self._prompt(n) if todo else None
            # timed more than once, the methods take turns (a drift in the machine's speed touches each alike);
            # timed once, each is measured whole and saved before the next (a long point resumes method by method)
            for block in ([todo] if cfg.repeats > 1 else [[m] for m in todo]):
                runs = {method: [] for method in block}
                for _ in range(cfg.repeats):
                    for method in block:
                        _, t = timed(lambda: self._prefill(method, ids), self.device)  # its cache freed at once
                        runs[method].append(t)
                for method in block:
                    have[method] = self._row(n, method, runs[method], ids, have.get("full"))
                    logger.info("bench %s", json.dumps(have[method]))
                    if progress is not None:
                        progress(have[method])
                    if checkpoint is not None:
                        checkpoint(rows + [have[m] for m in labels if m in have])
            rows.extend(have[m] for m in labels)
        return rows

    def _row(self, n: int, method: str, times: list[float], ids, base: dict | None) -> dict:
        """The row of ``method`` at ``n`` tokens from its timed prefills ``times``: one more prefill for its peak
        memory, cache size and decode; ratios to ``base``, the full cache's row (None: this is it)."""
        cfg = self.config
        if self.memory_probe is not None:
            peak, measure = self.memory_probe(method, n), "fresh process, sampled RSS"
            cache = self._prefill(method, ids)  # for its size and the decode
        else:
            with PeakMemory(self.device) as mem:
                cache = self._prefill(method, ids)
            peak = mem.peak
            measure = "CUDA allocator" if self.device.type == "cuda" else "this process, sampled RSS"
        row = {"context": n, "method": method, "keep_ratio": 1.0 if method == "full" else cfg.keep_ratio,
               "ttft_s": statistics.median(times), "ttft_runs_s": times, "peak_prefill_bytes": peak,
               "peak_measure": measure, "kv_bytes": cache.nbytes(), "flops": self._flops(method, n)}
        if cfg.decode_tokens:
            row.update(self._decode(cache))
        if method == "full":
            base = row
            if self.proxy_runner is not None and "proxykv" in cfg.methods:
                base["breakdown"] = self._breakdown(ids, cache if cfg.decode_tokens == 0 else
                                                    self._prefill("full", ids), row["ttft_s"])
        row["ttft_vs_full"] = row["ttft_s"] / base["ttft_s"]
        row["peak_vs_full"] = row["peak_prefill_bytes"] / max(1, base["peak_prefill_bytes"])
        if row["flops"] is not None and base["flops"] is not None:
            row["flops_vs_full"] = row["flops"]["total"] / base["flops"]["total"]
        if "decode_ms_per_token" in row:
            row["decode_vs_full"] = row["decode_ms_per_token"] / base["decode_ms_per_token"]
            row["decode_eager_vs_full"] = row["decode_eager_ms_per_token"] / base["decode_eager_ms_per_token"]
        if method == "proxykv" and "breakdown" in base:
            b = dict(base["breakdown"])
            side = b["proxy_s"] + b["mapper_s"]
            extra = row["ttft_s"] - base["ttft_s"] - b["compact_s"]
            b["target_prefill_s"] = base["ttft_s"]
            # a self proxy scores inside the target's prefill: on the critical path by design
            b["overlap_fraction"] = 0.0 if b["proxy_kind"] == "self" else \
                max(0.0, min(1.0, 1 - extra / side)) if side > 0 else 1.0
            row["breakdown"] = b
        return row


def table(rows: list[dict]) -> str:
    """A markdown table of the rows (times in ms, memory in MiB)."""
    lines = ["| context | method | TTFT ms | TTFT / full | FLOPs / full | peak prefill MiB | peak / full | KV MiB |"
             " decode ms/tok | decode / full | eager decode ms/tok |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        flops = f"{r['flops_vs_full']:.2f}" if "flops_vs_full" in r else "-"
        lines.append(
            f"| {r['context']} | {r['method']} | {1000 * r['ttft_s']:.0f} | {r['ttft_vs_full']:.2f} | {flops} | "
            f"{r['peak_prefill_bytes'] / 2**20:.1f} | {r['peak_vs_full']:.2f} | {r['kv_bytes'] / 2**20:.1f} | "
            f"{r.get('decode_ms_per_token', float('nan')):.1f} | {r.get('decode_vs_full', float('nan')):.2f} | "
            f"{r.get('decode_eager_ms_per_token', float('nan')):.1f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path) -> None:
    """TTFT and peak prefill memory vs context length, one line per method; where rows carry FLOP counts, a third
    panel sets each method's TTFT ratio against its FLOP ratio (the floor one device could reach)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counted = [r for r in rows if "flops_vs_full" in r and r["method"] != "full"]
    fig, axes = plt.subplots(1, 3 if counted else 2, figsize=(15 if counted else 10, 3.6))
    a, b = axes[:2]
    for i, method in enumerate(dict.fromkeys(r["method"] for r in rows)):
        rs = [r for r in rows if r["method"] == method]
        n = [r["context"] for r in rs]
        a.plot(n, [r["ttft_s"] for r in rs], marker="o", label=method, color=f"C{i}")
        b.plot(n, [r["peak_prefill_bytes"] / 2**20 for r in rs], marker="o", label=method, color=f"C{i}")
        if counted and method != "full":
            axes[2].plot(n, [r["ttft_vs_full"] for r in rs], marker="o", color=f"C{i}", label=f"{method} TTFT")
            floor = [(r["context"], r["flops_vs_full"]) for r in rs if "flops_vs_full" in r]
            if floor:
                axes[2].plot(*zip(*floor), ls="--", marker="x", color=f"C{i}", label=f"{method} FLOPs")
    a.set(xlabel="context tokens", ylabel="time to first token (s)", xscale="log", yscale="log")
    b.set(xlabel="context tokens", ylabel="peak prefill memory (MiB)", xscale="log")
    a.legend(fontsize=8)
    if counted:
        axes[2].axhline(1.0, color="C0", lw=0.8)
        axes[2].set(xlabel="context tokens", ylabel="ratio to the full cache's prefill", xscale="log")
        axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary_json(rows: list[dict], config: BenchConfig, env: dict) -> str:
    return json.dumps({"config": asdict(config), "env": env, "rows": rows})
