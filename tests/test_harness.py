"""The harness's shortcuts: one prefill shared by the methods that read it alike, and the keep ratios of a method
answered as the rows of one batch. Both must give what each method's own cache gives."""

import json

import pytest
import torch

from proxykv_hf.attention.compat import with_cache
from proxykv_hf.eval.harness import EvalConfig, run_eval
from proxykv_hf.eval.methods import RecordingCache, SharedPrefill, compacted_batch, compacted_copy, prefill_groups
from proxykv_hf.scorers.kvzip import KVzipScorer
from proxykv_hf.scorers.random import RandomScorer
from proxykv_hf.scorers.snapkv import SnapKVScorer
from proxykv_hf.scorers.statistic import AttentionStatisticScorer
from proxykv_hf.scorers.streaming import StreamingLLMScorer
from proxykv_hf.testing import random_prompt, tiny_model, tiny_tokenizer


def _record(model, ids, scorer) -> RecordingCache:
    rec = RecordingCache(scorer)
    rec.prepare(model, ids)
    with torch.no_grad():
        model(input_ids=ids, **with_cache(rec), use_cache=True)
    return rec


def _members():
    return {"max": AttentionStatisticScorer("max"), "sum": AttentionStatisticScorer("sum", group_reduce="mean"),
            "novelty": AttentionStatisticScorer("lookback", kernel_size=3)}


@pytest.mark.parametrize("members", [_members, lambda: {"snapkv": SnapKVScorer(window=4),
                                                        "streaming": StreamingLLMScorer(n_sink=2),
                                                        "random": RandomScorer(seed=3)}])
def test_shared_prefill_gives_each_member_its_own_scores(members):
    model = tiny_model("llama")
    ids = random_prompt(1, 48, seed=5)["input_ids"]
    shared = _record(model, ids, SharedPrefill(members()))
    for name, scorer in members().items():
        alone = _record(model, ids, scorer)
        assert sorted(shared.scorer.scores[name]) == sorted(alone.scores)
        for i, s in alone.scores.items():
            torch.testing.assert_close(shared.scorer.scores[name][i], s, rtol=1e-6, atol=1e-7)
        for layer_shared, layer_alone in zip(shared.layers, alone.layers):  # the same K/V as the member's own
            assert torch.equal(layer_shared.keys, layer_alone.keys)


def test_shared_prefill_refuses_other_kinds_and_groups_methods():
    with pytest.raises(ValueError, match="LayerScorer"):
        SharedPrefill({"kvzip": KVzipScorer(tiny_tokenizer())})
    with pytest.raises(ValueError, match="LayerScorer"):
        SharedPrefill({})
    scorers = {"kvzip": KVzipScorer(tiny_tokenizer()), "full": None, "attn_max": AttentionStatisticScorer("max"),
               "snapkv": SnapKVScorer(), "attn_sum": AttentionStatisticScorer("sum"), "random": RandomScorer()}
    assert prefill_groups(scorers) == [["kvzip"], ["full", "snapkv", "random"], ["attn_max", "attn_sum"]]


def test_compacted_batch_rows_are_the_single_ratio_caches():
    model = tiny_model("llama")
    ids = random_prompt(1, 40, seed=7)["input_ids"]
    rec = _record(model, ids, SharedPrefill(_members()))
    ratios = [0.1, 0.3, 0.7]
    batch = compacted_batch(rec, ratios, scorer=rec.scorer.members["novelty"], scores=rec.scorer.scores["novelty"])
    question = torch.tensor([[5, 9, 11]])
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    out = model.generate(input_ids=torch.cat([ids, question], 1).expand(3, -1),
                         attention_mask=torch.ones(3, 43, dtype=torch.long), **with_cache(batch), **kw)
    for j, rho in enumerate(ratios):
        single = compacted_copy(rec, rho, scorer=rec.scorer.members["novelty"], scores=rec.scorer.scores["novelty"])
        for i, rows in single.kept_sets().items():
            assert all(torch.equal(a, b) for a, b in zip(rows[0], batch.kept_sets()[i][j]))
        alone = model.generate(input_ids=torch.cat([ids, question], 1), attention_mask=torch.ones(1, 43,
                               dtype=torch.long), **with_cache(single), **kw)
        assert torch.equal(out[j], alone[0])
    with pytest.raises(ValueError, match="one row"):
        compacted_batch(_record(model, ids.expand(2, -1), AttentionStatisticScorer("max")), [0.5])


@pytest.mark.usefixtures("single_thread")
def test_batched_harness_matches_one_method_and_ratio_at_a_time(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    runs = {}
    for batched in (True, False):
        cfg = EvalConfig(methods=["full", "snapkv", "streaming", "attn_max", "attn_novelty"], keep_ratios=[0.2, 0.6],
                         tasks=["niah_single_1"], context_lengths=[300], n_samples=2, max_new_tokens=3,
                         out_dir=str(tmp_path / str(batched)), batched=batched)
        out = run_eval(model, tok, cfg)
        records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
        runs[batched] = {(r["sample"], r["method"], r["keep_ratio"]): (r["prediction"], r["kv_bytes"])
                         for r in records}
        assert len(records) == 2 * (1 + 4 * 2)
    assert runs[True] == runs[False]


@pytest.mark.usefixtures("single_thread")
def test_shards_split_the_samples_between_runs(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    kw = dict(methods=["full", "streaming"], keep_ratios=[0.5], tasks=["niah_single_1"], context_lengths=[300],
              n_samples=3, max_new_tokens=3)
    runs = {}
    for shards, index in ((1, 0), (2, 0), (2, 1)):
        out = run_eval(model, tok, EvalConfig(**kw, num_shards=shards, shard_index=index,
                                              out_dir=str(tmp_path / f"{shards}-{index}")))
        runs[shards, index] = {(r["sample"], r["method"]): r["prediction"]
                               for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert {s for s, _ in runs[2, 0]} == {0, 2} and {s for s, _ in runs[2, 1]} == {1}
    assert runs[1, 0] == runs[2, 0] | runs[2, 1]
    with pytest.raises(ValueError, match="shard_index"):
        EvalConfig(**kw, num_shards=2, shard_index=2)


@pytest.mark.usefixtures("single_thread")
def test_a_run_stopped_mid_record_resumes(tmp_path, caplog):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    cfg = EvalConfig(methods=["full", "kvzip", "streaming"], keep_ratios=[0.3, 0.6], tasks=["niah_single_1"],
                     context_lengths=[300], n_samples=2, max_new_tokens=3, out_dir=str(tmp_path / "run"))
    path = run_eval(model, tok, cfg) / "results.jsonl"
    whole = path.read_text()
    lines = whole.splitlines(keepends=True)
    path.write_text("".join(lines[:2]) + lines[2][:40])  # killed while writing the third record
    run_eval(model, tok, cfg)
    assert "cut off by a stopped run" in caplog.text
    records = [json.loads(line) for line in path.read_text().splitlines()]
    key = lambda r: (r["sample"], r["method"], r["keep_ratio"])  # noqa: E731
    assert sorted(map(key, records)) == sorted(map(key, map(json.loads, lines)))
    assert {key(r): r["prediction"] for r in records} == {key(r): r["prediction"] for r in map(json.loads, lines)}

    path.write_text(lines[0] + "not a record\n" + "".join(lines[1:]))
    with pytest.raises(ValueError, match="line 2: not an evaluation record"):
        run_eval(model, tok, cfg)
    oracles = sorted(p.name for p in (tmp_path / "run" / "oracle").iterdir())
    assert oracles == ["niah_single_1-300-0.safetensors", "niah_single_1-300-1.safetensors"]  # written whole
