"""The package's shape: at most twelve entries at its root, one concept each; the product never imports the tooling
(``train/ eval/ bench/ cli/``); no import cycles (type-only imports included); no module over :data:`MAX_LINES`
lines; stack frames read in one module only; docs/design.md's module table names every module; and importing the
package does no work beyond registering the pipeline task."""

import ast
import re
import subprocess
import sys
from pathlib import Path


PKG = Path(__file__).resolve().parents[1] / "proxykv_hf"
ROOT = {"__init__.py", "attention", "cache", "scorers", "mapper", "models", "contexts", "testing.py", "train", "eval",
        "bench", "cli"}
"""The root's entries, one concept each (README.md's module tree)."""
TOOLING = ("train", "eval", "bench", "cli")
PRODUCT = sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if p.relative_to(PKG).parts[0] not in TOOLING)
"""Every module a user imports (the cache, attention, scorers, mapper, models, compressed contexts, ...): all of the
package but the tooling built on it."""
MAX_LINES = 450  # past this a module is split by concept (STYLE.md: aim for 100-350)


def test_the_root_holds_twelve_entries_at_most():
    entries = {p.name for p in PKG.iterdir() if p.name != "__pycache__"}
    assert entries == ROOT, f"unexpected root entries {sorted(entries - ROOT)}, missing {sorted(ROOT - entries)}"
    assert len(ROOT) <= 12


def test_product_does_not_import_tooling():
    assert {"cache/proxykv_cache.py", "contexts/pipeline.py", "contexts/store.py", "models/loading.py"} <= set(PRODUCT)
    paths = list(PKG.rglob("*.py"))
    known = {_module_name(p) for p in paths}
    for rel in PRODUCT:
        bad = {name for name in _edges(PKG / rel, known) if name.split(".")[1] in TOOLING}
        assert not bad, f"{rel} imports {bad}"


def test_frames_are_read_in_one_module():
    """The cache learns generate's whole prompt from the calling frames in one place only (cache/prompt.py)."""
    readers = [str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
               if re.search(r"_getframe|currentframe|\.f_back|\.f_locals|inspect\.stack", p.read_text())]
    assert readers == ["cache/prompt.py"], readers


def test_the_design_table_names_every_module():
    """docs/design.md's "Where things live" names every module by its path (a folder's ``__init__.py`` aside), and
    nothing that is gone."""
    text = (PKG.parent / "docs" / "design.md").read_text()
    table = text[text.index("## Where things live"):text.index("## Logical vs physical length")]
    named = set(re.findall(r"^\| `([\w/]+\.py)` \|", table, flags=re.M))
    modules = {str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if p.name != "__init__.py" or p.parent == PKG}
    assert named == modules, f"not in the table: {sorted(modules - named)}, gone: {sorted(named - modules)}"


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
