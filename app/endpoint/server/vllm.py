"""What vLLM tells about one request and the batch around it, read from its own answers.

Checked against a live vLLM 0.32 (CPU build):

- `--enable-per-request-metrics` puts a top-level `metrics` object on the final usage chunk (the
  one with `usage` and no `choices`). Its `time_to_first_token_ms` equals the span's
  `time_in_model_prefill` (from scheduling), `generation_time_ms` its `time_in_model_decode` (first
  token to last), `mean_itl_ms` is that over completion_tokens - 1, and `tokens_per_second` is
  completion_tokens over ttft + generation.
- `"return_token_ids": true` puts the prompt's ids in a top-level `prompt_token_ids` of the first
  chunk (each chunk's own ids go in `choices[0].token_ids`).
- `/metrics`: `vllm:kv_cache_usage_perc` is a fraction despite its name (its HELP: "1 means 100
  percent usage"; live, it was the request's blocks over the cache's blocks).
- `POST /tokenize` (at the server's root, not under /v1) takes `messages` and applies the chat
  template; it answers `count`, `max_model_len`, `tokens` and, with `return_token_strs`,
  `token_strs`: vocabulary strings (byte-level BPE writes a space as `Ġ`), not decoded text.
"""

from __future__ import annotations

import json

import aiohttp

from reqscope.endpoint.json_values import figures_from
from reqscope.endpoint.server.prometheus import read_metrics
from reqscope.endpoint.server.records import BatchSample, ServerPrompt, VllmRequestMetrics

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
VLLM_METRICS: tuple[str, ...] = (RUNNING, WAITING, KV_USAGE, PREEMPTIONS, PREFIX_QUERIES, PREFIX_HITS, PROMPT_TOKENS)
METRICS_SOURCE = "vLLM /metrics"
TOKENIZE_SOURCE = "vLLM /tokenize (messages)"
TOKENIZE_TOOLS_SOURCE = "vLLM /tokenize (messages + tools)"
_NO_METRICS = VllmRequestMetrics(None, None, None, None, None)


class ServerPromptError(Exception):
    """vLLM's `/tokenize` gave no prompt: the route failed, refused the request, or answered
    something else than token ids. The message says which, with the server's own words."""


def parse_request_metrics(chunk: dict) -> VllmRequestMetrics | None:
    """The per-request `metrics` object of a streamed chunk, or None where the chunk carries none
    (every chunk but the final usage one, or a server without `--enable-per-request-metrics`).
    A figure that is missing or not a number stays None."""
    metrics = chunk.get("metrics")
    if not isinstance(metrics, dict):
        return None
    parsed = figures_from(VllmRequestMetrics, metrics)  # its fields keep vLLM's names
    # Another server's `metrics` object, with none of these figures, is not vLLM's.
    return None if parsed == _NO_METRICS else parsed


def prompt_token_ids(chunk: dict) -> tuple[int, ...] | None:
    """The prompt's token ids a chunk carries (the first one, where the request body had
    `"return_token_ids": true`), or None."""
    ids = chunk.get("prompt_token_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return None
    return tuple(ids)


def vllm_batch_sample(text: str, t_ms: float, poll_ms: float) -> BatchSample:
    """One `/metrics` page of vLLM's as a batch sample taken at `t_ms` (client clock)."""
    values = read_metrics(text, VLLM_METRICS)
    kv = values.get(KV_USAGE)
    if kv is not None:
        # read_metrics sums over label sets, right for counts; with several engines (data
        # parallel) each reports its own cache's fraction, so the batch's is their mean.
        engines = text.count(f"\n{KV_USAGE}{{") + text.count(f"\n{KV_USAGE} ") + text.startswith(KV_USAGE)
        kv = kv / max(engines, 1)
    return BatchSample(
        t_ms=t_ms,
        source=METRICS_SOURCE,
        running=values.get(RUNNING),
        waiting=values.get(WAITING),
        kv_usage=kv,
        preemptions_total=values.get(PREEMPTIONS),
        prefix_queries_total=values.get(PREFIX_QUERIES),
        prefix_hits_total=values.get(PREFIX_HITS),
        prompt_tokens_total=values.get(PROMPT_TOKENS),
        poll_ms=poll_ms,
    )


async def vllm_prompt(
    session: aiohttp.ClientSession,
    root: str,
    model: str,
    messages: list[dict],
    headers: dict,
    tools: list[dict] | None = None,
) -> ServerPrompt:
    """The tokens vLLM makes of `messages` (and `tools`, where given) with its chat template
    (`POST {root}/tokenize`, with the generation prompt added, as a chat request has it). `root` is
    the server's root URL, without /v1; `headers` go with the request (an API key). Raises
    ServerPromptError on any failure.

    vLLM hands `tools` to the template as a chat request does; a template without tool syntax
    (the default SmolLM2's) renders without them, and says nothing."""
    body = {"model": model, "messages": messages, "add_generation_prompt": True, "return_token_strs": True}
    if tools:
        body["tools"] = tools
    url = root.rstrip("/") + "/tokenize"
    try:
        async with session.post(url, json=body, headers=headers) as response:
            text = await response.text()
            if response.status != 200:
                raise ServerPromptError(f"{TOKENIZE_SOURCE}: HTTP {response.status}: {_error_message(text)}")
            try:
                answer = await response.json(content_type=None)
            except ValueError as error:
                raise ServerPromptError(f"{TOKENIZE_SOURCE}: not JSON: {text[:200]!r}") from error
    except (aiohttp.ClientError, TimeoutError) as error:
        raise ServerPromptError(f"{TOKENIZE_SOURCE}: {type(error).__name__}: {error}") from error
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise ServerPromptError(f"{TOKENIZE_SOURCE}: no token ids in the answer: {text[:200]!r}")
    pieces = answer.get("token_strs")
    # The pieces are kept only where there is one per token: a shorter list could not be lined up.
    keep = isinstance(pieces, list) and len(pieces) == len(tokens) and all(isinstance(p, str) for p in pieces)
    source = TOKENIZE_TOOLS_SOURCE if tools else TOKENIZE_SOURCE
    return ServerPrompt(source=source, token_ids=tuple(tokens), pieces=tuple(pieces) if keep else ())


def _error_message(text: str) -> str:
    """vLLM's own error message (`{"error": {"message": ...}}`), else the start of the body."""
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:200].strip()
    return str(message).splitlines()[0] if message else text[:200].strip()
