"""`detect_server` on the pages real servers sent (tests/endpoint/recorded_server.py), no server needed.

vLLM is told by the `vllm:` names on its /metrics and versioned by its /version; llama-server by
its /props (its /version is a 404), with the build it names there; llama-cpp-python's server, which
answers 404 to all three, is a server the client cannot read. The live tests
(test_server_view_vllm.py, test_server_view_llama.py) check the same against the running servers.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from recorded_server import replaying

from reqscope.endpoint.server.detect import detect_server
from reqscope.endpoint.server.poller import pollable
from reqscope.endpoint.server.records import LLAMA_SERVER, UNKNOWN, VLLM, ServerKind


def _detect(base_url: str) -> ServerKind:
    async def run() -> ServerKind:
        async with aiohttp.ClientSession() as session:
            return await detect_server(session, base_url, {})

    return asyncio.run(run())


@pytest.mark.parametrize("suffix", ["/v1", "", "/v1/"])
def test_vllm_is_told_by_its_metrics_and_named_with_its_version(suffix):
    with replaying("vllm") as replay:
        kind = _detect(replay.root + suffix)
        version = replay.recording.get["/version"].json()["version"]
    assert kind == ServerKind(VLLM, version, replay.root) and version == "0.32.0"
    assert pollable(kind)


def test_llama_server_is_told_by_its_props_and_named_with_its_build():
    with replaying("llama-server") as replay:
        kind = _detect(replay.v1)
        props = replay.recording.get["/props"].json()
    assert replay.recording.get["/version"].status == 404  # nothing to read the version from there
    assert kind == ServerKind(LLAMA_SERVER, props["build_info"], replay.root)
    assert pollable(kind)


def test_llama_server_without_metrics_is_still_told_by_its_props():
    with replaying("llama-server-no-metrics") as replay:
        kind = _detect(replay.v1)
    assert replay.recording.get["/metrics"].status == 501
    assert kind.name == LLAMA_SERVER


def test_a_server_with_none_of_the_routes_is_unknown_and_not_polled():
    with replaying("llama-cpp-python") as replay:
        kind = _detect(replay.v1)
        statuses = {route: replay.recording.get[route].status for route in ("/version", "/props", "/metrics")}
    assert statuses == {"/version": 404, "/props": 404, "/metrics": 404}
    assert kind == ServerKind(UNKNOWN, None, replay.root)
    assert not pollable(kind)


def test_detection_asks_each_route_once():
    with replaying("llama-server") as replay:
        _detect(replay.v1)
    assert sorted(s.route for s in replay.served) == ["/metrics", "/props", "/version"]
