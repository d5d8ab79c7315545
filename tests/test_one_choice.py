"""One place chooses how a step runs: `ModelRunner.pick`/`pick_rows` (the step's plan) and the model's
load-time set-up. Nothing else picks between two implementations of the same step or op.

Read from the source, as `test_layering` reads imports, so a branch added back anywhere fails here,
naming its file, function and line:

- a step path's name compared outside `step_path.py`: the plan runs, nobody dispatches on its name;
- a C-or-torch branch in the request path's model code (`model/`, `fast/`, `steps/`, `checkpoint/`):
  a condition that asks whether a C kernel serves (`...serves...()`, `library()`, `.lib`, `available()`,
  `activations()`, `amx_takes()`, `in_place()`), whether an operand is a kernel's (`isinstance` with a kernel's
  class), or compares a row count with a kernel's threshold (`UNPACK_ROWS`, `AMX_ROWS`), anywhere
  but in the functions `CHOOSERS` lists, each of which runs once at load, reports a setting, or
  is the plan. A condition whose branch only raises is a guard, not a choice.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL_CODE = ("minengine/model", "minengine/fast", "minengine/steps", "minengine/checkpoint")
KERNEL_CLASSES = {"PanelLinear", "PackedLinear", "EmbeddingRows", "LayerStack", "PromptStack", "KernelLibrary",
                  "SlotKernel", "RowsKernel"}  # fmt: skip
ASKS = {"library", "available", "activations", "amx_takes", "in_place"}  # and any `serves...`
THRESHOLDS = {"UNPACK_ROWS", "AMX_ROWS"}

# file::function -> why it may choose. Each runs once when the model (or a weight) is built, reports a
# setting, or is the plan; the one exception is named as such.
CHOOSERS = {
    "minengine/steps/model_runner.py::ModelRunner.pick": "the plan of one sequence's step",
    "minengine/steps/model_runner.py::ModelRunner.pick_rows": "the plan of a shared step",
    "minengine/steps/model_runner.py::ModelRunner._stack_group": "the plan: why the C stack cannot take the rows",
    "minengine/steps/shared_step.py::pooled_rows_count": "the plan: which decode rows attend together",
    "minengine/steps/shared_step.py::paged_chunks": "the plan: which chunk rows attend their blocks in place",
    "minengine/fast/row_ops.py::model_ops": "load: the model's row operations",
    "minengine/fast/eager_step.py::writer": "load: how each projection writes a decode step's scratch",
    "minengine/fast/eager_step.py::LayerStack.of": "load: the model's C stack, made once",
    "minengine/fast/eager_step.py::LayerStack.serves": "load: whether the blocks are the C stack's shape",
    "minengine/fast/prompt_stack.py::PromptStack.of": "load: the model's C prompt stack, made once",
    "minengine/fast/prompt_stack.py::PromptStack.serves_model": "load: whether it computes the Python blocks' bits",
    "minengine/fast/cpu_kernels.py::kernels_setting": "a setting's report (`reqscope env`)",
    "minengine/fast/panel_kernels.py::activations_refusal": "a setting's report",
    "minengine/fast/panel_kernels.py::amx_setting": "a setting's report",
    "minengine/fast/panel_kernels.py::PanelLinear.linear": (
        "the one left: from UNPACK_ROWS rows a panel product runs MKL's GEMM over the weight laid out "
        "densely, a choice of the product's own by its row count (docs/engine.md says so)"
    ),
    "minengine/checkpoint/weight_format.py::_float32": "load: the weight format",
    "minengine/checkpoint/weight_format.py::_fp16": "load: the weight format",
    "minengine/checkpoint/weight_format.py::resolve_weights": "load: the weight format",
    "minengine/checkpoint/layout_cache.py::RecordingReader.projection": "load: recording the built layout",
    "minengine/checkpoint/weight_layout.py::token_lookup": "load: how token ids become embedding rows",
    "minengine/checkpoint/weight_layout.py::KernelProduct.gating": "load: whether a gate/up kernel gates its sums",
    "minengine/checkpoint/weight_layout.py::read_bytes": "a byte count: runs nothing",
}


@dataclass(frozen=True)
class Choice:
    """One condition that picks an implementation."""

    where: str  # file::function
    line: int
    asks: str  # what the condition asks

    def __str__(self) -> str:
        return f"{self.where.replace('::', f':{self.line} in ')} ({self.asks})"


def _name(node: ast.AST) -> str:
    return getattr(node, "id", None) or getattr(node, "attr", None) or ""


def asks_for_a_kernel(test: ast.AST) -> str | None:
    """What a condition asks that picks C or torch, or None."""
    for node in ast.walk(test):
        if isinstance(node, ast.Call):
            name = _name(node.func)
            if name in ASKS or "serves" in name:
                return f"asks {name}()"
            if name == "isinstance" and len(node.args) == 2:
                kinds = [_name(n) for n in ast.walk(node.args[1])]
                if KERNEL_CLASSES.intersection(kinds):
                    return f"isinstance of {'/'.join(sorted(KERNEL_CLASSES.intersection(kinds)))}"
        if isinstance(node, ast.Attribute) and node.attr == "lib":
            return "reads .lib"
        if isinstance(node, ast.Name | ast.Attribute) and _name(node) in THRESHOLDS:
            return f"compares with {_name(node)}"
    return None


def _guard(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and not node.orelse and all(isinstance(s, ast.Raise) for s in node.body)


def choices_in(source: str, name: str) -> list[Choice]:
    """Every condition in `source` (the file `name`) that picks C or torch, with its function."""
    found: list[Choice] = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                visit(child, [*scope, child.name])
                continue
            tests = []
            if isinstance(child, ast.If | ast.IfExp | ast.While) and not _guard(child):
                tests.append(child.test)
            if isinstance(child, ast.comprehension):
                tests.extend(child.ifs)
            for test in tests:
                asks = asks_for_a_kernel(test)
                if asks:
                    found.append(Choice(f"{name}::{'.'.join(scope) or '<module>'}", test.lineno, asks))
            visit(child, scope)

    visit(ast.parse(source), [])
    return found


def _sources(folders: tuple[str, ...]) -> dict[str, str]:
    return {
        str(path.relative_to(ROOT)): path.read_text()
        for folder in folders
        for path in sorted((ROOT / folder).rglob("*.py"))
    }


def test_only_the_plan_and_the_load_choose_between_c_and_torch():
    found = [c for name, source in _sources(MODEL_CODE).items() for c in choices_in(source, name)]
    wrong = [str(c) for c in found if c.where not in CHOOSERS]
    assert not wrong, (
        "a C-or-torch choice outside the step's plan and the model's load-time set-up; make it once, in "
        "`ModelRunner.pick`/`pick_rows` or when the model is built:\n  " + "\n  ".join(wrong)
    )
    stale = sorted(set(CHOOSERS) - {c.where for c in found})
    assert not stale, f"CHOOSERS names functions that choose nothing any more (remove them): {stale}"


def path_names_compared(source: str, name: str) -> list[str]:
    """file:line for each comparison of a step path's name (`x.path.name == ...`, `last_path.name in ...`,
    `path.name.startswith(...)`)."""

    def is_path_name(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "name" and "path" in _name(node.value).lower()

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(is_path_name(n) for n in [node.left, *node.comparators]) or (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and is_path_name(node.func.value)
            and node.func.attr in ("startswith", "endswith")
        ):
            found.append(f"{name}:{node.lineno}")
    return found


def test_no_code_dispatches_on_a_step_paths_name():
    sources = _sources(("minengine", "app"))
    wrong = [w for name, source in sources.items() if not name.endswith("step_path.py")
             for w in path_names_compared(source, name)]  # fmt: skip
    assert not wrong, "a step path's name is for people; the plan runs itself (`StepPlan.run`):\n  " + "\n  ".join(
        wrong
    )


def test_the_rules_catch_what_they_are_for():
    # Guards the two rules above against passing vacuously: the branches this project once had.
    probe = (
        "class RMSNorm:\n"
        "    def __call__(self, x):\n"
        "        if self.wide and library().lib is not None:\n"
        "            return c_rms_norm(x)\n"
        "def attend(q, k, v):\n"
        "    if activations() == 'int8' and serves(q, k[0], v[0]):\n"
        "        return attend_prompt(q, k, v)\n"
        "def project_chunks(x, weight, out):\n"
        "    return weight.linear(x, out) if isinstance(weight, PanelLinear) else x @ weight\n"
        "def guarded(q):\n"
        "    if not serves(q):\n"
        "        raise ValueError('layout')\n"
        "def forward(self, rows):\n"
        "    if path.name != 'torch rows' and not stacked:\n"
        "        pass\n"
        "    if self.last_path.name.startswith('c-stack'):\n"
        "        pass\n"
    )
    choices = choices_in(probe, "probe.py")
    assert [(c.where, c.line) for c in choices] == [
        ("probe.py::RMSNorm.__call__", 3),
        ("probe.py::attend", 6),
        ("probe.py::project_chunks", 9),
    ], choices
    assert sorted(path_names_compared(probe, "probe.py")) == ["probe.py:14", "probe.py:16"]
