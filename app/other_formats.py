"""The weight formats besides an engine's own that this machine runs, and why the others do not.

A format is checked as the engine checks it (`weight_format.resolve_weights`, `refuse_shapes`),
before anything loads, with the compute dtype a second engine in that format would use: the
engine's own on the CPU (where the packed formats compute in float32), the format's own dtype
elsewhere. The explorer's `w` and the benchmark's format rows both ask here.
"""

from __future__ import annotations

from dataclasses import dataclass

from minengine.checkpoint.weight_format import WeightFormatError, compute_dtype_for, refuse_shapes, resolve_weights
from minengine.device import resolve_dtype
from minengine.dtype_names import WEIGHT_FORMATS
from minengine.engine.engine import Engine
from reqscope.wording import error_text


@dataclass(frozen=True)
class FormatOption:
    """A weight format other than the engine's, and why it cannot run here ("" when it can)."""

    format: str
    why_not: str = ""

    @property
    def runs(self) -> bool:
        """True when this machine runs the format."""
        return not self.why_not


REFERENCE = "reference"  # the reference model (`--kernels reference`), a row beside the formats


def run_label(engine: Engine) -> str:
    """What a comparison row calls an engine: "reference" under the reference kernels, else its format."""
    return REFERENCE if engine.kernels == REFERENCE else engine.weights.format


def other_formats(
    engine: Engine, asked: tuple[str, ...] = WEIGHT_FORMATS, *, reference: bool = False
) -> tuple[FormatOption, ...]:
    """Each format of `asked` but `engine`'s own, once, checked for this device, compute dtype, torch and model;
    with `reference`, the reference kernels last (dense weights, any machine), unless `engine` runs them."""
    options = []
    for fmt in dict.fromkeys(asked):
        if fmt == engine.weights.format and engine.kernels != REFERENCE:  # the reference's float32 is not fast float32
            continue
        if engine.device.type == "cpu":
            dtype = engine.dtype
        else:
            dtype = resolve_dtype(compute_dtype_for(fmt, engine.device), engine.device)
        try:
            refuse_shapes(resolve_weights(fmt, engine.device, dtype), engine.cfg)
        except WeightFormatError as exc:
            options.append(FormatOption(fmt, error_text(exc)))
            continue
        options.append(FormatOption(fmt))
    if reference and engine.kernels != REFERENCE:
        options.append(FormatOption(REFERENCE))
    return tuple(options)
