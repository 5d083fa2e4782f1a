"""ProxyKVCache under model.generate: exactness, physical size, padding, generation modes, errors."""

import math

import pytest
import torch
from transformers import DynamicCache

from proxykv_hf import BackgroundScorer, ProxyKVCache, RandomScorer, SnapKVScorer, StreamingLLMScorer
from proxykv_hf.cache.proxykv_cache import DEFAULT_KEEP_RATIO, ProxyKVLayer
from proxykv_hf.attention.compat import with_cache
from proxykv_hf.testing import FAMILIES, random_prompt, tiny_model


def greedy(model, inputs, cache, n=6, **kw):
    return model.generate(**inputs, **with_cache(cache), max_new_tokens=n, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kw)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_keep_ratio_one_is_identical_to_dynamic_cache(family, impl):
    model = tiny_model(family, attn_implementation=impl)
    inputs = random_prompt(2, 40, lengths=[40, 29], seed=1)
    ref = greedy(model, inputs, DynamicCache(config=model.config))
    out = greedy(model, inputs, ProxyKVCache(SnapKVScorer(window=8), keep_ratio=1.0))
    assert torch.equal(ref.sequences, out.sequences)
    for a, b in zip(ref.logits, out.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_physical_and_logical_lengths(family):
    model = tiny_model(family)
    N, rho, n_new = 50, 0.3, 7
    inputs = random_prompt(1, N, seed=2)
    cache = ProxyKVCache(SnapKVScorer(window=4), keep_ratio=rho)
    out = greedy(model, inputs, cache, n=n_new)
    t = out.sequences.shape[1] - N - 1  # tokens fed back after the prefill (the last one never is)
    K = math.ceil(rho * N)
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, ProxyKVLayer):
            assert layer.keys.shape[-2] == K + t
            assert layer.values.shape[-2] == K + t
            # the dropped entries are really gone: the storage holds what is kept and the room for later tokens
            entry = layer.keys.shape[0] * layer.keys.shape[1] * layer.keys.shape[-1] * layer.keys.element_size()
            assert layer.keys.untyped_storage().nbytes() == (K + min(ProxyKVLayer.ROOM, N - K)) * entry
        assert cache.get_seq_length(i) == N + t
    assert cache.compactable_layers()  # every family has at least one compacted layer


def test_first_token_is_exact_and_decode_matches_kept_subset():
    """Decode logits equal a run whose cache holds exactly the kept entries at their original positions."""
    model = tiny_model("llama")
    N, n_new = 48, 5
    inputs = random_prompt(1, N, seed=3)
    cache = ProxyKVCache(RandomScorer(seed=1), keep_ratio=0.25)
    out = greedy(model, inputs, cache, n=n_new)
    full = greedy(model, inputs, DynamicCache(config=model.config), n=1)
    torch.testing.assert_close(out.logits[0], full.logits[0], rtol=0, atol=0)

    # Reference: full prefill K/V, gathered at the kept positions, in a plain DynamicCache.
    ref_cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(**inputs, **with_cache(ref_cache))
    manual = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        idx = layer.kept_positions[..., None].expand(-1, -1, -1, layer.keys.shape[-1])
        k = ref_cache.layers[i].keys.gather(2, idx)
        v = ref_cache.layers[i].values.gather(2, idx)
        manual.update(k, v, i)
    seq = out.sequences
    for s in range(1, n_new):
        tok = seq[:, N + s - 1: N + s]
        with torch.no_grad():
            logits = model(input_ids=tok, **with_cache(manual),
                           position_ids=torch.tensor([[N + s - 1]])).logits[:, -1]
        torch.testing.assert_close(logits, out.logits[s], rtol=1e-5, atol=1e-5)


def test_decode_attention_by_hand_over_kept_subset():
    """One layer's decode attention output equals softmax(q K_kept^T) V_kept computed by hand."""
    model = tiny_model("llama", attn_implementation="eager")
    N = 40
    inputs = random_prompt(1, N, seed=4)
    cache = ProxyKVCache(SnapKVScorer(window=4), keep_ratio=0.3)
    with torch.no_grad():
        model(**inputs, **with_cache(cache))
    attn = model.model.layers[1].self_attn
    captured = {}

    def hook(mod, args, kwargs, output):
        captured["hidden"] = kwargs["hidden_states"]
        captured["pos"] = kwargs["position_embeddings"]
        captured["out"] = output[0]

    keys_before = cache.layers[1].keys.clone()
    values_before = cache.layers[1].values.clone()
    handle = attn.register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        model(input_ids=torch.tensor([[7]]), **with_cache(cache), position_ids=torch.tensor([[N]]))
    handle.remove()
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    h = captured["hidden"]
    B, Q, _ = h.shape
    D = attn.head_dim
    q = attn.q_proj(h).view(B, Q, -1, D).transpose(1, 2)
    k = attn.k_proj(h).view(B, Q, -1, D).transpose(1, 2)
    v = attn.v_proj(h).view(B, Q, -1, D).transpose(1, 2)
    cos, sin = captured["pos"]
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    K_all = torch.cat([keys_before, k], 2).repeat_interleave(attn.num_key_value_groups, 1)
    V_all = torch.cat([values_before, v], 2).repeat_interleave(attn.num_key_value_groups, 1)
    p = torch.softmax(q @ K_all.transpose(-1, -2) * attn.scaling, -1)
    o = attn.o_proj((p @ V_all).transpose(1, 2).reshape(B, Q, -1))
    torch.testing.assert_close(o, captured["out"], rtol=1e-5, atol=1e-6)
    # the query was rotated at the logical position N, not at the physical length
    assert captured["pos"][0].shape[-2] == 1


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_left_padded_batch_equals_rows_alone(family, impl):
    model = tiny_model(family, attn_implementation=impl)
    lengths = [44, 31]
    batch = random_prompt(2, 44, lengths=lengths, seed=5)
    out = greedy(model, batch, ProxyKVCache(SnapKVScorer(window=4), keep_ratio=0.3), n=6)
    for b, n in enumerate(lengths):
        alone = {k: v[b:b + 1, -n:] for k, v in batch.items()}
        ref = greedy(model, alone, ProxyKVCache(SnapKVScorer(window=4), keep_ratio=0.3), n=6)
        assert torch.equal(out.sequences[b, 44:], ref.sequences[0, n:])
        for s in range(6):
            torch.testing.assert_close(out.logits[s][b], ref.logits[s][0], rtol=1e-4, atol=1e-4)


def test_generation_modes_run_and_keep_size():
    model = tiny_model("llama")
    inputs = random_prompt(2, 36, lengths=[36, 30], seed=6)
    K = math.ceil(0.3 * 36)
    # sampling with several sequences per prompt
    cache = ProxyKVCache(SnapKVScorer(window=4), keep_ratio=0.3)
    torch.manual_seed(0)
    out = model.generate(**inputs, **with_cache(cache), max_new_tokens=5, do_sample=True,
                         num_return_sequences=2, pad_token_id=0)
    assert out.shape == (4, 41)
    assert cache.layers[0].keys.shape[:3] == (4, 2, K + 4)
    # beam search
    cache = ProxyKVCache(SnapKVScorer(window=4), keep_ratio=0.3)
    out = model.generate(**inputs, **with_cache(cache), max_new_tokens=5, num_beams=3, do_sample=False,
                         pad_token_id=0)
    assert out.shape[0] == 2
    assert cache.layers[0].keys.shape[-2] <= K + 4


def test_second_generate_continues_on_the_compressed_cache():
    model = tiny_model("llama")
    inputs = random_prompt(1, 40, seed=8)
    cache = ProxyKVCache(SnapKVScorer(window=4), keep_ratio=0.3)
    first = model.generate(**inputs, **with_cache(cache), max_new_tokens=4, do_sample=False, pad_token_id=0)
    K = math.ceil(0.3 * 40)
    question = torch.randint(4, 200, (1, 6), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([first, question], 1)
    second = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **with_cache(cache),
                            max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(second[:, :ids.shape[1]], ids)
    logical = ids.shape[1] + 3
    assert cache.get_seq_length() == logical
    # the prompt stays compacted; everything after it is kept in full
    assert cache.layers[0].keys.shape[-2] == K + (logical - 40)


def test_unrelated_prompt_on_a_used_cache_is_an_error():
    model = tiny_model("llama")
    cache = ProxyKVCache(SnapKVScorer(window=4), keep_ratio=0.3)
    model.generate(**random_prompt(1, 30, seed=9), **with_cache(cache), max_new_tokens=2, pad_token_id=0)
    other = random_prompt(1, 40, seed=10)
    with pytest.raises(ValueError, match="does not continue the conversation"):
        model.generate(**other, **with_cache(cache), max_new_tokens=2, pad_token_id=0)
    cache.reset()
    model.generate(**other, **with_cache(cache), max_new_tokens=2, pad_token_id=0)
    assert cache.layers[0].keys.shape[-2] == math.ceil(0.3 * 40) + 1


def test_chunked_prefill_equals_unchunked():
    model = tiny_model("llama")
    inputs = random_prompt(2, 45, lengths=[45, 33], seed=11)
    a = greedy(model, inputs, ProxyKVCache(RandomScorer(3), keep_ratio=0.4), n=5)
    cache = ProxyKVCache(RandomScorer(3), keep_ratio=0.4)
    b = greedy(model, inputs, cache, n=5, prefill_chunk_size=16)
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
    assert cache.layers[0].keys.shape[-2] == math.ceil(0.4 * 45) + 4


def test_explicit_prepare_without_frame_lookup():
    model = tiny_model("llama")
    inputs = random_prompt(1, 30, seed=12)
    auto = greedy(model, inputs, ProxyKVCache(SnapKVScorer(window=4), keep_ratio=0.5))
    cache = ProxyKVCache(SnapKVScorer(window=4), keep_ratio=0.5).prepare(model, **inputs)
    manual = greedy(model, inputs, cache)
    assert torch.equal(auto.sequences, manual.sequences)


def test_streaming_keeps_sinks_and_recent():
    model = tiny_model("llama")
    N = 40
    cache = ProxyKVCache(StreamingLLMScorer(n_sink=4), keep_ratio=0.25)
    with torch.no_grad():
        model(**random_prompt(1, N, seed=13), **with_cache(cache))
    kept = cache.layers[0].kept_positions[0, 0].tolist()
    assert kept == [0, 1, 2, 3] + list(range(N - 6, N))


def test_short_prompt_keeps_everything():
    model = tiny_model("llama")
    inputs = random_prompt(1, 6, seed=14)
    cache = ProxyKVCache(SnapKVScorer(window=8), keep_ratio=0.1)
    with torch.no_grad():
        model(**inputs, **with_cache(cache))
    assert cache.layers[0].keys.shape[-2] == 6


def test_crop_only_after_the_compressed_prompt():
    model = tiny_model("llama")
    cache = ProxyKVCache(SnapKVScorer(window=4), keep_ratio=0.3)
    model.generate(**random_prompt(1, 30, seed=15), **with_cache(cache), max_new_tokens=4, pad_token_id=0)
    cache.crop(-2)
    assert cache.get_seq_length() == 31
    with pytest.raises(ValueError, match="compressed prompt"):
        cache.crop(-5)


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, float("nan"), "0.3", True])
def test_bad_keep_ratio(bad):
    with pytest.raises(ValueError, match="keep_ratio"):
        ProxyKVCache(SnapKVScorer(), keep_ratio=bad)


def test_the_default_keep_ratio_is_the_papers_with_a_scorer_and_one_without():
    assert ProxyKVCache(SnapKVScorer()).keep_ratio == DEFAULT_KEEP_RATIO
    assert ProxyKVCache().keep_ratio == ProxyKVCache(None).keep_ratio == 1.0


@pytest.mark.parametrize("keep_ratio", [0.3, 0.99])
def test_a_keep_ratio_below_one_without_a_scorer_is_refused(keep_ratio):
    """It would keep every token while the cache says keep_ratio (a silent no-op)."""
    with pytest.raises(ValueError, match=f"keep_ratio={keep_ratio} needs a scorer.*SnapKVScorer"):
        ProxyKVCache(None, keep_ratio)
    with pytest.raises(ValueError, match="needs a scorer"):
        ProxyKVCache(keep_ratio=keep_ratio)


def test_all_padding_row_is_an_error():
    model = tiny_model("llama")
    inputs = random_prompt(2, 20, seed=16)
    inputs["attention_mask"][1] = 0
    with pytest.raises(ValueError, match="all padding"):
        with torch.no_grad():
            model(**inputs, **with_cache(ProxyKVCache(SnapKVScorer(), keep_ratio=0.5)))


def test_right_padding_is_an_error():
    model = tiny_model("llama")
    inputs = random_prompt(2, 20, seed=17)
    inputs["attention_mask"][1, -3:] = 0
    with pytest.raises(ValueError, match="left padding"):
        with torch.no_grad():
            model(**inputs, **with_cache(ProxyKVCache(SnapKVScorer(), keep_ratio=0.5)))


def test_unsupported_family_and_attention():
    from transformers import AutoModelForCausalLM, GPT2Config

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    cache = ProxyKVCache(SnapKVScorer(), keep_ratio=0.5)
    with pytest.raises(ValueError, match="supported: llama"):
        cache.prepare(gpt2, torch.ones(1, 5, dtype=torch.long))
    model = tiny_model("llama")
    model.config._attn_implementation_internal = "flash_attention_2"
    with pytest.raises(ValueError, match="sdpa' or 'eager"):
        ProxyKVCache(SnapKVScorer(), keep_ratio=0.5).prepare(model, torch.ones(1, 5, dtype=torch.long))


def test_inputs_embeds_without_prepare_is_a_clear_error():
    model = tiny_model("llama")
    ids = random_prompt(1, 10, seed=18)["input_ids"]
    embeds = model.get_input_embeddings()(ids)
    with pytest.raises(ValueError, match="prepare"):
        with torch.no_grad():
            model(inputs_embeds=embeds, **with_cache(ProxyKVCache(SnapKVScorer(), keep_ratio=0.5)))
    cache = ProxyKVCache(SnapKVScorer(window=2), keep_ratio=0.5).prepare(model, inputs_embeds_shape=(1, 10))
    with torch.no_grad():
        model(inputs_embeds=embeds, **with_cache(cache))
    assert cache.layers[0].keys.shape[-2] == 5


def test_plain_dynamic_cache_unaffected_after_opt_in():
    model = tiny_model("llama")
    inputs = random_prompt(1, 20, seed=19)
    before = greedy(model, inputs, DynamicCache(config=model.config))
    greedy(model, inputs, ProxyKVCache(SnapKVScorer(window=4), keep_ratio=0.3))  # opts the model in
    assert model.config._attn_implementation == "proxykv_sdpa"
    after = greedy(model, inputs, DynamicCache(config=model.config))
    assert torch.equal(before.sequences, after.sequences)


@pytest.mark.parametrize("budget", ["uniform", "global"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_compacted_copy_equals_a_live_cache(family, budget):
    """Recording scores once and compacting copies gives what a cache with that keep_ratio and budget gives."""
    model = tiny_model(family)
    inputs = random_prompt(2, 40, lengths=[40, 29], seed=20)
    from proxykv_hf.eval.methods import RecordingCache, compacted_copy

    rec = RecordingCache(SnapKVScorer(window=4))
    with torch.no_grad():
        model(**inputs, position_ids=(inputs["attention_mask"].cumsum(-1) - 1).clamp_min(0), **with_cache(rec))
    assert rec.physical_lengths()[rec.compactable_layers()[0]] == 40  # nothing dropped
    for rho in (0.2, 0.5):
        live = greedy(model, inputs, ProxyKVCache(SnapKVScorer(window=4), keep_ratio=rho, budget=budget), n=4)
        copy = compacted_copy(rec, rho, budget)
        for i, rows in live.past_key_values.kept_sets().items():
            for row_live, row_copy in zip(rows, copy.kept_sets()[i]):
                assert all(torch.equal(a, b) for a, b in zip(row_live, row_copy))
        ids = live.sequences[:, :41]
        out = model.generate(input_ids=ids, attention_mask=torch.cat([inputs["attention_mask"],
                                                                      torch.ones(2, 1, dtype=torch.long)], 1),
                             **with_cache(copy), max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert torch.equal(out, live.sequences)


class _LateScorer(RandomScorer, BackgroundScorer):
    """Background scores that only become ready after ``ready_after`` polls (a side stream still running)."""

    def __init__(self, ready_after: int):
        super().__init__(seed=4)
        self.ready_after, self.polls, self.compacted_at_poll = ready_after, 0, []

    def ready(self) -> bool:
        self.polls += 1
        return self.polls > self.ready_after


@pytest.mark.parametrize("ready_after", [0, 1, 100])
def test_background_scores_wait_without_blocking(ready_after):
    """Layers prefilled before the scores are in are compacted later, with the same result as compacting at once."""
    model = tiny_model("llama", num_hidden_layers=4)
    inputs = random_prompt(2, 40, lengths=[40, 31], seed=5)
    ref_cache = ProxyKVCache(RandomScorer(seed=4), keep_ratio=0.3)
    ref = greedy(model, inputs, ref_cache)
    scorer = _LateScorer(ready_after)
    seen = []
    compact = ProxyKVLayer.compact
    ProxyKVLayer.compact = lambda layer, idx, **kw: (seen.append(scorer.polls), compact(layer, idx, **kw))[1]
    try:
        cache = ProxyKVCache(scorer, keep_ratio=0.3)
        out = greedy(model, inputs, cache)
    finally:
        ProxyKVLayer.compact = compact
    assert torch.equal(ref.sequences, out.sequences)
    for a, b in zip(ref_cache.layers, cache.layers):
        assert torch.equal(a.kept_positions, b.kept_positions)
    # the cache polls once per layer; a layer is compacted at the first poll that finds the scores ready, or at the
    # last layer: ready at once -> each layer at its own poll; ready at the 2nd poll -> layer 0 waits for layer 1
    expected = {0: [1, 2, 3, 4], 1: [2, 2, 3, 4], 100: [4, 4, 4, 4]}[ready_after]
    assert seen == expected


class _AttendingCache(DynamicCache):
    """Leaves, for every layer, a pending call that computes the attention itself (and records that it did)."""

    def __init__(self, config):
        super().__init__(config=config)
        self.attended = []

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        from proxykv_hf.attention import wrapper as attention
        from proxykv_hf.attention.statistics import causal_attention_with_statistics

        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        cache = self

        class Call:
            def before(self, module, attention_mask, query, key):
                return attention_mask

            def attend(self, module, query, key, value, scaling):
                cache.attended.append(layer_idx)
                return causal_attention_with_statistics(query, key, value, scaling, chunk_size=7)[0]

            def after(self, *args):
                pass

        attention.set_pending(Call())
        return keys, values


@pytest.mark.parametrize("family", FAMILIES)
def test_a_pending_call_may_compute_plain_causal_attention(family):
    """The wrapper hands an unpadded causal prefill to a pending call's ``attend`` (and uses its output in sdpa's
    layout); masked layers (padding, Gemma3's sliding windows) and decode steps keep sdpa."""
    from proxykv_hf.attention.wrapper import use_proxykv_attention

    model = tiny_model(family, num_hidden_layers=3 if family != "gemma3" else 6)
    use_proxykv_attention(model)
    full = [i for i, t in enumerate(getattr(model.config, "layer_types", None) or ["full_attention"] * 3)
            if t == "full_attention"]
    for lengths, expected in (([40, 40], full), ([40, 31], [])):
        inputs = random_prompt(2, 40, lengths=lengths, seed=0)
        kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        ref = model.generate(**inputs, **with_cache(DynamicCache(config=model.config)), **kw)
        cache = _AttendingCache(model.config)
        out = model.generate(**inputs, **with_cache(cache), **kw)
        assert cache.attended == expected
        assert torch.equal(ref.sequences, out.sequences)
        torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), rtol=1e-4, atol=1e-4)


def test_plain_causal_declines_anything_special():
    from proxykv_hf.attention.wrapper import plain_causal

    module = torch.nn.Module()
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
    plain = dict(dropout=0.0, scaling=0.3, sliding_window=None, position_ids=None, use_cache=True)
    assert plain_causal(module, q, k, k, None, (), plain)
    assert not plain_causal(module, q, k, k, torch.ones(1, 1, 6, 6, dtype=torch.bool), (), plain)  # a mask
    assert not plain_causal(module, q[:, :, -1:], k, k, None, (), plain)  # a decode step
    assert not plain_causal(module, q[:, :, -4:], k, k, None, (), plain)  # a continuation prefill
    assert not plain_causal(module, q, k, k[..., :4], None, (), plain)  # values of another width
    assert not plain_causal(module, q, k, k, None, (0.1,), plain)  # positional extras
    for extra in (dict(dropout=0.1), dict(sliding_window=4), dict(softcap=30.0), dict(is_causal=False),
                  dict(s_aux=torch.zeros(4))):
        assert not plain_causal(module, q, k, k, None, (), {**plain, **extra}), extra
    module.is_causal = False  # an encoder
    assert not plain_causal(module, q, k, k, None, (), plain)


def test_appends_after_compaction_never_change_another_holders_view():
    """Compacted layers append into spare room in place; a snapshot, a restored state and a twin sharing the buffer
    each keep what they saw."""
    torch.manual_seed(0)
    layer = ProxyKVLayer()
    k, v = torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4)
    layer.update(k, v)
    layer.compact(torch.tensor([[[0, 3, 5], [1, 2, 9]]]))
    step = [torch.randn(1, 2, 1, 4) for _ in range(4)]
    layer.update(step[0], step[0])
    saved = dict(vars(layer))
    twin = ProxyKVLayer()
    twin.__dict__.update(saved)
    layer.update(step[1], step[1])
    room = layer.keys.untyped_storage().data_ptr()
    layer.update(step[2], step[2])
    assert layer.keys.untyped_storage().data_ptr() == room  # in place: no copy of the whole layer
    twin.update(step[3], step[3])  # shares the buffer but ends elsewhere: moves to its own
    assert twin.keys.untyped_storage().data_ptr() != room
    assert torch.equal(twin.keys[:, :, -1:], step[3]) and torch.equal(twin.keys[:, :, 3:4], step[0])
    assert torch.equal(layer.keys[:, :, 3:], torch.cat(step[:3], 2))
    assert saved["keys"].shape[-2] == 4 and torch.equal(saved["keys"][:, :, 3:], step[0])
    layer.__dict__.clear()
    layer.__dict__.update(saved)  # restore, then a different continuation
    layer.update(step[3], step[3])
    assert torch.equal(layer.keys[:, :, 3:], torch.cat([step[0], step[3]], 2))
    assert layer.get_seq_length() == 12 and layer.keys.shape[-2] == 5


@pytest.mark.parametrize("budget", ["uniform", "global"])
def test_snapshot_restore(budget):
    """Appends write into spare room in place (the global budget's into its tail), never into what a snapshot shows."""
    target = tiny_model("llama", num_hidden_layers=4)
    cache = ProxyKVCache(SnapKVScorer(window=4), keep_ratio=0.5, budget=budget)
    first = target.generate(**random_prompt(1, 20), **with_cache(cache), max_new_tokens=3, pad_token_id=0)
    state = cache.snapshot()
    held = lambda: [torch.cat([l.keys.flatten(), l.tail_keys.flatten()]) if l.ragged else l.keys.clone()  # noqa: E731
                    for l in cache.layers]
    before = held(), cache.get_seq_length()
    ids = torch.cat([first, torch.full((1, 8), 5)], 1)
    target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **with_cache(cache), max_new_tokens=3,
                    pad_token_id=0)
    assert cache.get_seq_length() > before[1]
    cache.restore(state)
    assert cache.get_seq_length() == before[1]
    assert all(torch.equal(a, b) for a, b in zip(before[0], held()))
    assert torch.equal(cache.conversation.ids(), first[:, :-1])  # the conversation is back as well
