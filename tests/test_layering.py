"""The layout holds: no import cycles, the engine never reaches the app, the request path never
reaches the tools built around it, and no folder grows back into a flat heap.

Imports are read from the source (module level and inside functions; those under
`if TYPE_CHECKING:` are left out, since they never run), so the rules hold for code that is not
executed by any other test. A failure names the files and lines to look at.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Import name -> source folder (pyproject's package-dir).
PACKAGES = {"minengine": ROOT / "minengine", "reqscope": ROOT / "app"}

# What serves one request, and what is built around it.
REQUEST_PATH = ("text", "checkpoint", "model", "kv", "sampling", "engine")
AROUND_IT = ("plan", "record", "hub", "gguf")
MAX_MODULES_PER_FOLDER = 15
MAX_SHARED_PREFIX = 2  # modules in one folder that may share a `name_` prefix


@dataclass(frozen=True)
class Import:
    """One import of a project module by another."""

    source: str  # importing module, dotted
    target: str  # imported module, dotted (a package's __init__ when a package is named)
    line: int

    def where(self) -> str:
        return f"{_path_of(self.source)}:{self.line} imports {self.target}"


def _modules() -> dict[str, Path]:
    found = {}
    for top, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if "__pycache__" in parts:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((top, *parts))] = path
    return found


MODULES = _modules()


def _path_of(module: str) -> str:
    return str(MODULES[module].relative_to(ROOT))


def _resolve(name: str) -> str | None:
    """The project module an import name loads (its longest existing prefix), or None."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in MODULES:
            return candidate
        parts.pop()
    return None


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports_of(module: str) -> list[Import]:
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _type_checking_only(node):
            skipped.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import mod` loads pkg.mod when that is a module, else pkg itself.
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            target = _resolve(name)
            if target is not None and target != module:
                found.append(Import(module, target, node.lineno))
    return found


IMPORTS = [imp for module in sorted(MODULES) for imp in _imports_of(module)]


def _cycles() -> list[list[Import]]:
    """One shortest cycle through each module that lies on a cycle."""
    graph: dict[str, dict[str, Import]] = defaultdict(dict)
    for imp in IMPORTS:
        graph[imp.source].setdefault(imp.target, imp)
    cycles, seen = [], set()
    for start in sorted(graph):
        if start in seen:
            continue
        # Breadth-first from start's imports back to start gives the shortest cycle through it.
        parent: dict[str, Import] = {}
        frontier = list(graph[start].values())
        for imp in frontier:
            parent.setdefault(imp.target, imp)
        while frontier and start not in parent:
            nxt = []
            for imp in frontier:
                for out in graph[imp.target].values():
                    if out.target not in parent:
                        parent[out.target] = out
                        nxt.append(out)
            frontier = nxt
        if start in parent:
            path, node = [], start
            while True:
                imp = parent[node]
                path.append(imp)
                node = imp.source
                if node == start:
                    break
            path.reverse()
            cycles.append(path)
            seen.update(imp.source for imp in path)
    return cycles


def test_no_import_cycles():
    cycles = _cycles()
    message = "\n\n".join(
        "import cycle: " + " -> ".join([c[0].source, *(imp.target for imp in c)]) + "\n  " +
        "\n  ".join(imp.where() for imp in c)
        for c in cycles
    )  # fmt: skip
    assert not cycles, "\n" + message


def test_the_engine_never_imports_the_app():
    wrong = [imp for imp in IMPORTS if imp.source.startswith("minengine") and imp.target.startswith("reqscope")]
    assert not wrong, "minengine must not import reqscope (the UI consumes the engine's events):\n  " + "\n  ".join(
        imp.where() for imp in wrong
    )


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "minengine" and len(parts) > 2 else None


def test_the_request_path_never_imports_the_tools_around_it():
    wrong = [
        imp
        for imp in IMPORTS
        if imp.source.startswith("minengine")
        and (_package(imp.source) in REQUEST_PATH or _package(imp.source) is None)
        and _package(imp.target) in AROUND_IT
    ]
    assert not wrong, (
        f"the request path ({', '.join(REQUEST_PATH)} and minengine's top-level modules) must not import "
        f"{', '.join(AROUND_IT)}:\n  " + "\n  ".join(imp.where() for imp in wrong)
    )


def _folders() -> dict[Path, list[str]]:
    folders: dict[Path, list[str]] = defaultdict(list)
    for path in MODULES.values():
        if path.name != "__init__.py":
            folders[path.parent].append(path.stem)
    return folders


@pytest.mark.parametrize("folder", sorted(_folders()), ids=lambda p: str(p.relative_to(ROOT)))
def test_folders_stay_small_and_named_by_idea(folder):
    modules = sorted(_folders()[folder])
    where = folder.relative_to(ROOT)
    assert len(modules) <= MAX_MODULES_PER_FOLDER, (
        f"{where} holds {len(modules)} modules (at most {MAX_MODULES_PER_FOLDER}): group them into a subpackage"
    )
    by_prefix: dict[str, list[str]] = defaultdict(list)
    for name in modules:
        if "_" in name:
            by_prefix[name.split("_")[0]].append(name)
    crowded = {prefix: names for prefix, names in by_prefix.items() if len(names) > MAX_SHARED_PREFIX}
    assert not crowded, f"{where}: modules sharing a prefix say 'package' by name: {crowded}; make it a subpackage"


def test_the_checker_sees_the_project():
    # Guards the rules above against passing vacuously (a wrong root, a parser that finds nothing).
    assert "minengine.engine.session" in MODULES and "reqscope.cli" in MODULES
    assert any(imp.source == "minengine.engine.session" and imp.target == "minengine.kv.cache" for imp in IMPORTS)
