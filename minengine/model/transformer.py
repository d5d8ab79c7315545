"""A compact decoder-only transformer (llama / mistral / qwen2 / qwen3 families).

Numerics follow Hugging Face's modeling files: RMSNorm in float32 cast back before the weight
multiply, RoPE angles in float32, SiLU-gated MLP. `forward` runs one sequence; a step shared
by several runs the same blocks over their stacked tokens (`shared_step`).

Top to bottom: one block's weights (`Layer`); what a block is handed besides its input, the
buffers a one-token step writes into (`Scratch`) and where K/V go and how attention reads them
(`Attention`; `CacheAttention` over any cache); then `Transformer`: the embedding, the block
(RMSNorm, q/k/v heads with RoPE, attention, output projection, MLP, residuals), the head, and
`forward`, the whole model over a KV cache. Attention's K/V handling is the one thing that
differs between the ways of running a step, which is why it is an argument: the single-token
decode steps (`eager_step`, `cuda_graph`) pass their own and run this same block. Which of
them runs is `runner.ModelRunner`'s choice, not this file's. The small shared operations
(RMSNorm, the two attentions) are in `ops`, RoPE's tables in `rope`.

Decode runs one token through every layer: a few hundred small operations per step, each
costing more in dispatch than in arithmetic, while all weights stream from memory once. So the
block keeps operations few and cheap: q/k/v and gate/up are fused matrices whose layout is
chosen for streaming (`weight_layout`), q and k are normalised and rotated together, RMSNorm
is four dispatches, residuals are added in place, and single-query attention is a small
matmul/softmax/matmul run on one thread (SDPA's kernels, and waking idle threads, cost more
than the work at that size). In prefill the last layer computes only the position whose logits
are returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from minengine.checkpoint import loader
from minengine.checkpoint.weight_layout import (
    CheckpointReader,
    Embedding,
    Operand,
    WeightSource,
    project,
    project_chunks,
)
from minengine.config import ModelConfig
from minengine.fast.linear_kernels import EmbeddingRows, PackedLinear
from minengine.fast.panel_kernels import PanelLinear
from minengine.kv.cache import KVCache
from minengine.model.ops import RMSNorm, attend, c_silu_mul, decode_attention, heads_first
from minengine.model.rope import RotaryTable, rotate
from minengine.progress import ProgressCallback
from minengine.threads import OneThread


class Layer:
    """One transformer block's weights (projections as `weight_layout` operands)."""

    def __init__(self, ckpt: WeightSource, prefix: str, cfg: ModelConfig) -> None:
        a, m, eps = prefix + "self_attn.", prefix + "mlp.", cfg.rms_norm_eps
        self.input_norm = RMSNorm(ckpt.copy(prefix + "input_layernorm.weight"), eps)
        self.post_norm = RMSNorm(ckpt.copy(prefix + "post_attention_layernorm.weight"), eps)
        self.qkv = ckpt.projection(*(a + f"{p}_proj.weight" for p in "qkv"))
        self.qkv_bias = None
        if cfg.attention_bias:
            self.qkv_bias = torch.cat([ckpt.copy(a + f"{p}_proj.bias") for p in "qkv"])
        self.o = ckpt.projection(a + "o_proj.weight")
        # Two chunks, gate then up: the MLP takes them apart without reassembling columns.
        self.gate_up = ckpt.projection(m + "gate_proj.weight", m + "up_proj.weight", chunks=2)
        self.down = ckpt.projection(m + "down_proj.weight")
        self.q_norm = ckpt.optional(a + "q_norm.weight")
        self.k_norm = ckpt.optional(a + "k_norm.weight")
        # qwen3 normalises each q head and each k head; one weight row per head lets a single
        # norm call cover q and k together.
        self.qk_norm = None
        if self.q_norm is not None and self.k_norm is not None:
            hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
            self.qk_norm = RMSNorm(torch.cat([self.q_norm.expand(hq, -1), self.k_norm.expand(hkv, -1)]), eps)

    def tensors(self) -> list[torch.Tensor | PackedLinear | PanelLinear]:
        """Every parameter of the block, tensors and packed weights (for byte counts)."""
        optional = (self.qkv_bias, self.q_norm, self.k_norm)
        norms = [self.input_norm.weight, self.post_norm.weight]
        return [*norms, self.qkv, self.o, self.gate_up, self.down] + [t for t in optional if t is not None]


@dataclass
class Scratch:
    """Buffers one token's pass through a block writes into, and the fixed views into them.

    A decode step that passes these to `Transformer.block` allocates nothing and makes no view:
    every product lands in a buffer whose views (q/k/v heads, gate and up, rows) were made once
    (`eager_step` says what that saves). Projection buffers are [chunks, 1, n/chunks], the
    layout `project_chunks` writes. One set serves every layer; a thread needs its own.
    """

    qkv: torch.Tensor  # the fused projection's output, chunks end to end
    qk: torch.Tensor  # [1, Hq+Hkv, d] view of q and k in `qkv`
    v: torch.Tensor  # [Hkv, d] view of v in `qkv`
    rotated: torch.Tensor  # [1, Hq+Hkv, d]
    swapped: torch.Tensor  # [1, Hq+Hkv, d], rotation's second term
    q: torch.Tensor  # [Hkv, Hq/Hkv, d] view of `rotated`: the query heads of each KV head as rows
    k: torch.Tensor  # [Hkv, d] view of `rotated`
    attended: torch.Tensor  # [Hkv, Hq/Hkv, d]
    attended_row: torch.Tensor  # [1, Hq*d] view of `attended`
    o: torch.Tensor
    o_row: torch.Tensor  # [1, hidden] view of `o`
    gate_up: torch.Tensor  # [2, 1, ff]: gate, then up
    gate: torch.Tensor  # [1, ff] views of `gate_up`
    up: torch.Tensor
    down: torch.Tensor
    down_row: torch.Tensor  # [1, hidden] view of `down`

    @classmethod
    def for_model(cls, model: Transformer) -> Scratch:
        """A fresh set shaped for `model`'s blocks."""
        cfg, layer = model.cfg, model.layers[0]
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

        def out(operand: torch.Tensor) -> torch.Tensor:
            return torch.empty(operand.shape[0], 1, operand.shape[2], dtype=model.dtype, device=model.device)

        qkv, o, gate_up, down = out(layer.qkv), out(layer.o), out(layer.gate_up), out(layer.down)
        flat = qkv.view(1, -1)
        qk = flat[:, : (hq + hkv) * d].view(1, hq + hkv, d)
        rotated = torch.empty_like(qk)
        attended = torch.empty(hkv, hq // hkv, d, dtype=model.dtype, device=model.device)
        return cls(
            qkv=qkv,
            qk=qk,
            v=flat[0, (hq + hkv) * d :].view(hkv, d),
            rotated=rotated,
            swapped=torch.empty_like(qk),
            q=rotated[0, :hq].view(hkv, hq // hkv, d),
            k=rotated[0, hq:],
            attended=attended,
            attended_row=attended.view(1, hq * d),
            o=o,
            o_row=o.view(1, -1),
            gate_up=gate_up,
            gate=gate_up[0],
            up=gate_up[1],
            down=down,
            down_row=down.view(1, -1),
        )


class Attention(Protocol):
    """Where a block's K/V go and how its queries read them: one per way of running a step."""

    def __call__(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store layer `index`'s k/v for this step's positions; the attended heads, [rows of q, Hq*d].

        q, k, v are `Transformer.qkv_heads`'s (their scratch views when the step has a `Scratch`).
        """
        ...


class CacheAttention:
    """`Attention` over a `KVCache`: k/v stored at positions [start, start+T), queries attend causally.

    Any cache and any number of positions (quantized or widened storage included: `KVCache.update`
    hands back K/V in the compute dtype).
    """

    def __init__(self, cache: KVCache, start: int, scale: float) -> None:
        self.cache, self.start, self.scale = cache, start, scale

    def __call__(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        T = q.shape[0]
        keys, values = self.cache.update(index, heads_first(k), heads_first(v), self.start)
        if T == 1:  # one query, the last position, sees every key: no mask needed
            with OneThread(q.device):
                return decode_attention(q[0], keys[0], values[0], self.scale).view(1, -1)
        out = attend(heads_first(q), keys, values, self.start, self.scale)
        return out[0].transpose(0, 1).reshape(T, -1)


class Transformer:
    """Weights plus the forward pass; the KV cache is passed in by the caller.

    Every projection is held as a [chunks, in, out/chunks] operand (`weight_layout` says which
    layout and why). A tied embedding is stored once, as the head's operand; looking a token up
    reads a column of it.
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor] | WeightSource, device: torch.device) -> None:
        """Build from a validated state dict, or from a reader (a cached layout, a recording reader,
        a reader that packs)."""
        self.cfg = cfg
        self.device = device
        ckpt = CheckpointReader(weights) if isinstance(weights, dict) else weights
        self.norm = RMSNorm(ckpt.copy("model.norm.weight"), cfg.rms_norm_eps)
        self.dtype = self.norm.weight.dtype
        tied = cfg.tie_word_embeddings
        self.embed: Embedding = ckpt.embedding("model.embed_tokens.weight", tied=tied)
        self.lm_head: Operand = ckpt.projection("model.embed_tokens.weight" if tied else "lm_head.weight")
        self.layers = [Layer(ckpt, f"model.layers.{i}.", cfg) for i in range(cfg.num_hidden_layers)]
        self.rope = RotaryTable(cfg, device, self.dtype)
        self.q_size = cfg.num_attention_heads * cfg.head_dim
        self.kv_size = cfg.num_key_value_heads * cfg.head_dim
        self.qk_size = self.q_size + self.kv_size  # q and k side by side in the fused q/k/v output
        self.scale = cfg.head_dim**-0.5

    @classmethod
    def load(
        cls,
        folder: Path,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        progress: ProgressCallback | None = None,
        *,
        packs: str | None = None,
    ) -> Transformer:
        """Load and validate the safetensors checkpoint in `folder` (through `loader`'s layout cache,
        whose first build reports to `progress`); `packs` names a packed weight format
        (`linear_kernels`), None keeps dense operands in `dtype`."""
        return loader.build(folder, cfg, dtype, device, lambda weights: cls(cfg, weights, device), progress, packs)

    # -- the layers ----------------------------------------------------------------------------

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows for token ids [T], shaped [T, hidden] (a fresh tensor)."""
        if isinstance(self.embed, EmbeddingRows):
            return self.embed.lookup(ids)
        if self.embed is not None:
            return F.embedding(ids, self.embed)
        if isinstance(self.lm_head, PanelLinear):
            return self.lm_head.rows(ids)
        per_chunk = self.lm_head.shape[2]
        return self.lm_head[ids // per_chunk, :, ids % per_chunk]  # column `id` of the head, [T, hidden]

    def block(
        self,
        index: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: Attention,
        s: Scratch | None = None,
        *,
        last_only: bool = False,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Block `index` on the residual stream x [T, hidden], which it adds to in place; returns x.

        cos/sin are the positions' rows from `RotaryTable.lookup_signed`. With `last_only` only
        the last position goes on past the K/V write (x becomes its [1, hidden] view); `keep`
        (row indices) does the same for several positions (a batched step's sequence ends). With
        a `Scratch` (one token) every product lands in its buffers.
        """
        layer = self.layers[index]
        q, k, v = self.qkv_heads(layer, layer.input_norm(x), cos, sin, s)
        if last_only:
            q, x = q[-1:], x[-1:]
        elif keep is not None:
            q, x = q[keep], x[keep]
        x.add_(self.attention_output(layer, attention(index, q, k, v), s))
        x.add_(self.mlp(layer, layer.post_norm(x), s))
        return x

    def qkv_heads(
        self, layer: Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, s: Scratch | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q [T, Hq, d], rotated k [T, Hkv, d] and v [T, Hkv, d] of `layer` for normalised h [T, hidden].

        With a `Scratch` they are its views instead: q grouped by KV head [Hkv, Hq/Hkv, d], k and
        v [Hkv, d].
        """
        if s is None:
            T, d, n = h.shape[0], self.cfg.head_dim, self.qk_size
            qkv = project(h, layer.qkv, layer.qkv_bias)
            # q and k heads sit side by side in the fused output: normalise and rotate them as one.
            qk, v = qkv[:, :n].view(T, -1, d), qkv[:, n:].view(T, -1, d)
        else:
            project_chunks(h, layer.qkv, layer.qkv_bias, out=s.qkv)
            qk, v = s.qk, s.v
        if layer.qk_norm is not None:
            qk = layer.qk_norm(qk)
        if s is None:
            qk = rotate(qk, cos, sin)
            hq = self.cfg.num_attention_heads
            return qk[:, :hq], qk[:, hq:], v
        rotate(qk, cos, sin, out=s.rotated, scratch=s.swapped)
        return s.q, s.k, s.v

    def attention_output(self, layer: Layer, attended: torch.Tensor, s: Scratch | None = None) -> torch.Tensor:
        """`layer`'s output projection of the attended heads [T, Hq*d]: [T, hidden]."""
        if s is None:
            return project(attended, layer.o)
        project_chunks(attended, layer.o, out=s.o)
        return s.o_row

    def mlp(self, layer: Layer, h: torch.Tensor, s: Scratch | None = None) -> torch.Tensor:
        """The SiLU-gated MLP of `layer` on normalised h [T, hidden]: [T, hidden]."""
        if s is None:
            gate, up = project_chunks(h, layer.gate_up)
            gated = c_silu_mul(gate, up)  # on the CPU in float32: the C stack's gating
            return project(F.silu(gate).mul_(up) if gated is None else gated, layer.down)
        project_chunks(h, layer.gate_up, out=s.gate_up)
        if c_silu_mul(s.gate, s.up, out=s.gate) is None:
            F.silu(s.gate, inplace=True).mul_(s.up)
        project_chunks(s.gate, layer.down, out=s.down)
        return s.down_row

    def logits(self, x: torch.Tensor, *, per_position: bool = False) -> torch.Tensor:
        """Float32 logits of the final residual stream: [vocab] for x [1, hidden], or [T, vocab]
        for every position with `per_position`."""
        h = self.norm(x)
        if per_position:
            return project(h, self.lm_head).float()
        return project_chunks(h, self.lm_head).view(-1).float()

    # -- the whole model -----------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, cache: KVCache, *, all_logits: bool = False) -> torch.Tensor:
        """Run positions [start, start+len(ids)) and return logits (float32).

        Returns logits for the last position ([vocab]) unless `all_logits`, then [T, vocab].
        This is the general path, for any cache and any number of tokens; `runner.ModelRunner`
        sends single-token steps through a leaner decode step when it can.
        """
        x = self.embed_tokens(ids)  # [T, hidden]
        cos, sin = self.rope.lookup_signed(start, ids.shape[0])
        attention = CacheAttention(cache, start, self.scale)
        last = len(self.layers) - 1
        for i in range(len(self.layers)):
            # The last layer still writes every position's K/V, but when only the last
            # position's logits are wanted nothing else of it is needed at other positions.
            x = self.block(i, x, cos, sin, attention, last_only=not all_logits and i == last)
        return self.logits(x, per_position=all_logits)

    def _read_every_step(self) -> list[torch.Tensor | PackedLinear | PanelLinear]:
        return [self.norm.weight, self.lm_head] + [t for layer in self.layers for t in layer.tensors()]

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights are stored in (the tied head counted once; a packed kernel's padding included)."""
        embed = 0
        if isinstance(self.embed, EmbeddingRows):
            embed = self.embed.stored_bytes
        elif self.embed is not None:
            embed = self.embed.numel() * self.embed.element_size()
        return embed + sum(_stored_bytes(t) for t in self._read_every_step())

    @property
    def decode_weight_bytes(self) -> int:
        """Weight bytes one decode step reads: every projection and norm (a packed kernel's real
        rows, not its padding), and one row of an embedding table of its own."""
        row = 0
        if isinstance(self.embed, EmbeddingRows):
            row = self.embed.row_bytes
        elif self.embed is not None:
            row = self.cfg.hidden_size * self.embed.element_size()
        return row + sum(_read_bytes(t) for t in self._read_every_step())


def _stored_bytes(t: torch.Tensor | PackedLinear | PanelLinear) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.stored_bytes


def _read_bytes(t: torch.Tensor | PackedLinear | PanelLinear) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.read_bytes
