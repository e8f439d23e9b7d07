"""``HEAD /status`` on the metrics port of ``dflockd`` started as a user starts it."""

from __future__ import annotations

import re
import socket
from collections.abc import Callable

from tests.support.servers import DflockdProcess


def _head(start: Callable[..., DflockdProcess], path: bytes) -> tuple[bytes, bytes]:
    """``HEAD path`` on the metrics port of a ``dflockd`` started as a user starts it: the
    answer's head and what came after it."""
    proc = start(
        "--host", "127.0.0.1", "--port", "0", "--state-dir", "none", "--metrics-port", "0",
    )  # fmt: skip
    match = re.search(r"http://(\S+):(\d+)/metrics", proc.wait_for("metrics on"))
    assert match, proc.lines
    with socket.create_connection((match.group(1), int(match.group(2))), timeout=5) as sock:
        sock.sendall(b"HEAD " + path + b" HTTP/1.0\r\nHost: x\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return head, body


def test_head_answers_the_headers_without_the_page(
    dflockd_process: Callable[..., DflockdProcess],
) -> None:
    """A ``HEAD /status`` (a load balancer's or an uptime checker's probe) was answered the whole
    page after the headers, which HTTP forbids (a client reading the next response on that
    connection reads the page instead). It gets the headers, the page's length among them."""
    head, body = _head(dflockd_process, b"/status")
    assert head.startswith(b"HTTP/1.0 200"), head
    assert body == b"", body[:200]
    length = re.search(rb"(?i)content-length: (\d+)", head)
    assert length and int(length.group(1)) > 0, head


def test_head_of_the_metrics_answers_their_headers(
    dflockd_process: Callable[..., DflockdProcess],
) -> None:
    """``HEAD /metrics`` (an uptime checker's probe: UptimeRobot's HTTP monitor sends HEAD)
    was answered ``405 Method Not Allowed`` (prometheus_client's own answer), so the endpoint
    looked down while Prometheus scraped it. It gets a ``GET``'s headers, without the content."""
    head, body = _head(dflockd_process, b"/metrics")
    assert head.startswith(b"HTTP/1.0 200"), head
    assert b"content-type: text/plain" in head.lower(), head
    assert body == b"", body[:200]
    length = re.search(rb"(?i)content-length: (\d+)", head)
    assert length and int(length.group(1)) > 0, head
