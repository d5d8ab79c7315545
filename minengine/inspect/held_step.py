"""A held step's views on demand: the step run again over the cache it already wrote, writing nothing.

A step on screen while paused was usually run without capture (its lean path). Its query is
recomputed from the token it fed; its keys are the cache's own, the step's position included
(the K/V the step stored, dequantized for FP8), so the weights are those the step gave, and
the cache, the logits waiting to be sampled and every later step stay exactly as they were.
"""

from __future__ import annotations

import torch

from minengine.inspect.observer import StepObserver
from minengine.kv.cache import KVCache
from minengine.kv.paged_cache import PagedKVCache
from minengine.model.transformer import Transformer
from minengine.reference.model import ReferenceModel
from minengine.steps.reference_runner import reference_forward
from minengine.threads import OneThread


class ReadingAttention:
    """`Attention` over positions [0, end) of a cache that already holds them: it reads, never writes."""

    def __init__(self, cache: KVCache | PagedKVCache, end: int, observer: StepObserver, model: Transformer) -> None:
        self.cache, self.end, self.observer = cache, end, observer
        self.scale, self.decode_attention = model.scale, model.ops.decode_attention

    def __call__(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = self.cache.read(index, self.end)
        self.observer.attended(index, q[0], keys[0])
        with OneThread(q.device):
            return self.decode_attention(q[0], keys[0], values[0], self.scale).view(1, -1)


@torch.inference_mode()
def recompute_step(
    model: Transformer | ReferenceModel,
    cache: KVCache | PagedKVCache,
    token: int,
    position: int,
    observer: StepObserver,
) -> torch.Tensor:
    """The step that fed `token` at `position` again, shown to `observer`; its logits [vocab] (float32)."""
    if isinstance(model, ReferenceModel):
        ids = torch.tensor([token], device=model.device)
        return reference_forward(model, ids, position, cache, observer=observer, writes=False)
    x = model.embed_tokens(torch.tensor([token], device=model.device))
    cos, sin = model.rope.lookup_signed(position, 1)
    attention = ReadingAttention(cache, position + 1, observer, model)
    for i in range(len(model.layers)):
        x = model.block(i, x, cos, sin, attention)
        observer.residual(i, x[0])
    return model.logits(x)
