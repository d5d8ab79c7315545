"""Which addresses name only this machine (reqscope.loopback), for `serve` and `web`."""

from __future__ import annotations

import pytest

from reqscope.loopback import host_header_names_loopback, listens_on_loopback


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("::1", True), ("[::1]", True),
                                                ("localhost", True), ("127.0.0.2", True), ("0.0.0.0", False),
                                                ("192.168.1.20", False)])  # fmt: skip
def test_listening_addresses(host, loopback):
    assert listens_on_loopback(host) is loopback


@pytest.mark.parametrize(("header", "loopback"), [("127.0.0.1:8000", True), ("localhost:8000", True),
                                                  ("LOCALHOST", True), ("[::1]:8000", True), ("127.0.0.1", True),
                                                  ("evil.example:8000", False), ("evil.example", False),
                                                  ("localhost.evil.example", False), ("10.0.0.1:8000", False),
                                                  ("", False), (None, False), ("[::1", False)])  # fmt: skip
def test_host_headers(header, loopback):
    assert host_header_names_loopback(header) is loopback
