"""Which server answers at an endpoint: vLLM, llama-server, `reqscope serve` or another.

Asked once, when the client connects, from routes each server has by default: vLLM's
`GET /version`, llama-server's `GET /props`, and the metric names of `GET /metrics`. The
answer decides which of the server's own views the client asks for, and which flags it names
when a view is off.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp

from reqscope.endpoint.server.records import LLAMA_SERVER, REQSCOPE, SGLANG, UNKNOWN, VLLM, ServerKind

_PROBE_TIMEOUT = aiohttp.ClientTimeout(total=5)


def server_root(base_url: str) -> str:
    """The server's root URL: the OpenAI base URL without its trailing /v1 (where /metrics, /tokenize live)."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


async def detect_server(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> ServerKind:
    """The server at `base_url`, from its own routes; UNKNOWN when none of them answers as expected."""
    root = server_root(base_url)
    version, props, metrics = await asyncio.gather(
        _get(session, root + "/version", headers),
        _get(session, root + "/props", headers),
        _get(session, root + "/metrics", headers),
    )
    props_json = _json(props)
    if isinstance(props_json, dict) and ("default_generation_settings" in props_json or "build_info" in props_json):
        build = props_json.get("build_info")
        return ServerKind(LLAMA_SERVER, build if isinstance(build, str) else None, root)
    if metrics is not None and "\nvllm:" in "\n" + metrics:
        version_json = _json(version)
        number = version_json.get("version") if isinstance(version_json, dict) else None
        return ServerKind(VLLM, number if isinstance(number, str) else None, root)
    if metrics is not None and "\nsglang:" in "\n" + metrics:  # untested against a live SGLang
        return ServerKind(SGLANG, None, root)
    if metrics is not None and "\nreqscope:" in "\n" + metrics:
        return ServerKind(REQSCOPE, None, root)
    return ServerKind(UNKNOWN, None, root)


async def _get(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> str | None:
    try:
        async with session.get(url, headers=headers, timeout=_PROBE_TIMEOUT) as resp:
            return await resp.text() if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return None


def _json(text: str | None) -> object:
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
