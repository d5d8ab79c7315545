"""The reference model is the oracle: it equals transformers, and every fast path is held against it.

`minengine/reference/model.py` is plain PyTorch over dense weights. Here it is first held to
Hugging Face transformers on every tiny family, then each of the engine's step paths and weight
formats is run beside it on the same tokens: prefill (`torch general`), a lone decode step (the
C stack, the Python eager step, the static step), and shared steps of several sequences (the C
stack over rows, the Python blocks over rows, a prompt chunk among decode rows).

Tolerances, on float32 logits or on the KL of next-token distributions (nats):
- float32 weights (dense or panels): logits within 1e-4 absolute: the same arithmetic, summed
  in another order;
- fp16 panels against the reference over the same fp16-rounded weights: within 1e-4 as well;
- q8_0 and q4_1 blocks (rows rounded to int16 or int8 where the CPU has VNNI, or float32, each
  mode run) and torch's packed bf16 / int8 against the plain reference: KL per position under
  `BLOCK_KL`, the formats' own rounding of the weights.

No fast path promises the reference's bits (each sums in its own order). The promises the fast
paths make of each other are held bit for bit where they are made: the eager step against the
general path and the C stack against the Python blocks (test_decode_step, test_decode_stack),
pooled rows against each row alone (test_pooled_rows), a batch against its rows alone
(test_batching).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import SPECS

from minengine.config import ModelConfig
from minengine.fast.cpu_kernels import library
from minengine.fast.linear_kernels import available
from minengine.fast.panel_kernels import ACTIVATIONS_ENV, activations
from minengine.kv.block_pool import BlockPool
from minengine.kv.paged_cache import PagedKVCache
from minengine.reference.generate import generate, sample
from minengine.reference.model import ReferenceModel
from minengine.sampling.params import SamplingParams
from minengine.sampling.sampler import Sampler
from minengine.steps.load import load_model
from minengine.steps.model_runner import ModelRunner
from minengine.steps.rows import Row
from minengine.steps.step_path import StepPath
from minengine.text.chat_template import Message

CPU = torch.device("cpu")
PROMPT = 11
DECODE = 6
NAMES = [s.name for s in SPECS]
FLOAT32_ATOL = 1e-4
BLOCK_KL = {"q8_0": 1e-3, "q4_1": 6e-2, "bf16": 2e-3, "int8": 5e-2}
PANEL_FORMATS = ["float32-panels", "fp16-panels", "q8_0", "q4_1"] if library().lib is not None else []
TORCH_PACKED = [f for f in ("bf16", "int8") if available(f).ok]
FORMATS = [None, *PANEL_FORMATS, *TORCH_PACKED]  # None: dense float32 operands


def _prompt(cfg: ModelConfig, n: int = PROMPT, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def _kl(ref: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    return F.kl_div(F.log_softmax(other, -1), F.log_softmax(ref, -1), log_target=True, reduction="none").sum(-1)


def _reference(folder, packs: str | None) -> ReferenceModel:
    """The reference over the weights the format holds where that is exact (fp16), else as stored."""
    model = ReferenceModel.load(folder)
    if packs == "fp16-panels":
        for layer in model.layers:
            for name in ("q", "k", "v", "o", "gate", "up", "down"):
                setattr(layer, name, getattr(layer, name).half().float())
        model.head = model.head.half().float()
        if model.cfg.tie_word_embeddings:  # a tied embedding is looked up in the head's fp16 panels
            model.embed = model.head
    return model


def _close(packs: str | None, ours: torch.Tensor, ref: torch.Tensor) -> None:
    if packs in BLOCK_KL:
        kl = _kl(ref, ours).max()
        assert kl < BLOCK_KL[packs], f"{packs}: KL {kl:.2e}"
    else:
        err = (ours - ref).abs().max()
        assert err < FLOAT32_ATOL, f"{packs or 'dense'}: {err:.2e}"


def _reference_steps(model: ReferenceModel, ids: torch.Tensor, tokens: list[int]) -> list[torch.Tensor]:
    """The reference's logits after the prompt and after each of `tokens` fed in turn."""
    cache = model.new_cache()
    out = [model.forward(ids, 0, cache)]
    for i, t in enumerate(tokens):
        out.append(model.forward(torch.tensor([t]), len(ids) + i, cache))
    return out


def _prefilled(runner: ModelRunner, cfg: ModelConfig, pool: BlockPool, lengths: tuple[int, ...]):
    """One paged cache per prompt length in `pool`, each prompt prefilled: (prompts, caches, first tokens)."""
    prompts = [_prompt(cfg, n, seed=n) for n in lengths]
    caches = [PagedKVCache(pool, cfg, owner=f"r{n}-{i}", device=CPU, compute_dtype=torch.float32, expect_tokens=40)
              for i, n in enumerate(lengths)]  # fmt: skip
    tokens = [int(runner.forward(prompt, 0, cache).argmax()) for prompt, cache in zip(prompts, caches, strict=True)]
    return prompts, caches, tokens


# -- the reference against transformers ---------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_reference_equals_transformers(tiny_models, name):
    """Every position's logits within 1e-4, and greedy decode token for token with `generate`."""
    folder, hf = tiny_models[name]
    model = ReferenceModel.load(folder)
    ids = _prompt(model.cfg)
    ours = model.forward(ids, 0, model.new_cache(), all_logits=True)
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0].float()
    assert (ours - theirs).abs().max() < FLOAT32_ATOL
    want = hf.generate(ids[None], max_new_tokens=DECODE, do_sample=False, eos_token_id=None, pad_token_id=0)
    cache, tokens = model.new_cache(), []
    logits = model.forward(ids, 0, cache)
    for pos in range(PROMPT, PROMPT + DECODE):
        tokens.append(int(logits.argmax()))
        logits = model.forward(torch.tensor([tokens[-1]]), pos, cache)
    assert tokens == want[0, PROMPT:].tolist()


def test_the_loop_streams_the_greedy_answer(chatty_tiny_dir):
    """`generate` runs outside the engine: template, prefill, greedy steps, the text growing with each."""
    from minengine.text.tokenizer import ModelTokenizer

    model, tok = ReferenceModel.load(chatty_tiny_dir), ModelTokenizer(chatty_tiny_dir)
    steps = list(generate(model, tok, "Hello", max_tokens=5))
    assert 0 < len(steps) <= 5
    ids = tok.encode(tok.render([Message("user", "Hello")]))
    expected = _reference_steps(model, torch.tensor(ids), [s.token for s in steps[:-1]])
    assert [s.token for s in steps] == [int(x.argmax()) for x in expected]
    assert steps[-1].text == tok.decode([s.token for s in steps])


# -- the reference sampler against the engine's ------------------------------------------------

# (temperature, top_k, top_p): greedy, each filter alone, and together.
SAMPLING = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 40, 1.0), (0.8, 0, 0.9), (1.3, 50, 0.8), (0.6, 5, 0.5)]
SEEDS = (0, 1, 2, 12345, 2**40)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SAMPLING)
def test_the_reference_sampler_draws_the_engines_tokens(temperature, top_k, top_p):
    """For the same seed and parameters, `sample` draws the token the engine's `Sampler` draws, step
    after step (each consumes one uniform per sampled token, none when greedy), over a 49,152-entry
    vocabulary (the engine's top-p then decides without sorting it)."""
    rows = torch.randn(12, 49_152, generator=torch.Generator().manual_seed(7)) * 3
    drawn = set()
    for seed in SEEDS:
        engine = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed))
        generator = torch.Generator().manual_seed(seed)
        ours = [sample(row, temperature, top_k, top_p, generator) for row in rows]
        assert ours == [engine.sample(row) for row in rows], f"seed {seed}"
        drawn.update(enumerate(ours))
    greedy = {(i, int(row.argmax())) for i, row in enumerate(rows)}
    assert drawn == greedy if temperature == 0 else len(drawn) > len(rows)  # else the seeds drew apart


def test_the_reference_loop_samples_as_the_engine_under_the_reference_kernels(chatty_tiny_dir):
    """`generate` with a temperature, top-k, top-p and seed gives the tokens the engine gives for the
    same request under `--kernels reference` (the same logits, the same draws)."""
    from minengine.engine.engine import Engine
    from minengine.engine.events import DoneEvent
    from minengine.engine.request import GenerationRequest
    from minengine.text.tokenizer import ModelTokenizer

    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kernels="reference", kv_budget_bytes=64 << 20)
    model, tok = ReferenceModel.load(chatty_tiny_dir), ModelTokenizer(chatty_tiny_dir)
    answers = set()
    for seed, (temperature, top_k, top_p) in zip(SEEDS, SAMPLING[1:], strict=False):
        knobs = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}
        ours = [s.token for s in generate(model, tok, "Hello", max_tokens=12, **knobs)]
        request = GenerationRequest.from_prompt("Hello", sampling=SamplingParams(**knobs), max_tokens=12, trace=False)
        done = next(e for e in engine.generate(request) if isinstance(e, DoneEvent))
        assert ours == list(done.result.token_ids), knobs
        answers.add(tuple(ours))
    assert len(answers) > 1  # the knobs and seeds steer the answer, or the equality above proves little


# -- every fast path against the reference -----------------------------------------------------


@pytest.mark.parametrize("packs", FORMATS)
@pytest.mark.parametrize("name", NAMES)
def test_one_sequence_paths_match_the_reference(tiny_models, name, packs):
    """Prefill, then the lean decode step (the C stack where it serves, else the Python eager step),
    the static step run eagerly, and the general path, each step's logits against the reference."""
    folder, _ = tiny_models[name]
    cfg = ModelConfig.from_file(folder)
    model = load_model(folder, cfg, torch.float32, CPU, packs=packs)
    ref = _reference(folder, packs)
    ids = _prompt(cfg)
    prefill = ModelRunner(model, static_decode=False).forward(ids, 0, model_cache(cfg), all_logits=True)
    _close(packs, prefill, ref.forward(ids, 0, ref.new_cache(), all_logits=True))
    static = ModelRunner(model)
    static.use_static_decode(True, capture=False)
    for runner, cache in ((ModelRunner(model, static_decode=False), model_cache(cfg)), (static, None)):
        cache = cache or runner.new_cache(PROMPT + DECODE)
        logits, tokens, paths = runner.forward(ids, 0, cache), [], set()
        for pos in range(PROMPT, PROMPT + DECODE):
            tokens.append(int(logits.argmax()))
            logits = runner.forward(torch.tensor([tokens[-1]]), pos, cache)
            paths.add(runner.last_path.name)
        expected = _reference_steps(ref, ids, tokens)
        _close(packs, logits, expected[-1])
        assert len(paths) == 1
    assert paths == {"static eager"}


def model_cache(cfg: ModelConfig):
    from minengine.kv.cache import KVCache

    return KVCache(cfg, PROMPT + DECODE, device=CPU, compute_dtype=torch.float32)


@pytest.mark.parametrize(("name", "packs", "path"), [
    ("llama-gqa", None, "torch eager"),
    ("qwen2", "float32-panels", "torch eager"),  # q/k/v bias: not the C stack's shape
    *([("llama-gqa", "float32-panels", "c-stack float32×float32"), ("llama-mha-tied", "q4_1", "c-stack")]
      if PANEL_FORMATS else []),
])  # fmt: skip
def test_the_runner_names_the_path_it_took(tiny_models, name, packs, path):
    folder, _ = tiny_models[name]
    cfg = ModelConfig.from_file(folder)
    runner = ModelRunner(load_model(folder, cfg, torch.float32, CPU, packs=packs), static_decode=False)
    cache = model_cache(cfg)
    runner.forward(_prompt(cfg), 0, cache)
    # the prompt: in one C call where every projection reads a DOT8 copy (q4_1's, under int16 or int8 rows)
    prompt = "c-stack prompt" if packs == "q4_1" and activations() != "float32" else "torch general"
    assert runner.last_path.name.startswith(prompt)
    runner.forward(torch.tensor([5]), PROMPT, cache)
    assert runner.last_path.name.startswith(path)
    assert runner.last_path.why


@pytest.mark.parametrize("packs", FORMATS)
@pytest.mark.parametrize("name", ["llama-gqa", "qwen2", "qwen3", "llama-mqa"])
def test_shared_steps_match_the_reference(tiny_models, name, packs):
    """Three sequences' decode rows in one step, then the same beside a prompt chunk: each row's
    logits against the reference run over that sequence alone."""
    folder, _ = tiny_models[name]
    cfg = ModelConfig.from_file(folder)
    runner = ModelRunner(load_model(folder, cfg, torch.float32, CPU, packs=packs), static_decode=False)
    ref = _reference(folder, packs)
    pool = BlockPool(64 << 20, CPU)
    prompts, caches, tokens = _prefilled(runner, cfg, pool, (5, 11, 18))
    rows = [Row((t,), len(p), c, True) for p, t, c in zip(prompts, tokens, caches, strict=True)]
    decoded = runner.forward_rows(rows)
    assert runner.last_path.name.startswith(("c-stack rows", "torch rows"))
    for p, t, logits in zip(prompts, tokens, decoded, strict=True):
        _close(packs, logits, _reference_steps(ref, p, [t])[-1])
    # Decode rows beside a new sequence's prompt chunk: the Python blocks over the stacked rows, or
    # (where the C stack serves the decode rows) the stack, then the chunk on its own.
    chunk = _prompt(cfg, 7, seed=99)
    fresh = PagedKVCache(pool, cfg, owner="chunk", device=CPU, compute_dtype=torch.float32, expect_tokens=20)
    nxt = [int(x.argmax()) for x in decoded]
    rows = [Row((t,), len(p) + 1, c, True) for p, t, c in zip(prompts, nxt, caches, strict=True)]
    out = runner.forward_rows([*rows, Row(tuple(chunk.tolist()), 0, fresh, True)])
    assert runner.last_path.name == "torch rows" or runner.last_path.name.endswith((" + torch chunks",
                                                                                    " + c-stack prompt"))
    for p, t, n, logits in zip(prompts, tokens, nxt, out[:-1], strict=True):
        _close(packs, logits, _reference_steps(ref, p, [t, n])[-1])
    _close(packs, out[-1], ref.forward(chunk, 0, ref.new_cache()))


@pytest.mark.skipif(not PANEL_FORMATS or not library().lib.dot8_native(), reason="rounded rows need AVX-512 VNNI")
@pytest.mark.parametrize("activation", ["int16", "int8", "float32"])
@pytest.mark.parametrize("packs", ["q8_0", "q4_1"])
def test_each_activation_mode_matches_the_reference(tiny_models, monkeypatch, packs, activation):
    """The block formats' rows rounded to int16 or int8, or kept float32: the lone C stack and the
    C stack over rows, each named with its activations, within the format's bound of the reference."""
    monkeypatch.setenv(ACTIVATIONS_ENV, activation)
    folder, _ = tiny_models["llama-gqa"]
    cfg = ModelConfig.from_file(folder)
    runner = ModelRunner(load_model(folder, cfg, torch.float32, CPU, packs=packs), static_decode=False)
    ref = _reference(folder, packs)
    pool = BlockPool(64 << 20, CPU)
    prompts, caches, tokens = _prefilled(runner, cfg, pool, (6, 13))
    alone = runner.forward(torch.tensor([tokens[0]]), len(prompts[0]), caches[0])
    assert runner.last_path.name == f"c-stack {activation}×{packs}"
    _close(packs, alone, _reference_steps(ref, prompts[0], tokens[:1])[-1])
    nxt = [int(alone.argmax()), tokens[1]]
    rows = [Row((nxt[0],), len(prompts[0]) + 1, caches[0], True), Row((nxt[1],), len(prompts[1]), caches[1], True)]
    out = runner.forward_rows(rows)
    assert runner.last_path.name == f"c-stack rows {activation}×{packs}"
    _close(packs, out[0], _reference_steps(ref, prompts[0], [tokens[0], nxt[0]])[-1])
    _close(packs, out[1], _reference_steps(ref, prompts[1], [tokens[1]])[-1])


@pytest.mark.skipif(not PANEL_FORMATS, reason="the C stack needs the C kernels")
def test_the_runner_picks_a_shared_steps_path_and_says_why(tiny_models):
    """Decode rows in one pool segment go through the C stack over rows; a prompt chunk among them,
    or rows whose weights the stack does not serve, through the Python blocks; each with its reason."""
    folder, _ = tiny_models["llama-gqa"]
    cfg = ModelConfig.from_file(folder)
    pool = BlockPool(64 << 20, CPU)

    def rows_of(runner: ModelRunner) -> list[Row]:
        caches = [PagedKVCache(pool, cfg, owner=f"{id(runner)}-{i}", device=CPU, compute_dtype=torch.float32,
                               expect_tokens=30) for i in range(3)]  # fmt: skip
        for i, cache in enumerate(caches):
            runner.forward(_prompt(cfg, 5 + i, seed=i), 0, cache)
        return [Row((7,), 5 + i, cache, True) for i, cache in enumerate(caches)]

    panels = ModelRunner(load_model(folder, cfg, torch.float32, CPU, packs="float32-panels"), static_decode=False)
    rows = rows_of(panels)
    assert panels.pick_rows(rows).path.name == "c-stack rows float32×float32"
    panels.forward_rows(rows)
    assert panels.last_path.name == "c-stack rows float32×float32" and "3 decode rows" in panels.last_path.why
    chunk = Row((3, 4, 5), 0, PagedKVCache(pool, cfg, owner="chunk", device=CPU, compute_dtype=torch.float32), True)
    assert panels.pick_rows([*rows[:2], chunk]).path.name == "c-stack rows float32×float32 + torch chunks"
    assert panels.pick_rows([rows[0], chunk]).path.why == "2 rows with a prompt chunk among them (C row ops)"
    dense = ModelRunner(load_model(folder, cfg, torch.float32, CPU), static_decode=False)
    dense.forward_rows(rows_of(dense))
    assert dense.last_path == StepPath("torch rows", "3 decode rows; no C stack for float32 weights on cpu (C row ops)")


@pytest.mark.skipif(not PANEL_FORMATS, reason="the C stack needs the C kernels")
@pytest.mark.parametrize("packs", ["float32-panels", "q4_1"])
def test_a_step_of_decode_rows_and_a_prompt_chunk_runs_in_two_passes_with_the_same_bits(tiny_models, packs):
    """The decode rows through the C stack over rows, then the chunk through the C prompt stack (rounded rows)
    or the Python blocks: each row's logits are the bits of the one pass over all of them, and near the
    reference's."""
    from minengine.steps.shared_step import forward_rows

    folder, _ = tiny_models["llama-gqa"]
    cfg = ModelConfig.from_file(folder)
    runner = ModelRunner(load_model(folder, cfg, torch.float32, CPU, packs=packs), static_decode=False)
    ref = _reference(folder, packs)
    pool = BlockPool(64 << 20, CPU)
    prompts, caches, tokens = _prefilled(runner, cfg, pool, (5, 9, 14))
    chunk = _prompt(cfg, 6, seed=42)
    fresh = PagedKVCache(pool, cfg, owner="chunk", device=CPU, compute_dtype=torch.float32, expect_tokens=10)
    rows = [Row((t,), len(p), c, True) for p, t, c in zip(prompts, tokens, caches, strict=True)]
    rows.insert(1, Row(tuple(chunk.tolist()), 0, fresh, True))
    split = runner.forward_rows(rows)
    second = "c-stack prompt" if runner._prompt is not None else "torch chunks"  # the prompt stack: DOT8 weights
    assert runner.last_path.name == f"c-stack rows {runner._label} + {second}"
    joint = forward_rows(runner.model, rows)  # the Python blocks, the same positions again: the same K/V written
    assert all(torch.equal(a, b) for a, b in zip(split, joint, strict=True))
    for p, t, logits in zip(prompts, tokens, [split[0], *split[2:]], strict=True):
        _close(packs, logits, _reference_steps(ref, p, [t])[-1])
    _close(packs, split[1], ref.forward(chunk, 0, ref.new_cache()))
