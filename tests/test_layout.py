"""The core never imports the tooling (train/, eval/, bench/, cli, pipeline), and importing the package does no
work beyond registering the pipeline task."""

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "proxykv_hf"
CORE = ["cache.py", "selection.py", "scoring.py", "attention.py", "mapper.py", "proxy.py", "hub.py",
        *[f"scorers/{p.name}" for p in (PKG / "scorers").glob("*.py")]]
TOOLING = ("train", "eval", "bench", "cli", "pipeline", "demo")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            names.add((node.module or "").split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("proxykv_hf."):
            names.add(node.module.split(".")[1])
    return names


def test_core_does_not_import_tooling():
    for rel in CORE:
        bad = _imports(PKG / rel) & set(TOOLING)
        assert not bad, f"{rel} imports {bad}"


def test_import_is_light():
    code = ("import proxykv_hf, transformers, sys;"
            "from transformers import AttentionInterface;"
            "assert 'proxykv_sdpa' not in AttentionInterface._global_mapping;"
            "assert 'proxykv_hf.train' not in sys.modules and 'proxykv_hf.eval' not in sys.modules;"
            "from transformers.pipelines import PIPELINE_REGISTRY;"
            "assert 'proxykv-generation' in PIPELINE_REGISTRY.get_supported_tasks()")
    subprocess.run([sys.executable, "-c", code], check=True)
