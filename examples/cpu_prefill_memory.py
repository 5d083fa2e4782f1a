"""Peak resident memory of one prefill per method on the CPU, in one process, in the order given.

    python examples/cpu_prefill_memory.py --tokens 4096

Shows how much the benchmark's CPU memory measure (resident set size above the level at entry, after
``malloc_trim``) depends on what earlier prefills left in the allocator's heap (docs/performance.md).
"""

from __future__ import annotations

import argparse
import time

import torch

from proxykv_hf import ProxyKVCache
from proxykv_hf.bench.run import PeakMemory, _trim_heap
from proxykv_hf.models import load_model_and_tokenizer

MAPPER = "proxykv_hf/checkpoints/proxykv-smollm2-135m-instruct"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--chunks", type=int, nargs="+", default=[256, 64], help="ProxyKV query-chunk sizes, in order")
    ns = p.parse_args(argv)
    model, _ = load_model_and_tokenizer()
    ids = torch.randint(10, 40000, (1, ns.tokens), generator=torch.Generator().manual_seed(0))
    for chunk in [None, *ns.chunks]:
        cache = (ProxyKVCache(None, 1.0) if chunk is None
                 else ProxyKVCache.from_pretrained(MAPPER, keep_ratio=0.3, chunk_size=chunk))
        cache.prepare(model, ids)
        _trim_heap()
        t0 = time.perf_counter()
        with torch.no_grad(), PeakMemory(torch.device("cpu")) as mem:
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        label = "full" if chunk is None else f"proxykv, chunk {chunk}"
        print(f"{label}: peak {mem.peak / 2**20:.0f} MiB, {time.perf_counter() - t0:.1f} s", flush=True)
        del cache


if __name__ == "__main__":
    main()
