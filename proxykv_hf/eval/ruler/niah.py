"""RULER's eight needle-in-a-haystack tasks (scripts/data/synthetic/niah.py of github.com/NVIDIA/RULER).

A needle is ``One of the special magic {numbers|uuids} for {key} is: {value}.``; keys are words (an adjective and
a noun joined by a hyphen) or UUIDs, values 7-digit numbers or UUIDs (:data:`~.templates.NIAH_TASKS` per variant).
The haystack is one of three:

* ``noise``: RULER's sentence ``The grass is green. ... There and back again.`` repeated, one per line, the
  needles as lines of their own at random places;
* ``essay``: the first words of Paul Graham's essays (:mod:`.essays`), cut into sentences, each needle between two
  sentences at a depth drawn from RULER's 40 (0%, 3%, ..., 100%), the pieces joined by spaces;
* ``needle``: lines of other needles (random keys and values of the same kinds), the real needle among them.

The template is RULER's, in the singular when one value is asked. Sizing: :func:`~.sizing.fit` over the haystack's
size (essay words, noise sentences, distractor lines).
"""

from __future__ import annotations

import random

from ..haystack import Sample, Stream, TaskRequest
from .._text import _number, _unique, _uuid, _word_key
from . import essays
from .sizing import Prompt, fit, make_sample, sentences
from .templates import DEPTHS, NEEDLE, NIAH, NOISE, NiahSettings, singular


def draw(kind: str, rng: random.Random) -> str:
    """One random key or value of ``kind``: ``"words"`` (``adjective-noun``), ``"numbers"`` (7 digits, as RULER's
    ``generate_random_number``) or ``"uuids"`` (a version-4 UUID from 128 random bits)."""
    if kind == "words":
        return _word_key(rng)
    if kind == "numbers":
        return _number(rng)
    if kind == "uuids":
        return _uuid(rng)
    raise ValueError(f"kind must be 'words', 'numbers' or 'uuids', got {kind!r}")


def niah_sample(req: TaskRequest, *, name: str, settings: NiahSettings) -> Sample:
    """One sample of the NIAH variant ``name`` (its ``settings``) for ``req`` (its random source, tokenizer counter
    and target length)."""
    rng, s = req.rng, settings
    num_k = max(s.num_k, s.num_q)  # RULER: args.num_needle_k = max(num_needle_k, num_needle_q)
    keys_seen: set[str] = set()
    values_seen: set[str] = set()
    keys = [_unique(lambda: draw(s.key, rng), keys_seen) for _ in range(num_k)]
    values = [[_unique(lambda: draw(s.value, rng), values_seen) for _ in range(s.num_v)] for _ in keys]
    needles = [NEEDLE.format(type_needle_v=s.value, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    asked = rng.sample(range(num_k), s.num_q)
    queries = [keys[i] for i in asked]
    answers = [v for i in asked for v in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    one = s.num_q * s.num_v == 1
    parts = [singular(p) if one else p for p in (NIAH.context, NIAH.question, NIAH.answer_prefix)]
    type_v = s.value[:-1] if one else s.value  # "number", "uuid" in the singular
    meta = {"haystack": s.haystack, "query": queries}

    if s.haystack == "essay":
        words = essays.haystack_words()  # ValueError with the install command when the essays are missing
        depths = rng.sample(DEPTHS, len(needles))
        meta["depths"] = sorted(depths)
        haystack, n_min = (lambda n: _essay(words, n, depths, needles)), 1
    else:
        place_seed = rng.getrandbits(64)
        if s.haystack == "noise":
            line = lambda i: NOISE  # noqa: E731
        elif s.haystack == "needle":
            distractors = Stream(lambda r, i: _distractor(r, s, keys_seen), random.Random(rng.getrandbits(64)))
            line = distractors.__getitem__
        else:
            raise ValueError(f"haystack must be 'noise', 'essay' or 'needle', got {s.haystack!r}")
        haystack, n_min = (lambda n: _lines(line, n, needles, random.Random(f"{place_seed}:{n}"))), len(needles)

    def render(n: int) -> Prompt:
        return Prompt(context=parts[0].format(type_needle_v=type_v, context=haystack(n)),
                      question=parts[1].format(type_needle_v=type_v, query=query),
                      answer_prefix=parts[2].format(type_needle_v=type_v, query=query))

    n, prompt, tokens = fit(render, req.count_tokens, req.target_tokens, NIAH.tokens_to_generate, n_min=n_min,
                            task=name)
    return make_sample(name, prompt, answers, tokens, NIAH.tokens_to_generate, haystack_units=n, **meta)


def _essay(words: tuple[str, ...], n: int, depths: list[int], needles: list[str]) -> str:
    """The first ``n`` words of the essays (repeated past their end), the needles between sentences at ``depths``."""
    picked = words[:n] if n <= len(words) else (words * -(-n // len(words)))[:n]
    sents = sentences(" ".join(picked).strip())
    cuts = [0] + sorted(int(len(sents) * (d / 100)) for d in depths) + [len(sents)]
    pieces = []
    for i in range(1, len(cuts)):
        pieces.append(" ".join(sents[cuts[i - 1]:cuts[i]]))
        if i - 1 < len(needles):
            pieces.append(needles[i - 1])
    return " ".join(pieces)


def _lines(line, n: int, needles: list[str], rng: random.Random) -> str:
    """``n`` haystack lines with the needles inserted before lines drawn at random, one per line."""
    lines = [line(i) for i in range(n)]
    for index, needle in zip(sorted(rng.sample(range(n), len(needles)), reverse=True), needles):
        lines.insert(index, needle)
    return "\n".join(lines)


def _distractor(rng: random.Random, s: NiahSettings, keys: set[str]) -> str:
    """A line of the ``needle`` haystack: a needle of another key (never one of the sample's keys)."""
    key = draw(s.key, rng)
    while key in keys:
        key = draw(s.key, rng)
    return NEEDLE.format(type_needle_v=s.value, key=key, value=draw(s.value, rng))
