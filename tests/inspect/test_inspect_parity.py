"""Attention weights and the logit lens of a step, against transformers on tiny models of every family.

The reference is transformers' own: `output_attentions=True` under eager attention for the
weights of the step's query over every earlier position, `output_hidden_states=True` passed
through the model's final norm and `lm_head` for the lens (its last hidden state is already
normed). Tolerances, float32 on the CPU: weights 1e-5 absolute; lens probabilities 1e-5
absolute; with FP8 K/V the weights come from the dequantized keys, 0.02 absolute (measured: 0.004).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import SPECS

from minengine.config import ModelConfig
from minengine.inspect.ask import InspectAsk
from minengine.inspect.capture import _observer
from minengine.inspect.held_step import recompute_step
from minengine.inspect.summary import attention_record, lens_record
from minengine.kv.cache import KVCache
from minengine.steps.load import load_model
from minengine.steps.model_runner import ModelRunner
from minengine.steps.rows import Row

CPU = torch.device("cpu")
PROMPT_LEN, STEPS = 12, 8
OBSERVED = (0, 3, 7)  # decode steps after prefill whose query is checked
WEIGHTS_ATOL, LENS_ATOL, FP8_ATOL = 1e-5, 1e-5, 0.02
ASK = InspectAsk(attention_top=4, strip=True, lens="vocab")


def _runner(folder) -> tuple[ModelConfig, ModelRunner]:
    cfg = ModelConfig.from_file(folder)
    return cfg, ModelRunner(load_model(folder, cfg, torch.float32, CPU))


def _hf_eager(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")


def _observed_run(runner, cfg, layout="gqa", storage=None, *, neighbour=False):
    """Greedy decode STEPS tokens after a prompt; the observers of the OBSERVED steps, and all ids fed.

    `neighbour`: every step shares its forward with a second sequence's row (a batch)."""
    ids = torch.randint(3, cfg.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))
    cache = KVCache(cfg, PROMPT_LEN + STEPS + 1, device=CPU, compute_dtype=torch.float32, layout=layout,
                    storage_dtype=storage)  # fmt: skip
    other = KVCache(cfg, PROMPT_LEN + STEPS + 1, device=CPU, compute_dtype=torch.float32)
    logits = runner.forward(ids, 0, cache)
    if neighbour:
        runner.forward(ids.flip(0), 0, other)
    fed, observers = ids.tolist(), {}
    for step in range(STEPS):
        token, pos = int(logits.argmax()), len(fed)
        fed.append(token)
        obs = _observer(runner.model, ASK) if step in OBSERVED else None
        rows = [Row((token,), pos, cache, True, obs)]
        if neighbour:
            rows.append(Row((token,), pos, other, True))
        logits = runner.forward_rows(rows)[0]
        if obs is not None:
            observers[step] = (obs, logits)
    return fed, observers


def _reference(hf, fed: list[int]):
    with torch.no_grad():
        out = hf(torch.tensor([fed]), output_attentions=True, output_hidden_states=True)
    return out.attentions, out.hidden_states


def _weights_match(obs, attentions, pos, atol):
    for layer, ours in enumerate(obs.weights):
        theirs = attentions[layer][0, :, pos, : pos + 1]
        assert ours.shape == theirs.shape
        assert torch.allclose(ours, theirs, atol=atol, rtol=0), (layer, (ours - theirs).abs().max())


@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_attention_weights_match_transformers_eager(tiny_models, name):
    folder, _ = tiny_models[name]
    cfg, runner = _runner(folder)
    fed, observers = _observed_run(runner, cfg)
    attentions, _ = _reference(_hf_eager(folder), fed)
    for step, (obs, _) in observers.items():
        _weights_match(obs, attentions, PROMPT_LEN + step, WEIGHTS_ATOL)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3"])
def test_mha_layout_and_a_batch_row_give_the_same_weights(tiny_models, name):
    folder, _ = tiny_models[name]
    cfg, runner = _runner(folder)
    attentions, _ = _reference(_hf_eager(folder), _observed_run(runner, cfg)[0])
    for layout, neighbour in (("mha", False), ("gqa", True)):
        _, observers = _observed_run(runner, cfg, layout, neighbour=neighbour)
        for step, (obs, _) in observers.items():
            _weights_match(obs, attentions, PROMPT_LEN + step, WEIGHTS_ATOL)
            assert obs.kv_heads == (cfg.num_attention_heads if layout == "mha" else cfg.num_key_value_heads)


@pytest.mark.parametrize("name", ["llama-gqa", "llama-mha-tied"])
def test_fp8_kv_weights_are_the_dequantized_keys(tiny_models, name):
    folder, _ = tiny_models[name]
    cfg, runner = _runner(folder)
    fed, observers = _observed_run(runner, cfg, storage=torch.float8_e4m3fn)
    attentions, _ = _reference(_hf_eager(folder), fed)
    for step, (obs, _) in observers.items():
        _weights_match(obs, attentions, PROMPT_LEN + step, FP8_ATOL)


@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_logit_lens_matches_transformers_hidden_states(tiny_models, name):
    folder, _ = tiny_models[name]
    cfg, runner = _runner(folder)
    fed, observers = _observed_run(runner, cfg)
    hf = _hf_eager(folder)
    _, hidden = _reference(hf, fed)
    last = cfg.num_hidden_layers - 1
    for step, (obs, logits) in observers.items():
        pos = PROMPT_LEN + step
        chosen = fed[pos + 1] if pos + 1 < len(fed) else int(logits.argmax())
        lens = lens_record(runner.model, obs.residuals, logits, chosen, ASK, str)
        with torch.no_grad():
            # hidden_states[i + 1] is block i's output; the last one is already through the norm.
            normed = [hf.model.norm(hidden[i + 1][0, pos]) for i in range(last)] + [hidden[-1][0, pos]]
            probs = hf.lm_head(torch.stack(normed)).softmax(-1)
        for i, layer in enumerate(lens.layers):
            assert layer.top_token == int(probs[i].argmax())
            assert abs(layer.top_prob - float(probs[i].max())) < LENS_ATOL
            assert abs(layer.chosen_prob - float(probs[i, chosen])) < LENS_ATOL
            assert layer.chosen_rank == int((probs[i] > probs[i, chosen]).sum()) + 1
        assert lens.layers[-1].chosen_rank == 1  # greedy: the last layer's guess is the token chosen


def test_candidate_lens_ranks_within_the_candidates(tiny_models):
    folder, _ = tiny_models["llama-gqa"]
    cfg, runner = _runner(folder)
    _, observers = _observed_run(runner, cfg)
    obs, logits = observers[0]
    chosen = int(logits.argmax())
    full = lens_record(runner.model, obs.residuals, logits, chosen, ASK, str)
    ask = InspectAsk(lens="candidates", lens_candidates=5)
    cheap = lens_record(runner.model, obs.residuals, logits, chosen, ask, str)
    assert cheap.basis == "candidates" and cheap.candidates == 5 and full.candidates == cfg.vocab_size
    for a, b in zip(cheap.layers, full.layers, strict=True):
        assert a.chosen_rank <= b.chosen_rank and a.chosen_prob >= b.chosen_prob - 1e-6


def test_a_held_step_recomputed_gives_its_weights_and_writes_nothing(tiny_models):
    folder, _ = tiny_models["qwen3"]
    cfg, runner = _runner(folder)
    fed, observers = _observed_run(runner, cfg)
    # Run again to where step 3 has just run, then recompute it reading the cache.
    cache = KVCache(cfg, PROMPT_LEN + STEPS + 1, device=CPU, compute_dtype=torch.float32)
    pos = PROMPT_LEN + 3
    logits = runner.forward(torch.tensor(fed[: pos + 1]), 0, cache)
    before = cache.read_span(0, pos + 1)
    obs = _observer(runner.model, ASK)
    again = recompute_step(runner.model, cache, fed[pos], pos, obs)
    after = cache.read_span(0, pos + 1)
    assert torch.equal(before.keys, after.keys) and torch.equal(before.values, after.values)
    assert torch.allclose(again, logits, atol=1e-5, rtol=0)
    for ours, theirs in zip(obs.weights, observers[3][0].weights, strict=True):
        assert torch.allclose(ours, theirs, atol=WEIGHTS_ATOL, rtol=0)


def test_attention_record_ranks_and_groups(tiny_models):
    folder, _ = tiny_models["llama-gqa"]
    cfg, runner = _runner(folder)
    _, observers = _observed_run(runner, cfg)
    obs, _ = observers[7]
    record = attention_record(obs.weights, obs.kv_heads, ASK, "gqa")
    assert record.context == PROMPT_LEN + 8 and record.query_position == PROMPT_LEN + 7
    assert record.group_size == cfg.num_attention_heads // cfg.num_key_value_heads
    for layer, w in zip(record.layers, obs.weights, strict=True):
        assert [h.kv_head for h in layer.heads] == [h // record.group_size for h in range(cfg.num_attention_heads)]
        for head in layer.heads:
            row = w[head.head]
            assert [a.position for a in head.top] == row.topk(4).indices.tolist()
            assert head.entropy == pytest.approx(float(-(row * row.log()).sum()), abs=1e-5)
        assert sum(layer.strip.weights) == pytest.approx(1.0, abs=1e-5) and layer.strip.bucket == 1
        assert [a.position for a in layer.mean_top] == w.mean(0).topk(4).indices.tolist()
