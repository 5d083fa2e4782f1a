"""RULER's task definitions as data: prompt templates, answer prefixes, generation budgets, metrics and the settings
of the 11 synthetic tasks built here (Hsieh et al., 2024, arXiv:2404.06654).

The wording is RULER's, reproduced on purpose (it is what makes the numbers comparable with other RULER boards):
templates and answer prefixes from ``scripts/data/synthetic/constants.py``, the per-task settings from
``scripts/synthetic.yaml``, the metrics from ``scripts/eval/synthetic/constants.py`` of github.com/NVIDIA/RULER.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "ruler_"
"""Task names of the benchmark are RULER's names behind this prefix (``ruler_niah_single_1``), apart from the
RULER-style training generators of :mod:`proxykv_hf.eval.tasks` that carry the bare names."""

SEED_RANGE = range(3_000_000, 4_000_000)
"""RULER samples come from their own generator seeds, disjoint from the train split's (below 1,000,000) and from
the dev and test splits' (1,000,003 and 2,000,003)."""

# ---------------------------------------------------------------------------------------------------------------
# templates: scripts/data/synthetic/constants.py. RULER formats ``template + answer_prefix`` as one string; the
# query-agnostic split (kvpress's, evaluation/benchmarks/ruler/create_huggingface_dataset.py) cuts it before the
# question and before the answer prefix. Each template below is RULER's, cut at those two points.


@dataclass(frozen=True)
class Template:
    """One RULER template, cut into the three parts the harness uses.

    Attributes:
        context: the instruction and ``{context}``, up to and including the newline before the question.
        question: the question (kvpress's question part).
        answer_prefix: RULER's answer prefix, its leading space included (stripped in the sample).
        tokens_to_generate: RULER's generation budget; the prompt is sized so that it and this fit the target.
    """

    context: str
    question: str
    answer_prefix: str
    tokens_to_generate: int


NIAH = Template(
    context="Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the {type_needle_v} afterwards.\n{context}\n",
    question="What are all the special magic {type_needle_v} for {query} mentioned in the provided text?",
    answer_prefix=" The special magic {type_needle_v} for {query} mentioned in the provided text are",
    tokens_to_generate=128)

VARIABLE_TRACKING = Template(
    context="Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n",
    question="Question: Find all variables that are assigned the value {query} in the text above.",
    answer_prefix=" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
                  "are assigned the value {query}, they are: ",
    tokens_to_generate=30)

COMMON_WORDS = Template(
    context="Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
            "ones that appear most often.\n{context}\n",
    question="Question: What are the 10 most common words in the above list?",
    answer_prefix=" Answer: The top 10 words that appear most often in the list are:",
    tokens_to_generate=120)

FREQUENT_WORDS = Template(
    context="Read the following coded text and track the frequency of each coded word. Find the three most "
            "frequently appeared coded words. {context}\n",
    question="Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
             "frequently appeared words in the above coded text?",
    answer_prefix=" Answer: According to the coded text above, the three most frequently appeared words are:",
    tokens_to_generate=50)


def singular(text: str) -> str:
    """RULER's rewording of the NIAH template when one value is asked (``num_needle_q * num_needle_v == 1``,
    scripts/data/synthetic/niah.py): the same string replacements, in the same order."""
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        text = text.replace(old, new)
    return text


NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
"""The ``noise`` haystack's sentence, repeated one per line (scripts/data/synthetic/niah.py)."""

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
"""A needle, also the ``needle`` haystack's distractor line (always the plural: ``numbers``, ``uuids``)."""

DEPTHS = tuple(round(100 * i / 39) for i in range(40))
"""RULER's 40 needle depths in %, ``np.round(np.linspace(0, 100, 40))`` (no ties to round: 200 i / 39 is odd only
for i = 0 or 39)."""


# ---------------------------------------------------------------------------------------------------------------
# the tasks: scripts/synthetic.yaml


@dataclass(frozen=True)
class NiahSettings:
    """One NIAH variant (scripts/synthetic.yaml).

    Attributes:
        haystack: ``"noise"``, ``"essay"`` or ``"needle"``.
        key, value: ``"words"``, ``"numbers"`` or ``"uuids"``.
        num_k, num_v, num_q: keys hidden, values per key, keys asked (RULER raises ``num_k`` to ``num_q``).
    """

    haystack: str
    key: str = "words"
    value: str = "numbers"
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1


NIAH_TASKS: dict[str, NiahSettings] = {
    "niah_single_1": NiahSettings(haystack="noise"),
    "niah_single_2": NiahSettings(haystack="essay"),
    "niah_single_3": NiahSettings(haystack="essay", value="uuids"),
    "niah_multikey_1": NiahSettings(haystack="essay", num_k=4),
    "niah_multikey_2": NiahSettings(haystack="needle"),
    "niah_multikey_3": NiahSettings(haystack="needle", key="uuids", value="uuids"),
    "niah_multivalue": NiahSettings(haystack="essay", num_v=4),
    "niah_multiquery": NiahSettings(haystack="essay", num_q=4),
}

VT_SETTINGS = {"num_chains": 1, "num_hops": 4}
CWE_SETTINGS = {"freq_cw": 30, "freq_ucw": 3, "num_cw": 10}
FWE_SETTINGS = {"alpha": 2.0}

NAMES = tuple(NIAH_TASKS) + ("vt", "cwe", "fwe")
"""RULER's 11 synthetic tasks built here, in RULER's order. ``qa_1`` (SQuAD) and ``qa_2`` (HotpotQA) need data sets
that cannot be reached offline and are not built."""

ESSAY_TASKS = tuple(name for name, s in NIAH_TASKS.items() if s.haystack == "essay")
"""The tasks whose haystack is Paul Graham's essays (:mod:`proxykv_hf.eval.ruler.essays`)."""

METRICS = dict.fromkeys(NAMES, "all")
"""scripts/eval/synthetic/constants.py: ``string_match_all`` for every synthetic task (``string_match_part`` is
for ``qa_1`` / ``qa_2``, not built)."""
