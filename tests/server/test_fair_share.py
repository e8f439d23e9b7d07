"""``--max-locks-per-ip``: with the shipped defaults one client address cannot take every key.
The real ``dflockd`` process, started with no setting but its address; one address opens 16
connections and asks each for 64 new keys (the default ``--max-locks-per-connection``: 1,024
in all, the default ``--max-locks``), another address (127.0.0.2, also loopback) then asks for
a new key."""

from __future__ import annotations

from collections.abc import Callable

from dflockd_server import constants as c
from tests.support.servers import DflockdProcess
from tests.support.waiting import wait_until
from tests.support.wire import Wire

CONNECTIONS = 16
OTHER_ADDRESS = "127.0.0.2"
SHARE = c.DEFAULT_MAX_LOCKS * 3 // 4


def take_all(address: tuple[str, int]) -> tuple[list[Wire], int, int]:
    """16 connections from 127.0.0.1, each asking for 64 new keys: (them, granted, refused)."""
    wires = [Wire(address) for _ in range(CONNECTIONS)]
    granted = refused = 0
    for i, wire in enumerate(wires):
        for j in range(c.DEFAULT_MAX_LOCKS_PER_CONNECTION):
            reply = wire.req("l", f"greedy-{i}-{j}", "0")
            if reply.startswith("ok "):
                granted += 1
            else:
                assert reply == "error_max_locks", reply
                refused += 1
    return wires, granted, refused


def test_one_address_with_16_connections_of_64_locks_leaves_keys_for_another(
    dflockd_process: Callable[..., DflockdProcess],
) -> None:
    proc = dflockd_process("--host", "0.0.0.0", "--port", "0")
    _, port = proc.wait_listening()
    wires, granted, refused = take_all(("127.0.0.1", port))
    print(f"one address: {granted} keys granted, {refused} refused error_max_locks")
    assert granted == SHARE  # 768 of 1024
    assert refused == CONNECTIONS * c.DEFAULT_MAX_LOCKS_PER_CONNECTION - SHARE
    # Another address still gets new keys: every one the table has left (64 a connection).
    others = [Wire(("127.0.0.1", port), source=OTHER_ADDRESS) for _ in range(4)]
    left = c.DEFAULT_MAX_LOCKS - SHARE
    for i in range(left):
        reply = others[i % len(others)].req("l", f"other-{i}", "0")
        assert reply.startswith("ok "), (i, reply)
    assert others[0].req("l", "one-too-many", "0") == "error_max_locks"  # --max-locks
    # The refusal names the flag in the log.
    assert "--max-locks-per-ip" in proc.wait_for("DFLOCKD_MAX_LOCKS_PER_IP")
    # Below its share again (one connection closed: its 64 keys released), the first address
    # gets a new key again (a released key's idle state makes room).
    wires.pop(0).close()
    wait_until(
        lambda: wires[-1].req("l", "greedy-again", "0").startswith("ok "),
        timeout=30,
        what="a new key for the first address once one of its connections closed",
    )
    for wire in others:
        wire.close()
    for wire in wires:
        wire.close()


def test_the_cap_is_off_with_0_and_one_address_then_takes_every_key(
    dflockd_process: Callable[..., DflockdProcess],
) -> None:
    """A single tenant that wants every key (a sidecar nobody else reaches) says so."""
    proc = dflockd_process(
        "--host", "127.0.0.1", "--port", "0", env={"DFLOCKD_MAX_LOCKS_PER_IP": "0"}
    )
    wires, granted, refused = take_all(proc.wait_listening())
    assert (granted, refused) == (c.DEFAULT_MAX_LOCKS, 0)
    for wire in wires:
        wire.close()
