"""Attention, as a ProxyKV cache sees it: the registered attention function that hands each layer's queries to the
cache (:mod:`.wrapper`), attention probabilities summed over queries without an N x N matrix (:mod:`.statistics`,
its PyTorch path :mod:`.statistics_torch` and the Triton kernels :mod:`.kernels`), and the one place where
transformers releases differ (:mod:`.compat`)."""
