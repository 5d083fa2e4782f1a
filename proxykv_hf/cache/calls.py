"""Which ``generate`` call a cache's forwards belong to (:class:`CallTracker`).

transformers' ``generate`` announces each call to a cache it is given (it sets ``cache._is_user_defined`` once per
call, before any forward), and a candidate-verifying decoder announces its first verification forward
(``activate_past_recording``). The cache keeps the setter on that private flag because no public seam of
``generate`` reaches a user's cache before the call's first forward, and only then is the call's whole prompt (before
chunking, candidates or a continued conversation's cut) to be seen. A :class:`~proxykv_hf.cache.ProxyKVCache` hands
both announcements, and the start of every forward, to its tracker, which looks the announced call up in the calling
frames once (:func:`~proxykv_hf.cache.prompt.running_forward`), hooks the call's model so that every forward's
inputs reach the cache (:class:`~proxykv_hf.cache.prompt.ForwardHooks`), has the cache check the call's prompt
(``cache._check_call``), and checks that the first forward of a call feeds that prompt
(:func:`~proxykv_hf.cache.conversation.check_fed`). The tracker is per call: never copied, pickled or snapshotted
with the cache.
"""

from __future__ import annotations

import torch

from . import candidates
from .conversation import START_OVER, check_fed
from .prompt import Forward, ForwardHooks, GenerateCall, running_forward


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
    """The ``generate`` call a cache is in, and the forwards it sees (:class:`~proxykv_hf.cache.prompt.ForwardHooks`).

    Attributes:
        hooks: the hooks that hand the cache each forward's inputs.
        call: the ``generate`` call last announced (its prompt), or None.
        new_call: ``generate`` announced a call whose prompt was not ready yet: look it up at its first forward.
        first_forward: the next forward is the first of the call.
        split: the :class:`~proxykv_hf.cache.candidates.FirstVerification` armed for the call, while it is.
    """

    def __init__(self, cache):
        self.hooks = ForwardHooks(cache)
        self.call: GenerateCall | None = None
        self.new_call = False
        self.first_forward = False
        self.split: candidates.FirstVerification | None = None
        self._looked = False  # the frames were read for a forward that no hook saw

    def watch(self, model) -> None:
        """Hand the cache the inputs of ``model``'s forwards from now on."""
        self.hooks.watch(model)

    def close(self) -> None:
        """The cache was reset: remove the hooks and the armed split."""
        self.hooks.close()
        if self.split is not None:
            self.split.remove()

    def forget(self) -> None:
        """After the cache was restored to a snapshot: no forward has run in the call it was in."""
        self.first_forward = False

    def generate_started(self, cache) -> None:
        """``generate`` set ``cache._is_user_defined``: once per call, before any forward and once its prompt is
        ready. The one frame read of the call finds its prompt, which is checked here (a prompt that cannot run
        fails before the cache ever sees a forward), and its model, whose forwards are hooked."""
        self.new_call = False
        _, call = running_forward(3)
        if call is None:
            self.new_call = True  # the prompt is not ready yet (an older release): look again at the first forward
            return
        self._enter(cache, call, cache._held())

    def forward_started(self, cache, n: int) -> tuple[Forward | None, torch.Tensor | None, int]:
        """At the first layer of every forward (``n`` new tokens): the forward's inputs, from the hooks (from the
        frames only for a call whose prompt was not ready when it was announced, or for a forward that no hook saw
        while the cache knows no model); the first forward of a call must feed its prompt.

        Returns:
            The running forward (None outside a transformers model), the ``(B, n)`` ids it feeds (None when
            unknown) and the tokens the cache holds before them.
        """
        forward, call = self.hooks.current, None
        if self.new_call or (forward is None and (cache.prompt is None or not self._looked)):
            self._looked = True
            found, call = running_forward(4)
            forward = forward or found
            if found is not None:
                self.watch(found.model)
        ids = forward.input_ids if forward is not None else None
        ids = ids if ids is not None and ids.dim() == 2 and ids.shape[-1] == n else None
        held = cache._held()
        if self.new_call:
            self.new_call = False
            if call is not None:
                self._enter(cache, call, held)
                held = cache.get_seq_length()
        if self.first_forward:
            self.first_forward = False
            check_fed(self.call.input_ids, self.call.length, ids, held)
        return forward, ids, held

    def verification_started(self, cache) -> None:
        """``activate_past_recording``: candidate-verifying decoding follows; before the call's first forward, arm the
        split of that forward."""
        if self.new_call:
            self.new_call = False
            _, call = running_forward(3)
            if call is not None:
                self._enter(cache, call, cache._held())
        if self.first_forward:
            self.split = candidates.FirstVerification.arm(cache, self.call)

    def _enter(self, cache, call: GenerateCall, held: int) -> None:
        self.call = call
        self.watch(call.model)
        cache._check_call(call, held)
        self.first_forward = True
