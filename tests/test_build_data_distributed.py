"""``build-data`` split over processes: each rank builds every world_size-th text, rank 0 merges them into the same
dataset as one process builds (proxykv_hf/train/distributed.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from proxykv_hf.testing import tiny_model, tiny_tokenizer
from proxykv_hf.train import DataConfig, Manifest, build_dataset
from proxykv_hf.train.distributed import Launch, build_dataset_distributed, rank_dir, rank_texts, unique_texts

pytestmark = pytest.mark.usefixtures("single_thread")
ROOT = Path(__file__).resolve().parent.parent
WORDS = "alpha beta gamma delta key value cache token needle haystack the of and river stone".split()


def per_text(directory: Path) -> dict[str, tuple[torch.Tensor, ...]]:
    """Every crop's (start, length, x, y, mask) of a dataset, keyed by its text's hash (no short texts skipped)."""
    m = Manifest.load(directory)
    assert m.skipped_short == 0
    out: dict[str, list] = {}
    for shard in m.shards:
        t = load_file(str(directory / shard["file"]))
        for i in range(len(t["text"])):
            out.setdefault(m.done[int(t["text"][i])], []).append(
                (int(t["start"][i]), int(t["length"][i]), t["x"][i], t["y"][i], t["mask"][i]))
    return {k: sorted(v, key=lambda c: c[0]) for k, v in out.items()}


def assert_same_data(a: Path, b: Path) -> None:
    ma, mb = Manifest.load(a), Manifest.load(b)
    assert (ma.texts, ma.tokens, ma.crops, ma.sources) == (mb.texts, mb.tokens, mb.crops, mb.sources)
    assert sorted(ma.done) == sorted(mb.done) and ma.mismatch(mb) is None
    ta, tb = per_text(a), per_text(b)
    assert ta.keys() == tb.keys()
    for key in ta:
        assert len(ta[key]) == len(tb[key])
        for ca, cb in zip(ta[key], tb[key]):
            assert ca[:2] == cb[:2]
            for x, y in zip(ca[2:], cb[2:]):
                torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_launch_from_env_and_the_split_by_rank():
    assert Launch.from_env({}) == Launch(rank=0, world_size=1, local_rank=0)
    launch = Launch.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (launch.rank, launch.world_size, launch.local_rank, launch.distributed) == (3, 4, 1, True)
    assert launch.device("cuda") == "cuda:1" and launch.device("cuda:0") == "cuda:0" and launch.device("cpu") == "cpu"
    assert Launch().device("cuda") == "cuda"
    for bad in ({"RANK": "2", "WORLD_SIZE": "2"}, {"WORLD_SIZE": "0"}, {"RANK": "x", "WORLD_SIZE": "2"}):
        with pytest.raises(ValueError):
            Launch.from_env(bad)
    texts = [f"text {i}" for i in range(7)]
    shares = [rank_texts(texts, r, 3) for r in range(3)]
    assert shares == [texts[0::3], texts[1::3], texts[2::3]]
    assert sorted(sum(shares, [])) == sorted(texts)
    assert unique_texts(["a", "b", {"text": "a", "source": "x"}, "c", "b"]) == ["a", "b", "c"]
    assert rank_dir("out", 1, 2) == Path("out") / "rank-00001-of-00002"


def _texts(n: int) -> list[str]:
    import random

    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(15, 45))) for _ in range(n)]


def test_ranks_build_their_shares_and_rank_0_merges_them(tmp_path):
    target, tok = tiny_model("llama", num_hidden_layers=4), tiny_tokenizer()
    cfg = DataConfig(crop_len=64, stride=32, shard_size=2, min_length=4, proxy_kind="self")
    texts = _texts(5)
    build_dataset(texts, target, tok, tmp_path / "single", cfg, progress=False)
    out = tmp_path / "dist"
    with pytest.raises(TimeoutError, match="rank 1"):  # rank 1 has not built its share yet
        build_dataset_distributed(texts, target, tok, out, cfg, launch=Launch(rank=0, world_size=2), timeout=0,
                                  progress=False)
    assert build_dataset_distributed(texts + texts[:1], target, tok, out, cfg, launch=Launch(rank=1, world_size=2),
                                     progress=False) is None
    merged = build_dataset_distributed(texts, target, tok, out, cfg, launch=Launch(rank=0, world_size=2),
                                       progress=False)
    assert merged.texts == 5 and Manifest.load(rank_dir(out, 1, 2)).texts == 2
    assert_same_data(tmp_path / "single", out)
    again = build_dataset_distributed(texts, target, tok, out, cfg, launch=Launch(rank=0, world_size=2),
                                      oracle=lambda *a, **k: pytest.fail("a rerun ran the oracle"), progress=False)
    assert again.done == merged.done and again.crops == merged.crops  # a rerun resumes: nothing left, merged again
    assert_same_data(tmp_path / "single", out)
    more = texts + _texts(7)[5:]  # more texts later: each rank builds only its new ones, rank 0 merges again
    build_dataset(more, target, tok, tmp_path / "single", cfg, progress=False)
    for rank in (1, 0):
        build_dataset_distributed(more, target, tok, out, cfg, launch=Launch(rank=rank, world_size=2), progress=False)
    assert Manifest.load(out).texts == 7
    assert_same_data(tmp_path / "single", out)
    fp32 = dataclasses.replace(cfg, dtype="float32")  # rank 1 rebuilt apart: rank 0 merges again
    build_dataset_distributed(more, target, tok, out, fp32, launch=Launch(rank=1, world_size=2), resume=False,
                              progress=False)
    with pytest.raises(ValueError, match="cannot merge"):  # rank 0's share is still float16
        build_dataset_distributed(more, target, tok, out, cfg, launch=Launch(rank=0, world_size=2), progress=False)
    with pytest.raises(ValueError, match="single-process build"):
        build_dataset_distributed(texts, target, tok, tmp_path / "single", cfg, launch=Launch(rank=1, world_size=2))


@pytest.mark.slow  # two Python processes under torchrun, each loading torch and transformers
def test_torchrun_build_data_matches_one_process(tmp_path):
    from proxykv_hf.cli import main

    args = ["build-data", "--tiny", "--tasks", "niah_single_1", "--n-per-task", "3", "--tokens", "200",
            "--crop-len", "64", "--stride", "32", "--shard-size", "4", "--no-progress"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "proxykv_hf.cli", *args, "--out", str(tmp_path / "dist")],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert json.loads(done.stdout)["texts"] == 3  # printed once, by rank 0
    main([*args, "--out", str(tmp_path / "single")])
    assert_same_data(tmp_path / "single", tmp_path / "dist")
