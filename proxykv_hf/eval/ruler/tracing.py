"""RULER's variable tracking, ``vt`` (scripts/data/synthetic/variable_tracking.py of github.com/NVIDIA/RULER).

One chain of ``num_hops + 1 = 5`` variables, ``VAR ABCDE = 12345`` then ``VAR FGHIJ = VAR ABCDE `` and so on (five
capital letters, a 5-digit value), its lines hidden in order among RULER's noise sentences, one per line. The
question asks for every variable that holds the value. Before it stands RULER's one in-context example: the same
task on a haystack of at most 500 tokens, with 3-letter names, followed by its answer. Sizing: :func:`~.sizing.fit`
over the number of noise sentences.
"""

from __future__ import annotations

import random
import string

from ..haystack import Sample, TaskRequest
from .._text import _unique
from .sizing import Prompt, fit, make_sample
from .templates import NOISE, VARIABLE_TRACKING as VT, VT_SETTINGS

ICL_TOKENS = 500
"""RULER sizes the in-context example to at most this many tokens (``max_seq_length=500``, nothing generated)."""


def _chain(rng: random.Random, letters: int, num_hops: int) -> tuple[list[str], str, list[str]]:
    """``(names, value, lines)``: distinct names of ``letters`` capitals, a value in [10000, 99999) (numpy's
    ``randint(10000, 99999)``), and the chain's lines as RULER writes them (an assignment of a variable ends with a
    space)."""
    seen: set[str] = set()
    names = [_unique(lambda: "".join(rng.choices(string.ascii_uppercase, k=letters)), seen)
             for _ in range(num_hops + 1)]
    value = str(rng.randint(10000, 99998))
    lines = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(num_hops)]
    return names, value, lines


def _noise_with_chain(n: int, chain: list[str], rng: random.Random) -> str:
    """``n`` noise sentences, one per line, the chain's lines inserted in order before lines drawn at random."""
    lines = [NOISE] * n
    for j, position in enumerate(sorted(rng.sample(range(n), len(chain)))):
        lines.insert(position + j, chain[j])
    # RULER then replaces ". \n" with ".\n", which never occurs in the noise haystack
    return "\n".join(lines)


def _renderer(chain: list[str], value: str, names: list[str], place_seed: int, before: str = ""):
    def render(n: int) -> Prompt:
        return Prompt(context=before + VT.context.format(
                          context=_noise_with_chain(n, chain, random.Random(f"{place_seed}:{n}"))),
                      question=VT.question.format(query=value),
                      answer_prefix=VT.answer_prefix.format(num_v=len(names), query=value))
    return render


def icl_example(rng: random.Random, count, num_hops: int) -> str:
    """RULER's in-context example: the whole template (answer prefix included) over the most noise sentences that
    keep it within :data:`ICL_TOKENS` tokens (at least 5, RULER's smallest step, even when longer), 3-letter names
    and a 5-digit value, then a space, its answer (the names) and a newline."""
    names, value, chain = _chain(rng, 3, min(10, num_hops))
    _, prompt, _ = fit(_renderer(chain, value, names, rng.getrandbits(64)), count, ICL_TOKENS, 0,
                       n_min=max(5, len(chain)), task="vt", strict=False)
    return prompt.text + " " + " ".join(names) + "\n"


def variable_tracking(req: TaskRequest) -> Sample:
    """One ``vt`` sample for ``req`` (RULER's settings: one chain of four hops)."""
    rng = req.rng
    num_hops = VT_SETTINGS["num_hops"]
    example = icl_example(rng, req.count_tokens, num_hops)
    names, value, chain = _chain(rng, 5, num_hops)
    # RULER inserts the example (which ends with a newline) and another newline before the task's template
    render = _renderer(chain, value, names, rng.getrandbits(64), before=example + "\n")
    n, prompt, tokens = fit(render, req.count_tokens, req.target_tokens, VT.tokens_to_generate, n_min=len(chain),
                            task="vt")
    return make_sample("vt", prompt, names, tokens, VT.tokens_to_generate, haystack_units=n, query=[value])
