"""The layout holds: no import cycles, the engine never reaches the app, the request path never
reaches the tools built around it, and no folder grows back into a flat heap.

Imports are read from the source (module level and inside functions; those under
`if TYPE_CHECKING:` are left out, since they never run), so the rules hold for code that is not
executed by any other test. A failure names the files and lines to look at.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Import name -> source folder (pyproject's package-dir).
PACKAGES = {"minengine": ROOT / "minengine", "reqscope": ROOT / "app"}

# What serves one request, and what is built around it.
REQUEST_PATH = ("text", "checkpoint", "reference", "model", "fast", "steps", "kv", "sampling", "engine")
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


# -- minengine leaves the command line's and the explorer's words to the app ----------------------
#
# Every string the engine writes (not its docstrings, which explain the app around it) is read.
# An f-string is read with each `{...}` as a stand-in (`_HOLE`), so "--{name}-lengths" is caught
# when a flag of that shape exists.

_HOLE = "\x00"
_PROCESS_CALLS = {
    "run", "Popen", "call", "check_call", "check_output", "system", "create_subprocess_exec",
    "create_subprocess_shell", "which", "execv", "execvp", "execve", "execl", "execlp", "spawnv", "spawnl",
}  # fmt: skip


@dataclass(frozen=True)
class Source:
    """One parsed file of the engine."""

    name: str  # its path from the repository root
    tree: ast.Module


@dataclass(frozen=True)
class Literal:
    """One string the engine's code writes."""

    text: str  # an f-string with `_HOLE` for each replacement field
    where: str  # file:line


def _sources(folder: Path) -> list[Source]:
    return [
        Source(str(path.relative_to(folder.parent)), ast.parse(path.read_text(), filename=str(path)))
        for path in sorted(folder.rglob("*.py"))
    ]


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            found.update(
                id(stmt.value) for stmt in body
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant | ast.JoinedStr)
            )  # fmt: skip
    return found


def _literals(sources: list[Source]) -> list[Literal]:
    found = []
    for source in sources:
        skipped = _docstrings(source.tree)
        for node in ast.walk(source.tree):
            if isinstance(node, ast.JoinedStr):
                skipped.update(id(part) for part in node.values)
        for node in ast.walk(source.tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            elif isinstance(node, ast.JoinedStr):
                text = "".join(p.value if isinstance(p, ast.Constant) else _HOLE for p in node.values)
            else:
                continue
            found.append(Literal(text, f"{source.name}:{node.lineno}"))
    return found


def _app_option_strings() -> set[str]:
    """Every option of every `reqscope` verb (the benchmark's are `reqscope bench`'s)."""
    from reqscope.cli import SUBCOMMANDS, build_parser

    options = {"--version", "-V"}  # read by cli.main before any parser
    for verb in SUBCOMMANDS:
        options.update(opt for action in build_parser(verb)._actions for opt in action.option_strings)
    return options


_OPTION_LIKE = re.compile(rf"(?<![\w-])--?[A-Za-z{_HOLE}][\w{_HOLE}-]*")


def flags_named(literals: list[Literal], options: set[str]) -> list[str]:
    """file:line and the flag, for each literal that names one of `options` (a hole stands for any name)."""
    wrong = []
    for lit in literals:
        for token in dict.fromkeys(_OPTION_LIKE.findall(lit.text)):
            shape = re.compile(re.escape(token).replace(_HOLE, r"[\w-]+"))
            named = sorted(opt for opt in options if shape.fullmatch(opt))
            if named:
                wrong.append(f"{lit.where} names {' / '.join(named)}: {lit.text!r}")
    return wrong


_KEY_WORDS = re.compile(rf"\b(the\s+[\w+{_HOLE}-]+\s+key|press(es)?\s+\S+|ctrl[+-]\w)", re.IGNORECASE)


def keys_named(literals: list[Literal]) -> list[str]:
    """file:line for each literal that tells the user to press a key ("the x key", "press x", "ctrl+c")."""
    return [f"{lit.where} names a key: {lit.text!r}" for lit in literals if _KEY_WORDS.search(lit.text)]


def verbs_named(literals: list[Literal], verbs: tuple[str, ...]) -> list[str]:
    """file:line for each literal that names a `reqscope VERB` command."""
    pattern = re.compile(rf"\breqscope\s+({'|'.join(verbs)})\b")
    return [f"{lit.where} names a command: {lit.text!r}" for lit in literals if pattern.search(lit.text)]


def _is_app(text: str | None) -> bool:
    return text is not None and (text == "reqscope" or text.startswith(("reqscope.", "reqscope ")))


def _text(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def processes_started(sources: list[Source]) -> list[str]:
    """file:line for each place that builds or runs a `reqscope` command line."""
    shell = re.compile(r"-m\s+reqscope\b")
    wrong = [f"{lit.where} runs the app: {lit.text!r}" for lit in _literals(sources) if shell.search(lit.text)]
    for source in sources:
        for node in ast.walk(source.tree):
            where = f"{source.name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.List | ast.Tuple):  # an argv: [python, "-m", "reqscope", ...] or ["reqscope", ...]
                texts = [_text(e) for e in node.elts]
                after_m = any(a == "-m" and _is_app(b) for a, b in zip(texts, texts[1:], strict=False))
                if after_m or (texts and _is_app(texts[0])):
                    wrong.append(f"{where} builds a reqscope command line")
            elif isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name in _PROCESS_CALLS and any(_is_app(_text(a)) for a in node.args):
                    wrong.append(f"{where} starts reqscope with {name}()")
    return wrong


def test_the_engine_never_starts_the_app():
    wrong = processes_started(_sources(PACKAGES["minengine"]))
    assert not wrong, "minengine must not start a reqscope process (tools that do live in the app):\n  " + (
        "\n  ".join(wrong)
    )


def test_the_engine_never_names_a_flag_a_key_or_a_command():
    from reqscope.cli import SUBCOMMANDS

    literals = _literals(_sources(PACKAGES["minengine"]))
    wrong = [
        *flags_named(literals, _app_option_strings()),
        *keys_named(literals),
        *verbs_named(literals, tuple(SUBCOMMANDS)),
    ]
    assert not wrong, (
        "minengine's texts name engine settings (minengine.errors.Setting), and the app words them "
        "(reqscope.wording); these name the app's flags, keys or commands:\n  " + "\n  ".join(wrong)
    )


def test_the_word_rules_catch_what_they_are_for():
    # Guards the two rules above against passing vacuously.
    probe = Source("probe.py", ast.parse(
        "import subprocess, sys\n"
        'subprocess.run([sys.executable, "-m", "reqscope", "--plain"])\n'
        'argv = ["reqscope", "serve"]\n'
        'shell = "python -m reqscope.bench"\n'
        'hint = f"give at least 2 (--{name}-lengths)"\n'
        'tip = "export one with the x key"\n'
        'cmd = "write one with `reqscope calibrate`"\n'
        'fine = ["pip", "download", "--no-deps", "-m"]\n'
    ))  # fmt: skip
    literals = _literals([probe])
    options = _app_option_strings()
    assert {"--plain", "--prompt-lengths", "--no-enable-prefix-caching", "--kv-budget-mib", "--export"} <= options
    flagged = flags_named(literals, options)
    assert sorted(w.split(" names ")[0] for w in flagged) == ["probe.py:2", "probe.py:5"]
    assert any("probe.py:5 names --context-lengths / --prompt-lengths" in w for w in flagged)
    assert keys_named(literals) == ["probe.py:6 names a key: 'export one with the x key'"]
    assert len(verbs_named(literals, ("calibrate", "serve"))) == 1
    started = processes_started([probe])
    assert sorted(w.split(" ")[0] for w in started) == ["probe.py:2", "probe.py:3", "probe.py:4"], started


def classes_named_twice(sources: dict[str, str]) -> dict[str, list[str]]:
    """Public class names defined in more than one place among `sources` (path -> source text),
    each with its `path:line`s. A private class (`_Name`) is named only inside its module, so a
    reader never meets two of them under one name at an import."""
    where: dict[str, list[str]] = defaultdict(list)
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text, filename=path)):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where[node.name].append(f"{path}:{node.lineno}")
    return {name: places for name, places in sorted(where.items()) if len(places) > 1}


def test_no_two_classes_share_a_name():
    twice = classes_named_twice({_path_of(m): MODULES[m].read_text() for m in sorted(MODULES)})
    assert not twice, "one name, one job: rename one of each pair (a name that says its job):\n  " + "\n  ".join(
        f"{name}: {', '.join(places)}" for name, places in twice.items()
    )
    probe = {"a.py": "class Timeline: ...\nclass _Row: ...\n", "b.py": "class Timeline: ...\nclass _Row: ..."}
    assert classes_named_twice(probe) == {"Timeline": ["a.py:1", "b.py:1"]}  # the check sees a pair


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_reference_is_the_whole_story_by_itself():
    """minengine/reference/ (the model, its cache, its loop and its sampler) imports nothing of the
    engine: not the KV caches, the engine, the engine's model, the fast paths, the runners (the one
    that seats the reference in the engine is `minengine.steps.reference_runner`) or the engine's
    sampler. The engine may use the reference, never the other way round."""
    engine_side = ("minengine.kv", "minengine.engine", "minengine.model", "minengine.fast", "minengine.steps",
                   "minengine.sampling")  # fmt: skip
    reference = [m for m in MODULES if _within(m, ("minengine.reference",))]
    seen = [imp for imp in IMPORTS if imp.source in reference]
    wrong = [imp.where() for imp in seen if _within(imp.target, engine_side)]
    assert not wrong, "the reference must not lean on the engine:\n  " + "\n  ".join(wrong)
    assert "minengine.reference.model" in reference and any(imp.target == "minengine.reference.model" for imp in seen)
    assert _within("minengine.kv.cache", engine_side) and not _within("minengine.kvx", engine_side)  # the rule bites


def test_the_torch_model_imports_no_fast_path():
    """minengine/model/ is the engine's model in torch: the fast paths plug into it (its `ModelOps`, bound
    when the model is built; the decoders and the C stack beside it, in minengine/fast/), never the other way."""
    beside = ("minengine.fast", "minengine.steps")
    wrong = [imp.where() for imp in IMPORTS
             if imp.source.startswith("minengine.model.") and imp.target.startswith(beside)]  # fmt: skip
    assert not wrong, "minengine/model must not import minengine/fast or minengine/steps:\n  " + "\n  ".join(wrong)
