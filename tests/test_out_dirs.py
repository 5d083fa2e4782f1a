"""Every ``--out`` (train, eval, bench, build-data, merge-data, compress) is new or empty, or holds only what the same
command wrote there before (recognised by its marker or manifest): anything else is refused in one line, before any
work, and no file the command did not write is ever changed or removed (:mod:`proxykv_hf.cli.out_dirs`)."""

import json
import os
import re
import string
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxykv_hf.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")

DOC = "The meeting moved to Thursday at 3 pm. " * 20


def _build(out, task):
    return ["build-data", "--tiny", "--tasks", task, "--n-per-task", "1", "--tokens", "300", "--crop-len", "128",
            "--stride", "64", "--out", str(out), "--no-progress"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Two tiny datasets of different texts."""
    root = tmp_path_factory.mktemp("data")
    for name, task in (("a", "niah_single_1"), ("b", "niah_single_2")):
        assert main(_build(root / name, task)) == 0
    return root / "a", root / "b"


def _argv(command, out, data):
    """The smallest run of ``command`` writing to ``out``."""
    return {
        "train": ["train", "--data", str(data[0]), "--preset", "tiny", "--epochs", "1", "--no-progress"],
        "eval": ["eval", "--tiny", "--methods", "full", "--keep-ratios", "0.5", "--tasks", "niah_single_1",
                 "--n-samples", "1", "--context-lengths", "300", "--max-new-tokens", "1"],
        "bench": ["bench", "--tiny", "--methods", "full", "--context-lengths", "64", "--repeats", "1", "--warmup",
                  "0", "--decode-tokens", "2"],
        "build-data": _build(out, "niah_single_1")[:-3] + ["--no-progress"],
        "merge-data": ["merge-data", str(data[0]), str(data[1])],
        "compress": ["compress", "--tiny", "--method", "snapkv", "--prompt", DOC],
    }[command] + ["--out", str(out)]


def _run(argv, capsys):
    """Exit status and stderr of ``main(argv)``."""
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and directory (None) under ``root``."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


COMMANDS = ["train", "eval", "bench", "build-data", "merge-data", "compress"]


# ------------------------------------------------------------------------------------------------ examples
def test_train_leaves_a_projects_files_alone(tmp_path, data, capsys):
    user = tmp_path / "my-project"
    user.mkdir()
    mine = {"README.md": b"# My project\nNotes I would hate to lose.\n", "model.safetensors": b"my own weights"}
    for name, content in mine.items():
        (user / name).write_bytes(content)
    code, err = _run(_argv("train", user, data), capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("proxykv train: error: ") and str(user) in lines[0]
    assert {p.name: p.read_bytes() for p in user.iterdir()} == mine
    run = tmp_path / "run"  # its own run directory: written, then resumed (the run is complete: nothing to do)
    assert main(_argv("train", run, data)) == 0
    before = (run / "model.safetensors").read_bytes()
    assert main(_argv("train", run, data)) == 0 and (run / "model.safetensors").read_bytes() == before


def test_eval_leaves_a_model_directory_alone(tmp_path, data, capsys):
    model_dir = tmp_path / "hf-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "llama"}')
    (model_dir / "results.md").write_text("my results")
    code, err = _run(_argv("eval", model_dir, data), capsys)
    assert code == 2 and str(model_dir) in err and "not the output of an earlier `proxykv eval`" in err
    assert (model_dir / "config.json").read_text() == '{"model_type": "llama"}'
    assert sorted(os.listdir(model_dir)) == ["config.json", "results.md"]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_foreign_out_is_refused_before_any_work(command, tmp_path, data, capsys, monkeypatch):
    import proxykv_hf.cli.commands as cli

    monkeypatch.setattr(cli, "load", lambda ns: pytest.fail("loaded a model before checking --out"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, err = _run(_argv(command, out, data), capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"proxykv {command}: error: ") and \
        str(out) in lines[0], err
    assert _tree(out) == {"notes.txt": b"mine"}


def test_each_command_recognises_its_own_output(tmp_path, data):
    from proxykv_hf.cli.out_dirs import OUTPUTS, check_out

    a, _ = data
    check_out("build-data", a)  # a dataset: build-data resumes it
    for command in ("train", "eval", "bench", "merge-data"):
        with pytest.raises(FileExistsError, match=re.escape(str(a))):
            check_out(command, a)
    (a / "notes.txt").write_text("mine")
    try:
        with pytest.raises(FileExistsError, match="notes.txt"):
            check_out("build-data", a)
    finally:
        (a / "notes.txt").unlink()
    (tmp_path / "empty").mkdir()
    for command in OUTPUTS:
        check_out(command, tmp_path / "empty")
        check_out(command, tmp_path / "new" / "dir")
    with pytest.raises(FileExistsError, match="is an existing file"):
        check_out("eval", a / "manifest.json")


def test_out_help_states_the_rule(capsys):
    from proxykv_hf.cli.out_dirs import OUTPUTS, out_help

    for command in COMMANDS:
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert (out_help(command) if command in OUTPUTS else "new or empty") in text, command  # compress: a context


# ------------------------------------------------------------------------------------------------ property
_OWN_NAMES = ["README.md", "model.safetensors", "proxykv_config.json", "log.jsonl", "training.png", "last",
              "config.json", "results.jsonl", "results.md", "accuracy.png", "oracle", "bench.json", "bench.md",
              "manifest.json", "shard-00000.safetensors", "rank-00000-of-00002", "context.json",
              "context.safetensors"]
_NAME = st.sampled_from(_OWN_NAMES) | st.text(string.ascii_letters + string.digits + "._-", min_size=1,
                                              max_size=10).filter(lambda n: n not in (".", ".."))
_LOOKALIKE = [{"version": 1}, {"model_type": "llama"}, {"config": {}, "env": {}}, {"kind": "step"},
              {"format_version": 1, "training": None}, {"format": "proxykv_hf context", "format_version": 2}]
_CONTENT = st.binary(max_size=40) | st.sampled_from(_LOOKALIKE).map(lambda v: json.dumps(v).encode())
_TREE = st.dictionaries(_NAME, _CONTENT | st.dictionaries(_NAME, _CONTENT, max_size=3), min_size=1, max_size=5)


def _write(root: Path, tree: dict) -> None:
    root.mkdir()
    for name, value in tree.items():
        if isinstance(value, dict):
            _write(root / name, value)
        else:
            (root / name).write_bytes(value)


@pytest.mark.parametrize("command", COMMANDS)
@given(tree=_TREE)
@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_no_command_changes_a_file_it_did_not_write(command, tree, data, tmp_path_factory, capsys):
    out = tmp_path_factory.getbasetemp() / f"out-{uuid.uuid4().hex[:8]}"
    _write(out, tree)
    before = _tree(out)
    code, err = _run(_argv(command, out, data), capsys)
    after = _tree(out)
    assert {k: after.get(k, "gone") for k in before} == before, (command, code, err)
    assert code in (0, 2) and "Traceback" not in err
