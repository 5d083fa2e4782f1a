"""``proxykv demo``: one long prompt with a fact to retrieve, answered with each method on the same model.

For each method the context is prefilled and compressed alone (query-agnostic), then the question is asked on the
compressed cache. Printed per method: the answer, whether it is right, the time to first token (context prefill
+ scoring + compaction + the question's forward) and the KV-cache bytes kept. Every method first compresses the
context's first :data:`WARMUP_TOKENS` tokens untimed, so that no method's time holds the process's first-call costs
(thread pools, kernel set-up, lazily read weights).
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from .cache import ProxyKVCache
from .compat import with_cache
from .eval import tasks as task_lib
from .eval.methods import build_method
from .eval.metrics import score_sample
from .pipeline import answer_from_cache, compress_context
from .scorers.registry import ScorerContext

WARMUP_TOKENS = 512
ANSWER_TOKENS = 40  # answers are capped as in the evaluation (docs/results.md: --max-new-tokens 40)


@torch.no_grad()
def _first_token_time(model, cache, ctx, q) -> float:
    """Seconds for the question's forward on the compressed cache (the rest of the time to first token)."""
    state = cache.snapshot()
    ids = q.to(ctx.device)
    n = cache.get_seq_length()
    t0 = time.perf_counter()
    model(input_ids=ids, **with_cache(cache), position_ids=torch.arange(n, n + ids.shape[1])[None],
          logits_to_keep=1)
    seconds = time.perf_counter() - t0
    cache.restore(state)
    return seconds


def run_demo(ns) -> int:
    from .cli_helpers import load, mapper_for

    print("loading the model (the first run converts the bundled GGUF once, ~30 s) ...", flush=True)
    model, tok = load(ns)
    sample = task_lib.generate(ns.task, 1, ns.context_tokens, tok, ns.seed)[0]
    ctx_ids, q_ids = task_lib.encode_sample(sample, tok)
    ctx, q = torch.tensor([ctx_ids]), torch.tensor([q_ids])
    print(f"prompt: {ctx.shape[1] + q.shape[1]} tokens, task {sample.task}; question: {sample.question!r}")
    rows = []
    mapper = mapper_for(ns, model)
    options = ScorerContext(tokenizer=tok, mapper=mapper)
    methods = [m for m in ns.methods if m != "proxykv" or mapper is not None]
    if len(methods) < len(ns.methods):
        print("no mapper checkpoint found: skipping proxykv (pass --mapper)")
    scorers = {method: build_method(method, model, options) for method in methods}

    def fresh_cache(scorer) -> ProxyKVCache:
        return ProxyKVCache(None, 1.0) if scorer is None else ProxyKVCache(scorer.fresh(), ns.keep_ratio)

    for method in tqdm(methods, desc="warm-up", unit="method"):
        compress_context(model, fresh_cache(scorers[method]), ctx[:, :WARMUP_TOKENS])
    for method in tqdm(methods, desc="methods", unit="method"):
        cache = fresh_cache(scorers[method])
        t0 = time.perf_counter()
        compress_context(model, cache, ctx)
        t_compress = time.perf_counter() - t0
        t_first = _first_token_time(model, cache, ctx, q)
        out = answer_from_cache(model, cache, ctx, q, max_new_tokens=ANSWER_TOKENS, do_sample=False,
                                pad_token_id=tok.pad_token_id)
        answer = tok.decode(out[0], skip_special_tokens=True).strip()
        answer = "".join(c if c.isprintable() else " " for c in " ".join(answer.split()))  # one table line
        rows.append((method, cache.keep_ratio, answer, score_sample(sample, answer), t_compress + t_first,
                     cache.nbytes()))
    width = max(len(r[2]) for r in rows)
    width = min(max(width, 6), 48)
    print(f"\nexpected answer: {sample.answers}")
    print(f"{'method':<10} {'keep':>5} {'answer':<{width}} {'correct':>7} {'TTFT s':>7} {'KV MiB':>7}")
    for method, ratio, answer, score, ttft, nbytes in rows:
        short = answer if len(answer) <= width else answer[: width - 1] + "…"
        print(f"{method:<10} {ratio:>5.2f} {short:<{width}} {'yes' if score == 1 else 'no':>7} {ttft:>7.2f} "
              f"{nbytes / 2**20:>7.1f}")
    if any(len(r[2]) > width for r in rows):
        print("\nthe answers in full:")
        for method, _, answer, _, _, _ in rows:
            print(f"{method:<10} {answer}")
    return 0
