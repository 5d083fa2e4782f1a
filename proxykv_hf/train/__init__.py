"""Training tooling on top of the core: text sources (:mod:`.sources`), data building (:mod:`.data`, with
:mod:`.manifest`, :mod:`.features` and :mod:`.shards`), reading it back (:mod:`.dataset`), the hybrid loss
(:mod:`.losses`), retention metrics (:mod:`.metrics`) and the training loop (:mod:`.loop`, with its settings in
:mod:`.config`, and :mod:`.mapper_init`, :mod:`.optim`, :mod:`.resume` and :mod:`.evaluate`)."""

from .data import build_dataset
from .dataset import MapperDataset, split_dataset
from .evaluate import evaluate_mapper, plot_training
from .loop import TrainConfig, mapper_config_for, train_mapper
from .manifest import DataConfig, Manifest
from .shards import crop_starts, merge_datasets
from .sources import texts_from_files, texts_from_hf_dataset, texts_from_tasks

__all__ = [
    "DataConfig",
    "Manifest",
    "MapperDataset",
    "TrainConfig",
    "build_dataset",
    "crop_starts",
    "evaluate_mapper",
    "mapper_config_for",
    "merge_datasets",
    "plot_training",
    "split_dataset",
    "texts_from_files",
    "texts_from_hf_dataset",
    "texts_from_tasks",
    "train_mapper",
]
