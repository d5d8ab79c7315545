"""The roofline of a decode step: its bytes against the seeds' KV formula by hand, the fraction against
its definition, and a held step's time left out of its step time."""

from __future__ import annotations

import time

import pytest

from minengine.engine.events import StepReady, TokenEvent
from minengine.engine.request import GenerationRequest
from minengine.engine.roofline import (
    ReadCeiling,
    StepBytes,
    decode_roofline,
    kv_read_bytes,
    roofline_ms,
    step_bytes,
    step_roofline,
)
from minengine.kv.usage import KVUsage
from minengine.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
CEILING = ReadCeiling(40e9, "matvec over 512 MiB, fastest of 15 passes", "cpu test, 2 threads", "2026-12-01 10:00 UTC",
                      "reqscope calibrate")  # fmt: skip


def usage(layers: int, heads: int, head_dim: int, dtype: str, tokens: int, layout: str = "gqa") -> KVUsage:
    """A cache snapshot holding `tokens` positions in every layer (the byte totals are not read here)."""
    per_token = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}[dtype] * 2 * layers * heads * head_dim
    return KVUsage(layout, dtype, tokens, 16, -(-tokens // 16), layers, heads, head_dim, per_token,
                   per_token * tokens, 0, 0, (tokens,) * layers, (), ())  # fmt: skip


def test_kv_read_is_the_seeds_formula():
    # Seed 000: 80 layers x 8 KV heads x 128 dims in bf16 is 327,680 bytes a token; 1,025 prompt
    # tokens hold 335,872,000 bytes, and a step after 149 more reads 384,696,320.
    assert kv_read_bytes(usage(80, 8, 128, "bfloat16", 1025)) == 335_872_000
    assert kv_read_bytes(usage(80, 8, 128, "bfloat16", 1025 + 149)) == 384_696_320
    # The MHA layout stores one head per query head (64): the seed's "8x the GQA footprint".
    assert kv_read_bytes(usage(80, 64, 128, "bfloat16", 1025, layout="mha")) == 8 * 335_872_000
    # The exercise's FP8 cache: 2 x 48 x 4 x 128 x 1 = 49,152 bytes a token, plus what the seed
    # leaves out and the cache stores: one float32 scale per position, head, K and V.
    assert kv_read_bytes(usage(48, 4, 128, "float8_e4m3fn", 4096)) == (49_152 + 2 * 48 * 4 * 4) * 4096
    assert kv_read_bytes(usage(30, 3, 64, "float32", 38)) == 46_080 * 38


def test_the_fraction_is_the_allowed_time_over_the_measured():
    read = StepBytes(weights=538_060_032, kv=46_080 * 40, positions=40)
    step = step_roofline(read, 20.0, CEILING)
    allowed = (538_060_032 + 46_080 * 40) / 40e9 * 1000  # ms at 40 GB/s
    assert step.bytes_read == read.total == 538_060_032 + 1_843_200
    assert step.roofline_ms == pytest.approx(allowed) == pytest.approx(roofline_ms(read.total, CEILING))
    assert step.fraction == pytest.approx(allowed / 20.0)
    # The run's fraction is its steps' time at the ceiling over the time they took, not a mean of fractions.
    later = StepBytes(538_060_032, 46_080 * 41, 41)
    run = decode_roofline([(read, 20.0), (later, 60.0)], CEILING)
    assert run is not None and run.steps == 2 and run.weight_bytes == 538_060_032
    both = roofline_ms(read.total, CEILING) + roofline_ms(later.total, CEILING)
    assert run.roofline_ms == pytest.approx(both) and run.fraction == pytest.approx(both / 80.0)
    mean = (read.total + later.total) / 2
    assert run.mean_bytes_read == mean and run.weight_share == pytest.approx(538_060_032 / mean)
    assert run.tokens_per_s_at() == pytest.approx(40e9 / mean)
    assert run.tokens_per_s_at(0.5) == pytest.approx(40e9 / (mean - 538_060_032 / 2))
    without = decode_roofline([(read, 20.0)], None)
    assert without is not None and without.roofline_ms is None and without.fraction is None
    assert without.tokens_per_s_at() is None and decode_roofline([], CEILING) is None
    with pytest.raises(ValueError, match="positive"):
        roofline_ms(1, ReadCeiling(0.0, "", "", "", ""))


def _decode_weight_bytes_by_hand(cfg, itemsize: int) -> int:
    """Every projection and norm, the head, and one embedding row (an untied table) or none (tied)."""
    hidden, q, kv, inter = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * \
        cfg.head_dim, cfg.intermediate_size  # fmt: skip
    per_layer = hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * inter + 2 * hidden
    params = cfg.num_hidden_layers * per_layer + hidden + cfg.vocab_size * hidden
    return (params + (0 if cfg.tie_word_embeddings else hidden)) * itemsize


def _tokens(engine, **request) -> list[TokenEvent]:
    req = GenerationRequest.from_prompt("Tell me about Kyoto", sampling=GREEDY, ignore_eos=True, **request)
    return [e for e in engine.start(req) if isinstance(e, TokenEvent)]


@pytest.mark.parametrize(("layout", "kv_dtype", "itemsize"),
                         [("gqa", "auto", 4), ("mha", "auto", 4), ("gqa", "bfloat16", 2)])  # fmt: skip
def test_each_decode_step_reads_the_weights_and_the_kv_at_its_context(chatty_engine, layout, kv_dtype, itemsize):
    cfg = chatty_engine.cfg
    tokens = _tokens(chatty_engine, max_tokens=6, kv_layout=layout, kv_dtype=kv_dtype)
    prompt = tokens[0].kv.tokens  # prefill's token: the cache holds the prompt
    assert tokens[0].bytes_read is None  # prefill made it, not a decode step
    heads = cfg.num_attention_heads if layout == "mha" else cfg.num_key_value_heads
    weights = _decode_weight_bytes_by_hand(cfg, 4)
    assert weights == chatty_engine.model.decode_weight_bytes
    for t in tokens[1:]:
        positions = prompt + t.index  # the step fed token index-1 at position prompt+index-1, and attended over all
        kv = 2 * cfg.num_hidden_layers * heads * cfg.head_dim * itemsize * positions
        assert t.bytes_read == StepBytes(weights, kv, positions), t.index


def test_an_fp8_step_reads_its_scales_too(chatty_engine):
    cfg = chatty_engine.cfg
    tokens = _tokens(chatty_engine, max_tokens=3, kv_dtype="fp8")
    last = tokens[-1]
    positions = tokens[0].kv.tokens + last.index
    per_position = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.head_dim * 1 + 4)
    assert last.bytes_read is not None and last.bytes_read.kv == per_position * positions


@pytest.mark.slow
def test_the_default_models_step_by_hand(default_engine):
    # SmolLM2-135M in float32: 134,515,008 parameters with the head tied to the embedding table
    # (so no row of it is read apart), and 2 x 30 x 3 x 64 x 4 = 46,080 KV bytes a position.
    cfg = default_engine.cfg
    assert _decode_weight_bytes_by_hand(cfg, 4) == 134_515_008 * 4
    tokens = _tokens(default_engine, max_tokens=4)
    prompt = tokens[0].kv.tokens
    for t in tokens[1:]:
        assert t.bytes_read == StepBytes(134_515_008 * 4, 46_080 * (prompt + t.index), prompt + t.index)
    assert step_bytes(default_engine.model.decode_weight_bytes, tokens[-1].kv) == tokens[-1].bytes_read


def test_a_hold_within_a_step_is_not_its_step_time(chatty_engine):
    req = GenerationRequest.from_prompt("Tell me about Kyoto", sampling=GREEDY, max_tokens=4, ignore_eos=True)
    session = chatty_engine.start(req)
    tokens = []
    for event in session:
        if isinstance(event, StepReady) and event.index == 2:
            session.hold()
            time.sleep(0.4)
        elif isinstance(event, TokenEvent):
            tokens.append(event)
    held = tokens[2]
    assert held.held_ms >= 400
    assert held.step_ms < 400  # the model step and sampling only: a tiny model's step is milliseconds
