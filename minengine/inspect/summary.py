"""From what a step's observer kept to records: attention's top positions and entropies, the logit lens.

Everything is reduced on the device first (top-k, entropies, the strip's buckets) and crosses
to the host once per record, so the cost grows with the top-N asked for, not the context.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minengine.fast.linear_kernels import EmbeddingRows, PackedLinear
from minengine.fast.panel_kernels import PanelLinear
from minengine.inspect.ask import InspectAsk
from minengine.inspect.records import (
    STRIP_MAX,
    Attended,
    HeadAttention,
    LayerAttention,
    LayerLens,
    PositionWeights,
    StepAttention,
    StepLens,
)
from minengine.model.transformer import Transformer
from minengine.reference.model import ReferenceModel


def attention_record(weights: list[torch.Tensor], kv_heads: int, ask: InspectAsk, layout: str) -> StepAttention:
    """Every layer's per-head [Hq, context] softmax weights of one query as a `StepAttention`;
    `kv_heads`: the stored K/V heads they were read from."""
    w = torch.stack(weights)  # [layers, Hq, context]
    layers, q_heads, context = w.shape
    n = min(max(ask.attention_top, 1), context)
    entropy = -(w * w.clamp_min(1e-30).log()).sum(-1)  # [layers, Hq]
    top_w, top_i = w.topk(n, dim=-1)
    mean = w.mean(1)  # [layers, context]
    mean_w, mean_i = mean.topk(n, dim=-1)
    strips = _strips(mean) if ask.strip else [None] * layers
    entropy_l, top_wl, top_il = entropy.tolist(), top_w.tolist(), top_i.tolist()
    mean_wl, mean_il = mean_w.tolist(), mean_i.tolist()
    group = q_heads // kv_heads
    return StepAttention(
        query_position=context - 1,
        context=context,
        layout=layout,
        q_heads=q_heads,
        kv_heads=kv_heads,
        top_n=ask.attention_top,
        layers=tuple(
            LayerAttention(
                layer=i,
                heads=tuple(
                    HeadAttention(h, h // group, entropy_l[i][h], _attended(top_il[i][h], top_wl[i][h]))
                    for h in range(q_heads)
                ),
                mean_top=_attended(mean_il[i], mean_wl[i]),
                strip=strips[i],
            )
            for i in range(layers)
        ),
    )


def _attended(positions: list[int], weights: list[float]) -> tuple[Attended, ...]:
    return tuple(Attended(p, w) for p, w in zip(positions, weights, strict=True))


def _strips(mean: torch.Tensor) -> list[PositionWeights]:
    """Each layer's per-position mean weights, summed into at most `STRIP_MAX` buckets."""
    layers, context = mean.shape
    bucket = -(-context // STRIP_MAX)
    if bucket > 1:
        padded = torch.nn.functional.pad(mean, (0, -context % bucket))
        mean = padded.view(layers, -1, bucket).sum(-1)
    return [PositionWeights(bucket, tuple(row)) for row in mean.tolist()]


def lens_record(
    model: Transformer | ReferenceModel,
    residuals: torch.Tensor,
    logits: torch.Tensor,
    chosen: int,
    ask: InspectAsk,
    piece: Callable[[int], str],
) -> StepLens:
    """The logit lens of residuals [layers, hidden] (each block's output at the step's position)
    through the final norm and the head, tracking token `chosen`; `logits` [vocab] are the step's
    own, whose most likely tokens are the "candidates" basis."""
    h = model.norm(residuals)
    if ask.lens == "vocab":
        basis = None
        lens_logits = _project_all(model, h)
    else:
        top = logits.topk(min(ask.lens_candidates, logits.shape[-1])).indices
        basis = torch.cat([top, torch.tensor([chosen], device=top.device)]).unique()
        lens_logits = _project_onto(model, h, basis)
    probs = lens_logits.float().softmax(-1)  # [layers, basis]
    at = chosen if basis is None else int((basis == chosen).nonzero()[0, 0])
    chosen_p = probs[:, at]
    ranks = (probs > chosen_p.unsqueeze(1)).sum(-1) + 1
    top_p, top_at = probs.max(-1)
    top_ids = top_at if basis is None else basis[top_at]
    rows = zip(top_ids.tolist(), top_p.tolist(), ranks.tolist(), chosen_p.tolist(), strict=True)
    return StepLens(
        chosen=chosen,
        chosen_piece=piece(chosen),
        basis="vocab" if basis is None else "candidates",
        candidates=probs.shape[-1],
        layers=tuple(LayerLens(i, t, piece(t), p, r, c) for i, (t, p, r, c) in enumerate(rows)),
    )


def _project_all(model: Transformer | ReferenceModel, h: torch.Tensor) -> torch.Tensor:
    if isinstance(model, ReferenceModel):
        return h @ model.head.T
    return model.head(h)


def _project_onto(model: Transformer | ReferenceModel, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """h [layers, hidden] against the head's rows for `ids` only: [layers, len(ids)]."""
    rows = _head_rows(model, ids)
    if rows is None:  # a packed head of its own has no rows to take: project fully, keep the columns
        return _project_all(model, h)[:, ids]
    return h.to(rows.dtype) @ rows.T


def _head_rows(model: Transformer | ReferenceModel, ids: torch.Tensor) -> torch.Tensor | None:
    """The head's weight rows [len(ids), hidden] for `ids`, where its storage has them to take."""
    if isinstance(model, ReferenceModel):
        return model.head[ids]
    head = model.lm_head
    if isinstance(head, PanelLinear):
        return head.rows(ids)
    if isinstance(head, PackedLinear):
        if model.cfg.tie_word_embeddings and isinstance(model.embed, EmbeddingRows):
            return model.embed.lookup(ids)  # the tied head is the embedding, whose rows it keeps
        return None
    per_chunk = head.shape[2]
    return head[ids // per_chunk, :, ids % per_chunk]
