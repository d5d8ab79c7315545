"""The reference model inside the engine (`--kernels reference`): the runner the engine's steps call.

It answers the calls `minengine.steps.model_runner.ModelRunner` answers, so the sessions, events,
batching, paged KV cache and prefix cache stay the engine's own; only each step's arithmetic is
the reference model's. A shared step runs its rows one after another, each over its own cache,
so a request's logits in a batch are its logits alone, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from minengine.checkpoint.weight_format import DTYPE_FORMAT, WeightChoice, WeightFormatError
from minengine.errors import Setting
from minengine.kv.cache import KVCache
from minengine.kv.paged_cache import PagedKVCache
from minengine.kv.request_cache import request_cache
from minengine.reference.model import ReferenceModel
from minengine.steps.shared_step import Row
from minengine.steps.step_path import REFERENCE, StepPath
from minengine.threads import model_thread


class ReferenceRunner:
    """A loaded `ReferenceModel` behind `ModelRunner`'s calls: `new_cache`, `forward`, `forward_rows`."""

    static_decoder = None  # no CUDA graphs, no lean steps: every step is the model's `forward`

    def __init__(self, model: ReferenceModel) -> None:
        self.model = model
        self.device = model.device
        self.last_path: StepPath = REFERENCE

    def use_static_decode(self, enabled: bool, *, capture: bool | None = None) -> None:
        """The reference has no static step; asking for one changes nothing."""

    def new_cache(self, tokens: int, **options: Any) -> KVCache | PagedKVCache:
        """The engine's cache for a request (`request_cache`, whose options these are): the
        reference has no static arena."""
        m = self.model
        return request_cache(m.cfg, m.device, m.dtype, tokens, **options)

    def forward(
        self, ids: torch.Tensor, start: int, cache: KVCache | PagedKVCache, *, all_logits: bool = False
    ) -> torch.Tensor:
        """`ReferenceModel.forward` over the engine's cache, on the model thread as every step."""
        steps = model_thread()
        if not steps.here():
            return steps.call(lambda: self.forward(ids, start, cache, all_logits=all_logits))
        if isinstance(cache, PagedKVCache):
            cache.make_room(start + ids.shape[0])
        return self.model.forward(ids, start, cache, all_logits=all_logits)

    def forward_rows(self, rows: list[Row], computing: Callable[[], object] | None = None) -> list[torch.Tensor | None]:
        """One shared step: each row's tokens through the model over its own cache, in turn."""
        steps = model_thread()
        if not steps.here():
            return steps.call(self.forward_rows, rows, computing)
        for row in rows:  # every row's blocks before any compute, so a full pool fails first
            if isinstance(row.cache, PagedKVCache):
                row.cache.make_room(row.start + len(row.ids))
        if computing is not None:
            computing()
        out: list[torch.Tensor | None] = []
        for row in rows:
            ids = torch.tensor(row.ids, device=self.device)
            logits = self.model.forward(ids, row.start, row.cache, observer=row.observer if row.logits else None)
            out.append(logits if row.logits else None)
        return out


def reference_weights(asked: str, dtype: torch.dtype) -> WeightChoice:
    """The weight format under the reference kernels: always dense in the compute dtype, as the
    checkpoint stores them; asking for another format is refused."""
    fmt = DTYPE_FORMAT.get(dtype, str(dtype).removeprefix("torch."))
    if asked not in ("auto", fmt):
        raise WeightFormatError(
            f"weights {asked!r} is a fast-path format, and the reference kernels keep the weights dense in {fmt}; "
            "drop ", Setting.WEIGHTS, " or leave ", Setting.KERNELS, " at fast",
        )
    return WeightChoice(fmt, "reference kernels: dense, as the checkpoint stores them")
