"""ContextStore (proxykv_hf/store.py): each text is compressed once and loaded afterwards, keyed by everything that
decides the compression; entries appear whole or not at all, two processes may fill one store at once, and the least
recently used entries go past a size limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from proxykv_hf import ContextStore, ProxyKVPipeline, SnapKVScorer
from proxykv_hf.contexts.directory import temp_name
from proxykv_hf.contexts.format import TENSORS_NAME
from proxykv_hf.testing import tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")

TEXT = "The code word is ZEBRA-42, and the door opens at nine. " * 3
QUESTIONS = ["What is the code word?", "When does the door open?"]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def pipeline(model, keep_ratio: float = 0.3, window: int = 8, **kwargs) -> ProxyKVPipeline:
    return ProxyKVPipeline(model, tiny_tokenizer(), SnapKVScorer(window=window), keep_ratio=keep_ratio, **kwargs)


def test_a_text_is_compressed_once_then_loaded(model, tmp_path, monkeypatch):
    pipe = pipeline(model)
    store = ContextStore(tmp_path / "store")
    first = store.get_or_compress(pipe, TEXT)
    answers = pipe.ask(first, QUESTIONS, max_new_tokens=5)
    assert (store.hits, store.misses) == (0, 1) and len(store.entries()) == 1

    def no_compression(text):
        raise AssertionError("compressed again")

    monkeypatch.setattr(pipe, "compress", no_compression)
    again = ContextStore(tmp_path / "store").get_or_compress(pipe, TEXT)  # another store object, as a later run
    assert again.text == TEXT and pipe.ask(again, QUESTIONS, max_new_tokens=5) == answers
    assert answers == pipeline(model).ask(TEXT, QUESTIONS, max_new_tokens=5)


def test_keys_follow_what_decides_the_compression(model, tmp_path):
    store = ContextStore(tmp_path / "store")
    base = store.key(pipeline(model), TEXT)
    assert base == store.key(pipeline(model), TEXT)
    assert len({base, store.key(pipeline(model, keep_ratio=0.5), TEXT), store.key(pipeline(model, window=4), TEXT),
                store.key(pipeline(model, budget="global"), TEXT), store.key(pipeline(model), TEXT + "."),
                store.key(pipeline(tiny_model("llama", seed=1)), TEXT)}) == 6


def test_a_crashed_writer_leaves_nothing_a_later_run_loads(model, tmp_path, monkeypatch):
    import proxykv_hf.contexts.format as contexts

    pipe, store = pipeline(model), ContextStore(tmp_path / "store")
    real = contexts.save_file

    def crash(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        raise KeyboardInterrupt  # killed after the tensors, before the header and the rename

    monkeypatch.setattr(contexts, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        store.get_or_compress(pipe, TEXT)
    monkeypatch.undo()
    assert store.entries() == []
    stale = store.directory / temp_name("abc")  # what a writer killed outright (no cleanup) leaves
    stale.mkdir()
    (stale / TENSORS_NAME).write_bytes(b"half")
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    store.get_or_compress(pipe, TEXT)
    assert store.misses == 2 and len(store.entries()) == 1 and not stale.exists()


def test_a_damaged_entry_is_compressed_again(model, tmp_path):
    pipe, store = pipeline(model), ContextStore(tmp_path / "store")
    store.get_or_compress(pipe, TEXT)
    (entry,) = store.entries()
    (entry / TENSORS_NAME).write_bytes(b"\0" * 100)
    found = store.get_or_compress(pipe, TEXT)
    assert store.misses == 2 and found.text == TEXT
    assert ContextStore(store.directory).get_or_compress(pipe, TEXT).num_tokens == found.num_tokens


def test_least_recently_used_entries_are_evicted(model, tmp_path):
    pipe = pipeline(model)
    probe = ContextStore(tmp_path / "probe")
    probe.get_or_compress(pipe, TEXT)
    size = probe.nbytes()
    store = ContextStore(tmp_path / "store", max_bytes=int(2.5 * size))
    texts = [TEXT.replace("nine", word) for word in ("one", "two", "six")]  # the same length, the same size
    for i, text in enumerate(texts[:2]):
        store.get_or_compress(pipe, text)
        os.utime(store.directory / store.key(pipe, text), (1000 + i, 1000 + i))
    store.get_or_compress(pipe, texts[0])  # a hit: now the most recently used
    store.get_or_compress(pipe, texts[2])
    names = {p.name for p in store.entries()}
    assert names == {store.key(pipe, texts[0]), store.key(pipe, texts[2])} and store.nbytes() <= 2.5 * size
    with pytest.raises(ValueError, match="max_bytes must be a positive int or None, got 0"):
        ContextStore(tmp_path / "x", max_bytes=0)


@pytest.mark.slow  # a second Python process loads torch and transformers
def test_two_processes_fill_one_store_at_once(model, tmp_path):
    """Another process and this one ask for the same entry at the same moment: both get the context, the store ends
    with one whole entry and nothing else."""
    script = (
        "import json, sys\n"
        "from proxykv_hf import ContextStore, ProxyKVPipeline, SnapKVScorer\n"
        "from proxykv_hf.testing import tiny_model, tiny_tokenizer\n"
        "pipe = ProxyKVPipeline(tiny_model('llama'), tiny_tokenizer(), SnapKVScorer(window=8), keep_ratio=0.3)\n"
        f"store = ContextStore({str(tmp_path / 'store')!r})\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"
        f"ctx = store.get_or_compress(pipe, {TEXT!r})\n"
        f"print(json.dumps(pipe.ask(ctx, {QUESTIONS!r}, max_new_tokens=5)))\n")
    other = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1",
                                                                         OMP_NUM_THREADS="1"))
    pipe = pipeline(model)
    store = ContextStore(tmp_path / "store")
    assert other.stdout.readline().strip() == "ready", other.stderr.read()[-3000:]
    other.stdin.write("go\n")
    other.stdin.flush()
    mine = pipe.ask(store.get_or_compress(pipe, TEXT), QUESTIONS, max_new_tokens=5)  # at the same moment
    out, err = other.communicate(timeout=300)
    assert other.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1]) == mine
    assert [p.name for p in store.directory.iterdir()] == [store.key(pipe, TEXT)]  # one entry, no leftovers
    assert ContextStore(store.directory).get_or_compress(pipe, TEXT).text == TEXT


def test_only_the_stores_own_entries_are_counted_or_evicted(model, tmp_path):
    mine = tmp_path / "store" / "my_project"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("work I did not back up\n")
    (tmp_path / "store" / ".cache.tmp").mkdir()  # a hidden directory of the user's, named like a temporary one
    os.utime(mine, (1000, 1000))  # older than any entry
    pipe, store = pipeline(model), ContextStore(tmp_path / "store", max_bytes=1)
    assert store.entries() == [] and store.nbytes() == 0
    store.get_or_compress(pipe, TEXT)
    store.get_or_compress(pipe, TEXT + ".")  # evicts the first entry, and nothing else
    assert [p.name for p in store.entries()] == [store.key(pipe, TEXT + ".")]
    assert (mine / "notes.txt").read_text() == "work I did not back up\n"
    assert (tmp_path / "store" / ".cache.tmp").is_dir()
    squatter = store.directory / store.key(pipe, TEXT)
    squatter.mkdir()
    (squatter / "context.json").write_text("{}")  # not a header of this library: left alone, before any compression
    pipe.compress = lambda text: pytest.fail("compressed before refusing")
    with pytest.raises(FileExistsError, match=squatter.name):
        store.get_or_compress(pipe, TEXT)
    assert (squatter / "context.json").read_text() == "{}"


def test_an_entry_missing_its_tensor_file_is_repaired_once(model, tmp_path):
    pipe, store = pipeline(model), ContextStore(tmp_path / "store")
    store.get_or_compress(pipe, TEXT)
    (entry,) = store.entries()
    (entry / TENSORS_NAME).unlink()
    assert store.entries() == [entry]  # still the store's own entry, damaged
    for _ in range(3):
        assert store.get_or_compress(pipe, TEXT).text == TEXT
    assert (store.hits, store.misses) == (2, 2) and sorted(p.name for p in entry.iterdir()) == ["context.json",
                                                                                                 TENSORS_NAME]
