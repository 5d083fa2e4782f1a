"""One conversation per cache: what a cache holds as token ids, which generate calls continue it, which are refused,
and that a refused call changes nothing. Tiny random Llama; keep_ratio 0.5."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxykv_hf import ProxyKVCache, RandomScorer, SnapKVScorer
from proxykv_hf.attention.compat import with_cache
from proxykv_hf.cache.conversation import Conversation
from proxykv_hf.testing import random_prompt, tiny_model

GEN = dict(do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def model(single_thread):
    return tiny_model("llama")


def run(model, ids, cache, n=3, **kw):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **with_cache(cache),
                          max_new_tokens=n, **GEN, **kw)


def tokens(n, seed, rows=1):
    return torch.randint(4, 250, (rows, n), generator=torch.Generator().manual_seed(seed))


def test_conversation_check_names_what_differs():
    conv = Conversation()
    conv.append(torch.tensor([[5, 6, 7, 8]]), 4)
    assert conv.check(torch.tensor([[5, 6, 7, 8, 9]])) == 1
    assert conv.check(torch.tensor([[5, 6, 7, 8, 9]] * 3)) == 3  # every row repeats the held one: expand 3x
    with pytest.raises(ValueError, match="row 0 is different at token 2"):
        conv.check(torch.tensor([[5, 6, 0, 8, 9]]))
    with pytest.raises(ValueError, match="prompt of 4 tokens.*already holds 4"):
        conv.check(torch.tensor([[5, 6, 7, 8]]))
    conv.append(None, 1)  # a forward fed embeddings: the ids are unknown from here on
    with pytest.raises(ValueError, match="inputs_embeds"):
        conv.check(torch.tensor([[5, 6, 7, 8, 9, 1]]))


def test_cache_records_prompt_and_generated_tokens(model):
    cache = ProxyKVCache(SnapKVScorer(window=8), keep_ratio=0.5)
    out = run(model, tokens(60, 1), cache, n=5)
    assert torch.equal(cache.conversation.ids(), out[:, :-1])  # the last token is never fed back
    assert len(cache.conversation) == cache.get_seq_length() == out.shape[1] - 1


@pytest.mark.parametrize("budget", ["uniform", "global"])
def test_edited_earlier_turn_and_same_length_edit_are_refused(model, budget):
    cache = ProxyKVCache(RandomScorer(), keep_ratio=0.5, budget=budget)
    turn1 = run(model, tokens(100, 1), cache, n=8)
    answer = turn1.clone()
    answer[0, 100:104] = (answer[0, 100:104] + 7) % 240 + 4  # the assistant's earlier answer, edited
    same_length = turn1.clone()
    same_length[0, 5:30] = (same_length[0, 5:30] + 7) % 240 + 4  # generate would feed just 1 token
    for ids in (torch.cat([answer, tokens(20, 2)], 1), same_length):
        with pytest.raises(ValueError, match="does not continue"):
            run(model, ids, cache)
    more = torch.cat([turn1, tokens(20, 2)], 1)
    assert torch.equal(run(model, more, cache)[:, :more.shape[1]], more)  # a real continuation still works


@pytest.mark.parametrize("budget", ["uniform", "global"])
def test_batch_growth_repeats_rows_and_other_sizes_are_refused(model, budget):
    cache = ProxyKVCache(SnapKVScorer(window=16), keep_ratio=0.5, budget=budget)
    turn1 = run(model, tokens(100, 1), cache, n=4)
    turn2 = torch.cat([turn1, tokens(20, 2)], 1)
    ref = ProxyKVCache(SnapKVScorer(window=16), keep_ratio=0.5, budget=budget)
    run(model, tokens(100, 1), ref, n=4)
    alone = run(model, turn2, ref, n=6)
    both = run(model, torch.cat([turn2, turn2]), cache, n=6)  # the held row is repeated for the second
    assert torch.equal(both, alone.expand(2, -1))
    three = torch.cat([both[:, :-1]] * 2)[:3]
    with pytest.raises(ValueError, match="batch of 3 rows"):
        run(model, torch.cat([three, tokens(2, 3, rows=3)], 1), cache)


def test_a_refused_call_changes_nothing(model):
    cache, ref = (ProxyKVCache(SnapKVScorer(window=8), keep_ratio=0.5) for _ in range(2))
    first = tokens(60, 1)
    out = run(model, first, cache)
    assert torch.equal(run(model, first, ref), out)
    with pytest.raises(ValueError):
        run(model, tokens(90, 2), cache)
    nxt = torch.cat([out, tokens(5, 3)], 1)
    assert torch.equal(run(model, nxt, cache), run(model, nxt, ref))


def test_a_continuation_prefilled_in_chunks(model):
    """transformers >= 5.23 feeds a continued conversation's new tokens chunk by chunk (same tokens as one forward);
    earlier releases feed the whole prompt again, which the cache refuses instead of holding it twice."""
    import transformers
    from packaging.version import Version

    cache, ref = (ProxyKVCache(SnapKVScorer(window=8), keep_ratio=0.5) for _ in range(2))
    out = run(model, tokens(60, 1), cache)
    run(model, tokens(60, 1), ref)
    nxt = torch.cat([out, tokens(30, 2)], 1)
    if Version(transformers.__version__) >= Version("5.23"):
        assert torch.equal(run(model, nxt, cache, prefill_chunk_size=8), run(model, nxt, ref))
    else:
        with pytest.raises(ValueError, match="feed the whole prompt again"):
            run(model, nxt, cache, prefill_chunk_size=8)


def test_crop_shortens_the_conversation_and_refuses_the_compressed_prompt(model):
    cache = ProxyKVCache(SnapKVScorer(window=8), keep_ratio=0.5)
    out = run(model, tokens(60, 1), cache, n=6)
    cache.crop(-3)
    assert torch.equal(cache.conversation.ids(), out[:, :-4])
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(-10)
    nxt = torch.cat([out[:, :-4], tokens(4, 2)], 1)
    assert torch.equal(run(model, nxt, cache)[:, :nxt.shape[1]], nxt)


# ------------------------------------------------------------------------------------------------------------------
# random call sequences: a generate call is refused exactly when its prompt does not continue what the cache holds,
# a refused call changes nothing, and every accepted call gives what a cache that saw only the accepted calls gives

OPS = st.lists(st.tuples(st.sampled_from(["continue", "edit", "shorten", "reset", "expand", "crop"]),
                         st.integers(1, 6)), min_size=2, max_size=6)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, seed=st.integers(0, 1000), budget=st.sampled_from(["uniform", "global"]))
def test_random_call_sequences_follow_the_rule(model, ops, seed, budget):
    cache, shadow = (ProxyKVCache(RandomScorer(seed=seed), keep_ratio=0.5, budget=budget) for _ in range(2))
    held = None  # what the cache should hold: (B, S) ids
    appended = 0  # tokens added after the compressed prompt
    for step, (op, k) in enumerate(ops):
        fresh = tokens(40 + 5 * k, seed + step)
        if op == "reset" or held is None:
            cache.reset()
            shadow.reset()
            out = run(model, fresh, cache, n=3)
            assert torch.equal(out, run(model, fresh, shadow, n=3))
            held, appended = out[:, :-1], 2
            continue
        if op in ("continue", "expand"):
            ids = torch.cat([held, tokens(k, seed + step, rows=held.shape[0])], 1)
            if op == "expand" and held.shape[0] < 4:
                ids = ids.repeat_interleave(2, dim=0)
            out = run(model, ids, cache, n=3)
            assert torch.equal(out, run(model, ids, shadow, n=3))
            held, appended = out[:, :-1], appended + ids.shape[1] - held.shape[1] + 2
        elif op == "crop":
            if k > appended:
                with pytest.raises(ValueError, match="cannot crop"):
                    cache.crop(-k)
                continue
            cache.crop(-k)
            shadow.crop(-k)
            held, appended = held[:, :-k], appended - k
        else:  # edit or shorten: refused, and nothing changes
            if op == "edit":
                ids = torch.cat([held, tokens(1, seed, rows=held.shape[0])], 1)
                pos = (k * 7) % held.shape[1]
                ids[:, pos] = (ids[:, pos] + 1) % 240 + 4
            else:
                ids = held[:, :held.shape[1] - k]
            with pytest.raises(ValueError, match="continue"):
                run(model, ids, cache)
        assert torch.equal(cache.conversation.ids(), held)
        assert cache.get_seq_length() == held.shape[1]
