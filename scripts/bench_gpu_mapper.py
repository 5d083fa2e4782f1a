"""The paper-preset mapper's forward on a GPU, four ways: time and agreement.

How to run me (one CUDA GPU; docs/performance.md, "Where ProxyKV's time goes")::

    python scripts/bench_gpu_mapper.py --shape llama-3.1-8b --lengths 32768
    python scripts/bench_gpu_mapper.py --shape qwen2.5-7b --lengths 32768

A random paper-preset mapper between the shape and its proxy (``proxykv_hf.bench.shapes``; timing does not depend
on the weights) scores every target layer from random features, under bfloat16 autocast as ``ProxyScorer`` runs
it: (1) the encoder through ``nn.TransformerEncoder``'s own forward, (2) through ``TimeEncoder.encode_sdpa`` (what
eval mode runs), (3) the same with the weights cast to bfloat16 (no autocast), (4) (2) with the encoder's forward
under ``torch.compile`` (``ProxyScorer(compile_mapper=True)``; its first call, which compiles, is timed apart).
Each: the median of ``--repeats`` CUDA-event timings after a warm-up, and the largest difference of its logits
from (2)'s.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from bench_kernel_tiles import median_ms  # the script beside this one (its directory is on sys.path)

from proxykv_hf.bench.shapes import pair_mapper_config
from proxykv_hf.mapper.model import HybridAxialMapper


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--lengths", type=int, nargs="+", default=[32768])
    p.add_argument("--repeats", type=int, default=3)
    ns = p.parse_args(argv)
    config = pair_mapper_config(ns.shape)

    def fresh() -> HybridAxialMapper:
        torch.manual_seed(0)
        return HybridAxialMapper(config).cuda().eval()

    def run(mapper, x, autocast: bool = True) -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            return mapper(x).float()

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; {ns.shape} pair, "
          f"{sum(p.numel() for p in fresh().parameters()):,} mapper parameters")
    print("| tokens | nn.TransformerEncoder | encode_sdpa | bfloat16 weights | compiled (first call) |\n"
          "|---|---|---|---|---|")
    rows = []
    for n in ns.lengths:
        x = torch.rand(1, config.num_proxy_layers, config.num_features, n, device="cuda") * 3
        module = fresh()
        te = module.time_encoder
        te.encode_sdpa = lambda z, pad: te.encoder(z, src_key_padding_mask=pad)  # the module's own forward
        t_module, out_module = median_ms(lambda: run(module, x), ns.repeats)
        sdpa = fresh()
        t_sdpa, ref = median_ms(lambda: run(sdpa, x), ns.repeats)
        half = fresh().to(torch.bfloat16)
        t_half, out_half = median_ms(lambda: run(half, x.to(torch.bfloat16), autocast=False), ns.repeats)
        compiled = fresh()
        compiled.time_encoder.forward = torch.compile(compiled.time_encoder.forward)
        start = time.perf_counter()
        run(compiled, x)
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        t_comp, out_comp = median_ms(lambda: run(compiled, x), ns.repeats)
        diff = {name: (out - ref).abs().max().item() for name, out in
                (("module", out_module), ("bfloat16", out_half), ("compiled", out_comp))}
        rows.append(dict(n=n, module_ms=t_module, sdpa_ms=t_sdpa, bfloat16_ms=t_half, compiled_ms=t_comp,
                         compile_first_s=first, max_abs_diff=diff))
        print(f"| {n} | {t_module:.1f} ms | {t_sdpa:.1f} ms | {t_half:.1f} ms | {t_comp:.1f} ms ({first:.1f} s) |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
