"""What every task generator shares: the sample and request types, and fitting a haystack with its needles to a
token budget."""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class Sample:
    """One task instance.

    Attributes:
        task: task name (a key of :data:`TASKS`).
        context: instructions + haystack; query-agnostic, compressed alone by the harness.
        question: the question asked after the context.
        answers: reference strings; see ``metric``.
        metric: ``"all"`` (fraction of ``answers`` in the prediction) or ``"part"`` (1 if any is).
        meta: seed, index, depth(s), target and actual context tokens, query strings, ...
        answer_prefix: text that starts the assistant's answer (RULER's answer prefix); may be empty.
    """

    task: str
    context: str
    question: str
    answers: list[str]
    metric: str
    meta: dict[str, Any] = field(default_factory=dict)
    answer_prefix: str = ""

    def __post_init__(self) -> None:
        if self.metric not in ("all", "part"):
            raise ValueError(f"metric must be 'all' or 'part', got {self.metric!r}")
        if not self.answers or not all(isinstance(a, str) and a for a in self.answers):
            raise ValueError(f"answers must be a non-empty list of non-empty strings, got {self.answers!r}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict (the inverse of :meth:`from_dict`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """Rebuild a sample written by :meth:`to_dict`."""
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class TaskRequest:
    """What a task generator gets: its random source, the token counter, the target and the needle depth.

    Attributes:
        rng: the sample's own random generator (seeded from task, seed and index).
        count_tokens: ``text -> number of tokens`` for the evaluation tokenizer.
        target_tokens: the context length to fit.
        depth: the main needle's depth in [0, 1), spread evenly over sample indices.
    """

    rng: random.Random
    count_tokens: Callable[[str], int]
    target_tokens: int
    depth: float


TaskFn = Callable[[TaskRequest], Sample]


class Stream:
    """An endless, lazily extended, deterministic sequence: ``item(rng, i)`` is called for i = 0, 1, 2, ..."""

    def __init__(self, item: Callable[[random.Random, int], str], rng: random.Random) -> None:
        self._item, self._rng, self._items = item, rng, []

    def __getitem__(self, i: int) -> str:
        while len(self._items) <= i:
            self._items.append(self._item(self._rng, len(self._items)))
        return self._items[i]


@dataclass
class Haystack:
    """``preamble`` + filler units with ``needles`` inserted at depth fractions among them.

    Units carry their own trailing separator. ``render(n, extra)`` uses the first ``n`` units and, when
    ``splittable``, the first ``extra`` words of unit ``n``. ``wrap(k, piece)`` formats the k-th piece (QA docs).
    """

    preamble: str
    filler: Stream
    needles: Sequence[tuple[float, str]] = ()
    splittable: bool = False
    wrap: Callable[[int, str], str] | None = None

    def render(self, n: int, extra: int = 0) -> str:
        units = [self.filler[i] for i in range(n)]
        if extra:
            units.append(" ".join(self.filler[n].split()[:extra]) + " ")
        pieces = insert_needles(units, self.needles)
        if self.wrap is not None:
            pieces = [self.wrap(k, p) for k, p in enumerate(pieces, 1)]
        return (self.preamble + "".join(pieces)).rstrip()

    def max_extra(self, n: int) -> int:
        return max(0, len(self.filler[n].split()) - 1) if self.splittable else 0


def insert_needles(units: list[str], needles: Sequence[tuple[float, str]]) -> list[str]:
    """Insert each needle ``(depth, text)`` before unit ``round(depth * len(units))``, keeping needle order."""
    slots: dict[int, list[str]] = {}
    for depth, text in needles:
        slots.setdefault(min(len(units), round(depth * len(units))), []).append(text)
    out: list[str] = []
    for i in range(len(units) + 1):
        out.extend(slots.get(i, ()))
        if i < len(units):
            out.append(units[i])
    return out


def fit_context(render: Callable[[int, int], str], max_extra: Callable[[int], int], count: Callable[[str], int],
         target: int, task: str) -> tuple[str, int]:
    """The longest ``render(n, extra)`` with at most ``target`` tokens, as ``(text, tokens)``.

    Interpolation search over ``n`` (tokens per unit estimated from the probes, so a handful of tokenizations
    of the full context), then bisection over ``extra`` words of the next unit when that is allowed.
    """
    seen: dict[tuple[int, int], tuple[int, str]] = {}

    def f(n: int, extra: int = 0) -> int:
        if (n, extra) not in seen:
            text = render(n, extra)
            seen[(n, extra)] = (count(text), text)
        return seen[(n, extra)][0]

    t0 = f(0)
    if t0 > target:
        raise ValueError(f"target_tokens={target} is too small for task {task!r}: its fixed part (instructions, "
                         f"needles, answer material) alone takes {t0} tokens with this tokenizer; ask for at least "
                         f"{t0}")
    lo, t_lo, hi = 0, t0, None  # invariant: f(lo) <= target < f(hi)
    slope: float | None = None  # tokens per unit, averaged over the probes
    cap = 4 * target + 64  # every unit holds at least ~1 token; guards against a render that ignores n
    steps = 0
    while hi is None or hi - lo > 1:
        steps += 1
        guess = lo + 8 if slope is None else lo + int((target - t_lo) / slope)
        if hi is None:
            guess = min(max(guess, lo + 1), cap)
        else:
            if steps > 12:  # interpolation is not converging: bisect
                guess = (lo + hi) // 2
            guess = min(max(guess, lo + 1), hi - 1)
        t = f(guess)
        slope = max((t - t0) / guess, 1e-3)
        if t <= target:
            lo, t_lo = guess, t
            if lo >= cap:
                logger.warning("task %r: the context stopped growing at %d tokens (target %d)", task, t, target)
                break
        else:
            hi = guess
    extra_lo, extra_hi = 0, max_extra(lo) + 1  # f(lo, extra_lo) <= target; extra_hi is out of range
    if target - t_lo > max(1, 0.002 * target):
        while extra_hi - extra_lo > 1:
            mid = (extra_lo + extra_hi) // 2
            if f(lo, mid) <= target:
                extra_lo = mid
            else:
                extra_hi = mid
    tokens, text = seen[(lo, extra_lo)]
    return text, tokens
