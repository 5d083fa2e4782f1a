"""Run NVIDIA kvpress's ``KVzipPress`` (its default, global budget) on given prompts; record what it keeps.

Runs INSIDE the kvpress virtualenv (``bash scripts/kvpress_env.sh``), never in ours: kvpress pins
transformers < 5.3. It does not import proxykv_hf. How to run me (CPU, about 10-20 s per prompt and ratio at 1k
tokens on SmolLM2-135M)::

    # prompts from our venv: .venv/bin/python scripts/kvpress_compare.py export --out runs/kvpress/prompts.jsonl
    MODEL=$(.venv/bin/python -c "from proxykv_hf.models import bundled_model_dir; print(bundled_model_dir())")
    .venv-kvpress/bin/python scripts/kvpress_kept_sets.py --model "$MODEL" \\
        --prompts runs/kvpress/prompts.jsonl --keep-ratios 0.1 0.3 0.5 --out runs/kvpress/kvpress.jsonl
    # then in our venv: scripts/kvpress_compare.py compare --kvpress runs/kvpress/kvpress.jsonl ...

Input: a JSONL of prompts, one object a line, ``{"id", "context_ids": [...], "question_ids": [...], "answers": [...]}``
(other fields are ignored). ``context_ids`` must be the chat-formatted context (template prefix included) and
``question_ids`` the question, end of the user turn and assistant header, as kvpress's pipeline builds them.

For every prompt and every ``keep_ratio`` it does what kvpress's ``KVPressTextGenerationPipeline._forward`` does
for a prefill press, on token ids (query-agnostic: the context is compressed alone, the question asked after):

1. ``with KVzipPress(compression_ratio=1 - keep_ratio)(model): model.model(input_ids=context, past_key_values=cache)``
   (``layerwise=False``: one bottom-k over the scores of all layers and KV heads; ``keep_ratio`` 1.0 = no press);
2. reads, per attention module, ``masked_key_indices = (batch, kv_head, position)``: the entries KVzipPress hides
   (it masks with fake keys at decoding time rather than removing anything); the kept set of each (layer, KV head)
   is every other context position;
3. answers greedily with the pipeline's own ``generate_answer`` (logical ``position_ids``, stops on eos).

Output: a JSONL, one object per (prompt, keep_ratio)::

    {"id", "keep_ratio", "compression_ratio", "context_length", "prefix_length", "prefix_matches",
     "n_layers", "n_kv_heads", "kept": [[[positions kept by KV head h] for h] for layer],   # sorted ints
     "kept_counts": [[count for h] for layer], "answer": str, "max_new_tokens", "n_sink", "chunk_size",
     "compress_s", "answer_s", "versions": {...}}

``prefix_length`` is the number of chat-template tokens KVzipPress skips when it chunks the context for
reconstruction (they keep score 0 and so are the first to be dropped, except the ``n_sink`` first tokens);
``prefix_matches`` says whether the prompt's first tokens are that template prefix, which KVzipPress assumes.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, pipeline
from transformers.utils import logging as hf_logging

from kvpress import KVzipPress

logger = logging.getLogger("kvpress_kept_sets")


@dataclass(kw_only=True)
class Config:
    model: str
    prompts: str
    out: str
    keep_ratios: tuple[float, ...] = (0.1, 0.3, 0.5)
    max_new_tokens: int = 32
    n_sink: int = 4
    chunk_size: int = 2048
    threads: int | None = None
    limit: int | None = None

    def __post_init__(self) -> None:
        for r in self.keep_ratios:
            if not 0.0 < r <= 1.0:
                raise ValueError(f"keep ratios must be in (0, 1], got {r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


def parse_args(argv: list[str] | None = None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local HF model directory (safetensors + tokenizer)")
    p.add_argument("--prompts", required=True, help="input JSONL of prompts")
    p.add_argument("--out", required=True, help="output JSONL")
    p.add_argument("--keep-ratios", type=float, nargs="+", default=[0.1, 0.3, 0.5],
                   help="fractions kept (kvpress compression_ratio = 1 - keep_ratio)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--n-sink", type=int, default=4, help="KVzipPress n_sink (its default 4)")
    p.add_argument("--chunk-size", type=int, default=2048, help="KVzipPress chunk_size (its default 2048)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    a = p.parse_args(argv)
    return Config(model=a.model, prompts=a.prompts, out=a.out, keep_ratios=tuple(a.keep_ratios),
                  max_new_tokens=a.max_new_tokens, n_sink=a.n_sink, chunk_size=a.chunk_size, threads=a.threads,
                  limit=a.limit)


def versions() -> dict[str, str]:
    return {name: md.version(name) for name in ("kvpress", "transformers", "torch")}


def kept_from_masked(masked, n_layers_heads: tuple[int, int], context_length: int) -> list[list[list[int]]]:
    """Kept positions ``[layer][kv_head]`` from each layer's ``masked_key_indices`` (None: nothing masked).

    Args:
        masked: per layer, None or ``(batch_idx, head_idx, seq_idx)`` 1-D tensors (batch size 1).
        n_layers_heads: ``(L, H_kv)``.
        context_length: ``T``, the prompt positions.
    """
    n_layers, n_heads = n_layers_heads
    kept = []
    for layer_masked in masked:
        keep = torch.ones(n_heads, context_length, dtype=torch.bool)  # (H_kv, T)
        if layer_masked is not None:
            batch, head, seq = (t.cpu() for t in layer_masked)
            if batch.numel() and int(batch.max()) != 0:
                raise ValueError(f"KVzipPress masked batch rows {sorted(set(batch.tolist()))}; expected only row 0")
            keep[head, seq] = False
        kept.append([torch.nonzero(keep[h]).flatten().tolist() for h in range(n_heads)])
    if len(kept) != n_layers:
        raise ValueError(f"found {len(kept)} attention layers, the config says {n_layers}")
    return kept


def run_one(pipe, model, prompt: dict, keep_ratio: float, cfg: Config, prefix_ids: list[int]) -> dict:
    device = model.device
    ctx = torch.tensor([prompt["context_ids"]], device=device)  # (1, T)
    question = torch.tensor([prompt["question_ids"]], device=device)  # (1, Q)
    T = ctx.shape[1]
    attn = [layer.self_attn for layer in model.model.layers]
    for module in attn:  # kvpress's attention patch also clears these at every prefill
        module.masked_key_indices = None
    cache = DynamicCache()
    cr = round(1.0 - keep_ratio, 10)
    t0 = time.perf_counter()
    with torch.no_grad():
        if cr > 0:
            press = KVzipPress(compression_ratio=cr, n_sink=cfg.n_sink, chunk_size=cfg.chunk_size)
            with press(model):
                model.model(input_ids=ctx, past_key_values=cache)
        else:
            model.model(input_ids=ctx, past_key_values=cache)
        t1 = time.perf_counter()
        masked = [getattr(m, "masked_key_indices", None) for m in attn]
        # the pipeline's own greedy loop: question at logical positions T.., one token at a time, stop on eos
        answer = pipe.generate_answer(question_ids=question, cache=cache, context_length=T,
                                      max_new_tokens=cfg.max_new_tokens)
    t2 = time.perf_counter()
    n_layers, n_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    kept = kept_from_masked(masked, (n_layers, n_heads), T)
    return {
        "id": prompt["id"], "keep_ratio": keep_ratio, "compression_ratio": cr, "context_length": T,
        "prefix_length": len(prefix_ids), "prefix_matches": prompt["context_ids"][:len(prefix_ids)] == prefix_ids,
        "n_layers": n_layers, "n_kv_heads": n_heads, "kept": kept,
        "kept_counts": [[len(h) for h in layer] for layer in kept], "answer": answer,
        "max_new_tokens": cfg.max_new_tokens, "n_sink": cfg.n_sink, "chunk_size": cfg.chunk_size,
        "compress_s": round(t1 - t0, 3), "answer_s": round(t2 - t1, 3), "versions": versions(),
    }


def template_prefix_ids(tok) -> list[int]:
    """The chat-template tokens before the user content, computed as KVzipPress does."""
    if tok.chat_template is None:
        return []
    dummy = "dummy context"
    sep = "\n" + "#" * len(dummy)
    text = tok.apply_chat_template([{"role": "user", "content": dummy + sep}], add_generation_prompt=True,
                                   tokenize=False, enable_thinking=False)
    prefix = text.split(sep)[0].split(dummy)[0]
    return tok.encode(prefix, add_special_tokens=False)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("kvpress").setLevel(logging.ERROR)  # KVzipPress warns about its cost on every construction
    hf_logging.disable_progress_bar()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    prompts = [json.loads(line) for line in Path(cfg.prompts).read_text().splitlines() if line.strip()]
    prompts = prompts[:cfg.limit] if cfg.limit else prompts
    # KVzipPress asserts non-eager attention (its masking lives in the patched attention functions)
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(cfg.model)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok)
    prefix_ids = template_prefix_ids(tok)
    print(f"{len(prompts)} prompts x keep ratios {list(cfg.keep_ratios)}; {versions()}; template prefix "
          f"{len(prefix_ids)} tokens", flush=True)
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(cfg.out, "w") as f:
        for i, prompt in enumerate(prompts):
            for keep_ratio in cfg.keep_ratios:
                rec = run_one(pipe, model, prompt, keep_ratio, cfg, prefix_ids)
                f.write(json.dumps(rec) + "\n")
                f.flush()
                kept = sum(map(sum, rec["kept_counts"]))
                print(f"[{i + 1}/{len(prompts)}] {rec['id']} keep {keep_ratio}: T={rec['context_length']} kept "
                      f"{kept}/{rec['n_layers'] * rec['n_kv_heads'] * rec['context_length']} compress "
                      f"{rec['compress_s']:.1f}s answer {rec['answer_s']:.1f}s -> {rec['answer'][:60]!r}",
                      flush=True)
                if not rec["prefix_matches"]:
                    logger.warning("prompt %s does not start with the chat-template prefix KVzipPress assumes",
                                   rec["id"])
    print(f"wrote {cfg.out} in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
