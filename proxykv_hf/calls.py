"""Which ``generate`` call a cache's forwards belong to (:class:`CallTracker`).

transformers' ``generate`` announces each call to a cache it is given (it sets ``cache._is_user_defined`` once per
call, before any forward), and a candidate-verifying decoder announces its first verification forward
(``activate_past_recording``). A :class:`~proxykv_hf.cache.ProxyKVCache` hands both, and the start of every forward,
to its tracker, which finds the running call in the calling frames (:func:`~proxykv_hf.prompt.running_forward`),
has the cache check a new call's prompt once (``cache._check_call``), and checks that the first forward of a call
feeds that prompt (:func:`~proxykv_hf.conversation.check_fed`). The tracker is per call: never copied, pickled or
snapshotted with the cache.
"""

from __future__ import annotations

import torch

from . import candidates
from .conversation import START_OVER, check_fed
from .prompt import Forward, GenerateCall, running_forward


def check_prepared_call(prepared: torch.Tensor | None, call: GenerateCall) -> None:
    """A ``generate`` call on a cache whose first prompt ``prepare()`` named (its ``(B, T)`` ids; None for
    ``inputs_embeds``) must be given that prompt.

    Raises:
        ValueError: other tokens, saying which.
    """
    if prepared is not None and (call.input_ids is None or call.input_ids.shape != prepared.shape
                                 or not torch.equal(call.input_ids.to(prepared.device), prepared)):
        got = "inputs_embeds" if call.input_ids is None else f"ids of shape {tuple(call.input_ids.shape)}"
        raise ValueError(f"generate() was given other tokens than the prompt passed to prepare() (ids of shape "
                         f"{tuple(prepared.shape)}; generate got {got}). {START_OVER}")


class CallTracker:
    """The ``generate`` call a cache is in.

    Attributes:
        ids: the prompt ids of the call last checked (compared by identity: the same tensor is the same call).
        new_call: ``generate`` announced a call whose prompt was not ready yet: check it at its first forward.
        first_forward: the next forward is the first of a checked call.
        split: the :class:`~proxykv_hf.candidates.FirstVerification` armed for the call, while it is.
    """

    def __init__(self, *, new_call: bool = False):
        self.ids: torch.Tensor | None = None
        self.new_call = new_call
        self.first_forward = False
        self.split: candidates.FirstVerification | None = None

    def forget(self) -> None:
        """After the cache was restored to a snapshot: the next forward starts a call to check again."""
        self.ids, self.new_call = None, True

    def generate_started(self, cache) -> None:
        """``generate`` set ``cache._is_user_defined``: once per call, before any forward and once its prompt is
        ready. The call's prompt is checked here (a prompt that cannot run fails before the cache ever sees a
        forward), else at the call's first forward."""
        _, call = running_forward(3)
        if call is None:
            self.new_call = True
            return
        self._enter(cache, call, cache._held())

    def forward_started(self, cache, n: int) -> tuple[Forward | None, torch.Tensor | None, int]:
        """At the first layer of every forward (``n`` new tokens): check a call not checked yet, and that the
        first forward of a call feeds its prompt.

        Returns:
            The running forward (None outside a transformers model), the ``(B, n)`` ids it feeds (None when
            unknown) and the tokens the cache holds before them.
        """
        forward, call = running_forward(4)
        ids = forward.input_ids if forward is not None else None
        ids = ids if ids is not None and ids.dim() == 2 and ids.shape[-1] == n else None
        held = cache._held()
        if call is not None and (self.new_call or call.input_ids is not self.ids):
            self._enter(cache, call, held)
            held = cache.get_seq_length()
        if self.first_forward and call is not None:
            self.first_forward = False
            check_fed(call.input_ids, call.length, ids, held)
        return forward, ids, held

    def verification_started(self, cache) -> None:
        """``activate_past_recording``: candidate-verifying decoding follows; arm the split of its first forward."""
        _, call = running_forward(3)
        if call is not None:
            self.split = candidates.FirstVerification.arm(cache, call)

    def _enter(self, cache, call, held: int) -> None:
        self.new_call, self.ids = False, call.input_ids
        cache._check_call(call, held)
        self.first_forward = True
