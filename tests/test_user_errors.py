"""Mistakes a user can make: broken or missing mapper checkpoints, a mapper for a model of another shape, bad values on
the ``proxykv`` command line. Each gives an error that names what is wrong; the command line exits with status 2
and one line, never a traceback."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from proxykv_hf import ProxyKVCache
from proxykv_hf.attention.compat import with_cache
from proxykv_hf.cli import build_parser, main
from proxykv_hf.cli.helpers import load
from proxykv_hf.mapper.hub import (BUNDLED_DIR, BUNDLED_MAPPER, CONFIG_NAME, WEIGHTS_NAME, Checkpoint, TargetSpec,
                                   load_checkpoint, looks_like_local_path)
from proxykv_hf.mapper.model import HybridAxialMapper, MapperConfig
from proxykv_hf.mapper.proxy import ProxySpec
from proxykv_hf.testing import random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")

BUNDLED = BUNDLED_DIR / BUNDLED_MAPPER


@pytest.fixture
def copy_of_bundled(tmp_path):
    return shutil.copytree(BUNDLED, tmp_path / "mapper")


# ------------------------------------------------------------------------------------------------ checkpoints
def test_corrupt_weights_name_the_file(copy_of_bundled):
    (copy_of_bundled / WEIGHTS_NAME).write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="safetensors") as info:
        load_checkpoint(copy_of_bundled)
    assert str(copy_of_bundled / WEIGHTS_NAME) in str(info.value)


def test_malformed_config_names_the_file(copy_of_bundled):
    config = copy_of_bundled / CONFIG_NAME
    config.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON") as info:
        ProxyKVCache.from_pretrained(str(copy_of_bundled), keep_ratio=0.3)
    assert str(config) in str(info.value)
    good = json.loads((BUNDLED / CONFIG_NAME).read_text())
    del good["target"]
    config.write_text(json.dumps(good))
    with pytest.raises(ValueError, match="malformed") as info:
        load_checkpoint(copy_of_bundled)
    assert str(config) in str(info.value) and "target" in str(info.value)


def test_weights_of_another_config_name_both_files(copy_of_bundled):
    config = copy_of_bundled / CONFIG_NAME
    data = json.loads(config.read_text())
    data["mapper"]["d_time"] *= 2
    config.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="do not fit the mapper config") as info:
        load_checkpoint(copy_of_bundled)
    assert str(copy_of_bundled / WEIGHTS_NAME) in str(info.value) and str(config) in str(info.value)


@pytest.mark.parametrize("as_path", [False, True])
def test_missing_local_directory_is_not_a_hub_id(tmp_path, as_path):
    missing = tmp_path / "no_such_dir"
    with pytest.raises(FileNotFoundError, match="does not exist") as info:
        ProxyKVCache.from_pretrained(missing if as_path else str(missing), keep_ratio=0.3)
    assert "no_such_dir" in str(info.value) and "Repo id" not in str(info.value)


@pytest.mark.parametrize("name,is_path", [
    ("/abs/mapper", True), ("./mapper", True), ("../mapper", True), ("~/mapper", True), (".", True),
    ("runs/a/mapper", True), ("org/mapper", False), ("mapper", False), ("proxykv-smollm2-135m-instruct", False),
])
def test_what_looks_like_a_local_path(name, is_path):
    assert looks_like_local_path(name) is is_path


def test_a_pathlib_path_is_always_local():
    from pathlib import Path

    assert looks_like_local_path(Path("mapper"))


# ------------------------------------------------------------------------------------------------ mapper vs model
def _self_proxy_checkpoint(heads=4):
    stats = ["sum"]
    cfg = MapperConfig.tiny(num_proxy_layers=3, num_proxy_heads=heads, num_target_layers=3, num_target_heads=2,
                            num_statistics=len(stats))
    return Checkpoint(mapper=HybridAxialMapper(cfg).eval(),
                      proxy=ProxySpec(kind="self", num_layers=3, num_heads=heads, statistics=stats),
                      target=TargetSpec(model_id="tiny", model_type="llama", num_layers=3, num_kv_heads=2,
                                        num_heads=heads))


def test_query_head_mismatch_is_refused_up_front():
    ckpt = _self_proxy_checkpoint(heads=4)
    ckpt.check_target(tiny_model("llama").config)  # 3 layers, 2 KV heads, 4 query heads: fits
    model = tiny_model("llama", num_attention_heads=8, hidden_size=64)  # same layers and KV heads, 8 query heads
    with pytest.raises(ValueError, match="4 query heads") as info:
        ckpt.check_target(model.config)
    assert "mapper" in str(info.value) and "8 query heads" in str(info.value)
    from proxykv_hf import ProxyScorer

    cache = ProxyKVCache(ProxyScorer(ckpt), keep_ratio=0.3)
    with pytest.raises(ValueError, match="8 query heads"):
        model.generate(**random_prompt(1, 40, seed=1), **with_cache(cache), max_new_tokens=2, do_sample=False,
                       pad_token_id=0)


def test_bundled_mapper_on_a_model_of_other_query_heads():
    ckpt = load_checkpoint(BUNDLED)
    model = tiny_model("llama", num_hidden_layers=30, num_attention_heads=6, num_key_value_heads=3, hidden_size=48)
    with pytest.raises(ValueError, match="9 query heads.*6 query heads"):
        ckpt.check_target(model.config)


# ------------------------------------------------------------------------------------------------ command line
GEN = ["generate", "--tiny", "--method", "snapkv", "--prompt", "hello world", "--max-new-tokens", "2"]


def _exit(argv, capsys):
    """The exit status of ``main(argv)`` and its stderr."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    return info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("extra,words", [
    (["--keep-ratio", "2"], ["--keep-ratio", "(0, 1]", "'2'"]),
    (["--keep-ratio", "abc"], ["--keep-ratio", "'abc'"]),
    (["--prompt-file", "/nonexistent/doc.txt"], ["--prompt-file", "/nonexistent/doc.txt", "does not exist"]),
    (["--method", "proxykv", "--mapper", "/nonexistent/mapper"], ["--mapper", "/nonexistent/mapper", "does not exist"]),
    (["--device", "nonsense"], ["--device", "'nonsense'"]),
])
def test_generate_refuses_bad_values_when_reading_the_command_line(capsys, extra, words):
    code, err = _exit(GEN + extra, capsys)
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("proxykv generate: error: ") and all(w in last for w in words), last


def test_output_and_input_directory_user_errors(tmp_path, capsys):
    existing = tmp_path / "file"
    existing.write_text("x")
    for command in (["eval", "--tiny"], ["bench", "--tiny"]):
        code, err = _exit([*command, "--out", str(existing)], capsys)
        assert code == 2 and "existing file" in err and str(existing) in err
    # a value only the library checks: one line naming the command, status 2, nothing written
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="is not a ProxyKV dataset") as info:
        main(["train", "--data", "/nonexistent/data", "--out", str(out)])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "proxykv train: error: /nonexistent/data is not a ProxyKV dataset: no manifest.json"]
    assert not out.exists()


def test_only_user_errors_become_exits(monkeypatch, capsys):
    """ValueError -> status 2 (or its traceback with -v); any other exception is a bug and propagates."""
    import proxykv_hf.cli.commands as cli

    def fails(error):
        def cmd(ns):
            raise error
        return cmd

    monkeypatch.setattr(cli, "cmd_corpora", fails(ValueError("bad value 7")))
    code, err = _exit(["corpora"], capsys)
    assert code == 2 and err.strip() == "proxykv corpora: error: bad value 7"
    with pytest.raises(ValueError, match="bad value 7"):
        main(["-v", "corpora"])
    monkeypatch.setattr(cli, "cmd_corpora", fails(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        main(["corpora"])


@pytest.mark.slow  # a new Python process imports torch and transformers
def test_no_traceback_from_the_console_entry_point(tmp_path):
    """The real process: one stderr line and status 2 for an error found after parsing."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "proxykv_hf.cli", "train", "--data", "/nonexistent/data", "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "proxykv train: error: /nonexistent/data is not a ProxyKV dataset: no manifest.json"]


def test_tiny_honours_dtype_and_device():
    ns = build_parser().parse_args(["generate", "--tiny", "--dtype", "float16", "--device", "meta", "--prompt", "x"])
    model, _ = load(ns)
    p = next(model.parameters())
    assert p.dtype == torch.float16 and p.device.type == "meta"
    ns = build_parser().parse_args(["generate", "--tiny", "--dtype", "bfloat16", "--prompt", "x"])
    p = next(load(ns)[0].parameters())
    assert p.dtype == torch.bfloat16 and p.device.type == "cpu"  # without --device, --tiny stays on the CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of CUDA where there is none")
def test_cuda_device_refused_without_cuda(capsys):
    code, err = _exit(GEN + ["--device", "cuda"], capsys)
    assert code == 2 and "no CUDA device" in err


def test_bench_help_names_its_json_line(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "one JSON line on stdout" in text and "bench.json" in text


# ------------------------------------------------------------------------------------------------ saved contexts
COMPRESS = ["compress", "--tiny", "--method", "snapkv", "--prompt", "the code is 12. " * 30]


def _no_work(monkeypatch):
    """Make loading the model fail, so that an error must come before any work."""
    import proxykv_hf.cli.commands as cli

    monkeypatch.setattr(cli, "load", lambda ns: pytest.fail("loaded the model before checking --out"))


def test_compress_refuses_an_out_that_is_not_a_saved_context_before_any_work(tmp_path, capsys, monkeypatch):
    user = tmp_path / "webapp"
    (user / "src").mkdir(parents=True)
    (user / "context.json").write_text('{"theme": "dark"}')
    (user / "src" / "main.py").write_text("print('my code')\n")
    readonly = tmp_path / "readonly"
    readonly.mkdir(mode=0o555)
    if os.geteuid() == 0:  # root may write anywhere: pretend, as for any other user
        import proxykv_hf.contexts.directory as context_files

        real = os.access
        monkeypatch.setattr(context_files.os, "access", lambda p, mode: real(p, mode) and Path(p) != readonly)
    _no_work(monkeypatch)
    for out, words in ((user, [str(user), "not a saved proxykv_hf context"]),
                       (readonly / "ctx", [str(readonly), "not writable"])):
        code, err = _exit(COMPRESS + ["--out", str(out)], capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("proxykv compress: error: ") and \
            all(w in lines[0] for w in words), err
    assert (user / "src" / "main.py").read_text() == "print('my code')\n" and sorted(os.listdir(user)) == [
        "context.json", "src"] and os.listdir(readonly) == []


def test_compress_out_and_generate_context_name_the_same_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    main(COMPRESS + ["--out=~/ctx"])
    assert json.loads(capsys.readouterr().out)["out"] == str(tmp_path / "home" / "ctx")
    assert not (tmp_path / "~").exists()
    assert main(["generate", "--tiny", "--context=~/ctx", "--question", "code?", "--max-new-tokens", "2"]) == 0
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    main(COMPRESS + ["--out", "."])  # an empty working directory
    assert sorted(os.listdir(".")) == ["context.json", "context.safetensors"]
    code, err = _exit(["generate", "--tiny", "--context", ".", "--dtype", "bfloat16", "--question", "code?"], capsys)
    assert code == 2 and "--convert-dtype" in err and "dtype='convert'" not in err, err
    capsys.readouterr()
    assert main(["generate", "--tiny", "--context", ".", "--dtype", "bfloat16", "--convert-dtype", "--question",
                 "code?", "--max-new-tokens", "2"]) == 0


def test_an_empty_or_continued_context_says_so(tmp_path, capsys):
    from proxykv_hf import ProxyKVPipeline, SnapKVScorer
    from proxykv_hf.contexts.compressed import encode_context
    from proxykv_hf.testing import tiny_tokenizer

    code, err = _exit(["compress", "--tiny", "--method", "snapkv", "--prompt", "", "--out", str(tmp_path / "x")],
                      capsys)
    assert code == 2 and "the context is empty" in err, err
    model, tok = tiny_model("llama"), tiny_tokenizer()
    pipe = ProxyKVPipeline(model, tok, SnapKVScorer(window=8), keep_ratio=0.3)
    with pytest.raises(ValueError, match="the context is empty"):
        pipe.compress("")
    text = "The code word is ZEBRA-42 and the door opens at nine. " * 3
    ctx = pipe.compress(text)
    c, q = encode_context(tok, text, "first question?")
    ids = torch.tensor([c + q])
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **with_cache(ctx.cache), max_new_tokens=4,
                   do_sample=False, pad_token_id=0)
    with pytest.raises(ValueError, match=rf"holds \d+ tokens, \d+ after the context's {len(c)}: it was continued"):
        pipe.ask(ctx, "second?", max_new_tokens=3)


# ------------------------------------------------------------------------------------------------ checkpoint fields
def test_a_directory_that_is_not_a_checkpoint_is_one_line(tmp_path, capsys):
    empty = tmp_path / "run"  # a typo'd run directory: exists, holds no checkpoint
    empty.mkdir()
    with pytest.raises(OSError, match="is not a ProxyKV mapper checkpoint"):
        load_checkpoint(empty)
    code, err = _exit(GEN + ["--method", "proxykv", "--mapper", str(empty)], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("proxykv generate: error: "), err
    assert all(w in lines[0] for w in (str(empty), CONFIG_NAME, WEIGHTS_NAME, "holds")), lines[0]


@pytest.mark.parametrize("field,value", [
    ("num_layers", 30.0), ("num_layers", "30"), ("num_layers", -5), ("num_layers", True), ("num_kv_heads", 0),
    ("num_heads", 10), ("model_type", 123), ("model_id", None), ("model_id", ""),
])
def test_mistyped_target_fields_name_the_file_and_field(copy_of_bundled, field, value):
    config = copy_of_bundled / CONFIG_NAME
    data = json.loads(config.read_text())
    data["target"][field] = value
    config.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="malformed") as info:
        ProxyKVCache.from_pretrained(str(copy_of_bundled), keep_ratio=0.3)
    assert str(config) in str(info.value) and f"target {field}" in str(info.value) and repr(value) in str(info.value)


@pytest.mark.parametrize("change,words", [
    (lambda t: t.update(layers=30), ["unknown TargetSpec fields", "'layers'"]),
    (lambda t: t.pop("num_heads"), ["'num_heads'", "missing"]),
])
def test_unknown_or_missing_target_fields_are_named(copy_of_bundled, change, words):
    config = copy_of_bundled / CONFIG_NAME
    data = json.loads(config.read_text())
    change(data["target"])
    config.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="malformed") as info:
        load_checkpoint(copy_of_bundled)
    assert str(config) in str(info.value) and all(w in str(info.value) for w in words), str(info.value)


def test_a_model_proxy_without_an_id_is_refused(copy_of_bundled, tmp_path, capsys, monkeypatch):
    with pytest.raises(ValueError, match="'model' proxy needs model_id"):
        ProxySpec(kind="model", num_layers=2, num_heads=4)
    config = copy_of_bundled / CONFIG_NAME
    data = json.loads(config.read_text())
    data["proxy"]["kind"] = "model"  # model_id stays null
    config.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="model_id") as info:
        load_checkpoint(copy_of_bundled)
    assert str(config) in str(info.value) and "'proxy'" in str(info.value) and "None" in str(info.value)
    _no_work(monkeypatch)
    code, err = _exit(["build-data", "--tiny", "--tasks", "niah_single_1", "--proxy-kind", "model", "--out",
                       str(tmp_path / "d")], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and lines == ["proxykv build-data: error: --proxy-kind model needs --proxy-model-id: the proxy "
                                   "model's name, directory or Hub id"], err
    from proxykv_hf.models.loading import load_model

    with pytest.raises(ValueError, match="no model given"):  # never looked up on the Hub as "None"
        load_model(None)


@pytest.mark.parametrize("extra,words", [
    (["--context-lengths", "-64"], ["context_lengths", "-64"]), (["--context-lengths", "0"], ["context_lengths"]),
    (["--decode-tokens", "-2"], ["decode_tokens", "-2"]), (["--warmup", "-1"], ["warmup", "-1"]),
    (["--repeats", "0"], ["repeats", "0"]), (["--keep-ratio", "1.5"], ["keep_ratio", "1.5"]),
])
def test_bench_numbers_are_checked_before_any_model_loads(capsys, monkeypatch, extra, words):
    import proxykv_hf.bench.cli as bench_cli

    monkeypatch.setattr(bench_cli, "_setup", lambda ns: pytest.fail("loaded a model before checking the numbers"))
    code, err = _exit(["bench", "--tiny", "--methods", "full", *extra], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("proxykv bench: error: "), err
    assert all(w in lines[0] for w in words), lines[0]
