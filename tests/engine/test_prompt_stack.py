"""The C prompt stack (`prompt_stack.PromptStack`, `prompt_layers.c`): one sequence's prompt chunk through every
block in one call, held to the Python blocks (`Transformer.forward`) bit for bit: the logits and every layer's
K/V in the cache, for a fresh prompt and for a chunk over what the cache holds, in a request's own cache and in
the block pool. Where it does not serve, the plan says so and runs the Python blocks.
"""

from __future__ import annotations

import pytest
import torch

from minengine.config import ModelConfig
from minengine.fast.cpu_kernels import library
from minengine.fast.panel_kernels import ACTIVATIONS_ENV
from minengine.fast.prompt_stack import PromptStack
from minengine.kv.block_pool import BlockPool
from minengine.kv.cache import KVCache
from minengine.steps.load import load_model
from minengine.steps.model_runner import ModelRunner
from minengine.steps.rows import Row

CPU, F32 = torch.device("cpu"), torch.float32

needs_vnni = pytest.mark.skipif(
    library().lib is None or not library().lib.dot8_native(), reason="rounded activations need AVX-512 VNNI"
)
ROUNDED = [pytest.param(f"{fmt}+{acts}", marks=needs_vnni) for acts in ("int16", "int8") for fmt in ("q8_0", "q4_1")]
# (positions before the chunk, the chunk's length): a fresh prompt of 2 (the least the stack takes), a few, and
# more than a prompt's rows round together and go out one run at a time (64); then chunks over a held prefix.
CHUNKS = [(0, 2), (0, 11), (0, 130), (40, 3), (70, 90)]


def _runner(folder, packs, monkeypatch) -> tuple[ModelConfig, ModelRunner]:
    """The model under "FORMAT+ACTS": FORMAT's panels, its rows rounded to ACTS (int16 or int8) or float32."""
    packs, _, acts = packs.partition("+")
    monkeypatch.setenv(ACTIVATIONS_ENV, acts)
    cfg = ModelConfig.from_file(folder)
    return cfg, ModelRunner(load_model(folder, cfg, torch.float32, CPU, packs=packs or None))


def _ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _same_cache(a, b, end: int) -> bool:
    (ka, va), (kb, vb) = a.head_views(), b.head_views()
    return all(torch.equal(x[:, :end], y[:, :end]) for x, y in zip(ka + va, kb + vb, strict=True))


def _both_ways(runner: ModelRunner, ids: torch.Tensor, start: int, make_cache) -> None:
    """The chunk ids[start:] through the plan (the prompt stack) and through `Transformer.forward`, each over a
    cache holding ids[:start] as the Python blocks wrote it: the same logits, the same cache."""
    model, ours, theirs = runner.model, make_cache(), make_cache()
    for cache in (ours, theirs):
        if start:
            model.forward(ids[:start], 0, cache)
    logits = runner.forward(ids[start:], start, ours)
    assert runner.last_path.name.startswith("c-stack prompt"), runner.last_path
    assert torch.equal(logits, model.forward(ids[start:], start, theirs))
    assert ours.lengths == theirs.lengths == [len(ids)] * model.cfg.num_hidden_layers
    assert _same_cache(ours, theirs, len(ids))


@pytest.mark.parametrize("packs", ROUNDED)
@pytest.mark.parametrize("name", ["llama-gqa", "llama-mha-tied", "llama-mqa"])
def test_a_chunk_through_the_prompt_stack_is_the_python_blocks_bit_for_bit(tiny_models, monkeypatch, packs, name):
    cfg, runner = _runner(tiny_models[name][0], packs, monkeypatch)
    for start, length in CHUNKS:
        ids = _ids(start + length, cfg.vocab_size, start + length)
        _both_ways(runner, ids, start, lambda: KVCache(cfg, 256, device=CPU, compute_dtype=torch.float32))


@pytest.mark.parametrize("packs", ROUNDED[1:2])  # q4_1 under int16, the default on a VNNI CPU
def test_in_the_block_pool_too(tiny_models, monkeypatch, packs):
    cfg, runner = _runner(tiny_models["llama-gqa"][0], packs, monkeypatch)
    pool = BlockPool(16 << 20, CPU)
    for i, (start, length) in enumerate(CHUNKS):
        ids = _ids(start + length, cfg.vocab_size, i)
        _both_ways(runner, ids, start, lambda n=start + length, i=i: runner.new_cache(n, pool=pool, owner=f"r{i}"))


@pytest.mark.slow
@needs_vnni
def test_the_default_models_prompt_with_its_rounded_attention(default_model_dir, monkeypatch):
    """The default model's heads take the chunk kernel's rounded twin, which the tiny models' do not; 300
    positions cover several of its 64-key blocks and the int16 products' AMX-sized windows of rows."""
    cfg, runner = _runner(default_model_dir, "q4_1+int16", monkeypatch)
    assert PromptStack.of(runner.model).rounded
    ids = _ids(340, cfg.vocab_size, 5)
    for start in (0, 40):
        _both_ways(runner, ids[: start + 300], start, lambda: KVCache(cfg, 400, device=CPU, compute_dtype=F32))


@needs_vnni
def test_where_it_does_not_serve_the_plan_says_so_and_runs_the_python_blocks(tiny_models, monkeypatch):
    cfg, runner = _runner(tiny_models["llama-gqa"][0], "q4_1+int16", monkeypatch)
    ids, small = _ids(12, cfg.vocab_size, 1), KVCache(cfg, 8, device=CPU, compute_dtype=torch.float32)

    def cache(**options):
        return KVCache(cfg, 64, device=CPU, compute_dtype=torch.float32, **options)

    assert runner.pick(ids, 0, cache()).path.name == "c-stack prompt int16×q4_1"
    assert "12 positions of one sequence" in runner.pick(ids, 0, cache()).path.why
    general = {  # each plan, and why the prompt stack did not take it (None: it was not asked)
        "every position's logits": (runner.pick(ids, 0, cache(), all_logits=True), None),
        "one position's, all asked": (runner.pick(ids[:1], 0, cache(), all_logits=True), None),
        "fp8 K/V": (runner.pick(ids, 0, cache(storage_dtype=torch.float8_e4m3fn)), " stores K/V as float8_e4m3fn"),
        "a head per query head": (runner.pick(ids, 0, cache(layout="mha")), " holds 4 heads (the mha layout)"),
        "no room": (runner.pick(_ids(small.capacity + 1, cfg.vocab_size, 2), 0, small), " must grow for the chunk"),
    }
    pool = BlockPool(4 << 20, CPU)
    split, beside = runner.new_cache(1, pool=pool, owner="a"), runner.new_cache(1, pool=pool, owner="b")
    for end in (16, 32, 48):  # their blocks taken in turns: neither table is one run
        split.make_room(end), beside.make_room(end)
    general["blocks apart"] = (runner.pick(_ids(40, cfg.vocab_size, 3), 0, split), "'s blocks are not one run")
    for name, (plan, why) in general.items():
        assert plan.path.name == "torch general", name
        if why is None:
            assert "no C prompt stack" not in plan.path.why, name
        else:
            assert f"no C prompt stack: the cache{why}" in plan.path.why, (name, plan.path.why)
    assert runner.pick(ids[:1], 0, cache()).path.name.startswith("c-stack int16")  # one token: a decode step's


def test_it_serves_rounded_rows_only(tiny_models, monkeypatch):
    for packs in ("q4_1+float32", "fp16-panels+float32", "+float32"):
        assert PromptStack.of(_runner(tiny_models["llama-gqa"][0], packs, monkeypatch)[1].model) is None


def _in_two_runs(runner: ModelRunner, pool: BlockPool, owner: str, tokens: int, prompt: list[int]) -> Row:
    """A prompt's row whose cache's blocks lie in two runs: its first block, another request's, then the rest."""
    cache = runner.new_cache(16, pool=pool, owner=owner)
    cache.make_room(16)
    runner.new_cache(16, pool=pool, owner=f"{owner}-between").make_room(16)
    cache.make_room(tokens)
    assert not cache.contiguous
    return Row(tuple(prompt), 0, cache, True)


def _first_logits_every_way(runner: ModelRunner, cfg, prompt: list[int]) -> dict[str, torch.Tensor]:
    """The prompt's first-token logits prefilled alone (the prompt stack; the Python blocks over a request's own
    cache) and in shared steps: beside two decode rows (two passes: the chunk through the prompt stack, or, its
    blocks in two runs, through the Python blocks attended in its blocks in place), beside one (one pass,
    `torch rows`), and beside one in caches of their own (attended over the gathered keys)."""
    pool, n = BlockPool(64 << 20, CPU), len(prompt)
    other = _ids(20, cfg.vocab_size, 9)

    def decoding(owner: str, pooled: bool = True):
        cache = runner.new_cache(24, pool=pool, owner=owner) if pooled else KVCache(cfg, 24, device=CPU,
                                                                                   compute_dtype=F32)  # fmt: skip
        runner.forward(other, 0, cache)
        return Row((5,), 20, cache, True)

    def prompt_row(owner: str, pooled: bool = True) -> Row:
        cache = runner.new_cache(n + 1, pool=pool, owner=owner) if pooled else KVCache(cfg, n + 1, device=CPU,
                                                                                      compute_dtype=F32)  # fmt: skip
        return Row(tuple(prompt), 0, cache, True)

    ways = {"alone": runner.forward(torch.tensor(prompt), 0, runner.new_cache(n + 1, pool=pool, owner="a"))}
    assert runner.last_path.name.startswith("c-stack prompt")
    plain = KVCache(cfg, n + 1, device=CPU, compute_dtype=F32)
    ways["alone, Python blocks"] = runner.model.forward(torch.tensor(prompt), 0, plain)
    ways["beside two decode rows"] = runner.forward_rows([decoding("d1"), decoding("d2"), prompt_row("b")])[2]
    assert runner.last_path.name.endswith(" + c-stack prompt")
    split = runner.forward_rows([decoding("d5"), decoding("d6"), _in_two_runs(runner, pool, "f", n + 1, prompt)])
    ways["beside two decode rows, its blocks in two runs"] = split[2]
    assert runner.last_path.name.endswith(" + torch chunks")
    assert "no C prompt stack: the cache's blocks are not one run" in runner.last_path.why
    ways["beside one"] = runner.forward_rows([decoding("d3"), prompt_row("c")])[1]
    assert runner.last_path.name == "torch rows"
    ways["beside one, own caches"] = runner.forward_rows([decoding("d4", False), prompt_row("e", False)])[1]
    return ways


@pytest.mark.parametrize("packs", ROUNDED[1:2])
def test_a_prompts_first_token_has_the_same_bits_alone_or_beside_others(tiny_models, monkeypatch, packs):
    """Every path attends a prompt chunk's last position in the last layer with the prompt attention, so the
    logits a prompt's first token is drawn from do not depend on what shared its step."""
    cfg, runner = _runner(tiny_models["llama-gqa"][0], packs, monkeypatch)
    ways = _first_logits_every_way(runner, cfg, _ids(40, cfg.vocab_size, 8).tolist())
    for name, logits in ways.items():
        assert torch.equal(logits, ways["alone"]), name


@pytest.mark.slow
@needs_vnni
def test_on_the_default_model_with_its_rounded_attention_too(default_model_dir, monkeypatch):
    cfg, runner = _runner(default_model_dir, "q4_1+int16", monkeypatch)
    ways = _first_logits_every_way(runner, cfg, _ids(90, cfg.vocab_size, 3).tolist())
    for name, logits in ways.items():
        assert torch.equal(logits, ways["alone"]), name
