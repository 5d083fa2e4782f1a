"""Loading targets and proxies by name: the bundled SmolLM2-135M-Instruct default, the packaged Qwen2.5-Coder
pair, a local directory or a Hub id. The shipped models are read from the model cache
(:mod:`proxykv_hf.models.model_cache`),
which converts each GGUF file once::

    model, tok = load_model_and_tokenizer()                       # bundled default
    model = load_model("qwen2.5-coder-1.5b-instruct")               # packaged (proxykv install-models)
    model = load_model("HuggingFaceTB/SmolLM2-360M-Instruct")       # a Hub id (honours HF_HUB_OFFLINE)
    model = load_model("/path/to/checkpoint_dir")                   # a local directory
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .model_cache import (CACHE_ENV, DEFAULT_MODEL, bundled_gguf_path, bundled_model_dir, cache_root, convert_packaged,
                          packaged_model_dir)

logger = logging.getLogger(__name__)


def native_bf16() -> bool:
    """True where ``/proc/cpuinfo`` lists ``amx_bf16`` or ``avx512_bf16`` (bfloat16 matrix instructions)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype, name_or_path: str | os.PathLike = DEFAULT_MODEL,
                  device: str | torch.device = "cpu") -> torch.dtype:
    """A torch dtype for ``dtype``; ``"auto"`` is bfloat16 for the packaged Qwen pair where the device computes it
    natively (a CUDA GPU, or a CPU with AMX-BF16 / AVX512-BF16) and float32 otherwise (and for every other model).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        named = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if dtype not in named:
            raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
        return named[dtype]
    from .parts import PackagedModel

    if str(name_or_path).lower() not in PackagedModel.names():
        return torch.float32
    on_cuda = torch.device(device).type == "cuda"
    return torch.bfloat16 if on_cuda or native_bf16() else torch.float32


def load_model(name_or_path: str | os.PathLike = DEFAULT_MODEL, *, dtype: torch.dtype | str = "auto",
               device: str | torch.device = "cpu", attn_implementation: str = "sdpa", revision: str | None = None,
               **kwargs: Any) -> PreTrainedModel:
    """Load a causal LM in eval mode.

    Args:
        name_or_path: :data:`DEFAULT_MODEL` (the bundled SmolLM2), a packaged model
            (``"qwen2.5-coder-1.5b-instruct"``, ``"qwen2.5-coder-0.5b-instruct"``), a local directory, a ``.gguf``
            file, or a Hub id.
        dtype: parameter dtype, or ``"auto"`` (:func:`resolve_dtype`: bfloat16 for the packaged pair on hardware
            with native bf16, else float32).
        device: where to put the model.
        attn_implementation: e.g. ``"sdpa"`` or ``"eager"``.
        revision: a Hub revision (branch, tag, commit); only for Hub ids.
        **kwargs: passed on to ``AutoModelForCausalLM.from_pretrained``.

    Returns:
        The model, in eval mode, on ``device``.

    Raises:
        ValueError: no model named (``name_or_path`` None or empty).
        MissingModelPackage, ModelCacheError: a shipped model's package is missing, its files are damaged, or the
            model cache cannot be written (:mod:`proxykv_hf.models.model_cache`); ``ValueError`` subclasses as well.
    """
    dtype = resolve_dtype(dtype, name_or_path, device)
    path, gguf_file, bundled = _resolve(name_or_path, revision)
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    if revision is not None:
        kwargs["revision"] = revision
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                                 **kwargs)
    if bundled:
        model.name_or_path = bundled
        model.config.name_or_path = bundled
    return model.to(device).eval()


def load_tokenizer(name_or_path: str | os.PathLike = DEFAULT_MODEL, *, revision: str | None = None,
                   **kwargs: Any) -> PreTrainedTokenizerBase:
    """Load a tokenizer with ``padding_side="left"`` and a pad token (the eos token when the model has none).

    Args:
        name_or_path: as for :func:`load_model`.
        revision: a Hub revision; only for Hub ids.
        **kwargs: passed on to ``AutoTokenizer.from_pretrained``.
    """
    path, gguf_file, bundled = _resolve(name_or_path, revision)
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    if revision is not None:
        kwargs["revision"] = revision
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            logger.warning("tokenizer of %s has neither a pad nor an eos token; batches cannot be padded",
                           name_or_path)
        else:
            tokenizer.pad_token = tokenizer.eos_token
    if bundled:
        tokenizer.name_or_path = bundled
    return tokenizer


def load_model_and_tokenizer(name_or_path: str | os.PathLike = DEFAULT_MODEL, *, dtype: torch.dtype | str = "auto",
                             device: str | torch.device = "cpu", attn_implementation: str = "sdpa",
                             revision: str | None = None,
                             **kwargs: Any) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """:func:`load_model` and :func:`load_tokenizer` together; the model's generation pad id follows the tokenizer."""
    model = load_model(name_or_path, dtype=dtype, device=device, attn_implementation=attn_implementation,
                       revision=revision, **kwargs)
    tokenizer = load_tokenizer(name_or_path, revision=revision)
    if model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def model_summary(model: PreTrainedModel) -> dict[str, Any]:
    """The architecture facts that checkpoints and reports record.

    Returns:
        ``{"model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "name_or_path"}`` read from the (text) config.
    """
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return {
        "model_type": config.model_type,
        "num_hidden_layers": int(text.num_hidden_layers),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "name_or_path": str(getattr(model, "name_or_path", "") or config.name_or_path),
    }


# ----------------------------------------------------------------------------------------------------------------
# internals


def _resolve(name_or_path: str | os.PathLike, revision: str | None) -> tuple[str, str | None, str | None]:
    """``(path or hub id, gguf file name or None, the bundled or packaged model's name or None)``."""
    from .parts import PackagedModel

    if name_or_path is None or not str(name_or_path).strip():  # str(None) would be looked up on the Hub as "None"
        raise ValueError(f"no model given: name_or_path must be a model name, a directory, a .gguf file or a Hub "
                         f"id, got {name_or_path!r}")
    name = str(name_or_path)
    lowered = name.lower()
    if lowered == DEFAULT_MODEL or lowered in PackagedModel.names():
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hub ids only, not to the bundled {lowered!r}; "
                             f"drop it")
        path = bundled_model_dir() if lowered == DEFAULT_MODEL else packaged_model_dir(lowered)
        return str(path), None, lowered
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), path.name, None
    if path.is_dir():
        return str(path), None, None
    return name, None, None  # a Hub id; from_pretrained raises OSError when it cannot be found
