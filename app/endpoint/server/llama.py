"""What llama.cpp's llama-server tells about one request, read from its own routes and fields.

Checked live against llama-server built from llama-cpp-python 0.3.36's vendored llama.cpp
(tests/endpoint/test_llama_server_live.py; scripts/peers/llama-server provisions it):

- `prompt_progress` (body `"return_progress": true`; streamed requests only, a plain stream has
  none): a top-level `{"total", "cache", "processed", "time_ms"}` on a chunk whose only delta is
  `{"role": "assistant", "content": null}`. The first comes as a slot takes the request
  (processed = cache, time_ms 0), then one after each decode of up to `-b` (n_batch, 2048 by
  default) prompt tokens, the last with processed = total, all before the first token's chunk.
  `total` is the prompt's token count, the final usage's `prompt_tokens`.
- `GET /slots` (on by default, off with `--no-slots`): a list, one object per slot (`-np`): `id`,
  `n_ctx` (the context divided among the slots), `speculative`, `is_processing`; once the slot has
  served a task also `id_task` (the last one's, while idle), `n_prompt_tokens*`, `params` and
  `next_token: [{"has_next_token", "has_new_line", "n_remain", "n_decoded"}]`.
- `GET /metrics` (`--metrics`, off by default): Prometheus text, `llamacpp:` names without labels.
  Its gauges (`n_busy_slots_per_decode`, the tokens/s) are averaged over the window since the
  previous scrape: every poll resets them. `requests_processing` is the processing slots now.
- A route whose flag is off answers 501 with an OpenAI-style error, e.g. `{"error": {"code": 501,
  "message": "This server does not support metrics endpoint. Start it with `--metrics`", "type":
  "not_supported_error"}}` (slots: "... slots endpoint. Start it with `--slots`"); a route it does
  not have answers 404 (`not_found_error`, "File Not Found"). See `route_off`.
- Cached prompt tokens: the final usage chunk's `usage.prompt_tokens_details.cached_tokens`
  equals `timings.cache_n` (and the first progress's `cache`); `wire.parse_usage` reads it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from reqscope.endpoint.json_values import count, number
from reqscope.endpoint.server.prometheus import read_metrics
from reqscope.endpoint.server.records import BatchSample, PromptProgress, ServerPrompt, SlotState

if TYPE_CHECKING:
    import aiohttp

PROGRESS_KEY = "prompt_progress"
METRICS_ROUTE = "/metrics"
SLOTS_ROUTE = "/slots"
ROUTE_OFF_STATUS = 501  # llama-server's ERROR_TYPE_NOT_SUPPORTED: the route exists, its flag is off

RUNNING = "llamacpp:requests_processing"
WAITING = "llamacpp:requests_deferred"
BUSY_SLOTS = "llamacpp:n_busy_slots_per_decode"
PROMPT_TOKENS = "llamacpp:prompt_tokens_total"  # processed, cached ones excluded
LLAMA_METRICS: tuple[str, ...] = (RUNNING, WAITING, BUSY_SLOTS, PROMPT_TOKENS)


class LlamaRouteError(Exception):
    """A llama-server route answered with an error status."""

    def __init__(self, route: str, status: int, message: str) -> None:
        super().__init__(f"llama-server {route}: HTTP {status}: {message}")
        self.route, self.status, self.message = route, status, message


def route_off(status: int) -> bool:
    """True where a llama-server route (`/metrics`, `/slots`) answered that its flag is off.

    Those routes exist on every llama-server and answer 501 (not_supported_error) when started
    without `--metrics` or with `--no-slots`; a 404 means some other server, not a flag to set.
    """
    return status == ROUTE_OFF_STATUS


def parse_progress(chunk: dict, t_ms: float) -> PromptProgress | None:
    """The `prompt_progress` object a streamed chunk carries (asked for with `return_progress`),
    stamped `t_ms` on the client's clock; None when the chunk has none or it is malformed."""
    raw = chunk.get(PROGRESS_KEY)
    if not isinstance(raw, dict):
        return None
    total, cache, processed = count(raw.get("total")), count(raw.get("cache")), count(raw.get("processed"))
    time_ms = raw.get("time_ms")
    if total is None or cache is None or processed is None or number(time_ms) is None:
        return None
    return PromptProgress(t_ms=t_ms, total=total, cache=cache, processed=processed, time_ms=float(time_ms))


def parse_slots(body: object) -> tuple[SlotState, ...]:
    """The slots of a `GET /slots` answer; entries without an integer `id` are left out.

    An idle slot still shows the last task it served and its counts: those are left out (task and
    decoded None), so that a task on a slot always means a request it serves now.
    """
    if not isinstance(body, list):
        return ()
    slots = []
    for raw in body:
        if not isinstance(raw, dict) or count(raw.get("id")) is None:
            continue
        processing = raw.get("is_processing") is True
        slots.append(
            SlotState(
                id=raw["id"],
                processing=processing,
                task=count(raw.get("id_task")) if processing else None,
                n_ctx=count(raw.get("n_ctx")),
                decoded=_decoded(raw.get("next_token")) if processing else None,
            )
        )
    return tuple(slots)


def llama_batch_sample(
    metrics_text: str | None, slots: tuple[SlotState, ...], t_ms: float, poll_ms: float
) -> BatchSample:
    """One poll of llama-server: its `/metrics` text (None where it did not answer) and its parsed
    `/slots` (empty where it did not answer), stamped `t_ms` on the client's clock.

    Without `/metrics`, `running` is the count of processing slots, which is what
    `llamacpp:requests_processing` counts; the source names the routes that answered.
    """
    values = read_metrics(metrics_text, LLAMA_METRICS) if metrics_text is not None else {}
    running = values.get(RUNNING)
    if running is None and slots:
        running = float(sum(slot.processing for slot in slots))
    routes = [METRICS_ROUTE] if metrics_text is not None else []
    routes += [SLOTS_ROUTE] if slots else []
    return BatchSample(
        t_ms=t_ms,
        source="llama-server " + (" + ".join(routes) if routes else "(no route answered)"),
        running=running,
        waiting=values.get(WAITING),
        prompt_tokens_total=values.get(PROMPT_TOKENS),
        busy_slots_per_decode=values.get(BUSY_SLOTS),
        slots=slots,
        poll_ms=poll_ms,
    )


async def llama_prompt(
    session: aiohttp.ClientSession, root: str, messages: list[dict], headers: dict, tools: list[dict] | None = None
) -> ServerPrompt:
    """The prompt llama-server makes of `messages` (and `tools`, where given): its chat template's
    text (`POST /apply-template`) and that text's tokens with their pieces (`POST /tokenize`).
    Raises LlamaRouteError on an error status.

    With `--jinja`, /apply-template renders `tools` as a chat request does: in the template's own
    tool syntax, or, for a template without one, in a system block of llama.cpp's generic format.

    The tokens are those a chat request gets: a chat completion tokenizes the rendered prompt
    with special tokens parsed (`<|im_start|>` is one token, not seven) and a BOS added where the
    model asks for one, so /tokenize is asked the same (its own default adds none). A piece that is
    not valid UTF-8 alone (part of a character) comes as its bytes, shown here as `<0xE6><0x97>`.
    """
    template_body: dict = {"messages": messages}
    if tools:
        template_body["tools"] = tools
    rendered = await _post(session, root, "/apply-template", template_body, headers)
    text = rendered.get("prompt") if isinstance(rendered, dict) else None
    if not isinstance(text, str):
        raise LlamaRouteError("/apply-template", 200, "no prompt in the answer")
    body = {"content": text, "add_special": True, "parse_special": True, "with_pieces": True}
    answer = await _post(session, root, "/tokenize", body, headers)
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list):
        raise LlamaRouteError("/tokenize", 200, "no tokens in the answer")
    kept = [t for t in tokens if isinstance(t, dict) and count(t.get("id")) is not None]
    return ServerPrompt(
        source="llama-server /apply-template" + (" (messages + tools)" if tools else "") + " + /tokenize",
        token_ids=tuple(t["id"] for t in kept),
        pieces=tuple(_piece(t.get("piece")) for t in kept),
        text=text,
    )


async def _post(session: aiohttp.ClientSession, root: str, route: str, body: dict, headers: dict) -> object:
    async with session.post(root.rstrip("/") + route, json=body, headers=headers) as resp:
        if resp.status != 200:
            raise LlamaRouteError(route, resp.status, _error_message(await resp.text()))
        return await resp.json(content_type=None)


def _error_message(text: str) -> str:
    # Its own small reader, not wire's: wire imports this module (for parse_progress).
    try:
        error = json.loads(text).get("error")
    except (json.JSONDecodeError, AttributeError):
        return text.strip()[:300] or "(empty body)"
    message = error.get("message") if isinstance(error, dict) else error
    return message if isinstance(message, str) else text.strip()[:300]


def _piece(raw: object) -> str:
    # A piece that is not valid UTF-8 on its own (part of a character) comes as a list of bytes.
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        return "".join(f"<0x{b:02X}>" for b in raw if isinstance(b, int))
    return ""


def _decoded(raw: object) -> int | None:
    # `next_token` is a list of one object in this llama.cpp, a bare object in older ones.
    if isinstance(raw, list) and raw:
        raw = raw[0]
    return count(raw.get("n_decoded")) if isinstance(raw, dict) else None


