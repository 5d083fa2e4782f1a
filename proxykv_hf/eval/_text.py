"""Word lists and random text pieces for the synthetic tasks (written for this package, no downloaded data)."""

from __future__ import annotations

import random
import re
import uuid
from collections.abc import Callable

# ----------------------------------------------------------------------------------------------------------------
# word lists (written for this module; ~370 common English words)

NOUNS = tuple("""
apple river garden window teacher market engine letter bridge mountain island candle doctor farmer painter village
forest planet rocket signal pocket button basket blanket bottle camera castle cloud coffee computer corner desk dinner
dragon dream drum eagle field finger flower friend guitar hammer harbor horse house idea jacket jungle kettle kitchen
ladder lake lamp lantern lawyer lemon lion machine magnet map meadow mirror monkey motor museum notebook ocean office
orange owl painting palace paper parrot pencil piano picture pillow pilot plate poem pond puzzle rabbit radio record
robot rock saddle sailor school scientist season shadow ship shoe singer skill soldier song spoon star station stone
street student sugar summer table teapot temple thunder ticket tiger tower town tractor train tree trumpet tunnel
turtle umbrella valley violin wagon wall whale wheel winter wizard writer yard zebra founder startup investor program
language customer product problem question company city story library country essay habit market editor neighbor
morning evening journey village cottage compass feather helmet island orchard pepper pebble pirate quilt ribbon
rooftop sandwich scarf shelf sparrow squirrel stadium statue sweater thimble tomato trolley walnut waterfall
""".split())

ADJECTIVES = tuple("""
able ancient angry bold brave bright broad busy calm careful cheap clean clever cold common curious dark deep eager
early easy empty fair famous fancy fast fierce flat fresh friendly gentle giant glad golden grand great happy hard
heavy honest huge humble hungry icy jolly kind large lazy little lively lonely loud lucky mighty modern narrow neat
noble odd old patient plain polite proud quick quiet rapid rare rich rough round royal rusty sharp shiny short silent
silly simple slow small smart smooth soft solid strange strong sudden sweet swift tall tender tiny tough useful vast
warm wild wise young zealous quirky sleepy steady tidy vivid witty dusty elegant fluffy fragile gloomy graceful
hollow lucid mellow misty nimble peaceful playful precious restless sturdy velvet wooden
""".split())

VERBS = tuple("""
build carry change choose climb collect cook create cross dance decide deliver design discover draw drive explain
explore fix follow gather grow help imagine improve invent join jump keep learn lift listen measure move notice open
paint plan plant play protect push read repair sell share sing sketch solve start study teach test travel trust visit
wander wash watch write borrow finish polish question rescue follow arrange balance celebrate compare
""".split())

ADVERBS = tuple("""
quickly slowly quietly carefully easily rarely often always eventually gradually suddenly gently boldly calmly
eagerly honestly loudly patiently politely proudly simply smoothly softly steadily truly usually warmly wisely barely
happily
""".split())

WORDS = tuple(dict.fromkeys(NOUNS + ADJECTIVES + VERBS + ADVERBS))
"""All the common words, deduplicated, in a fixed order."""

_SYLLABLES = tuple("""
ka lo mi ra ven tor bel sa dun mar li no fi gar ther ul pe quin ros ta vi zen bra cor del en hal is jor kel mo
nar ob pri sel tu var wen yor zal dri fen gos lum pha rin sto tev ur
""".split())
_FIRST_NAMES = tuple("""
Alice Bruno Clara Daniel Elena Felix Grace Hugo Irene Jonas Karin Leo Maya Nora Oscar Paula Quentin Rosa Samuel Tessa
Ulrich Vera Walter Xenia Yusuf Zoe Amir Beatrix Conrad Dalia Emil Frida Gustav Hanna Ivan Julia Kofi Lena Marco Nadia
""".split())
_PROFESSIONS = tuple("""
painter astronomer composer engineer botanist architect sculptor chemist poet cartographer historian mathematician
violinist glassblower watchmaker beekeeper
""".split())
_PRODUCTS = ("wooden clocks", "glass lanterns", "copper kettles", "wool blankets", "paper kites", "silver spoons",
             "clay pots", "leather boots", "honey cakes", "rope ladders", "brass trumpets", "linen shirts",
             "iron anchors", "cherry jam", "felt hats", "oak barrels", "straw baskets", "marble statues")
_COMPANY_SUFFIXES = ("Industries", "Works", "Company", "Labs", "Trading", "Mills")

_NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")

_ESSAY_TEMPLATES = (
    "Most {Ns} {V} {D} when they have to {V} {aA} {N}.",
    "The {A} {N} is usually more {A} than people expect.",
    "If you want to {V} {aN}, you should first {V} the {N}.",
    "That is why so many {Ns} end up trying to {V} the {A} {Ns}.",
    "In practice, the {N} of {aN} matters more than its {N}.",
    "It took me years to realize that {Ns} are rarely {A}.",
    "Nobody plans to {V} {aN}; it happens {D} while they {V} something else.",
    "The best way to {V} is to {V} {D} and see what happens to the {N}.",
    "When I started, I thought every {N} needed {aA} {N}.",
    "What surprised me most was how {D} the {Ns} began to {V}.",
    "You can learn a lot about {aN} by watching how it treats its {Ns}.",
    "Some {Ns} are {A} and some are {A}, but all of them {V} eventually.",
    "The {N} was never the problem; the {A} {N} was.",
    "People who {V} {Ns} for a living tend to be {A} about {Ns}.",
    "Even {aA} {N} can {V} if you give it enough {N}.",
    "I suspect the same is true of {Ns} and {Ns}.",
    "For a long time the {N} seemed {A}, and then suddenly it did not.",
    "Ask any {N} and they will tell you that {Ns} {V} {D}.",
    "{aA} idea is worth more than {aA} {N}, at least at the start.",
    "The {Ns} I admire most {V} {D} and never stop trying to {V}.",
)


# ----------------------------------------------------------------------------------------------------------------
# generators of text pieces


def _plural(noun: str) -> str:
    if noun.endswith("y") and noun[-2:-1] not in "aeiou":
        return noun[:-1] + "ies"
    if noun.endswith(("s", "sh", "ch", "x", "z")):
        return noun + "es"
    return noun + "s"


def _article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _essay_sentence(rng: random.Random) -> str:
    """One sentence of the essay-like haystack (grammatical, meaningless, varied)."""
    slots: dict[str, Callable[[], str]] = {
        "N": lambda: rng.choice(NOUNS), "Ns": lambda: _plural(rng.choice(NOUNS)), "A": lambda: rng.choice(ADJECTIVES),
        "V": lambda: rng.choice(VERBS), "D": lambda: rng.choice(ADVERBS),
        "aN": lambda: _article(rng.choice(NOUNS)), "aA": lambda: _article(rng.choice(ADJECTIVES)),
    }
    return re.sub(r"\{(\w+)\}", lambda m: slots[m.group(1)](), rng.choice(_ESSAY_TEMPLATES))


def _essay_unit(rng: random.Random, i: int) -> str:
    return _essay_sentence(rng) + ("\n\n" if rng.random() < 0.15 else " ")


def _noise_unit(rng: random.Random, i: int) -> str:
    return _NOISE[i % len(_NOISE)] + " "


def _unique(make: Callable[[], str], seen: set[str]) -> str:
    for _ in range(1000):
        value = make()
        if value not in seen:
            seen.add(value)
            return value
    raise RuntimeError(f"could not draw a new unique value after 1000 tries (have {len(seen)})")


def _word_key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _pseudo_word(rng: random.Random, syllables: tuple[int, int] = (2, 3)) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(*syllables)))


def _name(rng: random.Random, seen: set[str]) -> str:
    return _unique(lambda: _pseudo_word(rng).capitalize(), seen)


def _person(rng: random.Random, seen: set[str]) -> str:
    return _unique(lambda: f"{rng.choice(_FIRST_NAMES)} {_pseudo_word(rng).capitalize()}", seen)


def qa_document(rng: random.Random, seen: set[str]) -> tuple[str, list[tuple[str, str, str]]]:
    """A short document about a fictional entity and its ``(question, answer, entity)`` triples."""
    kind = rng.randrange(3)
    year = str(rng.randint(1400, 1950))
    product = rng.choice(_PRODUCTS)
    if kind == 0:
        town, region, river, founder = _name(rng, seen), _name(rng, seen), _name(rng, seen), _person(rng, seen)
        text = (f"{town} is a small town in the {region} valley. It was founded in {year} by {founder}. The town is "
                f"famous for its {product}, which are sold in markets across the region. Its oldest bridge crosses "
                f"the {river} river.")
        qas = [(f"In which year was the town of {town} founded?", year, town),
               (f"Who founded the town of {town}?", founder, town),
               (f"What is the town of {town} famous for?", product, town)]
    elif kind == 1:
        person, town = _person(rng, seen), _name(rng, seen)
        profession = rng.choice(_PROFESSIONS)
        first = person.split()[0]
        text = (f"{person} was {_article(profession)} born in {year} in the town of {town}. {first} is best "
                f"remembered for a long study of {rng.choice(ADJECTIVES)} {_plural(rng.choice(NOUNS))}. In later "
                f"years {first} collected {product} and gave them to friends.")
        qas = [(f"What was the profession of {person}?", profession, person),
               (f"In which town was {person} born?", town, person),
               (f"In which year was {person} born?", year, person)]
    else:
        company = _unique(lambda: f"{_pseudo_word(rng).capitalize()} {rng.choice(_COMPANY_SUFFIXES)}", seen)
        founder, town = _person(rng, seen), _name(rng, seen)
        staff = str(rng.randint(12, 950))
        text = (f"{company} is a company that makes {product}. It was started in {year} by {founder} and has its "
                f"headquarters in {town}. Today {company} employs about {staff} people.")
        qas = [(f"What does the company {company} make?", product, company),
               (f"In which town does {company} have its headquarters?", town, company),
               (f"Who started the company {company}?", founder, company),
               (f"How many people does {company} employ?", staff, company)]
    return text, qas
