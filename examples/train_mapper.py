"""Train a ProxyKV mapper for a target model from Python, then prune with it.

How to run me::

    python examples/train_mapper.py --out runs/my-mapper                 # bundled SmolLM2: ~10 min on a 2-core CPU
    python examples/train_mapper.py --model org/target --out runs/target-mapper --n-per-task 20 --epochs 30
    python examples/generate.py --mapper runs/my-mapper/mapper          # use it

Two steps, as ``proxykv build-data`` and ``proxykv train`` run them: (1) per training text, the proxy's attention
statistics (here the ``self`` proxy: the target's own prefill attention, no second model) and the KVzip oracle's
scores, the targets the mapper learns; (2) a ``small`` mapper fitted to them. The texts come from task generators
of the train split that need no extra package. The defaults show the workflow; a mapper worth using needs more
texts and epochs (docs/training.md: recipe, other proxies, the settings of the bundled mapper).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from proxykv_hf.models.loading import DEFAULT_MODEL, load_model_and_tokenizer
from proxykv_hf.train import DataConfig, TrainConfig, build_dataset, mapper_config_for, texts_from_tasks, train_mapper

TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multikey_2", "niah_multivalue", "cwe", "fwe",
         "needle:pycode", "multikey:pycode", "needle:filler-train", "multikey:filler-train",
         "multivalue:filler-train")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="Hub id or directory of the target (default: bundled)")
    p.add_argument("--out", required=True, help="directory for the dataset (data/) and the mapper (mapper/)")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), help="task generators the texts come from")
    p.add_argument("--n-per-task", type=int, default=2, help="texts per task")
    p.add_argument("--tokens", type=int, default=1024, help="length of each text in tokens")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--preset", default="small", choices=["paper", "small", "tiny"], help="mapper size")
    args = p.parse_args(argv)

    out = Path(args.out)
    model, tok = load_model_and_tokenizer(args.model)
    texts = list(texts_from_tasks(args.tasks, args.n_per_task, args.tokens, tok, seed=0))
    data = DataConfig(proxy_kind="self", proxy_statistics=("sum", "max", "lookback"), crop_len=args.tokens,
                      stride=args.tokens // 2, target_model_id=args.model)
    build_dataset(texts, model, tok, out / "data", data)  # resumes: texts already written are skipped

    window = min(512, args.tokens)  # the encoder's window: its memory grows with the window squared
    mapper = mapper_config_for(out / "data", args.preset, crop_len=window, stride=window // 2, direct_path=True)
    train = TrainConfig(epochs=args.epochs, batch_size=4, warmup_steps=20, val_fraction=0.1,
                        layers_per_step=min(6, model.config.num_hidden_layers),
                        cpu=not torch.cuda.is_available())
    ckpt = train_mapper(out / "data", out / "mapper", mapper, train)  # the best epoch by validation loss

    print(json.dumps(ckpt.metrics, indent=2))
    print(f"use it: ProxyKVCache.from_pretrained({str(out / 'mapper')!r}, keep_ratio=0.3)")
    return ckpt.metrics


if __name__ == "__main__":
    main()
