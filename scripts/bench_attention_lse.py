"""One proxy layer's attention with each row's log-sum-exp on a GPU, and the statistics pass after it.

How to run me (one CUDA GPU; docs/performance.md, "Where ProxyKV's time goes")::

    python scripts/bench_attention_lse.py --lengths 32768                                        # Llama-3.2-1B layer
    python scripts/bench_attention_lse.py --lengths 32768 --heads 12 --kv-heads 2 --head-dim 128  # Qwen2.5-1.5B layer

The proxy's statistics need the row log-sum-exp, which sdpa does not return, so the proxy calls a kernel that does
(``kernels.flash_attention_with_lse``): PyTorch's flash kernel or cuDNN's (``kernel="flash"`` / ``"cudnn"``).
Queries, keys and values are laid out as the model hands them (``(B, N, H, D)`` memory seen as ``(B, H, N, D)``).
Each row: the median of ``--repeats`` CUDA-event timings after a warm-up, for sdpa alone (its own choice of kernel,
no log-sum-exp), each kernel with the log-sum-exp, and pass 2 of the fused statistics after the flash kernel's
log-sum-exp with both accumulators (``tile_acc``); then cuDNN's largest output and log-sum-exp differences from
flash's, and the largest relative difference between the two accumulators' sums.
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_kernel_tiles import median_ms  # the script beside this one (its directory is on sys.path)

from proxykv_hf.attention import kernels


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[32768])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    ns = p.parse_args(argv)
    D, scale = ns.head_dim, ns.head_dim ** -0.5
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; heads {ns.heads}/{ns.kv_heads}, D={D}")
    print("| N | sdpa alone | flash + lse | cuDNN + lse | pass 2, row-reduced | pass 2, register tile | cuDNN output / "
          "lse max diff | accumulators' max rel. diff |\n|---|---|---|---|---|---|---|---|")
    rows = []
    for n in ns.lengths:
        torch.manual_seed(0)
        q = torch.randn(1, n, ns.heads, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k, v = (torch.randn(1, n, ns.kv_heads, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in "kv")
        sdpa, _ = median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                      enable_gqa=True), ns.repeats)
        flash, (out_f, lse_f) = median_ms(lambda: kernels.flash_attention_with_lse(q, k, v, scale, kernel="flash"),
                                          ns.repeats)
        cudnn, (out_c, lse_c) = median_ms(lambda: kernels.flash_attention_with_lse(q, k, v, scale, kernel="cudnn"),
                                          ns.repeats)
        rowwise, sums_r = median_ms(lambda: kernels.causal_attention_sums(q, k, scale, lse=lse_f, tile_acc=False),
                                    ns.repeats)
        tiled, sums_t = median_ms(lambda: kernels.causal_attention_sums(q, k, scale, lse=lse_f, tile_acc=True),
                                  ns.repeats)
        row = dict(n=n, sdpa_ms=sdpa, flash_ms=flash, cudnn_ms=cudnn, pass2_rows_ms=rowwise, pass2_tile_ms=tiled,
                   out_diff=(out_c.float() - out_f.float()).abs().max().item(),
                   lse_diff=(lse_c - lse_f).abs().max().item(),
                   acc_diff=((sums_t - sums_r).abs() / sums_r.abs().clamp_min(1e-3)).max().item())
        rows.append(row)
        print(f"| {n} | {sdpa:.2f} | {flash:.2f} | {cudnn:.2f} | {rowwise:.2f} | {tiled:.2f} | "
              f"{row['out_diff']:.1e} / {row['lse_diff']:.1e} | {row['acc_diff']:.1e} |")
    modes = {f"{dtype} D={dim}{' grouped' if grouped else ''}": mode
             for (_, grouped, dtype, dim), mode in kernels._cudnn_modes.items()}
    print(f"cuDNN took the heads as: {modes} (None: refused, and the cuDNN column ran flash)")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
