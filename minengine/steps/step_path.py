"""Which way a step's arithmetic ran, and why: the name the explorer, `--json` and the trace show.

Every forward of the engine goes one of these ways. `ModelRunner.pick` and `pick_rows` are the
one place that chooses among them: each returns a `StepPlan`, the path and the call that carries
it out, and the runner only calls it. The reference kernels send every step to the reference
model instead (`reference_runner`).

- `reference`: the plain PyTorch model (`minengine/reference/model.py`), dense weights;
- `cuda-graph`: one token, replayed from a captured CUDA graph (`cuda_graph.StaticDecoder`);
- `static eager`: the same static step run eagerly (where capture is off);
- `c-stack ACT×FMT`: one token, every block in one C call (`eager_step.LayerStack`), the
  products in FMT weights times ACT-rounded rows;
- `torch eager`: one token through the Python block into scratch buffers (`eager_step`);
- `c-stack prompt ACT×FMT`: one sequence's prompt chunk, every block in one C call
  (`prompt_stack.PromptStack`);
- `torch general`: any tokens, any cache (`Transformer.forward`): prefill the prompt stack does not
  take, quantized caches;
- `c-stack rows ACT×FMT` / `torch rows`: several sequences' rows in one shared step
  (`shared_step`), through the C stack or the Python blocks;
- `c-stack rows ACT×FMT + c-stack prompt`: a shared step of decode rows and one prompt chunk in two
  passes, the decode rows through the C stack, then the chunk through the C prompt stack;
- `c-stack rows ACT×FMT + torch chunks`: the same two passes where the prompt stack does not take the
  chunks (several, an inspected one, or a cache it does not serve): they go through the Python blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class StepPath:
    """A step's path: its name, and why that one ran."""

    name: str
    why: str


@dataclass(frozen=True)
class StepPlan(Generic[T]):
    """A step's path and the call that carries it out, every condition of it checked already:
    `run()` runs exactly the path named, and nothing downstream looks at the name again."""

    path: StepPath
    run: Callable[[], T]


REFERENCE = StepPath("reference", "the reference kernels: the plain PyTorch model over dense weights")
NOT_RUN = StepPath("", "no step has run yet")


def weights_label(projection: object) -> str:
    """"int16×q4_1" for a projection in panels whose rows are rounded to int16, "float32×fp16" for
    fp16 panels times float32 rows, the dtype for a dense tensor."""
    fmt = getattr(projection, "format", None)
    if fmt is None:
        return str(getattr(projection, "dtype", "")).removeprefix("torch.")
    return f"{getattr(projection, 'rounding', None) or 'float32'}×{fmt}"
