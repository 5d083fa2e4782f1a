"""The test split's ``letter`` family: held out (no train or dev task or corpus shares its sentences, templates or
names), deterministic, fitted to the target length, and its one asked fact unambiguous. Samples are generated and
measured only; no method runs on them."""

import inspect
import re

import pytest

from proxykv_hf.eval import _text, corpora, letters, realtext, splits, tasks
from proxykv_hf.eval.metrics import score_sample
from proxykv_hf.eval.tasks import family_of, generate, task_fn
from proxykv_hf.testing import tiny_tokenizer

TOK = tiny_tokenizer()  # one token per byte
TASK = "letter:everyday-test"


def _sentences(name: str) -> set[str]:
    return {u for doc in corpora.units(name) for u in doc}


def _template_pieces() -> set[str]:
    """The fixed wording of every statement, question, instruction, greeting and closing of the family."""
    texts = [t for topics in letters._TOPICS.values() for topic in topics for t in topic.statements + topic.questions]
    texts += [t for frame in letters._FRAMES for t in frame] + [t for t in letters._LEADS if t]
    return {piece.strip(" .,:;?") for t in texts for piece in re.split(r"\{\w+\}|\n", t) if len(piece.strip()) >= 12}


def test_the_family_is_test_only():
    families = {name: set(splits.get_split(name).families) for name in ("train", "dev", "test")}
    assert "letter" in families["test"] and not {"letter"} & (families["train"] | families["dev"])
    assert [t for t in splits.get_split("test").tasks if family_of(t) == "letter"] == [TASK]
    assert corpora.CORPORA["everyday-test"].split == "test"
    assert all(splits.split_of_task(t) != "test" for s in ("train", "dev") for t in splits.get_split(s).tasks)
    for corpus in ("filler-dev", "filler-dev2", "filler-train", "readmes"):
        with pytest.raises(ValueError, match="held out for the test split"):
            task_fn(f"letter:{corpus}")
    with pytest.raises(ValueError, match="only train corpora"):
        splits.check_training_tasks([TASK], seed=0)


def test_no_train_or_dev_text_shares_its_sentences_templates_or_names():
    mine = _sentences("everyday-test")
    assert len(mine) >= 60
    others = set().union(*(_sentences(name) for name, c in corpora.CORPORA.items()
                           if c.split != "test" and name in ("filler-train", "repeats-train", "filler-dev",
                                                             "repeats-dev", "filler-dev2")))
    assert not mine & others
    assert not any(re.search(r"\d", s) for s in mine), "no digits: a numeric answer occurs only where it is stated"
    # the wording of the facts, questions and frames is new: none of it is in the other generators' templates
    sources = inspect.getsource(realtext) + inspect.getsource(_text) + inspect.getsource(tasks) + " ".join(others)
    pieces = _template_pieces()
    assert len(pieces) >= 30
    assert not {p for p in pieces if p.lower() in sources.lower()}
    assert not set(letters._PEOPLE) & set(_text._FIRST_NAMES)
    assert not {i for i, _, _ in letters._FRAMES} & set(realtext._INSTRUCTIONS) - {""}
    names = set(letters._PEOPLE) | set(letters._VALUE_FIRST) | set(letters._VALUE_LAST)
    assert not {n for n in names if n.lower() in " ".join(mine).lower()}


def test_samples_are_deterministic_and_distinct():
    a = generate(TASK, 20, 2000, TOK, seed=11)
    assert [s.to_dict() for s in a] == [s.to_dict() for s in generate(TASK, 20, 2000, TOK, seed=11)]
    assert [s.context for s in a] != [s.context for s in generate(TASK, 20, 2000, TOK, seed=12)]
    assert len({s.context for s in a}) == 20 and len({s.meta["statement"] for s in a}) == 20
    picked = generate(TASK, 20, 2000, TOK, seed=11, indices=[7, 3])
    assert [s.to_dict() for s in picked] == [a[7].to_dict(), a[3].to_dict()]
    assert {s.meta["kind"] for s in a} == set(letters._TOPICS), "numbers, names, dates and phrases"
    assert {len(s.meta["distractors"]) for s in a} == {0, 1, 2}


@pytest.mark.parametrize("target", [2048, 4096])
def test_samples_fit_the_target_and_ask_one_unambiguous_fact(target):
    for s in generate(TASK, 20, target, TOK, seed=splits.get_split("test").seed):
        n = len(TOK.encode(s.context, add_special_tokens=False))
        assert s.meta["context_tokens"] == n and 0.95 * target <= n <= target, n
        stated, *spellings = s.answers
        low = s.context.lower()
        assert low.count(stated.lower()) == 1, (stated, s.context)
        assert s.meta["statement"] in s.context
        assert not any(a.lower() in low for a in spellings), "other spellings of a date are never in the text"
        assert not any(a.lower() in s.question.lower() for a in s.answers)
        name = s.meta["query"][0]
        assert name in s.question and name in s.meta["statement"] and low.count(name.lower()) == 1
        assert s.meta["statement"] not in s.question and s.question.rstrip("?") not in s.context
        for other in s.meta["distractors"]:
            assert other in s.context and other.lower() not in s.question.lower()
            assert all(a.lower() not in other.lower() and other.lower() not in a.lower() for a in s.answers)
            assert score_sample(s, other) == 0.0
        assert all(score_sample(s, f"It is {a}.") == 1.0 for a in s.answers)
        assert score_sample(s, "I do not know.") == 0.0


@pytest.mark.smollm
def test_twenty_samples_per_length_with_the_bundled_tokenizer(smollm_tokenizer):
    tok = smollm_tokenizer
    for target in (2048, 4096):
        samples = generate(TASK, 20, target, tok, seed=splits.get_split("test").seed)
        assert len({s.context for s in samples}) == 20
        for s in samples:
            n = len(tok.encode(s.context, add_special_tokens=False))
            assert 0.95 * target <= n <= target, (target, n)
            assert s.context.count(s.answers[0]) == 1
