"""The evaluation harness: methods x keep ratios x tasks x context lengths, on any model.

Two protocols:

* ``query-agnostic`` (default; KVzip's and kvpress's protocol): the context alone is prefilled and compressed, then
  the question is asked on the compressed cache. Each method scores a sample's context once (a
  :class:`~proxykv_hf.eval.methods.RecordingCache`); every keep ratio is a compacted copy of that one prefill,
  which is exactly what a cache with that ratio would hold.
* ``generate``: the prompt holds context and question and goes through ``model.generate`` with the cache (the
  prompt is scored again for each keep ratio).

Each (task, length, sample, method, keep ratio) becomes one JSON line in ``results.jsonl``; a run that finds the
file resumes where it stopped. Oracle fidelity (top-K recall of the kept set and the share of KVzip's score mass
it holds) is recorded whenever ``kvzip`` is among the methods.
"""

from __future__ import annotations

import json
import logging
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..cache import ProxyKVCache
from ..pipeline import answer_from_cache
from ..scorers.kvzip import N_SINK as KVZIP_N_SINK
from ..selection import BUDGETS, select_topk
from . import tasks as task_lib
from ..scorers import registry
from ..scorers.registry import ScorerContext
from .methods import RecordingCache, build_method, compacted_copy
from .metrics import score_sample

logger = logging.getLogger(__name__)

PROTOCOLS = ("query-agnostic", "generate")
DEFAULT_RATIOS = (0.1, 0.2, 0.3, 0.5, 0.7, 0.9)


@dataclass(kw_only=True)
class EvalConfig:
    """One evaluation run.

    Attributes:
        methods: the methods to run: ``"full"`` and names of the scorer registry
            (:mod:`proxykv_hf.scorers.registry`).
        keep_ratios: budgets to sweep (the full cache is run once, at 1.0).
        tasks: task names (see ``proxykv_hf.eval.tasks.TASKS``).
        context_lengths: target context lengths in tokens.
        n_samples: samples per (task, length).
        seed: base seed of the task generators.
        protocol: ``"query-agnostic"`` or ``"generate"``.
        max_new_tokens: answer length cap.
        out_dir: where results, tables and plots go.
        split: ``"dev"`` or ``"test"`` of the locked protocol (:mod:`proxykv_hf.eval.splits`): its tasks and seed
            replace ``tasks`` and ``seed``, and the report names the split. None: the tasks and seed as given.
        budgets: ``"uniform"`` and/or ``"global"`` (``ProxyKVCache(budget=...)``); a method under the global
            budget is reported as ``<method>@global``.
    """

    methods: list[str] = field(default_factory=lambda: ["full", "kvzip", "snapkv", "streaming", "random"])
    keep_ratios: list[float] = field(default_factory=lambda: list(DEFAULT_RATIOS))
    tasks: list[str] = field(default_factory=lambda: ["niah_single_1"])
    context_lengths: list[int] = field(default_factory=lambda: [2048])
    n_samples: int = 20
    seed: int = 0
    protocol: str = "query-agnostic"
    max_new_tokens: int = 32
    out_dir: str = "runs/eval"
    split: str | None = None
    budgets: list[str] = field(default_factory=lambda: ["uniform"])

    def __post_init__(self):
        bad_budgets = [b for b in self.budgets if b not in BUDGETS]
        if bad_budgets or not self.budgets:
            raise ValueError(f"budgets must be taken from {BUDGETS}, got {self.budgets!r}")
        if self.split is not None:
            from .splits import check_split, get_split

            if self.split == "train":
                raise ValueError("split 'train' holds training texts; evaluate on 'dev' (to choose) or 'test'")
            chosen = get_split(self.split)
            check_split(chosen)
            self.tasks, self.seed = list(chosen.tasks), chosen.seed
        bad = [m for m in self.methods if m not in registry.names()]
        if bad:
            raise ValueError(f"unknown methods {bad}; choose from {', '.join(registry.names())}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        for r in self.keep_ratios:
            if not 0 < r <= 1:
                raise ValueError(f"keep ratios must be in (0, 1], got {r}")
        if self.n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {self.n_samples}")
        for t in self.tasks:
            task_lib.task_fn(t)  # ValueError for an unknown task


def environment(model) -> dict:
    """Device, versions and model facts recorded with every run."""
    import transformers

    device = next(model.parameters()).device
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "device_type": device.type, "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(),
        "model": getattr(model.config, "name_or_path", "") or getattr(model.config, "_name_or_path", ""),
        "dtype": str(next(model.parameters()).dtype),
    }


def fidelity(scores: dict[int, torch.Tensor], oracle: dict[int, torch.Tensor], valid: torch.Tensor,
             keep_ratio: float, n_sink: int, n_recent: int, oracle_sink: int) -> dict[str, float]:
    """Top-K recall of the kept set against KVzip's kept set, and the share of KVzip's score mass it keeps,
    averaged over layers, heads and rows (scores: method's; ``{}`` = full cache)."""
    if not scores:  # the full cache keeps everything
        return {"topk_recall": 1.0, "mass_recovery": 1.0}
    recall, mass = [], []
    for i, y in oracle.items():
        y = y.float()
        ref, ref_ok = select_topk(y, keep_ratio, valid, oracle_sink, 0)
        got, got_ok = select_topk(scores[i].float(), keep_ratio, valid, n_sink, n_recent)
        T = y.shape[-1]
        kept = torch.zeros_like(y, dtype=torch.bool).scatter_(-1, got, got_ok[:, None, :].expand_as(got))
        kept_ref = torch.zeros_like(y, dtype=torch.bool).scatter_(-1, ref, ref_ok[:, None, :].expand_as(ref))
        kept &= valid[:, None, :T]
        recall.append(((kept & kept_ref).sum(-1) / kept_ref.sum(-1).clamp_min(1)).flatten())
        ymask = y * valid[:, None, :T]
        mass.append(((ymask * kept).sum(-1) / ymask.sum(-1).clamp_min(1e-12)).flatten())
    return {"topk_recall": float(torch.cat(recall).mean()), "mass_recovery": float(torch.cat(mass).mean())}


def _save_scores(path: Path, scores: dict[int, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({str(i): s.contiguous() for i, s in scores.items()}, str(path))


def _load_scores(path: Path) -> dict[int, torch.Tensor]:
    from safetensors.torch import load_file

    return {int(k): v for k, v in load_file(str(path)).items()}


class Harness:
    """Runs an :class:`EvalConfig` on a model and tokenizer; see :func:`run_eval`."""

    def __init__(self, model, tokenizer, config: EvalConfig, options: ScorerContext | None = None):
        self.model, self.tok, self.config = model, tokenizer, config
        self.options = options or ScorerContext()
        if self.options.tokenizer is None:
            self.options.tokenizer = tokenizer
        self.out = Path(config.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.results_path = self.out / "results.jsonl"
        self.scorers = {m: build_method(m, model, self.options) for m in config.methods}
        # the sinks of the stored KVzip scores, also when a later run adds methods without KVzip itself
        self.oracle_sink = self.scorers["kvzip"].n_sink if "kvzip" in self.scorers else KVZIP_N_SINK

    def _done(self) -> set[tuple]:
        done = set()
        if self.results_path.exists():
            for line in self.results_path.read_text().splitlines():
                if line.strip():
                    r = json.loads(line)
                    done.add((r["task"], r["context_length"], r["sample"], r["method"], r["keep_ratio"]))
        return done

    def _ids(self, sample) -> tuple[torch.Tensor, torch.Tensor]:
        ctx, q = task_lib.encode_sample(sample, self.tok)
        device = self.model.device
        return (torch.tensor([ctx], device=device), torch.tensor([q], device=device))

    def _answer(self, cache, ctx, q) -> tuple[str, float]:
        t0 = time.perf_counter()
        ids = answer_from_cache(self.model, cache, ctx, q, max_new_tokens=self.config.max_new_tokens,
                                do_sample=False, pad_token_id=self.tok.pad_token_id)
        return self.tok.decode(ids[0], skip_special_tokens=True), time.perf_counter() - t0

    def _generate(self, cache, ctx, q) -> tuple[str, float]:
        ids = torch.cat([ctx, q], 1)
        t0 = time.perf_counter()
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                  max_new_tokens=self.config.max_new_tokens, do_sample=False,
                                  pad_token_id=self.tok.pad_token_id)
        return self.tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True), time.perf_counter() - t0

    def _prefill(self, method: str, ctx: torch.Tensor) -> tuple[ProxyKVCache, float]:
        scorer = self.scorers[method]
        cache = RecordingCache(scorer.fresh() if scorer is not None else None)
        cache.prepare(self.model, ctx)
        t0 = time.perf_counter()
        with torch.no_grad():
            self.model(input_ids=ctx, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache, time.perf_counter() - t0

    def run(self) -> Path:
        cfg = self.config
        options = {"mapper": self.options.mapper, "pool_kernel": self.options.pool_kernel,
                   "kvzip_chunk": self.options.kvzip_chunk, "seed": self.options.seed}
        (self.out / "config.json").write_text(json.dumps({"config": asdict(cfg), "options": options,
                                                          "env": environment(self.model)}, indent=2, default=str))
        done = self._done()
        units = [(t, n) for t in cfg.tasks for n in cfg.context_lengths]
        total = len(units) * cfg.n_samples * len(cfg.methods)
        bar = tqdm(total=total, desc="eval", unit="run")
        with self.results_path.open("a") as log:
            for task, length in units:
                samples = task_lib.generate(task, cfg.n_samples, length, self.tok, cfg.seed)
                for idx, sample in enumerate(samples):
                    self._run_sample(task, length, idx, sample, done, log, bar)
        bar.close()
        from .report import write_report

        write_report(self.out)
        return self.out

    def _run_sample(self, task, length, idx, sample, done, log, bar) -> None:
        cfg = self.config
        ctx, q = self._ids(sample)
        valid = torch.ones(1, ctx.shape[1], dtype=torch.bool)
        oracle_path = self.out / "oracle" / f"{task}-{length}-{idx}.safetensors"
        oracle = _load_scores(oracle_path) if oracle_path.exists() else None
        order = sorted(cfg.methods, key=lambda m: m != "kvzip")  # the oracle first, for fidelity
        for method in order:
            ratios = [1.0] if method == "full" else cfg.keep_ratios
            variants = [("uniform", method)] if method == "full" else \
                [(b, method if b == "uniform" else f"{method}@{b}") for b in cfg.budgets]
            todo = [(b, label, r) for b, label in variants for r in ratios
                    if (task, length, idx, label, r) not in done]
            bar.update(1)
            if not todo:
                continue
            scorer = self.scorers[method]
            if cfg.protocol == "query-agnostic":
                base, t_prefill = self._prefill(method, ctx)
                scores = {i: s.cpu() for i, s in base.scores.items()}
                if method == "kvzip":
                    oracle = scores
                    _save_scores(oracle_path, scores)  # later runs (other methods) reuse it for fidelity
            for budget, label, ratio in todo:
                if cfg.protocol == "query-agnostic":
                    cache = base if method == "full" else compacted_copy(base, ratio, budget)
                    pred, t_answer = self._answer(cache, ctx, q)
                else:
                    cache = ProxyKVCache(scorer.fresh() if scorer is not None else None, keep_ratio=ratio,
                                         budget=budget)
                    pred, t_answer = self._generate(cache, ctx, q)
                    t_prefill = 0.0
                rec = {"task": task, "context_length": length, "sample": idx, "method": label, "keep_ratio": ratio,
                       "score": score_sample(sample, pred), "prediction": pred, "answers": sample.answers,
                       "n_tokens": int(ctx.shape[1]), "kv_bytes": cache.nbytes(), "seed": cfg.seed,
                       "protocol": cfg.protocol, "prefill_s": round(t_prefill, 4), "answer_s": round(t_answer, 4)}
                if oracle is not None and cfg.protocol == "query-agnostic" and budget == "uniform":
                    rec.update(fidelity(scores if method != "full" else {}, oracle, valid, ratio, base.n_sink,
                                        base.n_recent, self.oracle_sink))
                log.write(json.dumps(rec) + "\n")
                log.flush()


def run_eval(model, tokenizer, config: EvalConfig, options: ScorerContext | None = None) -> Path:
    """Run ``config`` and write ``results.jsonl``, ``results.md`` and ``accuracy.png`` to ``config.out_dir``."""
    return Harness(model, tokenizer, config, options).run()
