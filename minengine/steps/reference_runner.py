"""The reference model inside the engine (`--kernels reference`): the runner the engine's steps call.

It answers the calls `minengine.steps.model_runner.ModelRunner` answers, so the sessions, events,
batching, paged KV cache and prefix cache stay the engine's own; only each step's arithmetic is
the reference model's. A shared step runs its rows one after another, each over its own cache,
so a request's logits in a batch are its logits alone, bit for bit.

`minengine.reference` knows nothing of the engine: everything that seats it here is in this
module. The engine's caches hold [1, H, S, d] per layer where the reference keeps [S, H, d], so
`EngineCacheView` turns each of the model's cache calls around, and `ObserverView` does the same
for the explorer's observer; `EngineReferenceModel` adds what the engine reads of a model (the
roofline's byte counts, the observer's attention scale).
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
from minengine.steps.rows import Row, RowObserver
from minengine.steps.step_path import REFERENCE, StepPath
from minengine.threads import model_thread


class EngineReferenceModel(ReferenceModel):
    """The reference model as the engine holds it: the same forward, and what the engine reads of
    any model besides (`weight_bytes`, `decode_weight_bytes`, `scale`)."""

    @property
    def scale(self) -> float:
        """Attention's 1/sqrt(d), which the explorer's observer scales its scores by."""
        return self.cfg.head_dim**-0.5

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight tensor (a tied head counted once)."""
        tensors = {id(t): t for t in (self.embed, self.norm_weight, self.head)}
        for layer in self.layers:
            tensors |= {id(t): t for t in vars(layer).values() if t is not None}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    @property
    def decode_weight_bytes(self) -> int:
        """Bytes one decode step reads: every weight but the embedding table, of which one row
        (the embedding stays whole where the head is tied to it)."""
        untied = 0 if self.cfg.tie_word_embeddings else self.embed.numel() - self.embed.shape[1]
        return self.weight_bytes - untied * self.embed.element_size()


class EngineCacheView:
    """An engine cache (`KVCache`, `PagedKVCache`) behind the reference's `PlainKVCache.update`:
    K/V [T, Hkv, d] in, every position's [S, H, d] out. A view that does not write reads what the
    cache already holds instead (a held step recomputed: the cache stays as it was)."""

    def __init__(self, cache: KVCache | PagedKVCache, *, writes: bool = True) -> None:
        self.cache, self.writes = cache, writes

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`PlainKVCache.update` over the engine's cache."""
        if self.writes:
            keys, values = self.cache.update(layer, k.transpose(0, 1)[None], v.transpose(0, 1)[None], start)
        else:
            keys, values = self.cache.read(layer, start + k.shape[0])
        return keys[0].transpose(0, 1), values[0].transpose(0, 1)


class ObserverView:
    """The explorer's observer (`RowObserver`, keys [H, S, d]) behind the reference model's hooks (keys [S, H, d])."""

    def __init__(self, observer: RowObserver) -> None:
        self.observer = observer

    def attended(self, layer: int, q: torch.Tensor, keys: torch.Tensor) -> None:
        """Layer `layer`'s last query q [Hq, d] over keys [S, H, d]."""
        self.observer.attended(layer, q, keys.transpose(0, 1))

    def residual(self, layer: int, x: torch.Tensor) -> None:
        """The residual stream [hidden] after block `layer`."""
        self.observer.residual(layer, x)


def reference_forward(
    model: ReferenceModel,
    ids: torch.Tensor,
    start: int,
    cache: KVCache | PagedKVCache,
    *,
    all_logits: bool = False,
    observer: RowObserver | None = None,
    writes: bool = True,
) -> torch.Tensor:
    """`ReferenceModel.forward` over an engine cache (read only without `writes`), shown to `observer`."""
    seen = ObserverView(observer) if observer is not None else None
    return model.forward(ids, start, EngineCacheView(cache, writes=writes), all_logits=all_logits, observer=seen)


class ReferenceRunner:
    """A loaded reference model behind `ModelRunner`'s calls: `new_cache`, `forward`, `forward_rows`."""

    static_decoder = None  # no CUDA graphs, no lean steps: every step is the model's `forward`

    def __init__(self, model: EngineReferenceModel) -> None:
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
        return reference_forward(self.model, ids, start, cache, all_logits=all_logits)

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
            observer = row.observer if row.logits else None
            logits = reference_forward(self.model, ids, row.start, row.cache, observer=observer)
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
