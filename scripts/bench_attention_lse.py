"""Causal attention with each row's log-sum-exp on a GPU: PyTorch's flash kernel (what the proxy and the self-proxy
cache call, ``kernels.flash_attention_with_lse``) against cuDNN's, beside plain sdpa.

How to run me (one CUDA GPU)::

    python scripts/bench_attention_lse.py --lengths 8192 32768                                  # Llama-3.2-1B layer
    python scripts/bench_attention_lse.py --lengths 8192 32768 --heads 12 --kv-heads 2 --head-dim 128  # Qwen2.5-1.5B

The proxy's statistics need the row log-sum-exp, which sdpa does not return, so the proxy calls a flash kernel
directly; sdpa itself may pick cuDNN's attention on Hopper. Each row: the median of ``--repeats`` CUDA-event
timings after a warm-up, for sdpa (its own choice of kernel, no log-sum-exp), flash with the log-sum-exp, and
cuDNN with it (keys and values repeated to the query heads where cuDNN refuses grouped heads), with cuDNN's largest
output and log-sum-exp differences from flash's.
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_kernel_tiles import median_ms  # the script beside this one (its directory is on sys.path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    ns = p.parse_args(argv)
    ops, D = torch.ops.aten, ns.head_dim
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; heads {ns.heads}/{ns.kv_heads}, D={D}")
    print("| N | sdpa ms | flash + lse ms | cuDNN + lse ms | cuDNN output / lse max diff |\n|---|---|---|---|---|")
    rows = []
    for n in ns.lengths:
        torch.manual_seed(0)
        q = torch.randn(1, ns.heads, n, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, ns.kv_heads, n, D, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        sdpa, _ = median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                      enable_gqa=True), ns.repeats)
        flash, (out_f, lse_f) = median_ms(
            lambda: ops._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=D**-0.5)[:2], ns.repeats)
        row = dict(n=n, sdpa_ms=sdpa, flash_ms=flash)
        cudnn_cell, diff_cell = "refused", ""
        for kk, vv in ((k, v), (k.repeat_interleave(ns.heads // ns.kv_heads, 1),
                                v.repeat_interleave(ns.heads // ns.kv_heads, 1))):
            try:
                t, (out_c, lse_c) = median_ms(lambda: ops._scaled_dot_product_cudnn_attention(
                    q, kk, vv, None, True, 0.0, True, False, scale=D**-0.5)[:2], ns.repeats)
            except RuntimeError as err:
                cudnn_cell = f"refused ({str(err).splitlines()[0][:60]})"
                continue
            d_out = (out_c.float() - out_f.float()).abs().max().item()
            d_lse = (lse_c.float().flatten(2)[..., :n] - lse_f.float().flatten(2)[..., :n]).abs().max().item()
            row.update(cudnn_ms=t, grouped=kk is k, out_diff=d_out, lse_diff=d_lse)
            cudnn_cell = f"{t:.2f}" + ("" if kk is k else " (heads repeated)")
            diff_cell = f"{d_out:.1e} / {d_lse:.1e}"
            break
        rows.append(row)
        print(f"| {n} | {sdpa:.2f} | {flash:.2f} | {cudnn_cell} | {diff_cell} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
