"""Train ProxyKV mappers for the bundled SmolLM2-135M-Instruct on synthetic RULER-style texts, on a CPU.

    python examples/train_smollm2_mapper.py --out runs/smollm2 --n-per-task 5 --tokens 1024

One KVzip oracle pass per text serves two datasets: the "self" proxy (the target's own attention sums, all 30
layers) and the "layers" proxy (every 3rd decoder layer of the target run as a 10-layer network). The task
families ``vt`` and ``qa`` are held out of training (zero-shot check). Each dataset trains one ``small`` mapper.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import time
from pathlib import Path

import torch

from proxykv_hf.eval.tasks import TASK_FAMILIES
from proxykv_hf.models import load_model_and_tokenizer
from proxykv_hf.scorers.kvzip import kvzip_scores
from proxykv_hf.train import DataConfig, TrainConfig, build_dataset, mapper_config_for, texts_from_tasks, train_mapper

HELD_OUT = ("vt", "qa")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/smollm2")
    p.add_argument("--n-per-task", type=int, default=5)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--crop-len", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--kinds", nargs="+", default=["self", "layers"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--mapper-crop", type=int, default=512, help="the mapper encoder's window (memory ~ window^2)")
    p.add_argument("--reuse-y", default=None, help="a dataset built before from the same texts: take Y from it")
    p.add_argument("--statistics", nargs="+", default=["sum"], choices=["sum", "max"],
                   help="attention statistics stored as proxy features")
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    out = Path(ns.out)
    model, tok = load_model_and_tokenizer()
    tasks = [t for fam, names in TASK_FAMILIES.items() if fam not in HELD_OUT for t in names]
    texts = list(texts_from_tasks(tasks, ns.n_per_task, ns.tokens, tok, seed=ns.seed))
    memo: dict = {}

    @functools.wraps(kvzip_scores)  # the manifest records the oracle by name: kvzip_scores, not this local memo
    def oracle(m, ids, mask, tokenizer=None, **kw):  # one KVzip pass per text, shared by both datasets
        key = ids.cpu().numpy().tobytes()
        if key not in memo:
            memo[key] = kvzip_scores(m, ids, mask, tokenizer=tokenizer, **kw)
        return memo[key]

    summary = {"train_tasks": tasks, "held_out_families": list(HELD_OUT), "texts": len(texts)}
    for kind in ns.kinds:
        cfg = DataConfig(crop_len=ns.crop_len, stride=ns.crop_len // 2, proxy_kind=kind, layer_stride=3,
                         target_model_id="smollm2-135m-instruct", proxy_statistics=ns.statistics)
        t0 = time.time()
        manifest = build_dataset(texts, model, tok, out / f"data-{kind}", cfg, oracle=oracle, scores_from=ns.reuse_y)
        summary[f"data_{kind}_s"] = round(time.time() - t0, 1)
        summary[f"data_{kind}"] = manifest.summary()
        mcfg = mapper_config_for(out / f"data-{kind}", "small", crop_len=ns.mapper_crop, stride=ns.mapper_crop // 2)
        tcfg = TrainConfig(epochs=ns.epochs, warmup_steps=50, batch_size=ns.batch_size, seed=ns.seed, log_every=10)
        t0 = time.time()
        ckpt = train_mapper(out / f"data-{kind}", out / f"mapper-{kind}", mcfg, tcfg)
        summary[f"train_{kind}_s"] = round(time.time() - t0, 1)
        summary[f"metrics_{kind}"] = ckpt.metrics
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(json.dumps(summary, indent=2, default=str))


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
