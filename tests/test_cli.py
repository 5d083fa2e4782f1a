"""The proxykv command on tiny models: every subcommand runs end to end in seconds."""

import argparse
import json
import subprocess

import pytest
import torch

from proxykv_hf.cli import main


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.slow  # a whole command on a tiny model
def test_eval_tiny(tmp_path, capsys):
    out = tmp_path / "eval"
    main(["eval", "--tiny", "--methods", "full", "kvzip", "snapkv", "streaming", "random", "proxykv", "kvzip_iam",
          "--keep-ratios", "0.3", "0.7", "--tasks", "niah_single_1", "--context-lengths", "300", "--n-samples", "2",
          "--max-new-tokens", "4", "--out", str(out), "--kvzip-chunk", "128"])
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(records) == 2 * (1 + 6 * 2)
    assert {r["method"] for r in records} == {"full", "kvzip", "snapkv", "streaming", "random", "proxykv",
                                               "kvzip_iam"}
    kv = {(r["method"], r["keep_ratio"]): r["kv_bytes"] for r in records if r["sample"] == 0}
    assert kv[("snapkv", 0.3)] < kv[("snapkv", 0.7)] < kv[("full", 1.0)]
    fid = [r for r in records if r["method"] == "kvzip"]
    assert all(r["topk_recall"] == pytest.approx(1.0) for r in fid)  # the oracle against itself
    assert (out / "results.md").exists() and (out / "accuracy.png").exists()
    # resumable: a second run adds nothing
    main(["eval", "--tiny", "--methods", "full", "snapkv", "--keep-ratios", "0.3", "0.7", "--tasks", "niah_single_1",
          "--context-lengths", "300", "--n-samples", "2", "--max-new-tokens", "4", "--out", str(out)])
    assert len((out / "results.jsonl").read_text().splitlines()) == len(records)
    assert "ProxyKV / KVzip" in capsys.readouterr().out


@pytest.mark.slow  # a whole command on a tiny model
def test_demo_tiny(capsys):
    """The README's main command, on a tiny random model: a row per method with its keep ratio, right answers out
    of the questions asked and the cache size, each question's answers, and the summary line."""
    main(["demo", "--tiny", "--questions", "2"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("method "))
    rows = {line.split()[0]: line.split() for line in lines[head + 1:head + 5]}
    assert sorted(rows) == ["full", "kvzip", "proxykv", "snapkv"]
    assert rows["full"][1] == "1.00" and rows["proxykv"][1] == "0.30"
    assert all(row[2].endswith("/2") for row in rows.values())
    assert float(rows["proxykv"][-1]) < float(rows["full"][-1])  # KV MiB kept
    assert sum(line.startswith("Q") for line in lines) == 2
    assert lines[-1].startswith("of the ") and "still answered: proxykv" in lines[-1]


def test_demo_refuses_a_question_count_it_does_not_have(capsys):
    for bad in ("0", "6"):
        with pytest.raises(SystemExit) as err:
            main(["demo", "--tiny", "--questions", bad])
        assert err.value.code == 2
    assert "--questions: invalid choice" in capsys.readouterr().err


def test_demo_summary_counts_only_what_the_full_cache_answers():
    from proxykv_hf.cli.demo import Question, _print_tables

    questions = [Question("a?", ["1"]), Question("b?", ["2"]), Question("c?", ["3"])]
    results = {"full": {"answers": ["1", "x", "3"], "correct": [True, False, True], "ttft_s": 1.0, "kv_bytes": 2**20,
                        "keep_ratio": 1.0},
               "snapkv": {"answers": ["1", "2", "x"], "correct": [True, True, False], "ttft_s": 1.0,
                          "kv_bytes": 2**19, "keep_ratio": 0.3}}
    lines = []
    _print_tables(results, questions, lines.append)
    assert lines[-1] == "\nof the 2 questions the full cache answers, still answered: snapkv 1"


def test_demo_document_answers_are_in_the_file():
    from proxykv_hf.cli.demo import demo_document

    context, questions = demo_document()
    assert len(questions) == 5
    for q in questions:
        assert any(a in context for a in q.answers), q


def test_bundled_mapper_follows_the_model(tmp_path):
    from argparse import Namespace

    from proxykv_hf.cli.helpers import mapper_for
    from proxykv_hf.mapper.hub import BUNDLED_DIR

    assert mapper_for(Namespace(model="smollm2-135m-instruct", mapper=None), None) == str(
        BUNDLED_DIR / "proxykv-smollm2-135m-instruct")
    assert mapper_for(Namespace(model=str(tmp_path), mapper=None), None) is None  # no mapper for an unknown model
    assert mapper_for(Namespace(model=str(tmp_path), mapper="org/m"), None) == "org/m"


def test_generate_tiny(capsys):
    main(["generate", "--tiny", "--method", "snapkv", "--keep-ratio", "0.5", "--prompt", "hello " * 30,
          "--max-new-tokens", "3"])
    main(["generate", "--tiny", "--method", "proxykv", "--prompt", "the code is 12. " * 10, "--question", "code?",
          "again?", "--max-new-tokens", "3"])
    assert capsys.readouterr().out.count("\n") >= 2


@pytest.mark.slow  # a whole command on a tiny model
def test_bench_tiny(tmp_path, capsys):
    main(["bench", "--tiny", "--methods", "full", "snapkv", "kvzip", "proxykv", "--context-lengths", "64", "128",
          "--repeats", "1", "--decode-tokens", "4", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert "8/8" in captured.err  # the progress bar: one step per (context, method)
    rows = json.loads(captured.out.strip().splitlines()[-1])["rows"]
    assert {(r["context"], r["method"]) for r in rows} == {(n, m) for n in (64, 128)
                                                            for m in ("full", "snapkv", "kvzip", "proxykv")}
    full = [r for r in rows if r["method"] == "full"]
    assert all(r["ttft_vs_full"] == 1.0 for r in full)
    snap = [r for r in rows if r["method"] == "snapkv" and r["context"] == 128][0]
    assert snap["kv_bytes"] < full[1]["kv_bytes"]
    prox = [r for r in rows if r["method"] == "proxykv"][0]
    assert {"proxy_s", "mapper_s", "compact_s", "overlap_fraction"} <= set(prox["breakdown"])
    assert (tmp_path / "bench.png").exists() and (tmp_path / "bench.md").exists()
    # matmul FLOPs by part for every method; the --tiny mapper reads a model proxy, whose forward and mapper count;
    # on the CPU its statistics come from the same softmax as its attention output (no recomputation)
    assert all(r["flops_vs_full"] == 1.0 and set(r["flops"]) == {"target", "total"} for r in full)
    parts = prox["flops"]
    assert min(parts["proxy"], parts["mapper"]) > 0 and parts["statistics"] == 0
    assert parts["target"] == full[0]["flops"]["total"] and prox["flops_vs_full"] == parts["total"] / parts["target"]
    kvzip = [r for r in rows if r["method"] == "kvzip" and r["context"] == 128][0]["flops"]
    assert set(kvzip) == {"target", "repeat", "scoring", "total"} and kvzip["repeat"] > kvzip["target"]
    assert snap["flops"]["statistics"] > 0 and all(r["flops"]["total"] == sum(v for k, v in r["flops"].items()
                                                                             if k != "total") for r in rows)
    assert json.loads(captured.out.strip().splitlines()[-1])["env"]["compile_mapper"] is False
    md = (tmp_path / "bench.md").read_text().splitlines()
    cells = {tuple(c.strip() for c in line.split("|")[1:3]): line.split("|")[5].strip() for line in md[2:]}
    assert md[0].split("|")[5].strip() == "FLOPs / full" and all(len(line.split("|")) == 13 for line in md)
    assert cells[("64", "full")] == "1.00" and float(cells[("64", "proxykv")]) > 1 and float(cells[("64", "kvzip")]) > 2


def test_bench_resumes_a_stopped_run(tmp_path, capsys, monkeypatch):
    """bench.json is saved after each method's row; the same command again measures only what is missing (a length
    stopped between two methods goes on at the next), a new length extends the curve, and a run of another setting
    is refused before any model loads."""
    from proxykv_hf.bench.run import Bench

    def args(*lengths, keep="0.3"):
        return ["bench", "--tiny", "--methods", "full", "snapkv", "--context-lengths", *lengths, "--repeats", "1",
                "--warmup", "0", "--decode-tokens", "2", "--keep-ratio", keep, "--out", str(tmp_path)]

    real, order = Bench._prefill, []

    def prefill(self, method, ids):
        if (method, ids.shape[1]) == ("snapkv", 96) and ("stopped", 0) not in order:  # stops in its second length
            raise KeyboardInterrupt
        order.append((method, ids.shape[1]))
        return real(self, method, ids)

    monkeypatch.setattr(Bench, "_prefill", prefill)
    with pytest.raises(KeyboardInterrupt):
        main(args("64", "96"))
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert [(r["context"], r["method"]) for r in saved["rows"]] == [(64, "full"), (64, "snapkv"), (96, "full")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]
    del order[:]
    order.append(("stopped", 0))
    main(args("64", "96"))
    assert set(order[1:]) == {("snapkv", 96)}  # only the point it stopped at
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert rows[:3] == saved["rows"] and [(r["context"], r["method"]) for r in rows[3:]] == [(96, "snapkv")]
    assert rows[3]["ttft_vs_full"] == rows[3]["ttft_s"] / rows[2]["ttft_s"]  # against the saved full row
    del order[1:]
    main(args("128"))
    assert {n for _, n in order[1:]} == {128}
    summary = json.loads((tmp_path / "bench.json").read_text())
    assert [r["context"] for r in summary["rows"]] == [64, 64, 96, 96, 128, 128]
    assert summary["config"]["context_lengths"] == [64, 96, 128] and "| 128 | snapkv |" in (tmp_path / "bench.md")\
        .read_text()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    del order[1:]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(args("256", keep="0.5"))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "keep_ratio=0.3" in err[0] and "another --out" in err[0]
    assert order[1:] == [] and {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_bench_compile_mapper_reaches_the_scorer(tmp_path, capsys, monkeypatch):
    """``--compile-mapper`` hands the ProxyKV scorer ``compile_mapper=True`` (its encoder's forward goes through
    ``torch.compile``, replaced here by a marker so that the test does not compile) and the JSON records it."""
    import torch

    compiled = []

    def fake_compile(fn):
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)

        wrapper._torchdynamo_orig_callable = fn
        compiled.append(fn)
        return wrapper

    monkeypatch.setattr(torch, "compile", fake_compile)
    main(["bench", "--tiny", "--methods", "full", "proxykv", "--context-lengths", "64", "--repeats", "1",
          "--warmup", "0", "--decode-tokens", "0", "--compile-mapper"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["env"]["compile_mapper"] is True and len(compiled) == 1
    assert type(compiled[0].__self__).__name__ == "TimeEncoder" and compiled[0].__name__ == "forward"


def test_bench_times_the_methods_in_turn(capsys, monkeypatch):
    """The timed prefills go full, snapkv, full, snapkv, ... so that a drift in the machine's speed reaches every
    method alike; then one more prefill per method for its memory and decode."""
    from proxykv_hf.bench.run import Bench

    order = []
    real = Bench._prefill
    monkeypatch.setattr(Bench, "_prefill", lambda self, method, ids: order.append((method, ids.shape[1]))
                        or real(self, method, ids))
    main(["bench", "--tiny", "--methods", "full", "snapkv", "--context-lengths", "96", "--repeats", "3",
          "--warmup", "0", "--decode-tokens", "0"])
    assert order == [("full", 96), ("snapkv", 96)] * 3 + [("full", 96), ("snapkv", 96)]
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert [len(r["ttft_runs_s"]) for r in rows] == [3, 3]


def test_bench_mapper_config_sets_the_shape_mapper_only():
    """``--mapper-config`` reaches the random mapper of ``--shape`` (checked on its config, without building the
    8B model), is refused without ``--shape`` before any model loads, and checks its fields."""
    import argparse

    from proxykv_hf.bench.cli import shape_mapper_overrides
    from proxykv_hf.bench.shapes import pair_mapper_config

    ns = argparse.Namespace(shape="llama-3.1-8b", mapper_config=["stride=2048"])
    config = pair_mapper_config(ns.shape, **shape_mapper_overrides(ns))
    assert config.stride == config.crop_len == 2048 and pair_mapper_config(ns.shape).stride == 1024
    assert config.num_target_layers == 32 and config.num_proxy_layers == 16  # the shape's fields stay
    with pytest.raises(SystemExit, match="random mapper of --shape"):
        main(["bench", "--tiny", "--methods", "full", "--context-lengths", "64", "--mapper-config", "stride=64"])
    with pytest.raises(ValueError, match="--mapper-config expects"):
        shape_mapper_overrides(argparse.Namespace(shape="llama-3.1-8b", mapper_config=["strides=2048"]))


@pytest.mark.slow  # a whole command on a tiny model
def test_bench_fresh_memory(tmp_path, capsys, monkeypatch):
    """--fresh-memory: each point's peak prefill memory comes from a new process set up like this call (one per
    method and length), and the rows say how their peak was measured."""
    from proxykv_hf.bench import cli as bench_cli

    calls = []
    real = bench_cli.subprocess.run
    monkeypatch.setattr(bench_cli.subprocess, "run", lambda args, **k: calls.append(args) or real(args, **k))
    main(["bench", "--tiny", "--methods", "full", "proxykv", "--budgets", "uniform", "global", "--context-lengths",
          "96", "--repeats", "1", "--warmup", "0", "--decode-tokens", "0", "--fresh-memory"])
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert [r["method"] for r in rows] == ["full", "proxykv", "proxykv@global"]
    assert [r["peak_measure"] for r in rows] == ["fresh process, sampled RSS"] * 3
    assert all(r["peak_prefill_bytes"] >= 0 for r in rows)
    specs = [json.loads(args[-1]) for args in calls if "proxykv_hf.bench.cli" in args]  # not e.g. uname -p
    assert [(s["methods"], s["context_lengths"], s["tiny"], s["fresh_memory"]) for s in specs] == [
        (["full"], [96], True, False), (["proxykv"], [96], True, False), (["proxykv@global"], [96], True, False)]
    main(["bench", "--tiny", "--methods", "full", "--context-lengths", "96", "--repeats", "1", "--warmup", "0",
          "--decode-tokens", "0"])
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert rows[0]["peak_measure"] == "this process, sampled RSS"
    assert sum("proxykv_hf.bench.cli" in args for args in calls) == 3  # no new process without --fresh-memory


def test_fresh_memory_child_failure_is_reported(monkeypatch):
    from proxykv_hf.bench import cli as bench_cli

    probe = bench_cli.fresh_memory_probe(argparse.Namespace(tiny=True, methods=["full"], model="not/a-model"))
    monkeypatch.setattr(bench_cli.subprocess, "run", lambda args, **k: subprocess.CompletedProcess(
        args, 1, "", "Traceback ...\nValueError: boom"))
    with pytest.raises(RuntimeError, match="(?s)fresh process measuring snapkv at 64 tokens failed:.*boom"):
        probe("snapkv", 64)


@pytest.mark.parametrize("statistics", [("sum",), ("sum", "max")])
def test_bench_self_proxy_breakdown(tmp_path, capsys, statistics):
    """A self-proxy mapper scores inside the target's prefill: its breakdown says so (no overlap to claim), and
    times the features the mapper reads (the shipped mapper reads sums and maxima)."""
    from proxykv_hf.mapper.hub import Checkpoint, save_checkpoint
    from proxykv_hf.mapper.model import HybridAxialMapper, MapperConfig
    from proxykv_hf.mapper.proxy import ProxySpec
    from proxykv_hf.testing import tiny_model
    from proxykv_hf.train.data import target_spec_of

    model = tiny_model("llama", num_hidden_layers=4)  # the --tiny target
    target = target_spec_of(model, "tiny")
    spec = ProxySpec(kind="self", num_layers=target.num_layers, num_heads=target.num_heads, statistics=statistics)
    cfg = MapperConfig.tiny(num_proxy_layers=spec.num_layers, num_proxy_heads=spec.num_heads,
                            num_target_layers=target.num_layers, num_target_heads=target.num_kv_heads,
                            num_statistics=len(statistics))
    save_checkpoint(Checkpoint(mapper=HybridAxialMapper(cfg).eval(), proxy=spec, target=target), tmp_path / "m")
    main(["bench", "--tiny", "--methods", "full", "proxykv", "--mapper", str(tmp_path / "m"), "--context-lengths",
          "64", "--repeats", "1", "--decode-tokens", "0"])
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    b = [r for r in rows if r["method"] == "proxykv"][0]["breakdown"]
    assert b["proxy_kind"] == "self" and b["overlap_fraction"] == 0.0 and b["proxy_s"] >= 0
    assert b["proxy_dtype"] == "float32"  # the tiny target, which a self proxy is


@pytest.mark.slow  # a whole command on a tiny model
def test_build_data_and_train_tiny(tmp_path, capsys):
    data, mapper = tmp_path / "data", tmp_path / "mapper"
    main(["build-data", "--tiny", "--tasks", "niah_single_1", "--n-per-task", "2", "--tokens", "250",
          "--crop-len", "64", "--stride", "32", "--out", str(data)])
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["data_config"]["dtype"] == "float16"  # the storage dtype, not the model's --dtype
    main(["build-data", "--tiny", "--tasks", "niah_single_1", "--n-per-task", "2", "--tokens", "250",
          "--crop-len", "64", "--stride", "32", "--seed", "7", "--out", str(tmp_path / "data2")])
    main(["merge-data", str(data), str(tmp_path / "data2"), "--out", str(tmp_path / "merged")])
    other = json.loads((tmp_path / "data2" / "manifest.json").read_text())
    merged = json.loads((tmp_path / "merged" / "manifest.json").read_text())
    assert (merged["texts"], merged["crops"]) == (4, manifest["crops"] + other["crops"])
    main(["train", "--data", str(data), "--out", str(mapper), "--preset", "tiny", "--epochs", "1",
          "--warmup-steps", "2", "--batch-size", "4", "--no-progress", "--layers-per-step", "2",
          "--mapper-config", "d_time=16", "num_encoder_heads=2", "ffn_mult=4"])
    from proxykv_hf import ProxyKVCache

    cache = ProxyKVCache.from_pretrained(mapper, keep_ratio=0.5)
    assert cache.scorer.checkpoint.target.num_layers == 4
    assert cache.scorer.mapper.config.d_time == 16 and cache.scorer.mapper.config.ffn_mult == 4
    for bad in (["d_time"], ["width=3"], ["d_time=wide"], ["direct_path=maybe"], ["conv_stem=false"]):
        with pytest.raises(SystemExit, match="--mapper-config"):
            main(["train", "--data", str(data), "--out", str(tmp_path / "x"), "--preset", "tiny",
                  "--mapper-config", *bad])
    main(["train", "--data", str(data), "--out", str(tmp_path / "loss"), "--preset", "tiny", "--max-steps", "1",
          "--no-progress", "--loss", "lambda_cos=2", "rank_ratio=0.3", "--mapper-config", "direct_path=true"])
    saved = json.loads((tmp_path / "loss" / "proxykv_config.json").read_text())
    assert saved["training"]["train_config"]["loss"]["lambda_cos"] == 2.0
    assert saved["training"]["train_config"]["loss"]["rank_ratio"] == 0.3
    assert saved["mapper"]["direct_path"] is True
    for bad in (["lambda_list=2"], ["lambda_cos=high"]):  # the removed listwise term; not a number
        with pytest.raises(SystemExit, match="--loss"):
            main(["train", "--data", str(data), "--out", str(tmp_path / "y"), "--preset", "tiny", "--loss", *bad])



@pytest.mark.slow  # a whole command on a tiny model
def test_build_data_adds_the_max_statistic_without_the_oracle(tmp_path, monkeypatch):
    import proxykv_hf.train.data as data_mod

    data, wide = tmp_path / "data", tmp_path / "wide"
    common = ["build-data", "--tiny", "--tasks", "niah_single_1", "--n-per-task", "2", "--tokens", "250",
              "--crop-len", "64", "--stride", "32"]
    main([*common, "--out", str(data)])

    def no_oracle():
        def fail(*args, **kwargs):
            raise AssertionError("the oracle ran although --scores-from holds every text")
        return fail

    monkeypatch.setattr(data_mod, "default_oracle", no_oracle)
    main([*common, "--proxy-statistics", "sum", "max", "--scores-from", str(data), "--out", str(wide)])
    old, new = (json.loads((d / "manifest.json").read_text()) for d in (data, wide))
    assert new["proxy"]["statistics"] == ["sum", "max"] and new["crops"] == old["crops"]
    assert new["oracle"] == old["oracle"]
    main(["train", "--data", str(wide), "--out", str(tmp_path / "m"), "--preset", "tiny", "--max-steps", "1",
          "--no-progress"])
    saved = json.loads((tmp_path / "m" / "proxykv_config.json").read_text())
    assert saved["mapper"]["num_statistics"] == 2 and saved["mapper"]["input_transform"] == "log1p,log"
    main(["train", "--data", str(wide), "--out", str(tmp_path / "s"), "--preset", "tiny", "--max-steps", "1",
          "--statistics", "sum", "--no-progress"])
    saved = json.loads((tmp_path / "s" / "proxykv_config.json").read_text())
    assert saved["mapper"]["num_statistics"] == 1 and saved["proxy"]["statistics"] == ["sum"]


@pytest.mark.slow  # a whole command on a tiny model
def test_eval_adds_methods_later_with_fidelity(tmp_path, monkeypatch):
    """A second run with a new method (KVzip not among them) reuses the stored KVzip scores for its fidelity,
    without building a KVzip scorer."""
    from proxykv_hf.scorers.kvzip import KVzipScorer

    out = tmp_path / "eval"
    common = ["eval", "--tiny", "--keep-ratios", "0.3", "--tasks", "niah_single_1", "--context-lengths", "300",
              "--n-samples", "1", "--max-new-tokens", "2", "--out", str(out), "--kvzip-chunk", "128"]
    main(common + ["--methods", "full", "kvzip"])
    built = []
    real_init = KVzipScorer.__init__
    monkeypatch.setattr(KVzipScorer, "__init__", lambda self, *a, **k: built.append(1) or real_init(self, *a, **k))
    main(common + ["--methods", "snapkv"])
    assert not built
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    snap = [r for r in records if r["method"] == "snapkv"]
    assert len(snap) == 1 and 0 <= snap[0]["topk_recall"] <= 1 and 0 < snap[0]["mass_recovery"] <= 1
    # ProxyKV with --tiny's random mapper, handed over in memory: the run's config says so
    main(common + ["--methods", "proxykv"])
    assert json.loads((out / "config.json").read_text())["options"]["mapper"] == "a Checkpoint in memory"


def test_eval_report_splits_held_out_families(tmp_path):
    out = tmp_path / "eval"
    main(["eval", "--tiny", "--methods", "full", "kvzip", "snapkv", "--keep-ratios", "0.3", "--tasks",
          "niah_single_1", "vt", "--context-lengths", "300", "--n-samples", "1", "--max-new-tokens", "2",
          "--out", str(out), "--kvzip-chunk", "128", "--held-out", "vt"])
    text = (out / "results.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| snapkv | ")]
    assert any("| trained families |" in r for r in rows) and any("| held-out (vt) |" in r for r in rows)
    held = [r for r in rows if "held-out (vt)" in r][0]
    assert held.count(" / ") == 2  # accuracy / top-K recall / mass
    from proxykv_hf.eval.report import load_results, markdown

    with pytest.raises(ValueError, match="unknown task families"):
        markdown(load_results(out), held_out=["not-a-family"])


def test_eval_generate_protocol(tmp_path):
    out = tmp_path / "gen"
    main(["eval", "--tiny", "--protocol", "generate", "--methods", "full", "snapkv", "--keep-ratios", "0.5",
          "--tasks", "niah_single_1", "--context-lengths", "300", "--n-samples", "1", "--max-new-tokens", "2",
          "--out", str(out)])
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["method"], r["protocol"]) for r in records] == [("full", "generate"), ("snapkv", "generate")]
    assert records[1]["kv_bytes"] < records[0]["kv_bytes"]


def test_every_dataclass_option_has_help(capsys):
    """The options generated from a config dataclass take their help from its docstring's ``Attributes:``: every
    field of the four configs is described there (a new field without a description fails here)."""
    import dataclasses

    from proxykv_hf.bench.run import BenchConfig
    from proxykv_hf.cli import field_docs
    from proxykv_hf.eval.harness import EvalConfig
    from proxykv_hf.train.data import DataConfig
    from proxykv_hf.train.loop import TrainConfig

    for cls in (BenchConfig, EvalConfig, DataConfig, TrainConfig):
        docs = field_docs(cls)
        assert [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)] == [], cls.__name__
    docs = field_docs(TrainConfig)
    assert docs["lr"] == docs["weight_decay"] == "AdamW."  # one line for two fields
    assert docs["eval_batch_size"] == "validation batch size (default batch_size)."  # reST markup dropped
    assert "ReduceLROnPlateau (plateau_factor, plateau_patience epochs)" in docs["warmup_steps"]  # continued line
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    helps = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert "--fresh-memory" in helps and "on the CPU, measure each point's peak prefill memory in a fresh" in helps
    for command in ("bench", "eval"):  # method names are checked when the command line is read
        with pytest.raises(SystemExit):
            main([command, "--methods", "full", "not-a-method"])
        assert "invalid choice: 'not-a-method'" in capsys.readouterr().err


def test_field_docs_edge_cases():
    from proxykv_hf.cli import field_docs

    class NoDoc:
        pass

    class Doc:
        """Summary.

        Attributes:
            a: uses :class:`~pkg.mod.Thing` and 50% of ``x``.
                Second line.

        Note:
            b: not an attribute.
        """

    assert field_docs(NoDoc) == {}
    assert field_docs(Doc) == {"a": "uses Thing and 50% of x. Second line."}


def test_generate_prints_answers_as_plain_text(capsys):
    main(["generate", "--tiny", "--method", "snapkv", "--prompt", "the code is 12. " * 10, "--question", "code?",
          "again?", "--max-new-tokens", "3"])
    out = capsys.readouterr().out
    assert out.startswith("Q: code?\nA: ") and "\n\nQ: again?\nA: " in out and "['" not in out
    main(["generate", "--tiny", "--method", "snapkv", "--prompt", "the code is 12. " * 10, "--question", "code?",
          "--max-new-tokens", "3"])
    out = capsys.readouterr().out
    assert not out.startswith(("Q:", "[")) and out.strip()


def test_install_models_prints_pinned_requirements(capsys):
    main(["install-models", "qwen2.5-coder-0.5b-instruct", "--print-requirements"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 and all(" --hash=sha256:" in line and "==0.9.0" in line for line in lines)
    with pytest.raises(SystemExit) as err:
        main(["install-models", "qwen-7b"])
    assert err.value.code == 2


@pytest.mark.parametrize("argv", [
    ["refit-direct", "--help"], ["combine-mappers", "a", "b", "--weight", "0.5", "--out", "c"],
    ["generate", "--tiny", "--prompt", "x", "--pool-kernel", "3"],
    ["generate", "--tiny", "--prompt", "x", "--layer-mix", "1"], ["eval", "--tiny", "--global-norm", "layer"],
    ["eval", "--tiny", "--out-dir", "x"],
    ["build-data", "--tiny", "--tasks", "vt", "--mapper", ".", "--out", "x"],
    ["build-data", "--tiny", "--tasks", "vt", "--plugin", "os", "--out", "x"],
    ["train", "--data", "d", "--out", "o", "--direct-path-lr-mult", "50"],
    ["train", "--data", "d", "--out", "o", "--layer-embedding-lr-mult", "2"],
])
def test_removed_subcommands_and_options_are_user_errors(argv, capsys):
    """What served finished experiments or did nothing is gone: argparse refuses it in one line, status 2."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


@pytest.mark.slow  # two tiny models saved and loaded, one evaluation sample
def test_eval_proxy_model_is_iams_proxy(tmp_path, monkeypatch):
    """``--proxy-model`` is loaded once, in the target's dtype, and handed to KVzip+IAM (and to ProxyKV)."""
    from proxykv_hf.scorers import iam
    from proxykv_hf.testing import tiny_model, tiny_tokenizer

    for name, layers in (("target", 4), ("proxy", 2)):
        tiny_model("llama", num_hidden_layers=layers).save_pretrained(tmp_path / name)
        tiny_tokenizer().save_pretrained(tmp_path / name)
    seen = []
    real_init = iam.KVzipIAMScorer.__init__

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("proxy"))
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(iam.KVzipIAMScorer, "__init__", spy)
    main(["eval", "--model", str(tmp_path / "target"), "--proxy-model", str(tmp_path / "proxy"), "--dtype",
          "float32", "--methods", "full", "kvzip_iam", "--keep-ratios", "0.5", "--tasks", "niah_single_1",
          "--context-lengths", "200", "--n-samples", "1", "--max-new-tokens", "2", "--out", str(tmp_path / "out")])
    assert seen and seen[0] is not None and seen[0].config.num_hidden_layers == 2
    assert seen[0].dtype == torch.float32


def test_demo_converts_the_target_and_the_proxy_its_mapper_reads_side_by_side(monkeypatch):
    from proxykv_hf.cli import demo
    from proxykv_hf.models import model_cache

    asked = []
    monkeypatch.setattr(model_cache, "convert_packaged", lambda names: asked.append(list(names)))
    ns = argparse.Namespace(model="qwen2.5-coder-1.5b-instruct", methods=["full", "proxykv"], mapper=None, tiny=False)
    demo._convert_side_by_side(ns)
    ns.methods = ["full", "snapkv"]
    demo._convert_side_by_side(ns)
    assert asked == [["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"], ["qwen2.5-coder-1.5b-instruct"]]
