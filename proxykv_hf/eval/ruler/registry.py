"""The RULER benchmark's tasks by name, and the checks before a run: names, seeds, the essays.

Task names are RULER's behind a prefix (``ruler_niah_single_1`` ... ``ruler_fwe``; :data:`TASKS`), apart from the
RULER-style training generators of :mod:`proxykv_hf.eval.tasks`, which keep the bare names and templates of their
own. Samples come from :func:`proxykv_hf.eval.tasks.generate` like every task's, with generator seeds from
:data:`~.templates.SEED_RANGE` only (the ``ruler`` split of :mod:`proxykv_hf.eval.splits` uses 3,000,003)::

    samples = generate("ruler_niah_single_2", n_samples=5, target_tokens=4096, tokenizer=tok, seed=3_000_003)
"""

from __future__ import annotations

import functools

from ..haystack import TaskFn
from . import essays
from .aggregation import common_words, frequent_words
from .niah import niah_sample
from .templates import ESSAY_TASKS, NAMES, NIAH_TASKS, PREFIX, SEED_RANGE
from .tracing import variable_tracking

TASKS: dict[str, TaskFn] = {
    **{PREFIX + name: functools.partial(niah_sample, name=name, settings=s) for name, s in NIAH_TASKS.items()},
    PREFIX + "vt": variable_tracking,
    PREFIX + "cwe": common_words,
    PREFIX + "fwe": frequent_words,
}
"""Task name -> generator ``(TaskRequest) -> Sample``, in RULER's order."""


def is_ruler(task: str) -> bool:
    """Whether ``task`` names a task of this benchmark (by its prefix; it may still be unknown)."""
    return task.startswith(PREFIX)


def full_name(task: str) -> str:
    """``task`` as a key of :data:`TASKS`: RULER's own name (``"vt"``) gets the prefix.

    Raises:
        ValueError: neither a RULER name built here nor one with the prefix.
    """
    name = task if is_ruler(task) else PREFIX + task
    if name not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; choose from {', '.join(NAMES)} (qa_1 and qa_2 need SQuAD "
                         "and HotpotQA and are not built)")
    return name


def task_fn(task: str) -> TaskFn:
    """The generator of the RULER task ``task`` (a key of :data:`TASKS`); ``ValueError`` for any other name."""
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; choose from {', '.join(TASKS)}")
    return TASKS[task]


def check_seed(seed: int) -> None:
    """``ValueError`` unless ``seed`` is one of RULER's own generator seeds (:data:`~.templates.SEED_RANGE`)."""
    if seed not in SEED_RANGE:
        raise ValueError(f"RULER samples come from their own generator seeds, in [{SEED_RANGE.start}, "
                         f"{SEED_RANGE.stop}) (the ruler split uses 3000003), got {seed}")


def check_ready(tasks) -> None:
    """``ValueError`` with the install command when one of ``tasks`` reads the essays and they are not installed
    (before any model loads)."""
    if any(t.removeprefix(PREFIX) in ESSAY_TASKS for t in tasks if is_ruler(t)):
        essays.essay_files()
