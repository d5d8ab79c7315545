"""Which addresses name only this machine: for a listening address, and for a request's Host.

A server on loopback without a login trusts whoever can reach it, which is this machine's own
users, until a web page reaches it through the browser: a hostile site's name pointed at
127.0.0.1 (DNS rebinding) makes the browser treat the server as that site, so the page can send
requests and read the answers. Such requests carry the hostile name in Host; a request meant for
this machine names an address of it. The Host check never asks DNS, whose answer the site
controls.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit


def listens_on_loopback(host: str) -> bool:
    """Whether the listening address `host` reaches only this machine (127.0.0.0/8, ::1,
    localhost, or a name that resolves only to those)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (socket.gaierror, UnicodeError):
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def names_loopback(hostname: str) -> bool:
    """Whether `hostname` (no port) is a loopback IP literal or localhost, without asking DNS."""
    if hostname.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(hostname.strip("[]")).is_loopback
    except ValueError:
        return False


def host_header_names_loopback(host: str | None) -> bool:
    """Whether a request's Host header (`name[:port]`) addresses this machine by a loopback name."""
    if not host:
        return False
    try:
        hostname = urlsplit(f"//{host}").hostname
    except ValueError:
        return False
    return names_loopback(hostname or "")
