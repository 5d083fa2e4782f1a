"""``proxykv bench``: build the target, its scorers and (for ProxyKV) the model its features come from, then run
and report."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..eval.harness import environment
from .run import Bench, BenchConfig, plot, summary_json, table


def _scorers(ns, model, tok, tmp: str):
    """name -> scorer (None for the full cache), plus the model the ProxyKV scorer's features come from (for its
    breakdown; None without ProxyKV)."""
    from ..cache import ProxyKVCache
    from ..cli import _mapper_for
    from ..scorers import SnapKVScorer

    scorers, runner = {"full": None}, None
    for method in ns.methods:
        if method == "snapkv":
            scorers[method] = SnapKVScorer()
        elif method == "kvzip":
            from ..scorers.kvzip import KVzipScorer

            scorers[method] = KVzipScorer(tok)
        elif method == "kvzip_iam":
            from ..scorers.iam import KVzipIAMScorer

            scorers[method] = KVzipIAMScorer(tok, proxy=getattr(ns, "_proxy_model", None))
        elif method == "proxykv":
            mapper = getattr(ns, "_mapper_dir", None) or _mapper_for(ns, model, tmp)
            if mapper is None:
                raise SystemExit("proxykv needs a mapper checkpoint (--mapper), or use --tiny")
            scorer = ProxyKVCache.from_pretrained(mapper, proxy=getattr(ns, "_proxy_model", None),
                                                  proxy_device=ns.proxy_device or ns.device,
                                                  pool_kernel=getattr(ns, "pool_kernel", None)).scorer
            scorers[method] = scorer
            runner = scorer.proxy_model if scorer.spec.kind == "model" else model
    return scorers, runner


def _shape_setup(ns, tmp: str):
    """Random-weight target + proxy of real shapes, and a random paper-preset mapper (honest for timing)."""
    from ..hub import Checkpoint, save_checkpoint
    from ..mapper import HybridAxialMapper, MapperConfig
    from ..proxy import ProxySpec
    from ..testing import tiny_tokenizer
    from ..train.data import target_spec_of
    from .shapes import PAIRS, random_model

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[ns.dtype]
    target = random_model(ns.shape, device=ns.device, dtype=dtype)
    proxy = random_model(PAIRS[ns.shape], device=ns.proxy_device or ns.device, dtype=dtype, seed=1)
    spec = ProxySpec(kind="model", num_layers=proxy.config.num_hidden_layers,
                     num_heads=proxy.config.num_attention_heads, model_id=PAIRS[ns.shape])
    tspec = target_spec_of(target, ns.shape)
    cfg = MapperConfig.paper(num_proxy_layers=spec.num_layers, num_proxy_heads=spec.num_heads,
                             num_target_layers=tspec.num_layers, num_target_heads=tspec.num_kv_heads)
    mapper = HybridAxialMapper(cfg).eval()
    save_checkpoint(Checkpoint(mapper=mapper, proxy=spec, target=tspec), tmp)
    ns._proxy_model, ns._mapper_dir = proxy, tmp
    return target, tiny_tokenizer()  # ids only need to be in range; the tiny byte tokenizer serves KVzip's prompts


def run_bench(ns) -> int:
    from ..cli import from_args, load

    cfg = from_args(BenchConfig, ns)
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = _shape_setup(ns, tmp) if ns.shape else load(ns)
        scorers, runner = _scorers(ns, model, tok, tmp)
        bench = Bench(model, scorers, cfg, proxy_runner=runner)
        with tqdm(total=len(cfg.context_lengths) * len(cfg.methods), desc="bench", unit="method") as bar:
            rows = bench.run(progress=lambda row: (bar.set_postfix(context=row["context"], method=row["method"],
                                                                   ttft_s=f"{row['ttft_s']:.2f}"), bar.update()))
    env = environment(model)
    env["shape"] = ns.shape
    print(table(rows))
    if ns.out:
        out = Path(ns.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.md").write_text(table(rows) + "\n")
        plot(rows, out / "bench.png")
        (out / "bench.json").write_text(summary_json(rows, cfg, env) + "\n")
    print(summary_json(rows, cfg, env))
    return 0
