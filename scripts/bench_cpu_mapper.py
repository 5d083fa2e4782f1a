"""The mapper's forward on the CPU in float32 and under bfloat16 autocast: time, and how many kept tokens change.

How to run me (docs/performance.md, "How the CPU path runs")::

    OMP_NUM_THREADS=2 python scripts/bench_cpu_mapper.py --lengths 2048 4096

Scores every target layer of the bundled SmolLM2 mapper (or ``--mapper``) from random proxy features (timing does
not depend on their values). Each row gives the best of ``--repeats`` timings (after one warm-up) in float32 and
under ``torch.autocast("cpu", dtype=torch.bfloat16)``, and the share of each (layer, KV head)'s top 30% of tokens
that both precisions keep. ``ProxyScorer`` uses bfloat16 only where ``bfloat16_is_fast`` (AVX512-BF16 or AMX);
elsewhere the bfloat16 column measures the emulated path that the scorer avoids.
"""

from __future__ import annotations

import argparse

import torch
from bench_cpu_attention import best_of  # the script beside this one (its directory is on sys.path)

from proxykv_hf.hub import BUNDLED_MAPPER, load_checkpoint
from proxykv_hf.scorers.proxy import bfloat16_is_fast
from proxykv_hf.train.metrics import topk_recall


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mapper", default=None, help="mapper checkpoint (default: the bundled one)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    mapper = load_checkpoint(args.mapper or BUNDLED_MAPPER).mapper.eval()
    cfg = mapper.config
    print(f"mapper: {cfg.num_proxy_layers} proxy layers -> {cfg.num_target_layers} target layers, "
          f"{sum(p.numel() for p in mapper.parameters()):,} parameters; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; bfloat16_is_fast: {bfloat16_is_fast(torch.device('cpu'))}")
    print("\n| tokens | float32 | bfloat16 autocast | top-30% kept by both |\n|---|---|---|---|")
    gen = torch.Generator().manual_seed(args.seed)
    for n in args.lengths:
        x = torch.rand(1, cfg.num_proxy_layers, cfg.num_features, n, generator=gen)

        def run(half: bool) -> torch.Tensor:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
                return mapper(x).float()

        full, half = best_of(lambda: run(False), args.repeats), best_of(lambda: run(True), args.repeats)
        overlap = topk_recall(run(True), run(False), 0.3).item()  # same K for both: the share kept by both
        print(f"| {n} | {full:.3f} s | {half:.3f} s ({full / half:.2f}x) | {overlap:.4f} |")


if __name__ == "__main__":
    main()
