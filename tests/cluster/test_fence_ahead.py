"""A member's fence ceiling (``<prefix>/fence/<member>``) is stored without holding up the
loop's grants (``dflockd_server.tokens``): a store held by etcd, whether the member's thread
raises the counter or the counter stores its next ceiling ahead, leaves ``next_token`` answering
at once below the stored ceiling, and refusing (never waiting) at it. Real etcd behind a proxy
that holds its replies; the counter is the one a member uses, over the member's etcd store."""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from dflockd_server.cluster.etcd import EtcdClient, EtcdTransport
from dflockd_server.cluster.fencestore import EtcdCeilingStore
from dflockd_server.fence import FenceStateError, fence_of
from dflockd_server.tokens import FenceCounter
from tests.support.etcd import EtcdServer
from tests.support.proxy import FaultProxy
from tests.support.waiting import wait_until

WAIT_S = 30.0
BLOCK = 100


@pytest.fixture
def etcd_proxy(etcd_server: EtcdServer) -> Iterator[FaultProxy]:
    with FaultProxy(("127.0.0.1", etcd_server.client_port)) as proxy:
        yield proxy


@pytest.fixture
def store(etcd_proxy: FaultProxy, etcd_prefix: str) -> EtcdCeilingStore:
    proxied = EtcdClient(EtcdTransport(f"http://127.0.0.1:{etcd_proxy.address[1]}", timeout=20.0))
    return EtcdCeilingStore(proxied, etcd_prefix.rstrip("/"), "m:1")


def hold_next_store(proxy: FaultProxy, store: EtcdCeilingStore) -> threading.Event:
    """Hold etcd's reply to the next request naming the ceiling's key (base64 in the JSON)."""
    return proxy.hold_reply_after(base64.b64encode(store.key.encode()))


def stored(etcd: EtcdClient, store: EtcdCeilingStore) -> int:
    kv = etcd.get(store.key)
    assert kv is not None
    return int(kv.value)


def test_a_member_thread_raising_the_counter_does_not_hold_up_grants(
    etcd_proxy: FaultProxy, store: EtcdCeilingStore, etcd: EtcdClient
) -> None:
    counter = FenceCounter(store=store, persist_block=BLOCK)
    floor = counter.ceiling + 10
    held = hold_next_store(etcd_proxy, store)
    raising = threading.Thread(target=counter.raise_to, args=(floor,))
    raising.start()
    assert held.wait(WAIT_S), "raise_to never asked etcd"
    token = counter.next_token()  # the loop's grant, while the member's store is held
    assert raising.is_alive(), "the grant waited for the member thread's etcd store"
    assert fence_of(token) < floor
    etcd_proxy.release_replies()
    raising.join(WAIT_S)
    assert not raising.is_alive()
    assert fence_of(counter.next_token()) > floor
    assert stored(etcd, store) > floor


def test_the_next_ceiling_is_stored_ahead_and_a_grant_at_the_ceiling_is_refused_not_held(
    etcd_proxy: FaultProxy, store: EtcdCeilingStore, etcd: EtcdClient
) -> None:
    counter = FenceCounter(store=store, persist_block=BLOCK)
    with ThreadPoolExecutor(max_workers=1) as ahead:
        counter.store_ahead(ahead)
        ceiling = counter.ceiling
        held = hold_next_store(etcd_proxy, store)
        # Half a block under the ceiling, the next one is asked for; grants go on meanwhile.
        while counter.last + 1 < ceiling - BLOCK // 2:
            counter.next_token()
        counter.next_token()
        assert held.wait(WAIT_S), "the next ceiling was not asked for half a block ahead"
        while counter.last + 1 < ceiling:
            counter.next_token()  # each answered at once, the store still held
        with pytest.raises(FenceStateError):
            counter.next_token()  # at the stored ceiling: refused, not waited for
        assert counter.ceiling == ceiling == stored(etcd, store)
        etcd_proxy.release_replies()
        wait_until(lambda: counter.ceiling > ceiling, timeout=WAIT_S, what="the next ceiling")
        token = counter.next_token()
        assert fence_of(token) >= ceiling
        # That token may ask for the next ceiling ahead at once (half a block under the new
        # one): the store in etcd can then be a block ahead of the counter's ceiling, which is
        # raised only once the store is done (CI: stored 50 above it). What must hold: every
        # token below the counter's ceiling, and that ceiling stored.
        now = counter.ceiling
        assert fence_of(token) < now <= stored(etcd, store)
