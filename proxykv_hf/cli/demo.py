"""``proxykv demo``: questions about one long file, each answered from a cache compressed once per method.

The file (a Python module shipped with the package, ``demo_files/``) is prefilled and compressed alone, as a user
would compress a document before knowing what will be asked (query-agnostic); every question then continues the
same compressed cache. Per method the table shows each answer and whether it is right, the time to first token of
the first question (context prefill + scoring + compaction + the question's forward) and the K/V bytes kept; the
last line counts, among the questions the full cache answers, those each method still answers. Every method first
compresses the context's first :data:`WARMUP_TOKENS` tokens untimed, so no time holds first-call costs.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from importlib import resources

import torch
from tqdm.auto import tqdm

from ..cache.proxykv_cache import ProxyKVCache
from ..contexts.chat_prompt import encode_chat_prompt
from ..attention.compat import with_cache
from ..eval.methods import build_method
from ..eval.metrics import string_match_part
from ..contexts.pipeline import answer_from_cache, compress_context
from ..scorers.registry import ScorerContext

WARMUP_TOKENS = 128
ANSWER_TOKENS = 24
TINY_CHARS = 1000  # --tiny: the file's first characters (the byte-level tiny tokenizer makes one token a byte)


@dataclass(frozen=True)
class Question:
    question: str
    answers: list[str]


def demo_document(name: str = "stock_sync") -> tuple[str, list[Question]]:
    """``(context, questions)`` of a bundled demo file: the intro line and the file, and its questions."""
    root = resources.files("proxykv_hf.cli") / "demo_files"
    spec = json.loads((root / f"{name}.json").read_text())
    text = (root / spec["file"]).read_text()
    context = f"{spec['intro']}\n\n```python\n{text}```"
    return context, [Question(q["question"], list(q["answers"])) for q in spec["questions"]]


@torch.no_grad()
def _question_forward_seconds(model, cache: ProxyKVCache, q: torch.Tensor) -> float:
    """Seconds for the question's forward on the compressed cache (the rest of the time to first token)."""
    state = cache.snapshot()
    n = cache.get_seq_length()
    t0 = time.perf_counter()
    model(input_ids=q, **with_cache(cache), position_ids=torch.arange(n, n + q.shape[1])[None], logits_to_keep=1)
    seconds = time.perf_counter() - t0
    cache.restore(state)
    return seconds


def _one_line(text: str) -> str:
    return "".join(c if c.isprintable() else " " for c in " ".join(text.split()))


def run_demo(model, tok, scorers: dict, keep_ratio: float, *, context: str, questions: list[Question],
             out=print) -> dict:
    """Answer ``questions`` about ``context`` with each method of ``scorers`` (``{name: scorer or None}``, None:
    the full cache) and print the tables; returns ``{method: {"answers", "correct", "ttft_s", "kv_bytes"}}``."""
    encoded = [encode_chat_prompt(tok, context, q.question, name="demo") for q in questions]
    ctx_ids = encoded[0][0]
    if any(c != ctx_ids for c, _ in encoded):
        raise ValueError("the demo's questions do not share one tokenization of the context")
    device = model.device
    ctx = torch.tensor([ctx_ids], device=device)
    qs = [torch.tensor([q], device=device) for _, q in encoded]
    out(f"context: {ctx.shape[1]} tokens; {len(questions)} questions; keep_ratio {keep_ratio} for the pruned methods")

    def fresh_cache(scorer) -> ProxyKVCache:
        return ProxyKVCache(None, 1.0) if scorer is None else ProxyKVCache(scorer.fresh(), keep_ratio)

    for name in tqdm(scorers, desc="warm-up", unit="method"):
        compress_context(model, fresh_cache(scorers[name]), ctx[:, :WARMUP_TOKENS])
    results = {}
    for name in tqdm(scorers, desc="methods", unit="method"):
        cache = fresh_cache(scorers[name])
        t0 = time.perf_counter()
        compress_context(model, cache, ctx)
        ttft = time.perf_counter() - t0 + _question_forward_seconds(model, cache, qs[0])
        answers = []
        for q in qs:
            ids = answer_from_cache(model, cache, ctx, q, max_new_tokens=ANSWER_TOKENS, do_sample=False,
                                    pad_token_id=tok.pad_token_id)
            answers.append(_one_line(tok.decode(ids[0], skip_special_tokens=True).strip()))
        correct = [string_match_part(a, q.answers) == 1.0 for a, q in zip(answers, questions)]
        results[name] = {"answers": answers, "correct": correct, "ttft_s": ttft, "kv_bytes": cache.nbytes(),
                         "keep_ratio": cache.keep_ratio}
    _print_tables(results, questions, out)
    return results


def _print_tables(results: dict, questions: list[Question], out) -> None:
    width = 40
    for i, q in enumerate(questions):
        out(f"\nQ{i + 1}: {q.question}  (expected: {' / '.join(q.answers)})")
        for name, r in results.items():
            a = r["answers"][i]
            short = a if len(a) <= width else a[: width - 1] + "…"
            out(f"  {name:<9} {'right' if r['correct'][i] else 'wrong':<5}  {short}")
    out(f"\n{'method':<9} {'keep':>5} {'right':>6} {'TTFT s':>7} {'KV MiB':>7}")
    for name, r in results.items():
        out(f"{name:<9} {r['keep_ratio']:>5.2f} {sum(r['correct']):>3}/{len(questions):<2} {r['ttft_s']:>7.2f} "
            f"{r['kv_bytes'] / 2**20:>7.1f}")
    base = results.get("full")
    if base is not None:
        asked = [i for i, ok in enumerate(base["correct"]) if ok]
        kept = ", ".join(f"{name} {sum(r['correct'][i] for i in asked)}" for name, r in results.items()
                         if name != "full")
        out(f"\nof the {len(asked)} questions the full cache answers, still answered: {kept or '-'}")


def _convert_side_by_side(ns) -> None:
    """Convert the packaged target and the packaged proxy its ProxyKV mapper reads side by side, where both still
    need it (:func:`~proxykv_hf.models.model_cache.convert_packaged`): the first run's conversion in the time of the
    target's alone."""
    from .helpers import mapper_for
    from ..mapper.hub import load_checkpoint
    from ..models.model_cache import convert_packaged

    names = [ns.model]
    mapper = mapper_for(ns, None) if "proxykv" in ns.methods else None
    if mapper is not None:
        proxy = load_checkpoint(mapper).proxy
        if proxy.kind == "model":
            names.append(proxy.model_id)
    convert_packaged(names)


def main(ns) -> int:
    """``proxykv demo``: load the model (``--model``, the Qwen2.5-Coder-1.5B by default), build each method, run."""
    from .helpers import load, mapper_for

    print("loading a tiny random model ..." if ns.tiny else
          f"loading {ns.model} (a packaged model's first load converts its GGUF file once) ...", flush=True)
    if not ns.tiny:
        _convert_side_by_side(ns)
    model, tok = load(ns)
    context, questions = demo_document()
    if ns.tiny:
        context = context[:TINY_CHARS]
    questions = questions[: ns.questions]
    mapper = mapper_for(ns, model)
    methods = [m for m in ns.methods if m != "proxykv" or mapper is not None]
    if len(methods) < len(ns.methods):
        print(f"no ProxyKV mapper is bundled for {ns.model}: skipping proxykv (pass --mapper)")
    options = ScorerContext(tokenizer=tok, mapper=mapper)
    scorers = {method: build_method(method, model, options) for method in methods}
    run_demo(model, tok, scorers, ns.keep_ratio, context=context, questions=questions)
    return 0
