"""argparse `type=` converters for numeric flags, so bad numbers fail as one-line usage errors.

Shared by the CLI's verbs and `python -m reqscope.bench`.
"""

from __future__ import annotations

import argparse
import math


def whole_number(text: str) -> int:
    """A non-negative integer such as a token or request count."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def non_negative(text: str) -> float:
    """A finite number >= 0, such as a duration in ms."""
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def positive(text: str) -> float:
    """A finite number > 0, such as a window length or bytes per element."""
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be greater than 0")
    return value


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


def positive_whole_number(text: str) -> int:
    """An integer >= 1, such as a layer count or block size."""
    value = whole_number(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value
