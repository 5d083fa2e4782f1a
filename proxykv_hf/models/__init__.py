"""Models: loading targets and proxies by name (:mod:`.loading`), the packaged GGUF parts (:mod:`.parts`), the model
cache they are converted into once (:mod:`.model_cache`), what identifies a model and a tokenizer
(:mod:`.fingerprints`) and facts about a model's layers (:mod:`.layout`)."""

from .loading import load_model, load_model_and_tokenizer, load_tokenizer, model_summary, native_bf16, resolve_dtype
from .model_cache import CACHE_ENV, DEFAULT_MODEL, cache_root, convert_packaged, packaged_model_dir

__all__ = ["CACHE_ENV", "DEFAULT_MODEL", "cache_root", "convert_packaged", "load_model", "load_model_and_tokenizer",
           "load_tokenizer", "model_summary", "native_bf16", "packaged_model_dir", "resolve_dtype"]
