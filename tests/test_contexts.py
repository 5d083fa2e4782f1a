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

from proxykv_hf import KVzipScorer, ProxyKVCache, ProxyKVPipeline, ProxyScorer, SnapKVScorer
from proxykv_hf.cli import main
from proxykv_hf.compat import with_cache
from proxykv_hf.contexts import HEADER_NAME, TENSORS_NAME, read_context, write_directory
from proxykv_hf.hub import Checkpoint, TargetSpec
from proxykv_hf.mapper import HybridAxialMapper, MapperConfig
from proxykv_hf.pipeline import compress_context
from proxykv_hf.proxy import ProxySpec
from proxykv_hf.selection import BUDGETS
from proxykv_hf.testing import random_prompt, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")

LENGTHS = [72, 60]  # a padded batch of 2
QUESTION_SEEDS = (11, 12, 13)
N_NEW = 5


def self_proxy_scorer(model, **kwargs) -> ProxyScorer:
    """ProxyKV with a random-weight mapper on the target's own attention (the bundled mapper's path)."""
    cfg = model.config
    torch.manual_seed(0)
    mapper = HybridAxialMapper(MapperConfig.tiny(num_proxy_layers=cfg.num_hidden_layers,
                                                 num_proxy_heads=cfg.num_attention_heads,
                                                 num_target_layers=cfg.num_hidden_layers,
                                                 num_target_heads=cfg.num_key_value_heads, num_statistics=3,
                                                 crop_len=32, stride=16)).eval()
    ckpt = Checkpoint(mapper=mapper, proxy=ProxySpec(kind="self", num_layers=cfg.num_hidden_layers,
                                                     num_heads=cfg.num_attention_heads,
                                                     statistics=["sum", "max", "lookback"]),
                      target=TargetSpec(model_id="tiny", model_type="llama", num_layers=cfg.num_hidden_layers,
                                        num_kv_heads=cfg.num_key_value_heads, num_heads=cfg.num_attention_heads))
    return ProxyScorer(ckpt, mapper_autocast=False, **kwargs)


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
    scorers = {"proxykv": self_proxy_scorer(model), "kvzip": KVzipScorer(tiny_tokenizer(), chunk_size=16),
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
    header["format_version"] = 2
    (copy / HEADER_NAME).write_text(json.dumps(header))
    with pytest.raises(ValueError, match="format_version 2 .* newer than the 1 this proxykv_hf .* upgrade") as info:
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
    with pytest.raises(FileExistsError, match="exists and is not a saved context"):
        cache.save_context(tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"


def test_writes_are_whole_or_nothing(world, copy, monkeypatch):
    """A writer that fails half-way leaves no directory, no temporary one, and an older context as it was."""
    import proxykv_hf.contexts as contexts

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
