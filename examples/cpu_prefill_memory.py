"""Peak resident memory of one prefill per method on the CPU: in one process (order-dependent) or one fresh process each.

    python examples/cpu_prefill_memory.py --tokens 4096                       # one process, full then ProxyKV
    python examples/cpu_prefill_memory.py --fresh full snapkv proxykv kvzip --tokens 2048 4096

One process: shows how much the benchmark's CPU memory measure (resident set size above the level at entry, after
``malloc_trim``) depends on what earlier prefills left in the allocator's heap (docs/performance.md).

``--fresh``: each (method, length) prefill runs alone in a new Python process, so no method inherits another's heap.
Two figures per run: the sampled RSS peak above the level just before the prefill (the benchmark's measure), and
the process's high-water mark (``ru_maxrss``, exact) minus that same level ("-" where loading the model had set a
higher mark than the prefill reached); the model's weights and the input are in the level, not in the figures. Ratios are against the full cache at the same length.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

MAPPER = "proxykv_hf/checkpoints/proxykv-smollm2-135m-instruct"
METHODS = ("full", "snapkv", "kvzip", "proxykv")


def _cache(method: str, tok, chunk: int):
    from proxykv_hf import ProxyKVCache
    from proxykv_hf.scorers import SnapKVScorer
    from proxykv_hf.scorers.kvzip import KVzipScorer

    if method == "proxykv":
        return ProxyKVCache.from_pretrained(MAPPER, keep_ratio=0.3, chunk_size=chunk)
    scorer = {"full": lambda: None, "snapkv": SnapKVScorer, "kvzip": lambda: KVzipScorer(tok)}[method]()
    return ProxyKVCache(scorer, 1.0 if method == "full" else 0.3)


def measure(model, tok, method: str, tokens: int, chunk: int = 256) -> dict:
    """One prefill of ``tokens`` random ids with ``method``'s cache; peak memory above the level before it."""
    from proxykv_hf.bench.run import PeakMemory, _trim_heap

    ids = torch.randint(10, 40000, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # touch every weight first: they load lazily (memory-mapped), and would count as the peak
        model(input_ids=ids[:, :16])
    cache = _cache(method, tok, chunk).prepare(model, ids)
    _trim_heap()
    before = _high_water()
    t0 = time.perf_counter()
    with torch.no_grad(), PeakMemory(torch.device("cpu")) as mem:
        level = mem._base
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    after = _high_water()
    # the high-water mark is the process's: it speaks of the prefill only if the prefill raised it
    high = round((after - level) / 2**20) if after > before else None
    return {"method": method, "tokens": tokens, "seconds": round(time.perf_counter() - t0, 1),
            "peak_sampled_mib": round(mem.peak / 2**20), "peak_high_water_mib": high,
            "kv_mib": round(cache.nbytes() / 2**20)}


def _high_water() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _fresh(methods: list[str], lengths: list[int], chunk: int) -> None:
    rows = []
    for tokens in lengths:
        for method in methods:
            out = subprocess.run([sys.executable, __file__, "--only", method, "--tokens", str(tokens),
                                  "--chunks", str(chunk)], capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    print("| tokens | method | prefill s | peak MiB (sampled RSS) | / full | peak MiB (high-water) | / full | KV MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        full = next(f for f in rows if f["tokens"] == r["tokens"] and f["method"] == "full")
        high, full_high = r["peak_high_water_mib"], full["peak_high_water_mib"]
        ratio = f"{high / full_high:.2f}" if high and full_high else "-"
        print(f"| {r['tokens']} | {r['method']} | {r['seconds']} | {r['peak_sampled_mib']} | "
              f"{r['peak_sampled_mib'] / full['peak_sampled_mib']:.2f} | {high or '-'} | {ratio} | {r['kv_mib']} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096])
    p.add_argument("--chunks", type=int, nargs="+", default=[256, 64], help="ProxyKV query-chunk sizes, in order")
    p.add_argument("--fresh", nargs="+", choices=METHODS, help="one fresh process per method and length")
    p.add_argument("--only", choices=METHODS, help=argparse.SUPPRESS)  # the child of --fresh
    ns = p.parse_args(argv)
    if ns.fresh:
        if "full" not in ns.fresh:
            p.error("--fresh needs 'full' among the methods (the ratios are against it)")
        return _fresh(ns.fresh, ns.tokens, ns.chunks[0])
    from proxykv_hf.models import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer()
    if ns.only:
        print(json.dumps(measure(model, tok, ns.only, ns.tokens[0], ns.chunks[0])))
        return
    for chunk in [None, *ns.chunks]:
        row = measure(model, tok, "full" if chunk is None else "proxykv", ns.tokens[0], chunk or 256)
        label = "full" if chunk is None else f"proxykv, chunk {chunk}"
        print(f"{label}: peak {row['peak_sampled_mib']} MiB, {row['seconds']} s", flush=True)


if __name__ == "__main__":
    main()
