"""The samples of ``proxykv eval --split ruler`` as JSON lines, for running them outside this library (kvpress's
pipeline, in its own virtualenv: scripts/ruler_kvpress.py)::

    python -m proxykv_hf.eval.ruler.export --model qwen2.5-coder-1.5b-instruct --context-lengths 4096 \\
        --n-samples 5 [--tasks vt cwe ...] --out ruler-4k.jsonl

The samples are the harness's own (:class:`~proxykv_hf.eval.harness.EvalConfig` picks the split's tasks and seed,
:func:`~proxykv_hf.eval.tasks.generate` builds them with the model's tokenizer; only the tokenizer is loaded). Each
line holds the sample (``task context_length sample seed context question answer_prefix answers metric``), RULER's
answer budget ``max_new_tokens``, and the prompt as kvpress's pipeline takes it: ``kvpress_context`` and
``kvpress_question`` are the user message cut where the harness cuts the prompt between the compressed context and
the question (:func:`~proxykv_hf.eval.prompts.prompt_texts`), so that ``pipeline(kvpress_context,
question=kvpress_question, answer_prefix=answer_prefix)`` tokenizes to the harness's context and question ids
(``context_tokens``, ``question_tokens``) under the same chat template.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..harness import EvalConfig
from ..prompts import _full_text, encode_sample, prompt_texts
from ..tasks import generate

PROG = "python -m proxykv_hf.eval.ruler.export"


def kvpress_parts(sample, tokenizer) -> tuple[str, str]:
    """``(context, question)`` for kvpress's pipeline: the user message ``context + "\\n\\n" + question`` cut where
    the harness's chat prompt is cut (:func:`~proxykv_hf.eval.prompts.prompt_texts`; right before the question
    where no string split tokenizes exactly)."""
    text, ctx_end, q_start = _full_text(sample, tokenizer)
    try:
        cut = len(prompt_texts(sample, tokenizer)[0])
    except ValueError:
        cut = q_start
    start = ctx_end - len(sample.context)
    return text[start:cut], text[cut:q_start + len(sample.question)]


def records(tokenizer, context_lengths: list[int], n_samples: int, tasks: list[str]):
    """One dict per sample of the ``ruler`` split (the harness's samples), task by task, length by length."""
    cfg = EvalConfig(split="ruler", methods=["full"], tasks=tasks, context_lengths=context_lengths,
                     n_samples=n_samples)
    for task in cfg.tasks:
        for length in cfg.context_lengths:
            for i, s in enumerate(generate(task, cfg.n_samples, length, tokenizer, cfg.seed)):
                ctx, q = encode_sample(s, tokenizer)
                context, question = kvpress_parts(s, tokenizer)
                yield {"task": task, "context_length": length, "sample": i, "seed": cfg.seed, "context": s.context,
                       "question": s.question, "answer_prefix": s.answer_prefix, "answers": s.answers,
                       "metric": s.metric, "max_new_tokens": s.meta["max_new_tokens"], "kvpress_context": context,
                       "kvpress_question": question, "context_tokens": len(ctx), "question_tokens": len(q)}


def _tokenizer(ns):
    if ns.tiny:
        from ...testing import tiny_tokenizer

        return tiny_tokenizer()
    from ...models.loading import load_tokenizer

    return load_tokenizer(ns.model)


def main(argv: list[str] | None = None) -> int:
    from ...models.loading import DEFAULT_MODEL

    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="whose tokenizer sizes the samples: a packaged name, a "
                                                          "local directory or a Hub id")
    p.add_argument("--tiny", action="store_true", help="the tiny test tokenizer (proxykv_hf.testing)")
    p.add_argument("--context-lengths", type=int, nargs="+", default=[4096])
    p.add_argument("--n-samples", type=int, default=5)
    p.add_argument("--tasks", nargs="*", default=[], help="RULER's names (vt cwe ...); all eleven by default")
    p.add_argument("--out", required=True, help="the JSON lines file to write (a new file)")
    ns = p.parse_args(argv)
    out = Path(ns.out).expanduser()
    try:
        if out.exists():
            raise FileExistsError(f"{out} exists; give --out a new file")
        lines = [json.dumps(r) for r in records(_tokenizer(ns), ns.context_lengths, ns.n_samples, ns.tasks)]
        with out.open("x") as f:
            f.write("".join(line + "\n" for line in lines))
    except (ValueError, OSError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {len(lines)} samples to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
