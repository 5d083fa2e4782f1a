"""The evaluation harness: methods x keep ratios x tasks x context lengths, on any model.

Two protocols:

* ``query-agnostic`` (default; KVzip's and kvpress's protocol): the context alone is prefilled and compressed, then
  the question is asked on the compressed cache. Each method scores a sample's context once (a
  :class:`~proxykv_hf.eval.methods.RecordingCache`); every keep ratio is a compacted copy of that one prefill,
  which is exactly what a cache with that ratio would hold. With ``batched`` (the default) the methods that read
  the prefill the same way share one (:func:`~proxykv_hf.eval.methods.prefill_groups`), and the uniform-budget
  keep ratios of a method are answered as the rows of one batch
  (:func:`~proxykv_hf.eval.methods.compacted_batch`): the same kept sets, the answers equal up to the order of
  floating-point sums.
* ``generate``: the prompt holds context and question and goes through ``model.generate`` with the cache (the
  prompt is scored again for each keep ratio).

Each (task, length, sample, method, keep ratio) becomes one JSON line in ``results.jsonl``; a run that finds the
file resumes where it stopped. Under ``torchrun`` the processes share one run (:mod:`proxykv_hf.eval.distributed`). Oracle fidelity (top-K recall of the kept set and the share of KVzip's score mass
it holds) is recorded whenever ``kvzip`` is among the methods.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

import torch
from tqdm.auto import tqdm

from ..cache.proxykv_cache import ProxyKVCache
from ..attention.compat import with_cache
from ..models.file_errors import reading, writing
from ..contexts.pipeline import answer_from_cache
from ..scorers.kvzip import N_SINK as KVZIP_N_SINK
from ..cache.selection import BUDGETS, select_topk
from . import tasks as task_lib
from ..scorers import registry
from ..scorers.registry import ScorerContext
from .methods import (RecordingCache, SharedPrefill, build_method, compacted_batch, compacted_copy, prefill_groups,
                      entry_bytes)
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
        tasks: task names (see ``proxykv_hf.eval.tasks.TASKS``); with ``split``, those of the split to run (RULER's
            own names for the ``ruler`` split: ``vt cwe``), all of them when none is named. Default: niah_single_1.
        context_lengths: target context lengths in tokens.
        n_samples: samples per (task, length).
        seed: base seed of the task generators.
        protocol: ``"query-agnostic"`` or ``"generate"``.
        max_new_tokens: answer length cap (a RULER benchmark task answers within RULER's own budget instead: 128
            tokens for NIAH, 30 for vt, 120 for cwe, 50 for fwe).
        out_dir: where results, tables and plots go.
        split: ``"dev"`` or ``"test"`` of the locked protocol, or ``"ruler"``, RULER as a benchmark
            (:mod:`proxykv_hf.eval.splits`): its tasks (those of them ``tasks`` names) and its seed replace ``tasks``
            and ``seed``, and the report names the split. None: the tasks and seed as given.
        budgets: ``"uniform"`` and/or ``"global"`` (``ProxyKVCache(budget=...)``); a method under the global
            budget is reported as ``<method>@global``.
        batched: query-agnostic protocol: share one prefill among the methods that read it the same way, and
            answer a method's uniform-budget keep ratios in one batch. False: one prefill per method and one answer
            per ratio (the same kept sets; answers may differ where floating-point order breaks a near tie).
        num_shards, shard_index: run only the samples whose index is ``shard_index`` modulo ``num_shards`` (each
            sample depends only on its task, seed and index, so shards run side by side in separate processes and
            output directories (--out), one torch thread each, give the records of one run between them). Under
            ``torchrun`` they are the world size and the rank, and the ranks' records are merged into one --out
            (``proxykv_hf.eval.distributed``); give them by hand only without it.
    """

    methods: list[str] = field(default_factory=lambda: ["full", "kvzip", "snapkv", "streaming", "random"])
    keep_ratios: list[float] = field(default_factory=lambda: list(DEFAULT_RATIOS))
    tasks: list[str] = field(default_factory=list)
    context_lengths: list[int] = field(default_factory=lambda: [2048])
    n_samples: int = 20
    seed: int = 0
    protocol: str = "query-agnostic"
    max_new_tokens: int = 32
    out_dir: str = "runs/eval"
    split: str | None = None
    budgets: list[str] = field(default_factory=lambda: ["uniform"])
    batched: bool = True
    num_shards: int = 1
    shard_index: int = 0

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
            self.tasks, self.seed = chosen.select(self.tasks), chosen.seed
        self.tasks = list(self.tasks) or ["niah_single_1"]
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
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"shard_index must be in [0, num_shards), got {self.shard_index} of {self.num_shards}")
        for t in self.tasks:
            task_lib.task_fn(t)  # ValueError for an unknown task
        if any(t.startswith("ruler_") for t in self.tasks):  # RULER's seeds and essays, before any model loads
            from .ruler.registry import check_ready, check_seed

            check_seed(self.seed)
            check_ready(self.tasks)


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
    part = path.with_name(path.name + ".part")  # renamed when whole: a stopped run leaves no half-written oracle
    with writing(path):
        save_file({str(i): s.contiguous() for i, s in scores.items()}, str(part))
    os.replace(part, path)


def _load_scores(path: Path) -> dict[int, torch.Tensor]:
    from safetensors.torch import load_file

    with reading(path, "stored oracle score file"):
        return {int(k): v for k, v in load_file(str(path)).items()}


class Harness:
    """Runs an :class:`EvalConfig` on a model and tokenizer; see :func:`run_eval`."""

    def __init__(self, model, tokenizer, config: EvalConfig, options: ScorerContext | None = None, *,
                 records_dir: str | os.PathLike | None = None, done_elsewhere: Iterable[tuple] = ()):
        self.model, self.tok, self.config = model, tokenizer, config
        self.options = options or ScorerContext()
        if self.options.tokenizer is None:
            self.options.tokenizer = tokenizer
        self.out = Path(config.out_dir)  # created by run(), once the samples are drawn; the oracle's scores go here
        self.records = self.out if records_dir is None else Path(records_dir)  # config.json and results.jsonl
        self.results_path = self.records / "results.jsonl"
        self.done_elsewhere = set(done_elsewhere)  # record keys another file holds (a distributed run's merged ones)
        self.scorers = {m: build_method(m, model, self.options) for m in config.methods}
        # the sinks of the stored KVzip scores, also when a later run adds methods without KVzip itself
        self.oracle_sink = self.scorers["kvzip"].n_sink if "kvzip" in self.scorers else KVZIP_N_SINK

    def _done(self) -> set[tuple]:
        """The records ``results.jsonl`` holds. A last line without its newline is a record a stopped run was
        writing: it is cut off (and run again); any other line that is not a record is an error."""
        done = set()
        if not self.results_path.exists():
            return done
        text = self.results_path.read_text()
        if text and not text.endswith("\n"):
            complete = text[:text.rfind("\n") + 1]
            logger.warning("%s: dropping its last line, cut off by a stopped run: %r", self.results_path,
                           text[len(complete):][:80])
            with self.results_path.open("r+b") as f:
                f.truncate(len(complete.encode()))
            text = complete
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                done.add((r["task"], r["context_length"], r["sample"], r["method"], r["keep_ratio"]))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{self.results_path}, line {number}: not an evaluation record ({e}); move the "
                                 f"file away or fix the line to resume") from None
        return done

    def _ids(self, sample) -> tuple[torch.Tensor, torch.Tensor]:
        ctx, q = task_lib.encode_sample(sample, self.tok)
        device = self.model.device
        return (torch.tensor([ctx], device=device), torch.tensor([q], device=device))

    def _max_new_tokens(self, sample) -> int:
        """The answer's cap: the sample's own (RULER's budget for its task) or ``max_new_tokens``."""
        return sample.meta.get("max_new_tokens") or self.config.max_new_tokens

    def _answer(self, cache, ctx, q, sample) -> tuple[str, float]:
        t0 = time.perf_counter()
        ids = answer_from_cache(self.model, cache, ctx, q, max_new_tokens=self._max_new_tokens(sample),
                                do_sample=False, pad_token_id=self.tok.pad_token_id)
        return self.tok.decode(ids[0], skip_special_tokens=True), time.perf_counter() - t0

    def _answer_batch(self, cache, ctx, q, rows: int, sample) -> tuple[list[str], float]:
        t0 = time.perf_counter()
        ids = answer_from_cache(self.model, cache, ctx.expand(rows, -1), q.expand(rows, -1),
                                max_new_tokens=self._max_new_tokens(sample), do_sample=False,
                                pad_token_id=self.tok.pad_token_id)
        return self.tok.batch_decode(ids, skip_special_tokens=True), time.perf_counter() - t0

    def _generate(self, cache, ctx, q, sample) -> tuple[str, float]:
        ids = torch.cat([ctx, q], 1)
        t0 = time.perf_counter()
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **with_cache(cache),
                                  max_new_tokens=self._max_new_tokens(sample), do_sample=False,
                                  pad_token_id=self.tok.pad_token_id)
        return self.tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True), time.perf_counter() - t0

    def _prefill(self, methods: list[str], ctx: torch.Tensor) -> tuple[RecordingCache, float]:
        """One recorded prefill for ``methods`` (a :class:`SharedPrefill` when several score it)."""
        scorers = {m: self.scorers[m].fresh() for m in methods if self.scorers[m] is not None}
        scorer = None if not scorers else \
            next(iter(scorers.values())) if len(scorers) == 1 and len(methods) == 1 else SharedPrefill(scorers)
        cache = RecordingCache(scorer)
        cache.prepare(self.model, ctx)
        t0 = time.perf_counter()
        with torch.no_grad():
            self.model(input_ids=ctx, **with_cache(cache), use_cache=True, logits_to_keep=1)
        return cache, time.perf_counter() - t0

    def run(self, report: bool = True) -> Path:
        """Run the records not written yet (in :attr:`results_path` or :attr:`done_elsewhere`); then, if
        ``report``, write ``results.md`` and ``accuracy.png``. Returns the output directory."""
        cfg = self.config
        mapper = self.options.mapper
        options = {"mapper": mapper if mapper is None or isinstance(mapper, (str, os.PathLike)) else
                   f"a {type(mapper).__name__} in memory", **self.options.fields}  # the scorers' options
        done = self._done() | self.done_elsewhere
        units = [(t, n) for t in cfg.tasks for n in cfg.context_lengths]
        indices = range(cfg.shard_index, cfg.n_samples, cfg.num_shards)
        samples = {(t, n): dict(zip(indices, task_lib.generate(t, cfg.n_samples, n, self.tok, cfg.seed,
                                                                 indices=indices))) for t, n in units}
        self.records.mkdir(parents=True, exist_ok=True)  # only now: a run refused above leaves nothing behind
        write_whole(self.records / "config.json", json.dumps({"config": asdict(cfg), "options": options,
                                                             "env": environment(self.model)}, indent=2, default=str))
        bar = tqdm(total=len(units) * len(indices) * len(cfg.methods), unit="run",
                   desc="eval" if cfg.num_shards == 1 else f"eval {cfg.shard_index}/{cfg.num_shards}")
        with self.results_path.open("a") as log:
            for idx in indices:  # sample by sample across tasks: a stopped run leaves every task covered
                for task, length in units:
                    self._run_sample(task, length, idx, samples[task, length][idx], done, log, bar)
        bar.close()
        if report:
            from .report import write_report

            write_report(self.out)
        return self.out

    def _todo(self, task, length, idx, method, done) -> list[tuple[str, str, float]]:
        """``(budget, label, keep ratio)`` of ``method`` on this sample not in ``results.jsonl`` yet."""
        return [(b, label, r) for b, label, r in method_runs(self.config, method)
                if (task, length, idx, label, r) not in done]

    def _run_sample(self, task, length, idx, sample, done, log, bar) -> None:
        cfg = self.config
        ctx, q = self._ids(sample)
        oracle_path = self.out / "oracle" / f"{task}-{length}-{idx}.safetensors"
        oracle = _load_scores(oracle_path) if oracle_path.exists() else None
        order = sorted(cfg.methods, key=lambda m: m != "kvzip")  # the oracle first, for fidelity
        shared = cfg.batched and cfg.protocol == "query-agnostic"
        groups = prefill_groups({m: self.scorers[m] for m in order}) if shared else [[m] for m in order]
        for group in groups:
            todo = {m: self._todo(task, length, idx, m, done) for m in group}
            bar.update(len(group))
            group = [m for m in group if todo[m]]
            if not group:
                continue
            if cfg.protocol != "query-agnostic":
                for method in group:
                    self._run_generate(task, length, idx, sample, method, todo[method], ctx, q, log)
                continue
            base, t_prefill = self._prefill(group, ctx)
            for method in group:
                if isinstance(base.scorer, SharedPrefill):
                    scorer = base.scorer.members.get(method)
                    scores = base.scorer.scores.get(method, {})
                else:
                    scorer, scores = base.scorer, base.scores
                if method == "kvzip":
                    oracle = scores
                    _save_scores(oracle_path, scores)  # later runs (other methods) reuse it for fidelity
                run = _MethodRun(self, task, length, idx, sample, method, base, scorer, scores, oracle,
                                 prefill_s=t_prefill, shared=group if len(group) > 1 else None)
                run.answer(todo[method], ctx, q, log)

    def _run_generate(self, task, length, idx, sample, method, todo, ctx, q, log) -> None:
        """The ``generate`` protocol: a live cache per keep ratio, the prompt holding context and question."""
        scorer = self.scorers[method]
        for budget, label, ratio in todo:
            cache = ProxyKVCache(scorer.fresh() if scorer is not None else None, keep_ratio=ratio, budget=budget)
            pred, t_answer = self._generate(cache, ctx, q, sample)
            _write(log, self._record(task, length, idx, sample, label, ratio, pred, ctx, entry_bytes(cache),
                                     prefill_s=0.0, answer_s=t_answer))

    def _record(self, task, length, idx, sample, label, ratio, pred, ctx, kv_bytes, *, prefill_s, answer_s) -> dict:
        cfg = self.config
        return {"task": task, "context_length": length, "sample": idx, "method": label, "keep_ratio": ratio,
                "score": score_sample(sample, pred), "prediction": pred, "answers": sample.answers,
                "n_tokens": int(ctx.shape[1]), "kv_bytes": kv_bytes, "seed": cfg.seed, "protocol": cfg.protocol,
                "prefill_s": round(prefill_s, 4), "answer_s": round(answer_s, 4)}


def method_runs(cfg: EvalConfig, method: str) -> list[tuple[str, str, float]]:
    """``(budget, label, keep ratio)`` of each record ``method`` writes per sample, in the order they are written:
    the full cache once at 1.0; any other method at each keep ratio under each budget (``<method>@global``)."""
    ratios = [1.0] if method == "full" else cfg.keep_ratios
    variants = [("uniform", method)] if method == "full" else \
        [(b, method if b == "uniform" else f"{method}@{b}") for b in cfg.budgets]
    return [(b, label, r) for b, label in variants for r in ratios]


def write_whole(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temporary file renamed over it: readers (other processes checking ``--out``)
    see the old file or the new one, never half of it."""
    part = path.with_name(path.name + ".tmp")
    part.write_text(text)
    os.replace(part, path)


def _write(log, rec: dict) -> None:
    log.write(json.dumps(rec) + "\n")
    log.flush()


@dataclass
class _MethodRun:
    """One method's answers on one sample of the query-agnostic protocol, from its recorded prefill."""

    harness: Harness
    task: str
    length: int
    idx: int
    sample: object
    method: str
    base: RecordingCache
    scorer: object
    scores: dict
    oracle: dict | None
    prefill_s: float
    shared: list[str] | None

    def answer(self, todo, ctx, q, log) -> None:
        h, cfg = self.harness, self.harness.config
        n_sink = max(self.base.n_sink, getattr(self.scorer, "n_sink", 0))
        n_recent = max(self.base.n_recent, getattr(self.scorer, "n_recent", 0))
        preds: dict[tuple[str, float], tuple[str, float, int | None, int]] = {}
        batch = [r for b, _, r in todo if b == "uniform"] if self.method != "full" else []
        if cfg.batched and len(batch) > 1:
            cache = compacted_batch(self.base, batch, scorer=self.scorer, scores=self.scores)
            texts, t = h._answer_batch(cache, ctx, q, len(batch), self.sample)
            preds.update({("uniform", r): (text, t / len(batch), len(batch), entry_bytes(cache, j))
                          for j, (r, text) in enumerate(zip(batch, texts))})
        valid = torch.ones(1, ctx.shape[1], dtype=torch.bool)
        for budget, label, ratio in todo:
            if (budget, ratio) in preds:
                pred, t_answer, rows, kv_bytes = preds[(budget, ratio)]
            else:
                cache = self.base if self.method == "full" else \
                    compacted_copy(self.base, ratio, budget, scorer=self.scorer, scores=self.scores)
                (pred, t_answer), rows, kv_bytes = h._answer(cache, ctx, q, self.sample), None, entry_bytes(cache)
            rec = h._record(self.task, self.length, self.idx, self.sample, label, ratio, pred, ctx, kv_bytes,
                            prefill_s=self.prefill_s, answer_s=t_answer)
            if rows:
                rec["answer_batch"] = rows  # answered as one row of a batch; answer_s is the batch's share
            if self.shared:
                rec["prefill_shared_with"] = self.shared  # prefill_s is that of the shared prefill
            if self.oracle is not None and budget == "uniform":
                rec.update(fidelity(self.scores if self.method != "full" else {}, self.oracle, valid, ratio, n_sink,
                                    n_recent, h.oracle_sink))
            _write(log, rec)


def run_eval(model, tokenizer, config: EvalConfig, options: ScorerContext | None = None) -> Path:
    """Run ``config`` and write ``results.jsonl``, ``results.md`` and ``accuracy.png`` to ``config.out_dir``."""
    return Harness(model, tokenizer, config, options).run()
