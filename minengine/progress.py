"""Progress events reported while the default model is fetched, verified and converted."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class PullProgress:
    """One step of a pull or a GGUF conversion.

    `stage` is "download", "verify", "convert" or "write"; `done` and `total` count bytes for
    download/verify and tensors or files for convert/write; `total` is None while unknown.
    """

    stage: str
    done: int
    total: int | None
    message: str

    @property
    def fraction(self) -> float | None:
        """Share of the stage that is finished, or None while the total is unknown."""
        if not self.total:
            return None
        return min(1.0, self.done / self.total)


ProgressCallback = Callable[[PullProgress], None]


def report_to(callback: ProgressCallback | None) -> ProgressCallback:
    """A callable that forwards events to `callback`, or drops them when there is none."""
    return callback if callback is not None else _ignore


def _ignore(_event: PullProgress) -> None:
    pass
