"""Another weight format's engine (or the reference kernels') beside the explorer's, one loaded at a time.

The engine for a format (one that `reqscope.other_formats` says runs here) is loaded on demand
over the same model folder and kept until another format is asked for: then it is dropped
first, so at most one second copy of the weights (in its own format) is resident beside the
explorer's. What it cost (load time, the process's RSS once it has loaded, the weight bytes it
holds) is measured at each load.
"""

from __future__ import annotations

import gc
import os

import psutil
import torch

from minengine.engine.engine import Engine
from minengine.progress import StatusCallback
from reqscope.other_formats import REFERENCE, run_label
from reqscope.ui.run.formats.agreement import EngineCost


class OtherEngine:
    """At most one engine in another weight format, over the explorer's model folder."""

    def __init__(self) -> None:
        self.engine: Engine | None = None

    def load(self, baseline: Engine, fmt: str, progress: StatusCallback) -> tuple[Engine, EngineCost | None]:
        """The engine for `fmt` (loaded now, with its cost, unless it is the one kept)."""
        if self.engine is not None and run_label(self.engine) == fmt:
            return self.engine, None
        self.drop()
        dtype = str(baseline.dtype).removeprefix("torch.") if baseline.device.type == "cpu" else "auto"
        reference = fmt == REFERENCE  # the plain model over the checkpoint's dense weights
        engine = Engine(
            baseline.model_dir,
            device=str(baseline.device),
            dtype=dtype,
            weights="auto" if reference else fmt,
            kernels="reference" if reference else "fast",
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
