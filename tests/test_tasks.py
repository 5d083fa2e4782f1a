"""RULER-style synthetic tasks: determinism, correctness of the generated data, length fitting, prompt splitting,
and the string-match metrics."""

import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxykv_hf.eval import prompts
from proxykv_hf.eval.metrics import score_sample, string_match_all, string_match_part
from proxykv_hf.eval.tasks import (TASK_FAMILIES, TASKS, Sample, build_prompt, encode_sample, family_of, generate,
                                   prompt_texts)
from proxykv_hf.testing import tiny_tokenizer

TOK = tiny_tokenizer()  # one token per byte
ALL = list(TASKS)


def test_registry_and_families():
    assert set(ALL) == {"niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                        "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa"}
    grouped = [t for names in TASK_FAMILIES.values() for t in names]
    assert sorted(grouped) == sorted(ALL), "every task in exactly one family"
    assert family_of("niah_multikey_3") == "multikey" and family_of("qa") == "qa"


@pytest.mark.parametrize("task", ALL)
def test_deterministic_per_seed(task):
    a = generate(task, 3, 1500, TOK, seed=7)
    b = generate(task, 3, 1500, TOK, seed=7)
    assert [s.to_dict() for s in a] == [s.to_dict() for s in b]
    c = generate(task, 3, 1500, TOK, seed=8)
    assert [s.context for s in a] != [s.context for s in c]
    assert len({s.context for s in a}) == 3, "different sample index -> different sample"
    if task not in ("cwe", "fwe"):  # these have no needle depth
        assert len({s.meta["depth"] for s in a}) == 3
    assert len({tuple(s.answers) for s in a}) == 3
    picked = generate(task, 3, 1500, TOK, seed=7, indices=[2, 0])
    assert [s.to_dict() for s in picked] == [a[2].to_dict(), a[0].to_dict()], "sample i alone is sample i of all"


@pytest.mark.parametrize("task", ALL)
def test_answers_and_query_are_in_the_context(task):
    for s in generate(task, 3, 2000, TOK, seed=1):
        assert s.task == task and s.metric == ("part" if task == "qa" else "all")
        for answer in s.answers:
            assert answer in s.context, (task, answer)
        for query in s.meta["query"]:
            assert query in s.context and query in s.question, (task, query)
        assert not set(s.answers) & set(s.meta["query"])
        assert s.meta["context_tokens"] == len(TOK.encode(s.context, add_special_tokens=False)) <= 2000
        assert score_sample(s, s.answer_prefix + " " + ", ".join(s.answers)) == 1.0
        assert score_sample(s, "I do not know.") == 0.0


def test_niah_needles_are_unambiguous():
    for task in ("niah_multikey_1", "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery"):
        for s in generate(task, 2, 3000, TOK, seed=2):
            for key in s.meta["query"]:
                found = re.findall(rf"for {re.escape(key)} is: ([\w-]+)\.", s.context)
                assert found and set(found) <= set(s.answers), (task, key, found)
            values = re.findall(r"is: ([\w-]+)\.", s.context)
            assert len(values) == len(set(values)), "distractor values are distinct"


def test_vt_chain_resolves_to_the_answers():
    for s in generate("vt", 3, 2000, TOK, seed=3):
        value = s.meta["query"][0]
        assigned = dict(re.findall(r"VAR (\w+) = ([\w ]+?)\.", s.context))
        resolved = {}
        for name, rhs in assigned.items():
            while rhs.startswith("VAR "):
                rhs = assigned[rhs[4:]]
            resolved[name] = rhs
        assert sorted(n for n, v in resolved.items() if v == value) == sorted(s.answers)


@pytest.mark.parametrize("target", [700, 3000, 5000])
def test_cwe_common_words_are_the_most_common(target):
    for s in generate("cwe", 2, target, TOK, seed=4):
        counts = Counter(re.findall(r"\d+\. (\w+)", s.context))
        top = counts.most_common()
        k = len(s.answers)
        assert {w for w, _ in top[:k]} == set(s.answers)
        assert top[k - 1][1] > top[k][1] if len(top) > k else True


def test_fwe_answers_are_the_most_frequent_coded_words():
    for target in (600, 2500):
        for s in generate("fwe", 2, target, TOK, seed=5):
            counts = Counter(w for w in s.context.split(". ", 1)[1].split() if w != "....")
            top = counts.most_common(4)
            assert {w for w, _ in top[:3]} == set(s.answers) and top[2][1] > top[3][1]


def test_qa_answer_is_in_the_entity_document():
    for s in generate("qa", 4, 2500, TOK, seed=6):
        docs = [d for d in re.split(r"Document \d+:\n", s.context)[1:] if s.meta["query"][0] in d]
        assert len(docs) == 1 and s.answers[0] in docs[0]


def test_depths_spread_and_needle_position_follows_depth():
    samples = generate("niah_single_2", 16, 2000, TOK, seed=0)
    depths = sorted(s.meta["depth"] for s in samples)
    assert max(b - a for a, b in zip([0.0] + depths, depths + [1.0])) < 0.2
    for s in samples:
        hay_start = s.context.index("\n") + 1
        pos = (s.context.index("One of the special magic") - hay_start) / (len(s.context) - hay_start)
        assert abs(pos - s.meta["depth"]) < 0.1


@pytest.mark.parametrize("target", [2000, 6000])
@pytest.mark.parametrize("task", ALL)
def test_length_within_tolerance_tiny(task, target):
    for s in generate(task, 2, target, TOK, seed=0):
        n = len(TOK.encode(s.context, add_special_tokens=False))
        assert 0.95 * target <= n <= target, (task, target, n)


@settings(max_examples=20, deadline=None)
@given(task=st.sampled_from(["niah_single_1", "niah_single_2", "niah_multikey_2", "qa", "cwe", "vt"]),
       target=st.integers(900, 4000), seed=st.integers(0, 2**16))
def test_length_never_exceeds_target(task, target, seed):
    (s,) = generate(task, 1, target, TOK, seed=seed)
    n = len(TOK.encode(s.context, add_special_tokens=False))
    assert 0.9 * target <= n <= target


def test_generate_errors():
    with pytest.raises(ValueError, match="unknown task"):
        generate("niah_single_9", 1, 1000, TOK)
    with pytest.raises(ValueError, match="at least"):
        generate("niah_single_1", 1, 50, TOK)
    with pytest.raises(ValueError, match="n_samples"):
        generate("vt", -1, 1000, TOK)
    with pytest.raises(ValueError, match="indices"):
        generate("vt", 2, 1000, TOK, indices=[0, 2])


def test_any_tokenizer_shape():
    words = lambda text: text.split()  # noqa: E731 - a bare callable returning "ids"
    (s,) = generate("niah_single_1", 1, 300, words, seed=0)
    assert 0.95 * 300 <= len(s.context.split()) <= 300

    class EncodeOnly:
        def encode(self, text):
            return list(text.encode())
    (s,) = generate("qa", 1, 1200, EncodeOnly(), seed=0)
    assert 0.95 * 1200 <= len(s.context.encode()) <= 1200


def test_sample_validation_and_roundtrip():
    with pytest.raises(ValueError, match="metric"):
        Sample("t", "c", "q", ["a"], "some")
    with pytest.raises(ValueError, match="answers"):
        Sample("t", "c", "q", [], "all")
    (s,) = generate("niah_multivalue", 1, 800, TOK)
    assert Sample.from_dict(s.to_dict()) == s


# ---------------------------------------------------------------------------------------------------------------
# prompts: context + question == full, token-exactly


@pytest.mark.parametrize("task", ALL)
def test_context_question_split_tiny(task):
    (s,) = generate(task, 1, 1200, TOK, seed=9)
    ctx, q = encode_sample(s, TOK)
    full = build_prompt(s, TOK, part="full")
    assert ctx + q == full == build_prompt(s, TOK, part="context") + build_prompt(s, TOK, part="question")
    assert TOK.decode(ctx).endswith(s.context) and s.question in TOK.decode(q)
    assert TOK.decode(q).endswith(s.answer_prefix)


def test_split_without_chat_template():
    tok = tiny_tokenizer()
    tok.chat_template = None
    (s,) = generate("qa", 1, 1000, tok)
    ctx_text, q_text = prompt_texts(s, tok)
    assert ctx_text == tok.bos_token + s.context and q_text.startswith("\n\n" + s.question)
    ctx, q = encode_sample(s, tok)
    assert ctx + q == tok.encode(ctx_text + q_text, add_special_tokens=False)


class _LineTokenizer:
    """Each line *with its newline* is one token, so a split just before a newline is not token-exact."""

    chat_template = "yes"

    def __init__(self):
        self.vocab = {}

    def apply_chat_template(self, messages, **kw):
        return TOK.apply_chat_template(messages, **kw)

    def encode(self, text, add_special_tokens=False):
        return [self.vocab.setdefault(p, len(self.vocab)) for p in re.findall(r"[^\n]*\n|[^\n]+", text)]


def test_split_moves_to_a_token_boundary():
    tok = _LineTokenizer()
    (s,) = generate("niah_single_1", 1, 500, TOK)
    ctx_text, q_text = prompt_texts(s, tok)
    assert ctx_text.endswith(s.context + "\n") and q_text.startswith("\n" + s.question)
    ctx, q = encode_sample(s, tok)
    assert ctx + q == tok.encode(ctx_text + q_text)


class _PrefixingTokenizer:
    """Like SentencePiece: every encoded string starts with a dummy-prefix token, so no string split is exact."""

    chat_template = "yes"

    def apply_chat_template(self, messages, **kw):
        return TOK.apply_chat_template(messages, **kw)

    def encode(self, text, add_special_tokens=False):
        return [999] + TOK.encode(text, add_special_tokens=False)

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        enc = TOK(text, add_special_tokens=False, return_offsets_mapping=True)
        return {"input_ids": [999] + enc["input_ids"], "offset_mapping": [(0, 0)] + enc["offset_mapping"]}


def test_split_falls_back_to_token_offsets():
    tok = _PrefixingTokenizer()
    (s,) = generate("vt", 1, 500, TOK)
    with pytest.raises(ValueError, match="encode_sample"):
        prompt_texts(s, tok)
    ctx, q = encode_sample(s, tok)
    assert ctx + q == tok.encode(prompts._full_text(s, tok)[0])
    assert TOK.decode(ctx[1:]).endswith(s.context) and TOK.decode(q).startswith("\n\n" + s.question)


@pytest.mark.smollm
def test_smollm_lengths_and_split(smollm_tokenizer):
    tok = smollm_tokenizer
    for task in ALL:
        (s,) = generate(task, 1, 2000, tok, seed=0)
        n = len(tok.encode(s.context, add_special_tokens=False))
        assert 0.95 * 2000 <= n <= 2000, (task, n)
        ctx, q = encode_sample(s, tok)
        text = "".join(prompt_texts(s, tok))
        assert ctx + q == tok.encode(text, add_special_tokens=False), task
        assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n" + s.answer_prefix)


# ---------------------------------------------------------------------------------------------------------------
# metrics


def test_string_match_all():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert string_match_all("only 123 here", ["123", "456"]) == 0.5
    assert string_match_all("PARIS!", ["paris"]) == 1.0
    assert string_match_all("\x00 nothing\x1f", ["x", "y", "z", "w"]) == 0.0
    with pytest.raises(ValueError, match="list"):
        string_match_all("abc", "abc")
    with pytest.raises(ValueError, match="empty"):
        string_match_all("abc", [])


def test_string_match_part_and_score_sample():
    assert string_match_part("it was Alice Marvo", ["alice marvo", "Marvo"]) == 1.0
    assert string_match_part("it was Bob", ["alice", "carol"]) == 0.0
    qa = Sample("qa", "ctx", "q?", ["1873", "eighteen seventy-three"], "part")
    assert score_sample(qa, " 1873.") == 1.0
    multi = Sample("niah_multivalue", "ctx", "q?", ["1", "2", "3", "4"], "all")
    assert score_sample(multi, "1, 3") == 0.5
