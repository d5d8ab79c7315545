"""A compact decoder-only transformer (llama / mistral / qwen2 / qwen3 families), in torch.

Numerics follow Hugging Face's modeling files: RMSNorm in float32 cast back before the weight
multiply, RoPE angles in float32, SiLU-gated MLP. `forward` runs one sequence; a step shared
by several runs the same blocks over their stacked tokens (`minengine.steps.shared_step`).

Top to bottom: one block's weights (`Layer`); where K/V go and how attention reads them
(`Attention`; `CacheAttention` over any cache); then `Transformer`: the embedding, the block
(RMSNorm, q/k/v heads with RoPE, attention, output projection, MLP, residuals), the head, and
`forward`, the whole model over a KV cache. Attention's K/V handling is the one thing that
differs between the ways of running a step, which is why it is an argument. The row operations
(norm, rotation, gating, the two attentions) are the `ModelOps` the model was built with
(`ops`), and the projections are products of the operands the weights' layout chose
(`weight_layout`): both fixed when the model is built, never chosen here. The faster ways of
running a step (`minengine.fast`) run the same arithmetic beside this file; which runs is the
step's plan (`minengine.steps.model_runner`).

Decode runs one token through every layer: a few hundred small operations per step, each
costing more in dispatch than in arithmetic, while all weights stream from memory once. So the
block keeps operations few: q/k/v and gate/up are fused matrices, q and k are normalised and
rotated together, residuals are added in place, and single-query attention runs on one thread
(waking idle threads costs more than the work at that size). In prefill the last layer computes
only the position whose logits are returned.
"""

from __future__ import annotations

from typing import Protocol

import torch

from minengine.checkpoint.weight_layout import (
    CheckpointReader,
    Embedding,
    Operand,
    WeightSource,
    product,
    read_bytes,
    stored_bytes,
    token_lookup,
)
from minengine.config import ModelConfig
from minengine.kv.cache import KVCache
from minengine.model.ops import TORCH_OPS, ModelOps, heads_first
from minengine.model.rope import RotaryTable
from minengine.threads import OneThread


class Layer:
    """One transformer block's weights (projections as `weight_layout` operands)."""

    def __init__(self, ckpt: WeightSource, prefix: str, cfg: ModelConfig, ops: ModelOps) -> None:
        a, m, eps = prefix + "self_attn.", prefix + "mlp.", cfg.rms_norm_eps
        self.input_norm = ops.norm(ckpt.copy(prefix + "input_layernorm.weight"), eps)
        self.post_norm = ops.norm(ckpt.copy(prefix + "post_attention_layernorm.weight"), eps)
        self.qkv = ckpt.projection(*(a + f"{p}_proj.weight" for p in "qkv"))
        self.qkv_bias = None
        if cfg.attention_bias:
            self.qkv_bias = torch.cat([ckpt.copy(a + f"{p}_proj.bias") for p in "qkv"])
        self.o = ckpt.projection(a + "o_proj.weight")
        # Two chunks, gate then up: the MLP takes them apart without reassembling columns.
        self.gate_up = ckpt.projection(m + "gate_proj.weight", m + "up_proj.weight", chunks=2)
        self.down = ckpt.projection(m + "down_proj.weight")
        # Each projection's product, bound to its operand's kind once: what the block calls.
        self.qkv_proj, self.o_proj = product(self.qkv, self.qkv_bias), product(self.o)
        self.gate_up_proj, self.down_proj = product(self.gate_up), product(self.down)
        # The MLP's gate/up product and its gating: one C call where the panel kernel gates its own sums
        # with the C row operations' gating (the same bits, and the product's [T, 2 x ff] never written
        # out), else the product's two chunks through `ops.silu_mul`.
        fused = self.gate_up_proj.gating() if ops.name == "C" else None
        self.gating_in_product = fused is not None
        self.gated = fused or (lambda h: ops.silu_mul(*self.gate_up_proj.chunks(h)))
        self.q_norm = ckpt.optional(a + "q_norm.weight")
        self.k_norm = ckpt.optional(a + "k_norm.weight")
        # qwen3 normalises each q head and each k head; one weight row per head lets a single
        # norm call cover q and k together.
        self.qk_norm = None
        if self.q_norm is not None and self.k_norm is not None:
            hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
            self.qk_norm = ops.norm(torch.cat([self.q_norm.expand(hq, -1), self.k_norm.expand(hkv, -1)]), eps)

    def tensors(self) -> list[torch.Tensor | Operand]:
        """Every parameter of the block, tensors and packed weights (for byte counts)."""
        optional = (self.qkv_bias, self.q_norm, self.k_norm)
        norms = [self.input_norm.weight, self.post_norm.weight]
        return [*norms, self.qkv, self.o, self.gate_up, self.down] + [t for t in optional if t is not None]


class Attention(Protocol):
    """Where a block's K/V go and how its queries read them: one per way of running a step."""

    def __call__(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store layer `index`'s k/v for this step's positions; the attended heads, [rows of q, Hq*d].

        q, k, v are `Transformer.qkv_heads`'s (a lean decode step's own scratch views, `fast.eager_step`).
        """
        ...


class CacheAttention:
    """`Attention` over a `KVCache`: k/v stored at positions [start, start+T), queries attend causally.

    Any cache and any number of positions (quantized or widened storage included: `KVCache.update`
    hands back K/V in the compute dtype).
    """

    def __init__(self, cache: KVCache, start: int, scale: float, ops: ModelOps) -> None:
        self.cache, self.start, self.scale, self.ops = cache, start, scale, ops

    def __call__(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        T, queries = k.shape[0], q.shape[0]
        keys, values = self.cache.update(index, heads_first(k), heads_first(v), self.start)
        if T == 1:  # a decode step: one query, the last position, sees every key, no mask needed
            with OneThread(q.device):
                return self.ops.decode_attention(q[0], keys[0], values[0], self.scale).view(1, -1)
        # A prompt chunk's queries: every position's, or in the last layer its last position's alone. The prompt
        # attention either way, as a shared step attends a chunk (`RowsAttention`), so that a prompt's first
        # token has the same bits prefilled alone or beside other requests.
        out = self.ops.prompt_attention(heads_first(q), keys, values, self.start + T - queries, self.scale)
        return out[0].transpose(0, 1).reshape(queries, -1)


class Transformer:
    """Weights plus the forward pass; the KV cache is passed in by the caller.

    Every projection is held as a [chunks, in, out/chunks] operand (`weight_layout` says which
    layout and why). A tied embedding is stored once, as the head's operand; looking a token up
    reads a column of it.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor] | WeightSource,
        device: torch.device,
        ops: ModelOps = TORCH_OPS,
    ) -> None:
        """Build from a validated state dict, or from a reader (a cached layout, a recording reader,
        a reader that packs), its row operations bound to `ops` (`minengine.steps.load` chooses
        them for the machine)."""
        self.cfg = cfg
        self.device = device
        self.ops = ops
        ckpt = CheckpointReader(weights) if isinstance(weights, dict) else weights
        self.norm = ops.norm(ckpt.copy("model.norm.weight"), cfg.rms_norm_eps)
        self.dtype = self.norm.weight.dtype
        tied = cfg.tie_word_embeddings
        self.embed: Embedding = ckpt.embedding("model.embed_tokens.weight", tied=tied)
        self.lm_head: Operand = ckpt.projection("model.embed_tokens.weight" if tied else "lm_head.weight")
        self.layers = [Layer(ckpt, f"model.layers.{i}.", cfg, ops) for i in range(cfg.num_hidden_layers)]
        # Token ids to embedding rows [T, hidden] (a fresh tensor), the way the weights' layout holds them.
        self.embed_tokens = token_lookup(self.embed, self.lm_head)
        self.head = product(self.lm_head)
        self.rope = RotaryTable(cfg, device, self.dtype)
        self.q_size = cfg.num_attention_heads * cfg.head_dim
        self.kv_size = cfg.num_key_value_heads * cfg.head_dim
        self.qk_size = self.q_size + self.kv_size  # q and k side by side in the fused q/k/v output
        self.scale = cfg.head_dim**-0.5

    # -- the layers ----------------------------------------------------------------------------

    def block(
        self,
        index: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: Attention,
        *,
        last_only: bool = False,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Block `index` on the residual stream x [T, hidden], which it adds to in place; returns x.

        cos/sin are the positions' rows from `RotaryTable.lookup_signed`. With `last_only` only
        the last position goes on past the K/V write (x becomes its [1, hidden] view); `keep`
        (row indices) does the same for several positions (a batched step's sequence ends).
        """
        layer = self.layers[index]
        q, k, v = self.qkv_heads(layer, layer.input_norm(x), cos, sin)
        if last_only:
            q, x = q[-1:], x[-1:]
        elif keep is not None:
            q, x = q[keep], x[keep]
        x.add_(layer.o_proj(attention(index, q, k, v)))
        x.add_(self.mlp(layer, layer.post_norm(x)))
        return x

    def qkv_heads(
        self, layer: Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q [T, Hq, d], rotated k [T, Hkv, d] and v [T, Hkv, d] of `layer` for normalised h [T, hidden]."""
        T, d, n = h.shape[0], self.cfg.head_dim, self.qk_size
        qkv = layer.qkv_proj(h)
        # q and k heads sit side by side in the fused output: normalise and rotate them as one.
        qk, v = qkv[:, :n].view(T, -1, d), qkv[:, n:].view(T, -1, d)
        if layer.qk_norm is not None:
            qk = layer.qk_norm(qk)
        qk = self.ops.rotate(qk, cos, sin)
        hq = self.cfg.num_attention_heads
        return qk[:, :hq], qk[:, hq:], v

    def mlp(self, layer: Layer, h: torch.Tensor) -> torch.Tensor:
        """The SiLU-gated MLP of `layer` on normalised h [T, hidden]: [T, hidden]."""
        return layer.down_proj(layer.gated(h))

    def logits(self, x: torch.Tensor, *, per_position: bool = False) -> torch.Tensor:
        """Float32 logits of the final residual stream: [vocab] for x [1, hidden], or [T, vocab]
        for every position with `per_position`."""
        logits = self.head(self.norm(x)).float()
        return logits if per_position else logits.view(-1)

    # -- the whole model -----------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, cache: KVCache, *, all_logits: bool = False) -> torch.Tensor:
        """Run positions [start, start+len(ids)) and return logits (float32).

        Returns logits for the last position ([vocab]) unless `all_logits`, then [T, vocab].
        This is the general path, for any cache and any number of tokens; the step's plan
        (`minengine.steps.model_runner`) sends single-token steps through a leaner decode step when it can.
        """
        x = self.embed_tokens(ids)  # [T, hidden]
        cos, sin = self.rope.lookup_signed(start, ids.shape[0])
        attention = CacheAttention(cache, start, self.scale, self.ops)
        last = len(self.layers) - 1
        for i in range(len(self.layers)):
            # The last layer still writes every position's K/V, but when only the last
            # position's logits are wanted nothing else of it is needed at other positions.
            x = self.block(i, x, cos, sin, attention, last_only=not all_logits and i == last)
        return self.logits(x, per_position=all_logits)

    def _read_every_step(self) -> list[torch.Tensor | Operand]:
        return [self.norm.weight, self.lm_head] + [t for layer in self.layers for t in layer.tensors()]

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights are stored in (the tied head counted once; a packed kernel's padding included)."""
        return stored_bytes(self.embed) + sum(stored_bytes(t) for t in self._read_every_step())

    @property
    def decode_weight_bytes(self) -> int:
        """Weight bytes one decode step reads: every projection and norm (a packed kernel's real
        rows, not its padding), and one row of an embedding table of its own."""
        return read_bytes(self.embed, self.cfg.hidden_size) + sum(read_bytes(t) for t in self._read_every_step())
