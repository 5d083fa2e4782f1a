"""What a transformers user does with a cache besides generating: share a scorer between threads, measure memory,
copy and pickle, ask for attentions or pass embeddings, build it with defaults, answer several sequences from one
compressed context. Tiny random models."""

from __future__ import annotations

import copy
import logging
import pickle
import threading

import pytest
import torch
from transformers import DynamicCache

from proxykv_hf import ProxyKVCache, ProxyKVPipeline, ProxyScorer, SnapKVScorer
from proxykv_hf.cache.proxykv_cache import DEFAULT_KEEP_RATIO
from proxykv_hf.attention.compat import with_cache
from proxykv_hf.mapper.hub import Checkpoint, TargetSpec
from proxykv_hf.cache.layer import ProxyKVLayer
from proxykv_hf.mapper.model import HybridAxialMapper, MapperConfig
from proxykv_hf.mapper.proxy import ProxySpec
from proxykv_hf.testing import random_prompt, tiny_model, tiny_tokenizer

GEN = dict(do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _held_bytes(cache) -> int:
    """Bytes of every distinct storage behind the cache layers' tensors, spare-room buffers included."""
    seen, total = set(), 0
    for layer in cache.layers:
        for value in vars(layer).values():
            tensors = [value] if isinstance(value, torch.Tensor) else list(getattr(value, "tensors", ()))
            for t in tensors:
                if t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    total += t.untyped_storage().nbytes()
    return total


@pytest.mark.parametrize("budget", ["uniform", "global"])
@pytest.mark.parametrize("n", [100, 1000])
def test_nbytes_counts_what_is_held_and_never_exceeds_a_full_cache(model, n, budget):
    inputs = random_prompt(1, n, seed=1)
    full, cache = DynamicCache(), ProxyKVCache(SnapKVScorer(window=16), keep_ratio=0.3, budget=budget)
    for c in (full, cache):
        model.generate(**inputs, **with_cache(c), max_new_tokens=5, **GEN)
    assert cache.nbytes() == _held_bytes(cache)
    assert cache.nbytes() < _held_bytes(full)


def test_spare_room_is_at_most_what_compaction_freed(model):
    cache = ProxyKVCache(SnapKVScorer(window=8), keep_ratio=0.9)
    model.generate(**random_prompt(1, 100, seed=1), **with_cache(cache), max_new_tokens=3, **GEN)
    for layer in cache.layers:
        if isinstance(layer, ProxyKVLayer):
            assert layer._room.keys.shape[-2] == 90 + 10  # 90 kept + the 10 freed entries as room


def _self_proxy(crop_len=64):
    mapper = HybridAxialMapper(MapperConfig.tiny(num_proxy_layers=3, num_proxy_heads=4, num_target_layers=3,
                                                 num_target_heads=2, num_statistics=1, crop_len=crop_len,
                                                 stride=crop_len // 2)).eval()
    return Checkpoint(mapper=mapper, proxy=ProxySpec(kind="self", num_layers=3, num_heads=4, statistics=["sum"]),
                      target=TargetSpec(model_id="tiny", model_type="llama", num_layers=3, num_kv_heads=2,
                                        num_heads=4))


def test_one_scorer_behind_caches_in_two_threads(model):
    torch.manual_seed(0)
    shared = ProxyScorer(_self_proxy())
    prompts = [random_prompt(1, 300, seed=1), random_prompt(1, 200, seed=2)]
    gen = lambda p: model.generate(**p, **with_cache(ProxyKVCache(shared, keep_ratio=0.3)),  # noqa: E731
                                   max_new_tokens=4, **GEN)
    alone = [gen(p) for p in prompts]
    for _ in range(3):
        out = [None, None]

        def work(i):
            try:
                out[i] = gen(prompts[i])
            except Exception as e:  # noqa: BLE001 - reported below
                out[i] = e
        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        for i in range(2):
            assert isinstance(out[i], torch.Tensor), out[i]
            assert torch.equal(out[i], alone[i])


def test_deepcopy_copies_kv_not_the_model_and_pickle_works(model):
    inputs = random_prompt(1, 100, seed=1)
    cache = ProxyKVCache(SnapKVScorer(window=16), keep_ratio=0.5)
    out = model.generate(**inputs, **with_cache(cache), max_new_tokens=4, **GEN)
    with torch.no_grad():
        model(**inputs, output_hidden_states=True)  # installs transformers' output-capture hooks on the model
    clone = copy.deepcopy(cache)
    loaded = pickle.loads(pickle.dumps(cache))
    modules = [v for c in (clone, loaded) for v in vars(c).values() if isinstance(v, torch.nn.Module)]
    assert not modules and clone.prompt.model is None and loaded.prompt.model is None
    assert clone.nbytes() == cache.nbytes()
    nxt = torch.cat([out, torch.randint(4, 200, (1, 5), generator=torch.Generator().manual_seed(2))], 1)
    answers = [model.generate(input_ids=nxt, attention_mask=torch.ones_like(nxt), **with_cache(c),
                              max_new_tokens=4, **GEN) for c in (cache, clone, loaded)]
    assert torch.equal(answers[0], answers[1]) and torch.equal(answers[0], answers[2])


def test_a_proxykv_cache_pickles_with_its_mapper(model):
    torch.manual_seed(0)
    cache = ProxyKVCache(ProxyScorer(_self_proxy()), keep_ratio=0.3)
    out = model.generate(**random_prompt(1, 200, seed=1), **with_cache(cache), max_new_tokens=3, **GEN)
    loaded = pickle.loads(pickle.dumps(cache))
    nxt = torch.cat([out, torch.randint(4, 200, (1, 5), generator=torch.Generator().manual_seed(2))], 1)
    a, b = (model.generate(input_ids=nxt, attention_mask=torch.ones_like(nxt), **with_cache(c), max_new_tokens=4,
                           **GEN) for c in (cache, loaded))
    assert torch.equal(a, b)
    fresh = loaded.fresh()  # the unpickled scorer still compresses a new prompt as the original does
    ref = cache.fresh()
    p2 = random_prompt(1, 150, seed=3)
    assert torch.equal(model.generate(**p2, **with_cache(fresh), max_new_tokens=3, **GEN),
                       model.generate(**p2, **with_cache(ref), max_new_tokens=3, **GEN))


def test_copy_in_the_middle_of_compression_is_refused(model):
    cache = ProxyKVCache(SnapKVScorer(window=8), keep_ratio=0.5)
    inputs = random_prompt(1, 60, seed=1)
    cache.prepare(model, inputs["input_ids"])
    with torch.no_grad():
        model(input_ids=inputs["input_ids"][:, :30], **with_cache(cache))  # the first of two chunks
    with pytest.raises(ValueError, match="middle of compressing"):
        copy.deepcopy(cache)


def test_global_budget_returns_attentions_over_logical_positions():
    model = tiny_model("llama", attn_implementation="eager")
    cache = ProxyKVCache(SnapKVScorer(window=8), 0.3, budget="global")
    out = model.generate(**random_prompt(1, 60, seed=1), **with_cache(cache), max_new_tokens=3, **GEN,
                         return_dict_in_generate=True, output_attentions=True)
    kept = cache.kept_sets()
    for step, attentions in enumerate(out.attentions[1:], start=1):
        for layer, probs in enumerate(attentions):
            assert probs.shape == (1, 4, 1, 60 + step)
            torch.testing.assert_close(probs.sum(-1), torch.ones(1, 4, 1))
            for h in range(4):
                dropped = torch.ones(60, dtype=torch.bool)
                dropped[kept[layer][0][h // 2]] = False
                assert probs[0, h, 0, :60][dropped].abs().max() == 0  # nothing on the dropped entries


def test_inputs_embeds_generate_equals_input_ids(model):
    inputs = random_prompt(1, 100, seed=1)
    by_ids, by_embeds = (ProxyKVCache(SnapKVScorer(window=16), keep_ratio=0.5) for _ in range(2))
    ref = model.generate(**inputs, **with_cache(by_ids), max_new_tokens=4, **GEN)
    embeds = model.get_input_embeddings()(inputs["input_ids"])
    out = model.generate(inputs_embeds=embeds, attention_mask=inputs["attention_mask"], **with_cache(by_embeds),
                         max_new_tokens=4, **GEN)
    assert torch.equal(out, ref[:, 100:])
    assert {i: [[h.tolist() for h in r] for r in rows] for i, rows in by_embeds.kept_sets().items()} == \
           {i: [[h.tolist() for h in r] for r in rows] for i, rows in by_ids.kept_sets().items()}


def test_one_default_keep_ratio_and_a_warning_when_nothing_is_pruned(model, caplog):
    import inspect

    assert ProxyKVCache(SnapKVScorer()).keep_ratio == DEFAULT_KEEP_RATIO == \
        inspect.signature(ProxyKVCache.from_pretrained).parameters["keep_ratio"].default
    with caplog.at_level(logging.WARNING, logger="proxykv_hf"):
        cache = ProxyKVCache(SnapKVScorer(window=64), keep_ratio=0.3)
        model.generate(**random_prompt(1, 50, seed=1), **with_cache(cache), max_new_tokens=1, **GEN)
    assert [r.levelno for r in caplog.records if r.name == "proxykv_hf.cache.proxykv_cache"] == [logging.WARNING]
    assert len(cache.kept_sets()[0][0][0]) == 50


@pytest.mark.parametrize("budget", ["uniform", "global"])
def test_pipeline_answers_several_sequences_and_beams(model, budget):
    from proxykv_hf.eval.prompts import encode_chat_prompt

    tok = tiny_tokenizer()
    context = "The quick brown fox jumps over the lazy dog. " * 6 + "The code is 4417. " + "Lorem ipsum. " * 5
    pipe = ProxyKVPipeline(model, tok, SnapKVScorer(window=8), keep_ratio=0.3, budget=budget)
    greedy = pipe.ask(context, "What is the code?", max_new_tokens=6)
    sampled = pipe.ask(context, ["What is the code?"], max_new_tokens=6, do_sample=True, top_k=1,
                       num_return_sequences=2)
    assert sampled == [[greedy, greedy]]  # per question, every sequence equal to greedy decoding
    # beams on the compressed context: at keep_ratio 1 what beams on a DynamicCache give
    full = ProxyKVPipeline(model, tok, None, budget=budget)
    ids = torch.tensor([sum(encode_chat_prompt(tok, context, "What is the code?"), [])])
    ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **with_cache(DynamicCache()),
                         max_new_tokens=6, num_beams=2, num_return_sequences=2, **GEN)
    assert full.ask(context, "What is the code?", max_new_tokens=6, num_beams=2, num_return_sequences=2) == \
        tok.batch_decode(ref[:, ids.shape[1]:], skip_special_tokens=True)
