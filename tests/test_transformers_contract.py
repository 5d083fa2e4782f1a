"""What the cache relies on from transformers, checked on the installed release (CI runs the oldest and the newest
supported): each test fails if a release changes one of these behaviours (proxykv_hf/compat.py lists them)."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from transformers import DynamicCache

from proxykv_hf import ProxyKVCache, ProxyKVPipeline, SnapKVScorer
from proxykv_hf.attention.compat import CACHE_KWARG, SUPPORTED, cache_of, check_version, with_cache
from proxykv_hf.cache.prompt import running_forward
from proxykv_hf.testing import random_prompt, tiny_model, tiny_tokenizer

GEN = dict(do_sample=False, pad_token_id=0, max_new_tokens=3)


class Recorder(DynamicCache):
    """A DynamicCache that records what generate tells it and in which order."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.events = []

    @property
    def _is_user_defined(self):
        return getattr(self, "_flag", False)

    @_is_user_defined.setter
    def _is_user_defined(self, value):
        self._flag = value
        _, call = running_forward(2)
        self.events.append(("user_defined", None if call is None else tuple(call.input_ids.shape),
                            self.get_seq_length()))

    def activate_past_recording(self, **kwargs):
        super().activate_past_recording(**kwargs)
        self.events.append(("recording", self.get_seq_length()))

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 0:
            forward, call = running_forward(2)
            self.events.append(("forward", key_states.shape[-2], None if forward is None else
                                tuple(forward.input_ids.shape), None if call is None else tuple(call.input_ids.shape)))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_generate_marks_a_given_cache_once_per_call_before_any_forward_with_its_prompt_ready(model):
    cache = Recorder()
    inputs = random_prompt(1, 30, seed=1)
    model.generate(**inputs, **with_cache(cache), num_return_sequences=2, do_sample=True, top_k=1, pad_token_id=0,
                   max_new_tokens=2)
    assert cache.events[0] == ("user_defined", (2, 30), 0)  # the expanded prompt, before the first forward
    assert cache.events[1] == ("forward", 30, (2, 30), (2, 30))  # the forward feeds it all, the call holds it
    assert cache.events[2][:3] == ("forward", 1, (2, 1))


def test_a_continued_call_feeds_only_what_the_cache_does_not_hold(model):
    cache = Recorder()
    out = model.generate(**random_prompt(1, 30, seed=1), **with_cache(cache), **GEN)
    more = torch.cat([out, torch.full((1, 4), 7)], 1)
    cache.events.clear()
    model.generate(input_ids=more, attention_mask=torch.ones_like(more), **with_cache(cache), **GEN)
    assert cache.events[0] == ("user_defined", (1, 37), 32)
    assert cache.events[1] == ("forward", 5, (1, 5), (1, 37))  # 37 - 32 held


def test_assisted_decoding_announces_itself_and_verifies_prompt_and_candidates_together(model):
    cache = Recorder()
    model.generate(**random_prompt(1, 30, seed=1), **with_cache(cache), assistant_model=tiny_model("llama"), **GEN)
    kinds = [e[0] for e in cache.events]
    assert kinds[:3] == ["user_defined", "recording", "forward"]
    assert cache.events[2][1] > 30  # the first verification forward holds the prompt and the candidates


def test_the_cache_passes_the_past_recording_keywords_on(monkeypatch):
    """transformers 5.25 calls ``activate_past_recording(recurrent_states_to_keep=n)``; the cache must take the
    keywords (it raised ``TypeError``, which broke assisted decoding) and hand them to ``DynamicCache``."""
    seen = []
    monkeypatch.setattr(DynamicCache, "activate_past_recording", lambda self, **kwargs: seen.append(kwargs),
                        raising=False)
    ProxyKVCache(SnapKVScorer(), 0.5).activate_past_recording(recurrent_states_to_keep=3)
    assert seen == [{"recurrent_states_to_keep": 3}]


def test_chunked_prefill_keeps_the_whole_prompt_in_the_call(model):
    cache = Recorder()
    model.generate(**random_prompt(1, 30, seed=1), **with_cache(cache), prefill_chunk_size=12, **GEN)
    forwards = [e for e in cache.events if e[0] == "forward"]
    assert [f[1] for f in forwards[:3]] == [12, 12, 6] and all(f[3] == (1, 30) for f in forwards[:3])


def test_the_cache_keyword_is_the_installed_releases_own(model):
    """``CACHE_KWARG`` reaches the model without a deprecation warning; the other name is deprecated or the same."""
    inputs = random_prompt(1, 20, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(**inputs, **with_cache(DynamicCache()), use_cache=True)
        model.generate(**inputs, **with_cache(DynamicCache()), **GEN)
    assert not [w for w in caught if "past_key_values" in str(w.message) or "cache" in str(w.message).lower()]
    assert isinstance(out.past_key_values if CACHE_KWARG == "past_key_values" else out.cache, DynamicCache)
    assert cache_of({CACHE_KWARG: 1}) == 1


@pytest.mark.slow  # a new Python process imports torch and transformers
def test_a_release_outside_the_range_is_refused_with_the_range():
    check_version()  # the installed one is supported
    for version in ("4.57.1", "6.0.0", "6.1.0.dev0"):
        with pytest.raises(ImportError, match=rf"supports transformers {SUPPORTED}.*{version}"):
            check_version(version)
    code = "import transformers; transformers.__version__ = '4.57.1'; import proxykv_hf"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode != 0 and f"supports transformers {SUPPORTED}" in done.stderr.splitlines()[-1]


def _deprecations(caught) -> list[str]:
    return [str(w.message) for w in caught if "past_key_values" in str(w.message) and "deprecat" in str(w.message)]


def test_our_own_calls_raise_no_past_key_values_deprecation(model, tmp_path):
    """The pipeline, the CLI, the evaluation and the benchmark pass the cache the way the installed release prefers
    (the examples: tests/test_examples.py reads their stderr)."""
    from proxykv_hf.cli import main

    tok = tiny_tokenizer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = ProxyKVPipeline(model, tok, SnapKVScorer(window=8), keep_ratio=0.5)
        pipe.ask("The code is 4417. " * 10, ["What is the code?"], max_new_tokens=2)
        pipe("Hello there, a plain prompt.", max_new_tokens=2)
        model.generate(**random_prompt(1, 40, seed=1), **with_cache(ProxyKVCache(SnapKVScorer(window=8))),
                       assistant_model=tiny_model("llama"), **GEN)
        main(["generate", "--tiny", "--method", "snapkv", "--prompt", "hello world " * 20, "--max-new-tokens", "2"])
        main(["eval", "--tiny", "--methods", "full", "snapkv", "kvzip", "--keep-ratios", "0.5", "--tasks",
              "niah_single_1", "--context-lengths", "200", "--n-samples", "1", "--max-new-tokens", "2", "--out",
              str(tmp_path / "eval"), "--kvzip-chunk", "64"])
        main(["eval", "--tiny", "--methods", "full", "snapkv", "--keep-ratios", "0.5", "--tasks", "niah_single_1",
              "--context-lengths", "200", "--n-samples", "1", "--max-new-tokens", "2", "--out",
              str(tmp_path / "eval-generate"), "--protocol", "generate"])
        main(["bench", "--tiny", "--methods", "full", "snapkv", "--context-lengths", "64", "--repeats", "1",
              "--warmup", "0", "--decode-tokens", "2"])
    assert _deprecations(caught) == []
