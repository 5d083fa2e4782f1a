"""The product never imports the tooling (train/, eval/, bench/, cli, demo), the package's modules import each
other without cycles (type-only imports included) and stay within :data:`MAX_LINES` lines, and importing the package
does no work beyond registering the pipeline task."""

import ast
import subprocess
import sys
from pathlib import Path


PKG = Path(__file__).resolve().parents[1] / "proxykv_hf"
TOOLING = ("train", "eval", "bench", "cli", "cli_helpers", "out_dirs", "demo")
PRODUCT = sorted(str(p.relative_to(PKG)) for p in [*PKG.glob("*.py"), *(PKG / "scorers").glob("*.py")]
                 if p.stem not in TOOLING)
"""Every module a user imports (the cache, scoring, scorers, mapper, proxy, hub, pipeline, compressed contexts,
the store, models, ...): all of the package but the tooling built on it."""
MAX_LINES = 450  # past this a module is split by concept (STYLE.md: aim for 100-350)


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            names.add((node.module or "").split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("proxykv_hf."):
            names.add(node.module.split(".")[1])
    return names


def test_product_does_not_import_tooling():
    assert {"cache.py", "pipeline.py", "compressed.py", "store.py", "contexts.py", "models.py"} <= set(PRODUCT)
    for rel in PRODUCT:
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


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _edges(path: Path, known: set[str]) -> set[str]:
    """The package modules ``path`` imports, at any depth of its code: function-level imports and those under
    ``if TYPE_CHECKING:`` included (a type-only cycle is still two modules that each need the other; the shared
    definitions belong in a module both import). ``from .x import y`` counts ``x.y`` where that is a module, else
    ``x``."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return (found & known) - {me}


def test_no_import_cycles():
    paths = list(PKG.rglob("*.py"))
    known = {_module_name(p) for p in paths}
    graph = {_module_name(p): _edges(p, known) for p in paths}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = trail[trail.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_no_module_is_too_long():
    long = {str(p.relative_to(PKG)): n for p in sorted(PKG.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concept): {long}"
