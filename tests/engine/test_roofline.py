"""The roofline of a decode step: its bytes against the seeds' KV formula by hand, the fraction against
its definition, and a held step's time left out of its step time; prefill's FLOPs against a hand count
for the default model, its fraction of the compute ceiling, and the crossover rows."""

from __future__ import annotations

import dataclasses
import time

import pytest

from minengine.config import ModelConfig
from minengine.engine.events import StepReady, TokenEvent
from minengine.engine.request import GenerationRequest
from minengine.engine.roofline import (
    ComputeCeiling,
    FlopShape,
    ReadCeiling,
    StepBytes,
    crossover_rows,
    decode_roofline,
    flop_shape,
    kv_read_bytes,
    prefill_attention_flops,
    prefill_flops,
    prefill_roofline,
    roofline_ms,
    step_bytes,
    step_intensity,
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


# -- prefill's compute roofline --------------------------------------------------------------------

COMPUTE = ComputeCeiling(72e9, 256, "30 layers' projections over 256 rows, fastest of 5 passes", "cpu test, 2 threads",
                         "SmolLM2-135M-Instruct, q4_1 weights, float32", "2026-12-01 10:00 UTC",
                         "reqscope calibrate")  # fmt: skip


def _default_shape(default_model_dir, weight_bytes: int = 100_000_000) -> FlopShape:
    return flop_shape(ModelConfig.from_file(default_model_dir / "config.json"), weight_bytes)


def test_prefill_flops_match_a_hand_count_for_the_default_model(default_model_dir):
    shape = _default_shape(default_model_dir)
    # SmolLM2-135M: hidden 576, 9 q heads and 3 KV heads of 64, MLP 1,536, 30 layers, vocab 49,152.
    q, k, v, o = 576 * 576, 576 * 192, 576 * 192, 576 * 576  # 331,776 + 110,592 + 110,592 + 331,776
    gate, up, down = 576 * 1536, 576 * 1536, 1536 * 576  # 884,736 each
    assert q + k + v + o + gate + up + down == 3_538_944
    assert shape.layer_params == 30 * 3_538_944 == 106_168_320
    assert shape.head_params == 49_152 * 576 == 28_311_552
    # The default prompt's 38 tokens from position 0: contexts 1 + 2 + ... + 38 = 741.
    projections = 2 * 106_168_320 * 38  # 8,068,792,320
    head = 2 * 28_311_552  # the last position's logits: 56,623,104
    attention = 4 * 64 * 9 * 30 * 741  # q.k and p.v over each position's context: 51,217,920
    assert prefill_flops(shape, 38) == projections + head + attention == 8_176_633_344
    assert prefill_attention_flops(shape, 38) == attention  # the term that grows with the context
    # The same 38 tokens after 100 cached ones attend over 101 ... 138 positions: 38 x 100 + 741.
    assert prefill_flops(shape, 38, start=100) == projections + head + 4 * 64 * 9 * 30 * (3800 + 741)
    assert 0.2e9 < prefill_flops(shape, 1000) / 1000 < 0.3e9  # "about 0.27 GFLOP a token" with attention at 1,000


def test_prefill_roofline_sets_achieved_flops_against_the_ceiling_and_finds_the_crossover(default_model_dir):
    shape = _default_shape(default_model_dir, weight_bytes=100_000_000)
    p = prefill_roofline(shape, 38, 0, 250.0, 38, COMPUTE, CEILING)
    assert p.flops == 8_176_633_344 and p.flops_per_token == pytest.approx(8_176_633_344 / 38)
    assert p.attention_flops == 51_217_920 and p.attention_share == pytest.approx(51_217_920 / 8_176_633_344)
    # Far into a long prompt attention is half a chunk's arithmetic: 16 tokens at position 3,000.
    late = prefill_roofline(shape, 16, 3000, 250.0, 16, COMPUTE, CEILING)
    attended = 4 * 64 * 9 * 30 * (16 * 3000 + 136)  # contexts 3,001 ... 3,016
    assert late.attention_flops == attended
    assert late.attention_share == pytest.approx(attended / (attended + 2 * 106_168_320 * 16 + 2 * 28_311_552))
    assert 0.45 < late.attention_share < 0.55
    assert p.flops_per_s == pytest.approx(8_176_633_344 / 0.25)
    assert p.fraction == pytest.approx(8_176_633_344 / 0.25 / 72e9)
    # Ridge: 72e9 / 40e9 = 1.8 FLOPs a byte; a row is 2 x (106,168,320 + 28,311,552) FLOPs over 1e8 bytes.
    per_row = 2 * (106_168_320 + 28_311_552) / 100_000_000
    assert p.crossover == pytest.approx(1.8 / per_row)
    assert step_intensity(shape, 1) == pytest.approx(per_row)
    assert step_intensity(shape, p.crossover) == pytest.approx(COMPUTE.flops_per_s / CEILING.bytes_per_s)
    # The crossover is 1.8 / 2.69 = 0.67 rows here: a step of 1 row is past it, of none not.
    assert p.bound == "compute" and dataclasses.replace(p, rows=0).bound == "memory"
    slow_read = prefill_roofline(shape, 38, 0, 250.0, 38, COMPUTE, dataclasses.replace(CEILING, bytes_per_s=1e8))
    assert slow_read.crossover == pytest.approx(720 / per_row) and slow_read.bound == "memory"
    alone = prefill_roofline(shape, 38, 0, 250.0, 38, None, CEILING)
    assert alone.fraction is None and alone.crossover is None and alone.flops_per_s == p.flops_per_s
    assert alone.bound is None
    with pytest.raises(ValueError):
        crossover_rows(shape, dataclasses.replace(COMPUTE, flops_per_s=0.0), CEILING)


def test_a_compute_ceiling_is_named_for_the_arithmetic_it_was_measured_with(monkeypatch):
    """int8 rows run about twice int16's rate, and float32's slower: a ceiling `reqscope calibrate` measured with
    one set of rows is kept under another name than the others', so it is never another run's yardstick."""
    from pathlib import Path
    from types import SimpleNamespace

    import torch

    from minengine.fast.cpu_kernels import library
    from minengine.fast.panel_kernels import ACTIVATIONS_ENV, PanelLinear
    from minengine.plan.compute_ceiling import prefill_path_name

    names = {}
    for rows in ("int16", "int8", "float32"):
        monkeypatch.setenv(ACTIVATIONS_ENV, rows)
        panel = PanelLinear("q4_1", torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 0.02, 1)
        model = SimpleNamespace(layers=[SimpleNamespace(qkv=panel)])
        engine = SimpleNamespace(model=model, kernels="fast", model_dir=Path("tiny"),
                                 weights=SimpleNamespace(format="q4_1"), dtype=torch.float32)  # fmt: skip
        names[rows] = prefill_path_name(engine)
    assert names["float32"] == "tiny, q4_1 weights, float32, float32×q4_1 products"
    rounded = library().lib is not None and library().lib.dot8_native()
    assert len(set(names.values())) == (3 if rounded else 1), names  # without VNNI every row stays float32
