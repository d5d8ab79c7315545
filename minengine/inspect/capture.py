"""One request's capture: what is asked, each step's observer, and the cost it is measured at.

The session asks `observer()` before each forward: None while nothing is asked, so the step
runs exactly its uncaptured path (the lean single-token step, for a request alone). After the
token is chosen, `inspection()` turns the step's observer into records. The steps run without
capture are timed too (a median over the last few, as the explorer's solo-step figure is), so
a captured step's cost is said against them.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable

import torch

from minengine.device import synchronize
from minengine.inspect.ask import NOTHING, InspectAsk
from minengine.inspect.held_step import recompute_step
from minengine.inspect.observer import StepObserver
from minengine.inspect.records import InspectCost, StepInspection
from minengine.inspect.summary import attention_record, lens_record
from minengine.kv.cache import KVCache
from minengine.kv.paged_cache import PagedKVCache
from minengine.model.transformer import Transformer
from minengine.threads import OneThread

_PLAIN_HISTORY = 16  # uncaptured single-token steps the median is over


class StepCapture:
    """What one request captures of its steps, and the records of the step just run."""

    def __init__(self, layout: str, piece: Callable[[int], str]) -> None:
        self.ask: InspectAsk = NOTHING
        self.layout = layout
        self.piece = piece
        self._plain_ms: deque[float] = deque(maxlen=_PLAIN_HISTORY)
        self._pending: tuple[StepObserver, float, int] | None = None  # observer, forward ms, tokens fed

    def observer(self, model: Transformer) -> StepObserver | None:
        """A fresh observer for the next forward, or None when nothing is asked."""
        if not self.ask.anything:
            return None
        return _observer(model, self.ask)

    def ran(self, observer: StepObserver | None, forward_ms: float, tokens: int) -> None:
        """The forward `observer` watched (None: uncaptured) took `forward_ms` over `tokens` tokens."""
        if observer is None:
            self._pending = None
            if tokens == 1:
                self._plain_ms.append(forward_ms)
        else:
            self._pending = (observer, forward_ms, tokens)

    @property
    def pending(self) -> bool:
        """Whether a captured forward waits for its records (`inspection`)."""
        return self._pending is not None

    def inspection(self, model: Transformer, logits: torch.Tensor, chosen: int) -> StepInspection | None:
        """The records of the step whose `logits` chose `chosen`, if it was captured (once)."""
        pending, self._pending = self._pending, None
        if pending is None or not pending[0].complete:
            return None
        observer, forward_ms, tokens = pending
        plain = statistics.median(self._plain_ms) if self._plain_ms and tokens == 1 else None
        return _records(model, observer, logits, chosen, self.layout, self.piece, forward_ms, plain, False)

    def on_demand(
        self,
        model: Transformer,
        cache: KVCache | PagedKVCache,
        token: int,
        position: int,
        chosen: int,
        ask: InspectAsk,
    ) -> StepInspection:
        """The held step that fed `token` at `position`, recomputed reading `cache`, as `ask` asks."""
        observer = _observer(model, ask)
        start = time.perf_counter()
        logits = recompute_step(model, cache, token, position, observer)
        synchronize(model.device)
        ms = (time.perf_counter() - start) * 1000
        observer.work_ns = int(ms * 1e6)  # all of it is inspection's: the step itself had already run
        return _records(model, observer, logits, chosen, self.layout, self.piece, ms, None, True)


def _observer(model: Transformer, ask: InspectAsk) -> StepObserver:
    cfg = model.cfg
    return StepObserver(ask, cfg.num_hidden_layers, cfg.hidden_size, model.scale, model.dtype, model.device)


def _records(
    model: Transformer,
    observer: StepObserver,
    logits: torch.Tensor,
    chosen: int,
    layout: str,
    piece: Callable[[int], str],
    forward_ms: float,
    plain_ms: float | None,
    on_demand: bool,
) -> StepInspection:
    start = time.perf_counter()
    ask = observer.ask
    # A few dozen small reductions: on one thread, as single-query attention runs (`threads.OneThread`).
    with torch.inference_mode(), OneThread(logits.device):
        attention = None
        if ask.attention:
            attention = attention_record(observer.weights, observer.kv_heads, ask, layout)
        lens = None
        if ask.lens is not None and observer.residuals is not None:
            lens = lens_record(model, observer.residuals, logits, chosen, ask, piece)
    build_ms = (time.perf_counter() - start) * 1000  # the records cross to the host: the device is done
    cost = InspectCost(forward_ms + build_ms, plain_ms, observer.work_ns / 1e6 + build_ms)
    return StepInspection(attention, lens, cost, on_demand)
