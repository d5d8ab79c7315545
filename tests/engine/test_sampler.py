"""The sampler chain: stage semantics, engine orders, HF parity, draws and traces."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.utils import GenerationMixin

from minengine.errors import RequestError
from minengine.sampling.chain import filter_logits
from minengine.sampling.params import (
    HF_ORDER,
    LLAMA_CPP_ORDER,
    NAMED_ORDERS,
    SAMPLER_STAGES,
    VLLM_ORDER,
    SamplingParams,
)
from minengine.sampling.sampler import Sampler
from minengine.sampling.trace import explain, explain_candidates

NEG_INF = float("-inf")


def logits_of(*probs: float) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


def piece(token_id: int) -> str:
    return f"<{token_id}>"


def kept_ids(params: SamplingParams, logits: torch.Tensor) -> set[int]:
    filtered, _ = filter_logits(logits, params)
    return set(torch.nonzero(filtered > NEG_INF).flatten().tolist())


def dropped_by(params: SamplingParams, logits: torch.Tensor) -> list[str | None]:
    _, codes = filter_logits(logits, params)
    return [SAMPLER_STAGES[c] if c >= 0 else None for c in codes.tolist()]


def hf_filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """transformers' own warpers, in generate()'s order, on one row."""
    warpers = []
    if params.temperature != 1:
        warpers.append(TemperatureLogitsWarper(float(params.temperature)))
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p:
        warpers.append(MinPLogitsWarper(params.min_p))
    scores, ids = logits.unsqueeze(0), torch.zeros((1, 1), dtype=torch.long)
    for warp in warpers:
        scores = warp(ids, scores)
    return scores[0]


def llm_like(vocab: int, seed: int) -> torch.Tensor:
    """A broad bulk plus a few strong candidates, like a language model's last-position logits."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=g) * 2.0
    spikes = torch.randperm(vocab, generator=g)[:30]
    logits[spikes] += torch.linspace(16.0, 6.0, 30)
    return logits


# -- orders --------------------------------------------------------------------------------------


def test_hf_order_matches_installed_transformers():
    source = inspect.getsource(GenerationMixin._get_logits_processor)
    warper = {
        "temperature": "TemperatureLogitsWarper(",
        "top_k": "TopKLogitsWarper(",
        "top_p": "TopPLogitsWarper(",
        "min_p": "MinPLogitsWarper(",
    }
    assert tuple(sorted(SAMPLER_STAGES, key=lambda s: source.index(warper[s]))) == HF_ORDER


def test_named_orders():
    assert NAMED_ORDERS == {"hf": HF_ORDER, "llama.cpp": LLAMA_CPP_ORDER, "vllm": VLLM_ORDER}
    assert LLAMA_CPP_ORDER[-1] == "temperature"
    assert VLLM_ORDER == ("temperature", "min_p", "top_k", "top_p")


# -- each stage by hand ------------------------------------------------------------------------


@pytest.mark.parametrize("order", list(NAMED_ORDERS.values()))
def test_temperature_only_scales(order):
    logits = torch.tensor([2.0, -1.0, 0.5])
    filtered, codes = filter_logits(logits, SamplingParams(temperature=2.0, order=order))
    assert torch.equal(filtered, logits / 2.0)
    assert codes.tolist() == [-1, -1, -1]


@pytest.mark.parametrize("order", list(NAMED_ORDERS.values()))
def test_top_k_keeps_ties_with_the_kth(order):
    logits = torch.tensor([3.0, 1.0, 2.0, 0.0, 2.0])
    assert kept_ids(SamplingParams(top_k=2, order=order), logits) == {0, 2, 4}
    assert kept_ids(SamplingParams(top_k=1, order=order), logits) == {0}
    assert dropped_by(SamplingParams(top_k=1, order=order), logits) == [None, "top_k", "top_k", "top_k", "top_k"]


@pytest.mark.parametrize("order", list(NAMED_ORDERS.values()))
def test_top_p_keeps_tokens_until_the_mass_is_reached(order):
    # mass above each token: 0, 0.5, 0.8, 0.92
    logits = logits_of(0.5, 0.3, 0.12, 0.08)
    assert kept_ids(SamplingParams(top_p=0.45, order=order), logits) == {0}
    assert kept_ids(SamplingParams(top_p=0.75, order=order), logits) == {0, 1}
    assert kept_ids(SamplingParams(top_p=0.85, order=order), logits) == {0, 1, 2}
    assert kept_ids(SamplingParams(top_p=1e-9, order=order), logits) == {0}  # never empty


def test_top_p_cut_at_exactly_one_minus_p_drops_the_token():
    # Ascending cumulative 0.25, 0.5, 0.75, 1: HF drops where it is <= 1 - top_p = 0.5.
    logits = torch.zeros(4)
    params = SamplingParams(top_p=0.5)
    assert len(kept_ids(params, logits)) == 2
    assert torch.equal(filter_logits(logits, params)[0], hf_filter(logits, params))


@pytest.mark.parametrize("order", list(NAMED_ORDERS.values()))
def test_min_p_scales_with_the_top_probability(order):
    logits = logits_of(0.5, 0.3, 0.15, 0.05)  # threshold 0.2 * 0.5 = 0.1
    assert kept_ids(SamplingParams(min_p=0.2, order=order), logits) == {0, 1, 2}
    assert dropped_by(SamplingParams(min_p=0.2, order=order), logits)[3] == "min_p"


def test_temperature_placement_changes_top_p():
    # p = [0.6, 0.3, 0.1]. At T=0.5 the scaled distribution is [0.783, 0.196, 0.022], whose
    # top-0.7 nucleus is token 0 alone; llama.cpp cuts before scaling: 0.6 < 0.7 keeps token 1.
    logits = logits_of(0.6, 0.3, 0.1)
    params = SamplingParams(temperature=0.5, top_p=0.7)
    assert kept_ids(params, logits) == {0}
    assert kept_ids(params.with_(order=VLLM_ORDER), logits) == {0}
    assert kept_ids(params.with_(order=LLAMA_CPP_ORDER), logits) == {0, 1}


def test_min_p_before_top_p_changes_the_nucleus():
    # p = [0.5, 0.3, 0.1, 0.1], min_p 0.25 (threshold 0.125), top_p 0.6.
    # HF: top_p first keeps {0, 1} (mass above token 1 is 0.5 < 0.6); min_p keeps both.
    # vLLM: min_p first drops 2 and 3, renormalising to [0.625, 0.375]; now the mass above
    # token 1 is 0.625 >= 0.6, so top_p drops it too.
    logits = logits_of(0.5, 0.3, 0.1, 0.1)
    params = SamplingParams(top_p=0.6, min_p=0.25)
    assert kept_ids(params, logits) == {0, 1}
    assert dropped_by(params, logits) == [None, None, "top_p", "top_p"]
    assert kept_ids(params.with_(order=LLAMA_CPP_ORDER), logits) == {0, 1}
    vllm = params.with_(order=VLLM_ORDER)
    assert kept_ids(vllm, logits) == {0}
    assert dropped_by(vllm, logits) == [None, "top_p", "min_p", "min_p"]


def test_top_k_then_top_p_renormalises_first():
    # p = [0.4, 0.3, 0.2, 0.1]; top_k 2 leaves [4/7, 3/7]; top_p 0.5 then keeps token 0 only,
    # while top_p 0.5 alone would keep {0, 1} (mass above token 1 is 0.4).
    logits = logits_of(0.4, 0.3, 0.2, 0.1)
    assert kept_ids(SamplingParams(top_p=0.5), logits) == {0, 1}
    for order in NAMED_ORDERS.values():
        assert kept_ids(SamplingParams(top_k=2, top_p=0.5, order=order), logits) == {0}


def test_greedy_keeps_only_the_raw_argmax():
    logits = torch.tensor([0.1, 2.0, 1.5, -3.0])
    params = SamplingParams(temperature=0, top_k=3, top_p=0.1)
    filtered, codes = filter_logits(logits, params)
    assert filtered.tolist() == [NEG_INF, 2.0, NEG_INF, NEG_INF]
    assert codes.tolist() == [0, -1, 0, 0]


# -- parity with transformers --------------------------------------------------------------------

grid_logits = st.lists(
    st.integers(-41, 40).map(lambda v: v / 4 if v > -41 else NEG_INF), min_size=1, max_size=300
).filter(lambda values: max(values) > NEG_INF)
hf_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([1.0, 0.05, 0.3, 0.7, 1.3, 5.0]),
    top_k=st.integers(0, 310),
    top_p=st.one_of(st.just(1.0), st.floats(0.001, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
)


@settings(max_examples=300, deadline=None)
@given(values=grid_logits, params=hf_params)
def test_hf_order_matches_transformers_warpers(values, params):
    # The coarse grid makes ties common, including ties straddling the top-k and top-p cuts;
    # some logits arrive already -inf, as from a caller's mask.
    logits = torch.tensor(values)
    assert torch.equal(filter_logits(logits, params)[0], hf_filter(logits, params))


@pytest.mark.parametrize(
    "seed, params",
    [
        (0, SamplingParams(temperature=0.7, top_p=0.9)),  # top-p on the full row: estimate
        (1, SamplingParams(top_p=0.95)),
        (2, SamplingParams(temperature=0.7, top_k=50, top_p=0.9)),  # sorted survivors
        (3, SamplingParams(temperature=0.8, top_k=3000, top_p=0.5, min_p=0.02)),
        (4, SamplingParams(temperature=5.0, top_p=0.9)),  # flat: falls back to a full sort
        (5, SamplingParams(temperature=1.2, min_p=0.05)),
    ],
)
def test_large_vocabulary_matches_transformers(seed, params):
    logits = llm_like(49152, seed)
    assert torch.equal(filter_logits(logits, params)[0], hf_filter(logits, params))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    params=st.builds(
        SamplingParams,
        temperature=st.sampled_from([1.0, 0.5, 2.0]),
        top_k=st.sampled_from([0, 1, 7, 50, 400, 3000]),
        top_p=st.sampled_from([1.0, 0.2, 0.6, 0.9, 0.99]),
        min_p=st.sampled_from([0.0, 0.01, 0.3]),
    ),
)
def test_long_rows_full_of_ties_match_transformers(seed, params):
    # 20k logits on a 161-value grid: every cut lands inside a tie, on the chunked top-k,
    # the survivor sort and the unsorted top-p estimate alike.
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-80, 81, (20000,), generator=g).float() / 8
    assert torch.equal(filter_logits(logits, params)[0], hf_filter(logits, params))


def test_multinomial_draw_reproduces_hf_token_for_token():
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7)
    sampler = Sampler(params, draw="multinomial")
    reference = torch.Generator().manual_seed(7)
    for step in range(8):
        logits = llm_like(5000, 100 + step)
        probs = torch.softmax(hf_filter(logits, params).unsqueeze(0), dim=-1)
        expected = int(torch.multinomial(probs, 1, generator=reference))
        assert sampler.sample(logits) == expected


# -- drawing -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(seed=3),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=3),
        SamplingParams(temperature=1.1, min_p=0.05, order=VLLM_ORDER, seed=3),
        SamplingParams(temperature=0.9, top_k=40, top_p=0.95, order=LLAMA_CPP_ORDER, seed=3),
    ],
)
def test_same_seed_same_tokens_and_tracing_changes_nothing(params):
    steps = [llm_like(4096, s) for s in range(25)]
    plain = [Sampler(params).sample(x) for x in steps]  # a fresh generator per step
    first, second, traced = Sampler(params), Sampler(params), Sampler(params)
    run_a = [first.sample(x) for x in steps]
    run_b = [second.sample(x) for x in steps]
    run_t = [traced.sample_traced(x, piece)[0] for x in steps]
    assert run_a == run_b == run_t
    assert len(set(run_a)) > 1  # it really samples
    assert plain != run_a  # and the generator advances between steps
    other = Sampler(params.with_(seed=4))
    assert [other.sample(x) for x in steps] != run_a


def test_draws_follow_the_filtered_distribution():
    logits = logits_of(0.5, 0.3, 0.12, 0.08)
    sampler = Sampler(SamplingParams(top_p=0.85, seed=11))
    counts = [0, 0, 0, 0]
    for _ in range(2000):
        counts[sampler.sample(logits)] += 1
    expected = [0.5 / 0.92, 0.3 / 0.92, 0.12 / 0.92, 0.0]
    for got, want in zip(counts, expected, strict=True):
        assert abs(got / 2000 - want) < 0.03  # about 3 standard errors
    assert counts[3] == 0


def test_uniform_lands_in_the_chosen_tokens_cdf_interval():
    sampler = Sampler(SamplingParams(temperature=0.9, top_k=20, seed=5))
    for step in range(10):
        logits = llm_like(3000, step)
        chosen, trace = sampler.sample_traced(logits, piece)
        finals = {c.token_id: c.final_prob for c in trace.candidates}
        below = sum(p for tid, p in finals.items() if tid < chosen)
        assert below - 1e-6 <= trace.uniform < below + finals[chosen] + 1e-6


def test_greedy_is_argmax_and_draws_nothing():
    params = SamplingParams(temperature=0, top_k=5, top_p=0.5, seed=9)
    greedy = Sampler(params)
    for step in range(5):
        logits = llm_like(2000, step)
        assert greedy.sample(logits) == int(torch.argmax(logits))
        token, trace = greedy.sample_traced(logits, piece)
        assert token == int(torch.argmax(logits))
        assert trace.kept == 1 and trace.sample_logprob == 0.0 and trace.uniform is None
    greedy.update(params.with_(temperature=1.0))
    fresh = Sampler(params.with_(temperature=1.0))
    logits = llm_like(2000, 99)
    assert greedy.sample(logits) == fresh.sample(logits)


def _general_greedy_trace(logits, params, chosen, top_n, forced):
    """The trace the full chain builds for a greedy step (what `greedy_trace` must reproduce)."""
    from minengine.sampling.chain import final_distribution, over_row, run_chain
    from minengine.sampling.trace import build_trace

    run = run_chain(logits, params)
    final_probs = over_row(*final_distribution(run.final), logits.numel())
    chosen = int(run.final.alive[0]) if chosen is None else chosen
    return build_trace(logits, params, run, final_probs, chosen, piece, top_n, forced, None)


def _tied_rows():
    row = llm_like(3000, 4)
    top = float(row.max())
    two_way = row.clone()
    two_way[[7, 2900]] = top  # the argmax is the lower id; the display order puts 2900 first
    wide = row.clone()
    wide[torch.arange(100, 130)] = top  # more ties than candidates: the shortcut must step aside
    masked = row.clone()
    masked[::3] = NEG_INF
    return [row, two_way, wide, masked, torch.zeros(50), torch.full((5,), 1.5)]


@pytest.mark.parametrize("top_n", [1, 2, 20, 64])
def test_greedy_trace_shortcut_equals_the_full_chain(top_n):
    from minengine.sampling.trace import greedy_trace

    params = SamplingParams(temperature=0, top_k=5, top_p=0.5)
    taken = 0
    for row in _tied_rows():
        for chosen in (None, int(row.argmin())):
            fast = greedy_trace(row, params, chosen, piece, top_n, chosen is not None)
            if fast is None:  # ties beyond the candidates (or a non-finite top): the full chain decides
                assert bool((row == row.max()).sum() >= min(max(top_n, 2), row.numel()))
                continue
            taken += 1
            assert fast == _general_greedy_trace(row, params, chosen, top_n, chosen is not None)
    assert taken >= 4
    # Through the sampler and `explain`, the answer is the same whichever path ran.
    for row in _tied_rows():
        token, trace = Sampler(params).sample_traced(row, piece, top_n)
        assert token == int(torch.argmax(row)) == trace.chosen_id
        assert trace == _general_greedy_trace(row, params, None, top_n, False)
        assert explain(row, params, token, piece, top_n) == trace
    assert greedy_trace(torch.tensor([1.0, float("nan")]), params, None, piece, 2, False) is None


def test_forcing_advances_the_generator_like_a_draw():
    params = SamplingParams(temperature=1.0, seed=21)
    steps = [llm_like(2000, s) for s in range(4)]
    free, forced = Sampler(params), Sampler(params)
    expected = [free.sample(x) for x in steps]
    token, trace = forced.sample_traced(steps[0], piece, force=123)
    assert token == 123 and trace.forced and trace.chosen_id == 123
    assert [forced.sample(x) for x in steps[1:]] == expected[1:]


def test_update_reseeds_only_on_a_new_seed():
    params = SamplingParams(temperature=1.0, seed=1)
    steps = [llm_like(2000, s) for s in range(6)]
    reference = Sampler(params)
    expected = [reference.sample(x) for x in steps]
    sampler = Sampler(params)
    sampler.sample(steps[0])
    sampler.update(params.with_(top_k=0))  # same seed: the stream continues
    assert [sampler.sample(x) for x in steps[1:]] == expected[1:]
    sampler.update(params.with_(seed=2))
    assert sampler.seed == 2
    assert sampler.sample(steps[0]) == Sampler(params.with_(seed=2)).sample(steps[0])
    assert Sampler(SamplingParams()).seed != Sampler(SamplingParams()).seed


# -- traces --------------------------------------------------------------------------------------


def test_trace_fields_by_hand():
    probs = [0.5, 0.3, 0.12, 0.08]
    logits = logits_of(*probs)
    trace = explain(logits, SamplingParams(top_p=0.75), chosen_id=1, piece=piece)
    assert [c.token_id for c in trace.candidates] == [0, 1, 2, 3]
    assert [c.piece for c in trace.candidates] == ["<0>", "<1>", "<2>", "<3>"]
    assert [c.prob for c in trace.candidates] == pytest.approx(probs, abs=1e-6)
    assert [c.cumulative for c in trace.candidates] == pytest.approx([0.5, 0.8, 0.92, 1.0], abs=1e-6)
    assert [c.dropped_by for c in trace.candidates] == [None, None, "top_p", "top_p"]
    assert [c.final_prob for c in trace.candidates] == pytest.approx([0.625, 0.375, 0, 0], abs=1e-6)
    assert trace.kept == 2
    assert trace.top_p_cut == pytest.approx(0.8, abs=1e-6)
    assert trace.chosen_piece == "<1>" and not trace.forced
    assert trace.chosen_logprob == pytest.approx(math.log(0.3), abs=1e-6)
    assert trace.sample_logprob == pytest.approx(math.log(0.375), abs=1e-6)
    assert trace.entropy == pytest.approx(-sum(p * math.log(p) for p in probs), abs=1e-6)
    assert trace.order == HF_ORDER and trace.vocab_size == 4


def test_trace_uses_the_scaled_distribution_and_raw_logprob():
    logits = logits_of(0.6, 0.3, 0.1)
    trace = explain(logits, SamplingParams(temperature=0.5), chosen_id=2, piece=piece)
    scaled = [p * p / 0.46 for p in (0.6, 0.3, 0.1)]
    assert [c.prob for c in trace.candidates] == pytest.approx(scaled, abs=1e-6)
    assert trace.chosen_logprob == pytest.approx(math.log(0.1), abs=1e-6)
    assert trace.top_p_cut is None


def test_explain_refilters_as_top_p_changes():
    logits = llm_like(20000, 8)
    kept, previous = [], None
    for top_p in (0.99, 0.95, 0.9, 0.7, 0.5, 0.3):
        trace = explain(logits, SamplingParams(temperature=1.0, top_p=top_p), 0, piece)
        survivors = {c.token_id for c in trace.candidates if c.dropped_by is None}
        if previous is not None:
            assert survivors <= previous
        previous = survivors
        kept.append(trace.kept)
        assert trace.top_p_cut >= top_p
        assert kept[-1] == len(kept_ids(SamplingParams(top_p=top_p), logits))
    assert kept == sorted(kept, reverse=True) and kept[0] > kept[-1]


def test_sample_traced_matches_explain():
    params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=4)
    logits = llm_like(49152, 2)
    token, trace = Sampler(params).sample_traced(logits, piece, top_n=10)
    again = explain(logits, params, token, piece, top_n=10)
    assert len(trace.candidates) == 10
    assert trace.candidates == again.candidates
    assert (trace.kept, trace.top_p_cut, trace.entropy) == (again.kept, again.top_p_cut, again.entropy)


def test_replay_from_recorded_candidates():
    logits = llm_like(8000, 5)
    recorded = SamplingParams(temperature=0.8, top_p=0.9)
    trace = explain(logits, recorded, 0, piece)
    for params in (recorded, recorded.with_(top_p=0.5), recorded.with_(top_k=3, min_p=0.1)):
        full = explain(logits, params, trace.candidates[1].token_id, piece)
        replay = explain_candidates(
            trace.candidates,
            params,
            trace.candidates[1].token_id,
            recorded_temperature=0.8,
            vocab_size=8000,
        )
        assert [c.token_id for c in replay.candidates] == [c.token_id for c in full.candidates]
        assert [c.dropped_by for c in replay.candidates] == [c.dropped_by for c in full.candidates]
        for got, want in zip(replay.candidates, full.candidates, strict=True):
            assert got.prob == pytest.approx(want.prob, abs=1e-5)
            assert got.cumulative == pytest.approx(want.cumulative, abs=1e-5)
        # The raw (T=1) distribution is extrapolated from the T=0.8 record: close, not exact.
        assert replay.chosen_logprob == pytest.approx(full.chosen_logprob, abs=0.02)
    hotter = explain_candidates(trace.candidates, recorded.with_(temperature=1.5), 0)
    assert hotter.candidates[0].prob < trace.candidates[0].prob  # flatter, roughly


# -- parameters ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": 1e-6}, "temperature"),
        ({"temperature": 1000.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "warm"}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"order": ("top_k", "top_p")}, "order"),
        ({"order": ("top_k", "top_k", "top_p", "min_p")}, "order"),
    ],
)
def test_validation_names_the_field(changes, field):
    params = SamplingParams().with_(**changes)
    with pytest.raises(RequestError, match=field) as caught:
        params.validate()
    assert "\n" not in str(caught.value)
    with pytest.raises(RequestError):
        Sampler(params)


def test_valid_edges_pass():
    SamplingParams(temperature=0, top_k=0, top_p=1.0, min_p=1.0, seed=2**64 - 1).validate()
    SamplingParams(temperature=100, top_k=10**6, top_p=1e-9, min_p=0.0, seed=0).validate()


def test_with_rejects_unknown_fields():
    assert SamplingParams().with_(top_k=5).top_k == 5
    with pytest.raises(RequestError, match="top_q"):
        SamplingParams().with_(top_q=0.5)


@pytest.mark.parametrize(
    "text, order",
    [
        ("hf", HF_ORDER),
        (" LLaMA.cpp ", LLAMA_CPP_ORDER),
        ("vllm", VLLM_ORDER),
        ("top_k,temperature,top_p,min_p", ("top_k", "temperature", "top_p", "min_p")),
        ("min-p, top-p, top-k, temperature", ("min_p", "top_p", "top_k", "temperature")),
    ],
)
def test_parse_order(text, order):
    assert SamplingParams.parse_order(text) == order


@pytest.mark.parametrize("text", ["", "hf2", "top_k,top_p", "top_k,top_k,top_p,min_p", "a,b,c,d"])
def test_parse_order_rejects(text):
    with pytest.raises(RequestError, match="order"):
        SamplingParams.parse_order(text)


def test_rejects_batched_logits():
    with pytest.raises(ValueError, match="1-D"):
        Sampler(SamplingParams()).sample(torch.zeros(1, 5))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=3)
    steps = [llm_like(49152, s) for s in range(10)]
    cpu, cuda = Sampler(params), Sampler(params, device="cuda")
    assert [cpu.sample(x) for x in steps] == [cuda.sample(x.cuda()) for x in steps]
    filtered, _ = filter_logits(steps[0].cuda(), params)
    assert torch.equal(filtered.cpu().isinf(), hf_filter(steps[0], params).isinf())


def test_min_p_below_float32_range_removes_nothing():
    logits = torch.tensor([0.0, -200.0, float("-inf"), 1.0])
    params = SamplingParams(min_p=1e-60)
    assert torch.equal(filter_logits(logits, params)[0], hf_filter(logits, params))
    assert explain(logits, params, 3, piece).kept == 3


def test_masked_logits_never_drawn_and_traced():
    logits = logits_of(0.5, 0.3, 0.2, 0.1)
    logits[1] = NEG_INF  # masked by the caller
    sampler = Sampler(SamplingParams(seed=0))
    drawn = {sampler.sample(logits) for _ in range(200)}
    assert drawn == {0, 2, 3}
    trace = explain(logits, SamplingParams(), 0, piece)
    probs = [0.5 / 0.8, 0.2 / 0.8, 0.1 / 0.8]
    assert trace.entropy == pytest.approx(-sum(p * math.log(p) for p in probs), abs=1e-6)
    assert trace.kept == 3
