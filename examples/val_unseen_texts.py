"""Validation metrics of mappers on the texts no run trained on, when a dataset grew between two training runs.

    python examples/val_unseen_texts.py --data data/self-2k --earlier-crops 87 \
        runs/mapper-a runs/mapper-b runs/mapper-c

A resumed ``proxykv build-data`` appends texts, so a run on the grown dataset splits it differently from a run on
the first ``--earlier-crops`` crops: some of the new validation texts were training texts of the earlier run. This
keeps the validation texts of the grown dataset's split (``split_dataset``, by text, ``--val-fraction``, ``--seed``,
as ``proxykv train`` makes it) that were not on the training side of the earlier split, and scores every mapper on
them with :func:`~proxykv_hf.train.evaluate.evaluate_mapper` (each reads its own statistics' feature rows).
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.utils.data import Subset

from proxykv_hf.hub import load_checkpoint
from proxykv_hf.train import MapperDataset, split_dataset
from proxykv_hf.train.evaluate import evaluate_mapper


class _Texts:
    """The text ids of a dataset's first crops: all ``split_dataset`` reads."""

    def __init__(self, text_ids: list[int]):
        self.text_ids = text_ids

    def __len__(self) -> int:
        return len(self.text_ids)


def unseen_val_indices(text_ids: list[int], earlier_crops: int, val_fraction: float, seed: int) -> list[int]:
    """Crops on the validation side of the full split whose texts the earlier split did not train on."""
    if not 0 < earlier_crops <= len(text_ids):
        raise SystemExit(f"--earlier-crops must be in [1, {len(text_ids)}], got {earlier_crops}")
    earlier_train, _ = split_dataset(_Texts(text_ids[:earlier_crops]), val_fraction, seed, by_text=True)
    _, val = split_dataset(_Texts(text_ids), val_fraction, seed, by_text=True)
    seen = {text_ids[i] for i in earlier_train.indices}
    return [i for i in val.indices if text_ids[i] not in seen]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mappers", nargs="+", help="checkpoint directories")
    p.add_argument("--data", required=True)
    p.add_argument("--earlier-crops", type=int, required=True, help="crops the dataset had for the earlier run")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args(argv)
    torch.set_num_threads(1)
    for path in ns.mappers:
        ckpt = load_checkpoint(path)
        ds = MapperDataset(ns.data, statistics=ckpt.proxy.statistics)
        keep = unseen_val_indices(list(ds.text_ids), ns.earlier_crops, ns.val_fraction, ns.seed)
        if not keep:
            raise SystemExit("every validation text of the grown dataset was a training text of the earlier run")
        m = evaluate_mapper(ckpt.mapper, Subset(ds, keep), (0.1, 0.3, 0.5), batch_size=4)
        texts = len({ds.text_ids[i] for i in keep})
        print(path, f"({texts} texts, {len(keep)} crops)",
              json.dumps({k: round(v, 4) for k, v in m.items() if not k.startswith("loss_")}))


if __name__ == "__main__":
    main()
