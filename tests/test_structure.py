"""The import graph of the whole tree: no cycle anywhere, and only the edges docs/ARCHITECTURE.md lists.

Every `import` statement counts, those inside functions too: an import moved into a function hides a
cycle or an edge from Python, not from a reader. The allowed edges are read from the table between
`<!-- edges -->` and `<!-- /edges -->` in docs/ARCHITECTURE.md, so the map and the code cannot drift.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cli", "flows", "tasks", "trainers", "evaluation", "infra")
# Subpackages that are units of their own: the rest of their parent may import them, not the reverse.
OWN_UNITS = ("trainers.format", "trainers.contract")
# Imports inside functions that are there for start-up time, not to dodge a cycle: the trainer's
# entrypoint answers `--help` and a bad job file before importing Composer and torch.
DEFERRED_ON_PURPOSE = {"trainers.train"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports(path: Path, known: set[str]) -> list[tuple[str, bool]]:
    """(module imported, inside a function) for each import of a product module in `path`."""
    tree = ast.parse(path.read_text())
    nested = {
        id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) for n in ast.walk(f)
    }
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import mod` imports pkg.mod when that is a module; else a name of pkg
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names
            ]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found += [(n, id(node) in nested) for n in names if n.split(".")[0] in PACKAGES]
    return found


# tasks/ is layered: each of its folders is a unit, and so is each module at its top (tasks.recipe, tasks.retry ...),
# so that the map lists every edge between them and a cycle between two of them fails
# test_the_units_import_each_other_in_one_direction.
TASKS_UNITS = ("tasks.data", "tasks.training", "tasks.gauntlet", "tasks.registry", "tasks.runs")


def unit(module: str) -> str:
    own = next((u for u in OWN_UNITS + TASKS_UNITS if module == u or module.startswith(u + ".")), None)
    if own is not None:
        return own
    if module.startswith("tasks."):
        return ".".join(module.split(".")[:2])
    return module.split(".")[0]


def allowed_edges() -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    table = text.split("<!-- edges -->", 1)[1].split("<!-- /edges -->", 1)[0]
    edges = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue
        for source in re.findall(r"`([\w.]+)`", cells[0]):
            edges += [(source, target) for target in re.findall(r"`([\w.]+)`", cells[1])]
    return edges


def _covers(name: str, module: str) -> bool:
    return module == name or module.startswith(name + ".")


def is_allowed(importer: str, imported: str, edges: list[tuple[str, str]]) -> bool:
    if unit(importer) == unit(imported):
        return True
    return any(
        _covers(source, importer) and (_covers(target, imported) or _covers(target, unit(imported)))
        for source, target in edges
    )


def graph() -> dict[str, set[str]]:
    modules = product_modules()
    known = set(modules)
    out: dict[str, set[str]] = {}
    for name, path in modules.items():
        # an import of a package stands for its __init__ module; of a name inside a module, for the module
        out[name] = {m if m in known else m.rsplit(".", 1)[0] for m, _ in imports(path, known)} & known
    return out


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    visiting, done = [], set()

    def visit(node: str) -> list[str] | None:
        if node in visiting:
            return visiting[visiting.index(node) :] + [node]
        if node in done or node not in g:
            return None
        visiting.append(node)
        for dep in sorted(g[node] - {node}):
            if found := visit(dep):
                return found
        visiting.pop()
        done.add(node)
        return None

    for node in sorted(g):
        if found := visit(node):
            return found
    return None


def test_the_tree_has_no_import_cycle():
    g = graph()
    assert {"flows.pipeline", "tasks.training.gauntlet_queue", "trainers.format.checkpoints", "infra.local"} <= set(g)
    cycle = find_cycle(g)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_every_edge_between_units_is_on_the_map():
    edges = allowed_edges()
    assert ("flows", "tasks") in edges and ("infra", "trainers.contract") in edges
    modules = product_modules()
    known = set(modules)
    off_map = sorted(
        {
            f"{name} -> {imported}"
            for name, path in modules.items()
            for imported, _ in imports(path, known)
            if not is_allowed(name, imported, edges)
        }
    )
    assert off_map == [], "imports docs/ARCHITECTURE.md does not list:\n" + "\n".join(off_map)


def unit_graph() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for name, deps in graph().items():
        out.setdefault(unit(name), set()).update(unit(d) for d in deps if unit(d) != unit(name))
    return out


def test_the_units_import_each_other_in_one_direction():
    """Units, not only modules: tasks/'s folders once imported each other both ways (gauntlet <-> registry, registry
    <-> runs) through modules that formed no cycle of their own, and the map, one unit for all of tasks/, could not
    see it."""
    g = unit_graph()
    assert {"tasks.training", "tasks.gauntlet", "tasks.registry", "tasks.runs", "tasks.data", "tasks.slots"} <= set(g)
    assert "tasks.registry" in g["tasks.training"] and "tasks.gauntlet" in g["tasks.registry"]
    cycle = find_cycle(g)
    assert cycle is None, "units importing each other: " + " -> ".join(cycle or [])


def test_no_trainers_import_is_hidden_in_a_function():
    modules = product_modules()
    known = set(modules)
    hidden = sorted(
        f"{name} -> {m}"
        for name, path in modules.items()
        if name.startswith("trainers") and name not in DEFERRED_ON_PURPOSE
        for m, inside in imports(path, known)
        if inside and m.startswith("trainers")
    )
    assert hidden == [], f"imports of trainers modules inside functions: {hidden}"


def test_the_checks_see_what_they_are_for():
    helper = ast.parse("@flow(name='x')\ndef f(): pass\n@task\ndef g(): pass").body
    assert _is_flow(helper[0]) and not _is_flow(helper[1])
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    edges = [("flows", "tasks"), ("infra", "trainers.contract"), ("cli.k8s", "infra.kube_api")]
    assert is_allowed("flows.pipeline", "tasks.training.train", edges)
    assert not is_allowed("tasks.training.train", "flows.pipeline", edges)
    assert is_allowed("infra.local", "trainers.contract", edges)
    assert not is_allowed("infra.local", "trainers.config", edges)
    assert not is_allowed("trainers.format.export", "trainers.model", edges)  # the format is its own unit
    assert is_allowed("cli.k8s", "infra.kube_api", edges) and not is_allowed("cli.up", "infra.kube_api", edges)


# Public functions in flows/ that are not flows, each with why: the bodies several flows share.
SHARED_FLOW_BODIES = {
    "flows.pipeline.run_pipeline": "both training flows run it; as a subflow it would get a flow run of its own, "
    "whose id the run slot and the MLflow run's tags would name instead of the flow the person started",
    "flows.prepare.prepare_recipe_data": "prepare_data and run_pipeline prepare a recipe's data with it, inside their "
    "own flow runs",
}


def _is_flow(node: ast.AST) -> bool:
    return isinstance(node, ast.FunctionDef) and any(
        (isinstance(d, ast.Name) and d.id == "flow")
        or (isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id == "flow")
        for d in node.decorator_list
    )


def flows_beyond_flows() -> list[str]:
    """What a module of flows/ defines besides flows, their forms (pydantic models) and their own private glue: a
    module without a flow, a public function that is no flow and no listed shared body, a class that is no model."""
    import importlib

    from pydantic import BaseModel

    found = []
    for path in sorted((ROOT / "flows").glob("*.py")):
        name = module_name(path)
        tree = ast.parse(path.read_text())
        if path.stem == "__init__":
            found += [f"{name}: defines {n.name}" for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)]
            continue
        if not any(_is_flow(n) for n in tree.body):
            found.append(f"{name}: defines no flow")
        module = importlib.import_module(name)  # classes are checked as Python sees them: pydantic models or not
        for node in tree.body:
            qualified = f"{name}.{node.name}" if isinstance(node, ast.FunctionDef | ast.ClassDef) else ""
            if isinstance(node, ast.FunctionDef) and not (
                _is_flow(node) or node.name.startswith("_") or qualified in SHARED_FLOW_BODIES
            ):
                found.append(f"{qualified}: a public function that is not a flow")
            elif isinstance(node, ast.ClassDef) and not issubclass(getattr(module, node.name), BaseModel):
                found.append(f"{qualified}: a class that is not a flow's parameter or result model")
    return found


def test_flows_hold_only_flows_their_forms_and_the_bodies_they_share():
    assert flows_beyond_flows() == []


# Product modules that import a private module of Prefect (a `_name` in its path), each with why there is no public
# way; anywhere else such an import is refused.
PRIVATE_PREFECT = {
    "tasks.slots": "AcquireConcurrencySlotTimeoutError, the error of a concurrency slot not freed in time: no "
    "public module exports it, and the TimeoutError it extends is also a stalled server's (slot_timeout)",
    "cli.deploy": "PrefectYamlModel, the schema `prefect deploy` validates prefect.yaml with, so that tessera deploy "
    "refuses what Prefect would, in one line",
}


def private_prefect_imports() -> dict[str, set[str]]:
    """Product module -> the private Prefect modules it imports."""
    found: dict[str, set[str]] = {}
    for name, path in product_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            modules += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for module in modules:
                if module.split(".")[0] == "prefect" and any(p.startswith("_") for p in module.split(".")):
                    found.setdefault(name, set()).add(module)
    return found


def test_private_prefect_modules_are_imported_only_where_listed_with_why():
    assert set(private_prefect_imports()) == set(PRIVATE_PREFECT)


# The launcher's two imports by name, both of a module its command line names (as `python -m` and torchrun do):
# no edge of the map, since infra must not import trainers (it runs whatever `-m MODULE` says).
DYNAMIC = {
    "infra.launcher": "set_forkserver_preload: the --warm modules the ranks' forkserver imports once",
    "infra.warm": "run_module: each rank runs the launch's -m MODULE as `python -m` would",
}


def dynamic_imports() -> list[str]:
    """Product modules that import by name at run time (importlib.import_module, __import__, runpy.run_module, a
    forkserver's preload): an import the map above cannot see. importlib.metadata (a package's version) imports
    nothing of tessera."""
    found = []
    for name, path in product_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            called = node.func if isinstance(node, ast.Call) else None
            called_name = getattr(called, "attr", None) or getattr(called, "id", None)
            if called_name in ("import_module", "__import__", "run_module", "set_forkserver_preload"):
                found.append(name)
    return found


def test_no_module_imports_by_name_at_run_time_or_relatively():
    """Both would hide an edge from the map: `imports` reads absolute imports only (ruff's TID252 refuses relative
    ones at lint time too). The launcher's, listed in DYNAMIC with why, are the only ones."""
    assert sorted(set(dynamic_imports())) == sorted(DYNAMIC)
    relative = [
        f"{name}:{node.lineno}"
        for name, path in product_modules().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level
    ]
    assert relative == []


# Packages whose __init__ docstring indexes their modules, one a line (`name.py  what it is`, or `name  ...`,
# `name/  ...` for a subpackage): the index must name exactly the modules there are.
INDEXED = (
    "cli",
    "flows",
    "tasks",
    "tasks/data",
    "tasks/training",
    "tasks/gauntlet",
    "tasks/registry",
    "tasks/runs",
    "trainers",
    "trainers/format",
    "evaluation",
)


def index_drift(package: str) -> tuple[set[str], set[str]]:
    """(modules the index misses, names it lists that are no module) for `package`'s __init__ docstring."""
    folder = ROOT / package
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    listed = {m[1] for line in doc.splitlines() if (m := re.match(r"(_*[a-z0-9_]+)(?:\.py|/)? {2,}\S", line))}
    there = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    there |= {p.name for p in folder.iterdir() if (p / "__init__.py").exists()}
    return there - listed, listed - there


@pytest.mark.parametrize("package", INDEXED)
def test_a_package_index_names_every_module_and_only_those(package):
    assert index_drift(package) == (set(), set())


# What each trainers module other than layout.py and format/store.py removes; a checkpoint is none of it.
# layout.py decides a local checkpoint's removal (discard, retire, withdraw); format/store.py deletes (`remove`,
# the stores' `retire`, the manifest first) and drops pins; an s3 checkpoint goes through the s3 face's delete_object,
# which this check does not count: no other module holds a client.
REMOVES_OTHER_FILES = {
    "atomic": "its own temp file, when a state file's write fails before the rename",
    "data_check": "a damaged cached copy of a remote data shard, which Streaming then fetches and validates again",
    "faults": "the throttled-writer test hook's own probe file (TESSERA_FAULT=slow-save)",
    "metrics_journal": "a journal with nothing left to deliver",
    "metrics_outbox": "its own write-ahead journal",
    "preflight": "its own probe file, which shows the save folder takes a write",
    "remote": "hard links staged for an upload (.uploading/)",
    "s3": "a half-downloaded published folder's staging copy",
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


def test_only_layout_and_the_store_remove_checkpoints():
    trainers = ROOT / "trainers"
    removing = {p.stem for p in trainers.rglob("*.py") if _removals(p)}
    assert {"layout", "store"} <= removing
    assert removing - {"layout", "store"} == set(REMOVES_OTHER_FILES), (
        "a trainers module removes files without being listed; checkpoints are removed only through "
        "trainers/layout.py and trainers/format/store.py: "
        f"{sorted(removing - {'layout', 'store'} - set(REMOVES_OTHER_FILES))}"
    )


def _test_functions() -> int:
    """Test functions pytest collects (before parametrization): test_* at module level and in Test* classes."""
    count = 0
    for path in (ROOT / "tests").glob("test_*.py"):
        tree = ast.parse(path.read_text())
        bodies = [tree.body] + [n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name.startswith("Test")]
        count += sum(
            isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name.startswith("test_")
            for body in bodies
            for n in body
        )
    return count


def test_the_docs_count_the_tests_there_are():
    """A figure the docs state about the suite comes from the suite: it once said 248 when 369 existed."""
    stated = re.search(r"the suite has ([\d,]+) test functions", (ROOT / "docs" / "testing.md").read_text())
    assert stated is not None, "docs/testing.md no longer states the suite's size"
    assert int(stated[1].replace(",", "")) == _test_functions(), (
        f"docs/testing.md says {stated[1]} test functions; tests/ has {_test_functions()}: update the sentence"
    )
