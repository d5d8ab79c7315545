"""`reqscope bench serve`: the flags, named as `vllm bench serve` names them, and the run they start.

Prompts are made with the tokenizer of a local model folder (`--tokenizer`; by default
`--model` when it is one, else the default model's, which is what `reqscope serve` serves);
the server's own token counts, from `usage`, are the ones the summary adds up. The summary
goes to stdout (or the result as JSON with `--json`), the progress bar to stderr. With
`--response-format`/`--json-schema`, every request asks for structured output and every answer
is checked against it once the run is over (`answers`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path
from urllib.parse import urlsplit

from minengine.errors import ReqscopeError
from minengine.hub.pull import default_model_dir
from minengine.progress import PullProgress
from minengine.settings import CLIENT_API_KEY_ENV, read_env
from reqscope.argtypes import non_negative, positive, positive_whole_number, whole_number
from reqscope.bench.serve.arrivals import send_offsets
from reqscope.bench.serve.load import LoadPlan, run_load
from reqscope.bench.serve.prompts import (
    PromptShape,
    load_tokenizer,
    output_lens_from,
    random_prompts,
    with_output_lens,
)
from reqscope.bench.serve.response_format import FORMATS, json_schema_file, structured_from_flags
from reqscope.bench.serve.stream import CHAT_SUFFIX, RequestTarget
from reqscope.bench.serve.summary import BenchSetup, result_dict, summarize, summary_block
from reqscope.console.progress_line import ProgressLine
from reqscope.endpoint.settings import token_limit_field
from reqscope.endpoint.target import EndpointTarget, model_name

DESCRIPTION = "drive concurrent streaming requests at an OpenAI-compatible server (as `vllm bench serve`)"
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def request_rate(text: str) -> float:
    """Requests per second, > 0, or `inf` (every request at once)."""
    if text.strip().lower() in ("inf", "infinity"):
        return math.inf
    return positive(text)


def completions_route(text: str) -> str:
    """A route of OpenAI's completions API: /v1/completions or /v1/chat/completions."""
    route = "/" + text.strip().strip("/")
    if not route.endswith("/completions"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a completions route; give {' or '.join(ENDPOINTS)}")
    return route


def range_ratio(text: str) -> float:
    """A ratio in [0, 1)."""
    value = non_negative(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"{text} must be below 1")
    return value


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `reqscope bench serve`."""
    # The verb's help formatter ends each line with its default, unless the help says it in words.
    t = parser.add_argument_group("server")
    t.add_argument("--base-url", metavar="URL", default="http://127.0.0.1:8000", help="the server, without the route")
    t.add_argument(
        "--endpoint",
        metavar="ROUTE",
        type=completions_route,
        default=ENDPOINTS[0],
        help=f"the route: {' or '.join(ENDPOINTS)}",
    )
    t.add_argument("--model", metavar="NAME", help="the model the requests name (default: the first the server lists)")
    t.add_argument("--api-key", metavar="KEY", help=f"bearer token (default: ${CLIENT_API_KEY_ENV})")
    t.add_argument(
        "--timeout", metavar="S", type=positive, default=600.0, help="seconds without new bytes before a request fails"
    )
    d = parser.add_argument_group("prompts (vLLM's random dataset)")
    d.add_argument(
        "--tokenizer",
        metavar="FOLDER",
        help="a model folder with the server's tokenizer.json (default: --model when it is a folder, "
        "else the default model's)",
    )
    d.add_argument("--num-prompts", metavar="N", type=positive_whole_number, default=100, help="requests to send")
    length = {"type": positive_whole_number, "metavar": "N"}
    d.add_argument("--input-len", "--random-input-len", dest="input_len", default=1024, help="prompt tokens", **length)
    d.add_argument("--output-len", "--random-output-len", dest="output_len", default=128, help="tokens out", **length)
    d.add_argument(
        "--random-range-ratio", metavar="R", type=range_ratio, default=0.0, help="lengths drawn from [L(1-r), L(1+r)]"
    )
    d.add_argument(
        "--random-prefix-len", metavar="N", type=whole_number, default=0, help="random tokens every prompt starts with"
    )
    d.add_argument(
        "--output-lens-from",
        metavar="FILE",
        type=Path,
        help="each request generates the tokens the same request did in an earlier run (its --output FILE), "
        "so that two runs do the same work: a structured run against plain text, say",
    )
    d.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="send ignore_eos, so each request generates --output-len tokens, as vLLM, llama-server and reqscope "
        "serve take it (default: on, but off with --response-format: a structured answer ends where its JSON does)",
    )
    d.add_argument(
        "--temperature", metavar="T", type=non_negative, default=0.0, help="sampling temperature sent (0: greedy)"
    )
    d.add_argument("--seed", metavar="N", type=whole_number, default=0, help="seed of the prompts and the arrivals")
    d.add_argument(
        "--time-every-chunk",
        action="store_true",
        help="time every chunk that carries a choice, as vLLM's client does, empty text included "
        "(default: the chunks with visible text)",
    )
    s = parser.add_argument_group("structured output (checked: every answer is validated after the run)")
    s.add_argument(
        "--response-format",
        choices=FORMATS,
        help="send response_format of this type; json_object answers must parse as a JSON object "
        "(default: plain text, unchecked; json_schema with --json-schema)",
    )
    s.add_argument(
        "--json-schema",
        metavar="FILE",
        type=json_schema_file,
        help="a JSON schema (or OpenAI's json_schema object around one), sent strict; every answer is validated "
        "against it with jsonschema (default: none)",
    )
    a = parser.add_argument_group("load")
    a.add_argument(
        "--request-rate",
        metavar="RPS",
        type=request_rate,
        default=math.inf,
        help="requests per second, Poisson arrivals (default: inf, every request at once)",
    )
    a.add_argument(
        "--burstiness", metavar="K", type=positive, default=1.0, help="gamma shape of the arrival gaps: 1 is Poisson"
    )
    a.add_argument(
        "--max-concurrency", metavar="N", type=positive_whole_number, help="at most this many requests in flight"
    )
    a.add_argument(
        "--num-warmups", metavar="N", type=whole_number, default=0, help="uncounted requests sent one by one first"
    )
    o = parser.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the result as one JSON object instead of the summary")
    o.add_argument("--output", "--result-filename", dest="output", metavar="FILE", help="write the JSON result to FILE")


def route_url(base_url: str, endpoint: str) -> str:
    """The full URL of the route; a base URL that already ends in /v1 is not given a second one."""
    base = base_url.rstrip("/")
    if not urlsplit(base).scheme.startswith("http") or not urlsplit(base).netloc:
        raise ReqscopeError(f"--base-url {base_url!r} is not an http(s) URL; give e.g. http://127.0.0.1:8000")
    route = "/" + endpoint.strip("/")
    if base.endswith("/v1") and route.startswith("/v1/"):
        route = route[len("/v1") :]
    return base + route


def api_root(url: str) -> str:
    """The OpenAI base (…/v1) of a route URL, where GET /models is."""
    for suffix in (CHAT_SUFFIX, "/completions"):
        if url.endswith(suffix):
            return url[: -len(suffix)]
    return url.rsplit("/", 1)[0]


def tokenizer_folder(args: argparse.Namespace) -> Path:
    """--tokenizer, else --model when it names a local folder, else the default model's folder."""
    if args.tokenizer:
        return Path(args.tokenizer).expanduser()
    if args.model and Path(args.model).expanduser().is_dir():
        return Path(args.model).expanduser()
    return default_model_dir()


def run(args: argparse.Namespace) -> int:
    """Run the load and print its summary (or its JSON); 0 even when requests failed, as vLLM does."""
    setup, plan = plan_from_args(args)
    bar = _RequestsBar()
    result = summarize(setup, run_load(plan, bar))
    bar.line.close()
    text = json.dumps(result_dict(result))
    print(text if args.json else summary_block(result), flush=True)
    if args.output:
        _save(Path(args.output).expanduser(), text)
    return 0


def plan_from_args(args: argparse.Namespace) -> tuple[BenchSetup, LoadPlan]:
    """What the flags ask for, and the requests that do it (the model is asked of the server when not given)."""
    url = route_url(args.base_url, args.endpoint)
    api_key = args.api_key or read_env(CLIENT_API_KEY_ENV) or None
    try:
        structured = structured_from_flags(args.response_format, args.json_schema)
    except ValueError as exc:
        raise ReqscopeError(str(exc)) from None
    # A grammar ends its answer with the end of turn; ignoring it would run on past the JSON.
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else structured is None
    folder = tokenizer_folder(args)
    tokenizer = load_tokenizer(folder)
    model = args.model or _listed_model(api_root(url), api_key)
    shape = PromptShape(args.input_len, args.output_len, args.random_range_ratio, args.random_prefix_len)
    prompts = random_prompts(tokenizer, shape, args.num_warmups + args.num_prompts, args.seed)
    if args.output_lens_from is not None:
        lens = output_lens_from(args.output_lens_from.expanduser(), args.num_prompts)
        prompts = prompts[: args.num_warmups] + with_output_lens(prompts[args.num_warmups :], lens)
    target = RequestTarget(
        url=url,
        model=model,
        headers=(("Authorization", f"Bearer {api_key}"),) if api_key else (),
        token_limit_field=token_limit_field(url),
        ignore_eos=ignore_eos,
        temperature=args.temperature,
        every_chunk=args.time_every_chunk,
        structured=structured,
    )
    plan = LoadPlan(
        target=target,
        prompts=prompts[args.num_warmups :],
        offsets_s=send_offsets(args.num_prompts, args.request_rate, args.burstiness, args.seed),
        max_concurrency=args.max_concurrency,
        warmup_prompts=prompts[: args.num_warmups],
        timeout_s=args.timeout,
    )
    setup = BenchSetup(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=model,
        tokenizer=str(folder),
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        every_chunk=args.time_every_chunk,
        structured=structured,
        output_lens_from=None if args.output_lens_from is None else str(args.output_lens_from),
    )
    return setup, plan


class _RequestsBar:
    """The requests ended so far, as a progress line on stderr; its clock starts after any warm-up."""

    def __init__(self) -> None:
        self.line = ProgressLine(prefix="bench serve: ")
        self.started: float | None = None

    def __call__(self, ended: int, total: int) -> None:
        self.started = self.started if self.started is not None else time.monotonic()
        self.line(PullProgress("requests", ended, total, "", "requests", self.started, finished=ended == total))


def _save(path: Path, text: str) -> None:
    try:
        path.write_text(text + "\n", encoding="utf-8")
    except OSError as exc:
        raise ReqscopeError(f"cannot write --output {path}: {exc.strerror or exc}") from None


def _listed_model(root: str, api_key: str | None) -> str:
    async def ask() -> str:
        target = EndpointTarget(root, api_key=api_key)
        async with target.client() as client:
            return await model_name(client, target)

    return asyncio.run(ask())
