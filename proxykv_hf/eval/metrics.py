"""RULER's string-match metrics (Hsieh et al., 2024, arXiv:2404.06654), per sample, in [0, 1].

RULER reports the mean over samples times 100; these functions score one prediction. Matching is substring
containment, case-insensitive, after RULER's post-processing (control characters become newlines, whitespace is
stripped).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .haystack import Sample

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    """RULER's clean-up of a model output: control characters to newlines, then strip."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def _check(answers: Sequence[str]) -> list[str]:
    if isinstance(answers, str):
        raise ValueError(f"answers must be a list of strings, got the string {answers!r}; wrap it in a list")
    if not answers:
        raise ValueError("answers must not be empty")
    return [a.lower() for a in answers]


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """The fraction of ``answers`` contained in ``prediction`` (case-insensitive); RULER's metric for most tasks."""
    refs = _check(answers)
    pred = postprocess(prediction).lower()
    return sum(ref in pred for ref in refs) / len(refs)


def string_match_part(prediction: str, answers: Sequence[str]) -> float:
    """1.0 if any of ``answers`` is contained in ``prediction`` (case-insensitive), else 0.0; RULER's QA metric."""
    refs = _check(answers)
    pred = postprocess(prediction).lower()
    return float(any(ref in pred for ref in refs))


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {"all": string_match_all, "part": string_match_part}
"""``Sample.metric`` -> scoring function."""


def score_sample(sample: Sample, prediction: str) -> float:
    """Score ``prediction`` against ``sample.answers`` with the sample's metric (``"all"`` or ``"part"``)."""
    try:
        metric = METRICS[sample.metric]
    except KeyError:
        raise ValueError(f"unknown metric {sample.metric!r} in a {sample.task!r} sample; choose from "
                         f"{', '.join(METRICS)}") from None
    return metric(prediction, sample.answers)
