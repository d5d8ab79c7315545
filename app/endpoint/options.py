"""The flags of endpoint mode (`reqscope --base-url URL`), kept apart so parsing imports no HTTP code.

`--base-url` is the OpenAI client's and `vllm bench serve`'s name for the server's address (on
`bench serve`, `--endpoint` is the route, as in vLLM); `--card` names the served model's shape as
`reqscope plan --card` does. The old `--endpoint URL` and `--config MODEL` still work, with a warning.
"""

from __future__ import annotations

import argparse

from minengine.engine.request import GenerationRequest
from minengine.settings import CLIENT_API_KEY_ENV
from reqscope.argtypes import non_negative, whole_number
from reqscope.endpoint.controls import PENALTIES, OutputControls
from reqscope.flag_aliases import deprecated_alias

DEFAULT_POLL_MS = 500.0  # twice a second: the batch's changes show, and the server barely notices


def add_endpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """--base-url, --api-key, --new-connection, --card, --logprobs/--no-logprobs, --poll-ms and --otlp-listen."""
    e = parser.add_argument_group(
        "endpoint (run against an OpenAI-compatible server)",
        "With --base-url, a sampling flag not given (temperature, top-k, top-p, min-p, seed, max-tokens) "
        "is left out of the request, so the server's default applies.",
    )
    e.add_argument(
        "--base-url", metavar="URL", help="run the request on this OpenAI-compatible server, e.g. "
        "http://127.0.0.1:8000/v1 (a bare http://HOST:PORT gets /v1, as bench serve's --base-url; --model is then "
        "the served model's name)",
    )  # fmt: skip
    deprecated_alias(e, "--endpoint", "--base-url")
    e.add_argument("--api-key", metavar="KEY", help=f"bearer token for the server (default: ${CLIENT_API_KEY_ENV})")
    e.add_argument("--new-connection", action="store_true", help="open a fresh connection for the request")
    e.add_argument(
        "--card", metavar="MODEL", help="the served model's shape, for the planner's KV figures: a card name "
        "(`reqscope plan --list-cards`), model folder or config.json",
    )  # fmt: skip
    deprecated_alias(e, "--config", "--card")
    # Off by default: computing logprobs slows some servers several times over, which would
    # disturb the very latency this mode measures.
    e.add_argument(
        "--logprobs",
        type=whole_number,  # 0 asks for the chosen token's logprob only
        metavar="N",
        help="ask the server for logprobs with the top N alternatives per token (0: the chosen token's only); "
        "this can slow the server, and the outputs say so (default: off)",
    )
    e.add_argument(
        "--no-logprobs", dest="logprobs", action="store_const", const=None,
        help="ask for no logprobs, undoing an earlier --logprobs (default: none asked)",
    )  # fmt: skip
    e.add_argument(
        "--poll-ms",
        type=non_negative,
        default=DEFAULT_POLL_MS,
        metavar="MS",
        help="read the server's /metrics (and llama-server's /slots) this often while the request runs, to show "
        "the batch around it; each read's cost is shown (0: never)",
    )
    e.add_argument(
        "--otlp-listen",
        type=host_port,
        metavar="HOST:PORT",
        help="receive the server's trace spans here (OTLP/HTTP): start vLLM with "
        "--otlp-traces-endpoint http://HOST:PORT/v1/traces and OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf",
    )


def host_port(text: str) -> tuple[str, int]:
    """HOST:PORT for a listening socket (argparse type)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, such as 127.0.0.1:4318 (got {text!r})")
    return host.strip("[]"), int(port)


def controls_from(args: argparse.Namespace, request: GenerationRequest) -> OutputControls:
    """The output controls to send: those `request` carries (the shared flags --tools, --tool-choice,
    --json-schema, --regex, the penalties and --logit-bias build them into it), a penalty or the tool
    choice also when its flag was given with the neutral value (it then overrides a server default)."""
    given = [name for name in (*PENALTIES, "tool_choice") if getattr(args, name, None) is not None]
    return OutputControls.of(request, given)
