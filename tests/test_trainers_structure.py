"""trainers/ has no import cycles, counting imports made inside functions too.

An import moved into a function hides a cycle from Python but not from a reader; this check reads
every `import` statement in the package, wherever it stands.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "trainers"
# Imports inside functions that are there for start-up time, not to dodge a cycle: the entrypoint
# answers `--help` and a bad job file before importing Composer and torch.
DEFERRED_ON_PURPOSE = {"train"}


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """(every trainers module `path` imports, those imported inside a function)."""
    everywhere, inside = set(), set()
    tree = ast.parse(path.read_text())
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) for n in ast.walk(f)}
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "trainers":
            names = [node.module] if node.module != "trainers" else [f"trainers.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "trainers"]
        for name in names:
            module = name.split(".")[1] if "." in name else name
            everywhere.add(module)
            if id(node) in nested:
                inside.add(module)
    return everywhere, inside


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    graph, deferred = {}, {}
    for path in sorted(PACKAGE.glob("*.py")):
        if path.stem != "__init__":
            graph[path.stem], deferred[path.stem] = _imports(path)
    return graph, deferred


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    visiting, done = [], set()

    def visit(module: str) -> list[str] | None:
        if module in visiting:
            return visiting[visiting.index(module):] + [module]
        if module in done or module not in graph:
            return None
        visiting.append(module)
        for dep in sorted(graph[module] - {module}):
            if found := visit(dep):
                return found
        visiting.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        if found := visit(module):
            return found
    return None


def test_trainers_has_no_import_cycle():
    graph, _ = _graph()
    assert {"layout", "plan", "ledger", "saver", "faults", "checkpoints", "callbacks", "rollback", "remote"} <= set(graph)
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_trainers_import_is_hidden_in_a_function():
    _, deferred = _graph()
    hidden = {module: sorted(inside) for module, inside in deferred.items() if inside and module not in DEFERRED_ON_PURPOSE}
    assert not hidden, f"imports of trainers modules inside functions: {hidden}"


def test_the_cycle_check_sees_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


# What each module other than layout.py removes; a checkpoint is none of it. layout.py removes local
# checkpoints (discard, retire, withdraw) and remote.py's `retire` remote ones (through the object
# store's delete_object, which this check does not count: no other module holds a store).
REMOVES_OTHER_FILES = {
    "metrics_outbox": "its own write-ahead journal",
    "remote": "hard links staged for an upload (.uploading/) and half-downloaded data folders",
    "shm": "Streaming's shared-memory segments and locks of dead processes",
}


def _removals(path: Path) -> int:
    """Calls in `path` that remove a file or a tree: x.unlink(), os.remove/unlink(), shutil.rmtree()."""
    count = 0
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            on_os = isinstance(node.func.value, ast.Name) and node.func.value.id == "os"
            if node.func.attr in ("unlink", "rmtree") or (on_os and node.func.attr == "remove"):
                count += 1
    return count


def test_only_layout_removes_checkpoints():
    removing = {p.stem for p in PACKAGE.glob("*.py") if _removals(p)}
    assert "layout" in removing
    assert removing - {"layout"} == set(REMOVES_OTHER_FILES), (
        "a trainers module removes files without being listed; checkpoints are removed only through "
        f"trainers/layout.py: {sorted(removing - {'layout'} - set(REMOVES_OTHER_FILES))}"
    )
