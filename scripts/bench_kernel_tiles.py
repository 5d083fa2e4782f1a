"""The fused statistics kernels' launch settings on a GPU: time and agreement of each tile / warp / stage choice.

How to run me (one CUDA GPU; docs/performance.md, "Where ProxyKV's time goes")::

    python scripts/bench_kernel_tiles.py --length 32768 --heads 32 --kv-heads 8 --head-dim 64   # Llama-3.2-1B layer
    python scripts/bench_kernel_tiles.py --length 32768 --heads 12 --kv-heads 2 --head-dim 128  # Qwen2.5-1.5B layer
    python scripts/bench_kernel_tiles.py --length 4130 --queries 2078 --heads 32 --kv-heads 8 --head-dim 128 --max

The first two time pass 2 alone after flash attention's log-sum-exp, as a proxy layer runs it (``Q == T``). With
``--queries Q`` the queries hold the last ``Q`` of the ``--length`` positions and both passes run: the shape of
KVzip's scoring for one 2048-token chunk of the Llama-3.1-8B shape (4 sinks + 2048 chunk keys + the repeat).
``--max`` adds the per-key maxima. Each row: the median of ``--repeats`` CUDA-event timings after a warm-up (which
compiles the kernel), and the largest relative difference from the first setting's sums; each setting with both
ways pass 2 accumulates (``tile_acc``).
:func:`proxykv_hf.attention.kernels.default_tiles` holds the fastest per head dimension.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from proxykv_hf.attention import kernels

SETTINGS = [(128, 128, 4, 3), (128, 128, 8, 3), (64, 128, 4, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 4, 2),
            (64, 128, 4, 4), (128, 128, 8, 2), (256, 128, 8, 3), (128, 256, 8, 3), (64, 256, 8, 3), (256, 64, 8, 3)]


def median_ms(fn, repeats: int) -> tuple[float, object]:
    out = fn()  # warm-up: compiles this setting
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=32768, help="key positions T")
    p.add_argument("--queries", type=int, default=None, help="queries Q at the last positions (default: T)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--max", action="store_true", help="also the per-key maxima")
    p.add_argument("--repeats", type=int, default=3)
    ns = p.parse_args(argv)
    T, Q, D = ns.length, ns.queries or ns.length, ns.head_dim
    torch.manual_seed(0)
    q = torch.randn(1, ns.heads, Q, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, ns.kv_heads, T, D, device="cuda", dtype=torch.bfloat16)
    lse = kernels.flash_attention_with_lse(q, k, k, D**-0.5)[1] if Q == T else None
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; Q={Q}, T={T}, heads {ns.heads}/"
          f"{ns.kv_heads}, D={D}, {'pass 2 after flash' if lse is not None else 'both passes'}"
          f"{', with maxima' if ns.max else ''}; default {kernels.default_tiles(D)}")
    print("| block_m x block_n | warps | stages | pass-2 accumulator | ms | max rel. diff |\n|---|---|---|---|---|---|")
    rows, first = [], None
    for (bm, bn, warps, stages), tile_acc in [(s, t) for s in SETTINGS for t in (False, True)]:
        acc = "tile" if tile_acc else "row-reduced"
        try:
            ms, out = median_ms(lambda: kernels.causal_attention_sums(q, k, D**-0.5, block_m=bm, block_n=bn,
                                                                      num_warps=warps, num_stages=stages,
                                                                      with_max=ns.max, lse=lse, tile_acc=tile_acc),
                                ns.repeats)
        except Exception as err:  # noqa: BLE001 - e.g. a setting that needs more shared memory than the GPU has
            print(f"| {bm} x {bn} | {warps} | {stages} | {acc} | {type(err).__name__} | |")
            continue
        sums = out[0] if ns.max else out
        first = sums if first is None else first
        diff = ((sums - first).abs() / first.abs().clamp_min(1e-3)).max().item()
        rows.append(dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages, tile_acc=tile_acc, ms=ms,
                         diff=diff))
        print(f"| {bm} x {bn} | {warps} | {stages} | {acc} | {ms:.3f} | {diff:.1e} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
