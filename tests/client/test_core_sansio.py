"""`LockCore` without sockets: reply bytes in, decisions out (as the server's dispatch tests).

Each reply is the line a server sends, decoded by the protocol (`decode_reply`) and handed to
the core, which says what the lock now is and what to send next. No connection, no server.
"""

from __future__ import annotations

import json
import logging
import time

import pytest

from celery_dflock.client import _replies, wire
from celery_dflock.client._core import LockCore
from celery_dflock.client._grant import KEPT_MARGIN_S, LockState
from celery_dflock.client._replies import Reply
from celery_dflock.client._requests import Command
from celery_dflock.client._router import REDIRECT_LOOP, ClusterRouter, NextTry
from celery_dflock.client._servers import ServerInfo
from celery_dflock.client._session import ClientSession
from celery_dflock.client._settings import REPLY_GRACE_S, ClientSettings
from celery_dflock.client.cluster import ClusterMap
from celery_dflock.client.errors import (
    AuthError,
    DflockError,
    InvalidValueError,
    LimitMismatchError,
    LockNotOwned,
    MaxLocksError,
    MaxWaitersError,
    ProtocolError,
    ServerDraining,
    ShardingMismatchError,
)

TOKEN = "00000000000000a1" + "b" * 16
FENCING = ServerInfo("dflockd-server", "test", frozenset({wire.FEATURE_FENCE}))
SERVERS = (("10.0.0.1", 6388),)


def reply(command: Command, line: bytes) -> Reply:
    """What the server's line means, as the connection hands it to the core."""
    return _replies.decode_reply(command, line)


def make(
    limit: int | None = None,
    *,
    acquire_timeout_s: int = 5,
    lease_ttl_s: int | None = None,
    settings: ClientSettings | None = None,
    router: ClusterRouter | None = None,
) -> LockCore:
    return LockCore(
        "jobs",
        settings or ClientSettings.checked(SERVERS),
        limit=limit,
        acquire_timeout_s=acquire_timeout_s,
        lease_ttl_s=lease_ttl_s,
        router=router,
    )


def granted(core: LockCore, sent_at: float = 100.0) -> None:
    core.begin_acquire()
    command, _, _ = core.acquire_request(FENCING)
    assert core.on_grant_reply(command, reply(command, f"ok {TOKEN} 33".encode()), sent_at, FENCING)
    core.routing.end_acquire()


# ---------------------------------------------------------------------- grant, renew, release
def test_an_acquire_is_granted_renewed_and_released() -> None:
    core = make(lease_ttl_s=30)
    core.begin_acquire()
    command, data, timeout = core.acquire_request(FENCING)
    assert (command, data, timeout) == (Command.LOCK, b"l\njobs\n5 30\n", 5 + REPLY_GRACE_S)
    assert core.on_grant_reply(command, reply(command, f"ok {TOKEN} 33".encode()), 100.0, FENCING)
    core.routing.end_acquire()
    assert (core.state, core.grant.token, core.grant.lease, core.grant.fence) == (
        LockState.HELD,
        TOKEN,
        33,
        0xA1,
    )
    assert core.grant.lease_deadline == 133.0 and core.locked()
    with pytest.raises(DflockError, match="already held"):
        core.acquire_request(FENCING)

    command, data, _ = core.renew_request()
    assert (command, data) == (Command.RENEW, f"n\njobs\n{TOKEN} 30\n".encode())
    outcome = core.on_renew_reply(reply(command, b"ok 30"), 110.0)
    assert outcome.renewed and core.grant.lease_deadline == 140.0

    command, data, _ = core.release_request()
    assert (command, data) == (Command.RELEASE, f"r\njobs\n{TOKEN}\n".encode())
    assert core.on_release_reply(reply(command, b"ok"))
    assert (core.state, core.grant.token, core.grant.fence) == (LockState.IDLE, None, None)


def test_a_locks_requests_are_the_protocols_bytes() -> None:
    """A lock builds its own acquire and release from parts checked when it was made, without
    checking them again, byte by byte (no lease, a lease, an owner note to a server with
    holds)."""
    holds = ServerInfo(
        "dflockd-server", "test", frozenset({wire.FEATURE_HOLDS}), default_lease_ttl_s=21
    )
    for lease in (None, 30):
        with_lease = "" if lease is None else f" {lease}"
        core = make(lease_ttl_s=lease)
        core.begin_acquire()
        assert core.acquire_request(FENCING)[:2] == (
            Command.LOCK,
            f"l\njobs\n5{with_lease}\n".encode(),
        )
        assert core.enqueue_request(FENCING)[:2] == (
            Command.ENQUEUE,
            f"e\njobs\n{with_lease.lstrip()}\n".encode(),
        )
        sem = make(limit=3, lease_ttl_s=lease)
        sem.begin_acquire()
        assert sem.acquire_request(FENCING)[:2] == (
            Command.SEM_LOCK,
            f"sl\njobs\n5 3{with_lease}\n".encode(),
        )
        assert sem.enqueue_request(FENCING)[:2] == (
            Command.SEM_ENQUEUE,
            f"se\njobs\n3{with_lease}\n".encode(),
        )
        granted(sem)
        assert sem.renew_request()[:2] == (
            Command.SEM_RENEW,
            f"sn\njobs\n{TOKEN}{with_lease}\n".encode(),
        )
    settings = ClientSettings.checked(SERVERS)
    noted = LockCore("jobs", settings, acquire_timeout_s=5, lease_ttl_s=None, note="t~1/w@h")
    noted.begin_acquire()
    command, data, _ = noted.acquire_request(holds)
    assert (command, data) == (  # the lease the server's hello says is its default
        Command.HOLD,
        b"hl\njobs\n5 21 c t~1/w@h\n",
    )
    assert noted.on_grant_reply(command, reply(command, f"ok {TOKEN} 21".encode()), 1.0, holds)
    assert noted.renew_request()[:2] == (Command.RENEW, f"n\njobs\n{TOKEN}\n".encode())
    assert noted.hand_off_request(9, holds)[:2] == (
        Command.HAND_DOWN,
        f"hd\njobs\n{TOKEN} 9\n".encode(),
    )
    assert noted.release_request()[:2] == (Command.RELEASE, f"r\njobs\n{TOKEN}\n".encode())


def test_a_lock_without_a_lease_asks_for_the_servers_default_and_keeps_none_of_its_own() -> None:
    """The lease default lives in one place, the server: a lock made without a lease names
    none where the protocol lets it (``l``), and where it must name one (``hl``, ``ht``) asks
    for the default the server said in ``hello``. A server with holds that does not say it
    gets a plain ``l`` for an acquire (no owner note), and a hold or take-over that must
    name a lease is refused before asking, naming the lock's lease to give."""
    settings = ClientSettings.checked(SERVERS)
    quiet = ServerInfo("dflockd-server", "old", frozenset({wire.FEATURE_HOLDS}))
    noted = LockCore("jobs", settings, acquire_timeout_s=5, lease_ttl_s=None, note="t~1/w@h")
    noted.begin_acquire()
    assert noted.acquire_request(quiet)[:2] == (Command.LOCK, b"l\njobs\n5\n")
    with pytest.raises(InvalidValueError, match="lease_ttl_s="):
        noted.hold_request(quiet, "t~1/w@h")
    with pytest.raises(InvalidValueError, match="does not say its default lease"):
        noted.take_over_request(quiet, TOKEN, "t~1/w@h", None)
    says = ServerInfo(
        "dflockd-server", "new", frozenset({wire.FEATURE_HOLDS}), default_lease_ttl_s=40
    )
    assert noted.hold_request(says, "n~2")[:2] == (
        Command.HOLD,
        b"hl\njobs\n5 40 d n~2\n",
    )
    assert noted.take_over_request(says, TOKEN, "n~2", 7)[:2] == (
        Command.TAKE,
        f"ht\njobs\n{TOKEN} 40 7 n~2\n".encode(),
    )
    own = LockCore("jobs", settings, acquire_timeout_s=5, lease_ttl_s=12, note="t~1/w@h")
    own.begin_acquire()
    assert own.acquire_request(quiet)[:2] == (
        Command.HOLD,
        b"hl\njobs\n5 12 c t~1/w@h\n",
    )


def test_the_locks_of_one_client_share_each_servers_endpoint() -> None:
    """Every lock on a server gets the one `Endpoint` its settings made for it (the pool then
    finds its idle connections by identity), equal to one made anew."""
    settings = ClientSettings.checked((("10.0.0.1", 6388), ("10.0.0.2", 6388)))
    seen: set[int] = set()
    for i in range(20):
        core = LockCore(f"k{i}", settings, acquire_timeout_s=5, lease_ttl_s=None)
        endpoint = core.endpoint
        index = settings.servers.index((endpoint.host, endpoint.port))
        assert endpoint is settings.server_endpoint(index)
        assert endpoint == settings.endpoint(endpoint.host, endpoint.port)
        seen.add(index)
    assert seen == {0, 1}
    assert settings.endpoints() == [settings.server_endpoint(0), settings.server_endpoint(1)]


def test_a_semaphore_speaks_its_own_commands() -> None:
    core = make(3)
    core.begin_acquire()
    command, data, _ = core.acquire_request(None)
    assert (command, data) == (Command.SEM_LOCK, b"sl\njobs\n5 3\n")
    assert core.on_grant_reply(command, reply(command, f"ok {TOKEN} 33".encode()), 1.0, None)
    assert core.grant.fence is None  # a server that did not say it fences: the token is no fence
    assert core.release_request()[0] is Command.SEM_RELEASE


def test_queued_then_granted_counts_the_lease_from_the_enqueue() -> None:
    core = make()
    command, data, _ = core.enqueue_request(FENCING)
    assert (command, data) == (Command.ENQUEUE, b"e\njobs\n\n")
    assert not core.on_grant_reply(command, reply(command, b"queued"), 100.0, FENCING)
    assert core.state is LockState.ENQUEUED
    command, data, timeout = core.wait_request(2.5)
    assert (command, data, timeout) == (Command.WAIT, b"w\njobs\n3\n", 3 + REPLY_GRACE_S)
    assert core.on_grant_reply(command, reply(command, f"ok {TOKEN} 33".encode()), 150.0, FENCING)
    # granted when freed, maybe long before this `w` was sent: the lease counts from the `e`
    assert core.state is LockState.HELD and core.grant.lease_deadline == 133.0


def test_a_grant_collected_late_may_be_reattached_until_its_lease_surely_ended() -> None:
    """A `w` answered after the lease counted from its `e` ran out: not owned until renewed,
    but its connection broken, a reattach may still find it held until the reply's time plus
    the lease (the latest the server's lease can end), where a grant not collected by `w` has
    the lease left alone. A renewal ends that: from then on the lease is counted as usual."""
    now = [150.0]
    core = make(lease_ttl_s=30)
    core.grant.clock = lambda: now[0]
    command, _, _ = core.enqueue_request(FENCING)
    assert not core.on_grant_reply(command, reply(command, b"queued"), 100.0, FENCING)
    command, _, _ = core.wait_request(60)
    assert core.on_grant_reply(command, reply(command, f"ok {TOKEN} 30".encode()), 101.0, FENCING)
    assert not core.owned() and core.grant.lease_left() == -20.0  # counted from the `e`
    core.connection_broke("EOF")
    assert core.grant.reattach_left() == 30.0  # answered now: its lease ends by 180 at the latest
    assert core.grant.reattach_pause("refused", now=179.0) == pytest.approx(0.05)
    assert core.grant.reattach_pause("refused", now=180.0) is None
    assert core.reattach_endpoint(now=178.0).connect_timeout_s == pytest.approx(2.0)
    assert core.on_renew_reply(reply(Command.RENEW, b"ok 30"), 160.0).renewed
    now[0] = 170.0
    assert core.owned() and core.grant.reattach_left() == core.grant.lease_left() == 20.0
    acquired = make(lease_ttl_s=30)  # not by `w`: the lease left is all a reattach has
    acquired.grant.clock = lambda: now[0]
    command, _, _ = acquired.acquire_request(FENCING)
    assert acquired.on_grant_reply(command, reply(command, f"ok {TOKEN} 30".encode()), 120.0, None)
    assert acquired.grant.reattach_left() == acquired.grant.lease_left() == -20.0


def test_a_timeout_is_not_held_and_a_busy_hold_names_its_holder() -> None:
    core = make()
    core.begin_acquire()
    command, _, _ = core.acquire_request(FENCING)
    assert not core.on_grant_reply(command, reply(command, b"timeout"), 1.0, FENCING)
    assert (core.state, core.busy, core.holder) == (LockState.IDLE, True, None)
    holds = ServerInfo(
        "dflockd-server", "test", frozenset({wire.FEATURE_HOLDS}), default_lease_ttl_s=33
    )
    core.begin_acquire()
    command, data, _ = core.hold_request(holds, "me/1")
    assert (command, data) == (Command.HOLD, b"hl\njobs\n5 33 d me/1\n")
    assert not core.on_grant_reply(command, reply(command, b"timeout them/2"), 1.0, holds)
    assert (core.busy, core.holder) == (True, "them/2")


def test_a_wait_whose_grant_expired_is_not_held(caplog: pytest.LogCaptureFixture) -> None:
    core = make()
    command, _, _ = core.enqueue_request()
    core.on_grant_reply(command, reply(command, b"queued"), 1.0, None)
    command, _, _ = core.wait_request(None)
    with caplog.at_level(logging.WARNING, "celery_dflock.client"):
        assert not core.on_grant_reply(command, reply(command, b"error_lease_expired"), 2.0, None)
    assert core.state is LockState.IDLE and "call wait() sooner" in caplog.text


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("limit", "line", "error", "says"),
    [
        (None, b"error_max_locks", MaxLocksError, "--max-locks"),
        (None, b"error_max_waiters", MaxWaitersError, "--max-waiters"),
        (None, b"error_limit_mismatch", LimitMismatchError, "in use as a semaphore"),
        (2, b"error_limit_mismatch", LimitMismatchError, "limit other than 2"),
        (None, b"error_auth", AuthError, "requires authentication"),
        (None, b"error_draining", ServerDraining, "shutting down"),
        (None, b"error", ProtocolError, "--max-lease-ttl"),
    ],
)
def test_each_refusal_is_the_error_that_says_what_to_do(
    limit: int | None, line: bytes, error: type[DflockError], says: str
) -> None:
    core = make(limit, lease_ttl_s=400)
    core.begin_acquire()
    command, _, _ = core.acquire_request(None)
    with pytest.raises(error, match=says) as raised:
        core.on_grant_reply(command, reply(command, line), 1.0, None)
    assert "10.0.0.1:6388" in str(raised.value) and core.state is LockState.IDLE


def test_a_lease_above_the_servers_limit_is_refused_before_asking() -> None:
    limited = ServerInfo("dflockd-server", "test", frozenset(), max_lease_ttl_s=300)
    core = make(lease_ttl_s=400)
    core.begin_acquire()
    with pytest.raises(ValueError, match=r"above the longest lease .* \(300 s"):
        core.acquire_request(limited)


def test_a_wait_without_an_enqueue_is_refused() -> None:
    with pytest.raises(LockNotOwned, match="enqueue"):
        make().wait_request(None)


# ---------------------------------------------------------------------- losing the lease
def test_a_refused_renewal_loses_the_lock_once() -> None:
    core = make()
    granted(core)
    command, _, _ = core.renew_request()
    outcome = core.on_renew_reply(reply(command, b"error"), 110.0)
    assert not outcome.renewed and not outcome.reattach
    assert outcome.lost_reason is not None and "refused the renewal" in outcome.lost_reason
    assert core.mark_lost(outcome.lost_reason) and core.lost
    assert not core.mark_lost("again")  # reported once
    assert not core.owned()


def test_a_draining_server_means_reattach_not_lost() -> None:
    core = make()
    granted(core)
    command, _, _ = core.renew_request()
    outcome = core.on_renew_reply(reply(command, b"error_draining"), 110.0)
    assert (outcome.renewed, outcome.reattach) == (False, True) and not core.lost


def test_a_broken_connection_is_reattached_while_the_lease_runs() -> None:
    core = make()
    now = time.monotonic()
    granted(core, sent_at=now)
    core.connection_broke("reset by peer")
    first = core.grant.reattach_pause("refused", now=now)
    second = core.grant.reattach_pause("refused", now=now)
    assert first is not None and second is not None and second == 2 * first
    assert core.grant.reattach_pause("refused", now=now + 34) is None  # the lease ran out
    assert core.mark_unreachable() and core.lost
    fresh = make()  # a reattach that does get through: still held
    granted(fresh, sent_at=now)
    fresh.connection_broke("reset by peer")
    command, _, _ = fresh.renew_request()
    assert fresh.on_renew_reply(reply(command, b"ok 33"), now).renewed
    assert fresh.grant.broken is None and not fresh.lost


def test_a_release_the_server_refuses_was_a_loss_unless_sent_twice() -> None:
    core = make()
    granted(core)
    command, _, _ = core.release_request()
    assert not core.on_release_reply(reply(command, b"error"))
    assert core.lost and core.state is LockState.HELD  # the caller notifies, then resets
    again = make()
    granted(again)
    assert not again.on_release_reply(reply(command, b"error"), retried=True)
    assert not again.lost and again.state is LockState.IDLE


# ---------------------------------------------------------------------- redirects
def cluster(*nodes: str) -> tuple[ClientSettings, ClusterRouter]:
    """Cluster settings whose map puts every key on ``nodes[0]``."""
    settings = ClientSettings.checked(SERVERS, sharding_strategy="cluster")
    router = ClusterRouter(settings.servers)
    line = "ok " + json.dumps(
        {
            "mode": wire.MODE_CLUSTER,
            "hash": wire.HASH_FNV1A32,
            "shard_count": 1,
            "nodes": list(nodes),
            "current": [0],
            "target": [0],
            "members": list(nodes),
        }
    )
    shards = reply(Command.SHARDS, line.encode())
    assert isinstance(shards, _replies.JsonReply)
    router.update(ClusterMap.parse(shards.data, "10.0.0.1:6388"))
    return settings, router


def test_cluster_routing_aims_at_the_maps_node_and_follows_moved_then_pauses_in_a_loop() -> None:
    settings, router = cluster("10.0.0.9:6388", "10.0.0.2:6388")
    core = make(settings=settings, router=router)
    assert core.routing.route() and core.endpoint.address == "10.0.0.9:6388"
    core.begin_acquire()
    command, _, _ = core.acquire_request(FENCING)
    for _ in range(REDIRECT_LOOP):
        moved = reply(command, b"error_moved 10.0.0.2:6388")
        assert core.routing.redirected(moved)
        assert core.routing.on_redirect(moved) == NextTry(0.0, reroute=False)  # at once, there
        assert core.endpoint.address == "10.0.0.2:6388"
    step = core.routing.on_redirect(reply(command, b"error_moved 10.0.0.9:6388"))
    assert step is not None and step.reroute and step.reread and step.pause_s > 0  # a loop
    unavailable = reply(command, b"error_unavailable")
    assert core.routing.redirected(unavailable)
    step = core.routing.on_redirect(unavailable)
    assert step is not None and step.reroute and not step.reread
    assert core.routing.wait_seconds() <= 5  # what is left of the acquire's time, never more


def test_error_ask_sends_the_next_acquire_there_once_with_asking_first() -> None:
    settings, router = cluster("10.0.0.9:6388")
    core = make(settings=settings, router=router)
    core.routing.route()
    core.begin_acquire()
    command, _, _ = core.acquire_request(FENCING)
    asked = reply(command, b"error_ask 10.0.0.3:6388")
    assert isinstance(asked, _replies.Asked)
    assert core.routing.on_ask(asked) == NextTry(0.0, reroute=False)
    assert core.routing.asking and core.endpoint.address == "10.0.0.3:6388"
    assert core.routing.on_ask_refused() is not None  # an old member: pause, then route by the map
    assert core.routing.ask_ticket is None  # a member that sends no ticket
    with_ticket = reply(command, b"error_ask 10.0.0.4:6388 1.2.3." + b"0" * 32)
    assert isinstance(with_ticket, _replies.Asked)
    core.routing.on_ask(with_ticket)
    assert (
        core.routing.ask_ticket == "1.2.3." + "0" * 32 and core.endpoint.address == "10.0.0.4:6388"
    )


def test_a_hand_over_that_outlasts_the_acquire_says_so() -> None:
    settings, router = cluster("10.0.0.9:6388")
    core = make(settings=settings, router=router, acquire_timeout_s=0)
    core.begin_acquire()
    core.routing.route_deadline = time.monotonic() - 1  # its time (>= HANDOVER_MIN_WAIT_S) is up
    command, _, _ = core.acquire_request(FENCING)
    assert core.routing.on_redirect(reply(command, b"error_unavailable")) is None
    assert core.routing.handover is not None and "hand-over" in core.routing.handover


def test_a_list_mode_client_redirected_names_both_server_lists() -> None:
    core = make()
    core.begin_acquire()
    command, _, _ = core.acquire_request(FENCING)
    moved = reply(command, b"error_moved 10.0.0.2:6388")
    assert core.routing.redirected(moved) and core.routing.router is None
    shards = {"mode": "static", "members": ["10.0.0.1:6388", "10.0.0.2:6388"]}
    error = core.routing.mismatch_error(moved, shards)
    assert isinstance(error, ShardingMismatchError)
    assert "--members 10.0.0.1:6388,10.0.0.2:6388" in str(error)


# ---------------------------------------------------------------- sessions (issue 47)
SESSIONS = ServerInfo(
    "dflockd-server",
    "test",
    frozenset({wire.FEATURE_FENCE, wire.FEATURE_SESSION, wire.FEATURE_DURABLE}),
    session_ttl_s=3,
)


def held_on_sessions(sent: float) -> LockCore:
    core = make()
    granted = reply(Command.LOCK, f"ok {TOKEN} 60".encode())
    assert core.on_grant_reply(Command.LOCK, granted, sent, SESSIONS)
    return core


def test_a_grant_on_a_session_connection_counts_from_the_last_answered_send_time() -> None:
    """The loss deadline is the send time of the last answered request plus the session
    time, less a margin: never from a reply's arrival, never past the lease."""
    sent = time.monotonic() - 10.0  # the grant's request went 10 s ago, the session is 3 s
    core = held_on_sessions(sent)
    assert core.grant.session_deadline < sent + 3
    assert not core.owned()  # a lease of 60 s does not say it is held: no answer for 10 s
    assert core.grant.lease_left() <= 0  # a broken connection now: lost, not reattached
    assert core.first_renewal_in() == 0.0  # confirmed at once
    renewed_at = time.monotonic()
    outcome = core.on_renew_reply(reply(Command.RENEW, b"ok 60"), renewed_at)
    assert outcome.renewed and core.owned()
    assert renewed_at + 2 < core.grant.hold_deadline() < renewed_at + 3


def test_a_session_connection_is_kept_fresh_by_renewals_a_third_of_the_session_time_apart() -> None:
    core = held_on_sessions(time.monotonic())
    assert core.renew_interval() <= 1.0
    assert core.grant.renew_reply_timeout() <= 3.0


def test_a_server_found_not_running_frees_nothing_so_only_the_lease_makes_it_lost() -> None:
    """A durable server that refuses connections is down: a restart restores the grant to its
    lease; `owned` still waits for an answer."""
    core = held_on_sessions(time.monotonic() - 10.0)
    assert core.grant.lease_left() <= 0
    core.grant.refused()
    assert core.grant.lease_left() > 40
    assert not core.owned()


def test_without_sessions_the_lease_alone_says() -> None:
    core = make()
    granted = reply(Command.LOCK, f"ok {TOKEN} 60".encode())
    assert core.on_grant_reply(Command.LOCK, granted, time.monotonic() - 10.0, FENCING)
    assert core.grant.session_ttl is None and core.owned()


def test_an_answer_that_comes_after_the_session_deadline_does_not_revive_it() -> None:
    """Found by the simulator (tests/sim, seed 37 before the fix): a connection's join (``hello
    _ session <id>``), sent before the session's deadline, answered after it. The server may
    have ended the session meanwhile (its grants with it) and made a new one of the same id for
    that join: the answer says nothing of the grants. The session is over at its deadline, and
    the lock held on it stays not owned, whatever answer comes later."""
    now = [1000.0]
    session = ClientSession(15, clock=lambda: now[0])
    session.answered(now[0])  # joined: its deadline is 15 s less the margin from now
    core = make()
    core.grant.clock = lambda: now[0]
    granted = reply(Command.LOCK, f"ok {TOKEN} 60".encode())
    keeps = ServerInfo(
        "dflockd-server",
        "test",
        frozenset({wire.FEATURE_FENCE, wire.FEATURE_SESSION, wire.FEATURE_KEEPALIVE}),
    )
    assert core.on_grant_reply(Command.LOCK, granted, now[0], keeps, session)
    assert core.owned()
    join_sent = now[0] + 10.0  # a new connection joins, 10 s on
    now[0] += 15.0  # the deadline passes before its answer comes
    assert not core.owned()
    session.answered(join_sent)  # the late answer
    assert not core.owned()
    assert core.grant.session_ended() is not None


def test_a_keep_alive_renews_a_grant_only_if_its_answer_came_while_the_lease_surely_ran() -> None:
    """Found by the simulator (tests/sim, seed 329 before the fix): a holder paused past its
    lease resumes, and its session's next keep-alive is answered (the session lives, its time
    is longer than the lease); the server had let the grant's lease run out meanwhile (a
    keep-alive renews the grants it still holds, not one already gone), yet the answer made
    the lock count as owned again, while the server gave the key to another. Keep-alives
    answered in time chain the lease on."""
    now = [1000.0]
    session = ClientSession(15, clock=lambda: now[0])
    session.run = "run1"
    session.answered(now[0])
    core = make(lease_ttl_s=8)
    core.grant.clock = lambda: now[0]
    keeps = ServerInfo(
        "dflockd-server",
        "test",
        frozenset({wire.FEATURE_FENCE, wire.FEATURE_SESSION, wire.FEATURE_KEEPALIVE}),
        run="run1",
    )
    granted = reply(Command.LOCK, f"ok {TOKEN} 8".encode())
    assert core.on_grant_reply(Command.LOCK, granted, now[0], keeps, session)
    start = now[0]
    for sent in (start + 5.0, start + 10.0):  # answered at once: the lease runs on
        now[0] = sent
        session.answered(sent, renewed=True)
        assert core.owned()
    assert core.grant.lease_end() == start + 18.0
    now[0] = start + 19.0  # paused past the lease's end (the session's deadline is later)
    assert not core.owned()
    session.answered(now[0], renewed=True)  # the next keep-alive, sent now, answered
    assert not core.owned()
    assert core.grant.lease_end() == start + 18.0
    # sent in time but answered after the lease's end: the server may have ended it first
    core2 = make(lease_ttl_s=8)
    core2.grant.clock = lambda: now[0]
    assert core2.on_grant_reply(Command.LOCK, granted, now[0], keeps, session)
    sent = now[0] + 7.0
    now[0] += 8.5
    session.answered(sent, renewed=True)
    assert not core2.owned()


@pytest.mark.parametrize("lease", [3, 5, 6, 8, 10, 33, 300])
@pytest.mark.parametrize("offset", [0.01, 1.3, 2.6, 4.99])
def test_a_lease_left_to_keep_alives_never_runs_out_before_the_locks_next_look(
    lease: int, offset: float
) -> None:
    """A lock leaves its renewal to its session's keep-alives while they keep its lease, and
    looks again at `LockCore.next_look_in`. Seen on the real server (a lease of 5 s, a
    session of 15 s: keep-alives 5 s apart): a keep-alive sent just after the lock's own
    renewal made it skip the next one, the look after came a renewal interval later with
    milliseconds of the lease left, its renewal arrived after the server let the lease run out,
    and the lock was lost while its holder and its session lived. The lock and the keep-alives
    are played here on one clock against the server's lease end: every renewal of the lock's
    own is sent with at least the renewal's share of the lease left (or `KEPT_MARGIN_S`)."""
    now = [1000.0]
    session = ClientSession(15, clock=lambda: now[0])
    session.run = "run1"
    session.keeper = object()  # its keep-alive runs
    session.answered(now[0])
    core = make(lease_ttl_s=lease)
    core.grant.clock = lambda: now[0]
    keeps = ServerInfo(
        "dflockd-server",
        "test",
        frozenset({wire.FEATURE_FENCE, wire.FEATURE_SESSION, wire.FEATURE_KEEPALIVE}),
        run="run1",
    )
    granted = reply(Command.LOCK, f"ok {TOKEN} {lease}".encode())
    start = now[0]
    assert core.on_grant_reply(Command.LOCK, granted, start, keeps, session)
    server_end = start + lease  # the server's view of the lease
    keep_alive = start + offset
    look = start + core.first_renewal_in()
    margin = min(KEPT_MARGIN_S, lease * (1 - core.routing.settings.renew_ratio))
    while look < start + 120:
        while keep_alive <= look:  # keep-alives answered at once, every third of the session
            if keep_alive < server_end:
                server_end = keep_alive + lease
            now[0] = keep_alive
            session.answered(keep_alive, renewed=True)
            keep_alive += session.interval()
        now[0] = look
        assert server_end > look, f"the lease ran out {look - server_end:.2f} s before the look"
        if not core.grant.kept_alive():  # its own renewal, answered at once
            assert server_end - look >= margin - 1e-9, f"renewed with {server_end - look:.2f} s"
            server_end = look + lease
            assert core.on_renew_reply(reply(Command.RENEW, f"ok {lease}".encode()), look).renewed
        look += core.next_look_in()
