"""ProxyKVPipeline and the "proxykv-generation" transformers pipeline on a tiny model: the same text as
"text-generation" at keep_ratio 1, questions answered from one compressed context, and left-padded batches."""

import pytest
import torch
from transformers import pipeline

import proxykv_hf  # noqa: F401  (registers the pipeline task)
from proxykv_hf import ProxyKVPipeline, SnapKVScorer
from proxykv_hf.eval.prompts import encode_chat_prompt
from proxykv_hf.mapper.hub import save_checkpoint
from proxykv_hf.testing import tiny_checkpoint, tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", num_hidden_layers=4)


def test_pipeline_task_matches_text_generation_at_full_budget(tmp_path, target):
    path = save_checkpoint(tiny_checkpoint("layers"), tmp_path / "ckpt")
    tok = tiny_tokenizer()
    pk = pipeline("proxykv-generation", model=target, tokenizer=tok, proxykv=str(path), keep_ratio=1.0)
    tg = pipeline("text-generation", model=target, tokenizer=tok)
    chat = [{"role": "user", "content": "The secret is 42. Keep it. What is the secret?"}]
    kw = dict(max_new_tokens=6, do_sample=False)
    assert pk(chat, **kw) == tg(chat, **kw)
    texts = ["a short one", "a much longer prompt with more words in it"]
    assert pk(texts, batch_size=2, return_full_text=False, **kw) == tg(texts, batch_size=2, return_full_text=False,
                                                                        **kw)
    # compressed: runs, and each call gets its own cache
    pk3 = pipeline("proxykv-generation", model=target, tokenizer=tok, proxykv=str(path), keep_ratio=0.3)
    first = pk3(texts, batch_size=2, **kw)
    assert first == pk3(texts, batch_size=2, **kw)


def test_query_agnostic_reuse_equals_full_prompt_at_full_budget(target):
    tok = tiny_tokenizer()
    pipe = ProxyKVPipeline(target, tok, SnapKVScorer(window=4), keep_ratio=1.0)
    context = "The vault code is 9431. " * 4
    questions = ["What is the vault code?", "Say it again."]
    answers = pipe.ask(context, questions, max_new_tokens=6)
    for q, a in zip(questions, answers):
        ids = torch.tensor([sum(encode_chat_prompt(tok, context, q), [])])  # the whole prompt's tokens
        out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                              do_sample=False, pad_token_id=0)
        assert a == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    # compressed context: several questions from one cache, which is restored after each
    pipe = ProxyKVPipeline(target, tok, SnapKVScorer(window=4), keep_ratio=0.3)
    assert pipe.ask(context, questions, max_new_tokens=6) == [pipe.ask(context, q, max_new_tokens=6)
                                                              for q in questions]


def test_pipeline_batches_with_left_padding_and_leaves_the_tokenizer_alone(target):
    """A batch of prompts of different lengths is left-padded by the pipeline itself: each answer equals that prompt
    answered alone, and the caller's tokenizer keeps its padding side and pad token."""
    tok = tiny_tokenizer()
    tok.padding_side, before = "right", tok.pad_token_id
    pipe = ProxyKVPipeline(target, tok, SnapKVScorer(window=4), keep_ratio=0.5)
    prompts = ["The vault code is 9431. " * 4, "A short one."]
    both = pipe(prompts, max_new_tokens=4)
    assert both == [pipe(p, max_new_tokens=4) for p in prompts]
    assert tok.padding_side == "right" and tok.pad_token_id == before


def test_a_keep_ratio_without_a_scorer_is_refused_by_both_pipelines(target):
    """``keep_ratio=0.3`` with the mapper forgotten would keep every token while saying 0.3."""
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match="keep_ratio=0.3 needs a scorer.*proxykv="):
        ProxyKVPipeline(target, tok, keep_ratio=0.3)
    with pytest.raises(ValueError, match="keep_ratio=0.3 needs a scorer"):
        pipeline("proxykv-generation", model=target, tokenizer=tok, keep_ratio=0.3)
    assert ProxyKVPipeline(target, tok).new_cache().keep_ratio == 1.0  # no scorer, no ratio: the full cache
