"""Client and AsyncClient (the one public entry) against the real server; the error tree;
what ``import celery_dflock.client`` costs."""

from __future__ import annotations

import asyncio
import inspect
import re
import subprocess
import sys
import threading
from collections.abc import Callable

import pytest
from celery.exceptions import ImproperlyConfigured

import celery_dflock
import celery_dflock.client.errors
from celery_dflock import (
    AsyncClient,
    AsyncDistributedLock,
    Client,
    ConnectionPool,
    DflockError,
    DistributedLock,
    DistributedSemaphore,
    InvalidValueError,
    LockNotAcquired,
)
from celery_dflock.config import DflockConfigError, get_config
from celery_dflock.keys import KeyDerivationError
from dflockd_server.testing import ServerThread
from tests.support.ports import free_port


def test_lock_and_semaphore_use_the_clients_settings_and_pool(dflock_server: ServerThread) -> None:
    with Client([dflock_server.address], acquire_timeout_s=0, lease_ttl_s=20) as client:
        with client.lock("clients:one") as lock:
            assert lock.locked() and lock.lease == 20
            assert lock.server == dflock_server.address
            assert not client.lock("clients:one").acquire()  # acquire_timeout_s=0: one try
        sem = client.semaphore("clients:sem", 2)
        other = client.semaphore("clients:sem", 2)
        assert sem.acquire() and other.acquire()
        assert not client.semaphore("clients:sem", 2).acquire()
        assert sem.release() and other.release()
        assert client.pool.opened >= 1 and client.pool.reused >= 1
        opened, reused = client.pool.opened, client.pool.reused
    # closed with the block: the next lock on its pool opens a connection
    lock = DistributedLock("clients:one", servers=[dflock_server.address], pool=client.pool)
    assert lock.acquire() and lock.release()
    assert (client.pool.opened, client.pool.reused) == (opened + 1, reused)
    client.pool.close()


def test_release_by_token_from_another_client(dflock_server: ServerThread) -> None:
    servers = [dflock_server.address]
    with Client(servers) as holder, Client(servers, acquire_timeout_s=0) as other:
        lock = holder.lock("clients:token")
        assert lock.acquire() and lock.token is not None
        token = lock.token
        assert other.release("clients:token", token) is True
        assert (other.pool.opened, other.pool.reused) == (1, 0)  # one pooled connection
        assert other.renew("clients:token", token, lease_ttl=5) is False  # released: no longer
        assert (other.pool.opened, other.pool.reused) == (1, 1)  # the same connection again
        again = other.lock("clients:token")
        assert again.acquire()  # free now
        assert again.release()
        assert other.release("clients:token", token) is False  # no longer held: idempotent
        assert other.lock("clients:token").release() is False
        assert lock.release() is False  # its holder finds it released elsewhere


_HOLD_AND_EXIT = """
import os, sys
from celery_dflock import Client
client = Client([("127.0.0.1", int(sys.argv[1]))])
sem = client.semaphore("clients:gone", 1)
assert sem.acquire()
print(sem.token, flush=True)
os._exit(0)  # gone without a release
"""


def test_release_by_token_after_the_locking_process_is_gone(
    dflock_server_factory: Callable[..., ServerThread],
) -> None:
    server = dflock_server_factory(auto_release_on_disconnect=False)
    done = subprocess.run(
        [sys.executable, "-c", _HOLD_AND_EXIT, str(server.port)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    token = done.stdout.strip()
    with Client([server.address], acquire_timeout_s=0) as client:
        assert not client.semaphore("clients:gone", 1).acquire()  # still held by the dead one
        assert client.release("clients:gone", token, limit=1) is True
        sem = client.semaphore("clients:gone", 1)
        assert sem.acquire()
        assert sem.release()


def test_a_bad_token_is_refused_before_anything_is_sent(dflock_server: ServerThread) -> None:
    with Client([dflock_server.address]) as client, pytest.raises(InvalidValueError, match="hex"):
        client.release("clients:bad", "not-a-token")


def test_stats_and_ping_name_an_unreachable_server(dflock_server: ServerThread) -> None:
    down = ("127.0.0.1", free_port())
    with Client([dflock_server.address, down], connect_timeout_s=2) as client:
        lock = client.lock("clients:stats")
        assert lock.acquire()
        host, port = lock.server
        up_status, down_status = client.stats()
        assert up_status.reachable and up_status.server is not None
        assert up_status.stats is not None
        keys = [item["key"] for item in up_status.stats["locks"]]
        if (host, port) == dflock_server.address:
            assert "clients:stats" in keys
        assert not down_status.reachable
        assert down_status.error is not None and f"127.0.0.1:{down[1]}" in down_status.error
        pings = client.ping()
        assert [p.reachable for p in pings] == [True, False]
        assert pings[1].address == f"127.0.0.1:{down[1]}"
        (only,) = client.ping(f"{dflock_server.host}:{dflock_server.port}")
        assert only.reachable and only.stats is None
        with pytest.raises(InvalidValueError, match="not one of this client's servers"):
            client.stats(("10.9.9.9", 1))
        lock.release()


def test_settings_are_validated_once_naming_the_argument() -> None:
    with pytest.raises(InvalidValueError, match="renew_ratio"):
        Client(renew_ratio=1.5)
    with pytest.raises(InvalidValueError, match="servers"):
        Client([])
    with pytest.raises(ValueError, match="connect_timeout_s"):
        Client(connect_timeout_s=0)
    client = Client([("127.0.0.1", 1)])
    lock = client.lock("clients:x")
    assert isinstance(lock, DistributedLock)
    assert client.server_for("clients:x") == ("127.0.0.1", 1)
    assert lock._core.routing.settings is client.settings  # pyright: ignore[reportPrivateUsage]  # passed down whole


def test_a_lease_is_whole_seconds_everywhere_a_fraction_is_refused_naming_it() -> None:
    """One lease rule: ``lease_ttl_s`` / ``lease_ttl`` as Celery's ``lock_ttl``, whole
    seconds; a fraction is refused, naming the argument (a timeout's fraction rounds up)."""
    client = Client([("127.0.0.1", 1)])
    for bad in (
        lambda: Client(lease_ttl_s=1.5),  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
        lambda: client.lock("k", lease_ttl_s=1.5),  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
        lambda: client.semaphore("k", 2, lease_ttl_s=0),
        lambda: DistributedLock("k", lease_ttl_s=1.5),  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    ):
        with pytest.raises(
            InvalidValueError,
            match=r"lease_ttl_s must be (a whole number|between)",
        ):
            bad()
    for bad in (
        lambda: client.renew("k", "0" * 32, lease_ttl=1.5),  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
        lambda: client.hold("k", note="n", lease_ttl=2.5),  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    ):
        with pytest.raises(InvalidValueError, match="lease_ttl must be a whole number"):
            bad()
    assert (
        client.lock("k", acquire_timeout_s=1.5, lease_ttl_s=2)._core.routing.acquire_timeout_s == 2
    )  # pyright: ignore[reportPrivateUsage]


async def test_async_client(dflock_server: ServerThread) -> None:
    servers = [dflock_server.address]
    async with AsyncClient(servers, acquire_timeout_s=0) as client:
        lock = client.lock("clients:async")
        assert await lock.acquire() and lock.token is not None
        assert not await client.lock("clients:async").acquire()
        with Client(servers) as blocking:  # release by token works across the two faces
            assert await asyncio.to_thread(blocking.release, "clients:async", lock.token)
        assert await lock.release() is False  # released elsewhere
        sem = client.semaphore("clients:async-sem", 3)
        assert await sem.acquire() and sem.token is not None
        assert await client.release("clients:async-sem", sem.token, limit=3)
        assert await sem.release() is False
        (status,) = await client.stats()
        assert status.reachable and status.stats is not None
        (pong,) = await client.ping()
        assert pong.reachable
        opened, reused = client.pool.opened, client.pool.reused
    # closed with the block: the next lock on its pool opens a connection
    lock = AsyncDistributedLock("clients:one", servers=servers, pool=client.pool)
    assert await lock.acquire() and await lock.release()
    assert (client.pool.opened, client.pool.reused) == (opened + 1, reused)
    await client.pool.aclose()


def test_client_is_usable_from_threads(dflock_server: ServerThread) -> None:
    with Client([dflock_server.address], acquire_timeout_s=5) as client:
        held: list[bool] = []

        def run() -> None:
            with client.lock("clients:threads"):
                held.append(True)

        threads = [threading.Thread(target=run) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert held == [True] * 4


# ------------------------------------------------------------------ the error tree


def test_every_public_error_is_a_dflock_error() -> None:
    errors = [
        obj
        for _, obj in inspect.getmembers(celery_dflock.client.errors, inspect.isclass)
        if issubclass(obj, Exception) and obj.__module__ == "celery_dflock.client.errors"
    ]
    assert len(errors) >= 12
    for error in [*errors, DflockConfigError, KeyDerivationError]:
        assert issubclass(error, DflockError), error
    for name in celery_dflock.__all__:
        value = getattr(celery_dflock, name)
        if isinstance(value, type) and issubclass(value, BaseException):
            assert issubclass(value, DflockError), name


def test_config_errors_are_also_improperly_configured_and_value_errors() -> None:
    assert issubclass(DflockConfigError, ImproperlyConfigured)
    assert issubclass(DflockConfigError, ValueError)
    assert issubclass(DflockConfigError, InvalidValueError)
    assert issubclass(KeyDerivationError, ValueError)
    assert issubclass(LockNotAcquired, TimeoutError)

    class App:
        conf: dict[str, object] = {"dflock_renew_ratio": 2}  # noqa: RUF012

    with pytest.raises(DflockError, match="dflock_renew_ratio") as failure:
        get_config(App())
    assert isinstance(failure.value, ImproperlyConfigured)


def test_a_server_listed_twice_is_refused() -> None:
    with pytest.raises(InvalidValueError, match=r"^servers: server h:1 is listed twice"):
        Client([("h", 1), ("h", 2), ("h", 1)])


def test_a_host_written_with_its_port_or_brackets_is_refused_naming_it(
    dflock_server: ServerThread,
) -> None:
    """``("127.0.0.1:6388", 6388)`` or ``("[::1]", 6388)`` is refused where it is given, not
    taken as a host name that no lookup finds at the first acquire; an IPv6 address is a host."""
    host, port = dflock_server.address
    for written in (f"{host}:{port}", f"[{host}]", "[::1]", "h:x"):
        with pytest.raises(InvalidValueError, match=rf"server host '{re.escape(written)}'"):
            Client([(written, port)])
    for address in ("::1", "fe80::1%eth0", "2001:db8::1"):
        assert Client([(address, port)]).servers == ((address, port),)
    with Client([(host, port)], acquire_timeout_s=0) as client, client.lock("k") as lock:
        assert lock.fence is not None


def test_a_negative_timeout_is_refused_even_a_fraction_that_rounds_up_to_zero(
    dflock_server: ServerThread,
) -> None:
    """``acquire_timeout_s=-0.5`` is refused as ``-1`` is, naming the argument; it was rounded
    up to 0 and taken as a try-once acquire."""
    servers = [dflock_server.address]
    with Client(servers) as client:  # (closed: its pooled connection is not left to the GC)
        lock = client.lock("k")
        assert lock.enqueue() == "acquired"
        for bad, name in (
            (lambda: Client(servers, acquire_timeout_s=-0.5), "acquire_timeout_s"),
            (lambda: client.lock("k", acquire_timeout_s=-0.5), "acquire_timeout_s"),
            (lambda: DistributedLock("k", -0.5, servers=servers), "acquire_timeout_s"),
            (lambda: client.hold("k", note="n", lease_ttl=5, timeout=-0.5), "timeout"),
            (lambda: lock.wait(-0.5), "timeout_s"),
        ):
            with pytest.raises(InvalidValueError, match=rf"^{name} must be between 0 and"):
                bad()
        assert lock.release()


def test_the_cores_value_errors_are_dflock_errors() -> None:
    for bad in (
        lambda: DistributedLock("k", renew_ratio=0),
        lambda: DistributedLock("k", acquire_timeout_s=-1),
        lambda: DistributedLock("has space"),
        lambda: DistributedLock("k", servers=[("h", 0)]),
    ):
        with pytest.raises(InvalidValueError):
            bad()


def test_bad_arguments_of_locks_semaphores_and_pools_are_dflock_errors_naming_them() -> None:
    """A semaphore without a limit, an ``on_lost`` that cannot be called, a pool of the wrong
    kind or with a bad setting, a release by token with a bad ``limit``: each an
    `InvalidValueError` naming the argument, before anything is sent (none was a plain lock,
    an AssertionError, a TypeError or a bare ValueError)."""
    client = Client([("127.0.0.1", 1)])
    for bad, name in (
        (lambda: client.semaphore("k", None), "limit"),  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
        (lambda: DistributedSemaphore("k", None), "limit"),  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
        (lambda: client.lock("k", on_lost=5), "on_lost"),  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
        (lambda: DistributedSemaphore("k", 2, on_lost="x"), "on_lost"),  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
        (lambda: DistributedLock("k", pool=5), "pool"),  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
        (lambda: ConnectionPool(max_idle_time_s="x"), "max_idle_time_s"),  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
        (lambda: ConnectionPool(max_idle_per_server=-1), "max_idle_per_server"),
        (lambda: client.release("k", "0" * 32, limit=0), "limit"),
        (lambda: client.release("k", "0" * 32, limit="2"), "limit"),  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    ):
        with pytest.raises(InvalidValueError, match=name):
            bad()


# ------------------------------------------------------------------ imports


def test_the_client_does_not_import_celery() -> None:
    code = (
        "import sys, celery_dflock.client, celery_dflock.client.aio, celery_dflock\n"
        "assert 'celery' not in sys.modules, sorted(m for m in sys.modules if 'celery' in m)\n"
        "celery_dflock.Client, celery_dflock.DflockError\n"
        "assert 'celery' not in sys.modules\n"
        "celery_dflock.LockedTask\n"
        "assert 'celery' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_connect_timeout_too_long_for_the_socket_is_refused_at_construction(
    dflock_server: ServerThread,
) -> None:
    """A connect timeout past what a socket's timeout can hold (about 9.2e9 s) raised a raw
    ``OverflowError`` at the first connection; it is refused where it is given, and the
    longest accepted, the protocol's 9e9 s as for every other timeout, connects."""
    with pytest.raises(InvalidValueError, match=r"connect_timeout_s .* up to 9000000000"):
        Client([dflock_server.address], connect_timeout_s=1e12)
    with pytest.raises(InvalidValueError, match=r"connect_timeout_s .* up to 9000000000"):
        AsyncClient([dflock_server.address], connect_timeout_s=1e12)
    with Client([dflock_server.address], connect_timeout_s=9e9) as client:
        lock = client.lock("clients:longest-connect")
        assert lock.acquire() and lock.release()


@pytest.mark.parametrize("client_class", [Client, AsyncClient])
def test_server_for_refuses_a_key_no_lock_could_take_naming_it(
    client_class: type[Client] | type[AsyncClient], dflock_server: ServerThread
) -> None:
    """``server_for`` checks its key as ``lock`` does: a key with a space was routed as if a
    lock could take it (the server refuses it), and one that is no str ended in an
    ``AttributeError`` from inside the sharding strategy."""
    client = client_class([dflock_server.address, ("127.0.0.1", free_port())])
    for bad, words in (("has space", "whitespace"), (5, "must be a str"), ("", "empty")):
        with pytest.raises(InvalidValueError, match=words):
            client.server_for(bad)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
        with pytest.raises(InvalidValueError, match=words):
            client.lock(bad)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    assert client.server_for("clients:route") == client.lock("clients:route").server


@pytest.mark.parametrize("bad", ["yes", None])
def test_a_hold_s_detached_that_is_no_bool_is_refused_naming_it(
    bad: object, dflock_server: ServerThread
) -> None:
    """``hold(..., detached=...)`` of either face, and a lock's ``hold``: a value that is not
    True or False is an `InvalidValueError` naming ``detached``, before anything is sent; it
    was a ``TypeError: tuple indices must be integers`` from inside the request builder."""
    address, key = dflock_server.address, "clients:detached"
    detached: bool = bad  # type: ignore[assignment]  # pyright: ignore[reportAssignmentType]
    client, aclient = Client([address]), AsyncClient([address])
    with pytest.raises(InvalidValueError, match="detached must be True or False"):
        client.hold(key, note="n", lease_ttl=5, detached=detached)
    with pytest.raises(InvalidValueError, match="detached must be True or False"):
        asyncio.run(aclient.hold(key, note="n", lease_ttl=5, detached=detached))
    with pytest.raises(InvalidValueError, match="detached must be True or False"):
        DistributedLock(key, servers=[address]).hold("n", detached=detached)
    with client.lock(key, acquire_timeout_s=0) as lock:  # nothing was taken
        assert lock.owned()
    client.close()


def test_a_server_asked_of_stats_ping_or_shards_is_named_as_given(
    dflock_server: ServerThread,
) -> None:
    """``stats`` / ``ping`` / ``shards`` of one ``server`` of either face: one not in the list
    is refused naming ``server=`` as given (a ``"host"`` without its port was shown as
    ``('host', -1)``, a value the caller never wrote), and ``[host, port]``, as ``servers``
    takes it, names a listed server (it was refused as not one of the client's servers)."""
    host, port = dflock_server.address
    client, aclient = Client([(host, port)]), AsyncClient([(host, port)])
    for ask in (client.stats, client.ping, client.shards):
        with pytest.raises(InvalidValueError, match=r"server='127\.0\.0\.1' is not one of"):
            ask(host)
        ((answer),) = ask([host, port])  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
        assert answer.address == f"{host}:{port}" and answer.error is None

    async def ask_async() -> None:
        for ask in (aclient.stats, aclient.ping, aclient.shards):
            with pytest.raises(InvalidValueError, match=r"server='127\.0\.0\.1' is not one of"):
                await ask(host)
            ((answer),) = await ask([host, port])  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
            assert answer.address == f"{host}:{port}" and answer.error is None
        await aclient.close()  # on its loop: nothing left for a later test's collection

    asyncio.run(ask_async())
    client.close()


@pytest.mark.parametrize("lock_class", [DistributedLock, AsyncDistributedLock])
def test_a_lock_s_router_that_cannot_route_it_is_refused_naming_it(
    lock_class: type[DistributedLock] | type[AsyncDistributedLock], dflock_server: ServerThread
) -> None:
    """``router=``: something that is no `ClusterRouter` is refused when the lock is made,
    naming ``router`` (it was taken, and the acquire ended in ``AttributeError: 'int' object
    has no attribute 'map'``); a cluster client's router given to a lock routed over its list
    is refused too (it was ignored without a word: no map was shared)."""
    servers = [dflock_server.address]
    router = Client(servers, sharding_strategy="cluster").router
    assert router is not None
    with pytest.raises(InvalidValueError, match="router must be None or a ClusterRouter"):
        lock_class("clients:router", servers=servers, sharding_strategy="cluster", router=5)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    with pytest.raises(InvalidValueError, match=r'router .* sharding_strategy="cluster"'):
        lock_class("clients:router", servers=servers, router=router)
    assert lock_class("clients:router", servers=servers, sharding_strategy="cluster", router=router)


def test_a_coroutine_function_as_a_blocking_lock_s_on_lost_is_refused_naming_it(
    dflock_server: ServerThread,
) -> None:
    """The asyncio face awaits an ``async def`` ``on_lost``; the blocking face called it from
    its renewal thread and dropped the coroutine (``RuntimeWarning: coroutine ... was never
    awaited``): the loss was never reported to it. It is refused when the lock is made."""
    servers = [dflock_server.address]

    async def on_lost(lock: object) -> None:
        del lock

    client = Client(servers)
    for make in (
        lambda: client.lock("clients:async-cb", on_lost=on_lost),
        lambda: client.semaphore("clients:async-cb", 2, on_lost=on_lost),
        lambda: DistributedLock("clients:async-cb", servers=servers, on_lost=on_lost),
        lambda: DistributedSemaphore("clients:async-cb", 2, servers=servers, on_lost=on_lost),
    ):
        with pytest.raises(InvalidValueError, match="on_lost of a blocking lock"):
            make()
    assert AsyncClient(servers).lock("clients:async-cb", on_lost=on_lost)
    assert AsyncDistributedLock("clients:async-cb", servers=servers, on_lost=on_lost)
