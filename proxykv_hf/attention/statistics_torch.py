"""The chunked PyTorch path of :mod:`proxykv_hf.attention.statistics`: the reference for every statistic, and the path
off the GPU.

Each query chunk's logits go into one reused buffer and are softmaxed in place; the chunk's probabilities are summed
(and maxed) into per-key totals, the attention output taken from them when values are given, and the query-side
"lookback" statistic read from them last. Memory is ``O(B * H * chunk * T)``, on a CPU ``O(B * H / H_kv * chunk *
T)`` per thread: one KV head's query heads at a time (:func:`_kv_heads_per_pass`), the chunks shared out between
single-threaded workers (:func:`_cpu_workers`). Why these choices: docs/performance.md, "How the CPU path runs".

:mod:`proxykv_hf.attention.statistics` validates the arguments, picks this path or the fused kernels, and reduces the
query heads; :func:`_torch_statistics` is the entry point it calls.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

# the "lookback" statistic: keys at least this many positions before the query, past the row's first sink tokens
LOOKBACK_GAP = 8
LOOKBACK_SINKS = 4


def _torch_statistics(query, key, attention_mask, scaling, query_valid, chunk_size, statistics, value=None):
    """The chunked PyTorch path: ``({statistic: (B, H_kv, G, T)}, attention output (B, H, Q, D) or None)``.

    With ``value`` the attention output is computed from the same probabilities, before any query weighting. On a
    CPU with more than one torch thread and enough work, the query chunks are shared out between single-threaded
    workers (:func:`_cpu_workers`), each with its own buffer and sums: no chunk's probabilities pass from one core to
    another. Each worker takes the next chunk as it finishes one, longest chunks first, so a core that is slowed
    (another process, the host of a virtual machine) takes fewer; which worker sums which chunk then changes from
    one call to the next, so the workers sum in float64, and the sums they return, added up and rounded to float32,
    come out the same in any split (up to float64 rounding, far below float32's).
    """
    # no autograd whatever the caller's grad mode: the buffers are written in place, and the CPU workers are threads
    # of their own (grad mode is per thread), so they must not see tensors that require grad
    query, key = query.detach(), key.detach()
    value = None if value is None else value.detach()
    Q = query.shape[2]
    if query_valid is not None and query.device.type == "cpu" and bool(query_valid.all()):
        query_valid = None  # nothing to weight (off the GPU the check costs no device sync)
    chunked = _Chunks(query, key, attention_mask, scaling, query_valid, chunk_size, statistics, value)
    starts = list(range(0, Q, chunk_size))
    workers = _cpu_workers(query, key, value, len(starts))
    if workers == 1:
        out, peak = chunked.run(starts)
    else:
        threads = torch.get_num_threads()
        queue = _ChunkQueue(starts[::-1])  # causal: the last chunks read the most keys
        try:
            parts = list(_worker_pool(workers).map(chunked.run_single_threaded, [queue] * workers))
        finally:
            torch.set_num_threads(threads)  # the workers set the process-wide count to 1 while they ran
        out = torch.stack([p[0] for p in parts]).sum(0).float()
        peak = None if parts[0][1] is None else torch.stack([p[1] for p in parts]).amax(0)
    found = {"sum": out, "max": peak, "lookback": chunked.lookback}
    output = None if chunked.attended is None else chunked.attended.view(query.shape[:3] + (-1,))
    return found, output


class _ChunkQueue:
    """The chunk starts of one pass, shared by its workers: each iterator over it yields the next start no worker
    has taken."""

    def __init__(self, starts: list[int]):
        self.starts, self.taken, self.lock = starts, 0, threading.Lock()

    def __iter__(self):
        while True:
            with self.lock:
                if self.taken == len(self.starts):
                    return
                start = self.starts[self.taken]
                self.taken += 1
            yield start


# query-key pairs below which the CPU path stays on one thread (the workers' start-up would cost more than they save)
THREADED_MIN_PAIRS = 1 << 20
_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}  # (process id, workers): a forked child makes its own


def _cpu_workers(query, key, value, num_chunks: int) -> int:
    """How many threads share a CPU pass's query chunks: torch's thread count where the pass is on the CPU, has at
    least one chunk per thread and :data:`THREADED_MIN_PAIRS` query-key pairs, and needs no gradient; else 1.

    Why threads of their own: torch's intra-op threads split each chunk's matmuls, softmax and reductions along
    different axes, so each core reads probabilities the other wrote. On a 2-core KVM guest that traffic made the
    pass swing between 1.3x and 2x sdpa's time from one second to the next; single-threaded workers on whole chunks
    keep each chunk in one core's caches and stay near the faster figure (docs/performance.md, "How the CPU path
    runs"). Only under OpenMP, the backend of the PyTorch wheels, where each thread keeps its own thread count."""
    threads = torch.get_num_threads()
    if query.device.type != "cpu" or threads < 2 or num_chunks < threads or not _openmp():
        return 1
    if query.shape[2] * key.shape[2] < THREADED_MIN_PAIRS:
        return 1
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value)):
        return 1
    return threads


@functools.cache
def _openmp() -> bool:
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def _worker_pool(workers: int) -> ThreadPoolExecutor:
    key = (os.getpid(), workers)
    if key not in _POOLS:
        _POOLS[key] = ThreadPoolExecutor(workers, thread_name_prefix="proxykv-statistics")
    return _POOLS[key]


class _Chunks:
    """One chunked pass over a layer's queries: what every chunk reads, and the per-query results the chunks write
    to disjoint slices of (``attended``, ``lookback``). :meth:`run` returns the per-key sums and maxima of the chunks
    it is given."""

    def __init__(self, query, key, attention_mask, scaling, query_valid, chunk_size, statistics, value):
        B, H, Q, D = query.shape
        _, H_kv, T, _ = key.shape
        self.query, self.attention_mask, self.scaling, self.query_valid = query, attention_mask, scaling, query_valid
        self.chunk_size, self.statistics, self.G = chunk_size, statistics, H // H_kv
        self.k_t = key.float().transpose(-1, -2)  # (B, H_kv, D, T)
        self.v = None if value is None else value.float()
        self.lookback = query.new_zeros(B, H_kv, self.G, T, dtype=torch.float32) if "lookback" in statistics else None
        first = _first_lookback_key(attention_mask, query_valid, Q, T, query.device) if self.lookback is not None \
            else None
        self.first_rows = None if first is None else first.expand(B).tolist()  # once, not per chunk
        self.near_masks: dict[tuple[int, int, int], torch.Tensor] = {}
        self.attended = None if value is None else torch.empty(B, H_kv, self.G, Q, value.shape[-1], dtype=query.dtype,
                                                               device=query.device)
        self.causal = _hides_future(attention_mask, Q, T)  # then skip the keys after each chunk's last query
        self.plain = attention_mask is None and T >= Q  # causal, no padding: each chunk's diagonal block is masked
        self.per_pass = _kv_heads_per_pass(query.device, H_kv)

    def _near(self, offset: int, C: int, width: int) -> torch.Tensor:
        """`(C, width)` bool: True where key ``j`` of a band that begins ``offset`` positions before the chunk's first
        query lies less than :data:`LOOKBACK_GAP` positions before query ``i`` (or after it). Made once per shape:
        the full chunks of a causal pass share one."""
        if (offset, C, width) not in self.near_masks:
            keys = torch.arange(width, device=self.query.device) - offset
            self.near_masks[offset, C, width] = keys[None, :] > torch.arange(C, device=self.query.device)[:, None] \
                - LOOKBACK_GAP
        return self.near_masks[offset, C, width]

    def _lookback(self, probs: torch.Tensor, d0: int) -> torch.Tensor:
        """Per query of a chunk, the largest probability on a key at least :data:`LOOKBACK_GAP` positions back and at
        or after its row's first lookback key: ``probs`` `(B, H_kv, G, C, t)` with the chunk's first query at key
        position ``d0`` -> `(B, H_kv, G, C)`. Overwrites with zeros the probabilities of the keys closer than the gap
        (:meth:`_near`), so that one pass over each row finds the maximum: the chunk's last reader calls it."""
        C, t = probs.shape[3], probs.shape[4]
        far = min(max(d0 - LOOKBACK_GAP + 1, 0), t)  # keys before `far` are far enough back for every chunk query
        if far < t:
            probs[..., far:].masked_fill_(self._near(d0 - far, C, t - far), 0.0)
        found = probs.new_zeros(probs.shape[:4])
        for b, lo in enumerate(self.first_rows):
            if lo < t:
                torch.amax(probs[b, ..., lo:], dim=-1, out=found[b])
        return found

    def run_single_threaded(self, starts: Iterable[int]):
        torch.set_num_threads(1)  # this worker's own thread count (and, for a while, the process's: see the caller)
        return self.run(starts, torch.float64)

    def run(self, starts: Iterable[int], sum_dtype: torch.dtype = torch.float32):
        """``(sum, max or None)``, each `(B, H_kv, G, T)`, over the chunks that begin at ``starts``; the sums
        accumulated in ``sum_dtype``."""
        query, statistics, G = self.query, self.statistics, self.G
        B, H, Q, D = query.shape
        H_kv, T = self.k_t.shape[1], self.k_t.shape[-1]
        out = torch.zeros(B, H_kv, G, T, dtype=sum_dtype, device=query.device)
        peak = torch.zeros(B, H_kv, G, T, dtype=torch.float32, device=query.device) if "max" in statistics else None
        size = min(self.chunk_size, Q)
        # one buffer for every chunk's logits, softmaxed in place: no fresh chunk-sized allocation (and page faults)
        # per chunk, and no second chunk-sized tensor for the probabilities
        scratch = torch.empty(B * self.per_pass * G * size * T, dtype=torch.float32, device=query.device)
        for q0 in starts:
            q1 = min(q0 + self.chunk_size, Q)
            t_end = min(T, q1 + T - Q) if self.causal else T
            d0 = q0 + T - Q  # key position of the chunk's first query
            C = q1 - q0
            if self.plain:  # what each chunk hides: the future inside its diagonal block, or the mask's own bias
                future = torch.ones(C, C, dtype=torch.bool, device=query.device).triu_(1)  # (C, C)
            else:
                bias = _chunk_bias(self.attention_mask, q0, q1, Q, T, query.device, t_end)[:, :, None]
            for h0 in range(0, H_kv, self.per_pass):
                h1 = min(h0 + self.per_pass, H_kv)
                heads, n = slice(h0, h1), h1 - h0
                q = query[:, h0 * G:h1 * G, q0:q1].float().mul(self.scaling).reshape(B, n, G * C, D)
                logits = scratch[: B * n * G * C * t_end].view(B, n, G * C, t_end)
                torch.matmul(q, self.k_t[:, heads, :, :t_end], out=logits)
                logits = logits.view(B, n, G, C, t_end)
                if self.plain:
                    logits[..., d0:t_end].masked_fill_(future, float("-inf"))
                    probs = torch.ops.aten._softmax.out(logits, -1, False, out=logits)  # every row sees its own key
                else:
                    logits.add_(bias)  # broadcast over (n, G)
                    probs = torch.ops.aten._softmax.out(logits, -1, False, out=logits).nan_to_num_(0.0)  # masked: 0
                if self.v is not None:
                    rows = torch.matmul(probs.view(B, n, G * C, t_end), self.v[:, heads, :t_end])  # (B, n, G*C, Dv)
                    self.attended[:, heads, :, q0:q1] = rows.view(B, n, G, C, -1)
                if self.query_valid is not None:
                    probs.mul_(self.query_valid[:, None, None, q0:q1, None].to(probs.dtype))
                out[:, heads, :, :t_end] += probs.sum(dim=3)
                if peak is not None:
                    if T >= Q:  # the query's own key is on the diagonal of the block at d0
                        probs[..., d0:d0 + C].diagonal(dim1=-2, dim2=-1).zero_()
                    else:
                        own = torch.arange(t_end, device=query.device)[None, :] == (
                            torch.arange(q0, q1, device=query.device) + (T - Q))[:, None]  # (C, t_end)
                        probs.masked_fill_(own, 0.0)
                    window = peak[:, heads, :, :t_end]
                    torch.maximum(window, probs.amax(dim=3), out=window)
                if self.lookback is not None:  # last: it zeroes the probabilities of keys near each query
                    self.lookback[:, heads, :, d0:d0 + C] = self._lookback(probs, d0)
        return out, peak


def _kv_heads_per_pass(device: torch.device, num_kv_heads: int) -> int:
    """KV heads whose query chunks the PyTorch path computes together: one on a CPU, so that a chunk's logits stay
    small enough for the caches (docs/performance.md, "How the CPU path runs"); elsewhere all of them, in as few
    launches as possible."""
    return 1 if device.type == "cpu" else num_kv_heads


def _first_lookback_key(attention_mask, query_valid, Q: int, T: int, device) -> torch.Tensor:
    """`(B or 1,)` long: each row's first key that the lookback statistic may read, past its first real tokens (the
    sinks). A row's first real key is the first the last query sees under ``attention_mask``; without a mask, the
    first valid query of a prefill (``Q == T``, left padding), else position 0."""
    if attention_mask is not None:
        last = attention_mask[:, 0, -1, :T]  # (B|1, T)
        seen = last if last.dtype == torch.bool else last > torch.finfo(last.dtype).min / 2
        start = seen.to(torch.int8).argmax(-1)
    elif query_valid is not None and Q == T:
        start = query_valid.to(torch.int8).argmax(-1)
    else:
        start = torch.zeros(1, dtype=torch.long, device=device)
    return start.to(device=device, dtype=torch.long) + LOOKBACK_SINKS


def _chunk_bias(
    attention_mask: torch.Tensor | None, q0: int, q1: int, Q: int, T: int, device: torch.device, t_end: int
) -> torch.Tensor:
    """Additive float bias `(B or 1, 1, C, t_end)` for query rows ``q0:q1`` over keys ``:t_end`` (0 = visible,
    -inf = hidden).

    ``attention_mask`` is what transformers hands to an attention function: a bool mask (True = attend, sdpa), a
    float additive mask (eager) of shape `(B, 1, Q, T)`, or None, which means causal with the queries at the last
    ``Q`` key positions.
    """
    if attention_mask is None:
        qpos = torch.arange(q0, q1, device=device) + (T - Q)  # absolute position of each query, (C,)
        hidden = torch.arange(t_end, device=device)[None, :] > qpos[:, None]  # (C, t_end)
        return torch.zeros(1, 1, q1 - q0, t_end, device=device).masked_fill(hidden, float("-inf"))
    m = attention_mask[:, :, q0:q1, :t_end]
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, device=device).masked_fill(~m, float("-inf"))
    return m.float()


def _hides_future(attention_mask: torch.Tensor | None, Q: int, T: int) -> bool:
    """True when no query sees a key after its own position (queries at the last ``Q`` of ``T`` positions): then a
    chunk of queries only needs the keys up to its last query. One check per call, not per chunk."""
    if attention_mask is None:
        return True
    m = attention_mask[..., :T]
    visible = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
    qpos = torch.arange(Q, device=m.device) + (T - Q)
    future = torch.arange(T, device=m.device)[None, :] > qpos[:, None]  # (Q, T)
    return not bool((visible & future).any())
