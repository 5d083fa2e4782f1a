"""ProxyKVLayer: one full-attention cache layer that is compacted once, keeping its logical length.

A layer has a **logical** length (tokens processed: what positions, masks and ``generate`` see) and a **physical**
length (entries stored). ``get_mask_sizes`` returns ``(physical + q, logical - physical)`` so that the shared mask
addresses the compacted slots. After :meth:`ProxyKVLayer.compact` the layer holds, per KV head, the kept prompt
entries in position order, then every later token. In a padded batch each row keeps its own budget; a shorter row's
spare slots are hidden from attention by :meth:`ProxyKVLayer.mask_spare_slots`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class ProxyKVLayer(DynamicLayer):
    """A full-attention cache layer that can be compacted once, keeping its logical length.

    Attributes:
        kept_positions: `(B, H_kv, K)` prompt positions of the kept entries, after compaction (None: all kept).
        budgets: `(B,)` entries each row keeps per KV head (on the CPU), after compaction.
        slot_valid: `(B, K)` False on the spare slots of rows with a smaller budget; None when every row fills K.
        compacted_at: logical length when compacted; :meth:`crop` may not go below it.
    """

    is_croppable = True

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

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.cumulative_length += key_states.shape[-2]
        return super().update(key_states, value_states, *args, **kwargs)

    def compact(self, indices: torch.Tensor | None, *, budgets: torch.Tensor | None = None,
                slot_valid: torch.Tensor | None = None) -> None:
        """Keep the entries at ``indices`` `(B, H_kv, K)` (None: keep all) and free the others.

        Args:
            indices: positions to keep, sorted per row and head.
            budgets: `(B,)` entries each row really keeps (``<= K``).
            slot_valid: `(B, K)` False on a row's spare slots (where ``budgets < K``); None: all slots real.
        """
        if indices is not None:
            idx = indices[..., None].expand(-1, -1, -1, self.keys.shape[-1])  # (B, H_kv, K, D)
            self.keys = self.keys.gather(2, idx.to(self.keys.device))
            self.values = self.values.gather(2, idx.to(self.values.device))
        self.kept_positions, self.budgets = indices, budgets
        self.slot_valid = None if slot_valid is None or bool(slot_valid.all()) else slot_valid
        self.compacted = True
        self.compacted_at = self.cumulative_length

    @property
    def physical_length(self) -> int:
        return 0 if not self.is_initialized or self.keys.numel() == 0 else self.keys.shape[-2]

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
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

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._select_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._select_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._select_batch(lambda t: t[indices.to(t.device)])
