"""Step limits and KV budgets no request could run under: one line naming the flag and what to do,
a non-zero exit, no traceback, for serve and run alike (and nothing served or run)."""

from __future__ import annotations

import pytest

from minengine.config import ModelConfig
from minengine.engine.step_loop import BatchLimits
from minengine.errors import AdmissionError, RequestError
from minengine.kv.arithmetic import KIB
from minengine.kv.budget_floor import check_budget_holds_a_request, smallest_request_bytes
from reqscope.cli import main
from reqscope.wording import error_text

# The chatty tiny model: 2 layers, 2 KV heads of 16 dims; one 16-token block in float32 is
# 2 x 2 x 2 x 16 x 4 bytes x 16 tokens = 8 KiB (0.0078 MiB), in fp8 2 KiB.
CHATTY_BLOCK = 8 * KIB


def _error(argv, capsys) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    return code, lines[-1]


@pytest.mark.parametrize("verb", [["serve"], ["--plain"]], ids=["serve", "run"])
@pytest.mark.parametrize(
    ("flags", "line", "code"),
    [
        (
            ["--max-num-seqs", "0"],
            "--max-num-seqs 0 lets no sequence into a step, so no request could ever run; give it 1 or more",
            1,
        ),
        (
            ["--max-num-batched-tokens", "8"],
            "--max-num-batched-tokens 8 is smaller than one KV block (16 tokens), so a step could never fill one; "
            "raise --max-num-batched-tokens to at least 16",
            1,
        ),
        (
            ["--max-num-seqs", "24", "--max-num-batched-tokens", "20"],
            "--max-num-batched-tokens 20 is smaller than --max-num-seqs 24, so a step could not give every running "
            "sequence its token; raise --max-num-batched-tokens to at least 24 or lower --max-num-seqs",
            1,
        ),
        (
            ["--kv-budget-mib", "0.001"],
            "the KV budget cannot hold one request: the smallest, one block of 16 tokens, needs 0.01 MiB of KV, "
            "budget 0.0 MiB; raise --kv-budget-mib to at least 0.01",
            1,
        ),
    ],
    ids=["no-sequences", "budget-under-a-block", "budget-under-the-sequences", "pool-under-a-request"],
)
def test_a_limit_no_request_could_run_under_is_one_line(chatty_tiny_dir, capsys, verb, flags, line, code):
    argv = [*verb, "--model", str(chatty_tiny_dir), "--dtype", "float32", *flags]
    got, last = _error(argv + (["x"] if verb == ["--plain"] else []), capsys)
    assert (got, last) == (code, f"reqscope: error: {line}")


def test_the_token_budget_is_measured_in_the_runs_own_blocks(chatty_tiny_dir, capsys):
    argv = ["--plain", "--model", str(chatty_tiny_dir), "--block-size", "32", "--max-num-batched-tokens", "16", "x"]
    code, last = _error(argv, capsys)
    assert code == 1 and "(32 tokens)" in last and last.endswith("at least 32")


def test_the_pool_is_measured_in_the_runs_own_kv_storage(chatty_tiny_dir):
    cfg = ModelConfig.from_file(chatty_tiny_dir)
    assert smallest_request_bytes(cfg, "gqa", 4, 16) == CHATTY_BLOCK
    assert smallest_request_bytes(cfg, "gqa", 1, 16) == CHATTY_BLOCK // 4  # fp8
    assert smallest_request_bytes(cfg, "mha", 4, 16) == CHATTY_BLOCK * 2  # 4 query heads stored, not 2
    check_budget_holds_a_request(CHATTY_BLOCK, CHATTY_BLOCK, 16)  # exactly one block is one request
    with pytest.raises(AdmissionError) as info:
        check_budget_holds_a_request(CHATTY_BLOCK - 1, CHATTY_BLOCK, 16)
    assert error_text(info.value).endswith("raise --kv-budget-mib to at least 0.01")


def test_an_fp8_run_fits_a_budget_its_float32_blocks_would_not(chatty_tiny_dir, capsys):
    # 5 KiB: one fp8 block (2 KiB) fits, a float32 one (8 KiB) does not; the prompt's own KV does
    # not fit either way, so admission refuses it, with its own words.
    base = ["--plain", "--model", str(chatty_tiny_dir), "--dtype", "float32", "--kv-budget-mib", str(5 / 1024)]
    _, float32 = _error([*base, "x"], capsys)
    _, fp8 = _error([*base, "--kv-cache-dtype", "fp8", "x"], capsys)
    assert "cannot hold one request" in float32
    assert "cannot hold one request" not in fp8 and "MiB of KV" in fp8


def test_the_smallest_limits_that_can_run_pass():
    BatchLimits(1, 16).check(16)
    with pytest.raises(RequestError):
        BatchLimits(1, 15).check(16)
    with pytest.raises(RequestError):
        BatchLimits(17, 16).check(16)


def test_a_token_budget_of_zero_is_refused_not_taken_for_the_default(chatty_tiny_dir):
    from minengine.engine.engine import Engine

    with pytest.raises(RequestError, match="max_num_batched_tokens 0 is smaller than one KV block"):
        Engine(chatty_tiny_dir, device="cpu", max_num_batched_tokens=0)
