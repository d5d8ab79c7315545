"""The flags of endpoint mode (`reqscope --endpoint URL`), kept apart so parsing imports no HTTP code."""

from __future__ import annotations

import argparse

API_KEY_ENV = "OPENAI_API_KEY"


def add_endpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """--endpoint, --api-key, --new-connection and --config."""
    e = parser.add_argument_group("endpoint (run against an OpenAI-compatible server)")
    e.add_argument(
        "--endpoint", metavar="URL", help="server base URL, e.g. http://127.0.0.1:8000/v1 (--model is then its name)"
    )
    e.add_argument("--api-key", metavar="KEY", help=f"bearer token for the endpoint (default: ${API_KEY_ENV})")
    e.add_argument("--new-connection", action="store_true", help="open a fresh connection for the request")
    e.add_argument(
        "--config", metavar="MODEL", help="card name, model folder or config.json: planner KV for the served model"
    )
