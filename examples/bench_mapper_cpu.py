"""Time a mapper's forward on the CPU with its encoder attention through ``scaled_dot_product_attention`` (the
eval-mode CPU path) and through ``nn.TransformerEncoder``'s own fused path, back to back in one process.

    OMP_NUM_THREADS=1 python examples/bench_mapper_cpu.py --lengths 2048 4096

Features are random (speed does not depend on their values); prints seconds per forward (each path twice,
interleaved) and the largest difference between the two paths' logits.
"""

from __future__ import annotations

import argparse
import time

import torch

from proxykv_hf.hub import BUNDLED_DIR, BUNDLED_MAPPER, load_checkpoint
from proxykv_hf.mapper import TimeEncoder


def module_path(self, z, pad=None):
    """What eval mode ran before: the module's own forward."""
    return self.encoder(z, src_key_padding_mask=pad)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mapper", default=str(BUNDLED_DIR / BUNDLED_MAPPER), help="default: the shipped mapper")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--threads", type=int, default=1)
    ns = p.parse_args(argv)
    torch.set_num_threads(ns.threads)
    mapper = load_checkpoint(ns.mapper).mapper.eval()
    cfg = mapper.config
    sdpa = TimeEncoder.encode_sdpa
    print("| N | module s | sdpa s | speed-up | max abs diff |")
    print("|---|---|---|---|---|")
    try:
        for n in ns.lengths:
            x = torch.rand(1, cfg.num_proxy_layers, cfg.num_features, n) * 10
            times: dict[str, list[float]] = {"module": [], "sdpa": []}
            outs = {}
            with torch.no_grad():
                for name, fn in [("module", module_path), ("sdpa", sdpa)] * 2:
                    TimeEncoder.encode_sdpa = fn
                    t = time.perf_counter()
                    outs[name] = mapper(x)
                    times[name].append(time.perf_counter() - t)
            a, b = min(times["module"]), min(times["sdpa"])
            diff = (outs["module"] - outs["sdpa"]).abs().max().item()
            print(f"| {n} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {diff:.1e} |")
    finally:
        TimeEncoder.encode_sdpa = sdpa


if __name__ == "__main__":
    main()
