"""How a forward's tokens reach the cache: a forward pre-hook on the model, not the calling frames. The frames are
read at most once per ``generate`` call (its whole prompt) and once for a hand-written loop whose model the cache
was not told; the hook is removed with the cache (``reset``, garbage collection), never copied or pickled, and only
the forwards that carry its own cache count. Tiny random models."""

from __future__ import annotations

import copy
import gc
import pickle
import sys

import pytest
import torch

from proxykv_hf import ProxyKVCache, SnapKVScorer
from proxykv_hf.attention.compat import with_cache
from proxykv_hf.cache import prompt as prompt_module
from proxykv_hf.testing import random_prompt, tiny_model

GEN = dict(do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def model(single_thread):
    return tiny_model("llama")


class _CountingSys:
    """Stands in for ``sys`` in :mod:`proxykv_hf.cache.prompt` (the one module that reads frames): counts reads."""

    def __init__(self):
        self.reads = 0

    def _getframe(self, depth=0):
        self.reads += 1
        return sys._getframe(depth + 1)

    def __getattr__(self, name):
        return getattr(sys, name)


@pytest.fixture
def frames(monkeypatch):
    counter = _CountingSys()
    monkeypatch.setattr(prompt_module, "sys", counter)
    return counter


def make(ratio=0.5):
    return ProxyKVCache(SnapKVScorer(window=4), ratio)


def hooks(model) -> int:
    return len(model._forward_pre_hooks) + len(model._forward_hooks)


@torch.no_grad()
def loop(model, cache, ids, n_new, *, positional=False):
    out, step = [], ids
    for _ in range(n_new):
        call = model(step, **with_cache(cache)) if positional else model(input_ids=step, **with_cache(cache))
        step = call.logits[:, -1].argmax(-1, keepdim=True)
        out.append(step)
    return torch.cat(out, dim=1)


def test_a_16_token_generate_reads_the_frames_at_most_twice(model, frames):
    inputs = random_prompt(1, 40, seed=1)
    out = model.generate(**inputs, **with_cache(make()), max_new_tokens=16, min_new_tokens=16, **GEN)
    assert out.shape[1] == 40 + 16
    assert frames.reads <= 2, f"{frames.reads} frame reads in one 16-token generate call"


def test_a_hand_written_loop_reads_the_frames_once_without_prepare_and_never_with(model, frames):
    ids = random_prompt(1, 40, seed=2)["input_ids"]
    unprepared = loop(model, make(), ids, 8)
    assert frames.reads <= 1
    frames.reads = 0
    cache = make().prepare(model, ids)
    assert torch.equal(loop(model, cache, ids, 8), unprepared)
    assert frames.reads == 0


def test_positional_input_ids_are_recorded(model):
    ids = random_prompt(1, 40, seed=3)["input_ids"]
    by_name, by_position = make(), make()
    out = loop(model, by_name, ids, 5)
    assert torch.equal(loop(model, by_position, ids, 5, positional=True), out)
    assert by_position.conversation.known and torch.equal(by_position.conversation.ids(),
                                                         by_name.conversation.ids())
    assert by_position.kept_sets().keys() == by_name.kept_sets().keys()


def test_the_hook_goes_with_reset_and_with_the_cache(model):
    before = hooks(model)
    cache = make()
    model.generate(**random_prompt(1, 30, seed=4), **with_cache(cache), max_new_tokens=3, **GEN)
    assert hooks(model) > before
    cache.reset()
    assert hooks(model) == before
    model.generate(**random_prompt(1, 30, seed=4), **with_cache(cache), max_new_tokens=3, **GEN)
    assert hooks(model) > before
    del cache
    gc.collect()
    assert hooks(model) == before


def test_two_caches_on_one_model_one_after_the_other(model):
    a_in, b_in = random_prompt(1, 30, seed=5), random_prompt(1, 36, seed=6)
    alone_a = model.generate(**a_in, **with_cache(make()), max_new_tokens=4, **GEN)
    alone_b = model.generate(**b_in, **with_cache(make()), max_new_tokens=4, **GEN)
    a, b = make(), make()
    out_a = model.generate(**a_in, **with_cache(a), max_new_tokens=4, **GEN)
    out_b = model.generate(**b_in, **with_cache(b), max_new_tokens=4, **GEN)  # a's hook is still on the model
    assert torch.equal(out_a, alone_a) and torch.equal(out_b, alone_b)
    assert torch.equal(a.conversation.ids(), out_a[:, :-1]) and torch.equal(b.conversation.ids(), out_b[:, :-1])


def test_copies_and_pickles_hold_no_hook_and_continue(model, frames):
    inputs = random_prompt(1, 30, seed=7)
    cache = make()
    out = model.generate(**inputs, **with_cache(cache), max_new_tokens=3, **GEN)
    before = hooks(model)
    twins = [copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))]
    assert hooks(model) == before
    more = torch.cat([out, torch.full((1, 3), 7)], 1)
    want = model.generate(input_ids=more, **with_cache(cache), max_new_tokens=3, **GEN)
    for twin in twins:
        frames.reads = 0
        assert torch.equal(model.generate(input_ids=more, **with_cache(twin), max_new_tokens=3, **GEN), want)
        assert frames.reads <= 1


def test_a_forward_with_another_cache_is_not_recorded(model):
    """The hook reads only forwards that carry its own cache: a helper model's (here the same model, as its own
    assistant) runs with a DynamicCache of its own."""
    inputs = random_prompt(1, 30, seed=8)
    plain = model.generate(**inputs, **with_cache(make()), max_new_tokens=5, **GEN)
    cache = make()
    out = model.generate(**inputs, **with_cache(cache), assistant_model=model, max_new_tokens=5, **GEN)
    assert torch.equal(out, plain)
    assert torch.equal(cache.conversation.ids(), out[:, :cache.get_seq_length()])


def test_an_inner_model_run_by_hand_counts_as_its_own_forward(model):
    """Only the outermost hooked forward counts: after the base model alone has run on a cache (hooked too), a
    forward of the whole model records its tokens once."""
    ids = random_prompt(1, 30, seed=9)["input_ids"]
    cache = make()
    with torch.no_grad():
        model.model(input_ids=ids, **with_cache(cache), use_cache=True)
        step = torch.full((1, 1), 5)
        model(input_ids=step, **with_cache(cache))
    assert torch.equal(cache.conversation.ids(), torch.cat([ids, step], 1))


def test_two_threads_with_two_caches_on_one_model(model):
    """Each cache's hook sees its own forwards, also while another thread runs the model with another cache."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [random_prompt(1, 30 + 4 * i, seed=10 + i) for i in range(4)]
    alone = [model.generate(**p, **with_cache(make()), max_new_tokens=6, **GEN) for p in prompts]
    caches = [make() for _ in prompts]
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda pc: model.generate(**pc[0], **with_cache(pc[1]), max_new_tokens=6, **GEN),
                             zip(prompts, caches)))
    for out, want, cache in zip(outs, alone, caches):
        assert torch.equal(out, want)
        assert torch.equal(cache.conversation.ids(), out[:, :-1])
