"""A compact decoder-only transformer (llama / mistral / qwen2 / qwen3 families).

Numerics follow Hugging Face's modeling files: RMSNorm in float32 cast back before the weight
multiply, RoPE angles in float32, SiLU-gated MLP. Batch size is one: this engine follows one
request.

Decode runs one token through every layer: a few hundred small operations per step, each
costing more in dispatch than in arithmetic, while all weights stream from memory once. So the
forward pass keeps operations few and cheap: q/k/v and gate/up are fused matrices whose layout
is chosen for streaming (`weight_layout`), q and k are normalised and rotated together, RMSNorm
is four dispatches, and single-query attention is a small matmul/softmax/matmul run on one
thread (SDPA's kernels, and waking idle threads, cost more than the work at that size). In
prefill the last layer computes only the position whose logits are returned. A single-token
step over an ordinary cache runs `decode_step.EagerDecoder`: the same arithmetic in the same
order, into scratch buffers, with a third fewer operations.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from minengine.checkpoint import layout_cache
from minengine.checkpoint.weight_layout import CheckpointReader, WeightSource, project, project_chunks
from minengine.checkpoint.weights import checkpoint_files, load_state_dict
from minengine.config import ModelConfig
from minengine.kv.cache import KVCache
from minengine.model.eager_step import EagerDecoder
from minengine.model.rope import RotaryTable, rotate
from minengine.threads import OneThread

if TYPE_CHECKING:
    from minengine.model.cuda_graph import StaticDecoder

_HAS_GQA_SDPA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, cast back, then scaled (Hugging Face's order).

    Bit for bit `x * rsqrt(x.pow(2).mean(-1) + eps)`: the mean is the same sum divided by
    the same count, written as one `addcdiv` (a third of the dispatches; `F.rms_norm` is a
    composite of more operations than this on the CPU).
    """
    xf = x.float()
    count = _constant(float(xf.shape[-1]), xf)
    inv = torch.addcdiv(_constant(eps, xf), (xf * xf).sum(-1, keepdim=True), count).rsqrt_()
    return weight * (xf * inv).to(x.dtype)


_CONSTANTS: dict[tuple[float, torch.dtype, torch.device], torch.Tensor] = {}


def _constant(value: float, like: torch.Tensor) -> torch.Tensor:
    # 0-d tensors made once per (value, dtype, device): no step creates one, which also keeps
    # host-to-device copies out of a CUDA graph capture.
    key = (value, like.dtype, like.device)
    t = _CONSTANTS.get(key)
    if t is None:
        t = _CONSTANTS[key] = torch.tensor(value, dtype=like.dtype, device=like.device)
    return t


class Layer:
    """One transformer block's weights (projections as `weight_layout` operands)."""

    def __init__(self, ckpt: WeightSource, prefix: str, cfg: ModelConfig) -> None:
        a, m = prefix + "self_attn.", prefix + "mlp."
        self.input_norm = ckpt.copy(prefix + "input_layernorm.weight")
        self.post_norm = ckpt.copy(prefix + "post_attention_layernorm.weight")
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
            self.qk_norm = torch.cat([self.q_norm.expand(hq, -1), self.k_norm.expand(hkv, -1)])

    def tensors(self) -> list[torch.Tensor]:
        """Every parameter tensor of the block (for byte counts)."""
        optional = (self.qkv_bias, self.q_norm, self.k_norm)
        return [self.input_norm, self.post_norm, self.qkv, self.o, self.gate_up, self.down] + [
            t for t in optional if t is not None
        ]


class Transformer:
    """Weights plus the forward pass; the KV cache is passed in by the caller.

    Every projection is held as a [chunks, in, out/chunks] operand (`weight_layout` says which
    layout and why). A tied embedding is stored once, as the head's operand; looking a token up
    reads a column of it.
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor] | WeightSource, device: torch.device) -> None:
        """Build from a validated state dict, or from a reader (a cached layout, a recording reader)."""
        self.cfg = cfg
        self.device = device
        ckpt = CheckpointReader(weights) if isinstance(weights, dict) else weights
        self.norm = ckpt.copy("model.norm.weight")
        self.dtype = self.norm.dtype
        if cfg.tie_word_embeddings:
            self.embed, self.lm_head = None, ckpt.projection("model.embed_tokens.weight")
        else:
            self.embed = ckpt.copy("model.embed_tokens.weight")
            self.lm_head = ckpt.projection("lm_head.weight")
        self.layers = [Layer(ckpt, f"model.layers.{i}.", cfg) for i in range(cfg.num_hidden_layers)]
        self.rope = RotaryTable(cfg, device, self.dtype)
        self.q_size = cfg.num_attention_heads * cfg.head_dim
        self.kv_size = cfg.num_key_value_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.static_decoder: StaticDecoder | None = None
        self.use_static_decode(device.type == "cuda")
        self.eager_decoder = EagerDecoder(self)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows for token ids [T], shaped [T, hidden]."""
        if self.embed is not None:
            return F.embedding(ids, self.embed)
        per_chunk = self.lm_head.shape[2]
        return self.lm_head[ids // per_chunk, :, ids % per_chunk]  # column `id` of the head, [T, hidden]

    def use_static_decode(self, enabled: bool, *, capture: bool | None = None) -> None:
        """Decode through the static-shape step (captured in CUDA graphs unless `capture=False`).

        On by default on CUDA. Caches made by `new_cache` afterwards decode that way; on the CPU
        the static step only runs eagerly (it exists there to be tested).
        """
        if not enabled:
            self.static_decoder = None
            return
        from minengine.model.cuda_graph import StaticDecoder  # it builds on this module

        capture = self.device.type == "cuda" if capture is None else capture
        self.static_decoder = StaticDecoder(self, capture=capture)

    def new_cache(
        self,
        tokens: int,
        *,
        layout: str = "gqa",
        storage_dtype: torch.dtype | None = None,
        block_size: int = 16,
    ) -> KVCache:
        """A KV cache for `tokens` positions: over the static decoder's arena when that can
        serve it (unquantized storage in the model's dtype, arena not lent out), else its own."""
        storage = storage_dtype or self.dtype
        if self.static_decoder is not None and storage == self.dtype:
            cache = self.static_decoder.new_cache(tokens, layout=layout, block_size=block_size)
            if cache is not None:
                return cache
        return KVCache(
            self.cfg,
            tokens,
            device=self.device,
            compute_dtype=self.dtype,
            layout=layout,
            storage_dtype=storage,
            block_size=block_size,
        )

    @classmethod
    def load(cls, folder: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> Transformer:
        """Load and validate the safetensors checkpoint in `folder`.

        On the CPU the built layout of a pulled model is cached beside its checkpoint and mapped
        on later loads (`layout_cache`); the checkpoint is validated whenever the layout is built.
        """
        if device.type != "cpu" or not layout_cache.wanted(folder):
            return cls(cfg, load_state_dict(folder, cfg, dtype, device), device)
        path = layout_cache.layout_path(folder, layout_cache.layout_key(folder, checkpoint_files(folder), dtype))
        cached = layout_cache.open_layout(path)
        if cached is not None:
            try:
                return cls(cfg, cached, device)
            except (KeyError, RuntimeError):
                pass  # a layout that does not fit this build: rebuild it below
        recorder = layout_cache.RecordingReader(CheckpointReader(load_state_dict(folder, cfg, dtype, device)))
        model = cls(cfg, recorder, device)
        layout_cache.write_layout(path, recorder.made)
        return model

    @property
    def weight_bytes(self) -> int:
        """Bytes of all parameter tensors (the tied head counted once)."""
        tensors = [self.norm, self.lm_head] + ([] if self.embed is None else [self.embed])
        for layer in self.layers:
            tensors += layer.tensors()
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def decode_weight_bytes(self) -> int:
        """Weight bytes one decode step reads: everything but an untied embedding table, of
        which a step reads one row."""
        row = self.cfg.hidden_size * self.lm_head.element_size()
        untied = 0 if self.embed is None else self.embed.numel() * self.embed.element_size()
        return self.weight_bytes - untied + (row if untied else 0)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, cache: KVCache, *, all_logits: bool = False) -> torch.Tensor:
        """Run positions [start, start+len(ids)) and return logits (float32).

        Returns logits for the last position ([vocab]) unless `all_logits`, then [T, vocab].
        Prefill passes the whole prompt at start=0; decode passes one token.
        """
        if ids.shape[0] == 1:
            if self.static_decoder is not None and self.static_decoder.serves(cache):
                return self.static_decoder.step(ids, start, cache)
            if self.eager_decoder.serves(cache, start):
                return self.eager_decoder.step(ids, start, cache)
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        x = self.embed_tokens(ids)  # [T, hidden]
        cos, sin = self.rope.lookup_signed(start, ids.shape[0])
        for i, layer in enumerate(self.layers):
            # The last layer still writes every position's K/V, but when only the last
            # position's logits are wanted nothing else of it is needed at other positions.
            last_only = not all_logits and i == len(self.layers) - 1
            h = rms_norm(x, layer.input_norm, eps)
            attended = self._attention(layer, i, h, start, cos, sin, cache, last_only)
            x = x[-1:] + attended if last_only else x + attended
            h = rms_norm(x, layer.post_norm, eps)
            x = x + self.mlp(layer, h)
        logits = project(rms_norm(x, self.norm, eps), self.lm_head).float()
        return logits if all_logits else logits[0]

    def mlp(self, layer: Layer, h: torch.Tensor) -> torch.Tensor:
        """The SiLU-gated MLP of `layer` on normalised h [T, hidden]."""
        gate, up = project_chunks(h, layer.gate_up)
        return project(F.silu(gate).mul_(up), layer.down)

    def qkv_heads(self, layer: Layer, h: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q [T, Hq, d], rotated k [T, Hkv, d] and v [T, Hkv, d] of `layer` for h [T, hidden]."""
        cfg = self.cfg
        T, d, hq, hkv = h.shape[0], cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        qkv = project(h, layer.qkv, layer.qkv_bias)
        # q and k heads sit side by side in the fused output: normalise and rotate them as one.
        qk = qkv[:, : self.q_size + self.kv_size].view(T, hq + hkv, d)
        if layer.qk_norm is not None:
            qk = rms_norm(qk, layer.qk_norm, cfg.rms_norm_eps)
        qk = rotate(qk, cos, sin)
        return qk[:, :hq], qk[:, hq:], qkv[:, self.q_size + self.kv_size :].view(T, hkv, d)

    def _attention(
        self, layer: Layer, index: int, h, start: int, cos, sin, cache: KVCache, last_only: bool = False
    ) -> torch.Tensor:
        """Attention output of `layer` ([T, hidden], or [1, hidden] for the last position only)."""
        T = h.shape[0]
        q, k, v = self.qkv_heads(layer, h, cos, sin)
        keys, values = cache.update(index, _heads_first(k), _heads_first(v), start)
        if T == 1 or last_only:  # the last position sees every key: no mask needed
            with OneThread(h.device):
                out = decode_attention(q[-1], keys[0], values[0], self.scale)
        else:
            out = attend(_heads_first(q), keys, values, start, self.scale)
            out = out[0].transpose(0, 1).reshape(T, self.q_size)
        return project(out, layer.o)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[T, heads, d] -> [1, heads, T, d] (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


def decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, hidden: torch.Tensor | None = None
) -> torch.Tensor:
    """One query position: q [Hq, d] over keys/values [Hkv, L, d]; returns [1, Hq * d].

    The query heads sharing a KV head are stacked as rows of one small matrix, so grouped
    attention needs no repeated K/V. Every position is visible unless flagged in `hidden` [L]
    (the static decode step's fixed window); hidden slots get probability exactly 0.
    """
    hq, d = q.shape
    hkv = keys.shape[0]
    # beta=0 ignores the (dummy) input; the scale rides along as the GEMM's alpha.
    scores = torch.baddbmm(_constant(0.0, q), q.view(hkv, hq // hkv, d), keys.transpose(1, 2), beta=0, alpha=scale)
    if hidden is not None:
        scores.masked_fill_(hidden, float("-inf"))
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.bmm(probs, values).view(1, hq * d)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Causal attention of q [1, Hq, T, d] over cached k/v [1, Hkv, start+T, d]; returns [1, Hq, T, d].

    K/V are never repeated into the cache: a single query position goes through
    `decode_attention`; longer queries use SDPA's native GQA (or a transient expansion on
    torch builds without it).
    """
    hq, hkv, T = q.shape[1], k.shape[1], q.shape[2]
    groups = hq // hkv
    if T == 1:
        return decode_attention(q[0, :, 0], k[0], v[0], scale).view(1, hq, 1, q.shape[-1])
    mask = None
    causal = start == 0
    if not causal:  # a chunk after cached context: query i sees keys up to start + i
        rows = torch.arange(T, device=q.device).unsqueeze(1) + start
        mask = torch.arange(start + T, device=q.device).unsqueeze(0) <= rows
    if groups > 1:
        if _HAS_GQA_SDPA:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
            )
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
