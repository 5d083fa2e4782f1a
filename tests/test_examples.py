"""Scripts of examples/ that do arithmetic people read off (run on small hand-made inputs)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write(path: Path, method: str, scores: dict[tuple[str, int], list[float]], ratios=(0.1, 0.5)) -> str:
    with open(path, "w") as fh:
        fh.write(json.dumps({"task": "qa", "context_length": 64, "sample": 0, "method": "full", "keep_ratio": 1.0,
                             "score": 1.0}) + "\n")
        for (task, sample), values in scores.items():
            for r, v in zip(ratios, values):
                fh.write(json.dumps({"task": task, "context_length": 64, "sample": sample, "method": method,
                                     "keep_ratio": r, "score": v}) + "\n")
    return str(path)


def test_accuracy_on_common_samples(tmp_path, capsys):
    mod = example("accuracy_on_common_samples")
    a = write(tmp_path / "a.jsonl", "proxykv", {("qa", 0): [0.0, 1.0], ("qa", 1): [1.0, 1.0], ("vt", 0): [0.5, 0.5]})
    b = write(tmp_path / "b.jsonl", "kvzip", {("qa", 0): [1.0, 1.0], ("vt", 0): [1.0, 1.0]})  # no ("qa", 1)
    mod.main([f"new={a}", "--reference", f"oracle={b}:kvzip", "--held-out", "vt", "--oracle", "oracle"])
    out = capsys.readouterr().out
    assert "All tasks (2 samples)" in out and "Held-out tasks vt (1 samples)" in out
    assert "| new | 25.0 | 75.0 | 50.0 | 50.0% |" in out  # ("qa", 1) is not in both runs: left out
    assert "| new | 50.0 | 50.0 | 50.0 | 50.0% |" in out and "| oracle | 100.0 | 100.0 | 100.0 | 100.0% |" in out
    mod.main([f"new={a}", "--reference", f"oracle={b}:kvzip", "--report", str(tmp_path / "rep")])
    records = [json.loads(line) for line in (tmp_path / "rep" / "results.jsonl").read_text().splitlines()]
    assert sorted((r["method"], r["task"], r["sample"], r["keep_ratio"]) for r in records) == [
        ("full", "qa", 0, 1.0), ("new", "qa", 0, 0.1), ("new", "qa", 0, 0.5), ("new", "vt", 0, 0.1),
        ("new", "vt", 0, 0.5), ("oracle", "qa", 0, 0.1), ("oracle", "qa", 0, 0.5), ("oracle", "vt", 0, 0.1),
        ("oracle", "vt", 0, 0.5)]  # the shared samples only, each run under its label, one full-cache record
    assert "| new | 25.0 | 75.0 |" in (tmp_path / "rep" / "results.md").read_text()
    assert (tmp_path / "rep" / "accuracy.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="one method"):
        mod.main([f"x={write(tmp_path / 'c.jsonl', 'snapkv', {})}"])
    with pytest.raises(SystemExit, match="not one of the labels"):
        mod.main([f"new={a}", "--oracle", "kvzip"])


def test_needle_kept_counts_rows_whose_topk_holds_the_whole_needle():
    needle_kept = example("needle_rank").needle_kept
    scores = torch.zeros(2, 2, 20)
    scores[0, 0, [10, 11]] = 1.0  # whole needle on top
    scores[0, 1, [10]] = 1.0  # one token of two
    scores[1, 0, [9, 10, 11]] = 1.0  # three tokens tie on top: the earliest two (9, 10) win with a budget of 2
    scores[1, 1, [11]] = 1.0
    scores[1, 1, [10]] = 0.5
    # keep 0.3 of 20 = 6 tokens: 4 sinks + the best 2 others
    assert needle_kept(scores, [10, 11], 0.3) == pytest.approx(2 / 4)  # rows (0, 0) and (1, 1)
    assert needle_kept(scores, [10, 11], 0.3, n_sink=0) == pytest.approx(3 / 4)  # 6 free slots: row (1, 0) too
    assert needle_kept(scores, [10, 11], 0.05, n_sink=0) == 0.0  # one token kept


def test_val_unseen_texts_keeps_only_texts_no_run_trained_on():
    from proxykv_hf.train import split_dataset

    mod = example("val_unseen_texts")
    text_ids = [t for t in range(30) for _ in range(2)]  # 30 texts of 2 crops; the earlier run had the first 12
    keep = mod.unseen_val_indices(text_ids, 24, 0.2, 0)
    earlier_train, _ = split_dataset(mod._Texts(text_ids[:24]), 0.2, 0, by_text=True)
    _, val = split_dataset(mod._Texts(text_ids), 0.2, 0, by_text=True)
    seen = {text_ids[i] for i in earlier_train.indices}
    assert keep == [i for i in val.indices if text_ids[i] not in seen] and keep
    assert len(keep) < len(val.indices), "with this seed some validation texts were earlier training texts"
    with pytest.raises(SystemExit, match="earlier-crops"):
        mod.unseen_val_indices(text_ids, 0, 0.2, 0)


def test_bench_mapper_cpu_restores_the_sdpa_path(capsys):
    from proxykv_hf.mapper import TimeEncoder

    before = TimeEncoder.encode_sdpa
    example("bench_mapper_cpu").main(["--lengths", "96"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 96 |")]
    assert len(rows) == 1 and float(rows[0].split("|")[-2]) < 1e-4  # both paths give the same logits
    assert TimeEncoder.encode_sdpa is before


def test_bench_mapper_gpu_runs_both_encoder_paths(capsys, monkeypatch):
    """The GPU mapper benchmark, on the CPU with a tiny mapper of the Llama pair's shapes and no compile: both
    encoder paths run, give the same logits, and the shipped choice of path is restored."""
    from torch import nn

    from proxykv_hf.mapper import TimeEncoder

    before = TimeEncoder.SDPA_DEVICES
    ran = []
    for owner, name in ((TimeEncoder, "encode_sdpa"), (nn.TransformerEncoder, "forward")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _real=real, _name=name, **k: ran.append(_name) or _real(*a, **k))
    example("bench_mapper_gpu").main(["--device", "cpu", "--preset", "tiny", "--lengths", "96", "--repeats", "1",
                                      "--no-compile"])
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| 96 |")]
    assert [r[2].strip() for r in rows] == ["shipped (encode_sdpa)", "module"]
    assert float(rows[1][-2]) < 1e-4
    assert {"encode_sdpa", "forward"} <= set(ran)  # the switch really changed the path
    assert TimeEncoder.SDPA_DEVICES == before


def test_compare_kvzip_scorers(tmp_path):
    from proxykv_hf.scorers import kvzip
    from proxykv_hf.testing import random_prompt, tiny_model, tiny_tokenizer

    mod = example("compare_kvzip_scorers")
    model, tok = tiny_model("llama"), tiny_tokenizer()
    ids = random_prompt(1, 48, seed=2)["input_ids"]
    source = Path(kvzip.__file__).read_text()
    same = mod.compare(model, tok, ids, mod.load_other(kvzip.__file__), keep_ratios=(0.3,))
    assert same["max_abs_diff"] == 0 and same["kept_agreement"] == {0.3: 1.0}
    assert set(same["seconds"]) == {"installed", "other", "installed again"}
    assert kvzip._ChunkRecorder.__module__ == "proxykv_hf.scorers.kvzip"  # put back
    wrong = tmp_path / "kvzip_wrong.py"  # a causal mask one key off: other scores, other kept sets
    wrong.write_text(source.replace(".triu_(1)", ".triu_(2)"))
    other = mod.compare(model, tok, ids, mod.load_other(str(wrong)), keep_ratios=(0.1, 0.3, 0.5, 0.7))
    assert other["max_abs_diff"] > 1e-3 and min(other["kept_agreement"].values()) < 1.0


def test_compare_fused_statistics(tmp_path):
    """The comparison runs both settings on a tiny self-proxy checkpoint and finds them in agreement."""
    from test_proxykv import make_checkpoint

    from proxykv_hf import scoring
    from proxykv_hf.testing import random_prompt, tiny_model

    mod = example("compare_fused_statistics")
    path, _ = make_checkpoint(tmp_path, "self")
    ids = random_prompt(1, 48, seed=2)["input_ids"]
    r = mod.compare(tiny_model("llama", num_hidden_layers=4), ids[:, :40], ids[:, 40:], path, (0.2, 0.5),
                    max_new_tokens=3)
    assert [len(r["seconds"][f]) for f in (False, True)] == [2, 2]
    assert r["max_abs_diff"] < 1e-4 and r["kept_recall"] == {0.2: 1.0, 0.5: 1.0} and r["same_answer"]
    assert scoring.FUSE_WITH_ATTENTION  # restored


def test_flop_budget(tmp_path, capsys):
    """The FLOP table of both pairs, and a bench file's ProxyKV row read against it: the floor is the FLOP ratio
    and each part's rate is its FLOPs over its time in the breakdown."""
    from proxykv_hf.bench.flops import prefill_flops
    from proxykv_hf.bench.shapes import pair_mapper_config, shape_config

    bench = tmp_path / "bench.json"
    row = {"context": 8192, "method": "proxykv", "ttft_vs_full": 1.9, "ttft_s": 0.38,
           "breakdown": {"proxy_s": 0.5, "mapper_s": 0.25, "target_prefill_s": 0.2}}
    rows = [{"context": 8192, "method": "full", "ttft_s": 0.2, "ttft_vs_full": 1.0}, row,
            {"context": 8192, "method": "snapkv", "ttft_s": 0.21, "ttft_vs_full": 1.05},
            {"context": 8192, "method": "streaming", "ttft_s": 0.25, "ttft_vs_full": 1.25,
             "flops": {"target": 1, "total": 0.5e12}},  # a row with its own counts (newer bench rows)
            {"context": 8192, "method": "kvzip", "ttft_s": 1.0, "ttft_vs_full": 5.0}]
    bench.write_text(json.dumps({"env": {"shape": "llama-3.1-8b", "device": "X"}, "rows": rows}))
    example("flop_budget").main(["--context-lengths", "8192", "--bench", str(bench), "--plot",
                                 str(tmp_path / "floor.png"), "--target", "1.15"])
    assert (tmp_path / "floor.png").stat().st_size > 0
    out = capsys.readouterr().out
    target, proxy, mapper = shape_config("llama-3.1-8b"), shape_config("llama-3.2-1b"), pair_mapper_config(
        "llama-3.1-8b")
    floor = prefill_flops(target, 8192, proxy_kind="model", proxy_config=proxy, mapper_config=mapper)
    ran = prefill_flops(target, 8192, proxy_kind="model", proxy_config=proxy, mapper_config=mapper,
                        statistics_passes=2)
    assert f"| {floor['total'] / floor['target']:.3f} |" in out and "qwen2.5-7b target" in out
    measured = [line for line in out.splitlines() if line.startswith("| 8192 | 1.90 |")]
    assert measured == [f"| 8192 | 1.90 | {floor['total'] / floor['target']:.2f} | {ran['target'] / 0.2e12:.0f} | "
                        f"{(ran['proxy'] + ran['statistics']) / 0.5e12:.0f} | {ran['mapper'] / 0.25e12:.0f} |"]
    # every counted method's TTFT against its FLOPs (SnapKV's old row has no counts); KVzip with the bench's templates
    from proxykv_hf.bench.flops import kvzip_flops, kvzip_template_tokens
    from proxykv_hf.scorers.kvzip import KVzipScorer
    from proxykv_hf.testing import tiny_tokenizer

    first, later = kvzip_template_tokens(KVzipScorer(tiny_tokenizer()))
    kv = kvzip_flops(target, 8192, first_extra=first, later_extra=later)
    kvzip = floor["target"] + kv["repeat"] + kv["scoring"]
    methods = [line for line in out.splitlines() if line.startswith("| 8192 | ") and line.count("|") == 6]
    assert methods == [f"| 8192 | full | 1.00 | 1.00 | {floor['target'] / 0.2e12:.0f} |",
                       f"| 8192 | proxykv | 1.90 | {ran['total'] / floor['target']:.2f} | "
                       f"{ran['total'] / 0.38e12:.0f} |",
                       f"| 8192 | streaming | 1.25 | {0.5e12 / floor['target']:.2f} | 2 |",
                       f"| 8192 | kvzip | 5.00 | {kvzip / floor['target']:.2f} | {kvzip / 1e12:.0f} |"]


def test_shape_setup_builds_the_pair_and_its_paper_mapper(tmp_path):
    """``proxykv bench --shape``'s set-up, on the meta device (no weights): the pair's proxy and the paper-preset
    mapper between them."""
    import argparse

    from proxykv_hf.bench.cli import _shape_setup
    from proxykv_hf.bench.shapes import pair_mapper_config
    from proxykv_hf.hub import load_checkpoint

    ns = argparse.Namespace(shape="qwen2.5-7b", dtype="bfloat16", device="meta", proxy_device=None)
    target, _ = _shape_setup(ns, str(tmp_path))
    assert target.config.num_hidden_layers == 28 and ns._proxy_model.config.num_attention_heads == 12
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.mapper.config == pair_mapper_config("qwen2.5-7b") and ckpt.proxy.model_id == "qwen2.5-1.5b"
    assert pair_mapper_config("qwen2.5-7b", "tiny").num_proxy_heads == 12
    with pytest.raises(ValueError, match="no mapper for shape"):
        pair_mapper_config("qwen2.5-1.5b")
