"""A prompt chunk's attention through the grouped, key-blocked C kernel (`fast/chunk_attention`), held
against torch's SDPA in float64 and, in a shared step over a long prompt, against the reference model.

- The kernel alone, on the default model's shapes (9 query heads over 3 KV heads, d=64): chunks at
  offsets 0, 17 and 300 of lengths 1 to 300, over a contiguous cache and over a paged one whose
  blocks lie out of order across segments; within 1e-5 of SDPA in float64, relative to the
  output's largest value. Causal with the chunk's offset: query i sees keys 0 .. start + i.
- A position's output is the same bits however the prompt was cut into chunks, and whether its
  cache is contiguous or paged (the kernel's key blocks start at fixed positions).
- A long prompt prefilled in chunks beside a decoding sequence, each chunk read in place from its
  block table: the prompt's logits within `FLOAT32_ATOL` of the reference model's (tests/engine/
  test_reference.py's tolerance for float32 weights), and the greedy tokens after it the reference's.

The rounded twin (`attend_chunk_rounded`, int16 dot products, where the build has VNNI) is held to
the same: within `ROUNDED_RELATIVE` of SDPA in float64, relative to the values' largest (the output
is their weighted mean, and each value is rounded by its own largest element), the same bits
however cut, contiguous or paged, on one thread or several; bound where the products round their
rows; and in the shared step beside decode rows, within `ROUNDED_ATOL` of the reference's logits
with its greedy tokens.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from tiny_models import TinySpec, build_tiny

from minengine.config import ModelConfig
from minengine.fast import chunk_attention
from minengine.fast.chunk_attention import PagedChunk, attend_chunk, attend_chunk_rounded
from minengine.fast.cpu_kernels import library
from minengine.kv.block_pool import BlockFormat, BlockPool
from minengine.kv.paged_cache import PagedKVCache
from minengine.reference.model import ReferenceModel
from minengine.steps.load import load_model
from minengine.steps.model_runner import ModelRunner
from minengine.steps.rows import Row
from minengine.steps.rows_attention import RowsAttention
from minengine.steps.shared_step import paged_chunks, pool_groups

CPU = torch.device("cpu")
HQ, HKV, D = 9, 3, 64  # the default model's (SmolLM2-135M)
RELATIVE = 1e-5
ROUNDED_RELATIVE = 3e-4  # of the values' largest; measured up to 1e-4 on these shapes
# The rounded twin's logits against the reference's on the tiny random model (logits up to about 6): measured
# 2.9e-3 there; on the default model the twin leaves the KL from float32's under 1e-7 nats (docs/performance.md).
ROUNDED_ATOL = 1e-2
FLOAT32_ATOL = 1e-4  # float32 logits against the reference (test_reference.py)
OFFSETS = (0, 17, 300)
LENGTHS = (1, 2, 3, 5, 8, 11, 16, 17, 31, 47, 48, 63, 64, 65, 100, 127, 128, 129, 200, 255, 256, 299, 300)
BLOCK = 16
CFG = ModelConfig(
    model_type="llama", vocab_size=96, hidden_size=HQ * D, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, rms_norm_eps=1e-5, rope_theta=1e4,
    max_position_embeddings=1024, tie_word_embeddings=False,
)  # fmt: skip

pytestmark = pytest.mark.skipif(library().lib is None, reason=library().why_not or "no C kernels")
needs_rounded = pytest.mark.skipif(
    library().lib is None or not chunk_attention.rounded(D), reason="the rounded twin needs AVX-512 VNNI"
)
KERNELS = [attend_chunk, pytest.param(attend_chunk_rounded, marks=needs_rounded)]


def _sdpa64(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """SDPA in float64 with the chunk's causal offset: q [T, Hq, d] over keys/values [Hkv, start+T, d] -> [T, Hq*d]."""
    T = q.shape[0]
    mask = torch.arange(start + T).unsqueeze(0) <= torch.arange(T).unsqueeze(1) + start
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1).unsqueeze(0), keys.double().unsqueeze(0), values.double().unsqueeze(0),
        attn_mask=mask, scale=scale, enable_gqa=True,
    )  # fmt: skip
    return out[0].transpose(0, 1).reshape(T, -1)


def _close(ours: torch.Tensor, ref: torch.Tensor, values: torch.Tensor | None = None) -> None:
    """Within RELATIVE of the output's largest, or (the rounded twin, given the values) ROUNDED_RELATIVE of
    the values' largest."""
    err = (ours.double() - ref).abs().max().item()
    top = ref.abs().max().item() if values is None else values.abs().max().item()
    bound = RELATIVE if values is None else ROUNDED_RELATIVE
    assert err <= bound * top, f"{err:.3g} against a largest value of {top:.3g}"


def _scattered_cache(end: int) -> tuple[PagedKVCache, list[PagedKVCache]]:
    """A paged cache of CFG with room for `end` positions whose blocks lie out of order: interleaved
    with two other caches' (a run per block), in segments of 8 blocks (the table crosses them)."""
    fmt = BlockFormat(CFG.num_hidden_layers, HKV, D, BLOCK, torch.float32)
    pool = BlockPool(64 << 20, CPU, first_segment_bytes=8 * fmt.nbytes)
    caches = [PagedKVCache(pool, CFG, owner=f"r{i}", device=CPU, compute_dtype=torch.float32, block_size=BLOCK)
              for i in range(3)]  # fmt: skip
    for at in range(BLOCK, end + BLOCK, BLOCK):
        for cache in caches if at // BLOCK % 2 else caches[::-1]:  # the order changes block by block
            cache.make_room(min(at, end))
    return caches[0], caches[1:]


@pytest.mark.parametrize("attend", KERNELS)
def test_the_kernel_equals_sdpa_in_float64_over_contiguous_and_paged_caches(attend):
    rounded = attend is attend_chunk_rounded
    gen = torch.Generator().manual_seed(0)
    scale = D**-0.5
    for start in OFFSETS:
        end = start + max(LENGTHS)
        keys, values = (torch.randn(HKV, end, D, generator=gen) for _ in range(2))
        paged, _others = _scattered_cache(end)
        assert len(paged.runs(end)) > 1 and len({id(r.segment) for r in paged.runs(end)}) > 1
        # Every position's K/V written into the table, layer 1 (the layer stride counts), up to `start`.
        paged.write(1, keys[:, :start].unsqueeze(0), values[:, :start].unsqueeze(0), 0)
        for T in LENGTHS:
            q = torch.randn(T, HQ, D, generator=gen)
            k, v = keys[:, : start + T], values[:, : start + T]
            ref = _sdpa64(q, k, v, start, scale)
            contiguous = attend(q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), start, scale)
            _close(contiguous[0].transpose(0, 1).reshape(T, -1), ref, v if rounded else None)
            chunk = PagedChunk(paged, start, scale, rounded)
            in_place = chunk(1, q, k[:, start:].transpose(0, 1), v[:, start:].transpose(0, 1), T)
            _close(in_place, ref, v if rounded else None)
            # The same arithmetic either way: contiguous and paged give the same bits.
            assert torch.equal(in_place, contiguous[0].transpose(0, 1).reshape(T, -1))
            assert torch.equal(in_place[-1:], chunk(1, q[-1:], k[:, start:].transpose(0, 1),
                                                    v[:, start:].transpose(0, 1), 1))  # fmt: skip


@pytest.mark.parametrize("attend", KERNELS)
def test_a_positions_output_is_the_same_bits_however_the_prompt_was_cut(attend):
    gen = torch.Generator().manual_seed(1)
    n, scale = 300, D**-0.5
    q = torch.randn(n, HQ, D, generator=gen)
    k, v = torch.randn(HKV, n, D, generator=gen), torch.randn(HKV, n, D, generator=gen)

    def chunked(cuts: list[int]) -> torch.Tensor:
        outs, at = [], 0
        for end in [*cuts, n]:
            part = attend(q[at:end].transpose(0, 1).unsqueeze(0), k[None, :, :end], v[None, :, :end], at, scale)
            outs.append(part[0].transpose(0, 1).reshape(end - at, -1))
            at = end
        return torch.cat(outs)

    whole = chunked([])
    _close(whole, _sdpa64(q, k, v, 0, scale), v if attend is attend_chunk_rounded else None)
    for cuts in ([1], [17, 18, 100], [63, 64, 65, 129], [11 * i for i in range(1, 27)]):
        assert torch.equal(chunked(cuts), whole), cuts
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(chunked([40]), whole)  # one thread or several: each row's arithmetic is its own
    finally:
        torch.set_num_threads(threads)


@needs_rounded
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_input_to_the_twin_comes_out_nan_where_read_and_leaves_the_rest_its_bits(where, bad):
    """A NaN or inf in one query, key or value: the float kernel's arithmetic makes what reads it non-finite. The
    twin's rounding (a vector's largest element, MAXPS, drops a NaN) used to turn it into a number; now its
    scale is NaN. So every output the float kernel makes non-finite is non-finite in the twin too, and every
    output that does not read the vector (the other KV heads' queries, and the queries before its key block)
    keeps the bits it has without it. A query before a bad value's position in its key block may read it at
    weight 0 (0 x NaN), as the float kernel's may: those are left unchecked."""
    gen = torch.Generator().manual_seed(3)
    n, at, scale = 200, 150, D**-0.5  # position 150 lies in the third key block (64 keys a block)
    q = torch.randn(n, HQ, D, generator=gen)
    k, v = torch.randn(HKV, n, D, generator=gen), torch.randn(HKV, n, D, generator=gen)
    clean = attend_chunk_rounded(q.transpose(0, 1).unsqueeze(0), k[None], v[None], 0, scale)
    tensor = {"q": q, "k": k, "v": v}[where]
    if where == "q":
        tensor[at, 4, 5] = bad  # query head 4 reads KV head 1
    else:
        tensor[1, at, 5] = bad
    args = (q.transpose(0, 1).unsqueeze(0), k[None], v[None], 0, scale)
    floats, twin = attend_chunk(*args)[0], attend_chunk_rounded(*args)[0]  # [Hq, T, d]
    assert not (~torch.isfinite(floats) & torch.isfinite(twin)).any()
    heads = [4] if where == "q" else [3, 4, 5]  # KV head 1's query heads
    reads, may = torch.zeros(HQ, n, dtype=torch.bool), torch.zeros(HQ, n, dtype=torch.bool)
    for h in heads:
        if where == "q":
            reads[h, at] = True
        else:
            reads[h, at:] = True
            may[h, at // 64 * 64 : at] = True
    assert torch.isnan(twin[reads]).any(dim=-1).all()
    rest = ~(reads | may)
    assert torch.equal(twin[rest], clean[0][rest])


def test_the_model_binds_the_kernel_wherever_the_kernels_built():
    """Under AVX2 as under AVX-512 (docs/lab/prefill-profile.md: it outran SDPA on a Zen 3 too)."""
    from minengine.fast.row_ops import model_ops

    assert chunk_attention.available()
    ops = model_ops(CPU, torch.float32)
    assert ops.prompt_attention is attend_chunk
    assert "key-blocked" in ops.why
    rounded = model_ops(CPU, torch.float32, rounded=True)
    assert rounded.prompt_attention is attend_chunk_rounded and "int16 dot products" in rounded.why


def test_the_rounded_twin_is_bound_where_the_products_round_their_rows():
    from minengine.fast.panel_kernels import activations
    from minengine.steps.load import rounds_rows

    twin = chunk_attention.rounded(D) and activations() != "float32"
    assert rounds_rows(CFG, CPU, "q4_1-exact") is twin
    assert rounds_rows(CFG, CPU, "q8_0") is twin
    for packs in (None, "float32-panels", "fp16-panels", "int8", "bf16"):  # products over float rows
        assert not rounds_rows(CFG, CPU, packs)
    assert not rounds_rows(CFG, torch.device("meta"), "q4_1")
    odd = replace(CFG, head_dim=48)
    assert not rounds_rows(odd, CPU, "q4_1")  # a head the twin does not take keeps the float kernel


def test_float32_activations_keep_the_float_kernel(monkeypatch):
    from minengine.settings import ACTIVATIONS_ENV
    from minengine.steps.load import rounds_rows

    monkeypatch.setenv(ACTIVATIONS_ENV, "float32")
    assert not rounds_rows(CFG, CPU, "q4_1-exact")


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    """A tiny llama with the default model's attention shape (9 query heads over 3 KV heads, d=64)."""
    folder = tmp_path_factory.mktemp("gqa93")
    overrides = {"hidden_size": HQ * D, "num_attention_heads": HQ, "num_key_value_heads": HKV,
                 "max_position_embeddings": 1024}  # fmt: skip
    build_tiny(TinySpec("gqa-9-3", "llama", overrides), folder)
    return folder


@pytest.mark.parametrize("attend", KERNELS)
def test_a_long_prompt_in_chunks_beside_decode_rows_matches_the_reference(gqa_model, attend, monkeypatch):
    from minengine.steps import load

    rounded = attend is attend_chunk_rounded
    monkeypatch.setattr(load, "rounds_rows", lambda *_: rounded)  # the tiny model's float32 weights, either kernel
    cfg = ModelConfig.from_file(gqa_model)
    model = load_model(gqa_model, cfg, torch.float32, CPU)
    assert model.ops.prompt_attention is attend or not chunk_attention.available()
    runner, ref = ModelRunner(model, static_decode=False), ReferenceModel.load(gqa_model)
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, cfg.vocab_size, (700,), generator=gen)
    other = torch.randint(3, cfg.vocab_size, (9,), generator=gen)
    pool = BlockPool(64 << 20, CPU, first_segment_bytes=1 << 20)
    long = PagedKVCache(pool, cfg, owner="long", device=CPU, compute_dtype=torch.float32, block_size=BLOCK)
    beside = PagedKVCache(pool, cfg, owner="beside", device=CPU, compute_dtype=torch.float32, block_size=BLOCK)
    token = int(runner.forward(other, 0, beside).argmax())
    at, logits = 0, None
    for size in (64, 5, 130, 1, 200, 64, 236):  # chunks of every kind of length; 700 in all
        ids = tuple(prompt[at : at + size].tolist())
        beside.make_room(len(other) + at + size)  # the two tables' blocks interleave
        rows = [Row((token,), len(other), beside, True), Row(ids, at, long, at + size == len(prompt))]
        attention = RowsAttention(rows, model, pool_groups(rows, model), paged_chunks(rows, model))
        # The plan sends a chunk row over its table in place where the model binds the kernel; one token is a
        # decode row.
        assert (attention.paged[1] is not None) == (chunk_attention.available() and size > 1)
        out = runner.forward_rows(rows)
        token, logits, at = int(out[0].argmax()), out[1], at + size
        other = torch.cat([other, torch.tensor([rows[0].ids[0]])])
    assert not long.contiguous
    ref_cache = ref.new_cache()
    expected = ref.forward(prompt, 0, ref_cache)
    assert (logits - expected).abs().max().item() <= (ROUNDED_ATOL if rounded else FLOAT32_ATOL)
    # Greedy tokens after the prompt: the engine's (decode rows over the paged cache) and the reference's.
    ours, theirs = [int(logits.argmax())], [int(expected.argmax())]
    for pos in range(len(prompt), len(prompt) + 8):
        ours.append(int(runner.forward_rows([Row((ours[-1],), pos, long, True)])[0].argmax()))
        theirs.append(int(ref.forward(torch.tensor([theirs[-1]]), pos, ref_cache).argmax()))
    assert ours == theirs


def test_the_planner_counts_each_prompt_attention_at_its_own_weight():
    """`ChunkCost` by the prompt attention the model was built with: the kernel's and its twin's measured
    weights where they are bound, the SDPA fit otherwise; far into a prompt, the cheaper a chunk's
    attention is counted, the more tokens it gets."""
    from minengine.engine.chunk_cost import ATTENTION_MAC_WEIGHT, KEYBLOCKED_MAC_WEIGHT, ROUNDED_MAC_WEIGHT, ChunkCost
    from minengine.model.ops import TORCH_OPS

    smol = replace(CFG, vocab_size=49152, intermediate_size=1536, num_hidden_layers=30, tie_word_embeddings=True)
    kernel = ChunkCost.of_model(smol, replace(TORCH_OPS, prompt_attention=attend_chunk))
    twin = ChunkCost.of_model(smol, replace(TORCH_OPS, prompt_attention=attend_chunk_rounded))
    sdpa = ChunkCost.of_model(smol, TORCH_OPS)
    assert sdpa == ChunkCost.of_model(smol)
    assert kernel.keys_per_row == pytest.approx(sdpa.keys_per_row * ATTENTION_MAC_WEIGHT / KEYBLOCKED_MAC_WEIGHT)
    assert twin.keys_per_row == pytest.approx(sdpa.keys_per_row * ATTENTION_MAC_WEIGHT / ROUNDED_MAC_WEIGHT)
    # Beside 16 decoding streams (48 rows of a 64-row step left), near position 3,000.
    by_weight = sorted([(KEYBLOCKED_MAC_WEIGHT, kernel), (ROUNDED_MAC_WEIGHT, twin), (ATTENTION_MAC_WEIGHT, sdpa)],
                       key=lambda pair: pair[0])  # fmt: skip
    tokens = [cost.tokens(3000, 1000, 48.0) for _, cost in by_weight]
    assert tokens == sorted(tokens, reverse=True) and tokens[0] > tokens[-1] >= 11


@needs_rounded
def test_a_loaded_engines_settings_name_the_attention_its_model_binds(chatty_tiny_dir, monkeypatch):
    """`--json`'s and the trace's settings report the model's own prompt attention (the twin where its
    products round their rows), not the float kernel a fresh float32 model would bind."""
    from minengine.engine.engine import Engine
    from minengine.record.settings_report import collect, collect_for_engine
    from minengine.steps import load

    monkeypatch.setattr(load, "rounds_rows", lambda *_: True)
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", prefix_cache=False)
    assert engine.model.ops.prompt_attention is attend_chunk_rounded
    row_ops = collect_for_engine(engine)["row_ops"]
    assert row_ops.detail == engine.model.ops.why and row_ops.detail.endswith("in int16 dot products")
    assert "int16" not in collect(CPU)["row_ops"].detail


def test_the_twin_asked_for_a_head_it_does_not_take_says_so_rather_than_run_the_float_kernel():
    """The kernel never swaps its arithmetic by itself: a rounded chunk over heads of 48 floats (not a
    multiple of 32) is refused with the reason, as attend_chunk_rounded refuses it up front."""
    if not chunk_attention.available():
        pytest.skip("the chunk kernel does not run natively here")
    cfg = replace(CFG, head_dim=48, hidden_size=HQ * 48)
    pool = BlockPool(8 << 20, CPU)
    cache = PagedKVCache(pool, cfg, owner="odd", device=CPU, compute_dtype=torch.float32, block_size=BLOCK)
    cache.make_room(5)
    q, k, v = torch.randn(5, HQ, 48), torch.randn(5, HKV, 48), torch.randn(5, HKV, 48)
    with pytest.raises(ValueError, match="heads of 48 floats"):
        PagedChunk(cache, 0, 48**-0.5, True)(0, q, k, v, 5)
    with pytest.raises(ValueError, match="multiple of 32"):
        attend_chunk_rounded(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                             v.transpose(0, 1).unsqueeze(0), 0, 48**-0.5)  # fmt: skip
    assert PagedChunk(cache, 0, 48**-0.5)(0, q, k, v, 5).shape == (5, HQ * 48)  # the float kernel takes it
