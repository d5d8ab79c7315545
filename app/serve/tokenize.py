"""`POST /tokenize` and `POST /detokenize`, answered as vLLM's server answers them.

/tokenize renders messages (and tools) exactly as a chat request is rendered, so its tokens are
the prompt tokens a request with the same messages and tools would run:
`{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs`, the vocabulary's own strings,
only with `return_token_strs`, null otherwise, as vLLM's). /detokenize answers `{"prompt"}`,
special tokens kept. The rendering runs off the event loop, beside the streams it serves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

from minengine.engine.engine import Engine
from minengine.errors import RequestError, TokenizerError
from reqscope.openai.errors import ApiError
from reqscope.openai.schema import ParseOptions
from reqscope.openai.tokenize import DetokenizeRequest, TokenizeRequest, parse_detokenize, parse_tokenize
from reqscope.serve.body import read_json
from reqscope.serve.gateway import Arrival
from reqscope.wording import error_text

TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"

RouteHandler = Callable[[web.Request, Arrival], Awaitable[web.StreamResponse]]


def tokenize_ids(engine: Engine, request: TokenizeRequest, generic_tools: bool) -> list[int]:
    """The token ids of `request`'s text: its prompt as is, or its messages through the chat template."""
    tok = engine.tokenizer
    if request.prompt is not None:
        text = request.prompt
    else:
        try:
            text = tok.render(
                list(request.messages),
                add_generation_prompt=request.add_generation_prompt,
                tools=request.tools,
                generic_tools=generic_tools,
            )
        except RequestError as exc:  # tools the template cannot take
            raise ApiError(400, error_text(exc), param="tools") from None
        except TokenizerError as exc:  # the template failed on these messages (or there is none)
            raise ApiError(400, error_text(exc), param="messages") from None
    return tok.tok.encode(text, add_special_tokens=request.add_special_tokens).ids


def tokenize_body(engine: Engine, request: TokenizeRequest, generic_tools: bool) -> dict:
    """vLLM's TokenizeResponse for `request`."""
    ids = tokenize_ids(engine, request, generic_tools)
    token_strs = [engine.tokenizer.tok.id_to_token(i) or "" for i in ids] if request.return_token_strs else None
    return {
        "count": len(ids),
        "max_model_len": engine.cfg.max_position_embeddings,
        "tokens": ids,
        "token_strs": token_strs,
    }


def detokenize_body(engine: Engine, request: DetokenizeRequest) -> dict:
    """vLLM's DetokenizeResponse: the text of the ids, special tokens kept."""
    return {"prompt": engine.tokenizer.decode(list(request.tokens), skip_special_tokens=False)}


def tokenize_routes(
    engine: Engine, options: Callable[[], ParseOptions], body_timeout_s: float
) -> tuple[RouteHandler, RouteHandler]:
    """The handlers of /tokenize and /detokenize over `engine` (each behind the gateway)."""

    async def tokenize(request: web.Request, _arrival: Arrival) -> web.StreamResponse:
        parsed = parse_tokenize(await read_json(request, body_timeout_s), options())
        body = await asyncio.to_thread(tokenize_body, engine, parsed, options().generic_tools)
        return web.json_response(body)

    async def detokenize(request: web.Request, _arrival: Arrival) -> web.StreamResponse:
        parsed = parse_detokenize(await read_json(request, body_timeout_s), options())
        return web.json_response(await asyncio.to_thread(detokenize_body, engine, parsed))

    return tokenize, detokenize
