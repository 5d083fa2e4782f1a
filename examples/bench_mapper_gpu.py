"""Time the paper-preset mapper's forward at long contexts, three ways, back to back in one process: as shipped
(the encoder through ``nn.TransformerEncoder`` on a GPU), with the encoder through ``encode_sdpa`` (the CPU's
eval path), and under ``torch.compile``. On a GPU the mapper was the largest cost after the proxy's own forward
(333 ms at 32k for the Llama shapes, docs/performance.md); this says which path to ship there. (On the CPU the
shipped path is ``encode_sdpa`` and the other row is the module's own forward.)

    python examples/bench_mapper_gpu.py --shape llama-3.1-8b --lengths 8192 16384 32768

A random mapper with the pair's shapes (16 x 32 proxy heads -> 32 x 8 target KV heads for Llama), random features
(speed depends on neither), run as ``ProxyScorer`` runs it: eval mode, bfloat16 autocast on CUDA, no padding
mask. Prints ms per forward (median of ``--repeats`` after a warm-up; CUDA events on a GPU), the peak memory above
the features, and the largest difference from the shipped path's logits. ``torch.compile``'s first call (its
compile time) is reported apart; ``--no-compile`` skips it (the CPU test does).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from proxykv_hf.bench.run import timed
from proxykv_hf.bench.shapes import PAIRS, pair_mapper_config
from proxykv_hf.mapper import HybridAxialMapper, TimeEncoder


def mapper_for(shape: str, preset: str) -> HybridAxialMapper:
    """A random mapper reading the proxy of ``shape``'s pair and scoring ``shape``."""
    cfg = pair_mapper_config(shape, preset)
    torch.manual_seed(0)
    return HybridAxialMapper(cfg).eval()


def median_time(fn, device: torch.device, repeats: int) -> tuple[float, torch.Tensor]:
    """Median seconds of ``repeats`` calls (after the caller's warm-up) and the last output."""
    runs = [timed(fn, device) for _ in range(repeats)]
    return statistics.median(t for _, t in runs), runs[-1][0]


@contextlib.contextmanager
def sdpa_encoder(devices: tuple[str, ...]):
    saved = TimeEncoder.SDPA_DEVICES
    TimeEncoder.SDPA_DEVICES = devices
    try:
        yield
    finally:
        TimeEncoder.SDPA_DEVICES = saved


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(PAIRS))
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default="paper", choices=["paper", "tiny"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ns = p.parse_args(argv)
    device = torch.device(ns.device)
    mapper = mapper_for(ns.shape, ns.preset).to(device)
    cfg = mapper.config
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    compiled = torch.compile(mapper) if ns.compile else None
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch "
          f"{torch.__version__}, mapper {cfg.num_proxy_layers}x{cfg.num_proxy_heads} -> "
          f"{cfg.num_target_layers}x{cfg.num_target_heads} ({ns.preset})")
    print("| N | path | ms / forward | peak MiB | max abs diff |")
    print("|---|---|---|---|---|")
    for n in ns.lengths:
        x = torch.rand(1, cfg.num_proxy_layers, cfg.num_features, n, device=device) * 10
        shipped = TimeEncoder.SDPA_DEVICES
        if device.type in shipped:  # a CPU: the shipped path is encode_sdpa, the other one the module's
            paths = {"shipped (encode_sdpa)": (mapper, shipped),
                     "module": (mapper, tuple(d for d in shipped if d != device.type))}
        else:
            paths = {"shipped (module)": (mapper, shipped), "encode_sdpa": (mapper, (*shipped, device.type))}
        if compiled is not None:
            paths["torch.compile"] = (compiled, shipped)
        ref = None
        for name, (model, devices) in paths.items():
            with torch.no_grad(), autocast, sdpa_encoder(devices):
                t0 = time.perf_counter()
                model(x)  # warm-up (and, compiled, the compile)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    base = torch.cuda.memory_allocated(device)
                first = time.perf_counter() - t0
                seconds, out = median_time(lambda: model(x).float(), device, ns.repeats)
                peak = float("nan")
                if device.type == "cuda":
                    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
            ref = out if ref is None else ref
            note = f" (first call {first:.1f} s)" if name == "torch.compile" else ""
            print(f"| {n} | {name}{note} | {1000 * seconds:.1f} | {peak:.0f} | {(out - ref).abs().max().item():.1e} |")


if __name__ == "__main__":
    main()
