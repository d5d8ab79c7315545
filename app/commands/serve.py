"""`reqscope serve`: an OpenAI-compatible HTTP server on minengine.

Binds to 127.0.0.1 unless told otherwise. Up to --max-num-seqs requests decode together, in
shared engine steps; others wait in a bounded queue (503 once it is full). Each finished
request's telemetry goes to `--telemetry FILE` as a JSON line, and its access-log line to
stderr (`--log-level`). Stop with Ctrl-C.

A keyless server is the default on loopback, but an *empty* `--api-key ""` (typically an unset
shell variable) is refused: it reads as "protect this server" and would silently give an open
one. Slow clients are bounded by the header, body and keep-alive timeouts and a connection cap.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from minengine.errors import ReqscopeError
from minengine.kv.arithmetic import KIB, MIB
from minengine.sampling.params import SamplingParams
from minengine.settings import SERVE_API_KEY_ENV, read_env
from reqscope.argtypes import non_negative, positive, positive_whole_number, whole_number
from reqscope.engine_flags import add_engine_arguments
from reqscope.flag_aliases import deprecated_alias
from reqscope.loopback import listens_on_loopback
from reqscope.run_options import ModelFolder, add_prefix_cache_argument, open_engine, stderr_progress
from reqscope.serve.access import LOG_LEVELS, configure_logging
from reqscope.serve.app import ServeConfig, build_app
from reqscope.serve.connections import ConnectionLimits
from reqscope.serve.gateway import GatewayConfig
from reqscope.serve.runner import serve_forever
from reqscope.serve.telemetry import TelemetryLog

# KV pages written at start (on the CPU): 32 streams of about 360 tokens each with the default
# model's float32 KV (`Engine.prefault_kv`; docs/serving.md, "Pages written at start").
RESIDENT_KV_BYTES = 512 * MIB


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Model, network, gateway and telemetry flags."""
    m = parser.add_argument_group("model")
    add_engine_arguments(m, "model")
    m.add_argument("--served-model-name", metavar="NAME", help="name clients pass as `model` (default: folder name)")
    add_engine_arguments(
        m, "device", "dtype", "weights", "kernels", "kv_budget_mib", "max_num_seqs", "max_num_batched_tokens"
    )
    add_prefix_cache_argument(m)
    m.add_argument(
        "--sampler-order", default="vllm", metavar="ORDER", help="hf, llama.cpp, vllm or a comma list"
    )
    m.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template file used instead of the model's own (as vLLM and llama-server take it)",
    )
    m.add_argument(
        "--no-generic-tools",
        dest="generic_tools",
        action="store_false",
        default=True,
        help="refuse tools when the template has no tool syntax (default: reqscope writes its own tools block)",
    )
    m.add_argument(
        "--max-tokens",
        type=positive_whole_number,
        default=256,
        help="the max_tokens of a request that sets none (`reqscope run` and vLLM's clients call a request's own "
        "limit --max-tokens too)",
    )
    deprecated_alias(m, "--default-max-tokens", "--max-tokens")
    n = parser.add_argument_group("network")
    n.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    n.add_argument("--port", type=whole_number, default=8000, help="port (0 picks a free one)")
    g = parser.add_argument_group("gateway")
    g.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help=f"require this bearer token (repeatable; also ${SERVE_API_KEY_ENV})",
    )
    g.add_argument(
        "--rate-limit",
        type=non_negative,
        default=0.0,
        help="requests per minute per key (0 = off: a load tool's burst is not refused)",
    )
    g.add_argument(
        "--rate-burst",
        type=positive_whole_number,
        default=20,
        help="requests allowed at once per key",
    )
    g.add_argument(
        "--max-body-kib",
        type=positive_whole_number,
        default=1024,
        help="largest request body in KiB",
    )
    g.add_argument(
        "--max-queue",
        type=whole_number,
        help="requests that may wait for admission (default: as many as the KV pool could hold at one block each)",
    )
    limits = ConnectionLimits()
    c = parser.add_argument_group("connections")
    for flag, default, text in (
        ("--header-timeout", limits.header_timeout_s,
         "a client has to send a request's line and headers; then 408 and close"),
        ("--body-timeout", limits.body_timeout_s, "a client has to send a request's whole body; then 408 and close"),
        ("--keepalive-timeout", limits.keepalive_timeout_s, "an idle connection stays open between requests"),
        ("--write-timeout", limits.write_timeout_s, "a streamed response may wait for a client that stopped reading; "
         "then the connection is closed and its request cancelled"),
    ):  # fmt: skip
        c.add_argument(flag, type=positive, default=default, metavar="S", help=f"seconds {text}")
    c.add_argument(
        "--max-connections",
        type=positive_whole_number,
        default=limits.max_connections,
        help="open connections at once; requests on any beyond get 503 and are closed",
    )
    parser.add_argument("--telemetry", metavar="FILE", help="append one JSON telemetry line per finished request")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=LOG_LEVELS,
        help="log on stderr from this level up; info includes one access line per request",
    )


def run(args: argparse.Namespace) -> int:
    """Load the model and serve until interrupted."""
    if args.port > 65535:
        print(f"reqscope: error: --port {args.port} is not a TCP port (0-65535)", file=sys.stderr)
        return 2
    keys = _api_keys(args.api_key, read_env(SERVE_API_KEY_ENV) or "")
    if isinstance(keys, str):
        print(f"reqscope: error: {keys}", file=sys.stderr)
        return 2
    order = SamplingParams.parse_order(args.sampler_order)
    template = Path(args.chat_template) if args.chat_template else None
    if template is not None and not template.is_file():
        print(
            f"reqscope: error: --chat-template {template} is not a file; give a Jinja chat template file",
            file=sys.stderr,
        )
        return 2
    configure_logging(args.log_level)
    engine = open_engine(args, ModelFolder.of(args), progress=stderr_progress)
    if template is not None:
        engine.tokenizer.use_chat_template_file(template)
    # The KV pages the first requests take are written now, not inside their first decode steps.
    resident = engine.prefault_kv(RESIDENT_KV_BYTES)
    config = ServeConfig(
        model_name=args.served_model_name or engine.model_dir.name,
        gateway=GatewayConfig(
            api_keys=keys,
            max_body_bytes=args.max_body_kib * KIB,
            rate_per_minute=args.rate_limit or None,
            rate_burst=args.rate_burst,
            loopback_hosts_only=not keys and listens_on_loopback(args.host),
        ),
        sampler_order=order,
        default_max_tokens=args.max_tokens,
        generic_tools=args.generic_tools,
        max_queue=args.max_queue,
        limits=ConnectionLimits(
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            keepalive_timeout_s=args.keepalive_timeout,
            write_timeout_s=args.write_timeout,
            max_connections=args.max_connections,
        ),
    )
    app = build_app(engine, config, TelemetryLog(args.telemetry))
    if not keys and not listens_on_loopback(args.host):
        stderr_progress(f"warning: listening on {args.host} without --api-key; anyone who can reach it can use it")

    def ready(url: str) -> None:
        auth = "API key required" if keys else "no API key"
        stderr_progress(
            f"serving {config.model_name!r} at {url}/v1 ({engine.describe()}; "
            f"up to {engine.steps.limits.max_num_seqs} requests decode together, "
            f"queue {engine.scheduler.max_queue}; {resident // MIB} MiB of KV pages written; {auth}); Ctrl-C stops"
        )

    try:
        asyncio.run(serve_forever(app, args.host, args.port, ready))
    except KeyboardInterrupt:
        print("reqscope: stopped", file=sys.stderr)
    except OSError as exc:  # the port is taken, or the address is not this machine's
        reason = exc.strerror or exc
        raise ReqscopeError(f"cannot listen on {args.host}:{args.port}: {reason}; pick another --port") from None
    return 0


def _api_keys(flags: list[str], env: str) -> frozenset[str] | str:
    """The keys to require, or why they cannot be used.

    An empty environment variable counts as unset; an empty flag does not, since
    `--api-key "$KEY"` with KEY unset means a key was intended. A key with surrounding spaces
    could never match: the bearer token is read trimmed.
    """
    given = [(key, "--api-key", "leave the flag out") for key in flags]
    if env:
        given.append((env, f"${SERVE_API_KEY_ENV}", "unset it"))
    for key, where, keyless in given:
        if not key.strip():
            return f"{where} is empty (an unset shell variable?); give a key, or {keyless} to serve without one"
        if key != key.strip():
            return f"{where} has spaces around it, which a bearer token cannot carry; remove them"
    return frozenset([*flags, *([env] if env else [])])
