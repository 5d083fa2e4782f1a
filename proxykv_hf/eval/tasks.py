"""RULER-style synthetic long-context tasks, generated locally, seeded and tokenizer-agnostic.

The tasks follow RULER (Hsieh et al., 2024, arXiv:2404.06654): needle-in-a-haystack retrieval (single, multi-key,
multi-value, multi-query), variable tracking, common / frequent words extraction and question answering. Nothing is
downloaded: the essay-like haystack, the QA documents and the word lists are generated from the constants below.
Each :class:`Sample` keeps the context (instructions + haystack, query-agnostic, compressed alone by the harness)
apart from the question, so that one cache can be prefilled with the context and then continued with the question::

    samples = generate("niah_single_2", n_samples=8, target_tokens=4096, tokenizer=tok, seed=0)
    ctx_ids, q_ids = encode_sample(samples[0], tok)   # ctx_ids + q_ids == build_prompt(..., part="full")

``target_tokens`` counts the tokens of ``sample.context`` (no special tokens); the chat template and the question
add a few dozen more. Each context is the longest one that fits, within one haystack word (prose) or one haystack
item (needle lines, list entries) of the target.
"""

from __future__ import annotations

import functools
import logging
import math
import random
from collections.abc import Callable, Iterable
from typing import Any

from ._text import WORDS, _essay_unit, _noise_unit, _number, _pseudo_word, _unique, _uuid, _word_key, qa_document
from .haystack import Haystack, Sample, Stream, TaskFn, TaskRequest, fit_context
from .prompts import build_prompt, encode_sample, prompt_texts

__all__ = ["Sample", "TaskRequest", "TASKS", "TASK_FAMILIES", "generate", "family_of", "task_fn", "token_counter",
           "build_prompt", "encode_sample", "prompt_texts"]

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------------------------
# samples


def token_counter(tokenizer: Any) -> Callable[[str], int]:
    """``text -> token count`` (no special tokens) for a HF tokenizer or anything with ``encode``/``__call__``."""
    encode = getattr(tokenizer, "encode", None)
    if encode is not None:
        try:
            encode("a", add_special_tokens=False)
            return lambda text: len(encode(text, add_special_tokens=False))
        except TypeError:
            return lambda text: len(encode(text))
    if callable(tokenizer):
        def count(text: str) -> int:
            out = tokenizer(text)
            ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
            return len(ids)
        return count
    raise ValueError(f"tokenizer must have encode() or be callable, got {type(tokenizer).__name__}")


def generate(task: str, n_samples: int, target_tokens: int, tokenizer: Any, seed: int = 0, *,
             indices: Iterable[int] | None = None) -> list[Sample]:
    """Generate ``n_samples`` samples of ``task`` whose contexts hold about ``target_tokens`` tokens.

    Sample ``i`` depends only on ``(task, seed, i, target_tokens, tokenizer)``; its needles and questions depend
    only on ``(task, seed, i)``, so the same question is asked at every context length (except that ``cwe`` uses
    fewer common words at short targets).

    Args:
        task: a key of :data:`TASKS`.
        n_samples: number of samples.
        target_tokens: context length in tokens of ``tokenizer`` (the largest context that fits is built).
        tokenizer: a HF tokenizer, or anything with ``encode(text)``/``__call__(text)`` returning ids.
        seed: the random seed.
        indices: only the samples of these indices, in this order (each in ``range(n_samples)``); all by default.

    Raises:
        ValueError: an unknown task, a bad count or index, a target too short for the task's fixed parts, or a
            RULER benchmark task with a seed outside its range.
    """
    make = task_fn(task)
    if task.startswith("ruler_"):  # the RULER benchmark (proxykv_hf.eval.ruler): its own seed range only
        from .ruler.registry import check_seed

        check_seed(seed)
    if not isinstance(n_samples, int) or n_samples < 0:
        raise ValueError(f"n_samples must be an int >= 0, got {n_samples!r}")
    if not isinstance(target_tokens, int) or target_tokens < 1:
        raise ValueError(f"target_tokens must be an int >= 1, got {target_tokens!r}")
    indices = range(n_samples) if indices is None else list(indices)
    bad = [i for i in indices if not (isinstance(i, int) and 0 <= i < n_samples)]
    if bad:
        raise ValueError(f"indices must be ints in [0, {n_samples}), got {bad[:3]}")
    from tqdm.auto import tqdm

    count = token_counter(tokenizer)
    offset = random.Random(f"proxykv-depth:{task}:{seed}").random()
    samples = []
    big = len(indices) * target_tokens >= 200_000
    for index in tqdm(indices, desc=f"generating {task}", leave=False, disable=None if big else True):
        request = TaskRequest(rng=random.Random(f"proxykv-task:{task}:{seed}:{index}"), count_tokens=count,
                              target_tokens=target_tokens, depth=(offset + index * _GOLDEN) % 1.0)
        sample = make(request)
        sample.meta.update(task_family=family_of(task), seed=seed, index=index, target_tokens=target_tokens)
        samples.append(sample)
    return samples


_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0  # a low-discrepancy step: any run of indices covers [0, 1) evenly

# ----------------------------------------------------------------------------------------------------------------
# needle in a haystack (RULER niah_*)


def _niah(req: TaskRequest, *, task: str, haystack: str, key_kind: str, value_kind: str, num_keys: int = 1,
          num_values: int = 1, num_queries: int = 1) -> Sample:
    rng = req.rng
    kind = "numbers" if value_kind == "number" else "uuids"
    one = kind[:-1]
    keys_seen: set[str] = set()
    values_seen: set[str] = set()
    new_key = (lambda: _word_key(rng)) if key_kind == "word" else (lambda: _uuid(rng))
    new_value = (lambda: _number(rng)) if value_kind == "number" else (lambda: _uuid(rng))
    keys = [_unique(new_key, keys_seen) for _ in range(num_keys)]
    values = [[_unique(new_value, values_seen) for _ in range(num_values)] for _ in keys]
    queried = sorted(rng.sample(range(num_keys), num_queries))
    needle = "One of the special magic {kind} for {key} is: {value}.".format
    # the first queried needle sits at the evenly spread depth; the others anywhere
    texts = [needle(kind=kind, key=keys[q], value=values[q][0]) for q in queried[:1]]
    texts += [needle(kind=kind, key=k, value=v) for i, k in enumerate(keys) for j, v in enumerate(values[i])
              if (i, j) != (queried[0], 0)]
    depths = [req.depth] + [rng.random() for _ in texts[1:]]
    sep = "\n" if haystack == "needle" else " "
    needles = sorted(zip(depths, [t + sep for t in texts]), key=lambda p: p[0])

    if haystack == "noise":
        filler, splittable = Stream(_noise_unit, rng), False
    elif haystack == "essay":
        filler, splittable = Stream(_essay_unit, random.Random(rng.getrandbits(64))), True
    else:  # distractor needles with other keys
        def distractor(r: random.Random, i: int) -> str:
            key = _unique(lambda: _word_key(r) if key_kind == "word" else _uuid(r), keys_seen)
            value = _unique(lambda: _number(r) if value_kind == "number" else _uuid(r), values_seen)
            return needle(kind=kind, key=key, value=value) + "\n"
        filler, splittable = Stream(distractor, random.Random(rng.getrandbits(64))), False
    hay = Haystack(preamble=f"Some special magic {kind} are hidden within the following text. Make sure to "
                             f"memorize it. I will quiz you about the {kind} afterwards.\n",
                    filler=filler, needles=needles, splittable=splittable)
    context, tokens = fit_context(hay.render, hay.max_extra, req.count_tokens, req.target_tokens, task)

    query_keys = [keys[q] for q in queried]
    query = query_keys[0] if len(query_keys) == 1 else ", ".join(query_keys[:-1]) + ", and " + query_keys[-1]
    answers = [v for q in queried for v in values[q]]
    if len(answers) == 1:
        question = f"What is the special magic {one} for {query} mentioned in the provided text?"
        prefix = f"The special magic {one} for {query} mentioned in the provided text is"
    else:
        question = f"What are all the special magic {kind} for {query} mentioned in the provided text?"
        prefix = f"The special magic {kind} for {query} mentioned in the provided text are"
    return Sample(task=task, context=context, question=question, answers=answers, metric="all",
                  meta={"depth": req.depth, "depths": sorted(depths), "query": query_keys, "context_tokens": tokens,
                        "haystack": haystack}, answer_prefix=prefix)


def _niah_task(task: str, haystack: str, key_kind: str = "word", value_kind: str = "number",
               **counts: int) -> tuple[str, TaskFn]:
    return task, functools.partial(_niah, task=task, haystack=haystack, key_kind=key_kind, value_kind=value_kind,
                                   **counts)


# ----------------------------------------------------------------------------------------------------------------
# variable tracking, common / frequent words extraction, QA


def variable_tracking(req: TaskRequest, *, num_hops: int = 4) -> Sample:
    """RULER ``vt``: one chain ``VAR A = 12345``, ``VAR B = VAR A``, ... hidden in the noise haystack."""
    rng = req.rng
    seen: set[str] = set()
    names = [_unique(lambda: "".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=5)), seen)
             for _ in range(num_hops + 1)]
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}. "] + [f"VAR {names[j + 1]} = VAR {names[j]}. " for j in range(num_hops)]
    depths = sorted([req.depth] + [rng.random() for _ in range(num_hops)])
    hay = Haystack(preamble="Memorize and track the chain(s) of variable assignment hidden in the following "
                             "text.\n\n", filler=Stream(_noise_unit, rng), needles=list(zip(depths, chain)))
    context, tokens = fit_context(hay.render, hay.max_extra, req.count_tokens, req.target_tokens, "vt")
    return Sample(task="vt", context=context,
                  question=f"Find all variables that are assigned the value {value} in the text above.",
                  answers=names, metric="all",
                  meta={"depth": req.depth, "depths": depths, "query": [value], "context_tokens": tokens},
                  answer_prefix=f"According to the chain(s) of variable assignment in the text above, {len(names)} "
                                f"variables are assigned the value {value}, they are:")


def common_words_extraction(req: TaskRequest) -> Sample:
    """RULER ``cwe``: a numbered word list where ``num_cw`` words repeat ``freq_cw`` times, the rest ``freq_ucw``.

    RULER's settings (10 words x 30 vs 3 repeats) from 4096 tokens, its short-context ones (10 x 6 vs 1) below, and
    5 words x 3 vs 1 when even those do not fit.
    """
    rng, target = req.rng, req.target_tokens
    pool = list(WORDS)
    rng.shuffle(pool)
    rest = pool[10:]  # the common words are drawn from pool[:10]
    seen = set(WORDS)

    def uncommon(r: random.Random, i: int) -> str:
        return rest[i] if i < len(rest) else _unique(lambda: _pseudo_word(r), seen)

    words = Stream(uncommon, random.Random(rng.getrandbits(64)))
    shuffle_seed = rng.getrandbits(64)
    preamble = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize "
                "the ones that appear most often.\n")

    def renderer(common: list[str], freq_cw: int, freq_ucw: int) -> Callable[[int, int], str]:
        def render(n: int, extra: int = 0) -> str:
            items = common * freq_cw + [words[i] for i in range(n)] * freq_ucw
            random.Random(f"{shuffle_seed}:{n}").shuffle(items)
            return preamble + " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        return render

    settings = ([(30, 3, 10)] if target >= 4096 else []) + [(6, 1, 10), (3, 1, 5)]
    for freq_cw, freq_ucw, num_cw in settings:  # the first that fits (_fit raises if even the last does not)
        common = pool[:num_cw]
        render = renderer(common, freq_cw, freq_ucw)
        if req.count_tokens(render(0)) <= target:
            break
    context, tokens = fit_context(render, lambda n: 0, req.count_tokens, target, "cwe")
    return Sample(task="cwe", context=context,
                  question=f"What are the {num_cw} most common words in the above list?", answers=common,
                  metric="all", meta={"depth": None, "query": [], "context_tokens": tokens, "freq_cw": freq_cw,
                                      "freq_ucw": freq_ucw},
                  answer_prefix=f"The top {num_cw} words that appear most often in the list are:")


def frequent_words_extraction(req: TaskRequest, *, alpha: float = 2.0, vocab_size: int = 2000) -> Sample:
    """RULER ``fwe``: coded words with Zipf(``alpha``) counts; the answers are the 2nd-4th most frequent.

    The most frequent "word" is the noise ``....``. From 80 words on, the 2nd-4th counts are strictly above the rest.
    """
    rng = req.rng
    seen: set[str] = set()
    vocab = ["...."] + [_unique(lambda: "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=6)), seen)
                        for _ in range(vocab_size - 1)]
    zeta = _zeta(alpha)
    shuffle_seed = rng.getrandbits(64)
    min_words = 80
    preamble = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. ")

    def render(n: int, extra: int = 0) -> str:
        total = min_words + n
        items = [w for k, w in enumerate(vocab, 1) for _ in range(int(total * k ** -alpha / zeta))]
        random.Random(f"{shuffle_seed}:{n}").shuffle(items)
        return preamble + " ".join(items)

    context, tokens = fit_context(render, lambda n: 0, req.count_tokens, req.target_tokens, "fwe")
    return Sample(task="fwe", context=context,
                  question="Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                           "frequently appeared words in the above coded text?",
                  answers=vocab[1:4], metric="all", meta={"depth": None, "query": [], "context_tokens": tokens},
                  answer_prefix="According to the coded text above, the three most frequently appeared words are:")


@functools.lru_cache(maxsize=8)
def _zeta(alpha: float) -> float:
    """Riemann zeta(alpha) for alpha > 1 (partial sum plus the integral tail)."""
    if alpha <= 1:
        raise ValueError(f"alpha must be > 1, got {alpha}")
    n = 100_000
    return sum(k ** -alpha for k in range(1, n)) + n ** (1 - alpha) / (alpha - 1)


def question_answering(req: TaskRequest) -> Sample:
    """RULER-style ``qa`` on generated documents: one gold document among distractors about other entities."""
    rng = req.rng
    seen: set[str] = set()
    gold, qas = qa_document(rng, seen)
    question, answer, entity = rng.choice(qas)
    instruction = "Answer the question based on the given documents. Only give me the answer and do not output " \
                  "any other words."
    docs = Stream(lambda r, i: qa_document(r, seen)[0], random.Random(rng.getrandbits(64)))
    hay = Haystack(preamble=f"{instruction}\n\nThe following are given documents.\n\n", filler=docs,
                    needles=[(req.depth, gold)], splittable=True,
                    wrap=lambda k, text: f"Document {k}:\n{text.strip()}\n\n")
    context, tokens = fit_context(hay.render, hay.max_extra, req.count_tokens, req.target_tokens, "qa")
    return Sample(task="qa", context=context, question=f"{instruction}\n\nQuestion: {question}", answers=[answer],
                  metric="part", meta={"depth": req.depth, "query": [entity], "context_tokens": tokens},
                  answer_prefix="Answer:")


# ----------------------------------------------------------------------------------------------------------------
# registry

TASKS: dict[str, TaskFn] = dict([
    _niah_task("niah_single_1", "noise"),
    _niah_task("niah_single_2", "essay"),
    _niah_task("niah_single_3", "essay", value_kind="uuid"),
    _niah_task("niah_multikey_1", "essay", num_keys=4),
    _niah_task("niah_multikey_2", "needle"),
    _niah_task("niah_multikey_3", "needle", key_kind="uuid", value_kind="uuid"),
    _niah_task("niah_multivalue", "essay", num_values=4),
    _niah_task("niah_multiquery", "essay", num_keys=4, num_queries=4),
    ("vt", variable_tracking),
    ("cwe", common_words_extraction),
    ("fwe", frequent_words_extraction),
    ("qa", question_answering),
])
"""Task name -> generator ``(TaskRequest) -> Sample``; RULER's names. Add an entry to register a new task."""

TASK_FAMILIES: dict[str, tuple[str, ...]] = {
    "niah": ("niah_single_1", "niah_single_2", "niah_single_3"),
    "multikey": ("niah_multikey_1", "niah_multikey_2", "niah_multikey_3"),
    "multivalue": ("niah_multivalue",),
    "multiquery": ("niah_multiquery",),
    "vt": ("vt",),
    "cwe": ("cwe",),
    "fwe": ("fwe",),
    "qa": ("qa",),
}
"""Family -> task names, for held-out splits (train on some families, evaluate on the others)."""


def task_fn(task: str) -> TaskFn:
    """The generator of ``task``: a key of :data:`TASKS`, a RULER benchmark task (``"ruler_vt"``,
    :mod:`proxykv_hf.eval.ruler`), or ``"family:corpus"`` for a task over real text (:mod:`proxykv_hf.eval.realtext`,
    :mod:`proxykv_hf.eval.letters`); ``ValueError`` for anything else (and for the ``letter`` family over a corpus
    outside the test split)."""
    if task in TASKS:
        return TASKS[task]
    if task.startswith("ruler_"):
        from .ruler import registry

        return registry.task_fn(task)
    family, _, corpus = task.partition(":")
    from . import corpora, letters, realtext

    families = realtext.FAMILIES + letters.FAMILIES
    if not corpus or family not in families or corpus not in corpora.CORPORA:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)} or 'family:corpus' with a family "
                         f"from {', '.join(families)} and a corpus from {', '.join(corpora.CORPORA)}")
    if family in letters.FAMILIES:
        letters.check_corpus(corpus)
        return functools.partial(letters.make_sample, corpus)
    return functools.partial(realtext.make_sample, family, corpus)


def family_of(task: str) -> str:
    """The family (a key of :data:`TASK_FAMILIES`) of ``task``; ``"needle"`` for ``"needle:manpages"``; a task
    outside every family is its own family."""
    if ":" in task:
        return task.partition(":")[0]
    for family, names in TASK_FAMILIES.items():
        if task in names:
            return family
    return task
