"""The mapper's forward on the CPU in float32 and under bfloat16 autocast: time, and how many kept tokens change.

How to run me (docs/performance.md, "How the CPU path runs")::

    OMP_NUM_THREADS=2 python scripts/bench_cpu_mapper.py --lengths 2048 4096

Scores every target layer of the bundled SmolLM2 mapper (or ``--mapper``) from random proxy features (timing does
not depend on their values). Each row gives the best of ``--repeats`` timings (after one warm-up, the variants taken
in turn) in float32, under ``torch.autocast("cpu", dtype=torch.bfloat16)`` as the scorer runs it (the encoder's
attention through ``window_attention_bf16``), and under autocast with the encoder's attention through
``F.scaled_dot_product_attention`` instead; and the share of each (layer, KV head)'s top 30% of tokens that float32
and each bfloat16 variant both keep. ``ProxyScorer`` uses bfloat16 only where ``bfloat16_is_fast`` (AVX512-BF16 or
AMX); elsewhere the bfloat16 columns measure the emulated path that the scorer avoids.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_cpu_attention import in_turn  # the script beside this one (its directory is on sys.path)

from proxykv_hf.mapper import model as mapper_module
from proxykv_hf.mapper.hub import BUNDLED_MAPPER, load_checkpoint
from proxykv_hf.scorers.proxy import bfloat16_is_fast
from proxykv_hf.train.metrics import topk_recall


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mapper", default=None, help="mapper checkpoint (default: the bundled one)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    mapper = load_checkpoint(args.mapper or BUNDLED_MAPPER).mapper.eval()
    cfg = mapper.config
    print(f"mapper: {cfg.num_proxy_layers} proxy layers -> {cfg.num_target_layers} target layers, "
          f"{sum(p.numel() for p in mapper.parameters()):,} parameters; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; bfloat16_is_fast: {bfloat16_is_fast(torch.device('cpu'))}")
    print("\n| tokens | float32 | bfloat16 autocast | the same, encoder attention through sdpa | top-30% kept by both "
          "(sdpa) |\n|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(args.seed)
    windows = mapper_module.window_attention_bf16
    for n in args.lengths:
        x = torch.rand(1, cfg.num_proxy_layers, cfg.num_features, n, generator=gen)

        def run(half: bool, sdpa: bool = False) -> torch.Tensor:
            mapper_module.window_attention_bf16 = F.scaled_dot_product_attention if sdpa else windows
            try:
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
                    return mapper(x).float()
            finally:
                mapper_module.window_attention_bf16 = windows

        times = {name: min(t) for name, t in in_turn({"full": lambda: run(False), "half": lambda: run(True),
                                                      "sdpa": lambda: run(True, sdpa=True)}, args.repeats).items()}
        ref = run(False)
        kept = [topk_recall(run(True, sdpa), ref, 0.3).item() for sdpa in (False, True)]  # same K: the share both keep
        print(f"| {n} | {times['full']:.3f} s | {times['half']:.3f} s ({times['full'] / times['half']:.2f}x) | "
              f"{times['sdpa']:.3f} s ({times['full'] / times['sdpa']:.2f}x) | {kept[0]:.4f} ({kept[1]:.4f}) |")


if __name__ == "__main__":
    main()
