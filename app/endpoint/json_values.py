"""Numbers out of a server's JSON, where a field may be missing, null, a string or a bool.

Every server the client reads (OpenAI's API, vLLM, llama-server, `reqscope serve`) reports
figures as JSON numbers; anything else in their place is taken as "not said" (None), never as
an error, so one odd field does not cost the rest of the report.
"""

from __future__ import annotations

import dataclasses
import typing
from functools import cache

T = typing.TypeVar("T")


def number(value: object) -> float | None:
    """A JSON number as a float; None for anything else (bool is an int to Python, never a figure)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def count(value: object) -> int | None:
    """A JSON integer; None for anything else."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def figures_from(cls: type[T], raw: dict) -> T:
    """`cls` (a dataclass of `int | None` and `float | None` fields named as the JSON names them)
    from the object `raw`, each field read as `count` or `number` by its type."""
    readers = _readers(cls)
    return cls(**{name: read(raw.get(name)) for name, read in readers.items()})


@cache
def _readers(cls: type) -> dict[str, typing.Callable[[object], object]]:
    hints = typing.get_type_hints(cls)
    readers = {}
    for field in dataclasses.fields(cls):
        kinds = set(typing.get_args(hints[field.name])) - {type(None)}
        if kinds == {int}:
            readers[field.name] = count
        elif kinds == {float}:
            readers[field.name] = number
        else:
            raise TypeError(f"{cls.__name__}.{field.name}: only int | None and float | None fields are read")
    return readers
