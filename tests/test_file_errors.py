"""Errors of the file system and of damaged files on the ``proxykv`` command line: a read-only file system, a full
disk, a truncated dataset shard each end the command with one line naming the file or directory and status 2 (the
traceback with ``-v``); merge-data writes its output whole or not at all; a refused run leaves nothing behind."""

import errno
import os
import shutil

import pytest
from safetensors import SafetensorError

from proxykv_hf.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")

FULL_DISK = "Error while serializing: I/O error: No space left on device (os error 28)"


def _build(out, task):
    return ["build-data", "--tiny", "--tasks", task, "--n-per-task", "2", "--tokens", "300", "--crop-len", "128",
            "--stride", "64", "--shard-size", "1", "--out", str(out), "--no-progress"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Two tiny datasets of different texts (several shards each)."""
    root = tmp_path_factory.mktemp("data")
    for name, task in (("a", "niah_single_1"), ("b", "niah_single_2")):
        assert main(_build(root / name, task)) == 0
    return root / "a", root / "b"


def _one_line(argv, capsys, command):
    """The one stderr line of ``main(argv)``, which must exit with status 2."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(lines) == 1 and lines[0].startswith(f"proxykv {command}: error: "), lines
    return lines[0]


def _full_disk(*args, **kwargs):
    raise SafetensorError(FULL_DISK)


# ------------------------------------------------------------------------------------------------ file system
@pytest.mark.parametrize("command", ["eval", "bench", "build-data", "train", "merge-data"])
def test_a_read_only_out_is_refused_before_any_work(command, tmp_path, data, capsys, monkeypatch):
    import proxykv_hf.bench.cli as bench_cli
    import proxykv_hf.cli.out_dirs as out_dirs

    import proxykv_hf.cli.commands as cli

    ro = tmp_path / "ro"
    ro.mkdir()
    real_access = os.access

    class ReadOnly:
        f_flag = os.ST_RDONLY

    monkeypatch.setattr(out_dirs.os, "access", lambda p, mode: real_access(p, mode) and str(p) != str(ro))
    monkeypatch.setattr(out_dirs.os, "statvfs", lambda p: ReadOnly())
    for module in (cli, bench_cli):
        monkeypatch.setattr(module, "load", lambda ns: pytest.fail("loaded a model before checking --out"))
    argv = {"eval": ["eval", "--tiny"], "bench": ["bench", "--tiny"], "build-data": _build(ro, "niah_single_1")[:-3],
            "train": ["train", "--data", str(data[0])], "merge-data": ["merge-data", *map(str, data)]}[command]
    line = _one_line([*argv, "--out", str(ro / "out")], capsys, command)
    assert str(ro / "out") in line and "read-only file system" in line
    assert os.listdir(ro) == []


def test_environment_errors_are_one_line_and_bugs_keep_their_traceback(monkeypatch, capsys):
    import proxykv_hf.cli.commands as cli

    def raising(error):
        def cmd(ns):
            raise error
        return cmd

    for error, words in ((OSError(errno.EROFS, "Read-only file system", "/x/out/a.json"), "/x/out/a.json: Read-only"),
                         (OSError(errno.ENOSPC, "No space left on device", "/x/b"), "/x/b: No space left"),
                         (SafetensorError(FULL_DISK), "No space left on device")):
        monkeypatch.setattr(cli, "cmd_corpora", raising(error))
        assert words in _one_line(["corpora"], capsys, "corpora")
        with pytest.raises(type(error)):
            main(["-v", "corpora"])  # -v: the traceback
    for bug in (SafetensorError("Some tensors share memory"), OSError(errno.EBADF, "Bad file descriptor")):
        monkeypatch.setattr(cli, "cmd_corpora", raising(bug))
        with pytest.raises(type(bug)):
            main(["corpora"])


def test_compress_on_a_full_disk_names_the_file_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    import proxykv_hf.contexts.format as contexts

    monkeypatch.setattr(contexts, "save_file", _full_disk)
    line = _one_line(["compress", "--tiny", "--method", "snapkv", "--prompt", "the code is 12. " * 30, "--out",
                      str(tmp_path / "ctx")], capsys, "compress")
    assert str(tmp_path / "ctx" / "context.safetensors") in line and "No space left on device" in line
    assert os.listdir(tmp_path) == []


def test_merge_on_a_full_disk_leaves_nothing(tmp_path, data, capsys, monkeypatch):
    import proxykv_hf.train.shards as shards

    monkeypatch.setattr(shards, "save_file", _full_disk)
    line = _one_line(["merge-data", *map(str, data), "--out", str(tmp_path / "m")], capsys, "merge-data")
    assert str(tmp_path / "m" / "shard-00000.safetensors") in line and "No space left on device" in line
    assert os.listdir(tmp_path) == []
    (tmp_path / "empty").mkdir()  # an empty --out is left empty
    _one_line(["merge-data", *map(str, data), "--out", str(tmp_path / "empty")], capsys, "merge-data")
    assert os.listdir(tmp_path / "empty") == []


def test_train_on_a_full_disk_names_the_file(tmp_path, data, capsys, monkeypatch):
    import proxykv_hf.mapper.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "save_file", _full_disk)
    line = _one_line(["train", "--data", str(data[0]), "--out", str(tmp_path / "run"), "--preset", "tiny",
                      "--epochs", "1", "--no-progress"], capsys, "train")
    assert str(tmp_path / "run" / "model.safetensors") in line and "No space left on device" in line


# ------------------------------------------------------------------------------------------------ damaged data
def test_a_truncated_shard_is_one_line_naming_it(tmp_path, data, capsys):
    a = shutil.copytree(data[0], tmp_path / "a")
    shard = a / "shard-00000.safetensors"
    os.truncate(shard, shard.stat().st_size // 2)
    for argv, command in ((["merge-data", str(a), str(data[1]), "--out", str(tmp_path / "m")], "merge-data"),
                          (["train", "--data", str(a), "--out", str(tmp_path / "t"), "--preset", "tiny", "--epochs",
                            "1", "--no-progress"], "train")):
        line = _one_line(argv, capsys, command)
        assert str(shard) in line and "damaged or truncated" in line
    assert not (tmp_path / "m").exists()
    with pytest.raises(ValueError, match="damaged or truncated"):  # -v: the traceback
        main(["-v", "merge-data", str(a), str(data[1]), "--out", str(tmp_path / "m")])


def test_merge_checks_every_shard_before_writing(tmp_path, data, capsys):
    a = shutil.copytree(data[0], tmp_path / "a")
    last = sorted(a.glob("shard-*.safetensors"))[-1]
    assert last.name != "shard-00000.safetensors"  # a shard after the first: the first would be copied already
    last.rename(tmp_path / last.name)
    out = tmp_path / "merged"
    line = _one_line(["merge-data", str(a), str(data[1]), "--out", str(out)], capsys, "merge-data")
    assert str(last) in line and "missing" in line
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["a", last.name]
    (tmp_path / last.name).rename(last)  # repaired: the same command works
    assert main(["merge-data", str(a), str(data[1]), "--out", str(out)]) == 0
    assert (out / "manifest.json").is_file()


# ------------------------------------------------------------------------------------------------ refused runs
def test_a_refused_eval_leaves_nothing(tmp_path, capsys):
    out = tmp_path / "ev"
    line = _one_line(["eval", "--tiny", "--methods", "full", "--keep-ratios", "0.5", "--tasks", "niah_single_1",
                      "--n-samples", "1", "--context-lengths", "0", "--out", str(out)], capsys, "eval")
    assert "target_tokens" in line and not out.exists()


def test_build_data_files_without_text_say_so(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "notes.md").write_text("a markdown file\n")
    (tmp_path / "empty.txt").write_text("\n")
    for files, words in (([docs], [str(docs), ".txt or .jsonl"]), ([tmp_path / "empty.txt"], ["no text"])):
        line = _one_line(["build-data", "--tiny", "--files", *map(str, files), "--out", str(tmp_path / "d"),
                          "--no-progress"], capsys, "build-data")
        assert all(w in line for w in words) and "give --tasks" not in line, line
    assert not (tmp_path / "d").exists()
