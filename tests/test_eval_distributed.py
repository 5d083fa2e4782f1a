"""``eval`` split over processes: each rank runs every world_size-th sample into ``--out/rank-RRRRR-of-WWWWW/``,
rank 0 merges the records into ``--out/results.jsonl`` as one process writes them (proxykv_hf/eval/distributed.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from proxykv_hf.cli.out_dirs import check_out
from proxykv_hf.eval.distributed import (TIMING_FIELDS, merge_records, planned_keys, rank_config,
                                         run_eval_distributed)
from proxykv_hf.eval.harness import EvalConfig, run_eval
from proxykv_hf.testing import tiny_model, tiny_tokenizer
from proxykv_hf.train.distributed import Launch, rank_dir

pytestmark = pytest.mark.usefixtures("single_thread")
ROOT = Path(__file__).resolve().parent.parent


def records(out: Path) -> list[dict]:
    """The records of ``out/results.jsonl`` in their order, without the fields that differ from run to run."""
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_FIELDS}
            for line in (out / "results.jsonl").read_text().splitlines()]


def _config(out: Path, **kw) -> EvalConfig:
    return EvalConfig(**{**dict(methods=["full", "kvzip", "snapkv"], keep_ratios=[0.3, 0.6],
                                tasks=["niah_single_1", "niah_single_2"], context_lengths=[300], n_samples=2,
                                max_new_tokens=3), **kw, "out_dir": str(out)})


def test_the_ranks_split_the_samples_and_rank_0_merges_them_in_order(tmp_path, monkeypatch):
    from proxykv_hf.eval import report

    monkeypatch.setattr(report, "plot", lambda records, path: Path(path).touch())  # seconds of matplotlib each
    model, tok = tiny_model("llama"), tiny_tokenizer()
    single = run_eval(model, tok, _config(tmp_path / "single"))
    out = tmp_path / "dist"
    cfg = _config(out)
    assert sorted(planned_keys(cfg)) == sorted(map(_key, map(json.loads, (single / "results.jsonl").open())))
    with pytest.raises(TimeoutError, match="rank 1"):  # rank 1 has not run its share yet
        run_eval_distributed(model, tok, cfg, launch=Launch(rank=0, world_size=2), timeout=0)
    check_out("eval", out)  # a run under way is eval's own output
    assert run_eval_distributed(model, tok, cfg, launch=Launch(rank=1, world_size=2)) is None
    shard = [json.loads(line) for line in (rank_dir(out, 1, 2) / "results.jsonl").read_text().splitlines()]
    assert {r["sample"] for r in shard} == {1} and not (out / "results.jsonl").exists()
    assert run_eval_distributed(model, tok, cfg, launch=Launch(rank=0, world_size=2)) == out
    assert records(out) == records(single)  # the same records, in the same order
    assert (out / "results.md").exists() and (out / "accuracy.png").exists()
    assert not (rank_dir(out, 0, 2) / "results.md").exists()  # the report is written once, by rank 0
    assert json.loads((out / "config.json").read_text())["config"]["num_shards"] == 1
    assert sorted(p.name for p in (out / "oracle").iterdir()) == sorted(p.name for p in (single / "oracle").iterdir())
    check_out("eval", out)

    # rank 1 killed while writing a record: it resumes from its own records, rank 0 merges again
    path = rank_dir(out, 1, 2) / "results.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:2]) + lines[2][:30])  # between two prefills
    (out / "results.jsonl").unlink()
    run_eval_distributed(model, tok, cfg, launch=Launch(rank=1, world_size=2))
    assert len(path.read_text().splitlines()) == len(lines)
    merged = run_eval_distributed(model, tok, cfg, launch=Launch(rank=0, world_size=2))
    assert records(merged) == records(single)

    # a single-process run stopped half-way, resumed by two processes: they run only what it had not
    half = tmp_path / "half"
    whole = (single / "results.jsonl").read_text().splitlines(keepends=True)
    half.mkdir()
    (half / "config.json").write_text((single / "config.json").read_text())
    (half / "results.jsonl").write_text("".join(whole[:5]) + whole[5][:20])  # sample 0's first task
    for rank in (1, 0):
        run_eval_distributed(model, tok, _config(half), launch=Launch(rank=rank, world_size=2))
    assert records(half) == records(single)
    ran = [line for r in (0, 1) for line in (rank_dir(half, r, 2) / "results.jsonl").read_text().splitlines()]
    assert len(ran) == len(whole) - 5


def test_torchrun_is_refused_with_shards_given_by_hand(tmp_path):
    cfg = _config(tmp_path / "x", num_shards=2, shard_index=1)
    assert rank_config(cfg, Launch()) is cfg  # one process: the shards as given
    with pytest.raises(ValueError, match="num-shards"):
        rank_config(cfg, Launch(rank=0, world_size=2))
    split = rank_config(_config(tmp_path / "x"), Launch(rank=1, world_size=3))
    assert (split.num_shards, split.shard_index) == (3, 1)


def test_merge_orders_as_one_process_and_drops_repeats():
    rec = lambda s, t, m: {"task": t, "context_length": 8, "sample": s, "method": m, "keep_ratio": 1.0}  # noqa: E731
    ranks = [[rec(0, "b", "full"), rec(0, "a", "full"), rec(2, "b", "full")], [rec(1, "a", "full"), rec(1, "b", "x")]]
    merged = merge_records([[rec(1, "a", "full")], *ranks], units=[("b", 8), ("a", 8)])
    assert [(r["sample"], r["task"], r["method"]) for r in merged] == [
        (0, "b", "full"), (0, "a", "full"), (1, "b", "x"), (1, "a", "full"), (2, "b", "full")]


def _key(r: dict) -> tuple:
    return r["task"], r["context_length"], r["sample"], r["method"], r["keep_ratio"]


@pytest.mark.slow  # two Python processes under torchrun, each loading torch and transformers, run twice
def test_torchrun_eval_matches_one_process_and_a_rerun_adds_nothing(tmp_path, monkeypatch):
    from proxykv_hf.cli import main
    from proxykv_hf.eval import report

    monkeypatch.setattr(report, "plot", lambda records, path: Path(path).touch())  # in this process only

    args = ["eval", "--tiny", "--methods", "full", "snapkv", "--keep-ratios", "0.3", "0.6", "--tasks", "niah_single_1",
            "niah_single_2", "--context-lengths", "300", "--n-samples", "3", "--max-new-tokens", "3"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                "proxykv_hf.cli", *args, "--out", str(tmp_path / "dist")]
    done = subprocess.run(torchrun, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.count("results: ") == 1  # the report is printed once, by rank 0
    main([*args, "--out", str(tmp_path / "single")])
    assert records(tmp_path / "dist") == records(tmp_path / "single")
    files = sorted(tmp_path.joinpath("dist").rglob("results.jsonl"))
    before = {p: p.read_text() for p in files}
    assert len(files) == 3  # the merged records and each rank's own
    again = subprocess.run(torchrun, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert {p: p.read_text() for p in files} == before  # nothing new
