"""Compare KV-cache pruning methods on your own document and question: each method's answer, time and KV memory.

How to run me::

    python examples/compare_methods.py --document report.txt --question "Who signed the contract?"
    python examples/compare_methods.py --methods full proxykv snapkv streaming random --keep-ratio 0.2
    python examples/compare_methods.py --model org/target --mapper org/mapper-for-that-target

Without ``--document`` the text is generate.py's pass-key document. Each method compresses the document alone (it
does not see the question, as when one document answers many questions), then answers the question from the
compressed cache, through :class:`proxykv_hf.ProxyKVPipeline`. ``seconds`` is compression plus answer; ``KV MiB`` is
what the compressed document keeps. KVzip, the oracle ProxyKV learns from, is the slowest (several x the full
prefill). One document says little about a method: docs/results.md compares them over many.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from generate import pass_key_document  # examples/generate.py, beside this file

from proxykv_hf import KVzipScorer, ProxyKVCache, ProxyKVPipeline, RandomScorer, SnapKVScorer, StreamingLLMScorer
from proxykv_hf.mapper.hub import BUNDLED_DIR, BUNDLED_MAPPER
from proxykv_hf.models.loading import DEFAULT_MODEL, load_model_and_tokenizer

METHODS = ("full", "proxykv", "kvzip", "snapkv", "streaming", "random")


def cache_template(method: str, keep_ratio: float, mapper: str, tokenizer) -> ProxyKVCache:
    """The cache each method answers with: one ProxyKVCache class, a different scorer per method."""
    if method == "full":
        return ProxyKVCache(None, 1.0)  # no scorer: keeps everything
    if method == "proxykv":
        return ProxyKVCache.from_pretrained(mapper, keep_ratio=keep_ratio)
    scorer = {"kvzip": lambda: KVzipScorer(tokenizer), "snapkv": SnapKVScorer, "streaming": StreamingLLMScorer,
              "random": RandomScorer}[method]()
    return ProxyKVCache(scorer, keep_ratio)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="Hub id or directory of the target (default: bundled)")
    p.add_argument("--mapper", default=str(BUNDLED_DIR / BUNDLED_MAPPER),
                   help="ProxyKV mapper trained for the target: directory or Hub id (default: bundled)")
    p.add_argument("--document", help="a text file (default: plain sentences with a pass key)")
    p.add_argument("--question", default="What is the pass key?")
    p.add_argument("--methods", nargs="+", default=["full", "proxykv", "snapkv", "kvzip"], choices=METHODS)
    p.add_argument("--keep-ratio", type=float, default=0.3, help="share of the document's K/V entries kept")
    p.add_argument("--max-new-tokens", type=int, default=32)
    args = p.parse_args(argv)

    model, tok = load_model_and_tokenizer(args.model)
    document = Path(args.document).read_text() if args.document else pass_key_document()
    rows = []
    for method in args.methods:
        template = cache_template(method, args.keep_ratio, args.mapper, tok)
        used = []  # the pipeline asks for a fresh cache per call; keep it to read its size afterwards
        pipe = ProxyKVPipeline(model, tok, lambda: used.append(template.fresh()) or used[-1])
        start = time.perf_counter()
        answer = pipe.ask(document, args.question, max_new_tokens=args.max_new_tokens)
        rows.append({"method": method, "keep_ratio": template.keep_ratio, "seconds": time.perf_counter() - start,
                     "kv_mib": used[-1].nbytes() / 2**20, "answer": " ".join(answer.split())})

    print(f"{'method':<10} {'keep':>5} {'seconds':>8} {'KV MiB':>7}  answer")
    for r in rows:
        print(f"{r['method']:<10} {r['keep_ratio']:>5.2f} {r['seconds']:>8.2f} {r['kv_mib']:>7.1f}  {r['answer']}")
    return rows


if __name__ == "__main__":
    main()
