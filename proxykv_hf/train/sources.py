"""Text sources for :func:`~proxykv_hf.train.data.build_dataset`: the synthetic task generators, local
``.txt`` / ``.jsonl`` files, and HF ``datasets`` (optional)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator, Sequence


def texts_from_tasks(task_names: Sequence[str], n_per_task: int, target_tokens: int | Sequence[int], tokenizer,
                     seed: int = 0) -> Iterator[dict]:
    """Synthetic task samples (:func:`proxykv_hf.eval.tasks.generate`) as texts ``context + "\\n\\n" + question``.

    Args:
        task_names: RULER names (``proxykv_hf.eval.tasks.TASKS``) or ``"family:corpus"`` over a train corpus.
        n_per_task: samples per task and length.
        target_tokens: context length(s) in tokens; a sequence gives ``n_per_task`` samples at each.
        tokenizer: used by the generators to size contexts.
        seed: base seed (each task and length gets its own derived seed).

    Raises:
        ValueError: an unknown task, a dev or test corpus, or a derived seed at or above
            :data:`~proxykv_hf.eval.splits.TRAIN_SEED_LIMIT` (:func:`~proxykv_hf.eval.splits.check_training_tasks`).
    """
    from ..eval import tasks as task_lib
    from ..eval.splits import check_training_tasks

    lengths = [target_tokens] if isinstance(target_tokens, int) else list(target_tokens)
    # the largest generator seed below is seed + 1000 * (tasks - 1) + (lengths - 1)
    check_training_tasks(task_names, seed + 1000 * max(len(task_names) - 1, 0) + len(lengths) - 1)
    for t_i, task in enumerate(task_names):
        for l_i, n_tok in enumerate(lengths):
            samples = task_lib.generate(task, n_per_task, n_tok, tokenizer, seed + 1000 * t_i + l_i)
            for s in samples:
                yield {"text": f"{s.context}\n\n{s.question}", "source": task}


def texts_from_files(paths: str | os.PathLike | Sequence[str | os.PathLike], *, split_paragraphs: bool = False,
                     field: str = "text") -> Iterator[dict]:
    """Texts from ``.txt`` files (one document per file, or per blank-line-separated block with
    ``split_paragraphs``) and ``.jsonl`` files (the ``field`` of each line); directories are searched for both (a
    directory holding neither raises ``ValueError``)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for p in map(Path, paths):
        found = sorted([*p.glob("*.txt"), *p.glob("*.jsonl")]) if p.is_dir() else [p]
        if not found:
            raise ValueError(f"the directory {p} holds no .txt or .jsonl file to read texts from")
        files += found
    for path in files:
        if path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    if line.strip():
                        record = json.loads(line)
                        if field not in record:
                            raise ValueError(f"{path}:{n} has no {field!r} field (keys {sorted(record)})")
                        yield {"text": record[field], "source": path.stem}
        elif path.suffix == ".txt":
            text = path.read_text(encoding="utf-8")
            blocks = [b.strip() for b in text.split("\n\n")] if split_paragraphs else [text.strip()]
            yield from ({"text": b, "source": path.stem} for b in blocks if b)
        else:
            raise ValueError(f"unsupported file type {path.suffix!r} ({path}); use .txt or .jsonl")


def texts_from_hf_dataset(name: str, split: str = "train", field: str = "text", n: int | None = None,
                          **load_kwargs) -> Iterator[dict]:
    """The ``field`` of the first ``n`` rows of a ``datasets`` dataset (streamed). Needs the ``datasets`` package."""
    try:
        import datasets
    except ImportError as err:
        raise ImportError("texts_from_hf_dataset needs the optional 'datasets' package (pip install datasets); "
                          "or save the texts as .jsonl and use texts_from_files") from err
    ds = datasets.load_dataset(name, split=split, streaming=True, **load_kwargs)
    for i, row in enumerate(ds):
        if n is not None and i >= n:
            break
        yield {"text": row[field], "source": name}
