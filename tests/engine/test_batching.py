"""Continuous batching: requests share steps, and a greedy request's tokens are the ones it gets alone.

The step loop and the batched forward are checked on every tiny family (batch invariance, chunked
prefill), and the sessions on the chatty tiny model (events, pool accounting, a held request out
of the batch, cancellation between prompt chunks, bad limits).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
import torch
from concurrent_runs import run_all
from tiny_models import SPECS

from minengine.config import ModelConfig
from minengine.engine.burst import Bursts
from minengine.engine.chunk_cost import ChunkCost
from minengine.engine.engine import Engine
from minengine.engine.events import DoneEvent, PrefillEvent, PrefixCacheEvent, StepReady, TokenEvent
from minengine.engine.request import GenerationRequest
from minengine.engine.step_loop import BatchLimits, StepCancelled, StepLoop
from minengine.errors import Mention, RequestError, Setting
from minengine.kv.cache import KVCache
from minengine.sampling.params import SamplingParams
from minengine.steps.load import load_model
from minengine.steps.model_runner import ModelRunner
from reqscope.wording import error_text

GREEDY = SamplingParams(temperature=0.0)
PROMPT_LENGTHS = (5, 9, 23, 2)
NEW_TOKENS = 10


def _runner(folder) -> tuple[ModelConfig, ModelRunner]:
    cfg = ModelConfig.from_file(folder)
    model = load_model(folder, cfg, torch.float32, torch.device("cpu"))
    return cfg, ModelRunner(model, static_decode=False)


def _prompts(vocab: int) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(7)
    return [tuple(torch.randint(0, vocab, (n,), generator=g).tolist()) for n in PROMPT_LENGTHS]


def _cache(cfg: ModelConfig) -> KVCache:
    return KVCache(cfg, 64, device=torch.device("cpu"), compute_dtype=torch.float32)


def _solo(runner: ModelRunner, cfg: ModelConfig, prompt: tuple[int, ...]) -> list[int]:
    cache, out = _cache(cfg), []
    logits = runner.forward(torch.tensor(prompt), 0, cache)
    for i in range(NEW_TOKENS):
        out.append(int(logits.argmax()))
        logits = runner.forward(torch.tensor(out[-1:]), len(prompt) + i, cache)
    return out


def _batched(loop: StepLoop, cfg: ModelConfig, prompts: list[tuple[int, ...]]):
    """Every prompt greedily decoded on its own thread, all in one loop; tokens and members."""
    members = [loop.join(_cache(cfg), threading.Event()) for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    chunks: list[list] = [[] for _ in prompts]
    start = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        start.wait()
        logits, chunks[i] = members[i].forward(prompts[i], 0)
        for k in range(NEW_TOKENS):
            tokens[i].append(int(logits.argmax()))
            logits, _ = members[i].forward(tuple(tokens[i][-1:]), len(prompts[i]) + k)
        members[i].leave()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return tokens, chunks, members


@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_greedy_tokens_in_a_batch_equal_the_tokens_alone_on_every_family(tiny_models, name):
    folder, _ = tiny_models[name]
    cfg, runner = _runner(folder)
    prompts = _prompts(cfg.vocab_size)
    loop = StepLoop(runner, BatchLimits(max_num_seqs=4, max_num_batched_tokens=16), gather_s=0.05)
    tokens, chunks, members = _batched(loop, cfg, prompts)
    assert tokens == [_solo(runner, cfg, p) for p in prompts]
    # The steps really were shared, and the 23-token prompt did not fit one 16-token step.
    assert max(s.sequences for m in members for s in m.steps) > 1
    long = chunks[PROMPT_LENGTHS.index(23)]
    assert len(long) >= 2 and sum(c.tokens for c in long) == 23
    assert [c.start for c in long] == [sum(c.tokens for c in long[:i]) for i in range(len(long))]
    assert all(c.step.scheduled_tokens <= 16 and c.step.sequences <= 4 for cs in chunks for c in cs)
    assert loop.running == 0


def test_a_step_never_holds_more_than_its_limits(tiny_models):
    folder, _ = tiny_models["llama-gqa"]
    cfg, runner = _runner(folder)
    prompts = _prompts(cfg.vocab_size) * 2  # 8 requests, 3 sequences a step
    loop = StepLoop(runner, BatchLimits(max_num_seqs=3, max_num_batched_tokens=16), gather_s=0.05)
    tokens, _, members = _batched(loop, cfg, prompts)
    steps = [s for m in members for s in m.steps]
    assert max(s.sequences for s in steps) == 3 and all(s.scheduled_tokens <= 16 for s in steps)
    assert tokens[:4] == tokens[4:]  # the same prompts, decoded in other company, the same tokens


def test_a_cancelled_prompt_stops_between_its_chunks(tiny_models):
    folder, _ = tiny_models["llama-gqa"]
    cfg, runner = _runner(folder)
    loop = StepLoop(runner, BatchLimits(max_num_seqs=2, max_num_batched_tokens=16))
    cancelled = threading.Event()
    member = loop.join(_cache(cfg), cancelled)
    cancelled.set()
    with pytest.raises(StepCancelled):
        member.forward(tuple(range(40)), 0)
    assert member.steps == [] and member.cache.tokens == 0  # no step ran it


# -- sessions -------------------------------------------------------------------------------------


def _request(prompt: str, max_tokens: int = 12) -> GenerationRequest:
    return GenerationRequest.from_prompt(prompt, sampling=GREEDY, max_tokens=max_tokens, ignore_eos=True)


@contextlib.contextmanager
def _decoding_beside(engine: Engine, max_tokens: int) -> Iterator[None]:
    """A request decoding unsteered (as a server runs it) from its first token until the block ends."""
    decoding = engine.start(_request("Tell me about Kyoto", max_tokens=max_tokens), steered=False)
    events = iter(decoding)
    while not isinstance(next(events), TokenEvent):
        pass
    rest: list = []
    beside = threading.Thread(target=lambda: rest.extend(events))
    beside.start()
    try:
        yield
    finally:
        decoding.cancel()
        beside.join(timeout=60)


PROMPTS = ("Tell me about Kyoto", "What is a KV cache?", "Hi", "Name three hotels with step-free access in Osaka")


def test_concurrent_sessions_share_steps_and_keep_their_tokens(chatty_tiny_dir):
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=64 << 20, prefix_cache=False)
    alone = [next(e for e in engine.start(_request(p)) if isinstance(e, DoneEvent)).result for p in PROMPTS]
    together = run_all(engine, [_request(p) for p in PROMPTS])
    results = [evs[-1].result for evs in together]
    assert [r.token_ids for r in results] == [r.token_ids for r in alone]
    assert all(r.batch.steps == 12 and r.batch.max_batch == 1 and r.batch.shared_steps == 0 for r in alone)
    for evs, result in zip(together, results, strict=True):
        steps = [e.batch for e in evs if isinstance(e, TokenEvent) and e.batch is not None]
        assert len(steps) == 11  # every token after prefill's first came from a step
        assert result.batch.max_batch == max(s.sequences for s in steps) > 1
        assert result.batch.shared_steps >= 1 and result.batch.prefill_chunks >= 1
        shared = [s for s in steps if s.sequences > 1]
        # The pool as this request saw it: its own reservation, and the others' while they ran.
        assert all(s.pool.own > 0 and s.pool.others > 0 for s in shared)
        assert all(s.pool.own + s.pool.others + s.pool.prefix + s.pool.free == s.pool.budget for s in steps)
        # A shared step's roofline is the step's: the weights read once, every decode row's K/V,
        # over the forward's own time (not this request's wait for it).
        for token in (e for e in evs if isinstance(e, TokenEvent) and e.batch is not None and e.batch.sequences > 1):
            own_kv = token.kv.bytes_per_token * token.kv.tokens
            assert token.bytes_read == token.batch.bytes_read and token.read_step_ms == token.batch.step_ms
            assert token.bytes_read.weights == engine.model.decode_weight_bytes
            assert token.bytes_read.kv > own_kv if token.batch.decode_tokens > 1 else token.bytes_read.kv == own_kv
    assert engine.scheduler.running == 0 and engine.steps.running == 0 and engine.scheduler.held_bytes == 0


def test_a_long_prompt_is_prefilled_in_chunks_within_the_step_budget(chatty_tiny_dir):
    prompt = "Describe step-free routes between the stations of Kyoto, " * 6
    wide = Engine(
        chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=64 << 20, prefix_cache=False,
        max_num_batched_tokens=4096,
    )  # fmt: skip
    narrow = Engine(
        chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=64 << 20, prefix_cache=False,
        max_num_seqs=2, max_num_batched_tokens=16,
    )  # fmt: skip
    events = list(narrow.start(_request(prompt)))
    prefill = next(e for e in events if isinstance(e, PrefillEvent))
    assert prefill.prompt_tokens > 48 and len(prefill.chunks) == -(-prefill.prompt_tokens // 16)
    assert [c.tokens for c in prefill.chunks[:-1]] == [16] * (len(prefill.chunks) - 1)
    assert sum(c.tokens for c in prefill.chunks) == prefill.prompt_tokens
    assert events[-1].result.batch.prefill_chunks == len(prefill.chunks)
    whole = next(e for e in wide.start(_request(prompt)) if isinstance(e, PrefillEvent))
    assert len(whole.chunks) == 1
    assert events[-1].result.token_ids == next(
        e for e in wide.start(_request(prompt)) if isinstance(e, DoneEvent)
    ).result.token_ids


def test_the_cpu_default_budget_takes_a_prompt_whole_while_nothing_decodes(chatty_tiny_dir):
    """The default limits on the CPU: 80 rows a step beside a decoding sequence (56 where the products
    multiply float32 rows), a chunk's attention counted among them, and 2,048 tokens while none
    decodes (chunks there only cost); a budget given by name stays a hard cap on tokens alone."""
    from minengine.engine.step_loop import IDLE_TOKEN_BUDGET, default_limits, default_token_budget

    cpu = torch.device("cpu")
    rows = default_token_budget(cpu)
    # Without a cap, as many sequences as a step's token budget gives a token each (vLLM's 256 at most).
    assert default_limits(cpu, None, None) == BatchLimits(rows, rows, IDLE_TOKEN_BUDGET, attention_counted=True)
    assert default_limits(torch.device("cuda"), None, None) == BatchLimits(256, 2048, None)
    assert default_limits(cpu, None, 20) == BatchLimits(20, 20, None)
    assert default_limits(cpu, 8, None) == BatchLimits(8, rows, IDLE_TOKEN_BUDGET, attention_counted=True)
    assert default_limits(cpu, 8, 64) == BatchLimits(8, 64, None)
    assert default_limits(torch.device("cuda"), 8, None) == BatchLimits(8, 2048, None)
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=64 << 20, prefix_cache=False)
    long_prompt = "Describe step-free routes between the stations of Kyoto, " * 30  # far enough for chunks to shrink
    alone = next(e for e in engine.start(_request(long_prompt)) if isinstance(e, PrefillEvent))
    assert alone.prompt_tokens > 128 and len(alone.chunks) == 1  # nobody decoding: one step
    # Beside a request that decodes, the same prompt goes in chunks of the budget.
    # Unsteered, as a server runs it: the engine decodes it in every step without waiting for its
    # consumer thread, so the chunks share steps with it however busy the machine is.
    with _decoding_beside(engine, max_tokens=400):
        chunked = next(e for e in engine.start(_request(long_prompt)) if isinstance(e, PrefillEvent))
    # Each chunk beside the decoding row takes what the rest of the budget holds, its attention
    # over the positions before it counted, so the chunks shrink as the prompt goes on.
    cost, budget = ChunkCost.of_model(engine.model.cfg, engine.model.ops), engine.steps.limits.max_num_batched_tokens
    assert budget == rows
    beside_decoder = [c for c in chunked.chunks if c.step.decode_tokens == 1]
    assert len(beside_decoder) >= 3 and sum(c.tokens for c in chunked.chunks) == chunked.prompt_tokens
    for c in beside_decoder:
        left = chunked.prompt_tokens - c.start
        assert c.tokens == min(left, max(1, cost.tokens(c.start, left, budget - 1)))
        assert c.step.sequences == 2 and cost.rows(c.start, c.tokens) <= budget - 1 or c.tokens == 1
    sizes = [c.tokens for c in beside_decoder if c.tokens < chunked.prompt_tokens - c.start]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]


def test_the_cpu_budget_is_smaller_where_the_products_multiply_float32_rows(monkeypatch):
    """80 rows beside decoding sequences where the products round their rows (VNNI's integer tiles); 56
    where they multiply float32 rows, asked for here as a user asks (`REQSCOPE_ACTIVATIONS`) or where
    the CPU has no VNNI, since a plain decode step is then bound by the FMAs already; a GPU's 2,048."""
    from minengine.engine import step_loop
    from minengine.settings import ACTIVATIONS_ENV

    cpu = torch.device("cpu")
    monkeypatch.setenv(ACTIVATIONS_ENV, "float32")
    assert step_loop.default_token_budget(cpu) == step_loop.FLOAT_ROWS_TOKEN_BUDGET == 56
    assert step_loop.default_limits(cpu, None, None).max_num_batched_tokens == 56
    monkeypatch.setattr(step_loop, "activations", lambda: "int16")  # the rounded rows a VNNI CPU multiplies
    assert step_loop.default_token_budget(cpu) == step_loop.CPU_TOKEN_BUDGET == 80
    assert step_loop.default_token_budget(torch.device("cuda")) == 2048


def test_a_chunk_costs_its_rows_and_its_attention():
    """`ChunkCost` against its definition summed position by position, and the most tokens that fit."""
    cost = ChunkCost(keys_per_row=100.0)
    for start, n in [(0, 1), (0, 48), (37, 5), (3000, 12)]:
        assert cost.rows(start, n) == pytest.approx(sum(1 + (p + 1) / 100.0 for p in range(start, start + n)))
    for start, left, budget in [(0, 500, 48.0), (200, 500, 48.0), (3000, 500, 48.0), (0, 10, 48.0), (5000, 9, 3.5)]:
        n = cost.tokens(start, left, budget)
        assert n <= min(left, budget) and (n == 0 or cost.rows(start, n) <= budget)
        assert n == left or n == int(budget) or cost.rows(start, n + 1) > budget
    assert cost.tokens(0, 500, 48.0) > cost.tokens(200, 500, 48.0) > cost.tokens(3000, 500, 48.0)
    assert cost.tokens(10_000, 5, 48.0) == 0  # not even one fits: the step loop still gives its first chunk one
    # SmolLM2-135M's shape: about 900 positions weigh as one row's products.
    smol = ModelConfig(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
        max_position_embeddings=8192, tie_word_embeddings=True,
    )  # fmt: skip
    assert 850 < ChunkCost.of_model(smol).keys_per_row < 950


def test_a_held_request_is_out_of_the_batch_while_the_others_go_on(chatty_tiny_dir):
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=64 << 20, prefix_cache=False)
    held = engine.start(_request(PROMPTS[0]))
    it = iter(held)
    while not isinstance(next(it), StepReady):
        pass
    held.hold()  # a person looks at the step: it hands in no work
    other: list = []
    runner = threading.Thread(target=lambda: other.extend(engine.start(_request(PROMPTS[1]))))
    runner.start()
    runner.join(timeout=60)
    assert not runner.is_alive() and other[-1].result.finish_reason == "length"
    assert all(e.batch.sequences == 1 for e in other if isinstance(e, TokenEvent) and e.batch is not None)
    rest = list(it)
    alone = next(e for e in engine.start(_request(PROMPTS[0])) if isinstance(e, DoneEvent)).result
    assert rest[-1].result.token_ids == alone.token_ids


def test_a_request_cancelled_before_its_prompt_runs_ends_cancelled(chatty_tiny_dir):
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=64 << 20, max_num_batched_tokens=16)
    session = engine.start(_request("Describe the Philosopher's Path, " * 8))
    events = []
    for event in session:
        events.append(event)
        if isinstance(event, PrefixCacheEvent):
            session.cancel()
    result = events[-1].result
    assert result.finish_reason == "cancelled" and result.token_ids == ()
    assert not any(isinstance(e, PrefillEvent) for e in events)
    assert engine.scheduler.running == 0 and engine.steps.running == 0


@pytest.mark.parametrize(
    ("limits", "named"),
    [
        (dict(max_num_seqs=0), "--max-num-seqs"),
        (dict(max_num_batched_tokens=8), "--max-num-batched-tokens"),
        (dict(max_num_seqs=32, max_num_batched_tokens=16), "--max-num-batched-tokens"),
    ],
)
def test_limits_no_step_can_work_under_are_refused_by_name(chatty_tiny_dir, limits, named):
    with pytest.raises(RequestError) as caught:
        Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=64 << 20, **limits)
    assert named in error_text(caught.value) and "\n" not in error_text(caught.value)
    settings = {p.setting for p in caught.value.message.parts if isinstance(p, Mention)}
    assert settings & {Setting.MAX_NUM_SEQS, Setting.MAX_NUM_BATCHED_TOKENS}


def test_a_burst_starts_with_a_wave_beside_few_decoders_and_ends_within_its_tokens():
    """`Bursts`: a wave of prompts at least twice the decoding sequences runs first, prompts that
    arrive meanwhile join it, it ends when none waits or at its token bound, and a decode step
    always comes between two bursts; one long prompt beside streams is never one."""
    bursts = Bursts()
    assert bursts.members(["a"], decoding=16, max_tokens=100) == set()  # a long prompt beside streams
    assert bursts.members(["a", "b"], decoding=2, max_tokens=100) == set()  # not twice the decoders
    assert bursts.members(["a", "b"], decoding=0, max_tokens=100) == set()  # nothing decodes: the idle budget's
    assert bursts.members(["a", "b", "c"], decoding=1, max_tokens=100) == {"a", "b", "c"}
    bursts.ran(40)
    assert bursts.members(["b", "c", "d"], decoding=2, max_tokens=100) == {"b", "c", "d"}  # d arrived meanwhile
    bursts.ran(70)  # 110 tokens: past its bound
    assert bursts.members(["d", "e", "f", "g"], decoding=2, max_tokens=100) == set()  # the decoders' step
    assert bursts.members(["d", "e", "f", "g"], decoding=2, max_tokens=100) == {"d", "e", "f", "g"}
    bursts.ran(10)
    assert bursts.members([], decoding=6, max_tokens=100) == set()  # every prompt is in: this step decodes
    assert bursts.members(["h", "i"], decoding=1, max_tokens=100) == {"h", "i"}  # so the next wave may start
    bursts.ran(20)
    assert bursts.members(["h"], decoding=2, max_tokens=100) == {"h"}  # a burst goes on below twice the decoders
    assert bursts.stop() and not bursts.stop()  # its prompts found no room in the pool
    assert bursts.members(["h", "j", "k", "l"], decoding=2, max_tokens=100) == set()  # the decoders step first


def test_a_wave_beside_a_decoding_request_is_prefilled_first_and_keeps_its_tokens(chatty_tiny_dir):
    """Under the CPU's default limits a wave of prompts arriving beside one decoding request runs
    in prefill-only steps, several prompts a step, and every request's tokens are its solo run's."""
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=64 << 20, prefix_cache=False)
    wave = [f"{p} Describe step-free routes between the stations of Kyoto." for p in PROMPTS * 2]
    alone = [next(e for e in engine.start(_request(p)) if isinstance(e, DoneEvent)).result for p in wave]
    with _decoding_beside(engine, max_tokens=2000):
        together = run_all(engine, [_request(p) for p in wave], steered=False)
    assert [e[-1].result.token_ids for e in together] == [r.token_ids for r in alone]
    chunks = [c for e in together for p in e if isinstance(p, PrefillEvent) for c in p.chunks]
    # The decoding request never leaves, so a step without its row can only be a burst's.
    burst = [c for c in chunks if c.step.decode_tokens == 0]
    assert burst and any(c.step.sequences >= 2 for c in burst)
    assert all(c.tokens == c.step.prefill_tokens or c.step.sequences >= 2 for c in burst)
