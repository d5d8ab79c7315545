"""`reqscope --base-url URL`: one request against an OpenAI-compatible server, in plain or JSON mode.

The client first lists the server's models (which checks the URL and the key, picks the model
when `--model` is not given, and opens the connection the request then reuses unless
`--new-connection` asks for a fresh one), then streams the chat completion. The request carries
the messages of `request` and, of the sampling flags, only those the user gave.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from minengine.engine.request import GenerationRequest
from minengine.plan.planner import Plan
from minengine.record.export import prepare_export_folder
from reqscope.endpoint.events import ClientEvent, EndpointResult
from reqscope.endpoint.kv import architecture_for, planned_kv
from reqscope.endpoint.options import controls_from
from reqscope.endpoint.settings import RequestSettings
from reqscope.endpoint.target import EndpointTarget, model_name
from reqscope.endpoint.trace import EndpointTraceHeader, write_endpoint_trace


def run_endpoint(args: argparse.Namespace, request: GenerationRequest) -> int:
    """Run `request` against args.base_url; exit code 1 when the request failed, 2 for bad flags."""
    arch = architecture_for(args.card) if args.card else None
    if not (args.plain or args.json) and sys.stdout.isatty():
        if args.export:  # the explorer exports on `x`, each request to a new folder; never drop the flag silently
            print("reqscope: error: --export works with --plain or --json; in the explorer press x", file=sys.stderr)
            return 2
        from reqscope.ui.endpoint.launch import launch_endpoint_explorer  # the UI loads only when it is used

        return launch_endpoint_explorer(args, request, arch)

    def kv_plan_for(result: EndpointResult) -> Plan | None:
        if arch is None or result.usage is None:
            return None
        return planned_kv(arch, result.usage.prompt_tokens, result.usage.completion_tokens)

    if args.export:
        prepare_export_folder(args.export, force=args.force)  # before the request: a bad path wastes none
    result = asyncio.run(_run(args, request, kv_plan_for if arch is not None else None))
    if result.error:
        print(f"reqscope: error: {result.error}", file=sys.stderr)
        return 1
    return 0


async def _run(args: argparse.Namespace, request: GenerationRequest, kv_plan_for) -> EndpointResult:
    target = EndpointTarget.from_args(args)
    async with target.client() as client:
        model = await model_name(client, target)
        events = client.stream_chat(request, model, RequestSettings.from_args(args), controls_from(args, request))
        recorded: list[ClientEvent] = []
        if args.export:
            events = _recording(events, recorded)
        if args.json:
            from reqscope.endpoint.jsonl import print_endpoint_jsonl

            result = await print_endpoint_jsonl(events, kv_plan_for)
        else:
            from reqscope.endpoint.plain import print_endpoint_plain

            result = await print_endpoint_plain(events, kv_plan_for)
    if args.export:
        path = write_endpoint_trace(Path(args.export), EndpointTraceHeader(target.url, model), recorded)
        print(f"reqscope: exported {path} (reqscope replay {path})", file=sys.stderr)
    return result


async def _recording(events: AsyncIterator[ClientEvent], into: list[ClientEvent]) -> AsyncIterator[ClientEvent]:
    async for event in events:
        into.append(event)
        yield event

