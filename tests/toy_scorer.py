"""A scorer written the way a user would add one: one class, one registration (imported by tests/test_plugin.py as a
``--plugin``)."""

import torch

from proxykv_hf import LayerInputs, LayerScorer, register


class KeyNormScorer(LayerScorer):
    """Keeps the keys of smallest norm (a toy rule, not a method anyone should use)."""

    n_sink = 2

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        return -inputs.keys.float().norm(dim=-1)  # (B, H_kv, T)


register("toy_keynorm", lambda ctx: KeyNormScorer(), "keys of small norm (a test plug-in)", replace=True)
