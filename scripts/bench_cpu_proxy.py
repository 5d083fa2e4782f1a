"""The 0.5B proxy's prefill on the CPU, for docs/performance.md ("CPU: the Qwen2.5-Coder pair"): its plain sdpa
prefill against the same prefill with the attention statistics the bundled mapper reads, and the proxy + mapper
run side by side with the target's prefill (two Python threads, one torch thread each) against the two in turn
(2 torch threads).

    python scripts/bench_cpu_proxy.py --dtype bfloat16 --tokens 2048
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
from transformers import DynamicCache

from proxykv_hf import ProxyKVCache
from proxykv_hf.attention.compat import with_cache
from proxykv_hf.models.loading import load_model


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    model = load_model("qwen2.5-coder-1.5b-instruct", dtype=dtype)
    proxy = load_model("qwen2.5-coder-0.5b-instruct", dtype=dtype)
    scorer = ProxyKVCache.from_pretrained("proxykv-qwen2.5-coder-1.5b-instruct", keep_ratio=0.3, proxy=proxy).scorer
    ids = torch.randint(10, 150_000, (1, args.tokens), generator=torch.Generator().manual_seed(0))

    @torch.no_grad()
    def plain_proxy():
        proxy.model(input_ids=ids, **with_cache(DynamicCache()), use_cache=True)

    @torch.no_grad()
    def features():
        return scorer.features(proxy, ids, None)

    @torch.no_grad()
    def side():  # what ProxyKV runs before the target's prefill: the proxy with its statistics, then the mapper
        x = features()
        scorer._map(lambda: scorer.checkpoint.map_features(x, None), ids.device)

    @torch.no_grad()
    def target():
        cache = ProxyKVCache(None, 1.0).prepare(model, ids)
        model(input_ids=ids, **with_cache(cache), use_cache=True, logits_to_keep=1)

    def side_by_side():
        worker = threading.Thread(target=side)
        worker.start()
        target()
        worker.join()

    threads = torch.get_num_threads()
    for fn in (plain_proxy, side, target):
        fn()  # warm-up
    for _ in range(args.rounds):
        plain, stats = seconds(plain_proxy), seconds(features)
        in_turn = seconds(lambda: (side(), target()))
        torch.set_num_threads(1)
        together = seconds(side_by_side)
        torch.set_num_threads(threads)
        print(f"{args.dtype}, {args.tokens} tokens, {threads} threads: proxy plain {plain:.2f} s, with statistics "
              f"{stats:.2f} s ({stats / plain:.2f}x); proxy + mapper then target {in_turn:.2f} s, side by side "
              f"(1 thread each) {together:.2f} s ({together / in_turn:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
