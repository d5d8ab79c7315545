"""Where endpoint requests go and how, and which model they name: shared by every endpoint mode.

The plain and JSON modes (`reqscope.endpoint.run`) and the explorer's client thread
(`reqscope.ui.endpoint.worker`) read the same flags into an `EndpointTarget`, open the same
client from it and settle the model name the same way. Both depend on this module and it on
neither, so the endpoint modes can hand the terminal to the explorer without the explorer's
client importing them back.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp

from minengine.errors import ReqscopeError
from minengine.settings import CLIENT_API_KEY_ENV, read_env
from reqscope.endpoint.client import EndpointClient
from reqscope.endpoint.options import DEFAULT_POLL_MS


@dataclass(frozen=True)
class EndpointTarget:
    """Where the requests go, and how."""

    url: str
    api_key: str | None = None
    model: str | None = None  # None: the first model the server lists
    new_connection: bool = False
    poll_ms: float = DEFAULT_POLL_MS  # how often the server's batch is read while a request runs (0: never)
    otlp_listen: tuple[str, int] | None = None  # where the server's trace spans are received, if anywhere

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EndpointTarget:
        """The target the endpoint flags name; without --api-key, the key comes from $OPENAI_API_KEY."""
        api_key = args.api_key or read_env(CLIENT_API_KEY_ENV) or None
        return cls(
            openai_base(args.base_url),
            api_key=api_key,
            model=args.model,
            new_connection=args.new_connection,
            poll_ms=args.poll_ms,
            otlp_listen=args.otlp_listen,
        )

    def client(self) -> EndpointClient:
        """A client for this target (not yet open: use `async with`, or await its `__aenter__`)."""
        return EndpointClient(
            self.url,
            api_key=self.api_key,
            new_connection=self.new_connection,
            poll_ms=self.poll_ms,
            otlp_listen=self.otlp_listen,
        )


def openai_base(url: str) -> str:
    """The OpenAI base URL (…/v1) of `--base-url`: a server's bare address, as `bench serve --base-url` takes it,
    gets the /v1 that OpenAI's API lives under; a URL with a path is used as given."""
    url = url.strip().rstrip("/")
    return url + "/v1" if urlsplit(url).path in ("", "/") else url


async def model_name(client: EndpointClient, target: EndpointTarget) -> str:
    """The target's model, or the first one the server lists; checks the URL and the key on the way."""
    endpoint = target.url
    try:
        names = await client.models()
    except aiohttp.ClientResponseError as exc:
        if exc.status in (401, 403):
            message = f"{endpoint} refused the API key ({exc.message}); pass --api-key or set {CLIENT_API_KEY_ENV}"
            raise ReqscopeError(message) from None
        names = ()  # some servers have no /models; the request itself will tell
    except ValueError:  # a body that is not the JSON model list
        names = ()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ReqscopeError(f"cannot reach {endpoint} ({exc}); is the server running?") from None
    if target.model:
        return target.model
    if not names:
        raise ReqscopeError(f"{endpoint} lists no models; pass --model NAME")
    return names[0]
