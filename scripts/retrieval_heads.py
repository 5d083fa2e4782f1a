"""Which KV heads read a pass key when the model answers for it: each (layer, KV head)'s retrieval mass on train
texts (a train-split tool; ``copy_novelty.py``'s ``retN`` blends weigh each head by it).

Per sample, one forward of the whole cache over context + question + the right answer with eager attention; a
head's mass is the attention its queries at the answer's positions (each predicting the next answer token) give to
the answer's tokens in the context, the largest over those queries and over the KV head's query heads; the output
is its mean over the samples, a list per layer of one value per KV head (JSON).

How to run me (train split only: what it writes is fitted)::

    python scripts/retrieval_heads.py --task passkey:filler-train --seed 720000 --n-samples 30 \\
        --out docs/data/retrieval_heads_smollm2.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from layer_swap import answer_positions

from proxykv_hf.eval import tasks as task_lib
from proxykv_hf.eval.prompts import encode_sample
from proxykv_hf.eval.splits import split_of_task
from proxykv_hf.models import DEFAULT_MODEL, load_model_and_tokenizer


@torch.no_grad()
def retrieval_mass(model, ctx_ids: list[int], q_ids: list[int], ans_ids: list[int], positions: list[int],
                   n_kv_heads: int) -> torch.Tensor:
    """`(L, H_kv)`: per layer and KV head, the attention the answer's queries give to ``positions`` (summed over
    them; the largest over the answer's queries and the KV head's query heads)."""
    ids = torch.tensor([ctx_ids + q_ids + ans_ids])
    attentions = model(ids, output_attentions=True).attentions  # per layer (1, H, N, N)
    queries = list(range(len(ctx_ids) + len(q_ids) - 1, ids.shape[1] - 1))
    rows = []
    for a in attentions:
        mass = a[0][:, queries][:, :, positions].sum(-1).amax(-1)  # (H,)
        rows.append(mass.view(n_kv_heads, -1).amax(-1))
    return torch.stack(rows).float()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="passkey:filler-train")
    p.add_argument("--seed", type=int, default=720000)
    p.add_argument("--n-samples", type=int, default=30)
    p.add_argument("--context-length", type=int, default=2048)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--out", required=True, help="JSON file to write")
    ns = p.parse_args(argv)
    if split_of_task(ns.task) != "train":
        raise SystemExit(f"retrieval_heads.py fits on the train split only; {ns.task!r} is not a train task")
    model, tok = load_model_and_tokenizer(ns.model)
    model.set_attn_implementation("eager")  # the probabilities themselves
    total, n = None, 0
    for i, sample in enumerate(task_lib.generate(ns.task, ns.n_samples, ns.context_length, tok, ns.seed)):
        ctx_ids, q_ids = encode_sample(sample, tok)
        positions = answer_positions(tok, ctx_ids, sample.answers)
        if not positions:
            continue
        ans_ids = tok(" " + sample.answers[0], add_special_tokens=False)["input_ids"]
        mass = retrieval_mass(model, ctx_ids, q_ids, ans_ids, positions, model.config.num_key_value_heads)
        total = mass if total is None else total + mass
        n += 1
        print(f"sample {i}: the most read head is layer {divmod(int(mass.argmax()), mass.shape[1])}", flush=True)
    if not n:
        raise SystemExit("no sample had its answer in the context")
    table = (total / n).tolist()
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps([[round(v, 4) for v in row] for row in table]) + "\n")
    print(f"{n} samples -> {ns.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
