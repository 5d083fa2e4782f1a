"""One evaluation run by several processes (or GPUs): ``eval`` under ``torchrun`` or ``accelerate launch``.

How to run me (the CLI wraps it)::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m proxykv_hf.cli eval --split test --out runs/test

Every process loads its own model (``--device cuda`` becomes ``cuda:LOCAL_RANK``) and runs the samples whose index
is its rank modulo the world size, for every task, length and method: ``EvalConfig.num_shards`` and ``shard_index``
taken from the launch (giving them as well is an error). A sample depends only on its task, seed and index, so the
ranks' records together are those of one process. Rank ``r`` writes its ``config.json`` and ``results.jsonl`` into
``out/rank-RRRRR-of-WWWWW/`` (kept there: a rerun resumes each rank from its own records, as one process resumes
from its ``results.jsonl``); KVzip's stored scores go to the shared ``out/oracle/``, one file a sample. Rank 0 then
waits until the ranks' files hold every record of the run, as ``build-data`` does (no process group: the ranks meet
through the file system, which all of them must share), merges them into ``out/results.jsonl`` in the order one
process writes them, and writes ``out/config.json`` (the whole run's config, rank 0's environment and
``world_size``) and the report once. The records ``out/results.jsonl`` held before (a run stopped in one process, or
an earlier merge) count as written for every rank and stay in the merge; so do those of rank directories of another
world size.

CPU ranks each run ``OMP_NUM_THREADS`` torch threads (``torchrun`` sets 1 where it is not set): on 2 cores give
``OMP_NUM_THREADS=1`` to 2 ranks.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Iterable, Sequence

from ..scorers.registry import ScorerContext
from ..train.distributed import Launch, rank_dir
from .harness import EvalConfig, Harness, method_runs, run_eval, write_whole

logger = logging.getLogger(__name__)

__all__ = ["EVAL_EPILOG", "TIMING_FIELDS", "launch_of", "merge_records", "planned_keys", "rank_config", "read_records",
           "run_eval_distributed"]

EVAL_EPILOG = """\
Several processes (or GPUs) share one run under torchrun, each running every N-th sample
(--num-shards/--shard-index are taken from the launch: give them only without it):

  OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m proxykv_hf.cli eval ... --out DIR

Each process writes its records into DIR/rank-RRRRR-of-WWWWW/ (kept: a rerun resumes each from
its own); rank 0 merges them into DIR/results.jsonl, in one process's order, and writes the
report. --device cuda is cuda:LOCAL_RANK. CPU processes run OMP_NUM_THREADS torch threads each:
1 for 2 processes on 2 cores."""
"""The end of ``proxykv eval --help``: how to run it under ``torchrun``."""

TIMING_FIELDS = ("prefill_s", "answer_s")
"""The record fields that differ from one run (or process) to another; a merged record equals one process's in all
others."""


def record_key(record: dict) -> tuple:
    """What a record is of: ``(task, context_length, sample, method, keep_ratio)``, as the harness skips it."""
    return record["task"], record["context_length"], record["sample"], record["method"], record["keep_ratio"]


def read_records(path: Path) -> list[dict]:
    """The records on the complete lines of ``path`` (none if it is missing), read only: a last line still being
    written, or cut off by a stopped run, is left out (and left there for its own process to cut)."""
    if not path.exists():
        return []
    text = path.read_text()
    records = []
    for number, line in enumerate(text[:text.rfind("\n") + 1].splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
            record_key(records[-1])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}, line {number}: not an evaluation record ({e}); move the file away or fix the "
                             "line to resume") from None
    return records


def rank_config(config: EvalConfig, launch: Launch) -> EvalConfig:
    """This process's share of ``config``: ``num_shards`` = world size, ``shard_index`` = rank (``config`` itself in
    a launch of one process)."""
    if not launch.distributed:
        return config
    if (config.num_shards, config.shard_index) != (1, 0):
        raise ValueError(f"--num-shards {config.num_shards} --shard-index {config.shard_index} split a run by hand, "
                         f"but this is process {launch.rank} of {launch.world_size} under torchrun, which splits it: "
                         "give one or the other")
    return dataclasses.replace(config, num_shards=launch.world_size, shard_index=launch.rank)


def launch_of(config: EvalConfig, env: dict[str, str] | None = None) -> Launch:
    """This process's place in a launch (:meth:`Launch.from_env`), checked against ``config`` before any model loads
    (:func:`rank_config`)."""
    launch = Launch.from_env(env)
    rank_config(config, launch)
    return launch


def planned_keys(config: EvalConfig) -> list[tuple]:
    """The :func:`record_key` of every record ``config`` runs (its shard's), in the order one process writes them
    (the methods' order within a sample aside: the harness runs KVzip first and shares prefills)."""
    samples = range(config.shard_index, config.n_samples, config.num_shards)
    return [(task, length, idx, label, ratio) for idx in samples for task in config.tasks
            for length in config.context_lengths for method in config.methods
            for _, label, ratio in method_runs(config, method)]


def merge_records(sources: Iterable[Iterable[dict]], units: Sequence[tuple[str, int]]) -> list[dict]:
    """The records of ``sources`` in the order one process writes them: sample by sample, then by (task, length) in
    the order of ``units`` (others after them, by name); within one (sample, task, length) in the order of the
    sources and of each source (one rank wrote them, in the harness's order). A record whose key came before is
    dropped."""
    seen: set[tuple] = set()
    records = []
    for source in sources:
        for record in source:
            if record_key(record) not in seen:
                seen.add(record_key(record))
                records.append(record)
    position = {unit: i for i, unit in enumerate(units)}
    return sorted(records, key=lambda r: (r["sample"], position.get((r["task"], r["context_length"]), len(position)),
                                          str(r["task"]), r["context_length"]))


def run_eval_distributed(model, tokenizer, config: EvalConfig, options: ScorerContext | None = None, *,
                         launch: Launch | None = None, timeout: float = 7 * 24 * 3600.,
                         poll_seconds: float = 1.0) -> Path | None:
    """:func:`~proxykv_hf.eval.harness.run_eval` of this process's share of ``config``, merged by rank 0.

    Args:
        model, tokenizer, options: as for ``run_eval``; each process passes its own model.
        config: the whole run (every rank passes the same; ``num_shards`` 1 under a launch of several processes).
        launch: this process's rank (default: :meth:`Launch.from_env`); one process of one is a plain ``run_eval``.
        timeout: seconds rank 0 waits for the other ranks after its own share.
        poll_seconds: how often rank 0 reads their records.

    Returns:
        On rank 0 the output directory (``results.jsonl``, ``results.md``, ``accuracy.png``); None on the others.

    Raises:
        ValueError: ``config`` is split by hand (``num_shards`` > 1) under a launch of several processes.
        TimeoutError: rank 0 waited ``timeout`` seconds for a rank's records.
    """
    launch = launch or Launch.from_env()
    if not launch.distributed:
        return run_eval(model, tokenizer, config, options)
    share, out, world = rank_config(config, launch), Path(config.out_dir), launch.world_size
    before = read_records(out / "results.jsonl")  # written for every rank: a stopped single run, an earlier merge
    mine = rank_dir(out, launch.rank, world)
    logger.info("rank %d of %d: samples %d, %d, ... of %d into %s", launch.rank, world, launch.rank,
                launch.rank + world, config.n_samples, mine)
    Harness(model, tokenizer, share, options, records_dir=mine,
            done_elsewhere=map(record_key, before)).run(report=False)
    if launch.rank != 0:
        return None
    _wait(out, config, world, before, timeout, poll_seconds)
    units = [(task, length) for task in config.tasks for length in config.context_lengths]
    records = merge_records([before, *(read_records(d / "results.jsonl") for d in _rank_dirs(out))], units)
    text = "".join(json.dumps(r) + "\n" for r in records)
    if not (out / "results.jsonl").exists() or (out / "results.jsonl").read_text() != text:
        write_whole(out / "results.jsonl", text)
    run = json.loads((mine / "config.json").read_text())
    write_whole(out / "config.json", json.dumps({**run, "config": dataclasses.asdict(config), "world_size": world},
                                                indent=2, default=str))
    logger.info("merged %d ranks into %s: %d records", world, out / "results.jsonl", len(records))
    from .report import write_report

    write_report(out)
    return out


def _rank_dirs(out: Path) -> list[Path]:
    """The rank directories in ``out`` (of any world size), by name."""
    return sorted(p for p in out.glob("rank-*-of-*") if p.is_dir())


def _wait(out: Path, config: EvalConfig, world: int, before: list[dict], timeout: float, poll_seconds: float) -> None:
    """Until the records of ``before`` and of the rank directories cover every record of ``config``."""
    planned, deadline = planned_keys(config), time.monotonic() + timeout
    while True:
        have = {record_key(r) for r in before}
        have.update(record_key(r) for d in _rank_dirs(out) for r in read_records(d / "results.jsonl"))
        missing = [key for key in planned if key not in have]
        if not missing:
            return
        if time.monotonic() > deadline:
            rank = missing[0][2] % world  # a sample's rank
            raise TimeoutError(f"rank {rank} did not write its records into {rank_dir(out, rank, world)} within "
                               f"{timeout:.0f} s ({len(missing)} of the run's {len(planned)} records missing)")
        time.sleep(poll_seconds)
