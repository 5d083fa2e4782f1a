"""ProxyKVLayer: one full-attention cache layer that is compacted once, keeping its logical length.

A layer has a **logical** length (tokens processed: what positions, masks and ``generate`` see) and a **physical**
length (entries stored). ``get_mask_sizes`` returns ``(physical + q, logical - physical)`` so that the shared mask
addresses the compacted slots. Given its scores, a layer keeps its own Top-K per KV head (:meth:`ProxyKVLayer.keep`);
after :meth:`ProxyKVLayer.compact` it holds, per KV head, the kept prompt
entries in position order, then every later token. In a padded batch each row keeps its own budget; a shorter row's
spare slots are hidden from attention by :meth:`ProxyKVLayer.mask_spare_slots`.

Under a global budget (:meth:`ProxyKVLayer.compact_ragged`) each (row, KV head) keeps its own number of prompt
entries. The layer then stores them **packed**: ``keys`` and ``values`` are `(1, 1, N, D)`, the entries of every row
and head one after the other, sorted by ``owner`` (``b * H_kv + h``, one segment each), then by ``position`` (logical
index). Nothing is padded, so the memory held is exactly the entries kept. The tokens after the prompt are the same
for every head: they go to ``tail_keys`` / ``tail_values`` `(B, H_kv, t, D)`, written into spare room as the uniform
layout's (a decode step copies only the new entries). :meth:`ProxyKVLayer.ragged_attention` computes each query
head's attention over its own KV head's segment and the tail, in one softmax. A saved context stores the tail inside
the segments (:meth:`ProxyKVLayer.saved_tensors`), as the format always has.

For every forward after its compaction the cache hands the attention wrapper (:mod:`proxykv_hf.attention`) the
layer's :class:`SpareSlots` (hide a padded batch's spare slots) or :class:`RaggedAttention` (the packed layer's own
attention in place of the model's).
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import DynamicLayer

from .selection import select_topk

INDEX_DTYPE = torch.int32
"""The dtype of the global budget's packed ``owner`` and ``position`` indices (4 bytes each per stored entry)."""
LAYER_TENSORS = ("keys", "values", "kept_positions", "budgets", "slot_valid", "owner", "position")
"""The tensors a saved context holds of a layer (:meth:`ProxyKVLayer.saved_tensors`)."""


class ProxyKVLayer(DynamicLayer):
    """A full-attention cache layer that can be compacted once, keeping its logical length.

    Attributes:
        kept_positions: `(B, H_kv, K)` prompt positions of the kept entries, after compaction (None: all kept).
        budgets: `(B,)` entries each row keeps per KV head (on the CPU), after compaction.
        slot_valid: `(B, K)` False on the spare slots of rows with a smaller budget; None when every row fills K.
        compacted_at: logical length when compacted; :meth:`crop` may not go below it.
    """

    is_croppable = True
    ROOM = 128
    """Entries of spare room a compacted layer's buffer gets for the tokens appended after the prompt, at most the
    entries compaction freed (so that a compressed layer never holds more than the full one would)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._clear()

    def _clear(self) -> None:
        self.cumulative_length = 0
        self.kept_positions: torch.Tensor | None = None
        self.budgets: torch.Tensor | None = None
        self.slot_valid: torch.Tensor | None = None
        self.compacted = False
        self.compacted_at = 0
        self.ragged = False
        self.owner: torch.Tensor | None = None  # ragged: (N,) b * H_kv + h of each stored entry
        self.position: torch.Tensor | None = None  # ragged: (N,) logical index of each stored entry
        self.n_kv_heads = 0
        self._counts: torch.Tensor | None = None  # ragged: (B * H_kv,) entries per segment, on the CPU (None: count)
        self.freed = 0  # entries per row and head that compaction dropped (the spare room's ceiling)
        self._room: _Room | None = None  # compacted: the buffer that keys / values (ragged: the tail) view
        self.tail_keys: torch.Tensor | None = None  # ragged: (B, H_kv, t, D) the tokens after the prompt
        self.tail_values: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.ragged:
            return self._append_ragged(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        if not self.compacted:
            return super().update(key_states, value_states, *args, **kwargs)
        self.keys, self.values = self._into_room(self.keys, self.values, key_states, value_states)
        return self.keys, self.values

    def _into_room(self, keys, values, key_states, value_states) -> tuple[torch.Tensor, torch.Tensor]:
        """``keys`` / ``values`` `(B, H_kv, T, D)` with the new states after them (the tokens after the compressed
        prompt): views of the filled part of a buffer with room at its end (:class:`_Room`), so that a decode step
        copies only the new entries (a plain ``DynamicLayer`` copies the whole layer every step).

        The buffer is written in place only by the layer whose view ends where the buffer's filled part ends; a copy
        sharing it (a snapshot restored, a ``compacted_copy`` twin, a crop) finds another end and moves to a buffer
        of its own, so that appends never change what another holder sees. The room is at most what compaction freed
        (``freed``): the buffer never holds more entries than a full layer would."""
        n, T = key_states.shape[-2], keys.shape[-2]
        room = self._room
        if room is None or room.fill != T or T + n > room.keys.shape[-2] or \
                room.keys.data_ptr() != keys.data_ptr() or room.keys.shape[:2] != keys.shape[:2]:
            room = self._room = _Room(keys, values, extra=max(n, min(max(2 * n, self.ROOM), self.freed)))
        room.keys[:, :, T:T + n].copy_(key_states)
        room.values[:, :, T:T + n].copy_(value_states)
        room.fill = T + n
        return room.keys[:, :, :T + n], room.values[:, :, :T + n]

    def compact(self, indices: torch.Tensor | None, *, budgets: torch.Tensor | None = None,
                slot_valid: torch.Tensor | None = None) -> None:
        """Keep the entries at ``indices`` `(B, H_kv, K)` (None: keep all) and free the others.

        Args:
            indices: positions to keep, sorted per row and head.
            budgets: `(B,)` entries each row really keeps (``<= K``).
            slot_valid: `(B, K)` False on a row's spare slots (where ``budgets < K``); None when every row fills K.
        """
        if indices is not None:
            idx = indices[..., None].expand(-1, -1, -1, self.keys.shape[-1])  # (B, H_kv, K, D)
            self.freed = self.keys.shape[-2] - indices.shape[-1]
            self.keys = self.keys.gather(2, idx.to(self.keys.device))
            self.values = self.values.gather(2, idx.to(self.values.device))
        self.kept_positions, self.budgets = indices, budgets
        self.slot_valid = slot_valid
        self.compacted = True
        self.compacted_at = self.cumulative_length

    def keep(self, scores: torch.Tensor, budgets: torch.Tensor, valid: torch.Tensor, *, keep_ratio: float,
             n_sink: int = 0, n_recent: int = 0) -> None:
        """Keep, per row and KV head, the top ``budgets[b]`` prompt entries under ``scores`` `(B, H_kv, T)`
        (:func:`~proxykv_hf.cache.selection.select_topk`: protected tokens first, padding never) and free the others.

        Args:
            scores: higher means keep.
            budgets: `(B,)` entries each row keeps per KV head, on the CPU.
            valid: `(B, T)` True on real tokens.
            keep_ratio, n_sink, n_recent: as for ``select_topk``.
        """
        indices, slot_valid = select_topk(scores, keep_ratio, valid.to(scores.device), n_sink, n_recent, k_row=budgets)
        uneven = bool((budgets < budgets.max()).any())  # on the CPU: no device sync
        self.compact(indices, budgets=budgets, slot_valid=slot_valid if uneven else None)

    def compact_ragged(self, keep: torch.Tensor) -> None:
        """Keep, per row and KV head, the prompt entries where ``keep`` `(B, H_kv, T)` is True (any number per head),
        packed (see the module docstring), and free the others."""
        B, H, T = keep.shape
        b, h, t = keep.nonzero(as_tuple=True)  # row-major: row, then head, then position
        device = self.keys.device
        b, h, t = b.to(device), h.to(device), t.to(device)
        self.tail_keys, self.tail_values = self.keys.new_empty(B, H, 0, self.keys.shape[-1]), \
            self.values.new_empty(B, H, 0, self.values.shape[-1])  # the tokens after the prompt: none yet
        self.keys = self.keys[b, h, t][None, None]  # (1, 1, N, D)
        self.values = self.values[b, h, t][None, None]
        # (N,) int32 each, owning their storage: 8 bytes per kept entry, as the uniform layout's int64 kept_positions
        self.owner, self.position, self.n_kv_heads = (b * H + h).to(INDEX_DTYPE), t.to(INDEX_DTYPE), H
        self.ragged, self.compacted, self.compacted_at = True, True, self.cumulative_length
        self.kept_positions = self.slot_valid = None
        self.budgets = keep.sum(-1).cpu()  # (B, H_kv) entries kept per head
        self._counts = self.budgets.flatten()
        self.freed = T - int(self._counts.sum()) // (B * H)  # per head, on average: the tail's room

    def segment_counts(self) -> torch.Tensor:
        """Packed layout: `(B * H_kv,)` prompt entries in each (row, KV head)'s segment, on the CPU (known without a
        device sync after compaction; counted once after a load, where the layout is put in order first)."""
        self._split_tail()
        if getattr(self, "_counts", None) is None:
            self._counts = torch.bincount(self.owner.long(), minlength=self.budgets.numel()).cpu()
        return self._counts

    def _split_tail(self) -> None:
        """A packed layer as a saved context (or an older release) holds it, the later tokens inside the segments,
        maybe out of order: sorted by owner, then position, and the later tokens moved to the tail (once: a layer
        with a tail is left as it is)."""
        if getattr(self, "tail_keys", None) is not None:
            return
        key = self.owner.long() * (self.cumulative_length + 1) + self.position.long()
        if bool((key[1:] < key[:-1]).any()):
            order = torch.argsort(key)
            self.keys, self.values = self.keys[:, :, order], self.values[:, :, order]
            self.owner, self.position = self.owner[order], self.position[order]
        B, H, t = self.budgets.shape[0], self.n_kv_heads, self.cumulative_length - self.compacted_at
        later = self.position >= self.compacted_at
        owners = self.owner[later].long()
        if owners.numel() != B * H * t or not torch.equal(owners, torch.arange(B * H).repeat_interleave(t).to(owners)):
            raise ValueError(f"a packed layer must hold each of its {t} later tokens once per (row, KV head)")
        self.tail_keys = self.keys[0, 0, later].view(B, H, t, self.keys.shape[-1])
        self.tail_values = self.values[0, 0, later].view(B, H, t, self.values.shape[-1])
        if t:
            prompt = ~later
            self.keys, self.values = self.keys[:, :, prompt], self.values[:, :, prompt]
            self.owner, self.position = self.owner[prompt], self.position[prompt]
        self._counts = None

    def saved_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors a saved context stores (:data:`LAYER_TENSORS`, those that are set); a packed layer's
        tail goes at the end of each segment, so that the file holds one packed `(1, 1, N, D)` layout."""
        sizes = self.segment_counts().tolist() if self.ragged else None  # the layout in order first
        found = {name: getattr(self, name) for name in LAYER_TENSORS if getattr(self, name) is not None}
        if sizes is not None and self.tail_keys.shape[2]:
            B, H, t, _ = self.tail_keys.shape
            at = torch.arange(t, device=self.keys.device, dtype=INDEX_DTYPE)
            owner = torch.arange(B * H, device=at.device, dtype=INDEX_DTYPE)[:, None].expand(-1, t)
            found["keys"] = _interleave(self.keys[0, 0], self.tail_keys.flatten(0, 1), sizes)[None, None]
            found["values"] = _interleave(self.values[0, 0], self.tail_values.flatten(0, 1), sizes)[None, None]
            found["owner"] = _interleave(self.owner, owner, sizes)
            found["position"] = _interleave(self.position, (self.compacted_at + at).expand(B * H, t), sizes)
        return found

    def _append_ragged(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """The ``q`` new tokens of every row and head, at the end of the tail (in its spare room)."""
        self._split_tail()
        self.tail_keys, self.tail_values = self._into_room(self.tail_keys, self.tail_values, key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        return self.keys, self.values

    def ragged_attention(self, query: torch.Tensor, scaling: float, *, weights: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of ``query`` `(B, H, Q, D)` (the last ``Q`` positions) over each head's own packed entries and
        the tail, causal by position: the output `(B, H, Q, D)` and, with ``weights``, the attention probabilities
        over the logical positions `(B, H, Q, L)` (0 at the dropped ones), as eager attention returns them."""
        B, Hq, Q, D = query.shape
        H = self.n_kv_heads
        G = Hq // H
        counts = self.segment_counts().tolist()
        q = query.reshape(B, H, G * Q, D)  # a KV head's query heads, each with its Q queries
        t = self.tail_keys.shape[2]
        tail = torch.matmul(q, self.tail_keys.transpose(-1, -2)).float() * scaling  # (B, H_kv, G*Q, t)
        if Q > 1:  # the tail's last Q entries are the queries' own tokens: causal among them
            ahead = torch.arange(t, device=query.device)[None, :] > torch.arange(t - Q, t, device=query.device)[:, None]
            tail = tail.masked_fill(ahead.repeat(G, 1), -math.inf)
        if not weights:
            return self._segment_attention(q, tail, counts, scaling).view(B, Hq, Q, -1), None
        mine = self.owner.view(1, 1, 1, -1) == torch.arange(B * H, device=query.device).view(B, H, 1, 1)
        packed = torch.matmul(q, self.keys[0, 0].transpose(0, 1)).float() * scaling  # (B, H_kv, G*Q, N)
        probs = torch.cat([packed.masked_fill(~mine, -math.inf), tail], -1).softmax(-1).to(self.values.dtype)
        N = packed.shape[-1]
        out = torch.matmul(probs[..., :N], self.values[0, 0]) + torch.matmul(probs[..., N:], self.tail_values)
        logical = probs.new_zeros(B, H, G * Q, self.cumulative_length)
        logical.scatter_add_(-1, self.position.long().expand(B, H, G * Q, -1), probs[..., :N])
        logical[..., self.compacted_at:] = probs[..., N:]
        return out.view(B, Hq, Q, -1), logical.view(B, Hq, Q, -1)

    def _segment_attention(self, q: torch.Tensor, tail: torch.Tensor, counts: list[int], scaling: float
                           ) -> torch.Tensor:
        """:meth:`ragged_attention`'s output `(B, H_kv, G*Q, D)` from ``q`` `(B, H_kv, G*Q, D)` and the tail's
        logits: one softmax per (row, KV head) over its own segment (a view) and the tail."""
        B, H = q.shape[:2]
        out = q.new_empty(B, H, q.shape[2], self.values.shape[-1])
        start = 0
        for o, n in enumerate(counts):
            b, h = divmod(o, H)
            keys, values = self.keys[0, 0, start:start + n], self.values[0, 0, start:start + n]  # (n, D)
            logits = torch.cat([(q[b, h] @ keys.T).float() * scaling, tail[b, h]], -1)
            probs = logits.softmax(-1).to(values.dtype)
            out[b, h] = probs[:, :n] @ values + probs[:, n:] @ self.tail_values[b, h]
            start += n
        return out

    def kept_sets(self) -> list[list[torch.Tensor]]:
        """The prompt positions each row keeps per KV head: ``[b][h]`` sorted 1-D tensors."""
        if self.ragged:
            starts = [0] + torch.cumsum(self.segment_counts(), 0).tolist()
            H = self.n_kv_heads
            return [[self.position[starts[b * H + h]:starts[b * H + h + 1]] for h in range(H)]
                    for b in range(self.budgets.shape[0])]
        if self.kept_positions is None:
            B, H = self.keys.shape[:2]
            return [[torch.arange(self.compacted_at, device=self.keys.device) for _ in range(H)] for _ in range(B)]
        B, H, K = self.kept_positions.shape
        return [[self.kept_positions[b, h, K - int(self.budgets[b]):] if self.budgets is not None else
                 self.kept_positions[b, h] for h in range(H)] for b in range(B)]

    def held_entries(self) -> int:
        """K/V entries stored, summed over rows and heads."""
        if not self.is_initialized or self.keys is None:
            return 0
        if self.ragged:
            self._split_tail()
            return self.keys.shape[-2] + self.tail_keys[..., 0].numel()
        return self.keys.shape[0] * self.keys.shape[1] * self.keys.shape[2]

    @property
    def physical_length(self) -> int:
        return 0 if not self.is_initialized or self.keys.numel() == 0 else self.keys.shape[-2]

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.ragged:  # ragged_attention builds its own mask; the shared one need only cover the new tokens
            return query_length, self.cumulative_length
        physical = self.physical_length
        return physical + query_length, self.cumulative_length - physical

    def mask_spare_slots(self, attention_mask: torch.Tensor | None, q_len: int, kv_len: int) -> torch.Tensor | None:
        """``attention_mask`` with this layer's spare slots hidden (unchanged when it has none).

        Args:
            attention_mask: the forward's mask over the ``kv_len`` stored entries (bool, additive float, or None for
                plain causal attention over the new tokens).
            q_len, kv_len: queries of the forward and entries the attention reads.
        """
        if self.slot_valid is None:
            return attention_mask
        B, k = self.slot_valid.shape
        device = self.slot_valid.device if attention_mask is None else attention_mask.device
        visible = torch.ones(B, 1, 1, kv_len, dtype=torch.bool, device=device)
        visible[:, 0, 0, :k] = self.slot_valid.to(device)
        if attention_mask is None:  # causal over the new tokens, every compacted slot visible
            new = kv_len - k
            causal = torch.arange(new, device=device)[None, :] <= torch.arange(q_len, device=device)[:, None] + (
                new - q_len)
            full = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
            full[:, k:] = causal
            return full[None, None] & visible
        if attention_mask.dtype == torch.bool:
            return attention_mask & visible
        return attention_mask.masked_fill(~visible, torch.finfo(attention_mask.dtype).min)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        n = abs(tokens_to_remove) if tokens_to_remove < 0 else self.cumulative_length - tokens_to_remove
        if self.compacted and self.cumulative_length - n < self.compacted_at:
            raise ValueError(f"cannot crop {n} tokens: only the {self.cumulative_length - self.compacted_at} "
                             "tokens added after the compressed prompt can be removed")
        if self.ragged:
            self._split_tail()
            t = self.tail_keys.shape[2] - n  # the tail loses its last n entries
            self.tail_keys, self.tail_values = self.tail_keys[:, :, :t], self.tail_values[:, :, :t]
        else:
            super().crop(-n)
        self.cumulative_length -= n

    def reset(self) -> None:
        super().reset()
        self._clear()

    def _select_batch(self, fn) -> None:
        for name in ("kept_positions", "budgets", "slot_valid"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, fn(value))

    def _ragged_rows(self, rows: torch.Tensor) -> None:
        """Ragged layout: new row ``r`` holds old row ``rows[r]``'s entries."""
        self.segment_counts()  # counted before the rows move
        picked = rows.to(self.keys.device)
        self.tail_keys, self.tail_values = self.tail_keys[picked], self.tail_values[picked]
        H, old = self.n_kv_heads, self.owner // self.n_kv_heads
        picks = [torch.nonzero(old == int(src)).flatten() for src in rows.tolist()]
        index = torch.cat(picks)
        new_row = torch.cat([torch.full_like(p, r) for r, p in enumerate(picks)]).to(self.owner.dtype)
        self.keys, self.values = self.keys[:, :, index], self.values[:, :, index]
        self.owner, self.position = new_row * H + self.owner[index] % H, self.position[index]
        self._counts = self._counts.view(-1, H)[rows.cpu()].flatten()
        self.budgets = self.budgets[rows.cpu()]

    def _batch_op(self, rows: torch.Tensor, dense) -> None:
        if self.ragged:
            self._ragged_rows(rows)
            return
        dense()
        self._select_batch(lambda t: t[rows.to(t.device)])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._batch_op(beam_idx, lambda: DynamicLayer.reorder_cache(self, beam_idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows = torch.arange(self._batch_size()).repeat_interleave(repeats)
        self._batch_op(rows, lambda: DynamicLayer.batch_repeat_interleave(self, repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        rows = torch.arange(self._batch_size())[indices.cpu()]
        self._batch_op(rows, lambda: DynamicLayer.batch_select_indices(self, indices))

    def _batch_size(self) -> int:
        return self.budgets.shape[0] if self.ragged else self.keys.shape[0]


class _Room:
    """A compacted layer's K/V buffer with room at the end: ``keys`` / ``values`` `(B, H_kv, T + extra, D)`, the
    first ``fill`` entries in use."""

    __slots__ = ("keys", "values", "fill")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, *, extra: int):
        B, H, T, D = keys.shape
        self.keys = keys.new_empty(B, H, T + extra, D)
        self.values = values.new_empty(B, H, T + extra, values.shape[-1])
        self.keys[:, :, :T].copy_(keys)
        self.values[:, :, :T].copy_(values)
        self.fill = T


def _interleave(packed: torch.Tensor, new: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """``packed`` `(N, ...)`, segments of ``sizes`` entries, with ``new[o]`` `(q, ...)` at the end of segment ``o``:
    one concatenation."""
    return torch.cat([piece for segment_and_tail in zip(packed.split(sizes), new) for piece in segment_and_tail])


def held_bytes(layers) -> int:
    """Bytes of memory the cache ``layers`` hold: the whole storage of every tensor they hold (their attributes, and
    the buffers of their spare room), each storage counted once (a view and the tensor it views share one)."""
    seen, total = set(), 0
    for layer in layers:
        for value in vars(layer).values():
            for t in (value.keys, value.values) if isinstance(value, _Room) else (value,):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    key = (t.device, t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                    total += key[2] if key not in seen else 0
                    seen.add(key)
    return total


# --- what the cache hands the attention wrapper (attention.py) for the forwards over a compacted layer ---


class SpareSlots:
    """Hand-off for a later forward over a compacted layer whose shorter rows have spare slots: hides them."""

    __slots__ = ("layer",)

    def __init__(self, layer):
        self.layer = layer

    def before(self, module, attention_mask, query, key):
        return self.layer.mask_spare_slots(attention_mask, query.shape[2], key.shape[2])

    def attend(self, module, query, key, value, scaling):
        return None

    def after(self, module, query, key, value, attention_mask, scaling):
        pass


class RaggedAttention:
    """Hand-off for every forward over a layer compacted under the global budget: the attention of each query head
    over its own KV head's packed entries (:meth:`~proxykv_hf.cache.layer.ProxyKVLayer.ragged_attention`), in place of
    the model's."""

    __slots__ = ("layer",)

    def __init__(self, layer):
        self.layer = layer

    def before(self, module, attention_mask, query, key):
        return attention_mask

    def replace(self, module, query, key, value, scaling, *, weights: bool = False):
        return self.layer.ragged_attention(query, scaling, weights=weights)

    def after(self, module, query, key, value, attention_mask, scaling):
        pass
