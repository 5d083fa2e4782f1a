"""Where do mapper checkpoints rank the needle? Needle rank percentile of several mappers on cached self features.

    python examples/needle_rank.py --tasks niah_single_1 --n-samples 4 --seed 100 \
        --mappers proxykv_hf/checkpoints/proxykv-smollm2-135m-instruct runs/my-mapper

Same measure as ``examples/compare_proxies.py`` (percentile of the mean rank of the answer's context tokens among
all context tokens, 0 = top, 0.5 = chance; "best layer" / "median layer" over the 30 layers, mapper scores averaged
over the 3 KV heads, raw features: best head of each layer), but the self-proxy features of the samples are computed
once and cached (``--cache``), so comparing mapper variants costs seconds. No KVzip pass. The cache holds the
attention sums and maxima (``statistics=("sum", "max")``); a mapper reads the rows it was trained on. A cache
written before it held the maxima serves sum-only mappers.

``--pool-kernels`` also scores each mapper with its scores lifted to their neighbourhood's mean (the checkpoint
setting ``pool_kernel``: :func:`proxykv_hf.selection.smooth_scores` with ``keep_peaks``, as the cache does), and
``--keep-ratios`` adds how often the *whole* needle (every token of the answer) survives the Top-K that the cache
would make (4 sink tokens kept), over layers and KV heads: a number split into digit tokens is lost if any digit is.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_proxies import needle_positions, rank_percentile  # noqa: E402

from proxykv_hf.eval import tasks as task_lib  # noqa: E402
from proxykv_hf.hub import load_checkpoint  # noqa: E402
from proxykv_hf.selection import select_topk, smooth_scores  # noqa: E402


def cached_features(tasks: list[str], n: int, tokens: int, seed: int, cache: Path) -> list[dict]:
    """``[{"task", "x" (30, 2 * 9, N) sums then maxima, "pos"}]`` for the samples, from ``cache`` if it exists."""
    if cache.is_file():
        return torch.load(cache, weights_only=False)
    from proxykv_hf.models import load_model_and_tokenizer
    from proxykv_hf.proxy import proxy_features

    model, tok = load_model_and_tokenizer()
    items = []
    for task in tasks:
        for sample in task_lib.generate(task, n, tokens, tok, seed):
            ids, pos = needle_positions(sample, tok)
            with torch.no_grad():
                x = proxy_features(model, ids, statistics=("sum", "max"))[0].half()
                items.append({"task": task, "x": x, "pos": pos})
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save(items, cache)
    return items


@torch.no_grad()
def needle_rank(scores_fn, items: list[dict], best_head: bool = False) -> tuple[float, float]:
    """Mean over samples of (best layer, median layer) needle rank percentile; ``scores_fn(item)`` gives the item's
    scores `(L, H, N)`."""
    best, median = [], []
    for it in items:
        per_head = rank_percentile(scores_fn(it).float(), it["pos"])  # (L, H)
        per_layer = per_head.min(-1).values if best_head else per_head.mean(-1)  # (L,)
        best.append(float(per_layer.min()))
        median.append(float(per_layer.median()))
    return statistics.mean(best), statistics.mean(median)


def needle_kept(scores: torch.Tensor, positions: list[int], keep_ratio: float, n_sink: int = 4) -> float:
    """Share of the rows of ``scores (L, H, N)`` whose Top-K at ``keep_ratio`` (the cache's selection) holds every
    position of the needle."""
    L, H, N = scores.shape
    idx, _ = select_topk(scores, keep_ratio, torch.ones(L, N, dtype=torch.bool), n_sink=n_sink)  # (L, H, K)
    kept = torch.zeros(L, H, N, dtype=torch.bool).scatter_(-1, idx, True)
    return float(kept[..., positions].all(-1).float().mean())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", nargs="+", default=["niah_single_1"])
    p.add_argument("--n-samples", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=100)
    p.add_argument("--cache", type=Path, default=None, help="feature cache file (default runs/needle-cache-...pt)")
    p.add_argument("--mappers", nargs="*", default=[], help="checkpoint directories or Hub ids")
    p.add_argument("--pool-kernels", nargs="+", type=int, default=[1], help="score pooling widths to compare")
    p.add_argument("--keep-ratios", nargs="*", type=float, default=[], help="also: whole needle kept at these rho")
    ns = p.parse_args(argv)
    cache = ns.cache or Path(f"runs/needle-cache-{'-'.join(ns.tasks)}-n{ns.n_samples}-t{ns.tokens}-s{ns.seed}.pt")
    items = cached_features(ns.tasks, ns.n_samples, ns.tokens, ns.seed, cache)
    print(f"{','.join(ns.tasks)}, {ns.n_samples} samples per task of ~{ns.tokens} tokens, seed {ns.seed}: "
          "needle rank percentile (0 = top, 0.5 = chance)")
    width = max([60] + [len(f"{path}, pooled over {max(ns.pool_kernels)}") for path in ns.mappers])
    kept_head = "".join(f" {'whole @' + format(r, 'g'):>9}" for r in ns.keep_ratios)
    print(f"{'source':<{width}} {'best layer':>10} {'median layer':>12}{kept_head}")
    heads = 9  # SmolLM2's query heads: the first 9 rows are the sums
    b, m = needle_rank(lambda it: it["x"].float()[:, :heads], items, best_head=True)
    print(f"{'self features (best head)':<{width}} {b:>10.3f} {m:>12.3f}")
    if items[0]["x"].shape[1] > heads:
        b, m = needle_rank(lambda it: it["x"].float()[:, heads:], items, best_head=True)
        print(f"{'self features, max statistic (best head)':<{width}} {b:>10.3f} {m:>12.3f}")
    for path in ns.mappers:
        mapper = load_checkpoint(path).mapper.eval()
        rows = mapper.config.num_features
        if items[0]["x"].shape[1] < rows:
            raise SystemExit(f"{path} reads {rows} feature rows; the cache {cache} holds "
                             f"{items[0]['x'].shape[1]}: write a new one")
        with torch.no_grad():
            raw = [mapper(it["x"][None, :, :rows].float())[0].float() for it in items]  # (L, H, N) each
        for kernel in ns.pool_kernels:
            scores = [smooth_scores(s, torch.ones(1, s.shape[-1], dtype=torch.bool), kernel, keep_peaks=True)
                      for s in raw]
            lookup = {id(it): s for it, s in zip(items, scores)}
            b, m = needle_rank(lambda it, lookup=lookup: lookup[id(it)], items)
            kept = "".join(f" {statistics.mean(needle_kept(s, it['pos'], r) for it, s in zip(items, scores)):>9.3f}"
                           for r in ns.keep_ratios)
            label = f"{path}, unpooled" if kernel == 1 else f"{path}, pooled over {kernel}"
            print(f"{label:<{width}} {b:>10.3f} {m:>12.3f}{kept}")


if __name__ == "__main__":
    main()
