# pyright: reportMissingImports=false
"""Run by the peers' interpreter (not collected by pytest): a dflockd 0.5.0 client holds a lock
on the server at ``argv[1]:argv[2]`` (key ``argv[3]``, sync or async client per ``argv[4]``),
and after the test has restarted that server, reconnects, renews by its token and releases.

A line protocol with the test, one line each way per step:

* prints ``held <fence hex>`` once granted (its 0.5.0 ``DistributedLock``, lease 20 s), then
  waits for a line on stdin (the test restarts the server meanwhile);
* reconnects (a 0.5.0 lock object cannot: it only ever renews on the connection it acquired
  on, so the client's own ``renew``/``release`` functions run on a new connection, as a 0.5.0
  user who keeps the token would call them), renews with the token and prints
  ``renewed <seconds>``, then waits for a line;
* releases with the token (the 0.5.0 ``release`` raises unless the server says ``ok``) and
  prints ``released``.

Only the standard library and the peers are imported here.
"""

from __future__ import annotations

import asyncio
import socket
import sys

LEASE_S = 20
RENEW_RATIO = 0.95
"""The 0.5.0 lock's own renewal, on its first connection, comes after 19 s: not during the
test, so it neither fails on the dead connection (it would then forget the token) nor hides
the renewal this script makes."""


def step(text: str) -> None:
    print(text, flush=True)
    if not sys.stdin.readline():
        raise SystemExit("the test hung up")


def sync_client(address: tuple[str, int], key: str) -> None:
    from dflockd.sync_client import DistributedLock, release, renew

    lock = DistributedLock(
        key, acquire_timeout_s=0, lease_ttl_s=LEASE_S, servers=[address], renew_ratio=RENEW_RATIO
    )
    assert lock.acquire(), "not granted"
    token = lock.token
    assert token is not None
    step(f"held {token[:16]}")
    with socket.create_connection(address, timeout=10) as sock:
        rfile = sock.makefile("r", encoding="utf-8")
        remaining = renew(sock, rfile, key, token, LEASE_S)
        step(f"renewed {remaining}")
        release(sock, rfile, key, token)
    print("released", flush=True)


def async_client(address: tuple[str, int], key: str) -> None:
    from dflockd.client import DistributedLock, release, renew

    async def main() -> None:
        lock = DistributedLock(
            key,
            acquire_timeout_s=0,
            lease_ttl_s=LEASE_S,
            servers=[address],
            renew_ratio=RENEW_RATIO,
        )
        assert await lock.acquire(), "not granted"
        token = lock.token
        assert token is not None
        step(f"held {token[:16]}")
        reader, writer = await asyncio.open_connection(*address)
        try:
            remaining = await renew(reader, writer, key, token, LEASE_S)
            step(f"renewed {remaining}")
            await release(reader, writer, key, token)
        finally:
            writer.close()
        print("released", flush=True)

    asyncio.run(main())


if __name__ == "__main__":
    target = (sys.argv[1], int(sys.argv[2]))
    {"sync": sync_client, "async": async_client}[sys.argv[4]](target, sys.argv[3])
