"""The ``letter`` family, held out for the test split: one fact stated once in a letter or a diary of plain
sentences, and asked in other words than it was stated.

A sample is a letter (``Dear Ruben, ... With love, Astrid``) or diary pages written from a test corpus of everyday
sentences (``everyday-test``). Somewhere in it a fact about a person is stated once, as people write it: "My cousin
Mira's train leaves from platform 14." The question names the person without the relation and words the fact
differently ("Which platform does Mira's train depart from?"). Half of the samples or so hold one or two similar
facts about other people (other platforms, other dates); only one is asked. The value is a number (platforms,
flats, hotel rooms, bus lines, house numbers), a person's full name, a date or a short phrase (a colour and a
thing); the answer counts when the prediction contains it (dates: in any of three spellings).

No template, name list, instruction or sentence here is used by a train or dev task; :func:`make_sample` refuses a
corpus of another split, so the family can only be run on the test split's text.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from . import corpora
from .haystack import Haystack, Sample, fit_context
from .realtext import _Units

FAMILIES = ("letter",)

# people the facts are about (and the letters' writers and readers); none is in _text._FIRST_NAMES
_PEOPLE = tuple("""
Mira Tobias Ines Lars Odile Rafael Sunniva Henrik Priya Matteo Ingrid Cyrus Freya Dmitri Lucia Anselm Wanda Bastian
Yara Edgar Greta Milo Solveig Tariq Elif Ruben Astrid Kasimir Noemi Viggo Linnea Selma Idris Margit Florian Pavel
""".split())
_RELATIONS = ("my cousin", "our neighbour", "my friend", "my colleague", "my old classmate", "our lodger",
              "my penfriend", "my teammate")
# the values of the "name" kind: full names, so that a first name alone never matches
_VALUE_FIRST = ("Hilde", "Anton", "Beryl", "Eamon", "Fenna", "Gideon", "Hester", "Ivo", "Jorun", "Lorcan", "Maren",
                "Niall", "Orla", "Petra", "Rolf", "Sabine", "Torben", "Ursula", "Wilma", "Alvar")
_VALUE_LAST = ("Marwick", "Ashdown", "Pellow", "Thornbury", "Quayle", "Fenwick", "Oakley", "Brannigan", "Lindqvist",
               "Castell", "Dunmore", "Haverly", "Rookwood", "Sallis", "Kettering", "Gorse", "Abernethy", "Wyndham")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")
_COLOURS = ("red", "green", "yellow", "purple", "orange", "silver", "navy", "brown", "pink", "white", "grey",
            "turquoise")


@dataclass(frozen=True)
class _Topic:
    """One kind of fact: how it is stated (``{Who}`` / ``{who}``: relation and name, ``{value}``), how it is asked
    (``{name}``: the name alone) and its values (``rng -> (as written, its spellings)``, the written one first)."""

    statements: tuple[str, ...]
    questions: tuple[str, ...]
    value: Callable[[random.Random], tuple[str, tuple[str, ...]]]


def _number(lo: int, hi: int) -> Callable[[random.Random], tuple[str, tuple[str, ...]]]:
    def make(rng: random.Random) -> tuple[str, tuple[str, ...]]:
        value = str(rng.randint(lo, hi))
        return value, (value,)
    return make


def _full_name(rng: random.Random) -> tuple[str, tuple[str, ...]]:
    value = f"{rng.choice(_VALUE_FIRST)} {rng.choice(_VALUE_LAST)}"
    return value, (value,)


def _date(rng: random.Random) -> tuple[str, tuple[str, ...]]:
    """``"May 28"``, ``"28 May"`` or ``"the 28th of May"``; any of the three spellings counts."""
    month, day = rng.choice(_MONTHS), rng.randint(1, 28)
    suffix = "th" if 10 <= day <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
    spellings = [f"{month} {day}", f"{day} {month}", f"{day}{suffix} of {month}"]
    first = rng.randrange(3)
    written = ("the " if first == 2 else "") + spellings[first]
    return written, tuple([spellings[first]] + spellings[:first] + spellings[first + 1:])


def _thing(*things: str) -> Callable[[random.Random], tuple[str, tuple[str, ...]]]:
    def make(rng: random.Random) -> tuple[str, tuple[str, ...]]:
        value = f"{rng.choice(_COLOURS)} {rng.choice(things)}"
        return value, (value,)
    return make


_TOPICS: dict[str, tuple[_Topic, ...]] = {
    "number": (
        _Topic(("{Who}'s train leaves from platform {value}.", "The train {who} is catching goes from platform "
                "{value}."), ("Which platform does {name}'s train depart from?",
                              "From what platform will {name} board the train?"), _number(10, 29)),
        _Topic(("{Who} has moved into flat {value} in the new block by the park.",),
               ("What is the number of {name}'s new apartment?", "Which apartment does {name} live in now?"),
               _number(10, 99)),
        _Topic(("{Who} is staying in room {value} at the hotel by the harbour.",),
               ("What room number was {name} given at the hotel?", "In which hotel room can {name} be found?"),
               _number(101, 499)),
        _Topic(("{Who} takes the number {value} bus to the office.",),
               ("Which bus line does {name} ride to work?", "What bus gets {name} to work in the morning?"),
               _number(11, 99)),
        _Topic(("{Who} lives at number {value} on Mill Lane.",),
               ("What is {name}'s house number?", "At which number on that lane is {name}'s home?"),
               _number(10, 199)),
    ),
    "name": (
        _Topic(("{Who}'s new doctor is called {value}.", "{Who} has started seeing a doctor named {value}."),
               ("Who is the physician now treating {name}?", "What is the name of the doctor {name} goes to?"),
               _full_name),
        _Topic(("{Who} sold the old piano to a music teacher named {value}.",),
               ("To whom did {name} sell the piano?", "Who is the new owner of {name}'s piano?"), _full_name),
        _Topic(("{Who} is engaged to a carpenter called {value}.",),
               ("Whom is {name} going to marry?", "What is the name of {name}'s future spouse?"), _full_name),
        _Topic(("The landlord of {who}'s new flat is called {value}.",),
               ("Who rents the flat to {name}?", "Who owns the place where {name} lives now?"), _full_name),
        _Topic(("{Who} is taking driving lessons from {value}.",),
               ("Who is teaching {name} to drive?", "Who is {name}'s driving instructor?"), _full_name),
    ),
    "date": (
        _Topic(("{Who}'s wedding is on {value}.", "{Who} gets married on {value}."),
               ("On what date will {name} be married?", "When is the day of {name}'s wedding?"), _date),
        _Topic(("{Who} flies home on {value}.",),
               ("When does {name} travel back?", "On which day does {name} return home?"), _date),
        _Topic(("{Who} is throwing a garden party on {value}.",),
               ("When will {name}'s garden party take place?", "On what date is {name} hosting the party?"), _date),
        _Topic(("{Who} has the driving test on {value}.",),
               ("When is {name} taking the driving test?", "On what date does {name} sit the driving exam?"), _date),
    ),
    "phrase": (
        _Topic(("{Who} keeps a spare key under the {value} by the back door.",),
               ("Where is {name}'s spare key hidden?", "Under what does {name} hide the extra key?"),
               _thing("flowerpot", "watering can", "doormat", "stone frog", "boot scraper")),
        _Topic(("{Who} stores the family photographs in a {value} under the stairs.",),
               ("Where does {name} keep the family pictures?", "In what are {name}'s old photos kept?"),
               _thing("biscuit tin", "shoe box", "leather suitcase", "hat box", "tea chest")),
        _Topic(("{Who} will be wearing a {value} at the station, so look out for it.",),
               ("How will you recognise {name} at the station?", "What will {name} have on when arriving?"),
               _thing("raincoat", "straw hat", "woollen scarf", "duffel coat", "beret")),
        _Topic(("{Who} has bought a {value} and drives it everywhere.",),
               ("What vehicle did {name} buy recently?", "What does {name} drive around in now?"),
               _thing("estate car", "camper van", "scooter", "pickup truck")),
    ),
}

# (instruction, greeting, closing); {writer} and {reader} are names from _PEOPLE
_FRAMES = (
    ("Here is a letter. A question about it follows.", "Dear {reader},", "With love,\n{writer}"),
    ("Read this letter from {writer} to {reader}, then answer the question below it.", "Dear {reader},",
     "Warm wishes,\n{writer}"),
    ("", "Dear {reader},", "Write back soon,\n{writer}"),
    ("Below are some pages from {writer}'s diary. Read them, then answer the question.", "Dear diary,", ""),
    ("", "Dear diary,", ""),
)
_LEADS = ("", "A question about what you just read: ", "From the text above: ")


def _clash(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Whether a spelling of one value holds a spelling of the other (a prediction naming one would count as
    the other)."""
    return any(x.lower() in y.lower() or y.lower() in x.lower() for x in a for y in b)


def _values(make: Callable[[random.Random], tuple[str, tuple[str, ...]]], rng: random.Random,
            n: int) -> list[tuple[str, tuple[str, ...]]]:
    """``n`` values of one kind, none of whose spellings holds another's."""
    out: list[tuple[str, tuple[str, ...]]] = []
    for _ in range(1000):
        value = make(rng)
        if not any(_clash(value[1], v[1]) for v in out):
            out.append(value)
            if len(out) == n:
                return out
    raise RuntimeError(f"could not draw {n} values that do not hold one another")


def _fill(template: str, *, relation: str, name: str, value: str = "") -> str:
    who = f"{relation} {name}"
    text = template.format(Who=who[:1].upper() + who[1:], who=who, name=name, value=value)
    return text[:1].upper() + text[1:]


def check_corpus(corpus: str) -> None:
    """``ValueError`` unless ``corpus`` belongs to the test split (the family is held out for it)."""
    split = corpora.CORPORA[corpus].split
    if split != "test":
        raise ValueError(f"the letter family is held out for the test split; {corpus!r} is a {split!r} corpus "
                         f"(test corpora: {', '.join(n for n, c in corpora.CORPORA.items() if c.split == 'test')})")


def make_sample(corpus: str, req) -> Sample:
    """One ``letter:{corpus}`` sample for a :class:`~proxykv_hf.eval.tasks.TaskRequest`."""
    check_corpus(corpus)
    rng, task = req.rng, f"letter:{corpus}"
    units = _Units(corpus, random.Random(rng.getrandbits(64)))
    kind = rng.choice(tuple(_TOPICS))
    topic = rng.choice(_TOPICS[kind])
    n_facts = rng.choice((1, 1, 2, 3))
    writer, reader, *people = rng.sample(_PEOPLE, 2 + n_facts)
    relations = rng.sample(_RELATIONS, n_facts)
    values = _values(topic.value, rng, n_facts)
    statement = rng.choice(topic.statements)  # one wording for all the facts of a sample, as one writer writes
    facts = [_fill(statement, relation=r, name=p, value=w) for r, p, (w, _) in zip(relations, people, values)]
    question = rng.choice(_LEADS) + _fill(rng.choice(topic.questions), relation=relations[0], name=people[0])
    instruction, greeting, closing = (part.format(writer=writer, reader=reader) for part in rng.choice(_FRAMES))
    needles = sorted([(req.depth, facts[0] + units.joiner)] + [(rng.random(), f + units.joiner) for f in facts[1:]],
                     key=lambda p: p[0])
    hay = Haystack(preamble=(instruction + "\n\n" if instruction else "") + greeting + "\n\n", filler=units,
                   needles=needles, splittable=False)
    ending = "\n\n" + closing if closing else ""

    def render(n: int, extra: int = 0) -> str:
        return hay.render(n, extra) + ending

    context, tokens = fit_context(render, hay.max_extra, req.count_tokens, req.target_tokens, task)
    meta = {"depth": req.depth, "depths": [d for d, _ in needles], "corpus": corpus, "query": [people[0]],
            "kind": kind, "statement": facts[0], "distractors": [v[1][0] for v in values[1:]], "context_tokens": tokens}
    return Sample(task=task, context=context, question=question, answers=list(values[0][1]), metric="part", meta=meta)
