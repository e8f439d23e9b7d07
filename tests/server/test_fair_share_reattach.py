"""``--max-locks-per-ip`` holds whatever the grants of an address are bound to: a grant counts
against the address that took it (or that last reattached it or took it over) for as long as
it is held, bound to its connection, to a closed session connection, or to none (``hl ... d``,
``hd``). The real ``dflockd`` process, capped at 10; one address (127.0.0.1) closes its session
connections and reattaches by token, hands its grants down and takes them over, and tries to
go past 10 every other way: it never holds more than 10 keys, and each refusal is an acquire's
over the cap, ``error_max_locks``. Before the fix the same address held 60 keys this way."""

from __future__ import annotations

from collections.abc import Callable

from tests.support.servers import DflockdProcess
from tests.support.waiting import wait_until
from tests.support.wire import Wire, connection_count, held_keys

CAP = 10
ROUNDS = 6
LEASE = 60
SESSION_TTL_S = 60
"""Longer than the test: a closed session's grants are held throughout."""
OTHER = "127.0.0.2"
REFUSED = "error_max_locks"


def session(address: tuple[str, int], source: str | None = None) -> Wire:
    wire = Wire(address, source=source)
    assert wire.req("hello", "_", "session").startswith("ok ")
    return wire


def close_seen(address: tuple[str, int], wire: Wire) -> None:
    """Close ``wire`` and wait until the server has seen the close."""
    before = connection_count(address)
    wire.close()
    wait_until(lambda: connection_count(address) < before, what="the close seen by the server")


def held_here(address: tuple[str, int]) -> set[str]:
    """The keys held now of those 127.0.0.1 took (``mine-``)."""
    return {key for key in held_keys(address) if key.startswith("mine-")}


def test_closes_reattaches_hand_downs_and_take_overs_never_take_an_address_past_its_cap(
    dflockd_process: Callable[..., DflockdProcess],
) -> None:
    proc = dflockd_process(
        "--host",
        "0.0.0.0",
        "--port",
        "0",
        "--max-locks-per-ip",
        str(CAP),
        "--session-ttl",
        str(SESSION_TTL_S),
    )
    _, port = proc.wait_listening()
    address = ("127.0.0.1", port)

    # The 60-key reproduction: six session connections in turn each ask for 10 new keys and
    # close (their grants are kept for the session's time), then one reattaches them all.
    tokens: dict[str, str] = {}
    most = 0
    for round_ in range(ROUNDS):
        wire = session(address)
        for j in range(CAP):
            key = f"mine-{round_}-{j}"
            reply = wire.req("l", key, f"0 {LEASE}")
            if reply.startswith("ok "):
                tokens[key] = reply.split()[1]
            else:
                assert reply == REFUSED, (key, reply)
        most = max(most, len(held_here(address)))
        close_seen(address, wire)
    assert most == len(tokens) == CAP, f"one address held {most} keys with a cap of {CAP}"
    assert held_here(address) == set(tokens)

    back = Wire(address)
    for key, token in tokens.items():  # the same address reattaches its own grants
        assert back.req("n", key, f"{token} {LEASE}") == f"ok {LEASE}", key
    # Every other way to a new grant is refused while it holds 10.
    assert back.req("l", "mine-new", "0") == REFUSED
    assert back.req("sl", "mine-sem", "0 5") == REFUSED
    assert back.req("e", "mine-new") == REFUSED
    assert back.req("se", "mine-sem", "5") == REFUSED
    assert back.req("hl", "mine-new", f"0 {LEASE} d note") == REFUSED
    assert back.req("hl", "mine-new", f"0 {LEASE} c note") == REFUSED
    # Handed down (bound to no connection), its grants still count.
    for key, token in tokens.items():
        assert back.req("hd", key, f"{token} {LEASE}") == "ok", key
    assert back.req("l", "mine-new", "0") == REFUSED
    assert back.req("hl", "mine-new", f"0 {LEASE} d note") == REFUSED
    close_seen(address, back)
    fresh = session(address)
    assert fresh.req("l", "mine-new", "0") == REFUSED
    # Taken over by the same address, they still count once.
    for key, token in tokens.items():
        assert fresh.req("ht", key, f"{token} {LEASE} {LEASE} note") == f"ok {LEASE}", key
    assert fresh.req("l", "mine-new", "0") == REFUSED
    assert held_here(address) == set(tokens)

    # Another address's grants, left behind: a detached hold and a closed session's grant.
    other = session(address, source=OTHER)
    detached = other.req("hl", "theirs-detached", f"0 {LEASE} d note").split()[1]
    bound = other.req("l", "theirs-bound", f"0 {LEASE}").split()[1]
    close_seen(address, other)
    # At its cap, this address can neither take one over nor reattach one: refused as an
    # acquire over the cap is, and the grants stay as they were.
    assert fresh.req("ht", "theirs-detached", f"{detached} {LEASE} r note") == REFUSED
    assert fresh.req("n", "theirs-bound", f"{bound} {LEASE}") == REFUSED
    assert held_here(address) == set(tokens)
    assert {"theirs-detached", "theirs-bound"} <= held_keys(address)
    # Their own address still reattaches them (nothing was lost by the refusals).
    again = Wire(address, source=OTHER)
    assert again.req("ht", "theirs-detached", f"{detached} {LEASE} r note") == f"ok {LEASE}"
    assert again.req("n", "theirs-bound", f"{bound} {LEASE}") == f"ok {LEASE}"
    # Below its cap again (one key released), the first address gets a new key.
    first = next(iter(tokens))
    assert fresh.req("r", first, tokens[first]) == "ok"
    assert fresh.req("l", "mine-new", f"0 {LEASE}").startswith("ok ")
    assert fresh.req("l", "mine-newer", "0") == REFUSED
    assert len(held_here(address)) == CAP
    # The refusals are logged, naming the setting.
    assert "--max-locks-per-ip" in proc.wait_for("DFLOCKD_MAX_LOCKS_PER_IP")
    again.close()
    fresh.close()
