"""What the RULER generators share: a prompt cut in RULER's three parts, sizing it to the target length, the sample
it becomes, and the essays' sentence split.

RULER sizes a prompt so that its tokens (the template with context, question and answer prefix, no chat template)
plus the task's generation budget fit the requested length, searching the haystack size (sentences, words, lines)
with the target's tokenizer (``generate_samples`` in scripts/data/synthetic/niah.py). :func:`fit` does the same per
sample: the largest haystack whose prompt fits, so a prompt falls short of the budget by less than one haystack unit.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ..haystack import Sample
from .templates import METRICS, PREFIX


@dataclass(frozen=True)
class Prompt:
    """A RULER prompt in the three parts the query-agnostic protocol uses (kvpress's split of RULER's input).

    Attributes:
        context: everything before the question, its final newline included (compressed alone).
        question: RULER's query part.
        answer_prefix: RULER's answer prefix, its leading space included.
    """

    context: str
    question: str
    answer_prefix: str

    @property
    def text(self) -> str:
        """RULER's whole input (template + answer prefix, no chat template): what its length counts."""
        return self.context + self.question + self.answer_prefix


def fit(render: Callable[[int], Prompt], count: Callable[[str], int], target: int, tokens_to_generate: int, *,
        n_min: int, task: str, strict: bool = True) -> tuple[int, Prompt, int]:
    """The largest haystack size ``n >= n_min`` whose prompt's tokens plus ``tokens_to_generate`` fit ``target``.

    Interpolation over ``n`` (tokens per unit estimated from the probes), then bisection, as RULER's binary search;
    ``render(n)`` must depend on ``n`` alone (a sample's random draws are made before).

    Returns:
        ``(n, prompt, prompt tokens)``.

    Raises:
        ValueError: even ``render(n_min)`` does not fit (unless not ``strict``: then it is returned).
    """
    budget = target - tokens_to_generate
    seen: dict[int, tuple[int, Prompt]] = {}

    def tokens(n: int) -> int:
        if n not in seen:
            prompt = render(n)
            seen[n] = (count(prompt.text), prompt)
        return seen[n][0]

    t0 = tokens(n_min)
    if t0 > budget:
        if not strict:
            return n_min, seen[n_min][1], t0
        raise ValueError(f"target_tokens={target} is too small for RULER task {task!r}: its smallest prompt takes {t0} "
                         f"tokens with this tokenizer, and RULER keeps {tokens_to_generate} for the answer; ask for at "
                         f"least {t0 + tokens_to_generate}")
    lo, t_lo, hi = n_min, t0, None  # invariant: tokens(lo) <= budget < tokens(hi)
    slope: float | None = None  # tokens per haystack unit
    cap = 8 * target + 64  # a unit holds at least ~1 token; guards against a render that ignores n
    steps = 0
    while hi is None or hi - lo > 1:
        if hi is None and lo >= cap:
            break  # the prompt stopped growing with n
        steps += 1
        guess = lo + 8 if slope is None else lo + max(1, int((budget - t_lo) / slope))
        if hi is None:
            guess = min(guess, cap)
        else:
            guess = (lo + hi) // 2 if steps > 16 else min(max(guess, lo + 1), hi - 1)
        t = tokens(guess)
        slope = max((t - t0) / (guess - n_min), 1e-3)
        if t <= budget:
            lo, t_lo = guess, t
        else:
            hi = guess
    return lo, seen[lo][1], t_lo


def make_sample(name: str, prompt: Prompt, answers: list[str], tokens: int, tokens_to_generate: int,
                **meta) -> Sample:
    """The harness's sample of a RULER prompt: the context without its final newline (the chat prompt puts
    ``"\\n\\n"`` between context and question), the question, the answer prefix without its leading space, RULER's
    metric, and in ``meta`` the prompt's RULER token count and RULER's generation budget (``max_new_tokens``, which
    the harness uses for these samples)."""
    return Sample(task=PREFIX + name, context=prompt.context.rstrip("\n"), question=prompt.question.strip(),
                  answers=answers, metric=METRICS[name], answer_prefix=prompt.answer_prefix.lstrip(" "),
                  meta={"prompt_tokens": tokens, "max_new_tokens": tokens_to_generate, "ruler": name, **meta})


_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]]))\s+(?=[\"'(\[]?[A-Z0-9])")


def sentences(text: str) -> list[str]:
    """``text`` cut into sentences: after ``.``, ``!`` or ``?`` (and a closing quote or bracket) where whitespace and
    a capital, a digit or an opening quote follow. Stands in for NLTK's Punkt (``sent_tokenize``), which RULER uses
    to place needles between sentences of the essays; it splits where Punkt does except around abbreviations."""
    return [s for s in _SENTENCE_END.split(text) if s]
