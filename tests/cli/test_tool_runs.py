"""A real run of the default model with the example tool forced: `--json` carries the tools' block
tokens, the grammar's facts at every step and the parsed call; the exported trace keeps them."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import jsonschema
import pytest
from openmp_policy import keep_openmp_policy

from minengine.engine.events import PromptEvent, TokenEvent
from minengine.record.export import TRACE_JSONL
from minengine.record.trace_io import read_trace
from reqscope.cli import main
from reqscope.run_options import DEFAULT_PROMPT

HOTELS = Path(__file__).resolve().parents[2] / "examples" / "search_hotels.json"
SCHEMA = json.loads(HOTELS.read_text())[0]["function"]["parameters"]
VOCAB = 49152


@pytest.fixture(scope="module")
def forced_run(tmp_path_factory, default_model_dir):
    """`reqscope --json --export DIR --tools examples/search_hotels.json --tool-choice required ...`, greedy."""
    folder = tmp_path_factory.mktemp("forced")
    out = folder / "run.jsonl"
    argv = ["--json", "--model", str(default_model_dir), "--temperature", "0", "--max-tokens", "160",
            "--tools", str(HOTELS), "--tool-choice", "required", "--no-parallel-tool-calls",
            "--export", str(folder / "export"), DEFAULT_PROMPT]  # fmt: skip
    # Module-scoped: set up outside the autouse fixture that undoes the command's OpenMP choice.
    with pytest.MonkeyPatch.context() as monkeypatch, out.open("w") as stdout, contextlib.redirect_stdout(stdout):
        keep_openmp_policy(monkeypatch)
        assert main(argv) == 0
    return [json.loads(line) for line in out.read_text().splitlines()], folder / "export"


def test_the_prompt_record_counts_reqscope_s_tools_block(forced_run):
    records, _ = forced_run
    prompt = next(r for r in records if r["event"] == "prompt")
    parts = {p["name"]: p["tokens"] for p in prompt["parts"]}
    assert parts["tools (reqscope)"] > 100  # the schema's text: the default template has no tool syntax
    assert sum(parts.values()) == prompt["tokens"]
    done = records[-1]
    assert done["usage"]["prompt_tokens"] == prompt["tokens"]


def test_every_step_carries_the_grammar_s_facts(forced_run):
    records, _ = forced_run
    tokens = [r for r in records if r["event"] == "token"]
    assert tokens
    for token in tokens:
        grammar = token["adjustments"]["grammar"]
        assert 1 <= grammar["allowed"] <= grammar["vocab_size"] == VOCAB
        assert 0.0 <= grammar["mass_removed"] <= 1.0 + 1e-6 and grammar["state"]
        removed = [r["token_id"] for r in grammar["removed"]]
        assert token["token_id"] not in removed  # what the grammar took away was never chosen
        assert sum(r["prob"] for r in grammar["removed"]) <= grammar["mass_removed"] + 1e-6
    # `<tool_call>` opens the reply: the grammar forces its first token, taking the model's likelier words away.
    first = tokens[0]["adjustments"]["grammar"]
    assert first["allowed"] == 1 and first["mass_removed"] > 0.5


def test_the_done_record_has_the_call_and_its_arguments_follow_the_schema(forced_run):
    records, _ = forced_run
    done = records[-1]
    assert done["event"] == "done" and done["finish_reason"] == "stop"
    assert done["content"] == "" and len(done["tool_calls"]) == 1
    call = done["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "search_hotels"
    assert call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)


def test_the_exported_trace_keeps_the_adjustments_and_the_tools_part(forced_run):
    records, export = forced_run
    _, events = read_trace(export / TRACE_JSONL)
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    from_json = [r["adjustments"] for r in records if r["event"] == "token"]
    assert len(tokens) == len(from_json)
    for event, record in zip(tokens, from_json, strict=True):
        grammar = event.trace.adjustments.grammar
        assert (grammar.allowed, grammar.vocab_size, grammar.state) == (
            record["grammar"]["allowed"], record["grammar"]["vocab_size"], record["grammar"]["state"])
        assert [r.token_id for r in grammar.removed] == [r["token_id"] for r in record["grammar"]["removed"]]
        assert grammar.mass_removed == pytest.approx(record["grammar"]["mass_removed"])
    prompt = next(e for e in events if isinstance(e, PromptEvent))
    assert "tools (reqscope)" in prompt.token_parts


def test_a_chat_template_file_with_tool_syntax_renders_the_tools_itself(default_model_dir, capsys):
    """`--chat-template` (Qwen2.5's, whose template writes the tools in its own words): no generic block."""
    template = Path(__file__).resolve().parents[1] / "data" / "qwen2.5-chat-template.jinja"
    argv = ["--json", "--model", str(default_model_dir), "--max-tokens", "1", "--chat-template", str(template),
            "--tools", str(HOTELS), DEFAULT_PROMPT]  # fmt: skip
    assert main(argv) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    parts = {p["name"]: p["tokens"] for p in next(r for r in records if r["event"] == "prompt")["parts"]}
    assert parts["tools"] > 100 and "tools (reqscope)" not in parts


def test_plain_names_each_step_a_penalty_moved_and_the_stages_on_the_sampler_line(default_model_dir, capsys):
    """The same greedy run in --json and --plain: a `step N` line for each token whose ranks the penalty moved."""
    argv = ["--model", str(default_model_dir), "--temperature", "0", "--max-tokens", "16", "--min-tokens", "2",
            "--repetition-penalty", "1.5", "Hotels in Kyoto"]  # fmt: skip
    assert main(["--json", *argv]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    moved = [r["index"] + 1 for r in records if r["event"] == "token" and r.get("adjustments", {}).get("changes")]
    masked = [r["index"] + 1 for r in records if r["event"] == "token"
              and r.get("adjustments", {}).get("min_tokens_masked")]  # fmt: skip
    assert moved and masked == [1, 2]
    assert main(["--plain", *argv]) == 0
    err = capsys.readouterr().err
    steps = [int(line.split()[2]) for line in err.splitlines() if line.startswith("· step ")]
    assert sorted(set(steps)) == sorted(set(moved) | set(masked))
    assert "sampler   logits -> min_tokens -> repetition 1.5 -> temperature -> top_k" in err
