"""A scorer added in one file and one registration runs through generate, `proxykv eval` and `proxykv bench`."""

import json

import pytest

from proxykv_hf import ProxyKVCache
from proxykv_hf.attention.compat import with_cache
from proxykv_hf.cli import main
from proxykv_hf.scorers import ScorerContext, registry
from proxykv_hf.testing import random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture
def toy():
    main_argv = ["--plugin", "toy_scorer"]
    yield main_argv
    if "toy_keynorm" in registry.names():
        registry.unregister("toy_keynorm")


@pytest.mark.slow  # three whole commands on a tiny model
def test_plugin_through_generate_eval_and_bench(tmp_path, toy, capsys):
    main(["generate", "--tiny", "--method", "toy_keynorm", "--keep-ratio", "0.5", "--prompt", "hello " * 30,
          "--max-new-tokens", "3", *toy])
    assert "toy_keynorm" in registry.names()
    model = tiny_model("llama")
    inputs = random_prompt(2, 40, lengths=[40, 27], seed=1)
    cache = ProxyKVCache(registry.build("toy_keynorm", ScorerContext(model=model)), keep_ratio=0.25)
    model.generate(**inputs, **with_cache(cache), max_new_tokens=2, do_sample=False, pad_token_id=0)
    layer = cache.layers[0]
    assert layer.kept_positions.shape[-1] == 10 and layer.budgets.tolist() == [10, 7]
    assert layer.keys.shape[-2] == 11  # 10 kept, then the first generated token (the last one is not fed back)

    out = tmp_path / "eval"
    main(["eval", "--tiny", "--methods", "full", "toy_keynorm", "--keep-ratios", "0.3", "--tasks", "niah_single_1",
          "--context-lengths", "200", "--n-samples", "1", "--max-new-tokens", "2", "--out", str(out), *toy])
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {(r["method"], r["keep_ratio"]) for r in records} == {("full", 1.0), ("toy_keynorm", 0.3)}

    main(["bench", "--tiny", "--methods", "toy_keynorm", "--context-lengths", "64", "--repeats", "1",
          "--warmup", "0", "--decode-tokens", "2", "--out", str(tmp_path / "bench"), *toy])
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    toy_row = next(r for r in rows if r["method"] == "toy_keynorm")
    assert toy_row["kv_bytes"] < next(r for r in rows if r["method"] == "full")["kv_bytes"]
    assert toy_row["flops"] is None  # the toy counts no FLOPs


def test_unknown_plugin_is_a_clear_error():
    with pytest.raises(SystemExit, match="could not import scorer plugin 'no_such_module'"):
        main(["eval", "--tiny", "--plugin", "no_such_module", "--methods", "full"])


def test_unknown_plugin_exits_with_status_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["eval", "--tiny", "--plugin", "no_such_module", "--methods", "full"])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().startswith("proxykv: error: could not import scorer plugin")


def test_plugin_is_found_in_the_working_directory(tmp_path, monkeypatch):
    """The installed ``proxykv`` script has no working directory on sys.path; ``--plugin mymethods`` still imports
    ./mymethods.py (and leaves sys.path as it was)."""
    import sys

    name = "cwd_plugin_for_test"
    (tmp_path / f"{name}.py").write_text(
        "from proxykv_hf.scorers import register\n"
        "from proxykv_hf.scorers.random import RandomScorer\n"
        f"register({name!r}, lambda ctx: RandomScorer(), 'from the working directory')\n")
    monkeypatch.chdir(tmp_path)
    path = [p for p in sys.path if p not in ("", ".", str(tmp_path))]  # as under the console script
    monkeypatch.setattr(sys, "path", list(path))
    try:
        registry.load_plugins([name])
        assert name in registry.names() and sys.path == path
        with pytest.raises(ValueError, match="could not import scorer plugin"):
            registry.load_plugins([name + "_missing"])
        assert sys.path == path
    finally:
        sys.modules.pop(name, None)
        if name in registry.names():
            registry.unregister(name)
