"""kvpress 0.5.5's presses on the samples of ``proxykv eval --split ruler``, written as this library's eval records.

How to run me (kvpress pins transformers<5.3, so it gets a virtualenv of its own and never imports proxykv_hf)::

    python3 -m venv .venv-kvpress && .venv-kvpress/bin/pip install torch==2.13.0 "kvpress==0.5.5"
    python -m proxykv_hf.eval.ruler.export --model qwen2.5-coder-1.5b-instruct --context-lengths 4096 \\
        --n-samples 5 --out ruler-4k.jsonl                                  # this library's env: the samples
    .venv-kvpress/bin/python scripts/ruler_kvpress.py --samples ruler-4k.jsonl \\
        --model ~/.cache/proxykv_hf/qwen2.5-coder-1.5b-instruct --presses kvzip snapkv \\
        --keep-ratios 0.75 0.5 0.25 0.125 --dtype float32 --out runs/kvpress-ruler-4k/results.jsonl
    python scripts/results_tables.py runs/kvpress-ruler-4k/results.jsonl our/results.jsonl --merge --split ruler

--model: the model's directory with its tokenizer (KVzipPress reloads it from there; the export's tokenizer, else the
progress line shows both context token counts). Per sample: ``kvpress_full`` (no press) at keep 1.0, then
``kvpress_kvzip`` (``KVzipPress()``: global selection across layers, as kvpress's RULER board) and ``kvpress_snapkv``
(``SnapKVPress()``) at compression_ratio = 1 - keep ratio; greedy, RULER's per-task answer budget, the context
compressed alone (query-agnostic). Resumes: records already in --out are skipped.

The prompt is the harness's: user message ``context + "\\n\\n" + question``, RULER's answer prefix opening the
assistant turn, cut between context and question where the harness cuts it (the export's ``kvpress_context`` /
``kvpress_question``): the same context ids. kvpress's RULER board has one newline there and a space after the
question. ``kv_bytes``: the cache after prefill (KVzipPress masks what it evicts, SnapKVPress removes it).
"""

import argparse
import json
import re
import time
from pathlib import Path


def score(prediction: str, answers: list[str], metric: str) -> float:
    """RULER's string_match_all ("all") / string_match_part ("part") of one prediction, in [0, 1]; mirrors
    proxykv_hf.eval.metrics.score_sample (control characters to newlines, strip, case-insensitive containment)."""
    if metric not in ("all", "part"):
        raise ValueError(f"unknown metric {metric!r}; choose from all, part")
    pred = re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip().lower()
    hits = [a.lower() in pred for a in answers]
    return sum(hits) / len(hits) if metric == "all" else float(any(hits))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", required=True, help="JSON lines of python -m proxykv_hf.eval.ruler.export")
    p.add_argument("--model", required=True, help="the model's directory (with its tokenizer) or Hub id")
    p.add_argument("--presses", nargs="+", default=["kvzip", "snapkv"], choices=["kvzip", "snapkv"])
    p.add_argument("--keep-ratios", type=float, nargs="+", default=[0.75, 0.5, 0.25, 0.125])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="default: cuda where there is one, else cpu")
    p.add_argument("--out", required=True, help="results.jsonl to write or resume")
    ns = p.parse_args(argv)
    import torch
    from kvpress import KVzipPress, SnapKVPress  # registers the kv-press-text-generation pipeline
    from transformers import DynamicCache, pipeline

    samples = [json.loads(line) for line in Path(ns.samples).read_text().splitlines() if line.strip()]
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {(r["task"], r["context_length"], r["sample"], r["method"], r["keep_ratio"]) for r in
            map(json.loads, out.read_text().splitlines() if out.exists() else [])}
    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    pipe = pipeline("kv-press-text-generation", model=ns.model, device=device, dtype=getattr(torch, ns.dtype))
    marks: list[float] = []  # the start of answering: the first call of the model with its head
    pipe.model.register_forward_pre_hook(lambda *_: marks.append(time.perf_counter()))
    runs = [("full", None, 1.0)] + [(n, KVzipPress if n == "kvzip" else SnapKVPress, k) for n in ns.presses
                                    for k in ns.keep_ratios]
    with out.open("a") as log:
        for k, (s, (name, press, keep)) in enumerate(((s, r) for s in samples for r in runs), 1):
            key = (s["task"], s["context_length"], s["sample"], f"kvpress_{name}", keep)
            if key in done:
                continue
            q = s["kvpress_question"]
            n_tokens = pipe.preprocess(s["kvpress_context"], [q], s["answer_prefix"], 10**9)["context_ids"].shape[1]
            cache, t0 = DynamicCache(), time.perf_counter()
            marks.clear()
            with torch.inference_mode():
                pred = pipe(s["kvpress_context"], question=q, answer_prefix=s["answer_prefix"],
                            press=press(compression_ratio=1 - keep) if press else None,
                            max_new_tokens=s["max_new_tokens"], cache=cache)["answer"]
            t1 = time.perf_counter()
            kv_bytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
            rec = dict(zip(("task", "context_length", "sample", "method", "keep_ratio"), key),
                       score=score(pred, s["answers"], s["metric"]), prediction=pred, answers=s["answers"],
                       n_tokens=n_tokens, kv_bytes=kv_bytes, seed=s["seed"], protocol="query-agnostic",
                       prefill_s=round(marks[0] - t0, 4), answer_s=round(t1 - marks[0], 4))
            print(json.dumps(rec), file=log, flush=True)
            odd = "" if n_tokens == s["context_tokens"] else f", export's tokenizer: {s['context_tokens']} tokens"
            print(f"[{k}/{len(samples) * len(runs)}] {key[0]} #{key[2]} {key[3]} keep {keep}: score "
                  f"{rec['score']:.2f} ({t1 - t0:.1f}s, {n_tokens} context tokens{odd})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
