"""Training tooling on top of the core: data building (:mod:`.data`), the hybrid loss (:mod:`.losses`), retention
metrics (:mod:`.metrics`) and the training loop (:mod:`.loop`)."""

from .data import (DataConfig, Manifest, MapperDataset, build_dataset, crop_starts, split_dataset, texts_from_files,
                   texts_from_hf_dataset, texts_from_tasks)
from .loop import TrainConfig, evaluate_mapper, mapper_config_for, plot_training, train_mapper

__all__ = [
    "DataConfig",
    "Manifest",
    "MapperDataset",
    "TrainConfig",
    "build_dataset",
    "crop_starts",
    "evaluate_mapper",
    "mapper_config_for",
    "plot_training",
    "split_dataset",
    "texts_from_files",
    "texts_from_hf_dataset",
    "texts_from_tasks",
    "train_mapper",
]
