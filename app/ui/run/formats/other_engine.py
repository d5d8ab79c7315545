"""Another weight format's engine beside the explorer's: which formats this machine runs, and one loaded at a time.

A format is checked as the engine checks it (`weight_format.resolve_weights`, `refuse_shapes`),
before anything loads, so one this torch, CPU or device lacks is listed with the reason instead
of failing. The engine for a format is loaded on demand over the same model folder and kept
until another format is asked for: then it is dropped first, so at most one second copy of the
weights (in its own format) is resident beside the explorer's. What it cost (load time, the
process's RSS once it has loaded, the weight bytes it holds) is measured at each load.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import psutil
import torch

from minengine.device import resolve_dtype
from minengine.dtype_names import WEIGHT_FORMATS
from minengine.engine.engine import Engine
from minengine.model.weight_format import WeightFormatError, compute_dtype_for, refuse_shapes, resolve_weights
from minengine.progress import StatusCallback
from reqscope.ui.run.formats.agreement import EngineCost
from reqscope.wording import error_text


@dataclass(frozen=True)
class FormatOption:
    """A weight format other than the explorer's, and why it cannot run here ("" when it can)."""

    format: str
    why_not: str = ""

    @property
    def runs(self) -> bool:
        """True when this machine runs the format."""
        return not self.why_not


def format_options(engine: Engine) -> tuple[FormatOption, ...]:
    """Every weight format but `engine`'s own, each checked for this device, compute dtype, torch and model."""
    options = []
    for fmt in WEIGHT_FORMATS:
        if fmt == engine.weights.format:
            continue
        try:
            refuse_shapes(resolve_weights(fmt, engine.device, _compute_dtype(engine, fmt)), engine.cfg)
        except WeightFormatError as exc:
            options.append(FormatOption(fmt, error_text(exc)))
            continue
        options.append(FormatOption(fmt))
    return tuple(options)


def _compute_dtype(engine: Engine, fmt: str) -> torch.dtype:
    # The CPU's packed formats compute in the explorer's dtype; elsewhere a format is its own dtype.
    if engine.device.type == "cpu":
        return engine.dtype
    return resolve_dtype(compute_dtype_for(fmt, engine.device), engine.device)


class OtherEngine:
    """At most one engine in another weight format, over the explorer's model folder."""

    def __init__(self) -> None:
        self.engine: Engine | None = None

    def load(self, baseline: Engine, fmt: str, progress: StatusCallback) -> tuple[Engine, EngineCost | None]:
        """The engine for `fmt` (loaded now, with its cost, unless it is the one kept)."""
        if self.engine is not None and self.engine.weights.format == fmt:
            return self.engine, None
        self.drop()
        dtype = str(baseline.dtype).removeprefix("torch.") if baseline.device.type == "cpu" else "auto"
        engine = Engine(
            baseline.model_dir,
            device=str(baseline.device),
            dtype=dtype,
            weights=fmt,
            kv_budget_bytes=baseline.pool.budget_bytes,
            progress=progress,
            prefix_cache=False,
            max_num_seqs=1,
        )
        self.engine = engine
        return engine, EngineCost(engine.load_ms, engine.model.weight_bytes, _rss())

    def drop(self) -> None:
        """Let the kept engine go (its weights are freed once nothing else holds them)."""
        if self.engine is None:
            return
        device = self.engine.device
        self.engine = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _rss() -> int:
    return psutil.Process(os.getpid()).memory_info().rss
