"""The standard-library etcd client against a real etcd server (no mocks)."""

from __future__ import annotations

import contextlib
import queue
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflockd_server.cluster.etcd import (
    MAX_TXN_OPS,
    Compare,
    Delete,
    EtcdClient,
    EtcdError,
    EtcdTransport,
    Get,
    Put,
    WatchEvent,
    prefix_end,
)
from tests.support.etcd import (
    EtcdServer,
    delete,
    find_etcd,
    healthy,
    lease_time_to_live,
    put,
)


def test_put_get_and_range_of_a_prefix(etcd: EtcdClient, etcd_prefix: str) -> None:
    p = etcd_prefix
    revision = put(etcd, p + "b", "two")
    put(etcd, p + "a", "one")
    put(etcd, p + "c/é", "trois ✓")
    put(etcd, p[:-1] + "0", "outside the prefix")
    kv = etcd.get(p + "b")
    assert kv is not None
    assert (kv.key, kv.value, kv.mod_revision, kv.version, kv.lease) == (
        p + "b",
        "two",
        revision,
        1,
        0,
    )
    assert etcd.get(p + "missing") is None
    result = etcd.range(p, prefix=True)
    assert [(kv.key, kv.value) for kv in result.kvs] == [
        (p + "a", "one"),
        (p + "b", "two"),
        (p + "c/é", "trois ✓"),
    ]
    assert result.revision >= revision + 2
    put(etcd, p + "a", "uno")
    assert [kv.value for kv in etcd.get_prefix(p + "a")] == ["uno"]
    assert delete(etcd, p + "a") == 1
    assert delete(etcd, p + "a") == 0
    assert delete(etcd, p, prefix=True) == 2
    assert etcd.get_prefix(p) == []
    assert etcd.get(p[:-1] + "0") is not None


def test_stat_counts_a_prefix_and_tells_whether_a_key_was_put_since(
    etcd: EtcdClient, etcd_prefix: str
) -> None:
    p = etcd_prefix
    empty = etcd.stat(p, prefix=True)
    assert (empty.count, empty.modified) == (0, False)
    first = put(etcd, p + "a", "one")
    put(etcd, p + "b", "two")
    put(etcd, p[:-1] + "0", "outside the prefix")
    stat = etcd.stat(p, prefix=True, since=first - 1)
    assert (stat.count, stat.modified) == (2, True)
    assert stat.revision == etcd.range(p, prefix=True).revision
    assert etcd.stat(p, prefix=True, since=stat.revision).modified is False
    put(etcd, p + "a", "uno")  # a change of a key there: modified, same count
    changed = etcd.stat(p, prefix=True, since=stat.revision)
    assert (changed.count, changed.modified) == (2, True)
    delete(etcd, p + "b")  # a delete: only the count tells
    deleted = etcd.stat(p, prefix=True, since=changed.revision)
    assert (deleted.count, deleted.modified) == (1, False)
    assert etcd.stat(p + "a").count == 1


def test_prefix_end() -> None:
    assert prefix_end("/a/") == "/a0"
    assert prefix_end("") == "\0"


def test_transactions(etcd: EtcdClient, etcd_prefix: str) -> None:
    k = etcd_prefix + "k"
    assert etcd.create_if_absent(k, "first")
    assert not etcd.create_if_absent(k, "second")
    assert not etcd.compare_and_set(k, "second", "third")
    assert etcd.compare_and_set(k, "first", "third")
    assert not etcd.compare_and_set(etcd_prefix + "missing", "", "x")
    result = etcd.txn(
        [Compare(k, "VALUE", "EQUAL", "nope")],
        [Put(k, "never")],
        [Get(k), Put(etcd_prefix + "other", "o"), Get(etcd_prefix, prefix=True)],
    )
    assert not result.succeeded
    assert [[kv.value for kv in r] for r in result.ranges] == [["third"], ["third", "o"]]
    # A batch of the most etcd allows in one transaction, written at one revision.
    batch = [Put(f"{etcd_prefix}batch/{i:03d}", str(i)) for i in range(MAX_TXN_OPS)]
    result = etcd.txn([], batch)
    assert result.succeeded
    kvs = etcd.get_prefix(etcd_prefix + "batch/")
    assert len(kvs) == MAX_TXN_OPS
    assert {kv.mod_revision for kv in kvs} == {result.revision}
    assert etcd.txn([], [Delete(etcd_prefix + "batch/", prefix=True)]).succeeded
    assert etcd.get_prefix(etcd_prefix + "batch/") == []


def test_create_if_absent_race_has_one_winner(etcd_server: EtcdServer, etcd_prefix: str) -> None:
    """Two clients, released together, race to create the same keys: one winner per key."""
    rounds = 20
    wins: dict[str, list[int]] = {"a": [], "b": []}
    barrier = threading.Barrier(2, timeout=10)

    def racer(name: str) -> None:
        client = etcd_server.client()
        for i in range(rounds):
            barrier.wait()
            if client.create_if_absent(f"{etcd_prefix}race/{i}", name):
                wins[name].append(i)

    threads = [threading.Thread(target=racer, args=(name,)) for name in wins]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert sorted(wins["a"] + wins["b"]) == list(range(rounds))
    client = etcd_server.client()
    for i in range(rounds):
        kv = client.get(f"{etcd_prefix}race/{i}")
        assert kv is not None
        assert i in wins[kv.value]
        assert kv.version == 1  # written once


def test_a_lease_not_kept_alive_expires_and_its_keys_vanish(
    etcd: EtcdClient, etcd_prefix: str
) -> None:
    # The kept lease is long: a loaded machine may take seconds between two keep-alives, and
    # the test is about the dropped one.
    kept = etcd.lease_grant(30)
    dropped = etcd.lease_grant(2)
    assert kept.ttl >= 30 and dropped.ttl >= 2
    put(etcd, etcd_prefix + "kept", "k", lease=kept.id)
    put(etcd, etcd_prefix + "dropped", "d", lease=dropped.id)
    kv = etcd.get(etcd_prefix + "dropped")
    assert kv is not None and kv.lease == dropped.id
    deadline = time.monotonic() + 15
    while etcd.get(etcd_prefix + "dropped") is not None:
        assert time.monotonic() < deadline, "the lease's key outlived it"
        assert etcd.lease_keepalive_once(kept.id) >= 2
        time.sleep(0.3)
    assert lease_time_to_live(etcd, dropped.id) == -1
    assert etcd.lease_keepalive_once(dropped.id) == 0
    # The kept-alive lease's key is still there; revoking the lease deletes it at once.
    assert etcd.get(etcd_prefix + "kept") is not None
    etcd.lease_revoke(kept.id)
    assert etcd.get(etcd_prefix + "kept") is None
    etcd.lease_revoke(kept.id)  # already gone: not an error


def _events(got: queue.Queue[WatchEvent], count: int) -> list[WatchEvent]:
    """Up to ``count`` events, waiting at most 10 s."""
    events: list[WatchEvent] = []
    deadline = time.monotonic() + 10
    while len(events) < count and time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            events.append(got.get(timeout=0.5))
    return events


def test_watch_sees_puts_and_deletes(etcd: EtcdClient, etcd_prefix: str) -> None:
    p = etcd_prefix
    put(etcd, p + "before", "not seen: the watch starts after it")
    got: queue.Queue[WatchEvent] = queue.Queue()
    watch = etcd.watch(p, prefix=True, on_event=got.put)
    try:
        put(etcd, p + "x", "1")
        put(etcd, p[:-1] + "_outside", "not seen")
        put(etcd, p + "x", "2")
        delete(etcd, p + "x")
        lease = etcd.lease_grant(2)
        put(etcd, p + "leased", "l", lease=lease.id)
        etcd.lease_revoke(lease.id)
        events = _events(got, 5)
        assert [(e.type, e.kv.key, e.kv.value) for e in events] == [
            ("put", p + "x", "1"),
            ("put", p + "x", "2"),
            ("delete", p + "x", ""),
            ("put", p + "leased", "l"),
            ("delete", p + "leased", ""),
        ]
        time.sleep(0.3)
        assert got.empty()
    finally:
        watch.stop()
    assert not watch.running
    assert watch.error is None


def test_watch_from_a_revision_replays_and_calls_back(etcd: EtcdClient, etcd_prefix: str) -> None:
    first = put(etcd, etcd_prefix + "k", "a")
    put(etcd, etcd_prefix + "k", "b")
    seen: list[str] = []
    done = threading.Event()

    def on_event(event: WatchEvent) -> None:
        seen.append(event.kv.value)
        if len(seen) == 3:
            done.set()

    watch = etcd.watch(etcd_prefix + "k", start_revision=first, on_event=on_event)
    try:
        put(etcd, etcd_prefix + "k", "c")
        assert done.wait(10)
        assert seen == ["a", "b", "c"]
    finally:
        watch.stop()
    assert not watch.running


@contextlib.contextmanager
def socket_closed_port() -> Iterator[str]:
    """An http:// URL on 127.0.0.1 where nothing listens (a port bound, never listened on)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_errors_name_the_url_and_the_operation(etcd: EtcdClient) -> None:
    with pytest.raises(EtcdError, match=r"etcd at http://127\.0\.0\.1:\d+: revoke of lease"):
        etcd.transport.call("/v3/lease/revoke", {"ID": "1"}, "revoke of lease 1")
    with socket_closed_port() as url:
        down = EtcdClient(EtcdTransport(url, timeout=2))
        with pytest.raises(EtcdError, match=rf"etcd at {url}: put of 'k' failed"):
            put(down, "k", "v")
        assert not healthy(down.transport)
    with pytest.raises(ValueError, match="expected http://HOST:PORT"):
        EtcdClient("etcd://127.0.0.1:2379")


def test_a_watch_reports_etcd_going_away(etcd_server: EtcdServer, tmp_path: Path) -> None:
    """Stopping etcd under a running watch ends it with an error naming the URL."""
    binary = find_etcd()
    assert binary is not None  # etcd_server skipped or failed otherwise
    server = EtcdServer(binary, tmp_path).start()
    try:
        watch = server.client().watch("/w/", prefix=True, on_event=lambda _: None)
    finally:
        server.stop()
    deadline = time.monotonic() + 10
    while watch.error is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert re.match(rf"etcd at {server.url}: watch of '/w/'", str(watch.error)), watch.error
    watch.stop()
    assert not watch.running
