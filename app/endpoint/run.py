"""`reqscope --endpoint URL`: one request against an OpenAI-compatible server, in plain or JSON mode.

The client first lists the server's models (which checks the URL and the key, picks the model
when `--model` is not given, and opens the connection the request then reuses unless
`--new-connection` asks for a fresh one), then streams the chat completion. The request carries
the messages of `request` and, of the sampling flags, only those the user gave.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from minengine.engine.request import GenerationRequest
from minengine.plan.planner import Plan
from reqscope.endpoint.events import EndpointResult
from reqscope.endpoint.kv import architecture_for, planned_kv
from reqscope.endpoint.settings import RequestSettings
from reqscope.endpoint.target import EndpointTarget, model_name


def run_endpoint(args: argparse.Namespace, request: GenerationRequest) -> int:
    """Run `request` against args.endpoint; exit code 1 when the request failed, 2 for bad flags."""
    if args.export:
        print("reqscope: error: --export is not available with --endpoint", file=sys.stderr)
        return 2
    arch = architecture_for(args.config) if args.config else None
    if not (args.plain or args.json) and sys.stdout.isatty():
        from reqscope.ui.endpoint.launch import launch_endpoint_explorer  # the UI loads only when it is used

        return launch_endpoint_explorer(args, request, arch)

    def kv_plan_for(result: EndpointResult) -> Plan | None:
        if arch is None or result.usage is None:
            return None
        return planned_kv(arch, result.usage.prompt_tokens, result.usage.completion_tokens)

    result = asyncio.run(_run(args, request, kv_plan_for if arch is not None else None))
    if result.error:
        print(f"reqscope: error: {result.error}", file=sys.stderr)
        return 1
    return 0


async def _run(args: argparse.Namespace, request: GenerationRequest, kv_plan_for) -> EndpointResult:
    target = EndpointTarget.from_args(args)
    async with target.client() as client:
        model = await model_name(client, target)
        events = client.stream_chat(request, model, RequestSettings.from_args(args))
        if args.json:
            from reqscope.endpoint.jsonl import print_endpoint_jsonl

            return await print_endpoint_jsonl(events, kv_plan_for)
        from reqscope.endpoint.plain import print_endpoint_plain

        return await print_endpoint_plain(events, kv_plan_for)

