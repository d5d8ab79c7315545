"""The planner, the architecture cards and `reqscope plan`, against every seed's worked numbers.

Two seeds write end-to-end latency as TTFT + O x ITL (one gap per output token). This project
counts only the O - 1 gaps that follow the first token, so their E2E figures come out one ITL
shorter here; the per-user rate 1000 / ITL they quote is our decode-only rate and matches.
"""

from __future__ import annotations

import ast
import json
from importlib.resources import files
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minengine.config import ModelConfig
from minengine.errors import ConfigError
from minengine.kv.arithmetic import GIB, KIB, MIB
from minengine.plan.cards import Architecture, dense_param_count, load_cards
from minengine.plan.planner import (
    PlanInputError,
    PlanInputs,
    UnsupportedLayoutError,
    parse_memory_size,
    plan,
    tokens_at_stop,
)
from reqscope.cli import main

CARDS = load_cards(files("reqscope.cards"))
ATLAS, LLAMA, QWEN = CARDS["atlas-70b"], CARDS["llama-3.1-8b"], CARDS["qwen3-30b-a3b"]

SMOLLM2_CONFIG = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --- seed: "Inside an LLM Inference Request" (80-layer GQA model, 1,025-token prompt) --------


def test_worked_example_memory_and_timing():
    p = plan(
        ATLAS,
        PlanInputs(prompt_tokens=1025, output_tokens=150, prefill_fixed_ms=190, itl_ms=25),
    )
    assert p.memory.kv_bytes_per_token == 327_680
    assert p.memory.kv_bytes_per_token / MIB == 0.3125
    assert p.memory.prompt_kv_bytes == 335_872_000
    assert p.memory.prompt_kv_bytes / MIB == 320.3125
    assert p.memory.stop_kv_tokens == 1025 + 149
    assert p.memory.stop_kv_bytes == 384_696_320
    assert p.memory.stop_kv_bytes / MIB == 366.875
    assert p.latency.ttft_ms == 190 and p.latency.e2e_ms == 3915 and p.latency.tpot_ms == 25
    assert p.latency.decode_output_tokens_per_second == pytest.approx(40.0)
    assert round(p.latency.whole_request_output_tokens_per_second, 2) == 38.31


def test_query_heads_in_the_formula_would_overstate_gqa_eightfold():
    p = plan(ATLAS, PlanInputs())
    assert p.memory.kv_bytes_per_token_mha == 8 * p.memory.kv_bytes_per_token
    assert p.memory.kv_bytes_per_token_mha / MIB == 2.5
    assert p.memory.kv_bytes_per_token_mqa == p.memory.kv_bytes_per_token // 8
    assert any("8 KV heads, not the 64 query heads" in note for note in p.notes)


def test_exercise_fp8_model():
    card = CARDS["exercise-48l-fp8"]
    p = plan(
        card,
        PlanInputs(
            kv_dtype=card.kv_dtype, prompt_tokens=4096, output_tokens=256,
            prefill_fixed_ms=420, itl_ms=18,
        ),
    )  # fmt: skip
    assert p.memory.kv_bytes_per_token == 49_152
    assert p.memory.kv_bytes_per_token / MIB == 0.046875
    assert p.memory.prompt_kv_bytes / MIB == 192
    assert p.memory.prompt_kv_bytes / GIB == 0.1875
    assert p.latency.e2e_ms == 5010
    assert round(p.latency.decode_output_tokens_per_second, 2) == 55.56
    assert round(p.latency.whole_request_output_tokens_per_second, 2) == 51.10
    assert p.memory.weights_bytes is None  # the exercise gives no parameter count
    assert any("scale" in note for note in p.notes)


# --- seed: Kite chat on Qwen3-30B-A3B and tab completion on Llama-3.1-8B -------------------


def test_kite_chat_on_qwen3_30b_a3b():
    p = plan(
        QWEN,
        PlanInputs(
            prompt_tokens=6000, output_tokens=400, network_ms=40, queue_ms=60,
            prefill_fixed_ms=300, itl_ms=20, device_memory_bytes=parse_memory_size("80GB"),
        ),
    )  # fmt: skip
    assert p.memory.kv_bytes_per_token == 98_304 == 96 * KIB
    # The seed holds 6,400 tokens (600 MiB); the last token is never fed back, so 6,399.
    assert 6400 * p.memory.kv_bytes_per_token == 600 * MIB
    assert p.memory.stop_kv_tokens == 6399
    assert p.memory.stop_kv_bytes / MIB == 599.90625
    assert pytest.approx(29.3, abs=0.01) == 50 * 600 * MIB / GIB
    assert p.memory.weights_bytes == 61_000_000_000
    assert p.memory.max_concurrent_requests == 19_000_000_000 // 629_047_296 == 30
    assert p.latency.ttft_ms == 400
    # The seed's 8,400 ms charges 400 gaps; 399 follow the first token.
    assert p.latency.e2e_ms == 400 + 399 * 20 == 8380
    assert p.latency.decode_output_tokens_per_second == pytest.approx(1000 / 20)
    assert p.latency.whole_request_output_tokens_per_second == pytest.approx(400 / 8.38)
    # 95% of the request's life is decode under either counting.
    assert (p.latency.e2e_ms - p.latency.ttft_ms) / p.latency.e2e_ms == pytest.approx(0.95, 0.01)


def test_kite_tab_completion_on_llama_3_1_8b():
    p = plan(
        LLAMA,
        PlanInputs(
            prompt_tokens=1500, output_tokens=20, network_ms=30, queue_ms=5,
            prefill_fixed_ms=40, itl_ms=8,
        ),
    )  # fmt: skip
    assert p.latency.ttft_ms == 75
    assert p.latency.e2e_ms == 75 + 19 * 8 == 227  # the seed's 235 charges 20 gaps
    assert p.latency.decode_output_tokens_per_second == pytest.approx(125.0)
    assert p.memory.kv_bytes_per_token == 128 * KIB
    # The seed's "1,520 tokens x 128 KiB = 190 MiB" counts prompt + O; we hold prompt + O - 1.
    assert 1520 * p.memory.kv_bytes_per_token == 190 * MIB
    assert p.memory.stop_kv_tokens == 1519
    assert p.memory.stop_kv_bytes / MIB == 189.875
    assert p.memory.weights_bytes == 16_060_000_000


# --- seed: "Your First Inference Request" (Atlas, prefill 20 + 0.035 ms/token, 45 ms steps) --


def test_atlas_single_request():
    p = plan(
        ATLAS,
        PlanInputs(
            prompt_tokens=1000, output_tokens=200, prefill_fixed_ms=20,
            prefill_per_token_ms=0.035, itl_ms=45, device_memory_bytes=parse_memory_size("80GB"),
        ),
    )  # fmt: skip
    assert p.memory.kv_bytes_per_token == 320 * KIB
    assert p.memory.prompt_kv_bytes == 320_000 * KIB
    assert p.memory.prompt_kv_bytes / MIB == 312.5
    assert p.memory.weights_bytes == 140_000_000_000
    assert p.memory.max_concurrent_requests == 0  # 140 GB of weights cannot fit in 80 GB
    assert any("weights alone" in note for note in p.notes)
    assert p.latency.ttft_ms == pytest.approx(55.0)
    # The seed's ~9.1 s adds 200 steps of 45 ms after prefill; 199 gaps follow token 1.
    assert p.latency.e2e_ms == pytest.approx(55 + 199 * 45)
    assert round(p.latency.decode_output_tokens_per_second, 1) == 22.2


def test_atlas_concurrency_arithmetic():
    per_token = plan(ATLAS, PlanInputs()).memory.kv_bytes_per_token
    assert 100 * 1000 * per_token / GIB == pytest.approx(30.52, abs=0.005)
    assert 10 * 1200 * per_token / GIB == pytest.approx(3.66, abs=0.005)
    assert 100 * 1200 * per_token / GIB == pytest.approx(36.62, abs=0.005)
    assert 4000 * per_token / GIB == pytest.approx(1.22, abs=0.005)
    # The seed prints 3.12 GiB for ten 1,000-token prompts; 3,125 MiB is 3.05 GiB.
    assert 10 * 1000 * per_token / GIB == pytest.approx(3.05, abs=0.005)


# --- memory details ------------------------------------------------------------------------


def test_block_rounding_is_reported_as_physical_and_limits_concurrency():
    inputs = PlanInputs(
        prompt_tokens=1500, output_tokens=20, device_memory_bytes=parse_memory_size("80GB")
    )
    logical = plan(LLAMA, inputs)
    blocked = plan(LLAMA, PlanInputs(**{**vars(inputs), "block_size": 16}))
    assert blocked.memory.stop_kv_blocks == 95  # ceil(1519 / 16)
    assert blocked.memory.stop_kv_physical_bytes == 95 * 16 * 128 * KIB
    assert blocked.memory.stop_kv_bytes == logical.memory.stop_kv_bytes
    assert logical.memory.max_concurrent_requests == 63_940_000_000 // (1519 * 128 * KIB) == 321
    assert blocked.memory.max_concurrent_requests == 63_940_000_000 // (1520 * 128 * KIB) == 320


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GB", 80 * 10**9),
        ("80GiB", 80 * 2**30),
        ("141 gib", 141 * 2**30),
        ("1.5TB", 1_500_000_000_000),
        ("512MiB", 512 * 2**20),
        ("24GB", 24_000_000_000),
    ],
)
def test_memory_sizes(text, expected):
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize("text", ["80", "80 XB", "GB", "-5GB", "80G"])
def test_memory_sizes_need_a_known_unit(text):
    with pytest.raises(PlanInputError, match="needs a number and a unit"):
        parse_memory_size(text)


def test_tokens_at_stop():
    assert tokens_at_stop(1025, 150) == 1174
    assert tokens_at_stop(0, 1) == 0
    with pytest.raises(PlanInputError):
        tokens_at_stop(10, 0)


@given(
    layers=st.integers(1, 128),
    kv_heads=st.integers(1, 16),
    group=st.integers(1, 16),
    head_dim=st.sampled_from([32, 64, 80, 96, 128, 256]),
    dtype=st.sampled_from(["float32", "bfloat16", "float16", "fp8"]),
    prompt=st.integers(0, 200_000),
    output=st.integers(1, 10_000),
    ttft=st.floats(0, 1e4),
    itl=st.floats(0.01, 500),
)
def test_plan_properties(layers, kv_heads, group, head_dim, dtype, prompt, output, ttft, itl):
    arch = Architecture("prop", layers, kv_heads * group, kv_heads, head_dim)
    p = plan(
        arch,
        PlanInputs(
            kv_dtype=dtype, prompt_tokens=prompt, output_tokens=output,
            prefill_fixed_ms=ttft, itl_ms=itl,
        ),
    )  # fmt: skip
    mem, lat = p.memory, p.latency
    assert mem.kv_bytes_per_token_mha == group * mem.kv_bytes_per_token
    assert mem.kv_bytes_per_token == kv_heads * mem.kv_bytes_per_token_mqa
    assert mem.stop_kv_bytes == mem.prompt_kv_bytes + (output - 1) * mem.kv_bytes_per_token
    assert lat.e2e_ms == pytest.approx(ttft + (output - 1) * itl)
    if output > 1:
        assert lat.tpot_ms == pytest.approx(itl)
        assert lat.decode_output_tokens_per_second == pytest.approx(1000 / itl)


def test_latency_figures_appear_only_with_their_inputs():
    p = plan(LLAMA, PlanInputs(network_ms=30, itl_ms=8, output_tokens=20))
    assert p.latency.ttft_ms is None and p.latency.e2e_ms is None  # no prefill term given
    p = plan(LLAMA, PlanInputs(prefill_fixed_ms=40, network_ms=30))
    assert p.latency.ttft_ms == 70 and p.latency.e2e_ms is None
    out = p.as_json()
    assert "ttft_ms" in out and "e2e_ms" not in out and "prompt_kv_bytes" not in out
    with pytest.raises(PlanInputError, match="needs prompt_tokens"):
        plan(LLAMA, PlanInputs(prefill_per_token_ms=0.035))


@pytest.mark.parametrize(
    "inputs",
    [
        PlanInputs(kv_dtype="int3"),
        PlanInputs(weight_dtype="bf17"),
        PlanInputs(output_tokens=0),
        PlanInputs(prompt_tokens=-1),
        PlanInputs(block_size=0),
        PlanInputs(itl_ms=-1.0),
        PlanInputs(queue_ms=float("nan")),
    ],
)
def test_bad_inputs_are_rejected(inputs):
    with pytest.raises(PlanInputError):
        plan(LLAMA, inputs)


# --- cards and architectures -------------------------------------------------------------


def test_cards_ship_with_sources_and_seed_shapes():
    assert {"atlas-70b", "llama-3.1-8b", "qwen3-30b-a3b", "exercise-48l-fp8"} <= set(CARDS)
    for name, card in CARDS.items():
        assert card.source, f"card {name} has no source note"
        assert (files("reqscope.cards") / f"{name}.json").is_file()
    shapes = {n: (c.layers, c.q_heads, c.kv_heads, c.head_dim) for n, c in CARDS.items()}
    assert shapes["atlas-70b"] == (80, 64, 8, 128)
    assert shapes["llama-3.1-8b"] == (32, 32, 8, 128)
    assert shapes["qwen3-30b-a3b"] == (48, 32, 4, 128)
    assert shapes["exercise-48l-fp8"] == (48, 32, 4, 128)
    assert shapes["smollm2-135m-instruct"] == (30, 9, 3, 64)
    assert (ATLAS.params, LLAMA.params, QWEN.params) == (70e9, 8.03e9, 30.5e9)


@pytest.mark.parametrize(
    ("name", "layout"),
    [("deepseek-v3", "MLA"), ("mistral-7b-v0.1", "SLIDING-WINDOW"), ("jamba-v0.1", "HYBRID")],
)
def test_nonstandard_cards_are_refused(name, layout):
    card = CARDS[name]
    assert not card.kv_formula_applies
    with pytest.raises(UnsupportedLayoutError, match=layout) as info:
        plan(card, PlanInputs(prompt_tokens=1000))
    assert "\n" not in str(info.value) and "refuses" in str(info.value)


def test_smollm2_card_matches_its_config(tmp_path):
    config = ModelConfig.from_dict(SMOLLM2_CONFIG)
    assert dense_param_count(config) == 134_515_008 == CARDS["smollm2-135m-instruct"].params
    arch = Architecture.from_config(config, "smollm2")
    card = CARDS["smollm2-135m-instruct"]
    assert (arch.layers, arch.q_heads, arch.kv_heads, arch.head_dim) == (30, 9, 3, 64)
    assert plan(arch, PlanInputs()).memory.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23_040
    assert plan(card, PlanInputs()).memory == plan(arch, PlanInputs()).memory


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({"name": "x", "layers": 2, "q_heads": 6, "kv_heads": 4, "head_dim": 8}, "evenly"),
        ({"name": "x", "layers": 2, "q_heads": 4, "kv_heads": 4}, "lacks 'head_dim'"),
        ({"name": "x", "layers": 0, "q_heads": 4, "kv_heads": 4, "head_dim": 8}, "positive"),
        (
            {
                "name": "x",
                "layers": 2,
                "q_heads": 4,
                "kv_heads": 4,
                "head_dim": 8,
                "attention": "linear",
            },
            "unknown",
        ),
        ([1, 2], "not a JSON object"),
    ],
)
def test_malformed_cards(raw, fragment):
    with pytest.raises(ConfigError, match=fragment):
        Architecture.from_card(raw, "x.json")


def test_minengine_modules_never_import_the_ui_package():
    root = Path(__file__).parent.parent.parent / "minengine"
    for module in ("engine/metrics", "record/timeline_csv", "plan/planner", "plan/cards"):
        tree = ast.parse((root / f"{module}.py").read_text())
        imported = [
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        ] + [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
        assert not [name for name in imported if name.startswith("reqscope")], module


# --- the CLI -----------------------------------------------------------------------------


def test_cli_json_for_kite_chat(capsys):
    code, out, err = _cli(
        ["plan", "qwen3-30b-a3b", "--input-len", "6000", "--output-len", "400",
         "--network-ms", "40", "--queue-ms", "60", "--prefill-fixed-ms", "300", "--itl-ms", "20",
         "--device-memory", "80GB", "--json"],
        capsys,
    )  # fmt: skip
    assert (code, err) == (0, "")
    data = json.loads(out)
    assert data["kv_bytes_per_token"] == 98_304
    assert data["kv_bytes_per_token_mha"] == 8 * 98_304
    assert data["kv_bytes_per_token_mqa"] == 98_304 // 4
    assert data["prompt_kv_bytes"] == 6000 * 98_304
    assert data["stop_kv_bytes"] == 6399 * 98_304
    assert data["weights_bytes"] == 61_000_000_000
    assert data["max_concurrent_requests"] == 30
    assert (data["ttft_ms"], data["e2e_ms"], data["tpot_ms"]) == (400, 8380, 20)
    assert data["decode_output_tokens_per_second"] == pytest.approx(50.0)
    assert data["whole_request_output_tokens_per_second"] == pytest.approx(400 / 8.38)
    assert any("not the 32 query heads" in note for note in data["notes"])


def test_cli_explicit_flags_and_card_flag_agree(capsys):
    explicit = ["plan", "--layers", "32", "--q-heads", "32", "--kv-heads", "8", "--head-dim",
                "128", "--params", "8.03e9", "--input-len", "1500", "--json"]  # fmt: skip
    code, out, _ = _cli(explicit, capsys)
    assert code == 0
    by_flags = json.loads(out)
    code, out, _ = _cli(["plan", "--card", "llama-3.1-8b", "--input-len", "1500", "--json"],
                        capsys)  # fmt: skip
    by_card = json.loads(out)
    for key in ("kv_bytes_per_token", "prompt_kv_bytes", "weights_bytes"):
        assert by_flags[key] == by_card[key]
    assert by_card["prompt_kv_bytes"] / MIB == 187.5


def test_cli_card_override_and_kv_dtype(capsys):
    code, out, _ = _cli(["plan", "atlas-70b", "--kv-heads", "64", "--kv-cache-dtype", "fp8", "--json"],
                        capsys)  # fmt: skip
    assert code == 0
    assert json.loads(out)["kv_bytes_per_token"] == 2 * 80 * 64 * 128 * 1


def test_cli_reads_a_config_folder(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    code, out, _ = _cli(["plan", str(tmp_path), "--weight-dtype", "float32", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["kv_bytes_per_token"] == 23_040
    assert data["weights_bytes"] == 4 * 134_515_008


def test_cli_table_states_kv_heads_and_units(capsys):
    code, out, _ = _cli(["plan", "llama-3.1-8b", "--input-len", "1500", "--output-len",
                         "20", "--block-size", "16"], capsys)  # fmt: skip
    assert code == 0
    assert "128 KiB (131,072 B), from 8 KV heads" in out
    assert "189.875 MiB" in out and "95 blocks of 16 tokens" in out
    assert "16.06 GB" in out
    assert "logical" in out


@pytest.mark.parametrize("name", ["deepseek-v3", "mistral-7b-v0.1", "jamba-v0.1"])
def test_cli_refuses_nonstandard_cards_in_one_line(capsys, name):
    code, out, err = _cli(["plan", name, "--json"], capsys)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"reqscope: error: {name} uses")


def test_cli_refuses_a_sliding_window_config(tmp_path, capsys):
    config = {**SMOLLM2_CONFIG, "sliding_window": 4096, "use_sliding_window": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, _, err = _cli(["plan", str(tmp_path / "config.json")], capsys)
    assert code == 1 and "sliding-window" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["plan"], "no model given"),
        (["plan", "--layers", "80", "--kv-heads", "8"], "--q-heads, --head-dim"),
        (["plan", "no-such-card"], "no card or model folder"),
        (["plan", "atlas-70b", "--card", "llama-3.1-8b"], "not both"),
        (["plan", "atlas-70b", "--device-memory", "80"], "needs a number and a unit"),
        (["plan", "atlas-70b", "--prefill-per-token-ms", "0.03"], "needs prompt_tokens"),
        (["plan", "atlas-70b", "--kv-heads", "7"], "evenly"),
        (["plan", "atlas-70b", "--output-len", "0"], "at least 1"),
        (["plan", "atlas-70b", "--input-len", "-3"], "negative"),
        (["plan", "atlas-70b", "--kv-cache-dtype", "int4"], "invalid choice"),
    ],
)
def test_cli_usage_errors_exit_2(capsys, argv, fragment):
    code, out, err = _cli(argv, capsys)
    assert code == 2 and out == ""
    assert fragment in err and err.count("\n") == 1 and "Traceback" not in err
