"""The tools, structured-output, penalty and bias flags: read into the request as given, and bad
input refused with one line and exit code 2 before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minengine.sampling.structured import StructuredOutput
from minengine.text.tools import Tool, ToolChoice
from reqscope.cli import build_parser, main
from reqscope.run_options import ModelFolder, request_from_args

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
HOTELS = EXAMPLES / "search_hotels.json"


def request_of(*argv: str):
    args = build_parser("run").parse_args([*argv, "hi"])
    return request_from_args(args, "hi", ModelFolder.of(args))


def test_the_example_tool_is_read_as_the_file_says():
    request = request_of("--tools", str(HOTELS), "--tool-choice", "required")
    raw = json.loads(HOTELS.read_text())[0]["function"]
    assert request.tools == (Tool(raw["name"], raw["description"], json.dumps(raw["parameters"])),)
    assert json.loads(request.tools[0].parameters) == raw["parameters"]
    assert request.tool_choice == ToolChoice("required") and request.generic_tools


def test_a_named_tool_choice_and_no_generic_block():
    request = request_of("--tools", str(HOTELS), "--tool-choice", "search_hotels", "--no-generic-tools")
    assert request.tool_choice == ToolChoice("function", "search_hotels") and request.tool_choice.forced
    assert request.generic_tools is False


def test_tools_without_a_choice_are_auto_and_no_tools_by_default():
    assert request_of("--tools", str(HOTELS)).tool_choice == ToolChoice("auto")
    plain = request_of()
    assert plain.tools == () and plain.structured is None and not plain.sampling.adjusts_logits


def test_schema_regex_and_choice_become_structured_outputs(tmp_path):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    path = tmp_path / "hotel.json"
    path.write_text(json.dumps(schema))
    shaped = request_of("--json-schema", str(path)).structured
    assert (shaped.kind, json.loads(shaped.spec), shaped.name) == ("json_schema", schema, "hotel")
    assert request_of("--regex", "[0-9]{4}").structured == StructuredOutput("regex", spec="[0-9]{4}")
    choice = request_of("--choice", "yes, no,maybe").structured
    assert choice == StructuredOutput("choice", choices=("yes", "no", "maybe"))


def test_min_tokens_reach_the_request():
    assert request_of("--min-tokens", "5").min_tokens == 5 and request_of().min_tokens == 0


def test_penalties_and_bias_reach_the_sampling_params_and_say_where_they_came_from():
    request = request_of("--repetition-penalty", "1.3", "--frequency-penalty", "0.5", "--presence-penalty", "-1",
                         "--logit-bias", "28=5", "--logit-bias", "2=-100", "--logit-bias", "28=-2.5")  # fmt: skip
    s = request.sampling
    assert (s.repetition_penalty, s.frequency_penalty, s.presence_penalty) == (1.3, 0.5, -1.0)
    assert s.logit_bias == ((2, -100.0), (28, -2.5))  # ascending ids; given twice, the last counts
    sources = {x.name: x.source for x in request.setting_sources}
    assert {sources[n] for n in ("repetition_penalty", "frequency_penalty", "presence_penalty")} == {"flag"}
    s.validate()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--tools", "no-such-file.json"], "--tools no-such-file.json: no such file"),
        (["--tools", "{bad}"], "--tools {bad}: not valid JSON"),
        (["--tools", "{list}"], "expected a JSON list of tools"),
        (["--tools", "{noname}"], 'tool [0] has no "name"'),
        (["--tools", "{params}"], '"parameters" must be a JSON schema object'),
        (["--tools", str(HOTELS), "--tool-choice", "book_flight"],
         "--tool-choice book_flight: no tool of that name in the --tools file (it has search_hotels)"),
        (["--tool-choice", "required"], "--tool-choice required: give the tools too"),
        (["--logit-bias", "5=300"], "the bias must be between -100 and 100"),
        (["--logit-bias", "5"], "give a bias after '='"),
        (["--logit-bias", "x=1"], "the token id must be a whole number"),
        (["--logit-bias", "49152=1"], "token 49152 is outside the vocabulary (0..49151)"),
        (["--repetition-penalty", "0"], "--repetition-penalty 0: give a value in (0, 2]"),
        (["--presence-penalty", "2.5"], "--presence-penalty 2.5: give a value between -2 and 2"),
        (["--json-schema", "{list}"], "a JSON schema is an object"),
        (["--json-schema", "{bad}"], "not valid JSON"),
        (["--chat-template", "no-such.jinja"], "--chat-template no-such.jinja: no such file"),
        (["--choice", "a,,b"], "an answer is empty"),
        (["--min-tokens", "300", "--max-tokens", "10"], "--min-tokens 300 is over max_tokens (10)"),
        (["--regex", "(("], "--regex ((: does not compile (at 1(8): invalid regex"),
        (["--json-schema", "{objekt}"], "the grammar library cannot compile it (Invalid type: objekt)"),
        (["--tools", "{objekt}"], "the parameters of f do not compile as a JSON schema (Invalid type: objekt)"),
        (["--regex", "a", "--choice", "a,b"], "not allowed with argument"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, default_model_dir, argv, needle):
    argv = list(argv)
    files = {"{bad}": "[{", "{list}": '"search_hotels"', "{noname}": '[{"type": "function", "function": {}}]',
             "{params}": '[{"type": "function", "function": {"name": "f", "parameters": "x"}}]',
             "{objekt}": '{"type": "objekt"}'}  # fmt: skip
    if argv[0] == "--tools" and argv[1] == "{objekt}":
        files["{objekt}"] = '[{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]'
    for i, word in enumerate(argv):
        if word in files:
            (tmp_path / f"{i}.json").write_text(files[word])
            argv[i] = str(tmp_path / f"{i}.json")
            needle = needle.replace(word, argv[i])
    try:  # --model: the vocabulary is read from its config.json before anything loads
        code = main(["run", "--plain", "--model", str(default_model_dir), *argv, "hi"])
    except SystemExit as exc:  # argparse's own errors (a bad ID=BIAS, two shapes at once)
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_argparse_errors_exit_2_too(capsys):
    with pytest.raises(SystemExit) as info:
        main(["run", "--logit-bias", "3=1e9", "hi"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--logit-bias" in err and err.count("\n") == 1
