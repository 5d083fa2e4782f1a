"""Tiny random models, an in-code tokenizer and tiny random mapper checkpoints, shared by the tests, the docs and
``--tiny`` runs.

Everything here builds in well under a second on a CPU and needs no download::

    model = tiny_model("llama")
    tok = tiny_tokenizer()
    cache = ProxyKVCache(self_proxy_scorer(model), keep_ratio=0.5)
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
VOCAB_SIZE = 272  # 4 specials + 256 byte symbols, rounded up
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (one token per UTF-8 byte) with pad/bos/eos, left padding and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(_SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        padding_side="left",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_config(family: str = "llama", *, num_hidden_layers: int = 3, num_attention_heads: int = 4,
                num_key_value_heads: int = 2, hidden_size: int = 64, **overrides):
    """A small random config of ``family`` (one of :data:`FAMILIES`).

    Gemma3 gets a hybrid layout (sliding window 16, every third layer full). ``initializer_range`` is 0.2 so that
    random attention is peaked enough for tests to tell methods apart.
    """
    from transformers import (Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config)

    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, head_dim=hidden_size // num_attention_heads,
        max_position_embeddings=4096, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=True,
    )
    if family == "llama":
        cfg = LlamaConfig(**common)
    elif family == "mistral":
        cfg = MistralConfig(**common, sliding_window=None)
    elif family == "qwen2":
        cfg = Qwen2Config(**common, use_sliding_window=False)
    elif family == "qwen3":
        cfg = Qwen3Config(**common, use_sliding_window=False)
    elif family == "gemma3":
        types = ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(num_hidden_layers)]
        cfg = Gemma3TextConfig(**common, sliding_window=16, layer_types=types, query_pre_attn_scalar=16)
    else:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def tiny_model(family: str = "llama", *, seed: int = 0, attn_implementation: str = "sdpa",
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", **config_overrides):
    """A tiny random causal LM of ``family`` in eval mode (deterministic for a given ``seed``: the weights are drawn
    on the CPU, then moved to ``device``)."""
    cfg = tiny_config(family, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation, dtype=dtype)
    if torch.device(device).type != "cpu":
        model = model.to(device)
    return model.eval()


def random_prompt(batch: int, length: int, *, seed: int = 0, pad_to: int | None = None,
                  lengths: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Random token ids (left padded when ``lengths`` differ) as ``{"input_ids", "attention_mask"}``."""
    gen = torch.Generator().manual_seed(seed)
    lengths = lengths or [length] * batch
    width = pad_to or max(lengths)
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, width - n:] = torch.randint(4, VOCAB_SIZE, (n,), generator=gen)
        mask[b, width - n:] = 1
    return {"input_ids": ids, "attention_mask": mask}


def tiny_checkpoint(kind: str = "self", *, num_target_layers: int = 4):
    """A :class:`~proxykv_hf.mapper.checkpoint.Checkpoint` of a random tiny mapper (seed 0) for a ``tiny_model("llama",
    num_hidden_layers=num_target_layers)`` target (4 query heads, 2 KV heads), read through a proxy of ``kind``:
    ``"model"`` (a 2-layer tiny model, e.g. ``tiny_model("llama", num_hidden_layers=2, seed=1)``), ``"layers"``
    (every other target layer) or ``"self"`` (every target layer, the attention sums)."""
    from .mapper.checkpoint import Checkpoint, TargetSpec
    from .mapper.model import HybridAxialMapper, MapperConfig
    from .mapper.proxy import ProxySpec, every_kth_layer

    specs = {
        "model": lambda: ProxySpec(kind="model", num_layers=2, num_heads=4, model_id="tiny-proxy"),
        "layers": lambda: ProxySpec(kind="layers", num_layers=2, num_heads=4,
                                    layers=every_kth_layer(num_target_layers, 2)),
        "self": lambda: ProxySpec(kind="self", num_layers=num_target_layers, num_heads=4),
    }
    if kind not in specs:
        raise ValueError(f"kind must be one of {sorted(specs)}, got {kind!r}")
    spec = specs[kind]()
    torch.manual_seed(0)
    cfg = MapperConfig.tiny(num_proxy_layers=spec.num_layers, num_proxy_heads=4,
                            num_target_layers=num_target_layers, num_target_heads=2)
    target = TargetSpec(model_id="tiny-llama", model_type="llama", num_layers=num_target_layers, num_kv_heads=2,
                        num_heads=4)
    return Checkpoint(mapper=HybridAxialMapper(cfg).eval(), proxy=spec, target=target,
                      training={"texts": 0}, metrics={"mass_recovery@0.3": 0.5})


def self_proxy_scorer(model, **kwargs):
    """A :class:`~proxykv_hf.scorers.proxy.ProxyScorer` with a random tiny mapper (seed 0) on ``model``'s own
    attention (the bundled mapper's path: sum, max and lookback statistics of every layer), in float32;
    ``kwargs``: the scorer's options."""
    from .mapper.checkpoint import Checkpoint, TargetSpec
    from .mapper.model import HybridAxialMapper, MapperConfig
    from .mapper.proxy import ProxySpec
    from .scorers.proxy import ProxyScorer

    cfg = model.config
    torch.manual_seed(0)
    mapper = HybridAxialMapper(MapperConfig.tiny(num_proxy_layers=cfg.num_hidden_layers,
                                                 num_proxy_heads=cfg.num_attention_heads,
                                                 num_target_layers=cfg.num_hidden_layers,
                                                 num_target_heads=cfg.num_key_value_heads, num_statistics=3,
                                                 crop_len=32, stride=16)).eval()
    ckpt = Checkpoint(mapper=mapper, proxy=ProxySpec(kind="self", num_layers=cfg.num_hidden_layers,
                                                     num_heads=cfg.num_attention_heads,
                                                     statistics=["sum", "max", "lookback"]),
                      target=TargetSpec(model_id="tiny", model_type="llama", num_layers=cfg.num_hidden_layers,
                                        num_kv_heads=cfg.num_key_value_heads, num_heads=cfg.num_attention_heads))
    return ProxyScorer(ckpt, mapper_autocast=False, **kwargs)


def pair_installed() -> bool:
    """Whether the Qwen2.5-Coder pair's GGUF parts are installed (located, never imported), for tests marked
    ``pair``."""
    from .models.parts import PackagedModel

    try:
        for name in PackagedModel.names():
            PackagedModel.get(name).locate()
    except ImportError:
        return False
    return True
