"""``proxykv bench``: build the target, its scorers and (for ProxyKV) the model its features come from, then run
and report.

The report on stdout is a table for people, then one line of JSON (:func:`~proxykv_hf.bench.run.summary_json`: the
config, the environment and every row), the interface for scripts: ``json.loads(stdout.splitlines()[-1])``.
``--out`` also writes the table, a plot and the same JSON (``bench.json``) to a directory; ``bench.json`` is saved
after each method's row, and a run given the ``--out`` of an earlier one of the same setting measures only the
(length, method) points that one has not (a long curve survives a stopped process, and grows by lengths).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

from tqdm.auto import tqdm

from ..cli.helpers import dtype_of, from_args, load, mapper_for, mapper_overrides, proxy_model_of
from ..eval.harness import environment
from .run import Bench, BenchConfig, plot, summary_json, table

logger = logging.getLogger(__name__)


def _scorers(ns, model, tok):
    """name -> scorer (None for the full cache), plus the model the ProxyKV scorer's features come from (for its
    breakdown; None without ProxyKV)."""
    from ..scorers import ProxyScorer, ScorerContext, registry

    names = dict.fromkeys(["full", *(m.partition("@")[0] for m in ns.methods)])  # "kvzip@global" scores as kvzip
    mapper = getattr(ns, "_mapper", None) or (mapper_for(ns, model) if "proxykv" in names else None)
    if "proxykv" in names and mapper is None:
        raise ValueError("proxykv needs a mapper checkpoint (--mapper), or use --tiny")
    proxy = getattr(ns, "_proxy_model", None) or proxy_model_of(ns, model)
    context = ScorerContext(model=model, tokenizer=tok, mapper=mapper, proxy=proxy,
                            fields={"proxy_device": ns.proxy_device or ns.device, "compile_mapper": ns.compile_mapper})
    scorers = {method: registry.build(method, context) for method in names}
    runner = scorers.get("proxykv")
    if isinstance(runner, ProxyScorer):
        runner = runner.proxy_model if runner.spec.kind == "model" else model
    return scorers, runner


def shape_mapper_overrides(ns) -> dict:
    """``--mapper-config FIELD=VALUE ...`` as typed fields of the random mapper; only with ``--shape``.

    Raises:
        ValueError: ``--mapper-config`` without ``--shape``, or a bad item.
    """
    items = getattr(ns, "mapper_config", None) or []
    if items and not getattr(ns, "shape", None):
        raise ValueError("--mapper-config changes the random mapper of --shape; a trained mapper keeps its config")
    return mapper_overrides(items)


def _shape_setup(ns):
    """Random-weight target + proxy of real shapes, and a random paper-preset mapper (honest for timing)."""
    from ..mapper.hub import Checkpoint
    from ..mapper.model import HybridAxialMapper
    from ..mapper.proxy import ProxySpec
    from ..testing import tiny_tokenizer
    from ..train.data import target_spec_of
    from .shapes import PAIRS, pair_mapper_config, random_model

    dtype = dtype_of(ns.dtype)
    target = random_model(ns.shape, device=ns.device, dtype=dtype)
    proxy = random_model(PAIRS[ns.shape], device=ns.proxy_device or ns.device, dtype=dtype, seed=1)
    spec = ProxySpec(kind="model", num_layers=proxy.config.num_hidden_layers,
                     num_heads=proxy.config.num_attention_heads, model_id=PAIRS[ns.shape])
    mapper = HybridAxialMapper(pair_mapper_config(ns.shape, **shape_mapper_overrides(ns))).eval()
    ns._proxy_model = proxy
    ns._mapper = Checkpoint(mapper=mapper, proxy=spec, target=target_spec_of(target, ns.shape))
    return target, tiny_tokenizer()  # ids only need to be in range; the tiny byte tokenizer serves KVzip's prompts


def fresh_memory_probe(ns):
    """``(method, context) -> peak prefill bytes``, each measured by a new Python process that sets up what this
    ``proxykv bench`` call does (same model, mapper, keep ratio, dtype, device) and runs :meth:`Bench.peak_once`."""
    options = {k: v for k, v in vars(ns).items() if not k.startswith("_") and _is_json(v)}

    def probe(method: str, n: int) -> int:
        spec = dict(options, methods=[method], context_lengths=[n], out=None, fresh_memory=False)
        done = subprocess.run([sys.executable, "-m", "proxykv_hf.bench.cli", json.dumps(spec)], capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the fresh process measuring {method} at {n} tokens failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])["peak_prefill_bytes"]

    return probe


def _is_json(value) -> bool:
    try:
        json.dumps(value)
    except TypeError:
        return False
    return True


def _setup(ns):
    model, tok = _shape_setup(ns) if ns.shape else load(ns)
    scorers, runner = _scorers(ns, model, tok)
    return model, scorers, runner


def _measure_peak(spec: dict) -> int:
    """The child of :func:`fresh_memory_probe`: print one JSON line with the peak prefill bytes of one point."""

    ns = argparse.Namespace(**spec)
    model, scorers, _ = _setup(ns)
    method, n = ns.methods[0], ns.context_lengths[0]
    peak = Bench(model, scorers, from_args(BenchConfig, ns)).peak_once(method, n)
    print(json.dumps({"method": method, "context": n, "peak_prefill_bytes": peak}))
    return 0


def _environment(ns, model) -> dict:
    """:func:`~proxykv_hf.eval.harness.environment`, the CPU by name and instruction set (a curve resumed on another
    CPU would mix two machines' times), and the options that pick the models."""
    import torch

    from ..models.loading import native_bf16

    env = environment(model)
    env.update(shape=ns.shape, compile_mapper=ns.compile_mapper, mapper=getattr(ns, "mapper", None),
               proxy_model=getattr(ns, "proxy_model", None), cpu=_cpu_name(),
               cpu_capability=torch.backends.cpu.get_cpu_capability(), native_bf16=native_bf16())
    if getattr(ns, "mapper_config", None):
        env["mapper_config"] = list(ns.mapper_config)
    return env


def _cpu_name() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    names = [line.partition(":")[2].strip() for line in info.splitlines() if line.startswith("model name")]
    return names[0] if names else platform.processor()


def earlier_run(out: Path | None, cfg: BenchConfig) -> tuple[BenchConfig, dict | None]:
    """The run saved in ``out`` (``bench.json``, written after each method's row) that this one resumes: the
    config extended to the lengths of both, and the saved summary (None where there is none).

    Raises:
        ValueError: the saved run has another setting than ``cfg`` (any field but the context lengths).
    """
    path = out / "bench.json" if out is not None else None
    if path is None or not path.exists():
        return cfg, None
    summary = json.loads(path.read_text())
    mine = json.loads(json.dumps(asdict(cfg)))
    _same(out, summary["config"], mine, skip="context_lengths")
    lengths = sorted(set(cfg.context_lengths) | {r["context"] for r in summary["rows"]})
    return replace(cfg, context_lengths=lengths), summary


def _same(out: Path, theirs: dict, mine: dict, skip: str = "") -> None:
    for key in sorted((set(theirs) | set(mine)) - {skip}):
        if theirs.get(key) != mine.get(key):
            raise ValueError(f"{out} holds a bench run with {key}={theirs.get(key)!r}, this one has "
                             f"{mine.get(key)!r}: give another --out (a run resumes only the same setting)")


def _save(out: Path, rows: list[dict], cfg: BenchConfig, env: dict) -> None:
    """``bench.json`` whole or not at all (a temporary sibling renamed over it)."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "bench.json.tmp"
    try:
        tmp.write_text(summary_json(rows, cfg, env) + "\n")
        os.replace(tmp, out / "bench.json")
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half-written summary
        raise


def run_bench(ns) -> int:
    out = Path(ns.out) if ns.out else None
    cfg, earlier = earlier_run(out, from_args(BenchConfig, ns))  # a run of another setting fails before any load
    shape_mapper_overrides(ns)  # a bad --mapper-config fails before any model loads
    model, scorers, runner = _setup(ns)
    env = _environment(ns, model)
    if earlier is not None:
        _same(out, earlier["env"], json.loads(json.dumps(env)))
    done = earlier["rows"] if earlier is not None else []
    probe = None
    if cfg.fresh_memory:
        if next(model.parameters()).device.type == "cpu":
            probe = fresh_memory_probe(ns)
        else:
            logger.warning("--fresh-memory applies to the CPU only: on %s the allocator's own peak is used",
                           next(model.parameters()).device)
    bench = Bench(model, scorers, cfg, proxy_runner=runner, memory_probe=probe)
    points = len(cfg.context_lengths) * len(bench.labels())
    pending = points - sum(map(len, bench.measured(done).values()))
    if done:
        logger.warning("resuming the run in %s: %d of %d (context length, method) points measured", out,
                       points - pending, points)
    with tqdm(total=pending, desc="bench", unit="method") as bar:
        rows = bench.run(progress=lambda row: (bar.set_postfix(context=row["context"], method=row["method"],
                                                               ttft_s=f"{row['ttft_s']:.2f}"), bar.update()),
                         done=done, checkpoint=None if out is None else lambda rows: _save(out, rows, cfg, env))
    print(table(rows))
    if out is not None:
        _save(out, rows, cfg, env)  # first: marks the directory bench's
        (out / "bench.md").write_text(table(rows) + "\n")
        plot(rows, out / "bench.png")
    print(summary_json(rows, cfg, env))
    return 0


if __name__ == "__main__":  # the fresh process of ``--fresh-memory``
    sys.exit(_measure_peak(json.loads(sys.argv[1])))
