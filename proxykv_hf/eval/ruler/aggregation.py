"""RULER's aggregation tasks: common words extraction ``cwe`` and frequent words extraction ``fwe``
(scripts/data/synthetic/common_words_extraction.py and freq_words_extraction.py of github.com/NVIDIA/RULER).

* ``cwe``: a numbered list of words in which 10 words appear ``freq_cw`` times each and every other word
  ``freq_ucw`` times (30 and 3 from 4096 tokens, 6 and 1 below), shuffled; the answer is the 10 common words. One
  in-context example comes first (40 words, 10 x 10 and 3 x 1, from 4096 tokens; 20 words, 3 and 1, below) with
  its answer. Sizing: :func:`~.sizing.fit` over the number of distinct words.
* ``fwe``: coded words of 6 random letters, a vocabulary of ``(target - 50) // 50``, the k-th word repeated
  ``int(n * k**-alpha / zeta(alpha))`` times (alpha 2), shuffled; the most frequent "word" is the noise ``...``, the
  answer the 2nd to 4th. Sizing: :func:`~.sizing.fit` over ``n``.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
import string

from ..haystack import Sample, Stream, TaskRequest
from .._text import _SYLLABLES, ADJECTIVES, NOUNS, VERBS, _unique
from .sizing import Prompt, fit, make_sample
from .templates import COMMON_WORDS as CWE, CWE_SETTINGS, FREQUENT_WORDS as FWE, FWE_SETTINGS

WORDS = tuple(sorted(set(NOUNS + ADJECTIVES + VERBS)))
"""``cwe``'s words: nouns, adjectives and verbs, as RULER takes them (from its ``wonderwords`` lists; here this
package's own, 373 words)."""


@functools.lru_cache(maxsize=1)
def more_words() -> tuple[str, ...]:
    """The words ``cwe`` draws from when a list needs more than :data:`WORDS` (RULER switches to a longer English
    word list then): every word of two or three of this package's syllables, about 100,000."""
    combos = itertools.chain(itertools.product(_SYLLABLES, repeat=2), itertools.product(_SYLLABLES, repeat=3))
    return tuple(sorted(set(map("".join, combos)) - set(WORDS)))


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _word_list(words: list[str], num_cw: int, freq_cw: int, freq_ucw: int, rng: random.Random) -> str:
    """RULER's ``get_example``: the first ``num_cw`` of ``words`` ``freq_cw`` times, the rest ``freq_ucw`` times,
    shuffled, numbered."""
    items = words[:num_cw] * freq_cw + words[num_cw:] * freq_ucw
    rng.shuffle(items)
    return _numbered(items)


def common_words(req: TaskRequest) -> Sample:
    """One ``cwe`` sample for ``req`` (RULER's settings: 10 common words)."""
    rng, target = req.rng, req.target_tokens
    num_cw = CWE_SETTINGS["num_cw"]
    if target < 4096:  # RULER's settings below 4096 tokens
        shot, (freq_cw, freq_ucw) = (20, 3, 1), (6, 1)
    else:
        shot, (freq_cw, freq_ucw) = (40, 10, 3), (CWE_SETTINGS["freq_cw"], CWE_SETTINGS["freq_ucw"])
    shot_words = rng.sample(WORDS, shot[0])
    example = CWE.context.format(context=_word_list(shot_words, num_cw, shot[1], shot[2], rng)) + CWE.question + \
        CWE.answer_prefix + " " + _numbered(shot_words[:num_cw])
    # random.sample(words, n) of RULER, for every n at once: a random order of the words, its first n
    order = rng.sample(WORDS, len(WORDS))
    seen: set[str] = set()
    extra = Stream(lambda r, i: _unique(lambda: r.choice(more_words()), seen), random.Random(rng.getrandbits(64)))
    shuffle_seed = rng.getrandbits(64)

    def render(n: int) -> Prompt:
        words = order[:n] if n <= len(WORDS) else [extra[i] for i in range(n)]
        listed = _word_list(words, num_cw, freq_cw, freq_ucw, random.Random(f"{shuffle_seed}:{n}"))
        return Prompt(context=example + "\n" + CWE.context.format(context=listed), question=CWE.question,
                      answer_prefix=CWE.answer_prefix)

    n, prompt, tokens = fit(render, req.count_tokens, target, CWE.tokens_to_generate, n_min=num_cw, task="cwe")
    common = order[:num_cw] if n <= len(WORDS) else [extra[i] for i in range(num_cw)]
    return make_sample("cwe", prompt, list(common), tokens, CWE.tokens_to_generate, haystack_units=n,
                       freq_cw=freq_cw, freq_ucw=freq_ucw, query=[])


def zeta(alpha: float) -> float:
    """Riemann zeta(alpha) for alpha > 1 (scipy's ``zeta`` in RULER): a partial sum plus its Euler-Maclaurin tail."""
    if alpha <= 1:
        raise ValueError(f"alpha must be > 1, got {alpha}")
    n = 10_000
    return math.fsum(k ** -alpha for k in range(1, n)) + n ** (1 - alpha) / (alpha - 1) + n ** -alpha / 2


def frequent_words(req: TaskRequest) -> Sample:
    """One ``fwe`` sample for ``req`` (RULER's settings: alpha 2, 6-letter coded words, vocabulary
    ``(target - 50) // 50``)."""
    rng, target = req.rng, req.target_tokens
    alpha = FWE_SETTINGS["alpha"]
    vocab_size = (target - FWE.tokens_to_generate) // 50
    if vocab_size < 5:
        raise ValueError(f"target_tokens={target} is too small for RULER task 'fwe': its vocabulary of "
                         f"(target - 50) // 50 = {vocab_size} words needs at least 5; ask for at least 300")
    seen: set[str] = set()
    vocab = sorted(_unique(lambda: "".join(rng.choices(string.ascii_lowercase, k=6)), seen) for _ in range(vocab_size))
    rng.shuffle(vocab)
    vocab[0] = "..."  # RULER: the top-ranked word is noise
    z = zeta(alpha)
    shuffle_seed = rng.getrandbits(64)

    def render(n: int) -> Prompt:
        items = [w for k, w in enumerate(vocab, 1) for _ in range(int(n * k ** -alpha / z))]
        random.Random(f"{shuffle_seed}:{n}").shuffle(items)
        return Prompt(context=FWE.context.format(context=" ".join(items)), question=FWE.question,
                      answer_prefix=FWE.answer_prefix)

    # from this n on, the 4th word occurs at least once more than the 5th: the three answers are never tied
    n_min = math.ceil(z / (4 ** -alpha - 5 ** -alpha))
    n, prompt, tokens = fit(render, req.count_tokens, target, FWE.tokens_to_generate, n_min=n_min, task="fwe")
    return make_sample("fwe", prompt, vocab[1:4], tokens, FWE.tokens_to_generate, haystack_units=n, query=[])
