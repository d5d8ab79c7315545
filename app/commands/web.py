"""`reqscope web [PROMPT]`: the explorer in a browser, one live session per open page.

textual-serve answers each browser connection by starting a command and relaying its screen
over a websocket to xterm.js in the page. The command here is this verb again with `--session`:
the same explorer `reqscope run PROMPT` opens on a terminal, with the same run flags. It has to
be asked for by name, because the served process talks to textual-serve over pipes, not a
terminal, and `reqscope run` would take that for a pipe and print text instead.

The default model is pulled (with progress on this terminal) before serving, so sessions never
race to pull it; each session loads its own engine. Loopback only unless `--host` says
otherwise: whoever opens the page drives the model, and there is no login.
"""

from __future__ import annotations

import argparse
import functools
import logging
import shlex
import socket
import sys
from urllib.parse import urlsplit

from minengine.errors import ReqscopeError
from reqscope.argtypes import positive_whole_number, whole_number
from reqscope.flag_aliases import is_alias
from reqscope.loopback import host_header_names_loopback, listens_on_loopback
from reqscope.run_options import (
    DEFAULT_PROMPT,
    ModelFolder,
    add_run_arguments,
    request_from_args,
    stderr_progress,
)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8123
DEFAULT_MAX_SESSIONS = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The prompt, where to listen, and the shared run flags (passed on to every session)."""
    parser.add_argument("prompt", nargs="?", default=None, help=f"the user message (default: {DEFAULT_PROMPT!r})")
    n = parser.add_argument_group("network")
    n.add_argument(
        "--host", default=DEFAULT_HOST, help=f"address to listen on (default: {DEFAULT_HOST}, this machine only)"
    )
    n.add_argument("--port", type=whole_number, default=DEFAULT_PORT, help="port")
    n.add_argument(
        "--max-sessions",
        type=positive_whole_number,
        default=DEFAULT_MAX_SESSIONS,
        help="open pages at once: each runs its own explorer process with its own copy of the model "
        "(the default model takes about 0.8 GiB a session)",
    )
    parser.add_argument(
        "--paused", action="store_true", help="each session holds before the first token (s steps, space runs)"
    )
    # What each browser connection runs; not for typing by hand.
    parser.add_argument("--session", action="store_true", help=argparse.SUPPRESS)
    add_run_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Serve the explorer until interrupted (or, with `--session`, be one browser's explorer)."""
    if args.session:
        return _session(args)
    if not 0 < args.port <= 65535:
        print(f"reqscope: error: --port {args.port} is not a TCP port (1-65535)", file=sys.stderr)
        return 2
    try:
        from textual_serve.server import Server
    except ImportError:
        raise ReqscopeError("reqscope web needs textual-serve: pip install textual-serve") from None
    _check_port_free(args.host, args.port)  # before a pull that may take minutes
    model_dir = ModelFolder.of(args).ensure(stderr_progress)
    if not model_dir.is_dir():
        raise ReqscopeError(f"model folder {model_dir} does not exist; pass --model PATH")
    if not listens_on_loopback(args.host):
        stderr_progress(
            f"warning: serving on {args.host}, beyond this machine: anyone who can reach "
            f"port {args.port} can drive the model (there is no login)"
        )
    command = session_command(args, str(model_dir.resolve()))
    prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    server = _server_class(Server)(command, host=args.host, port=args.port, title=f"reqscope: {prompt[:60]}")
    server.max_sessions = args.max_sessions
    try:
        server.serve()
    except OSError as exc:  # lost the port between the check and the bind
        reason = exc.strerror or exc
        raise ReqscopeError(f"cannot listen on {args.host}:{args.port}: {reason}; pick another --port") from None
    print("reqscope: stopped", file=sys.stderr)
    return 0


def _session(args: argparse.Namespace) -> int:
    from reqscope.ui.launch import launch_explorer

    prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    model = ModelFolder.of(args)
    return launch_explorer(args, request_from_args(args, prompt, model), model, start_paused=args.paused)


def session_command(args: argparse.Namespace, model_dir: str) -> str:
    """The shell command each browser connection runs: this verb with `--session` and the same flags."""
    argv = [sys.executable, "-m", "reqscope.cli", "web", "--session", *run_flags(args, model=model_dir)]
    if args.paused:
        argv.append("--paused")
    if args.prompt is not None:
        argv += ["--", args.prompt]  # after `--`, a prompt that starts with "-" is still the prompt
    return shlex.join(argv)


def run_flags(args: argparse.Namespace, **overrides: object) -> list[str]:
    """The shared run flags that differ from their defaults, as command-line words.

    Read back from the parsed values (generically, from `add_run_arguments`'s own actions), so a
    flag added there later is passed on without a change here.
    """
    shared = argparse.ArgumentParser(add_help=False)
    add_run_arguments(shared)
    words: list[str] = []
    for action in shared._actions:
        if not action.option_strings or is_alias(action):  # an old name passes its value on under the new one
            continue
        value = overrides.get(action.dest, getattr(args, action.dest, action.default))
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            words.append(flag if value else f"--no-{flag.removeprefix('--')}")
        elif action.nargs == 0:  # store_true and the like
            words.append(flag)
        elif isinstance(value, list):  # repeatable, such as --stop
            for item in value:
                words += [flag, str(item)]
        else:
            words += [flag, str(value)]
    return words


def _check_port_free(host: str, port: int) -> None:
    """A one-line error now, rather than a traceback from the server, when the port is taken."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise ReqscopeError(f"cannot listen on {host}:{port}: {getattr(exc, 'strerror', None) or exc}") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds
            try:
                probe.bind(address)
            except OSError as exc:
                raise ReqscopeError(
                    f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick another --port"
                ) from None


def _server_class(base: type) -> type:
    """textual-serve's Server, quieter and reachable under any address the browser used."""

    class ExplorerServer(base):
        max_sessions = DEFAULT_MAX_SESSIONS
        sessions = 0  # pages whose explorer runs now

        @functools.cached_property
        def on_loopback(self) -> bool:
            # Once per server: for a host name this asks DNS, which no request should wait on.
            return listens_on_loopback(self.host)

        def initialize_logging(self) -> None:
            # textual-serve logs every connection through rich at INFO; warnings are enough here.
            logging.basicConfig(level=logging.WARNING, format="reqscope web: %(message)s")

        async def on_startup(self, app) -> None:
            print(
                f"reqscope: serving the explorer at http://{_url_host(self.host)}:{self.port} "
                f"(each page runs its own session); Ctrl-C stops",
                file=sys.stderr,
                flush=True,
            )

        async def handle_index(self, request):
            _refuse_foreign(request, self.on_loopback)
            self._refuse_beyond_cap()
            # The page tells the browser where its websocket is; textual-serve builds that from
            # --host, which for 0.0.0.0 is no address a browser can use. The address the
            # browser itself used always is (no await below runs before the page is made).
            self.public_url = f"{request.scheme}://{request.host}"
            return await super().handle_index(request)

        async def handle_websocket(self, request):
            _refuse_foreign(request, self.on_loopback)
            self._refuse_beyond_cap()
            self.sessions += 1  # counted from here: the page's explorer starts with its websocket
            try:
                return await super().handle_websocket(request)
            finally:
                self.sessions -= 1

        def _refuse_beyond_cap(self) -> None:
            # Each page starts a process that loads the model: without a cap, tabs left open
            # (or a page reloaded in a loop) would exhaust the machine's memory.
            if self.sessions >= self.max_sessions:
                from aiohttp import web as aiohttp_web

                raise aiohttp_web.HTTPServiceUnavailable(
                    text=f"reqscope web: {self.sessions} explorer sessions are open, the most allowed "
                    f"(--max-sessions {self.max_sessions}); close one of their pages, or restart with a "
                    "higher --max-sessions",
                    headers={"Retry-After": "5"},
                )

    return ExplorerServer


def _refuse_foreign(request, on_loopback: bool) -> None:
    """403 for a request another web site made the browser send.

    Websockets are not bound by the same-origin policy, so any page a user visits could open
    this server's websocket and start sessions that type into the explorer; browsers always
    say which page asks (Origin), and it must be this server's own page. On loopback the Host
    must name this machine too, so a DNS-rebound name (a hostile site's name pointed at
    127.0.0.1) is refused as well.
    """
    from aiohttp import web as aiohttp_web

    origin = request.headers.get("Origin")
    if origin is not None and urlsplit(origin).netloc != request.host:
        raise aiohttp_web.HTTPForbidden(text="reqscope web: cross-origin request refused")
    if on_loopback and not host_header_names_loopback(request.host):
        raise aiohttp_web.HTTPForbidden(text="reqscope web: use a loopback address (127.0.0.1 or localhost)")


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
