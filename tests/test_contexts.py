"""Compressed contexts on disk (proxykv_hf/contexts.py): a saved cache loaded in another process continues exactly where
it stood, for every kind of scorer, both budgets and a padded batch; whatever does not fit is refused with a message
that names the file, and nothing is loaded half-way."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxykv_hf import KVzipScorer, ProxyKVCache, ProxyKVPipeline, SnapKVScorer
from proxykv_hf.cli import main
from proxykv_hf.attention.compat import with_cache
from proxykv_hf.contexts.format import FORMAT_VERSION, HEADER_NAME, TENSORS_NAME, read_context, write_directory
from proxykv_hf.contexts.pipeline import compress_context
from proxykv_hf.cache.selection import BUDGETS
from proxykv_hf.testing import random_prompt, self_proxy_scorer, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")

LENGTHS = [72, 60]  # a padded batch of 2
QUESTION_SEEDS = (11, 12, 13)
N_NEW = 5


def question(seed: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(4, 200, (batch, 6), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def answer(model, cache: ProxyKVCache, q: torch.Tensor, n_new: int = N_NEW) -> list[list[int]]:
    """Greedy tokens for the question ``q`` `(B, Q)` continuing the cache's conversation (the cache is left as it
    was)."""
    state = cache.snapshot()
    ids = torch.cat([cache.conversation.ids(), q], dim=1)
    mask = torch.cat([cache.prompt.valid.long(), torch.ones(ids.shape[0], ids.shape[1] - cache.prompt.length,
                                                            dtype=torch.long)], dim=1)
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, **with_cache(cache), max_new_tokens=n_new,
                             do_sample=False, pad_token_id=0)
    finally:
        cache.restore(state)
    return out[:, ids.shape[1]:].tolist()


def compressed(model, scorer, budget: str = "uniform", *, seed: int = 5) -> ProxyKVCache:
    inputs = random_prompt(2, max(LENGTHS), lengths=LENGTHS, seed=seed)
    return compress_context(model, ProxyKVCache(scorer, 0.3, budget=budget), inputs["input_ids"],
                            inputs["attention_mask"])


@pytest.fixture(scope="module")
def world():
    model = tiny_model("llama")
    scorers = {"proxykv": self_proxy_scorer(model), "kvzip": KVzipScorer(tiny_tokenizer(), context_chunk=16),
               "snapkv": SnapKVScorer(window=8)}
    return model, tiny_tokenizer(), scorers


@pytest.fixture(scope="module")
def saved(world, tmp_path_factory) -> Path:
    """One saved SnapKV context, copied by the tests that damage it."""
    model, tok, scorers = world
    path = tmp_path_factory.mktemp("saved") / "ctx"
    compressed(model, scorers["snapkv"]).save_context(path, tok)
    return path


@pytest.fixture
def copy(saved, tmp_path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "ctx"))


# ------------------------------------------------------------------------------------------------ continuing
@pytest.mark.slow  # a new Python process loads the contexts
def test_another_process_continues_each_saved_context(world, tmp_path):
    """Saved here, loaded in a fresh Python process: the same greedy tokens for 3 questions, for ProxyKV, KVzip and
    SnapKV under both budgets, on a padded batch of 2."""
    model, tok, scorers = world
    expected = {}
    for name in ("proxykv", "kvzip", "snapkv"):
        for budget in BUDGETS:
            cache = compressed(model, scorers[name], budget)
            cache.save_context(tmp_path / f"{name}-{budget}", tok)
            expected[f"{name}-{budget}"] = [answer(model, cache, question(s)) for s in QUESTION_SEEDS]
    script = (
        "import json, sys, torch\n"
        "torch.set_num_threads(1)\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_contexts import QUESTION_SEEDS, answer, question\n"
        "from proxykv_hf import ProxyKVCache\n"
        "from proxykv_hf.testing import tiny_model, tiny_tokenizer\n"
        "model, tok, out = tiny_model('llama'), tiny_tokenizer(), {}\n"
        f"for name in {sorted(expected)!r}:\n"
        f"    cache = ProxyKVCache.load_context({str(tmp_path)!r} + '/' + name, model, tok)\n"
        "    out[name] = [answer(model, cache, question(s)) for s in QUESTION_SEEDS]\n"
        "print(json.dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == expected
    assert len({json.dumps(v) for v in expected.values()}) > 1  # the methods keep different entries


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("budget", BUDGETS)
def test_a_continued_cache_loads_with_the_same_logits_and_ids(family, budget, tmp_path):
    """A cache that decoded past its prompt (a view of its spare room; Gemma3's sliding layers) loads with the same
    next-token logits, kept sets and ids."""
    model = tiny_model(family)
    inputs = random_prompt(2, 50, lengths=[50, 41], seed=2)
    cache = ProxyKVCache(SnapKVScorer(window=8), 0.3, budget=budget)
    model.generate(**inputs, **with_cache(cache), max_new_tokens=4, do_sample=False, pad_token_id=0)
    cache.save_context(tmp_path / "ctx")
    loaded = ProxyKVCache.load_context(tmp_path / "ctx", model)
    assert torch.equal(loaded.conversation.ids(), cache.conversation.ids())
    assert torch.equal(loaded.prompt.valid, cache.prompt.valid)
    assert loaded.get_seq_length() == cache.get_seq_length() == 53
    assert {i: [[h.tolist() for h in r] for r in rows] for i, rows in loaded.kept_sets().items()} == \
           {i: [[h.tolist() for h in r] for r in rows] for i, rows in cache.kept_sets().items()}
    q = question(3)
    ids = torch.cat([cache.conversation.ids(), q], dim=1)
    mask = torch.cat([cache.prompt.valid.long(), torch.ones(2, ids.shape[1] - 50, dtype=torch.long)], dim=1)
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)[:, -q.shape[1]:]
    logits = []
    for c in (cache, loaded):
        with torch.no_grad():
            logits.append(model(input_ids=q, attention_mask=mask, position_ids=position_ids, **with_cache(c)).logits)
    assert torch.equal(logits[0], logits[1])


def test_a_loaded_cache_checks_the_conversation_as_the_saved_one_did(world, copy):
    model, tok, _ = world
    loaded = ProxyKVCache.load_context(copy, model, tok)
    other = random_prompt(2, 80, seed=9)
    with pytest.raises(ValueError, match="does not continue the conversation"):
        model.generate(**other, **with_cache(loaded), max_new_tokens=2)
    assert answer(model, loaded, question(11)) == answer(model, ProxyKVCache.load_context(copy, model, tok),
                                                          question(11))


def test_a_scorer_given_on_load_must_be_the_one_it_was_compressed_with(world, copy):
    model, tok, scorers = world
    with pytest.raises(ValueError, match="other settings than the scorer given"):
        ProxyKVCache.load_context(copy, model, tok, scorer=SnapKVScorer(window=4))
    loaded = ProxyKVCache.load_context(copy, model, tok, scorer=scorers["snapkv"])
    assert isinstance(loaded.fresh().scorer, SnapKVScorer) and loaded.keep_ratio == 0.3


# ------------------------------------------------------------------------------------------------ refusals
def test_another_model_is_refused(world, copy):
    with pytest.raises(ValueError, match="saved from another model.*num_hidden_layers 3 vs 4") as info:
        ProxyKVCache.load_context(copy, tiny_model("llama", num_hidden_layers=4))
    assert str(copy / HEADER_NAME) in str(info.value)


def test_other_weights_of_the_same_config_are_refused_and_nothing_is_loaded(world, copy):
    other = tiny_model("llama", seed=1)
    with pytest.raises(ValueError, match="same config but other weights") as info:
        ProxyKVCache.load_context(copy, other)
    assert str(copy / HEADER_NAME) in str(info.value)
    assert other.config._attn_implementation == "sdpa"  # the model was not touched


def test_another_tokenizer_is_refused(world, copy):
    model, _, _ = world
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="saved with another tokenizer") as info:
        ProxyKVCache.load_context(copy, model, tok)
    assert str(copy / HEADER_NAME) in str(info.value)


def test_another_dtype_is_refused_unless_converted(world, copy):
    model, tok, _ = world
    half = tiny_model("llama", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="holds float32 K/V, but the model runs in bfloat16.*dtype='convert'"):
        ProxyKVCache.load_context(copy, half, tok)
    loaded = ProxyKVCache.load_context(copy, half, tok, dtype="convert")
    assert all(layer.keys.dtype == torch.bfloat16 for layer in loaded.layers)
    assert len(answer(half, loaded, question(11))[0]) == N_NEW
    with pytest.raises(ValueError, match="dtype must be one of .* got 'cast'"):
        ProxyKVCache.load_context(copy, model, tok, dtype="cast")


def test_a_newer_format_is_refused(world, copy):
    header = json.loads((copy / HEADER_NAME).read_text())
    header["format_version"] = FORMAT_VERSION + 1
    (copy / HEADER_NAME).write_text(json.dumps(header))
    with pytest.raises(ValueError, match=f"format_version {FORMAT_VERSION + 1} .* newer than the {FORMAT_VERSION} "
                                         "this proxykv_hf .* upgrade") as info:
        ProxyKVCache.load_context(copy, world[0])
    assert str(copy / HEADER_NAME) in str(info.value)


@pytest.mark.parametrize("damage, message", [("truncate", "truncated or damaged"), ("flip", "is corrupt"),
                                             ("header", "not valid JSON")])
def test_a_damaged_file_is_refused_naming_it(world, copy, damage, message):
    tensors, header = copy / TENSORS_NAME, copy / HEADER_NAME
    data = bytearray(tensors.read_bytes())
    if damage == "truncate":
        tensors.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        data[len(data) // 2] ^= 0xFF
        tensors.write_bytes(data)
    else:
        header.write_text(header.read_text()[:100])
    with pytest.raises(ValueError, match=message) as info:
        ProxyKVCache.load_context(copy, world[0])
    assert str(header if damage == "header" else tensors) in str(info.value)


def test_missing_files_and_directories(world, copy, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ProxyKVCache.load_context(tmp_path / "nowhere", world[0])
    (copy / TENSORS_NAME).unlink()
    with pytest.raises(FileNotFoundError, match=f"has no {TENSORS_NAME}"):
        ProxyKVCache.load_context(copy, world[0])


def test_what_cannot_be_saved(world, tmp_path):
    model, _, scorers = world
    with pytest.raises(ValueError, match="the ProxyKVCache is empty"):
        ProxyKVCache(scorers["snapkv"], 0.3).save_context(tmp_path / "empty")
    cache = compressed(model, scorers["snapkv"])
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="is not empty and not a saved proxykv_hf context"):
        cache.save_context(tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"


def test_writes_are_whole_or_nothing(world, copy, monkeypatch):
    """A writer that fails half-way leaves no directory, no temporary one, and an older context as it was."""
    import proxykv_hf.contexts.format as contexts

    model, tok, scorers = world
    before = (copy / TENSORS_NAME).read_bytes()

    def crash(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(contexts, "save_file", crash)
    cache = compressed(model, scorers["kvzip"])
    for target in (copy, copy.parent / "new"):
        with pytest.raises(OSError, match="disk full"):
            cache.save_context(target, tok)
    assert (copy / TENSORS_NAME).read_bytes() == before and not (copy.parent / "new").exists()
    assert sorted(p.name for p in copy.parent.iterdir()) == ["ctx"]
    monkeypatch.undo()
    cache.save_context(copy, tok)  # replaces the old context whole
    assert ProxyKVCache.load_context(copy, model, tok).kept_sets().keys() == cache.kept_sets().keys()
    assert (copy / TENSORS_NAME).read_bytes() != before
    assert not write_directory(copy, lambda tmp: (tmp / HEADER_NAME).write_text("{}"), overwrite=False)
    assert sorted(p.name for p in copy.parent.iterdir()) == ["ctx"]  # the loser's copy is gone


# ------------------------------------------------------------------------------------------------ pipeline, CLI
def test_pipeline_compress_save_load_ask(world, tmp_path):
    model, tok, scorers = world
    pipe = ProxyKVPipeline(model, tok, scorers["proxykv"], keep_ratio=0.3)
    text = "The code word is ZEBRA-42. " * 6
    questions = ["What is the code word?", "Repeat the text."]
    context = pipe.compress(text)
    assert context.num_tokens == context.ids.shape[1] > 150 and 0 < context.nbytes
    direct = pipe.ask(text, questions, max_new_tokens=6)
    assert pipe.ask(context, questions, max_new_tokens=6) == direct
    context.save(tmp_path / "ctx")
    loaded = pipe.load(tmp_path / "ctx")
    assert loaded.text == text and loaded.num_tokens == context.num_tokens
    assert pipe.ask(loaded, questions, max_new_tokens=6) == direct
    assert pipe.ask(loaded, questions[0], max_new_tokens=6) == direct[0]  # the context is left as it was
    bare = read_context(tmp_path / "ctx", model, tok, cache_class=ProxyKVCache)
    assert bare.header["scorer"]["class"].endswith("ProxyScorer") and bare.header["cache"]["keep_ratio"] == 0.3


def test_cli_compress_then_generate_from_the_context(tmp_path, capsys):
    prompt = "the code is 12. " * 20
    main(["compress", "--tiny", "--method", "snapkv", "--prompt", prompt, "--out", str(tmp_path / "ctx")])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["tokens"] > 300 and summary["disk_bytes"] > summary["kv_bytes"] > 0
    main(["generate", "--tiny", "--context", str(tmp_path / "ctx"), "--question", "code?", "--max-new-tokens", "4"])
    from_context = capsys.readouterr().out
    main(["generate", "--tiny", "--method", "snapkv", "--prompt", prompt, "--question", "code?",
          "--max-new-tokens", "4"])
    assert from_context == capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["generate", "--context", str(tmp_path / "ctx"), "--question", "code?"])  # names no model
    assert "does not name its model" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ where a save writes
def _tree(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and directory (None) under ``root``, by relative path."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def test_a_directory_that_is_not_a_saved_context_is_never_replaced(world, tmp_path):
    model, tok, scorers = world
    cache = compressed(model, scorers["snapkv"])
    user = tmp_path / "webapp"
    (user / "src").mkdir(parents=True)
    (user / HEADER_NAME).write_text('{"theme": "dark"}')  # an application's own file of that name
    (user / "src" / "main.py").write_text("print('my code')\n")
    before = _tree(user)
    with pytest.raises(FileExistsError, match="not a saved proxykv_hf context") as info:
        cache.save_context(user, tok)
    assert str(user) in str(info.value) and _tree(user) == before
    saved = tmp_path / "ctx"
    cache.save_context(saved, tok)
    (saved / "notes.txt").write_text("mine")  # a saved context with a file of the user's beside it
    with pytest.raises(FileExistsError):
        cache.save_context(saved, tok)
    assert (saved / "notes.txt").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["ctx",
                                                                                                          "webapp"]


def test_saving_keeps_a_private_directory_private(world, tmp_path):
    model, tok, scorers = world
    cache = compressed(model, scorers["snapkv"])
    old_umask = os.umask(0o022)
    try:
        private = tmp_path / "private"
        private.mkdir(mode=0o700)
        cache.save_context(private, tok)  # an empty directory: filled in place
        modes = [private.stat().st_mode & 0o777, *((private / n).stat().st_mode & 0o777 for n in
                                                    (HEADER_NAME, TENSORS_NAME))]
        cache.save_context(private, tok)  # a saved context: replaced, keeping its mode
        modes += [private.stat().st_mode & 0o777, (private / TENSORS_NAME).stat().st_mode & 0o777]
        cache.save_context(tmp_path / "shared", tok)  # a new directory: the umask's permissions
        shared = [(tmp_path / "shared").stat().st_mode & 0o777, (tmp_path / "shared" / HEADER_NAME).stat().st_mode
                  & 0o777]
    finally:
        os.umask(old_umask)
    assert modes == [0o700, 0o600, 0o600, 0o700, 0o600] and shared == [0o755, 0o644]
    assert ProxyKVCache.load_context(private, model, tok).get_seq_length() == cache.get_seq_length()


def test_dot_tilde_and_long_names_are_saved_where_they_say(world, tmp_path, monkeypatch):
    model, tok, scorers = world
    cache = compressed(model, scorers["snapkv"])
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert cache.save_context(".", tok) == here  # an empty working directory, filled in place
    cache.save_context(".", tok)  # and replaced in place: the working directory stays the same directory
    assert sorted(os.listdir(".")) == [HEADER_NAME, TENSORS_NAME]
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.save_context("~/ctx", tok) == tmp_path / "home" / "ctx" and not (here / "~").exists()
    assert ProxyKVCache.load_context("~/ctx", model, tok).get_seq_length() == cache.get_seq_length()
    long = tmp_path / ("c" * 245)  # a valid name, whose temporary sibling must still be one
    cache.save_context(long, tok)
    cache.save_context(long, tok)
    assert sorted(p.name for p in long.iterdir()) == [HEADER_NAME, TENSORS_NAME]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["c" * 245, "here", "home"])


def test_a_load_overlapping_a_resave_gets_the_old_or_the_new_context(world, tmp_path, monkeypatch):
    import proxykv_hf.contexts.format as contexts

    model, tok, scorers = world
    old, new = (compress_context(model, ProxyKVCache(scorers["snapkv"], 0.3),
                                 random_prompt(1, n, seed=n)["input_ids"]) for n in (60, 70))
    path = tmp_path / "ctx"
    old.save_context(path)
    real, calls = contexts.check_fits, []

    def check_then_resave(*args, **kwargs):
        out = real(*args, **kwargs)
        if not calls:
            new.save_context(path)  # the refresh lands between reading the header and the tensors
        calls.append(1)
        return out

    monkeypatch.setattr(contexts, "check_fits", check_then_resave)
    assert ProxyKVCache.load_context(path, model).get_seq_length() == 70 and len(calls) == 2


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                     max_leaves=6)
_NAMES = st.lists(st.sampled_from(["a", "b", "src", HEADER_NAME, TENSORS_NAME]), min_size=1, max_size=3)
_CONTENT = st.binary(max_size=20) | _JSON.map(lambda v: json.dumps(v).encode()) | \
    st.fixed_dictionaries({"format": st.just("proxykv_hf context"), "format_version": st.integers(0, 3),
                           "tensors": st.just({})}).map(lambda v: json.dumps(v).encode())


@given(tree=st.dictionaries(_NAMES.map("/".join), _CONTENT, min_size=1, max_size=6))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_no_save_or_store_operation_changes_a_tree_that_is_not_a_saved_context(world, tmp_path_factory, tree):
    from proxykv_hf import ContextStore
    from proxykv_hf.contexts.directory import is_saved_context

    model, tok, scorers = world
    root = tmp_path_factory.mktemp("tree")
    for name, data in tree.items():  # a file where no earlier file is in the way
        file = root / name
        if any(p.is_file() for p in [file, *file.parents] if p != root) or file.is_dir():
            continue
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_bytes(data)
    before = _tree(root)
    cache = compressed(model, scorers["snapkv"])
    for target in [root, *(root / p for p, data in before.items() if data is None)]:
        assert not is_saved_context(target)
        with pytest.raises(FileExistsError):
            cache.save_context(target, tok)
    pipe = ProxyKVPipeline(model, tok, scorers["snapkv"], keep_ratio=0.3)
    store = ContextStore(root, max_bytes=1)
    assert store.entries() == []
    store.get_or_compress(pipe, "The code word is ZEBRA-42. ")
    store.get_or_compress(pipe, "Another text. ")  # evicts the first entry, and nothing else
    after = _tree(root)
    assert {k: after.get(k, "gone") for k in before} == before and len(store.entries()) == 1


def _tuned_copy(model, *, layers: bool = True):
    """A "fine-tune" of ``model``: every decoder weight moved, its embeddings untouched."""
    import copy

    tuned = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if ".layers." in name and layers:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return tuned


def test_a_fine_tune_with_the_same_embeddings_is_refused(tmp_path):
    from proxykv_hf import ContextStore
    from proxykv_hf.models.fingerprints import weights_probe

    base, tok = tiny_model("llama"), tiny_tokenizer()
    tuned = _tuned_copy(base)
    assert weights_probe(base) != weights_probe(tuned)
    ids = random_prompt(1, 60, seed=2)["input_ids"]
    compress_context(base, ProxyKVCache(SnapKVScorer(window=8), 0.3), ids).save_context(tmp_path / "ctx", tok)
    with pytest.raises(ValueError, match="same config but other weights") as info:
        ProxyKVCache.load_context(tmp_path / "ctx", tuned, tok)
    assert str(tmp_path / "ctx" / HEADER_NAME) in str(info.value)
    half = _tuned_copy(base).to(torch.bfloat16)
    with pytest.raises(ValueError, match="same config but other weights"):  # the sketch, across dtypes
        ProxyKVCache.load_context(tmp_path / "ctx", half, tok, dtype="convert")
    same = ProxyKVCache.load_context(tmp_path / "ctx", base.to(torch.bfloat16), tok, dtype="convert")  # within rounding
    assert same.layers[0].keys.dtype == torch.bfloat16
    base.float()
    store = ContextStore(tmp_path / "store")
    keys = {store.key(ProxyKVPipeline(m, tok, SnapKVScorer(window=8)), "x") for m in (base, tuned)}
    assert len(keys) == 2
    with torch.no_grad():  # an in-place update of a probed weight is seen (the memo is keyed on the tensor version)
        before = weights_probe(base)
        base.model.layers[1].mlp.down_proj.weight[0, 0] += 1.0
        assert weights_probe(base) != before


def test_ask_refuses_a_context_of_another_model():
    tok = tiny_tokenizer()
    text = "The code word is ZEBRA-42 and the door opens at nine. " * 3
    ctx = ProxyKVPipeline(tiny_model("llama", seed=0), tok, SnapKVScorer(window=8), keep_ratio=0.3).compress(text)
    for model in (tiny_model("llama", seed=1), tiny_model("llama", num_hidden_layers=4),
                  tiny_model("llama", dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="this compressed context .*compress it with this pipeline's model"):
            ProxyKVPipeline(model, tok, SnapKVScorer(window=8), keep_ratio=0.3).ask(ctx, "code?", max_new_tokens=2)
    same = tiny_model("llama", seed=0)
    assert isinstance(ProxyKVPipeline(same, tok, SnapKVScorer(window=8)).ask(ctx, "code?", max_new_tokens=2), str)


def _edit_header(path: Path, edit) -> None:
    """Change the header at ``path`` and write it back with its checksum made good again (a consistent edit)."""
    from proxykv_hf.contexts.header import CHECKSUM, header_checksum

    header = json.loads((path / HEADER_NAME).read_text())
    edit(header)
    header[CHECKSUM] = header_checksum(header)
    (path / HEADER_NAME).write_text(json.dumps(header))


def test_a_damaged_or_inconsistent_header_is_refused(tmp_path):
    model = tiny_model("llama")
    ids = random_prompt(1, 60, seed=2)["input_ids"]
    compress_context(model, ProxyKVCache(SnapKVScorer(window=8), 0.3, budget="global"), ids).save_context(
        tmp_path / "src")

    def copy(name):
        return Path(shutil.copytree(tmp_path / "src", tmp_path / name))

    flipped = copy("flip")
    text = (flipped / HEADER_NAME).read_text()
    assert '"n_kv_heads": 2' in text
    (flipped / HEADER_NAME).write_text(text.replace('"n_kv_heads": 2', '"n_kv_heads": 3', 1))
    with pytest.raises(ValueError, match="does not match the checksum") as info:
        ProxyKVCache.load_context(flipped, model)
    assert str(flipped / HEADER_NAME) in str(info.value)
    nested = copy("nested")
    (nested / HEADER_NAME).write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(ValueError, match="nested too deeply") as info:
        ProxyKVCache.load_context(nested, model)
    assert str(nested / HEADER_NAME) in str(info.value)
    for name, edit, message in (
            ("heads", lambda h: h["state"]["layers"][0].update(n_kv_heads=3), "lists 3 KV heads"),
            ("zero", lambda h: h["state"]["layers"][0].update(n_kv_heads=0), "n_kv_heads"),
            ("tensor", lambda h: h["state"]["layers"][0]["tensors"].append("__class__"), "known: keys"),
            ("ratio", lambda h: h["cache"].update(keep_ratio=1.5), "keep_ratio"),
            ("dtype", lambda h: h.update(dtype="int8"), "floating torch dtype")):
        path = copy(name)
        _edit_header(path, edit)
        with pytest.raises(ValueError, match=message) as info:
            ProxyKVCache.load_context(path, model)
        assert str(path / HEADER_NAME) in str(info.value)


def test_a_failed_save_into_an_empty_directory_leaves_it_empty(world, tmp_path, monkeypatch):
    import proxykv_hf.contexts.directory as context_files

    model, tok, scorers = world
    cache = compressed(model, scorers["snapkv"])
    empty = tmp_path / "empty"
    empty.mkdir()
    real = os.replace

    def fail_on_header(src, dst):
        if Path(dst).name == HEADER_NAME:
            raise OSError("disk full")
        real(src, dst)

    monkeypatch.setattr(context_files.os, "replace", fail_on_header)
    with pytest.raises(OSError, match="disk full"):
        cache.save_context(empty, tok)
    monkeypatch.undo()
    assert os.listdir(empty) == []
    cache.save_context(empty, tok)
    assert sorted(os.listdir(empty)) == [HEADER_NAME, TENSORS_NAME]
