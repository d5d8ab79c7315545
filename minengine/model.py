"""A compact decoder-only transformer (llama / mistral / qwen2 / qwen3 families).

Numerics follow Hugging Face's modeling files: RMSNorm in float32 cast back before the weight
multiply, RoPE angles in float32, SiLU-gated MLP. For speed the q/k/v projections and the
gate/up projections are fused into single matrices at load time; the result is the same.
Batch size is one: this engine follows one request.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from minengine.config import ModelConfig
from minengine.kv_cache import KVCache
from minengine.rope import RotaryTable, apply_rotary
from minengine.weights import load_state_dict

_HAS_GQA_SDPA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, cast back, then scaled (Hugging Face's order)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class Layer:
    """One transformer block's weights."""

    def __init__(self, sd: dict[str, torch.Tensor], prefix: str, cfg: ModelConfig) -> None:
        a, m = prefix + "self_attn.", prefix + "mlp."
        self.input_norm = sd[prefix + "input_layernorm.weight"]
        self.post_norm = sd[prefix + "post_attention_layernorm.weight"]
        self.qkv = torch.cat([sd.pop(a + f"{p}_proj.weight") for p in "qkv"])
        self.qkv_bias = torch.cat([sd.pop(a + f"{p}_proj.bias") for p in "qkv"]) if cfg.attention_bias else None
        self.o = sd[a + "o_proj.weight"]
        self.q_norm = sd.get(a + "q_norm.weight")
        self.k_norm = sd.get(a + "k_norm.weight")
        self.gate_up = torch.cat([sd.pop(m + "gate_proj.weight"), sd.pop(m + "up_proj.weight")])
        self.down = sd[m + "down_proj.weight"]


class Transformer:
    """Weights plus the forward pass; the KV cache is passed in by the caller."""

    def __init__(self, cfg: ModelConfig, sd: dict[str, torch.Tensor], device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = sd["model.embed_tokens.weight"].dtype
        self.embed = sd["model.embed_tokens.weight"]
        self.norm = sd["model.norm.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else sd["lm_head.weight"]
        self.layers = [Layer(sd, f"model.layers.{i}.", cfg) for i in range(cfg.num_hidden_layers)]
        self.rope = RotaryTable(cfg, device, self.dtype)
        self.q_size = cfg.num_attention_heads * cfg.head_dim
        self.kv_size = cfg.num_key_value_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5

    @classmethod
    def load(cls, folder: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> Transformer:
        """Load and validate the safetensors checkpoint in `folder`."""
        return cls(cfg, load_state_dict(folder, cfg, dtype, device), device)

    @property
    def weight_bytes(self) -> int:
        """Bytes of all parameter tensors (the tied head counted once)."""
        tensors = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for layer in self.layers:
            tensors += [layer.input_norm, layer.post_norm, layer.qkv, layer.o, layer.gate_up, layer.down]
            tensors += [t for t in (layer.qkv_bias, layer.q_norm, layer.k_norm) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, cache: KVCache, *, all_logits: bool = False) -> torch.Tensor:
        """Run positions [start, start+len(ids)) and return logits (float32).

        Returns logits for the last position ([vocab]) unless `all_logits`, then [T, vocab].
        Prefill passes the whole prompt at start=0; decode passes one token.
        """
        cfg = self.cfg
        T = ids.shape[0]
        x = F.embedding(ids, self.embed)  # [T, hidden]
        cos, sin = self.rope.lookup(start, T)
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            x = x + self._attention(layer, i, h, start, cos, sin, cache)
            h = rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
            gate, up = F.linear(h, layer.gate_up).split(cfg.intermediate_size, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        if not all_logits:
            x = x[-1:]
        x = rms_norm(x, self.norm, cfg.rms_norm_eps)
        logits = F.linear(x, self.lm_head).float()
        return logits if all_logits else logits[0]

    def _attention(self, layer, index, h, start, cos, sin, cache: KVCache) -> torch.Tensor:
        cfg = self.cfg
        T, d = h.shape[0], cfg.head_dim
        qkv = F.linear(h, layer.qkv, layer.qkv_bias)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(T, cfg.num_attention_heads, d).transpose(0, 1).unsqueeze(0)
        k = k.view(T, cfg.num_key_value_heads, d).transpose(0, 1).unsqueeze(0)
        v = v.view(T, cfg.num_key_value_heads, d).transpose(0, 1).unsqueeze(0)
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        keys, values = cache.update(index, k, v, start)
        out = attend(q, keys, values, start, self.scale)  # [1, heads, T, d]
        return F.linear(out.transpose(1, 2).reshape(T, self.q_size), layer.o)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Causal attention of q [1, Hq, T, d] over cached k/v [1, Hkv, start+T, d].

    K/V are never repeated into the cache: for one query position the query heads of a group
    are folded into the "length" axis of their shared KV head, which needs no mask; longer
    queries use SDPA's native GQA (or a transient expansion on torch builds without it).
    """
    hq, hkv, T = q.shape[1], k.shape[1], q.shape[2]
    groups = hq // hkv
    if T == 1:
        if groups > 1:
            out = F.scaled_dot_product_attention(q.view(1, hkv, groups, q.shape[-1]), k, v, scale=scale)
            return out.view(1, hq, 1, q.shape[-1])
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
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
