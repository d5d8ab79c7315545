"""The flags that add tools, a grammar, penalties and logit bias to a run's request, read into its records.

`--min-tokens`, `--tools FILE`, `--tool-choice`, `--no-parallel-tool-calls`, `--no-generic-tools`, `--json-schema FILE`,
`--regex`, `--choice`, `--repetition-penalty`, `--frequency-penalty`, `--presence-penalty`, `--logit-bias ID=BIAS` and
`--chat-template FILE`, named as vLLM's request fields and server flags name them.

The parsed flags stay the words the user typed (paths, `ID=BIAS`), so `reqscope web` can hand them
on to each browser session unchanged; `read_request_flags` turns them into the request's records
and refuses bad input with one line that names the flag (`FlagError`, exit code 2, as argparse's).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from minengine.errors import RequestError
from minengine.sampling.params import MAX_ADDITIVE_PENALTY, MAX_LOGIT_BIAS, MAX_REPETITION_PENALTY
from minengine.sampling.structured import StructuredOutput
from minengine.text.tools import Tool, ToolChoice
from reqscope.argtypes import whole_number

TOOL_CHOICE_MODES = ("none", "auto", "required")


class FlagError(RequestError):
    """A flag's value (or the file it names) is wrong: a usage error, before any model loads."""

    exit_code = 2


def add_request_arguments(parser: argparse.ArgumentParser) -> None:
    """The tools, structured-output, penalty, bias and chat-template flags (shared by run and web)."""
    t = parser.add_argument_group("tools and structured output")
    t.add_argument(
        "--tools", metavar="FILE",
        help='a JSON file holding a list of OpenAI tools, each {"type": "function", "function": {"name", '
        '"description", "parameters"}} (examples/search_hotels.json)',
    )  # fmt: skip
    t.add_argument(
        "--tool-choice", metavar="none|auto|required|NAME",
        help="how the model may use the tools: not at all, freely, at least one call, or the named function "
        "(required and a name are enforced by a grammar) (default: auto with --tools)",
    )  # fmt: skip
    t.add_argument(
        "--no-parallel-tool-calls", dest="parallel_tool_calls", action="store_false", default=True,
        help="at most one tool call in the reply, as OpenAI's parallel_tool_calls: false (default: several allowed)",
    )  # fmt: skip
    t.add_argument(
        "--no-generic-tools", dest="generic_tools", action="store_false", default=True,
        help="refuse tools when the chat template has no tool syntax, instead of writing reqscope's own tools "
        "block (default: the block is written, and labelled as reqscope's)",
    )  # fmt: skip
    shape = t.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", help="a JSON schema file the answer must follow (a grammar)")
    shape.add_argument("--regex", metavar="PATTERN", help="a regular expression the answer must match (a grammar)")
    shape.add_argument("--choice", metavar="A,B,C", help="the answer must be one of these comma-separated texts")
    t.add_argument(
        "--chat-template", metavar="FILE",
        help="a Jinja chat template file used instead of the model's own, as vLLM and llama-server take it",
    )  # fmt: skip
    p = parser.add_argument_group("min tokens, bias and penalties (after the grammar, before temperature, as vLLM)")
    p.add_argument(
        "--min-tokens", type=whole_number, metavar="N",
        help="mask the end of turn (and EOS) until N tokens are out, as vLLM's min_tokens (default: 0)",
    )  # fmt: skip
    p.add_argument(
        "--repetition-penalty", type=float, metavar="R",
        help=f"divide positive logits and multiply negative ones of every token already in the prompt or the "
        f"output by R, as transformers does; in (0, {MAX_REPETITION_PENALTY:g}], 1 = off (default: 1)",
    )  # fmt: skip
    p.add_argument(
        "--frequency-penalty", type=float, metavar="F",
        help=f"subtract F x (times the token was output) from its logit; in [-{MAX_ADDITIVE_PENALTY:g}, "
        f"{MAX_ADDITIVE_PENALTY:g}], 0 = off (default: 0)",
    )  # fmt: skip
    p.add_argument(
        "--presence-penalty", type=float, metavar="P",
        help=f"subtract P from the logit of every token already output; in [-{MAX_ADDITIVE_PENALTY:g}, "
        f"{MAX_ADDITIVE_PENALTY:g}], 0 = off (default: 0)",
    )  # fmt: skip
    p.add_argument(
        "--logit-bias", action="append", default=[], metavar="ID=BIAS", type=bias_word,
        help=f"add BIAS (-{MAX_LOGIT_BIAS:g}..{MAX_LOGIT_BIAS:g}) to token ID's logit (repeatable)",
    )  # fmt: skip


def bias_word(text: str) -> str:
    """`ID=BIAS` checked as typed (argparse `type=`); kept as the text, so it can be passed on as given."""
    parse_bias(text, error=argparse.ArgumentTypeError)
    return text


def parse_bias(text: str, error: type[Exception] = RequestError) -> tuple[int, float]:
    """`(id, bias)` from `ID=BIAS`; `error` names what is wrong."""
    token, sep, value = text.partition("=")
    try:
        token_id = int(token.strip())
    except ValueError:
        raise error(f"{text!r} is not ID=BIAS: the token id must be a whole number (as 2=-100)") from None
    if not sep:
        raise error(f"{text!r} is not ID=BIAS: give a bias after '=' (as {token_id}=5)")
    try:
        bias = float(value)
    except ValueError:
        raise error(f"{text!r} is not ID=BIAS: the bias must be a number (as {token_id}=5)") from None
    if token_id < 0:
        raise error(f"{text!r}: the token id must be 0 or more")
    if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # also refuses nan
        raise error(f"{text!r}: the bias must be between {-MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}, as OpenAI's")
    return token_id, bias


@dataclass(frozen=True)
class RequestFlags:
    """What the flags add to a request: its tools, how it may choose them, its grammar, its logit bias."""

    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    parallel_tool_calls: bool = True
    generic_tools: bool = True
    structured: StructuredOutput | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()


def read_request_flags(args: argparse.Namespace, vocab_size: int | None = None) -> RequestFlags:
    """The flags' records, read and checked; FlagError names the flag and what to do.

    `vocab_size`, when known before the model loads, bounds `--logit-bias` ids.
    """
    tools = read_tools(args.tools) if getattr(args, "tools", None) else ()
    choice = _tool_choice(getattr(args, "tool_choice", None), tools)
    structured = _structured(args)
    _check_compiles(args, tools, structured)
    if getattr(args, "chat_template", None):  # read by the engine's tokenizer once it loads; checked before
        _check_template(args.chat_template)
    return RequestFlags(
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=getattr(args, "parallel_tool_calls", True),
        generic_tools=getattr(args, "generic_tools", True),
        structured=structured,
        logit_bias=_bias(getattr(args, "logit_bias", []), vocab_size),
    )


def read_tools(path: str) -> tuple[Tool, ...]:
    """The tools in a JSON file of OpenAI tool objects (a list, or one object)."""
    raw = _read_json(path, "--tools")
    items = [raw] if isinstance(raw, dict) else raw
    if not isinstance(items, list) or not items:
        raise FlagError(f'--tools {path}: expected a JSON list of tools, each {{"type": "function", "function": '
                        '{"name": ..., "parameters": {...}}}')  # fmt: skip
    tools: list[Tool] = []
    for i, item in enumerate(items):
        where = f"--tools {path}: tool [{i}]"
        if not isinstance(item, dict) or item.get("type", "function") != "function":
            raise FlagError(f'{where} is not {{"type": "function", "function": {{...}}}}')
        function = item.get("function", item)  # the older bare function object reads too
        if not isinstance(function, dict):
            raise FlagError(f'{where}: "function" must be an object with a "name"')
        name = function.get("name")
        if not isinstance(name, str) or not name.strip():
            raise FlagError(f'{where} has no "name"; give each function a name')
        description = function.get("description", "")
        if not isinstance(description, str):
            raise FlagError(f'{where} ({name}): "description" must be text')
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise FlagError(f'{where} ({name}): "parameters" must be a JSON schema object')
        if name in (t.name for t in tools):
            raise FlagError(f"{where}: the name {name!r} is given twice; names must be unique")
        tools.append(Tool(name, description, json.dumps(parameters)))
    return tuple(tools)


def _tool_choice(text: str | None, tools: tuple[Tool, ...]) -> ToolChoice:
    if text is None:
        return ToolChoice("auto")
    if not tools:
        raise FlagError(f"--tool-choice {text}: give the tools too (--tools FILE)")
    if text in TOOL_CHOICE_MODES:
        return ToolChoice(text)  # type: ignore[arg-type]  # checked just above
    names = [t.name for t in tools]
    if text not in names:
        raise FlagError(f"--tool-choice {text}: no tool of that name in the --tools file (it has "
                        f"{', '.join(names)}); or give one of {', '.join(TOOL_CHOICE_MODES)}")  # fmt: skip
    return ToolChoice("function", text)


def _structured(args: argparse.Namespace) -> StructuredOutput | None:
    if getattr(args, "json_schema", None):
        schema = _read_json(args.json_schema, "--json-schema")
        if not isinstance(schema, dict):
            raise FlagError(f"--json-schema {args.json_schema}: a JSON schema is an object ({{...}}), "
                            f"not {type(schema).__name__}")  # fmt: skip
        return StructuredOutput("json_schema", spec=json.dumps(schema), name=Path(args.json_schema).stem)
    if getattr(args, "regex", None) is not None:
        if not args.regex:
            raise FlagError("--regex: the pattern is empty")
        return StructuredOutput("regex", spec=args.regex)
    if getattr(args, "choice", None) is not None:
        choices = tuple(c.strip() for c in args.choice.split(","))
        if not all(choices):
            raise FlagError(f"--choice {args.choice!r}: an answer is empty; give texts separated by commas")
        return StructuredOutput("choice", choices=choices)
    return None


def _check_compiles(args: argparse.Namespace, tools: tuple[Tool, ...], structured: StructuredOutput | None) -> None:
    """What a grammar will be built from compiles (llguidance, no tokenizer needed): refused here, before the
    model loads, by the flag that gave it. The engine compiles the whole grammar again when the request comes."""
    if not tools and (structured is None or structured.kind == "choice"):
        return  # nothing to compile: the grammar library (and torch with it) stays unloaded, as --base-url needs
    from reqscope.openai.grammar_check import grammar_problem  # llguidance: only when there is something to check

    for tool in tools:
        problem = grammar_problem("json_schema", tool.parameters)
        if problem:
            raise FlagError(f"--tools {args.tools}: the parameters of {tool.name} do not compile as a JSON schema "
                            f"({problem})")  # fmt: skip
    if structured is None or structured.kind == "choice":
        return
    problem = grammar_problem("json_schema" if structured.kind == "json_schema" else "regex", structured.spec)
    if problem and structured.kind == "json_schema":
        raise FlagError(f"--json-schema {args.json_schema}: the grammar library cannot compile it ({problem})")
    if problem:
        raise FlagError(f"--regex {structured.spec}: does not compile ({problem})")


def _bias(words: list[str], vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    pairs: dict[int, float] = {}
    for word in words:
        token_id, bias = parse_bias(word, FlagError)
        if vocab_size is not None and token_id >= vocab_size:
            raise FlagError(f"--logit-bias {word}: token {token_id} is outside the vocabulary (0..{vocab_size - 1})")
        pairs[token_id] = bias  # given twice: the last one counts, as a JSON object's key would
    return tuple(sorted(pairs.items()))


def check_penalties(args: argparse.Namespace) -> None:
    """The penalty flags within vLLM's ranges, named by their flags (before any model loads)."""
    r = getattr(args, "repetition_penalty", None)
    if r is not None and not 0 < r <= MAX_REPETITION_PENALTY:
        raise FlagError(f"--repetition-penalty {r:g}: give a value in (0, {MAX_REPETITION_PENALTY:g}] (1 = off)")
    for flag in ("frequency_penalty", "presence_penalty"):
        value = getattr(args, flag, None)
        if value is not None and not -MAX_ADDITIVE_PENALTY <= value <= MAX_ADDITIVE_PENALTY:
            raise FlagError(f"--{flag.replace('_', '-')} {value:g}: give a value between {-MAX_ADDITIVE_PENALTY:g} "
                            f"and {MAX_ADDITIVE_PENALTY:g} (0 = off)")  # fmt: skip


def _read_text(path: str, flag: str) -> str:
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FlagError(f"{flag} {path}: no such file") from None
    except IsADirectoryError:
        raise FlagError(f"{flag} {path}: is a folder; give a file") from None
    except UnicodeDecodeError:
        raise FlagError(f"{flag} {path}: not UTF-8 text") from None
    except OSError as exc:
        raise FlagError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None


def _check_template(path: str) -> None:
    if not _read_text(path, "--chat-template").strip():
        raise FlagError(f"--chat-template {path}: the file is empty; give a Jinja chat template")


def _read_json(path: str, flag: str) -> object:
    text = _read_text(path, flag)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise FlagError(f"{flag} {path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
