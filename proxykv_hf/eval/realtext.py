"""Tasks over real text: facts hidden in a corpus of :mod:`proxykv_hf.eval.corpora`, asked about afterwards.

A task name is ``"{family}:{corpus}"`` (``"needle:manpages"``, ``"vt:perl"``); :func:`proxykv_hf.eval.tasks.generate`
accepts these names beside RULER's. Each sample draws a window of consecutive units from a random document of the
corpus (continuing into the next documents as needed), hides its facts at evenly spread depths, and asks about them.
Formats vary from sample to sample so that no scorer can learn one template: the value's kind (numbers of 3-7
digits, codes, words, names), the sentence that states the fact, the key's wording, the question and the
instructions.

Families:

* ``needle``: one fact; ``multikey``: four to six facts of one kind, one asked; ``multivalue``: one key with three or
  four values, all asked; ``multiquery``: four to six facts, two asked.
* ``vt``: a chain of assignments ``A = 12345``, ``B = A``, ... (prose or code phrasing), all names asked.
* ``qa``: a short document about a fictional entity (and two about others) inside the text, one attribute asked.
* ``passkey``: a number stated and repeated as a pass key or code inside plain sentences, asked without a hint
  of where it was.

The ``letter`` family (a fact stated once in a letter or a diary, asked in other words) is in
:mod:`proxykv_hf.eval.letters`.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from . import corpora
from ._text import ADJECTIVES, NOUNS, _FIRST_NAMES, _pseudo_word, _unique, qa_document
from .haystack import Haystack, Sample, fit_context

FAMILIES = ("needle", "multikey", "multivalue", "multiquery", "vt", "qa", "passkey")

_INSTRUCTIONS = (
    "Read the following text carefully. You will be asked about it afterwards.",
    "Below is a document. Some details in it will matter later, so keep them in mind.",
    "Here is some text to read. Afterwards I will ask you a question about it.",
    "Please read this material; a question about its contents follows.",
    "",
)

# (what the value is called) -> value maker; the key is a phrase about something
_VALUE_KINDS: dict[str, tuple[tuple[str, ...], Callable[[random.Random], str]]] = {
    "number": (("number", "code", "access code", "PIN", "pass key", "reference number"),
               lambda r: _digits(r, r.randint(3, 7))),
    "code": (("code", "password", "token", "serial", "ticket code"),
             lambda r: _code(r)),
    "word": (("password", "keyword", "code word", "secret word"), lambda r: r.choice(NOUNS)),
    "name": (("contact", "owner", "supervisor"), lambda r: f"{r.choice(_FIRST_NAMES)} {_pseudo_word(r).capitalize()}"),
}

# (statement, question); {what} the value's name, {key} the key phrase, {value}
_FACTS = (
    ("The secret {what} for {key} is {value}.", "What is the secret {what} for {key}?"),
    ("Remember this: {key} has the {what} {value}.", "Which {what} does {key} have?"),
    ("Note: the {what} of {key} = {value}", "What is the {what} of {key}?"),
    ("For the record, the {what} assigned to {key} was {value}.", "What {what} was assigned to {key}?"),
    ("({key}: {what} {value})", "What {what} is listed for {key}?"),
    ("Important: use {value} as the {what} for {key}.", "Which {what} should be used for {key}?"),
    ("The {what} you need for {key} is {value}, do not forget it.", "What {what} do you need for {key}?"),
    ("{Key} uses the {what} {value}.", "What {what} does {key} use?"),
)

_KEYS = (
    lambda r: f"the {r.choice(ADJECTIVES)} {r.choice(NOUNS)}",
    lambda r: f"the {r.choice(NOUNS)} room",
    lambda r: f"{r.choice(_FIRST_NAMES)}'s {r.choice(NOUNS)}",
    lambda r: f"project {_pseudo_word(r).capitalize()}",
    lambda r: f"the {r.choice(NOUNS)} account",
)


def _digits(rng: random.Random, n: int) -> str:
    return str(rng.randint(10 ** (n - 1), 10 ** n - 1))


def _code(rng: random.Random) -> str:
    letters = "ABCDEFGHJKLMNPQRSTUVWXYZ"
    style = rng.randrange(3)
    if style == 0:
        return "".join(rng.choices(letters, k=2)) + "-" + str(rng.randint(1000, 9999))
    if style == 1:
        return "".join(rng.choices("abcdefghjkmnpqrstuvwxyz23456789", k=rng.randint(6, 8)))
    return f"{rng.choice(letters)}{rng.randint(10, 99)}{rng.choice(letters)}{rng.randint(100, 999)}"


def _fact(rng: random.Random, n_keys: int, n_values: int = 1):
    """``(statements, question maker, keys, values)`` for ``n_keys`` keys of one value kind and template."""
    kind = rng.choice(tuple(_VALUE_KINDS))
    names, make_value = _VALUE_KINDS[kind]
    what = rng.choice(names)
    statement, question = rng.choice(_FACTS)
    make_key = rng.choice(_KEYS)
    seen_k: set[str] = set()
    seen_v: set[str] = set()
    keys = [_unique(lambda: make_key(rng), seen_k) for _ in range(n_keys)]
    values = [[_unique(lambda: make_value(rng), seen_v) for _ in range(n_values)] for _ in keys]
    texts = [[_fill(statement, what=what, key=k, value=v) for v in vs] for k, vs in zip(keys, values)]

    def ask(key: str) -> str:
        return _fill(question, what=what, key=key, value="")
    return texts, ask, keys, values, what


def _fill(template: str, *, what: str, key: str, value: str) -> str:
    text = template.format(what=what, key=key, Key=key[:1].upper() + key[1:], value=value)
    return text[:1].upper() + text[1:]


class _Units:
    """Consecutive units of a corpus from a random document on, endless (wrapping around the corpus)."""

    def __init__(self, corpus: str, rng: random.Random):
        self.docs = corpora.units(corpus)
        self.doc, self.pos = rng.randrange(len(self.docs)), 0
        if corpora.CORPORA[corpus].joiner == "\n\n":  # start at a random paragraph of the first document
            self.pos = rng.randrange(max(1, len(self.docs[self.doc]) // 2))
        self.joiner = corpora.CORPORA[corpus].joiner
        self.items: list[str] = []

    def __getitem__(self, i: int) -> str:
        while len(self.items) <= i:
            while self.pos >= len(self.docs[self.doc]):
                self.doc, self.pos = (self.doc + 1) % len(self.docs), 0
            self.items.append(self.docs[self.doc][self.pos] + self.joiner)
            self.pos += 1
        return self.items[i]


def make_sample(family: str, corpus: str, req) -> Sample:
    """One sample of ``family`` over ``corpus`` for a :class:`~proxykv_hf.eval.tasks.TaskRequest`."""

    if family not in FAMILIES:
        raise ValueError(f"unknown real-text family {family!r}; choose from {', '.join(FAMILIES)}")
    rng, task = req.rng, f"{family}:{corpus}"
    units = _Units(corpus, random.Random(rng.getrandbits(64)))
    sep = units.joiner
    instruction = rng.choice(_INSTRUCTIONS)
    prefix = ""
    metric = "all"
    meta: dict = {"depth": req.depth, "corpus": corpus}
    if family in ("needle", "multikey", "multiquery", "multivalue"):
        n_keys = {"needle": 1, "multivalue": 1}.get(family) or rng.randint(4, 6)
        n_values = rng.randint(3, 4) if family == "multivalue" else 1
        texts, ask, keys, values, what = _fact(rng, n_keys, n_values)
        n_ask = 2 if family == "multiquery" else 1
        asked = sorted(rng.sample(range(n_keys), n_ask))
        first = [texts[asked[0]][0]]
        rest = [t for i, ts in enumerate(texts) for j, t in enumerate(ts) if (i, j) != (asked[0], 0)]
        needles = [(req.depth, first[0])] + [(rng.random(), t) for t in rest]
        answers = [v for i in asked for v in values[i]]
        if family == "multivalue":
            question = f"List every {what} given for {keys[asked[0]]} in the text."
        elif n_ask > 1:
            question = " ".join(ask(keys[i]) for i in asked)
        else:
            question = ask(keys[asked[0]])
        meta["query"] = [keys[i] for i in asked]
    elif family == "vt":
        seen: set[str] = set()
        names = [_unique(lambda: "".join(rng.choices("ABCDEFGHJKLMNPQRSTUVWXYZ", k=rng.randint(4, 6))), seen)
                 for _ in range(rng.randint(3, 5))]
        value = str(rng.randint(10000, 99999))
        if rng.random() < 0.5:
            chain = [f"{names[0]} = {value}"] + [f"{b} = {a}" for a, b in zip(names, names[1:])]
        else:
            chain = [f"Let {names[0]} be {value}."] + [f"Set {b} equal to {a}." for a, b in zip(names, names[1:])]
        depths = sorted([req.depth] + [rng.random() for _ in chain[1:]])
        needles = list(zip(depths, chain))
        answers = names
        question = f"Which variables in the text end up holding the value {value}? Name all of them."
        meta["query"] = [value]
    elif family == "qa":

        seen = set()
        gold, qas = qa_document(rng, seen)
        question, answer, entity = rng.choice(qas)
        others = [qa_document(rng, seen)[0] for _ in range(2)]
        needles = [(req.depth, gold)] + [(rng.random(), o) for o in others]
        answers, metric = [answer], "part"
        question = f"Answer briefly from the text. {question}"
        meta["query"] = [entity]
    else:  # passkey
        value = str(rng.randint(1000, 99999))
        word = rng.choice(("pass key", "secret code", "access code", "code"))
        needles = [(req.depth, rng.choice((f"The {word} is {value}. Remember it. {value} is the {word}.",
                                            f"Here is the {word}: {value}. Keep it in mind.",
                                            f"Please remember that the {word} is {value}.")))]
        answers = [value]
        question = rng.choice((f"What is the {word}?", f"What was the {word} mentioned in the text?",
                               f"Tell me the {word}."))
        meta["query"] = [word]
    needles = sorted(((d, t + sep) for d, t in needles), key=lambda p: p[0])
    meta["depths"] = [d for d, _ in needles]
    hay = Haystack(preamble=(instruction + "\n\n") if instruction else "", filler=units, needles=needles,
                    splittable=False)
    context, tokens = fit_context(hay.render, hay.max_extra, req.count_tokens, req.target_tokens, task)
    meta["context_tokens"] = tokens
    return Sample(task=task, context=context, question=question, answers=answers, metric=metric, meta=meta,
                  answer_prefix=prefix)
