"""Typed access to the key/value metadata of a GGUF file.

`gguf.GGUFReader` exposes each value as raw numpy parts; this view decodes them into Python
values and turns a missing or mistyped key into a WeightsError naming the key, so converters
never index into reader internals themselves.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from minengine.errors import WeightsError

_MISSING = object()


class GGUFMetadata:
    """Decoded metadata of one GGUF file, looked up by key (`llama.block_count`, ...)."""

    def __init__(self, reader: GGUFReader, source: str) -> None:
        self._reader = reader
        self._source = source

    @property
    def architecture(self) -> str:
        """`general.architecture`, e.g. "llama" or "qwen2"."""
        return self.get_str("general.architecture")

    def has(self, key: str) -> bool:
        """Whether the file stores `key`."""
        return key in self._reader.fields

    def get_str(self, key: str, default: Any = _MISSING) -> str:
        """A string value."""
        return self._get(key, str, default)

    def get_int(self, key: str, default: Any = _MISSING) -> int:
        """An integer value (any of the GGUF integer widths)."""
        return self._get(key, int, default)

    def get_float(self, key: str, default: Any = _MISSING) -> float:
        """A floating-point value (integers are accepted too)."""
        return self._get(key, float, default)

    def get_bool(self, key: str, default: Any = _MISSING) -> bool:
        """A boolean value."""
        return self._get(key, bool, default)

    def get_list(self, key: str, default: Any = _MISSING) -> list[Any]:
        """An array value (strings or numbers)."""
        return self._get(key, list, default)

    def _get(self, key: str, kind: type, default: Any) -> Any:
        field = self._reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise WeightsError(
                    f"{self._source} has no {key!r} metadata; is it a complete GGUF model?"
                )
            return default
        value = _decode(field.parts, field.data, field.types)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise WeightsError(
                f"{self._source}: metadata {key!r} is {type(value).__name__}, "
                f"expected {kind.__name__}"
            )
        return value


def _decode(parts: list[np.ndarray], data: list[int], types: list[GGUFValueType]) -> Any:
    main = types[0]
    if main == GGUFValueType.ARRAY:
        items = [parts[i] for i in data]
        if types[-1] == GGUFValueType.STRING:
            return [bytes(item).decode("utf-8") for item in items]
        # Numeric arrays can be long (one entry per vocabulary token): join them in one go.
        return np.concatenate(items).tolist() if items else []
    if main == GGUFValueType.STRING:
        return bytes(parts[data[0]]).decode("utf-8")
    value = parts[data[0]][0]
    if main == GGUFValueType.FLOAT32:
        # Print-and-parse keeps the value a float32 means (1e-05), not its binary expansion.
        return float(str(value))
    return value.item()
