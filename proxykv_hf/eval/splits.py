"""The locked evaluation protocol: three disjoint splits, fixed in code.

* ``train``: what ``proxykv build-data --split train`` may draw texts from (generator seeds below
  :data:`TRAIN_SEED_LIMIT`);
* ``dev``: what every choice is made on (checkpoint, epochs, mapper size, features, pooling, any threshold);
* ``test``: only reported, never used to choose anything;
* ``ruler``: RULER's 11 synthetic tasks as a benchmark (:mod:`proxykv_hf.eval.ruler`), reported beside other RULER
  boards, never chosen on, from seeds of their own.

The splits never share a corpus (:mod:`proxykv_hf.eval.corpora` gives each corpus one split) or a generator seed.
The test split holds task families that neither train nor dev has (``vt``, ``qa``, ``letter``) and haystacks from
corpora that neither saw (the Linux man pages, Perl's modules, its own everyday sentences). ``proxykv eval --split
test`` runs it; the report names the split it ran on.

A test task that has been reported on and then guides choices moves to dev and is replaced by a family nobody has
looked at: the pass keys in plain sentences (``passkey:filler-test``, reported at ~2k and ~4k) are dev's
``passkey:filler-dev2`` (the same generator over the same sentences), and the test split's sixth family is
``letter:everyday-test`` (:mod:`proxykv_hf.eval.letters`).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import corpora
from .ruler.templates import NAMES as _RULER_NAMES, PREFIX as _RULER_PREFIX
from .tasks import family_of, task_fn

TRAIN_SEED_LIMIT = 1_000_000
"""Generator seeds of training texts are below this; dev and test seeds are above it."""


@dataclass(frozen=True)
class Split:
    """One split of the protocol.

    Attributes:
        name: ``"train"``, ``"dev"``, ``"test"`` or ``"ruler"``.
        tasks: its task names (RULER generators or ``"family:corpus"``).
        seed: the generators' base seed for this split's samples.
        purpose: one line on what it is for.
    """

    name: str
    tasks: tuple[str, ...]
    seed: int
    purpose: str

    @property
    def families(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(family_of(t) for t in self.tasks))

    @property
    def corpora(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t.partition(":")[2] for t in self.tasks if ":" in t))

    def select(self, names) -> list[str]:
        """The split's tasks that ``names`` name, in the given order (RULER's own names, ``vt``, for the ``ruler``
        split's ``ruler_vt``); all of them when ``names`` is empty. ``ValueError`` for a task outside the split."""
        if not names:
            return list(self.tasks)
        chosen = []
        for name in names:
            task = name if name in self.tasks else _RULER_PREFIX + name
            if task not in self.tasks:
                shown = [t.removeprefix(_RULER_PREFIX) for t in self.tasks]
                raise ValueError(f"task {name!r} is not in the {self.name!r} split; choose from {', '.join(shown)}")
            chosen.append(task)
        return list(dict.fromkeys(chosen))


_RULER_TRAIN = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                "niah_multikey_3", "niah_multivalue", "cwe", "fwe")

SPLITS: dict[str, Split] = {
    "train": Split(
        name="train",
        tasks=_RULER_TRAIN + tuple(f"{family}:{corpus}" for corpus in ("pydocs", "pycode", "filler-train")
                                   for family in ("needle", "multikey", "multivalue")),
        seed=0, purpose="mapper training texts"),
    "dev": Split(
        name="dev",
        tasks=("needle:filler-dev", "needle:readmes", "multikey:readmes", "multivalue:readmes",
               "multiquery:readmes", "passkey:filler-dev2"),
        seed=1_000_003, purpose="every choice: checkpoint, epochs, features, pooling, the shipped default"),
    "test": Split(
        name="test",
        tasks=("letter:everyday-test", "needle:manpages", "multikey:perl", "multivalue:manpages", "vt:perl",
               "qa:manpages"),
        seed=2_000_003, purpose="reported only, never used to choose anything"),
    "ruler": Split(
        name="ruler", tasks=tuple(_RULER_PREFIX + name for name in _RULER_NAMES), seed=3_000_003,
        purpose="RULER as a benchmark: reported beside other RULER boards, never chosen on"),
}


def get_split(name: str) -> Split:
    """The split called ``name``; ``ValueError`` for any other name."""
    if name not in SPLITS:
        raise ValueError(f"unknown split {name!r}; choose from {', '.join(SPLITS)}")
    return SPLITS[name]


def split_of_task(task: str) -> str | None:
    """The split whose corpus ``task`` draws from; ``"ruler"`` for a task of the RULER benchmark; None for a
    RULER-style generator (its split is set by the seed)."""
    if task.startswith(_RULER_PREFIX):
        return "ruler"
    corpus = task.partition(":")[2]
    return corpora.CORPORA[corpus].split if corpus else None


def check_split(split: Split) -> None:
    """``ValueError`` unless every task of ``split`` exists and draws only from its own split's corpora."""
    for task in split.tasks:
        task_fn(task)
        owner = split_of_task(task)
        if owner is not None and owner != split.name:
            raise ValueError(f"task {task!r} of split {split.name!r} draws from a {owner!r} corpus")


def check_training_tasks(tasks, seed: int) -> None:
    """``ValueError`` for an unknown task, or if training texts would come from a dev or test corpus, or with a dev
    or test seed (``seed``: the largest generator seed the texts use)."""
    for task in tasks:
        task_fn(task)
        owner = split_of_task(task)
        if owner == "ruler":
            raise ValueError(f"task {task!r} is the RULER benchmark's, reported only; training may use RULER-style "
                             f"generators ({', '.join(_RULER_NAMES[:2])}, ...) and train corpora")
        if owner not in (None, "train"):
            raise ValueError(f"task {task!r} draws from the {owner!r} corpus {task.partition(':')[2]!r}; training "
                             f"may use only train corpora ({', '.join(SPLITS['train'].corpora)})")
    if not 0 <= seed < TRAIN_SEED_LIMIT:
        raise ValueError(f"training seeds must be in [0, {TRAIN_SEED_LIMIT}) (dev and test use the seeds above), "
                         f"got {seed}")
