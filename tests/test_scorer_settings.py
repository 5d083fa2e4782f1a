"""Every built-in scorer's ``settings()``, pinned: saved contexts record them and a context store keys by them
(:mod:`proxykv_hf.contexts`, :mod:`proxykv_hf.contexts.store`), so their keys and values must not change (contexts saved
before must still load, store keys must stay the same). The expected dicts were written down from the scorers as
they were before they became dataclasses; a proxy model and a mapper appear by a digest of their weights, computed
here. Also: every public scorer is a dataclass whose fields are its options."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import proxykv_hf
from proxykv_hf import scorers
from proxykv_hf.models.fingerprints import weights_digest
from proxykv_hf.scorers import (AttentionStatisticScorer, KVzipIAMScorer, KVzipScorer, ProxyScorer, RandomScorer,
                                SnapKVScorer, StreamingLLMScorer)
from proxykv_hf.scorers.statistic import ProxyStatisticScorer
from proxykv_hf.attention.statistics import FusedStatistics
from proxykv_hf.testing import tiny_checkpoint, tiny_model, tiny_tokenizer

MODULE = "proxykv_hf.scorers."
PROXY = object()  # stands for {"name": "", "weights": <digest of the proxy model>}


@pytest.fixture(scope="module")
def proxy():
    return tiny_model("llama", num_hidden_layers=2, seed=1)


def _same(got: dict, want: dict, proxy) -> None:
    if any(v is PROXY for v in want.values()):
        want = {k: {"name": "", "weights": weights_digest([proxy])} if v is PROXY else v for k, v in want.items()}
    assert got == want
    assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)  # the store's digest reads this


CASES = {
    "snapkv": (lambda tok, p: SnapKVScorer(),
               {"class": MODULE + "snapkv.SnapKVScorer", "chunk_size": 256, "kernel_size": 5, "n_recent": 64,
                "window": 64}),
    "snapkv_options": (lambda tok, p: SnapKVScorer(window=16, kernel_size=7, chunk_size=32),
                       {"class": MODULE + "snapkv.SnapKVScorer", "chunk_size": 32, "kernel_size": 7, "n_recent": 16,
                        "window": 16}),
    "streaming": (lambda tok, p: StreamingLLMScorer(),
                  {"class": MODULE + "streaming.StreamingLLMScorer", "n_sink": 4}),
    "streaming_options": (lambda tok, p: StreamingLLMScorer(n_sink=0),
                          {"class": MODULE + "streaming.StreamingLLMScorer", "n_sink": 0}),
    "random": (lambda tok, p: RandomScorer(), {"class": MODULE + "random.RandomScorer", "seed": 0}),
    "random_options": (lambda tok, p: RandomScorer(7), {"class": MODULE + "random.RandomScorer", "seed": 7}),
    "kvzip": (lambda tok, p: KVzipScorer(),
              {"class": MODULE + "kvzip.KVzipScorer", "context_chunk": 2048, "dtype": None, "n_sink": 4,
               "prev_postfix_size": 8, "tokenizer": None, "use_chat_template": True}),
    "kvzip_tokenizer": (lambda tok, p: KVzipScorer(tok),
                        {"class": MODULE + "kvzip.KVzipScorer", "context_chunk": 2048, "dtype": None, "n_sink": 4,
                         "prev_postfix_size": 8, "use_chat_template": True}),
    "kvzip_options": (lambda tok, p: KVzipScorer(tok, context_chunk=16, prev_postfix_size=0, n_sink=2,
                                                 use_chat_template=False, dtype=torch.bfloat16),
                      {"class": MODULE + "kvzip.KVzipScorer", "context_chunk": 16, "dtype": "torch.bfloat16",
                       "n_sink": 2, "prev_postfix_size": 0, "use_chat_template": False}),
    "kvzip_iam": (lambda tok, p: KVzipIAMScorer(),
                  {"class": MODULE + "iam.KVzipIAMScorer", "context_chunk": 2048, "head_map": None, "layer_map": None,
                   "layers": None, "n_sink": 4, "proxy": None, "tokenizer": None}),
    "kvzip_iam_proxy": (lambda tok, p: KVzipIAMScorer(tok, proxy=p, context_chunk=32, n_sink=1),
                        {"class": MODULE + "iam.KVzipIAMScorer", "context_chunk": 32, "head_map": None,
                         "layer_map": None, "layers": None, "n_sink": 1, "proxy": PROXY}),
    "kvzip_iam_layers": (lambda tok, p: KVzipIAMScorer(tok, layers=[0, 2], context_chunk=32),
                         {"class": MODULE + "iam.KVzipIAMScorer", "context_chunk": 32, "head_map": None,
                          "layer_map": None, "layers": [0, 2], "n_sink": 4, "proxy": None}),
    "attn_max": (lambda tok, p: AttentionStatisticScorer(),
                 {"class": MODULE + "statistic.AttentionStatisticScorer", "chunk_size": 128, "group_reduce": "max",
                  "kernel_size": 1, "n_sink": 4, "statistic": "max", "statistics": ["max"]}),
    "attn_options": (lambda tok, p: AttentionStatisticScorer("lookback", group_reduce="mean", kernel_size=3,
                                                             n_sink=0, chunk_size=32),
                     {"class": MODULE + "statistic.AttentionStatisticScorer", "chunk_size": 32,
                      "group_reduce": "mean", "kernel_size": 3, "n_sink": 0, "statistic": "lookback",
                      "statistics": ["lookback"]}),
    "proxy_novelty": (lambda tok, p: ProxyStatisticScorer(p),
                      {"class": MODULE + "statistic.ProxyStatisticScorer", "chunk_size": 128, "group_reduce": "max",
                       "kernel_size": 1, "n_sink": 4, "proxy": PROXY, "statistic": "lookback"}),
    "proxy_options": (lambda tok, p: ProxyStatisticScorer(p, "sum", group_reduce="mean", kernel_size=5, n_sink=2,
                                                          chunk_size=16),
                      {"class": MODULE + "statistic.ProxyStatisticScorer", "chunk_size": 16, "group_reduce": "mean",
                       "kernel_size": 5, "n_sink": 2, "proxy": PROXY, "statistic": "sum"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_settings_are_those_saved_before(case, proxy):
    make, want = CASES[case]
    _same(make(tiny_tokenizer(), proxy).settings(), want, proxy)


def test_calibrated_alignment_is_a_setting():
    scorer = KVzipIAMScorer(tiny_tokenizer(), layers=[0, 2])
    scorer.layer_map, scorer.head_map = [0, 1], [[0, 1], [1, 0]]
    assert scorer.settings() == {"class": MODULE + "iam.KVzipIAMScorer", "context_chunk": 2048,
                                 "head_map": [[0, 1], [1, 0]], "layer_map": [0, 1], "layers": [0, 2], "n_sink": 4,
                                 "proxy": None}


@pytest.mark.parametrize("kind", ["self", "layers", "model"])
@pytest.mark.parametrize("options", [False, True])
def test_proxy_scorer_settings_are_those_saved_before(kind, options, proxy):
    ckpt = tiny_checkpoint(kind)
    extra = {"proxy_model": proxy} if kind == "model" else {}
    if options:
        extra.update(chunk_size=32, n_sink=2, mapper_autocast=False, overlap=True, proxy_device="cpu",
                     fused=FusedStatistics(), compile_mapper=False)
    want = {"class": MODULE + "proxy.ProxyScorer", "chunk_size": 32 if options else 128,
            "mapper_autocast": not options, "n_sink": 2 if options else 4, "needs_input_ids": kind != "self",
            "overlap": True if options else None, "proxy_model": PROXY if kind == "model" else None,
            "statistics": ["sum"] if kind == "self" else [],
            "checkpoint": {"proxy": ckpt.proxy.to_dict(), "target": ckpt.target.to_dict(),
                           "mapper": ckpt.mapper.config.to_dict(), "layer_mappers": None,
                           "weights": weights_digest(ckpt.mappers)}}
    if not options:
        want["proxy_device"] = None  # a device is left out of the settings; None is not
    _same(ProxyScorer(ckpt, **extra).settings(), want, proxy)


def test_proxy_checkpoint_description_is_the_one_saved_before():
    """The checkpoint part of the settings of ``tiny_checkpoint("layers")``, written down in full."""
    got = ProxyScorer(tiny_checkpoint("layers")).settings()["checkpoint"]
    got.pop("weights")
    assert got == {
        "layer_mappers": None,
        "mapper": {"crop_len": 64, "d_head": 8, "d_time": 32, "direct_context": 0, "direct_path": False,
                   "dropout": 0.0, "ffn_mult": 2, "input_transform": "log1p", "num_encoder_heads": 2,
                   "num_encoder_layers": 1, "num_proxy_heads": 4, "num_proxy_layers": 2, "num_statistics": 1,
                   "num_target_heads": 2, "num_target_layers": 4, "stem_hidden": 16, "stride": 32},
        "proxy": {"kind": "layers", "layers": [1, 3], "model_id": None, "num_heads": 4, "num_layers": 2,
                  "statistics": ["sum"]},
        "target": {"model_id": "tiny-llama", "model_type": "llama", "num_heads": 4, "num_kv_heads": 2,
                   "num_layers": 4}}


def test_settings_do_not_change_with_a_fresh_copy_or_a_prompt():
    from proxykv_hf.eval.methods import record_scores
    from proxykv_hf.testing import random_prompt

    model, tok = tiny_model("llama"), tiny_tokenizer()
    ids = random_prompt(1, 40, seed=1)["input_ids"]
    for scorer in (SnapKVScorer(window=8), KVzipScorer(tok, context_chunk=16), AttentionStatisticScorer("sum"),
                   KVzipIAMScorer(tok, context_chunk=16), RandomScorer(3)):
        before = scorer.settings()
        assert scorer.fresh().settings() == before
        record_scores(model, scorer, ids)
        assert scorer.settings() == before


def _public_scorers(module) -> list[type]:
    bases = {scorers.Scorer, scorers.LayerScorer, scorers.BackgroundScorer, scorers.ModelScorer}
    found = [getattr(module, name) for name in module.__all__]
    return [c for c in found if isinstance(c, type) and issubclass(c, scorers.Scorer) and c not in bases]


@pytest.mark.parametrize("module", [proxykv_hf, scorers])
def test_every_public_scorer_is_a_dataclass(module):
    found = _public_scorers(module)
    assert {c.__name__ for c in found} >= {"AttentionStatisticScorer", "KVzipIAMScorer", "KVzipScorer", "ProxyScorer",
                                           "RandomScorer", "SnapKVScorer", "StreamingLLMScorer"}
    for cls in found:
        assert dataclasses.is_dataclass(cls), cls.__name__


@pytest.mark.parametrize("kind", ["self", "layers", "model"])
def test_proxy_scorer_is_the_scorer_of_the_checkpoint_kind(tmp_path, kind, proxy):
    """A self proxy and a proxy run on its own are two classes; ``ProxyScorer(checkpoint)`` and
    ``ProxyScorer.from_pretrained`` pick the one of the checkpoint's kind, and each refuses the other kind."""
    from proxykv_hf.mapper.hub import save_checkpoint
    from proxykv_hf.scorers import SelfProxyScorer, SeparateProxyScorer

    ckpt = tiny_checkpoint(kind)
    extra = {"proxy_model": proxy} if kind == "model" else {}
    want, other = (SelfProxyScorer, SeparateProxyScorer) if kind == "self" else (SeparateProxyScorer, SelfProxyScorer)
    scorer = ProxyScorer(ckpt, **extra)
    assert type(scorer) is want and isinstance(scorer, ProxyScorer) and dataclasses.is_dataclass(scorer)
    assert type(scorer.fresh()) is want and scorer.fresh() == scorer
    assert type(want(ckpt, **extra)) is want
    loaded = ProxyScorer.from_pretrained(save_checkpoint(ckpt, tmp_path / "ckpt"), proxy=extra.get("proxy_model"))
    assert type(loaded) is want and loaded.settings()["class"] == MODULE + "proxy.ProxyScorer"
    with pytest.raises(ValueError, match=f"proxy kind is '{kind}'"):
        other(ckpt, **extra)
    if kind == "self":
        with pytest.raises(ValueError, match="runs no proxy model"):
            ProxyScorer(ckpt, proxy_model=proxy)


def test_registry_builds_each_scorer_dataclass_from_the_context():
    """``registry.build`` fills a scorer's fields from ``ScorerContext.fields`` (those it has) and the context's
    tokenizer and proxy; a preset (``attn_sum``'s statistic) wins; ProxyKV takes the proxy only where its mapper reads
    a separate model."""
    from proxykv_hf.scorers import ScorerContext, registry

    tok, proxy = tiny_tokenizer(), tiny_model("llama", num_hidden_layers=2, seed=1)
    ctx = ScorerContext(tokenizer=tok, proxy=proxy, fields={"context_chunk": 16, "seed": 3, "window": 8,
                                                            "statistic": "max"})
    assert registry.build("kvzip", ctx) == KVzipScorer(tok, context_chunk=16)
    assert registry.build("kvzip_iam", ctx) == KVzipIAMScorer(tok, proxy=proxy, context_chunk=16)
    assert registry.build("random", ctx) == RandomScorer(3)
    assert registry.build("snapkv", ctx) == SnapKVScorer(window=8)
    assert registry.build("attn_sum", ctx) == AttentionStatisticScorer("sum")
    assert registry.build("proxy_sum", ctx) == ProxyStatisticScorer(proxy, "sum")
    for kind in ("self", "layers", "model"):
        built = registry.build("proxykv", dataclasses.replace(ctx, mapper=tiny_checkpoint(kind)))
        assert built.proxy_model is (proxy if kind == "model" else None)
    with pytest.raises(ValueError, match=r"\['statistic'\] are not fields of SnapKVScorer"):
        registry.register("snap_sum", SnapKVScorer, statistic="sum")
    assert "snap_sum" not in registry.names()


@pytest.mark.parametrize("make,match", [
    (lambda: SnapKVScorer(window=0), "window must be an int >= 1, got 0"),
    (lambda: StreamingLLMScorer(n_sink=-1), "n_sink must be an int >= 0, got -1"),
    (lambda: RandomScorer("x"), "seed must be an int, got 'x'"),
    (lambda: KVzipIAMScorer(proxy="m"), "proxy must be a loaded model or None, got str"),
    (lambda: AttentionStatisticScorer("max", group_reduce="min"), "group_reduce must be one of"),
])
def test_bad_options_are_errors_that_quote_them(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("cls", [KVzipScorer, KVzipIAMScorer])
def test_chunk_size_is_the_deprecated_spelling_of_context_chunk(cls):
    """0.1.0's ``chunk_size=`` still sets ``context_chunk`` (with a FutureWarning naming the new name); it is not a
    setting of its own."""
    with pytest.warns(FutureWarning, match="use context_chunk="):
        scorer = cls(chunk_size=32)
    assert scorer.context_chunk == 32 and "chunk_size" not in scorer.settings()
    assert dataclasses.replace(scorer).context_chunk == 32
