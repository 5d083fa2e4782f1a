"""Compressed contexts on disk with the bundled SmolLM2: bytes, save and load times, and the first answer token from a
loaded context against a fresh prefill + ProxyKV compression.

How to run me (docs/performance.md, "Compressed contexts on disk")::

    python scripts/bench_contexts.py --context-tokens 4096 --repeats 3

The context is the evaluation's dev-split pass key in plain sentences (as ``proxykv demo`` builds it), compressed
by ProxyKV with the bundled mapper at ``--keep-ratio``. Per repeat, in turn: a fresh cache prefills and compresses the
context and runs the question's forward (its first answer token); the compressed cache is saved
(``ProxyKVCache.save_context``); the saved context is loaded (``ProxyKVCache.load_context``, the SHA-256 of its
file checked) and runs the same forward. Each save and load pays the tokenizer's fingerprint, as the first of a
process does (later ones in a process find it remembered). Reported: medians; the full cache's K/V bytes against the saved context's
bytes on disk; whether both paths give the same first token. Neither time includes loading the model; the load reads
a file just written (in the page cache). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from proxykv_hf import ProxyKVCache
from proxykv_hf.models import fingerprints
from proxykv_hf.attention.compat import with_cache
from proxykv_hf.eval import tasks as task_lib
from proxykv_hf.eval.prompts import encode_sample
from proxykv_hf.eval.splits import SPLITS
from proxykv_hf.mapper.hub import BUNDLED_DIR, BUNDLED_MAPPER
from proxykv_hf.models.loading import load_model_and_tokenizer
from proxykv_hf.contexts.pipeline import compress_context

WARMUP_TOKENS = 512


@torch.no_grad()
def first_token(model, cache: ProxyKVCache, question: torch.Tensor) -> int:
    """The question's forward on the filled cache: its first answer token."""
    n = cache.get_seq_length()
    logits = model(input_ids=question, **with_cache(cache), position_ids=torch.arange(n, n + question.shape[1])[None],
                   logits_to_keep=1).logits
    return int(logits[0, -1].argmax())


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context-tokens", type=int, default=4096, help="length of the pass-key context")
    parser.add_argument("--keep-ratio", type=float, default=0.3, help="ProxyKV's keep ratio")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each path (medians reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--task", default="passkey:filler-dev2",
                        help="the context's task (default: the dev split's pass key)")
    parser.add_argument("--seed", type=int, default=SPLITS["dev"].seed, help="task seed (the dev split's)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    model, tok = load_model_and_tokenizer()
    sample = task_lib.generate(args.task, 1, args.context_tokens, tok, args.seed)[0]
    ctx_ids, q_ids = encode_sample(sample, tok)
    ctx, q = torch.tensor([ctx_ids]), torch.tensor([q_ids])
    template = ProxyKVCache.from_pretrained(str(BUNDLED_DIR / BUNDLED_MAPPER), keep_ratio=args.keep_ratio)
    print(f"context {ctx.shape[1]} tokens, question {q.shape[1]}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads", flush=True)
    for cache in (template.fresh(), ProxyKVCache(None, 1.0)):  # first-call costs (thread pools, lazy weights)
        compress_context(model, cache, ctx[:, :WARMUP_TOKENS])

    with tempfile.TemporaryDirectory() as tmp:
        full = compress_context(model, ProxyKVCache(None, 1.0), ctx)
        full.save_context(Path(tmp) / "full", tok)
        full_bytes, full_disk = full.nbytes(), disk_bytes(Path(tmp) / "full")
        del full
        times: dict[str, list[float]] = {"fresh": [], "save": [], "load": [], "loaded_first": []}
        same = True
        for r in range(args.repeats):
            t0 = time.perf_counter()
            cache = compress_context(model, template.fresh(), ctx)
            state = cache.snapshot()  # the compressed context, before the question is appended
            token = first_token(model, cache, q)
            times["fresh"].append(time.perf_counter() - t0)
            cache.restore(state)
            path = Path(tmp) / f"ctx{r}"
            fingerprints._TOKENIZER_MEMO.clear()  # each save and load as the first of its process
            t0 = time.perf_counter()
            cache.save_context(path, tok)
            times["save"].append(time.perf_counter() - t0)
            fingerprints._TOKENIZER_MEMO.clear()
            t0 = time.perf_counter()
            loaded = ProxyKVCache.load_context(path, model, tok)
            times["load"].append(time.perf_counter() - t0)
            same &= first_token(model, loaded, q) == token
            times["loaded_first"].append(time.perf_counter() - t0)
            kv_bytes, saved_disk = cache.nbytes(), disk_bytes(path)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"context_tokens": ctx.shape[1], "keep_ratio": args.keep_ratio, "threads": args.threads,
           "full_kv_bytes": full_bytes, "full_disk_bytes": full_disk, "compressed_kv_bytes": kv_bytes,
           "context_disk_bytes": saved_disk, "disk_over_full_kv": saved_disk / full_bytes,
           "save_s": med["save"], "load_s": med["load"], "first_token_fresh_s": med["fresh"],
           "first_token_loaded_s": med["loaded_first"], "speedup": med["fresh"] / med["loaded_first"],
           "same_first_token": same, "times": times, "torch": torch.__version__}
    mib = 2 ** 20
    print(f"\n| | full cache | ProxyKV, keep {args.keep_ratio} |\n|---|---|---|")
    print(f"| K/V in memory | {full_bytes / mib:.1f} MiB | {kv_bytes / mib:.1f} MiB |")
    print(f"| saved context on disk | {full_disk / mib:.1f} MiB | {saved_disk / mib:.1f} MiB "
          f"({saved_disk / full_bytes:.3f}x the full K/V) |")
    print(f"| save / load | | {med['save']:.3f} s / {med['load']:.3f} s |")
    print(f"| first answer token: fresh prefill + compression | | {med['fresh']:.2f} s |")
    print(f"| first answer token: load + question | | {med['loaded_first']:.3f} s ({out['speedup']:.1f}x sooner; "
          f"same token: {'yes' if same else 'NO'}) |")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
