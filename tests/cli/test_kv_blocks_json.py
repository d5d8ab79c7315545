"""`--json` token records and the telemetry record split the request's KV blocks by who else holds them."""

from __future__ import annotations

import io
import json

from minengine.engine.engine import Engine
from minengine.engine.events import DoneEvent, PrefixCacheEvent
from minengine.engine.request import GenerationRequest
from minengine.record.telemetry import block_sharing_json, telemetry_record
from minengine.sampling.params import SamplingParams
from reqscope.cli import main
from reqscope.console.jsonl import print_jsonl

GREEDY = SamplingParams(temperature=0.0)


def test_json_token_records_carry_the_block_split(chatty_tiny_dir, capsys):
    assert main(["--json", "--model", str(chatty_tiny_dir), "--temperature", "0", "--max-tokens", "4", "hi"]) == 0
    tokens = [r for r in map(json.loads, capsys.readouterr().out.splitlines()) if r["event"] == "token"]
    assert len(tokens) == 4
    for t in tokens:  # alone on a fresh engine: every block its own
        split = t["kv_blocks"]
        assert split["own"] == split["blocks"] > 0 and split["with_requests"] == split["with_prefix"] == 0
        assert split["own_bytes"] == t["kv_physical_bytes"]  # physical: the blocks it holds


def test_a_prefix_cache_hit_is_in_the_records(chatty_tiny_dir):
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=64 << 20)
    request = GenerationRequest.from_prompt("Tell me about Kyoto's temples " * 4, sampling=GREEDY, max_tokens=3)
    list(engine.start(request))
    events = list(engine.start(request))
    hit = next(e for e in events if isinstance(e, PrefixCacheEvent)).blocks_hit
    out = io.StringIO()
    print_jsonl(events, out)
    tokens = [r for r in map(json.loads, out.getvalue().splitlines()) if r["event"] == "token"]
    assert hit > 0 and len(tokens) == 3
    for t in tokens:
        split = t["kv_blocks"]
        assert split["with_prefix"] == hit and split["with_requests"] == 0
        assert split["own"] + split["with_prefix"] == split["blocks"]
        assert split["own_bytes"] + split["with_prefix_bytes"] == t["kv_physical_bytes"]
    result = events[-1]
    assert isinstance(result, DoneEvent)
    assert telemetry_record(result.result)["kv_peak_blocks"] == tokens[-1]["kv_blocks"]
    assert block_sharing_json(None) is None  # a cache outside the pool
