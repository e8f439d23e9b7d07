"""A cluster member publishes the longest lease it may have granted (``<prefix>/longest/<member>``)
off its event loop (``dflockd_server.leasebound``): while etcd holds the reply to that publish,
every other connection is served, and the grant that asked for the longer lease is answered only
once the longer bound is in etcd (the fail-over bound holds). Real server, real etcd, a proxy in
front of it that holds etcd's replies."""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from celery_dflock.client.clients import Client
from dflockd_server import Config
from dflockd_server.cluster.etcd import EtcdClient
from dflockd_server.cluster.fencestore import published_longest
from dflockd_server.testing import ServerThread
from tests.support.etcd import EtcdServer
from tests.support.fleet import Fleet, cluster_url
from tests.support.ports import free_port
from tests.support.proxy import FaultProxy
from tests.support.waiting import wait_until
from tests.support.wire import Wire

WAIT_S = 30.0
SHORT_LEASE_S = 3
LONG_LEASE_S = 10
PINGS = 50


@pytest.fixture
def etcd_proxy(etcd_server: EtcdServer) -> Iterator[FaultProxy]:
    with FaultProxy(("127.0.0.1", etcd_server.client_port)) as proxy:
        yield proxy


@pytest.fixture
def member(etcd_proxy: FaultProxy, etcd_prefix: str) -> Iterator[ServerThread]:
    """One member whose only etcd endpoint is the proxy."""
    port = free_port()
    cfg = Config(
        host="127.0.0.1",
        port=port,
        advertise=f"127.0.0.1:{port}",
        cluster=f"etcd://127.0.0.1:{etcd_proxy.address[1]}{etcd_prefix.rstrip('/')}",
        max_lease_ttl_s=300,
        default_lease_ttl_s=SHORT_LEASE_S,
    )
    thread = ServerThread(cfg).start()
    try:
        yield thread
    finally:
        thread.stop()


def test_a_held_longest_lease_publish_stalls_only_the_grant_that_needs_it(
    member: ServerThread, etcd_proxy: FaultProxy, etcd: EtcdClient, etcd_prefix: str
) -> None:
    prefix = etcd_prefix.rstrip("/")
    advertise = member.server.config.advertise
    assert advertise is not None
    node = member.server.node
    assert node is not None
    wait_until(
        lambda: all(node.ownership.check(k) is None for k in ("short", "short2", "long")),
        timeout=WAIT_S,
        what="the member serving the test's keys",
    )

    other = Wire(member.address)
    other.lock("short", lease=SHORT_LEASE_S)  # publishes 3 s first (the start's bound was 0)
    assert published_longest(etcd, prefix)[advertise] == SHORT_LEASE_S

    # The next request that names this member's longest-lease key (in base64, as the JSON
    # gateway carries keys) goes to etcd; its reply does not come back.
    key = f"{prefix}/longest/{advertise}"
    held = etcd_proxy.hold_reply_after(base64.b64encode(key.encode()))
    longer = Wire(member.address)
    longer.send("l", "long", f"0 {LONG_LEASE_S}")
    assert held.wait(WAIT_S), "the member never asked etcd to publish a longer lease"

    # The publish is under way and held: the loop serves every other connection meanwhile.
    slowest = 0.0
    for _ in range(PINGS):
        began = time.perf_counter()
        assert other.req("ping") == "ok"
        slowest = max(slowest, time.perf_counter() - began)
    other.lock("short2", lease=SHORT_LEASE_S)  # a grant within the bound is not held up
    print(f"{PINGS} pings while etcd held the publish's reply: slowest {slowest * 1000:.1f} ms")

    # ... and the grant that needs a longer bound is not acknowledged while etcd has the old.
    longer.assert_silent(0.2)
    assert published_longest(etcd, prefix)[advertise] == SHORT_LEASE_S

    etcd_proxy.release_replies()
    reply = longer.recv().split()
    assert reply[0] == "ok" and reply[2] == str(LONG_LEASE_S), reply
    assert published_longest(etcd, prefix)[advertise] >= LONG_LEASE_S
    other.close()
    longer.close()


def test_a_publish_etcd_never_answers_leaves_that_grant_unavailable_and_the_next_publishes(
    member: ServerThread, etcd_proxy: FaultProxy, etcd: EtcdClient, etcd_prefix: str
) -> None:
    """etcd's client gives up on the held publish (its 5 s timeout): the parked grant is
    answered ``error_unavailable`` (nothing granted beyond the bound etcd has; try again
    shortly), the connection stays in step, and the next longer lease publishes anew."""
    prefix = etcd_prefix.rstrip("/")
    advertise = member.server.config.advertise
    assert advertise is not None
    node = member.server.node
    assert node is not None
    wait_until(
        lambda: all(node.ownership.check(k) is None for k in ("short", "long")),
        timeout=WAIT_S,
        what="the member serving the test's keys",
    )
    with Wire(member.address, timeout=WAIT_S) as wire:
        wire.lock("short", lease=SHORT_LEASE_S)
        key = f"{prefix}/longest/{advertise}"
        held = etcd_proxy.hold_reply_after(base64.b64encode(key.encode()))
        wire.send("l", "long", f"0 {LONG_LEASE_S}")
        assert held.wait(WAIT_S)
        assert wire.recv() == "error_unavailable"  # once etcd's client gave up (was: error)
        assert wire.req("ping") == "ok"  # in step
        assert published_longest(etcd, prefix)[advertise] == SHORT_LEASE_S
        etcd_proxy.release_replies()
        reply = wire.req("l", "long", f"0 {LONG_LEASE_S}").split()
        assert reply[0] == "ok" and reply[2] == str(LONG_LEASE_S), reply
        assert published_longest(etcd, prefix)[advertise] >= LONG_LEASE_S


ETCD_TIMEOUT_S = 5
"""A member's etcd client gives up on a request after this."""


def test_a_lock_whose_longer_lease_etcd_does_not_take_yet_waits_it_out_and_is_granted(
    member: ServerThread,
    etcd_proxy: FaultProxy,
    etcd: EtcdClient,
    etcd_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The client of a lock whose lease is longer than any the member has published, while
    etcd holds the publish past the member's etcd timeout: the member answers the parked
    acquire ``error_unavailable``, and the client asks again (as for a shard changing hands)
    until etcd takes the bound: granted. It raised ``ProtocolError`` (the member answered
    ``error``, a request it found malformed), and a locked task failed on it."""
    prefix = etcd_prefix.rstrip("/")
    advertise = member.server.config.advertise
    assert advertise is not None
    node = member.server.node
    assert node is not None
    wait_until(
        lambda: all(node.ownership.check(k) is None for k in ("short", "long")),
        timeout=WAIT_S,
        what="the member serving the test's keys",
    )
    with Wire(member.address, timeout=WAIT_S) as wire:
        wire.lock("short", lease=SHORT_LEASE_S)  # the published bound: 3 s
    key = f"{prefix}/longest/{advertise}"
    held = etcd_proxy.hold_reply_after(base64.b64encode(key.encode()))
    got: list[object] = []
    with Client([member.address], sharding_strategy="cluster", acquire_timeout_s=60) as client:
        lock = client.lock("long", lease_ttl_s=LONG_LEASE_S)
        acquiring = threading.Thread(target=lambda: got.append(_outcome(lock.acquire)))
        acquiring.start()
        assert held.wait(WAIT_S), "the member never asked etcd to publish a longer lease"
        wait_until(
            lambda: "cannot record a lease bound" in caplog.text,
            timeout=ETCD_TIMEOUT_S + WAIT_S,
            what="the member giving up on the publish",
        )
        etcd_proxy.release_replies()
        acquiring.join(WAIT_S + LONG_LEASE_S)
        assert got == [True], got
        assert lock.owned() and lock.lease == LONG_LEASE_S
        assert published_longest(etcd, prefix)[advertise] >= LONG_LEASE_S
        assert lock.release()


def _outcome(call: Callable[[], bool]) -> object:
    try:
        return call()
    except Exception as exc:  # the test shows what it was
        return exc


@pytest.mark.timeout(300)
def test_a_member_restarted_while_etcd_holds_its_lease_bound_publish_serves_once_etcd_answers(
    etcd_server: EtcdServer, etcd_proxy: FaultProxy, etcd_prefix: str, tmp_path: Path
) -> None:
    """A member restarted in place publishes the longest lease of its new run before it serves.
    etcd holds the reply past the member's etcd timeout: the start exited (``cannot publish the
    longest lease in etcd``), and the holder of a key it had granted kept a lease no server
    renewed. It now tries again, serving nothing meanwhile, and once etcd answers it serves,
    the holder's grant restored from its journal."""
    lease = 40  # outlasts the kill, the held publish and the new run's start
    args = ("--max-lease-ttl", str(lease), "--restart-grace", "0")
    with Fleet.on(etcd_server, etcd_prefix, tmp_path, *args) as fleet:
        a = fleet.start(cluster_url(f"http://127.0.0.1:{etcd_proxy.address[1]}", fleet.prefix))
        fleet.wait_settled("the member's first shard map")
        with Client(fleet.seeds(), sharding_strategy="cluster") as holding:
            held = holding.lock("restarted", lease_ttl_s=lease)
            assert held.acquire() and held.server == a.address
            a.kill()
            key = f"{fleet.prefix}/longest/{a.advertise}"
            publish = etcd_proxy.hold_reply_after(base64.b64encode(key.encode()))
            a.start()
            assert publish.wait(WAIT_S), "the new run never published its longest lease"
            time.sleep(ETCD_TIMEOUT_S + 2)
            assert a.proc.poll() is None, "\n".join(a.log()[-5:])
            assert any("not serving yet" in line for line in a.log())
            etcd_proxy.release_replies()
            a.wait_listening()
            wait_until(held.renew, timeout=WAIT_S, what="the holder renews on a's new run")
            assert held.owned() and not held.lost
            assert held.release()
