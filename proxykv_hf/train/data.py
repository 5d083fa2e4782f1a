"""Training data for the mapper: proxy features X and oracle scores Y, cut into crops and stored as shards.

How to run me (library; the CLI wraps it)::

    from proxykv_hf.train import DataConfig, build_dataset, texts_from_tasks
    manifest = build_dataset(texts_from_tasks(["niah_single_2", "cwe"], 50, 4096, tok, seed=0), target, tok,
                             "data/smol", DataConfig(proxy_kind="layers", layer_stride=3))

Per text (paper, "Training procedure"): one proxy forward gives ``X (L_s, H_s, N)`` and one teacher-forced oracle
pass (KVzip by default) gives ``Y (L_l, H_kv, N)``; both are cut into sliding crops of ``crop_len`` tokens with
``stride`` (the last crop ends at the text's end; a text shorter than ``crop_len`` is one short crop, right-padded).
Features are computed on the whole text first, so a crop's X and Y are exactly what the mapper and the oracle see
at inference inside a long prompt.

On disk, ``out_dir`` holds ``shard-00000.safetensors, ...`` (tensors ``x (S, L_s, H_s, C)``, ``y (S, L_l, H_kv,
C)``, ``mask (S, C)`` bool, ``length``, ``start``, ``text`` (S,)) and ``manifest.json``. A shard ends at a text
boundary (so ``shard_size`` is a target, not a cap) and the manifest is rewritten atomically after each shard with
the hashes of the texts it completed: an interrupted build resumes by skipping them.

The pieces: :mod:`.manifest` (``DataConfig``, ``Manifest``), :mod:`.features` (one text's X and Y),
:mod:`.shards` (crops, shards, merging), :mod:`.sources` (texts).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Iterable, Sequence

from torch import Tensor

from .features import Oracle, default_oracle, encode, features_and_scores, resolve_proxy, target_spec_of, text_key
from .manifest import MANIFEST_NAME, DataConfig, Manifest
from .shards import ShardWriter, stored_scores

logger = logging.getLogger(__name__)

TextItem = str | Sequence[int] | dict


def build_dataset(texts: Iterable[TextItem], target, tokenizer, out_dir: str | os.PathLike,
                  config: DataConfig | None = None, *, proxy=None, oracle: Oracle | None = None,
                  scores_from: str | os.PathLike | None = None, resume: bool = True,
                  progress: bool = True) -> Manifest:
    """Run proxy and oracle over ``texts`` and write crops of (X, Y) as shards to ``out_dir``.

    Args:
        texts: strings, token-id lists, or dicts ``{"text" | "input_ids", "source"}`` (as the ``texts_from_*``
            helpers yield; ``source`` is counted in the manifest).
        target: the target model (a ``PreTrainedModel``) the oracle runs on.
        tokenizer: the target's tokenizer (and the proxy's: a ``"model"`` proxy must share it).
        out_dir: dataset directory (created).
        config: :class:`DataConfig`; default ``DataConfig()``.
        proxy: the proxy model for ``config.proxy_kind == "model"`` (default: ``load_model(proxy_model_id)``).
        oracle: ``oracle(model, input_ids, attention_mask, tokenizer=..., **config.oracle_kwargs)`` returning
            ``(L_l, B, H_kv, T)`` scores for every full-attention layer (or ``(L, B, H_kv, T)`` for every layer,
            of which the full-attention ones are kept); default KVzip's ``kvzip_scores``.
        scores_from: a dataset built before for the same target (:func:`stored_scores`): texts it holds take
            their oracle scores from it (e.g. to store other proxy features without another oracle pass); the
            others run ``oracle``. Its manifest's oracle name is recorded when it served every text.
        resume: continue an existing build in ``out_dir`` (skip its done texts); False deletes it first.
        progress: show a tqdm bar.

    Returns:
        The final :class:`Manifest` (also in ``out_dir/manifest.json``).
    """
    from tqdm.auto import tqdm

    config = config or DataConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tspec = target_spec_of(target, config.target_model_id)
    runner, layers, pspec = resolve_proxy(target, config, proxy, tokenizer)
    oracle = oracle or default_oracle()
    stored, stored_from = ({}, None) if scores_from is None else stored_scores(scores_from)
    if stored_from is not None and stored_from.target != tspec.to_dict():
        raise ValueError(f"scores_from={scores_from} was built for target {stored_from.target}, not {tspec.to_dict()}")
    now = time.strftime("%Y-%m-%dT%H:%M:%S")
    manifest = Manifest(target=tspec.to_dict(), proxy=pspec.to_dict(), data_config=config.to_dict(),
                        tokenizer={"name": getattr(tokenizer, "name_or_path", "") or "unknown",
                                   "vocab_size": len(tokenizer)},
                        oracle=_qualname(oracle), created=now)
    if (out / MANIFEST_NAME).exists():
        if resume:
            old = Manifest.load(out)
            _check_resumable(old, manifest, out)
            old.data_config = manifest.data_config
            manifest = old
            listed = {sh["file"] for sh in manifest.shards}
            for p in out.glob("shard-*.safetensors*"):  # written before a crash, never listed: redone below
                if p.name not in listed:
                    p.unlink()
            logger.info("resuming %s: %d texts, %d crops already done", out, manifest.texts, manifest.crops)
        else:
            for p in out.glob("shard-*.safetensors*"):
                p.unlink()
            (out / MANIFEST_NAME).unlink()
    if not (out / MANIFEST_NAME).exists():  # first: a dataset's directory from the start (cli/out_dirs.py)
        manifest.save(out)
    done = set(manifest.done)
    writer = ShardWriter(out, manifest, config)
    seen: set[str] = set()
    skipped = reused = 0
    bar = tqdm(texts, desc="build data", unit="text", disable=not progress)
    for item in bar:
        text, source = _unpack(item)
        key = text_key(text)
        if key in done or key in seen:
            skipped += 1
            continue
        seen.add(key)
        ids = encode(text, tokenizer, config)
        if len(ids) < config.min_length:
            writer.add(key, None, len(ids))
            continue
        if len(ids) > config.max_length:
            ids = ids[:config.max_length]
            manifest.truncated += 1
        use = oracle
        if key in stored:
            kept = stored[key]
            if kept.shape[-1] != len(ids):
                raise ValueError(f"scores_from holds {kept.shape[-1]} tokens of a text that now encodes to "
                                 f"{len(ids)}; build both datasets with the same tokenizer and data config")
            use = lambda *args, _y=kept, **kwargs: _y[:, None]  # noqa: E731  (L_l, 1, H_kv, T), as an oracle returns
            reused += 1
        x, y = features_and_scores(ids, target, runner, layers, pspec, use, tokenizer, config, tspec)
        writer.add(key, source, len(ids), x, y)
        bar.set_postfix(crops=manifest.crops + len(writer.crops), refresh=False)
    writer.flush()
    if stored_from is not None:
        logger.info("%d texts took their scores from %s", reused, scores_from)
        if reused == manifest.texts:  # every text's scores came from there
            manifest.oracle = stored_from.oracle
            manifest.save(out)
    if skipped:
        logger.info("skipped %d texts already in %s (or repeated)", skipped, out)
    if not manifest.shards:
        manifest.save(out)
    logger.info("dataset %s: %d texts, %d tokens, %d crops in %d shards, %.1f MB", out, manifest.texts,
                manifest.tokens, manifest.crops, len(manifest.shards), manifest.disk_bytes / 2**20)
    return manifest


def _check_resumable(old: Manifest, new: Manifest, out: Path) -> None:
    problem = old.mismatch(new)
    if problem:
        raise ValueError(f"{out} was built with {problem}; use another out_dir or resume=False to rebuild")


def _qualname(fn) -> str:
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _unpack(item: TextItem) -> tuple[str | Sequence[int], str]:
    if isinstance(item, dict):
        text = item.get("text", item.get("input_ids"))
        if text is None:
            raise ValueError(f"a text dict needs 'text' or 'input_ids', got keys {sorted(item)}")
        return text, str(item.get("source", "unknown"))
    if isinstance(item, (str, list, tuple)) or isinstance(item, Tensor):
        return (item.tolist() if isinstance(item, Tensor) else item), "unknown"
    raise ValueError(f"a text must be a str, a list of token ids or a dict, got {type(item).__name__}")
