"""Every scorer x both budgets x the ways transformers' ``generate`` runs a cache: each run either gives what its
reference gives (a hand-written loop, plain greedy decoding, the unchunked run, each row alone, a fresh cache, or a
``DynamicCache`` at keep_ratio 1) or raises the documented ``ValueError``. Tiny random models; keep_ratio 0.5."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import DynamicCache

from proxykv_hf import ProxyKVCache
from proxykv_hf.cli.helpers import tiny_mapper_checkpoint
from proxykv_hf.attention.compat import with_cache
from proxykv_hf.scorers import ScorerContext, registry
from proxykv_hf.testing import random_prompt, self_proxy_scorer, tiny_model, tiny_tokenizer

SCORERS = [name for name in registry.names() if name != "full"] + ["proxykv_self"]
BUDGETS = ["uniform", "global"]
GEN = dict(do_sample=False, pad_token_id=0, max_new_tokens=4)
N = 80
RATIO = 0.5


@pytest.fixture(scope="module")
def world(single_thread):
    model = tiny_model("llama")
    ctx = ScorerContext(model=model, tokenizer=tiny_tokenizer(), mapper=tiny_mapper_checkpoint(model),
                        fields={"context_chunk": 16})
    # the proxy_* methods read a separate proxy model: another depth and head count than the target's
    with_proxy = dataclasses.replace(ctx, proxy=tiny_model("llama", num_hidden_layers=3, num_attention_heads=8,
                                                            seed=1))
    scorers = {name: registry.build(name, with_proxy if name.startswith("proxy_") else ctx)
               for name in SCORERS if name != "proxykv_self"}
    # the mapper in float32: under bfloat16 autocast (CPUs with AVX512-BF16 or AMX) a padded row's logits differ from
    # its logits alone by rounding, which can swap two near-tied tokens; what these tests check is the cache's logic
    scorers["proxykv"].mapper_autocast = False
    scorers["proxykv_self"] = self_proxy_scorer(model)
    return model, scorers


def make(world, name, budget, ratio=RATIO):
    return ProxyKVCache(world[1][name], ratio, budget=budget)


def gen(model, inputs, cache, **kw):
    return model.generate(**inputs, **with_cache(cache), **{**GEN, **kw})


def prompt(seed=1, n=N):
    return random_prompt(1, n, seed=seed)


def kept(cache):
    return {i: [[h.tolist() for h in row] for row in rows] for i, rows in cache.kept_sets().items()}


@torch.no_grad()
def manual_greedy(model, cache, ids, n_new, attention_mask=None):
    """Greedy decoding by hand: one forward of ``ids`` (the new tokens), then one token at a time."""
    out, step = [], ids
    for _ in range(n_new):
        logits = model(input_ids=step, **with_cache(cache), use_cache=True).logits[:, -1]
        step = logits.argmax(-1, keepdim=True)
        out.append(step)
    return torch.cat(out, dim=1)


matrix = pytest.mark.parametrize("budget", BUDGETS)
scorers = pytest.mark.parametrize("name", SCORERS)


@scorers
@matrix
def test_greedy_equals_a_hand_written_loop(world, name, budget):
    model = world[0]
    inputs = prompt()
    out = gen(model, inputs, make(world, name, budget))
    cache = make(world, name, budget).prepare(model, inputs["input_ids"])
    assert torch.equal(out[:, N:], manual_greedy(model, cache, inputs["input_ids"], GEN["max_new_tokens"]))


@scorers
@matrix
def test_sampling_and_num_return_sequences(world, name, budget):
    model = world[0]
    inputs = prompt()
    greedy = gen(model, inputs, make(world, name, budget))
    sampled = gen(model, inputs, make(world, name, budget), do_sample=True, top_k=1, num_return_sequences=2)
    assert torch.equal(sampled, greedy.expand(2, -1))  # top_k=1 sampling is greedy, in every returned row


@scorers
@matrix
def test_beams_keep_what_one_row_keeps(world, name, budget):
    model = world[0]
    inputs = prompt()
    one = make(world, name, budget)
    gen(model, inputs, one)
    beams = make(world, name, budget)
    out = gen(model, inputs, beams, num_beams=2, num_return_sequences=2)
    assert out.shape == (2, N + GEN["max_new_tokens"]) and torch.equal(out[:, :N], inputs["input_ids"].expand(2, -1))
    for layer, rows in kept(beams).items():
        assert rows == kept(one)[layer] * 2  # every beam holds the compressed prompt of the row


@matrix
def test_beams_at_keep_ratio_one_equal_a_dynamic_cache(world, budget):
    model = world[0]
    inputs = prompt()
    ref = gen(model, inputs, DynamicCache(), num_beams=3, num_return_sequences=2)
    assert torch.equal(gen(model, inputs, make(world, "snapkv", budget, 1.0), num_beams=3, num_return_sequences=2),
                       ref)


@scorers
@matrix
def test_assisted_and_prompt_lookup_equal_plain_greedy(world, name, budget):
    model = world[0]
    twin = tiny_model("llama")  # identical weights: every candidate is accepted
    inputs = prompt()
    assert torch.equal(gen(model, inputs, make(world, name, budget), assistant_model=twin),
                       gen(model, inputs, make(world, name, budget)))
    ids = torch.cat([torch.randint(4, 200, (1, 20), generator=torch.Generator().manual_seed(3))] * 4, 1)
    repetitive = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    assert torch.equal(gen(model, repetitive, make(world, name, budget), prompt_lookup_num_tokens=3),
                       gen(model, repetitive, make(world, name, budget)))


@scorers
@matrix
def test_chunked_prefill_equals_unchunked(world, name, budget):
    model = world[0]
    inputs = prompt()
    whole, chunked = make(world, name, budget), make(world, name, budget)
    ref = gen(model, inputs, whole)
    assert torch.equal(gen(model, inputs, chunked, prefill_chunk_size=26), ref)  # chunks of 26, 26, 26, 2
    assert kept(chunked) == kept(whole)


@scorers
@matrix
def test_padded_rows_equal_rows_alone(world, name, budget):
    model = world[0]
    batch = random_prompt(2, N, seed=2, lengths=[N, 60])
    together = make(world, name, budget)
    out = gen(model, batch, together)
    for row, n in enumerate((N, 60)):
        alone = make(world, name, budget)
        ref = gen(model, {k: v[row:row + 1, N - n:] for k, v in batch.items()}, alone)
        assert torch.equal(out[row, N:], ref[0, n:])
        for layer, rows in kept(together).items():
            assert [[p - (N - n) for p in head] for head in rows[row]] == kept(alone)[layer][0]


@scorers
@matrix
def test_continuation_equals_a_hand_written_continuation(world, name, budget):
    model = world[0]
    inputs = prompt()
    question = torch.randint(4, 200, (1, 12), generator=torch.Generator().manual_seed(4))
    cache, ref_cache = make(world, name, budget), make(world, name, budget)
    turn1 = gen(model, inputs, cache)
    assert torch.equal(gen(model, inputs, ref_cache), turn1)
    turn2 = torch.cat([turn1, question], dim=1)
    out = gen(model, {"input_ids": turn2, "attention_mask": torch.ones_like(turn2)}, cache)
    new = torch.cat([turn1[:, -1:], question], dim=1)  # the last generated token was never fed back
    assert torch.equal(out[:, turn2.shape[1]:], manual_greedy(model, ref_cache, new, GEN["max_new_tokens"]))


@scorers
@matrix
def test_a_prompt_that_does_not_continue_is_refused(world, name, budget):
    model = world[0]
    cache = make(world, name, budget)
    turn1 = gen(model, prompt(), cache)
    edited = turn1.clone()
    edited[0, 10] = (edited[0, 10] + 1) % 250 + 4
    for ids in (prompt(seed=5)["input_ids"], prompt(seed=5, n=20)["input_ids"], edited):
        with pytest.raises(ValueError, match="continue"):
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **with_cache(cache), **GEN)
    cache.reset()
    assert torch.equal(gen(model, prompt(seed=5), cache), gen(model, prompt(seed=5), make(world, name, budget)))


@scorers
@matrix
def test_prepare_then_generate(world, name, budget):
    model = world[0]
    inputs = prompt()
    cache = make(world, name, budget).prepare(model, inputs["input_ids"], inputs["attention_mask"])
    assert torch.equal(gen(model, inputs, cache), gen(model, inputs, make(world, name, budget)))
    other = make(world, name, budget).prepare(model, inputs["input_ids"], inputs["attention_mask"])
    with pytest.raises(ValueError, match="prepare"):
        gen(model, prompt(seed=6), other)


@pytest.mark.slow
@matrix
def test_compiled_model_equals_eager(world, budget):
    model = world[0]
    inputs = prompt()
    compiled = torch.compile(model)
    assert torch.equal(compiled.generate(**inputs, **with_cache(make(world, "snapkv", budget)), **GEN),
                       gen(model, inputs, make(world, "snapkv", budget)))
