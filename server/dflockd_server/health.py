"""Health check (the container's HEALTHCHECK, ``python -m dflockd_server.health``): ``ping`` a
dflockd server, exit 0 on ``ok``, 1 otherwise. It reads the server's environment (port, auth
token, TLS) as the server reads it: an empty variable is unset, a value is stripped."""

from __future__ import annotations

import os
import socket
import ssl
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from dflockd_server import constants as c
from dflockd_server.config import Config
from dflockd_server.settings import BY_FIELD

CHECK_TIMEOUT_S = 2.0
USAGE = "python -m dflockd_server.health [HOST [PORT]] (takes no flag: the server's DFLOCKD_*)"
WILDCARD_LOOPBACK = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}
"""Where a client on this machine reaches a server bound to all addresses (``::``: IPv6's)."""


def _request(sock: socket.socket, command: str, argument: str) -> str:
    sock.sendall(f"{command}\n{c.PLACEHOLDER}\n{argument}\n".encode())
    reply = b""
    while not reply.endswith(b"\n"):
        if not (chunk := sock.recv(c.MAX_LINE_BYTES + 1)):
            raise ConnectionError("the server closed the connection")
        reply += chunk
        if len(reply) > c.MAX_LINE_BYTES:
            raise ConnectionError("the server's reply is longer than a protocol line")
    return reply.decode("utf-8", "replace").strip()


def check(host: str, port: int, auth_token: str | None, tls: bool) -> str | None:
    """Ping the server; return None when healthy, else a one-line reason."""
    try:
        sock = socket.create_connection((host, port), timeout=CHECK_TIMEOUT_S)
        if tls:
            # The check runs beside the server: it verifies liveness, not the certificate.
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            sock = ctx.wrap_socket(sock, server_hostname=host)
        with sock:
            if auth_token and (answer := _request(sock, c.CMD_AUTH, auth_token)) != c.STATUS_OK:
                return f"auth refused: {answer!r}"
            if (answer := _request(sock, c.CMD_PING, c.PLACEHOLDER)) != c.STATUS_OK:
                return f"ping answered {answer!r}"
    except OSError as exc:
        return f"{host}:{port} unreachable: {exc}"
    return None


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Check ``[host] [port]``, by default the server's ``DFLOCKD_HOST`` (the loopback address of
    its family for all addresses) and ``DFLOCKD_PORT``."""
    args = list(sys.argv[1:] if argv is None else argv)
    env = os.environ if environ is None else environ
    if len(args) > 2 or any(arg.startswith("-") for arg in args):
        print(f"dflockd health: usage: {USAGE} (given: {' '.join(args)})", file=sys.stderr)
        return 1
    try:
        bound: str = _setting(env, "host") or c.DEFAULT_HOST
        host = (
            BY_FIELD["host"].take(args[0], "host") if args else WILDCARD_LOOPBACK.get(bound, bound)
        )
        port = BY_FIELD["port"].take(args[1], "port") if len(args) > 1 else _setting(env, "port")
        token = Config(  # the file read as the server reads it
            auth_token=_setting(env, "auth_token"), auth_token_file=_setting(env, "auth_token_file")
        ).resolve_auth_token()
    except (ValueError, OSError) as exc:
        print(f"dflockd health: bad setting: {exc}", file=sys.stderr)
        return 1
    tls = _setting(env, "tls_cert") is not None
    if (problem := check(host, c.DEFAULT_PORT if port is None else port, token, tls)) is not None:
        print(f"dflockd health: {problem}", file=sys.stderr)
        return 1
    return 0


def _setting(env: Mapping[str, str], field: str) -> Any:
    """The server's setting ``field`` from its environment, parsed and checked as the server
    does; None where no variable of it is set (or all are empty)."""
    setting = BY_FIELD[field]
    found = setting.in_environment(env)
    return None if found is None else setting.take(found[1], found[0])


if __name__ == "__main__":
    raise SystemExit(main())
