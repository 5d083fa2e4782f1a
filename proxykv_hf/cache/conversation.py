"""What a ProxyKVCache holds, as token ids: one conversation, and the check that a new prompt continues it.

A cache holds one conversation: the token ids of its first prompt and of every token appended since (continuation
prompts, decoded tokens). A ``generate`` call on a used cache must be given that whole conversation followed by its
new tokens (the way ``generate`` continues any cache: it feeds only what the cache does not hold yet). A prompt that
is shorter, or differs anywhere, would be answered from a context the caller did not give; :meth:`Conversation.check`
refuses it with a ``ValueError`` that says what differs and how to start over. A prompt whose rows repeat the held
rows (``num_return_sequences``, beams) expands the cache instead (:meth:`Conversation.check` returns the factor).
"""

from __future__ import annotations

import torch

START_OVER = ("A cache holds one conversation: pass the whole conversation so far followed by the new tokens, or "
              "start over with cache.reset() (or cache.fresh() for an empty cache with the same settings).")


class Conversation:
    """The token ids a cache holds, per row, in order (the prompt, then everything appended).

    The ids are kept as the parts they came in (on their own device, so a decode step appends without a host
    sync) and joined when read. They become unknown (:attr:`known` False) once a forward comes without ids
    (``inputs_embeds``); a later ``generate`` call then cannot be checked and is refused.

    Attributes:
        length: tokens held per row.
        known: whether every held token's id is known.
    """

    def __init__(self):
        self._parts: list[torch.Tensor] = []
        self.length = 0
        self.known = True

    def __copy__(self) -> "Conversation":
        new = Conversation()
        new._parts, new.length, new.known = list(self._parts), self.length, self.known
        return new

    def __len__(self) -> int:
        return self.length

    def append(self, ids: torch.Tensor | None, n: int) -> None:
        """Record ``n`` tokens appended to every row: their ids `(B, n)`, or None when they came as embeddings."""
        self.length += n
        if ids is None or not self.known:
            self.known, self._parts = False, []
            return
        if ids.shape[-1] != n:
            raise ValueError(f"recorded {ids.shape[-1]} token ids for a forward of {n} tokens")
        self._parts.append(ids)

    def ids(self) -> torch.Tensor | None:
        """`(B, length)` the ids held, or None when unknown (or nothing held)."""
        if not self.known or not self._parts:
            return None
        if len(self._parts) > 1:
            device = self._parts[0].device
            self._parts = [torch.cat([p.to(device) for p in self._parts], dim=-1)]
        return self._parts[0]

    @property
    def rows(self) -> int | None:
        return self._parts[0].shape[0] if self._parts else None

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens."""
        ids = self.ids()
        self.length = length
        if ids is not None:
            self._parts = [ids[:, :length]]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Row ``r`` now holds old row ``rows[r]`` (beam reordering, expansion, selection)."""
        ids = self.ids()
        if ids is not None:
            self._parts = [ids[rows.to(ids.device)]]

    def clear(self) -> None:
        self.__init__()

    def check(self, prompt: torch.Tensor | None, *, what: str = "generate() was given") -> int:
        """Check that ``prompt`` `(B', N)` (a generate call's whole prompt) continues the held conversation.

        Returns:
            the factor by which the held rows must be repeated (``B' / B``: 1, or the ``num_return_sequences`` /
            beams expansion when every group of rows repeats one held row).

        Raises:
            ValueError: the prompt is unknown (``inputs_embeds``), shorter than what is held, or differs from it.
        """
        held = self.length
        if prompt is None:
            raise ValueError(f"{what} inputs_embeds on a cache that already holds {held} tokens, so it cannot be "
                             f"checked that they continue its conversation. Pass input_ids. {START_OVER}")
        ids = self.ids()
        if ids is None:
            raise ValueError(f"this ProxyKVCache holds {held} tokens that came as inputs_embeds: their ids are "
                             f"unknown, so it cannot be checked that a new prompt continues them. {START_OVER}")
        B, N = ids.shape[0], prompt.shape[-1]
        if prompt.shape[0] % B:
            raise ValueError(f"{what} a batch of {prompt.shape[0]} rows, but this ProxyKVCache holds a conversation "
                             f"of {B} rows (a batch can only grow by repeating each row, as num_return_sequences "
                             f"and beams do). {START_OVER}")
        if N <= held:
            raise ValueError(f"{what} a prompt of {N} tokens, but this ProxyKVCache already holds {held} tokens of a "
                             f"conversation: a prompt on a used cache must continue it (start with those {held} "
                             f"tokens, then add new ones). {START_OVER}")
        factor = prompt.shape[0] // B
        expected = ids if factor == 1 else ids.repeat_interleave(factor, dim=0)
        head = prompt[:, :held].to(expected.device)
        if not torch.equal(head, expected):
            row, pos = (head != expected).nonzero()[0].tolist()
            raise ValueError(f"{what} a prompt that does not continue the conversation this ProxyKVCache holds: row "
                             f"{row} is different at token {pos} (the cache holds {held} tokens: its compressed "
                             f"prompt and what was appended since). {START_OVER}")
        return factor


def check_fed(prompt: torch.Tensor | None, length: int, ids: torch.Tensor | None, held: int) -> None:
    """The first forward of a ``generate`` call on a cache holding ``held`` tokens must feed the call's ``prompt``
    `(B, length)` tokens after those (it may feed candidates beyond the prompt's end); ``ids``: what it feeds."""
    m = 0 if ids is None or prompt is None else min(ids.shape[-1], length - held)
    want = None if m <= 0 or held == 0 else prompt[:, held:held + m]
    if want is not None and not torch.equal(ids[:, :m].to(want.device), want):
        raise ValueError(f"generate() fed this ProxyKVCache other tokens than those of its prompt after the {held} "
                         f"the cache holds (transformers releases before 5.23 feed the whole prompt again when a "
                         f"continued conversation is prefilled in chunks: drop prefill_chunk_size there). "
                         f"{START_OVER}")


def check_prompt_forward(prompt: torch.Tensor | None, length: int, ids: torch.Tensor | None, held: int, n: int) -> None:
    """A forward of the prompt being compressed (``prompt`` `(B, length)`, of which ``held`` tokens are in) must feed
    its next ``n`` tokens (``ids``, when known), and not run past its end."""
    if held + n > length:
        raise ValueError(f"this forward feeds {n} tokens on top of {held}, past the end of the prompt being "
                         f"compressed ({length} tokens): feed the prompt alone first (a cache compresses the "
                         f"prompt it was given, then keeps later tokens in full). {START_OVER}")
    if ids is not None and prompt is not None and not torch.equal(ids.to(prompt.device), prompt[:, held:held + n]):
        raise ValueError(f"this forward feeds other tokens than positions {held}-{held + n - 1} of the prompt "
                         f"being compressed (given to prepare() or generate()). {START_OVER}")
