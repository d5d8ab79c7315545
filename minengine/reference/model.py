"""The whole model in plain PyTorch: read this file first.

A decoder-only transformer of the llama family (llama, mistral, qwen2, qwen3) written as Hugging
Face's modeling files write it, one operation per line, in the order they run. Weights stay
dense and as the checkpoint stores them; nothing here is fused, packed, threaded or written in C.
The engine's fast paths (`minengine.model`) compute the same function faster, and the tests hold
each of them against this file.

Shapes in the comments: T tokens in this call, S positions in the cache after it, H hidden size,
Hq query heads, Hkv key/value heads, d head size, V vocabulary. Positions come first everywhere,
[T, heads, d], the KV cache's [S, Hkv, d] included: nothing is laid out for a kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from minengine.checkpoint.weights import load_state_dict
from minengine.config import ModelConfig

# -- the small pieces ---------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Scale x so its root mean square is 1, then by the learned weight (LlamaRMSNorm)."""
    xf = x.float()  # the statistic in float32 whatever the model's dtype
    variance = xf.pow(2).mean(-1, keepdim=True)  # mean of squares over the hidden dimension
    normed = xf * torch.rsqrt(variance + eps)  # x / rms(x)
    return weight * normed.to(x.dtype)  # cast back before the weight, as transformers does


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """The rotary embedding's angle per position for each pair of dimensions [d/2] (float32),
    with the config's scaling applied: theta^(-2i/d)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling
    if scaling.rope_type == "linear":  # positions squeezed by `factor`: every angle slower
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_frequencies(inv_freq, cfg)
    return inv_freq


def _llama3_frequencies(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    # Llama 3.1: wavelengths longer than the original context are slowed by `factor`, short ones
    # kept, and the band between them blended, so nearby positions stay distinguishable.
    s = cfg.rope_scaling
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, scaled)


def rotary_cos_sin(
    inv_freq: torch.Tensor, start: int, length: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every angle for positions [start, start+length): two [T, d] tables."""
    positions = torch.arange(start, start + length, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(positions, inv_freq)  # [T, d/2]: position x frequency
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, d]: the two halves of a head share angles
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head of x [T, heads, d] by its position's angles (cos/sin [T, d])."""
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    return x * cos + rotate_half(x) * sin


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of queries q [T, Hq, d] at positions [start, start+T) over every cached
    position keys/values [S, H, d]; returns [T, Hq, d].

    H is Hkv (grouped-query attention: each key/value head serves Hq/Hkv query heads) or Hq
    (a cache that stored them expanded); the keys are repeated up to the query heads first.
    """
    T, hq, d = q.shape
    repeat = hq // keys.shape[1]
    keys = keys.repeat_interleave(repeat, dim=1).transpose(0, 1)  # [Hq, S, d]: query head h reads KV head h // repeat
    values = values.repeat_interleave(repeat, dim=1).transpose(0, 1)
    q = q.transpose(0, 1)  # [Hq, T, d]
    scores = q @ keys.transpose(1, 2) * d**-0.5  # [Hq, T, S]: every query against every key, over sqrt(d)
    S = keys.shape[1]
    query_at = torch.arange(start, start + T, device=q.device)[:, None]  # [T, 1] absolute positions
    future = torch.arange(S, device=q.device)[None, :] > query_at  # [T, S]: keys after the query
    scores = scores.masked_fill(future, float("-inf"))  # a token never sees what comes after it
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # float32 softmax, as HF
    return (probs @ values).transpose(0, 1)  # [T, Hq, d]


# -- the KV cache -------------------------------------------------------------------------------


class PlainKVCache:
    """The simplest KV cache: per layer, the K and V of every position so far, [S, Hkv, d] each."""

    def __init__(self, layers: int, empty: torch.Tensor) -> None:
        self.k, self.v = [empty] * layers, [empty] * layers

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [T, Hkv, d] as positions [start, start+T) of `layer` (dropping any from
        `start` on); return K and V of positions [0, start+T), [S, Hkv, d] each."""
        self.k[layer] = torch.cat((self.k[layer][:start], k))
        self.v[layer] = torch.cat((self.v[layer][:start], v))
        return self.k[layer], self.v[layer]


# -- the model ----------------------------------------------------------------------------------


@dataclass
class LayerWeights:
    """One block's tensors, as the checkpoint names them (`model.layers.{i}.…`)."""

    input_norm: torch.Tensor  # [H]
    q: torch.Tensor  # [Hq*d, H]
    k: torch.Tensor  # [Hkv*d, H]
    v: torch.Tensor  # [Hkv*d, H]
    o: torch.Tensor  # [H, Hq*d]
    post_norm: torch.Tensor  # [H]
    gate: torch.Tensor  # [F, H]
    up: torch.Tensor  # [F, H]
    down: torch.Tensor  # [H, F]
    q_bias: torch.Tensor | None = None  # qwen2
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # qwen3: a per-head RMSNorm of q and k [d]
    k_norm: torch.Tensor | None = None


class ReferenceModel:
    """Dense weights plus `forward`; the caller owns the KV cache."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        """Take a state dict with Hugging Face's names (`load_state_dict` checks them)."""
        self.cfg = cfg
        self.embed = weights["model.embed_tokens.weight"]  # [V, H]
        self.norm_weight = weights["model.norm.weight"]  # [H]
        self.head = self.embed if cfg.tie_word_embeddings else weights["lm_head.weight"]  # [V, H]
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.inv_freq = inverse_frequencies(cfg).to(self.device)
        self.layers = [self._layer(weights, f"model.layers.{i}.") for i in range(cfg.num_hidden_layers)]

    @staticmethod
    def _layer(w: dict[str, torch.Tensor], p: str) -> LayerWeights:
        a, m = p + "self_attn.", p + "mlp."
        return LayerWeights(
            input_norm=w[p + "input_layernorm.weight"],
            q=w[a + "q_proj.weight"],
            k=w[a + "k_proj.weight"],
            v=w[a + "v_proj.weight"],
            o=w[a + "o_proj.weight"],
            post_norm=w[p + "post_attention_layernorm.weight"],
            gate=w[m + "gate_proj.weight"],
            up=w[m + "up_proj.weight"],
            down=w[m + "down_proj.weight"],
            q_bias=w.get(a + "q_proj.bias"),
            k_bias=w.get(a + "k_proj.bias"),
            v_bias=w.get(a + "v_proj.bias"),
            q_norm=w.get(a + "q_norm.weight"),
            k_norm=w.get(a + "k_norm.weight"),
        )

    @classmethod
    def load(
        cls, folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> ReferenceModel:
        """Read `config.json` and the safetensors weights of a Hugging Face model folder."""
        folder = Path(folder)
        cfg = ModelConfig.from_file(folder)
        return cls(cfg, load_state_dict(folder, cfg, dtype, torch.device(device)))

    def new_cache(self) -> PlainKVCache:
        """An empty cache for one sequence."""
        empty = torch.empty(0, self.cfg.num_key_value_heads, self.cfg.head_dim, dtype=self.dtype, device=self.device)
        return PlainKVCache(self.cfg.num_hidden_layers, empty)

    def block(self, i: int, x: torch.Tensor, cos, sin, cache: PlainKVCache, start: int, observer=None) -> torch.Tensor:
        """Transformer block `i` on the residual stream x [T, H]: attention, then the MLP, each
        added back to the stream."""
        w, cfg = self.layers[i], self.cfg
        T, d = x.shape[0], cfg.head_dim
        h = rms_norm(x, w.input_norm, cfg.rms_norm_eps)  # pre-norm
        q = torch.nn.functional.linear(h, w.q, w.q_bias).view(T, -1, d)  # [T, Hq, d]
        k = torch.nn.functional.linear(h, w.k, w.k_bias).view(T, -1, d)  # [T, Hkv, d]
        v = torch.nn.functional.linear(h, w.v, w.v_bias).view(T, -1, d)  # [T, Hkv, d]
        if w.q_norm is not None:  # qwen3 normalises each head before rotating it
            q, k = rms_norm(q, w.q_norm, cfg.rms_norm_eps), rms_norm(k, w.k_norm, cfg.rms_norm_eps)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)  # position enters here only
        keys, values = cache.update(i, k, v, start)  # [S, Hkv, d]: every position so far, this one's included
        observer and observer.attended(i, q[-1], keys)  # HOOK for the explorer: the last query, every key
        attended = attention(q, keys, values, start).reshape(T, -1)  # [T, Hq*d]
        x = x + torch.nn.functional.linear(attended, w.o)  # attention's output joins the residual
        h = rms_norm(x, w.post_norm, cfg.rms_norm_eps)
        gate = torch.nn.functional.linear(h, w.gate)  # [T, F]
        up = torch.nn.functional.linear(h, w.up)  # [T, F]
        return x + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w.down)  # SwiGLU MLP

    @torch.inference_mode()
    def forward(
        self, ids: torch.Tensor, start: int, cache: PlainKVCache, *, all_logits: bool = False, observer=None
    ) -> torch.Tensor:
        """Run tokens ids [T] at positions [start, start+T), storing their K/V in `cache`.

        Returns float32 next-token logits: [V] for the last position, or [T, V] with
        `all_logits`. `observer` is the explorer's (the two lines marked HOOK; None runs none).
        """
        x = self.embed[ids]  # [T, H]: each token's row of the embedding table
        cos, sin = rotary_cos_sin(self.inv_freq, start, ids.shape[0], self.dtype)
        for i in range(len(self.layers)):
            x = self.block(i, x, cos, sin, cache, start, observer)
            observer and observer.residual(i, x[-1])  # HOOK for the explorer: the residual after block i
        if not all_logits:
            x = x[-1:]  # only the last position's next token is asked for
        logits = torch.nn.functional.linear(self.norm(x), self.head)  # [T, V]: each row against every token's
        return logits.float() if all_logits else logits[0].float()

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm, before the head (the logit lens applies it to every layer's residual)."""
        return rms_norm(x, self.norm_weight, self.cfg.rms_norm_eps)
