# pyright: reportAttributeAccessIssue=false, reportCallIssue=false, reportFunctionMemberAccess=false
# (Celery's @app.task is untyped: pyright takes a task for the plain function it decorates.)
"""Queue-once at its edges (issue 31), on real prefork workers with Redis as broker and result
backend and a real ``dflockd`` process: a send the lock server never answered leaves no hold
behind; canvas (group, chord, chain) with duplicate members completes; eager ``apply()`` of a
key held by a queued message fails at once and honours per-call lock options."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import chain, chord, group

from celery_dflock import AlreadyQueued
from celery_dflock._runtime import app_client
from celery_dflock.client.errors import InvalidValueError, LockSkipped, ServerUnavailable
from dflockd_server import Config
from tests.celery.apps.queue_once import LONG_RETRY_MAX_LEASE_S, define_tasks
from tests.support.apps import make_app
from tests.support.ports import free_port
from tests.support.processes import paused
from tests.support.rigs import Rig, open_rig, unique
from tests.support.servers import DflockdProcess, dflockd_subprocess
from tests.support.services import REDIS_DBS, require_redis
from tests.support.workers import (
    close_app,
    redis_cleanup,
    redis_settings,
)

EVENT_TIMEOUT_S = 30.0
RESULT_TIMEOUT_S = 60.0
FREE_WAIT_S = 20.0
"""How long a test waits in the key's FIFO queue for a key to be freed (a hold left by a send
the server never answered used to last lock_pending_ttl, 300 s)."""
REDIS_DB = REDIS_DBS["queue_once_edges"]


DflockdChild = tuple[subprocess.Popen[bytes], tuple[str, int]]


@pytest.fixture(scope="module")
def dflockd_child(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DflockdChild]:
    """The rig's lock server: a ``dflockd`` subprocess (a test stops it with SIGSTOP)."""
    tmp = tmp_path_factory.mktemp("qonce-edges-dflockd")
    with dflockd_subprocess(tmp / "dflockd.log") as child:
        yield child


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory, dflockd_child: DflockdChild) -> Iterator[Rig]:
    require_redis()
    queue = unique("dflock-qedges")
    with open_rig(
        tmp_path_factory.mktemp("qonce-edges"),
        "apps.queue_once",
        redis_settings(queue, db=REDIS_DB),
        server=dflockd_child[1],
        main="qonce-edges-client",
        define_tasks=define_tasks,
        cleanup=lambda: redis_cleanup(queue, db=REDIS_DB),
    ) as made:
        made.start_worker(pool="prefork", concurrency=2)
        yield made


# ------------------------------------------------------------------------ a send not answered


def test_a_send_the_server_never_answered_leaves_no_hold(
    rig: Rig, dflockd_child: DflockdChild
) -> None:
    """The lock server stopped (SIGSTOP) during ``delay()`` (issue 49: an outage at publish):
    with ``on_duplicate="raise"`` the send raises ServerUnavailable and sends nothing; with
    the default ``"return"`` the task is sent without a hold, logged, and its run takes the
    key when the server is back. Either way no hold is left behind (one was held for
    lock_pending_ttl, 300 s, by a task id never sent), and each run sent runs once."""
    warm = unique("warm")  # the publisher's pooled connection is open (hello done)
    assert rig.tasks["once"].delay(warm).get(timeout=RESULT_TIMEOUT_S) == warm
    name, refused = unique("stalled"), unique("stalled-raise")
    with paused(dflockd_child[0].pid):
        with pytest.raises(ServerUnavailable, match="nothing was sent"):
            rig.tasks["once_raise"].delay(refused)
        sent = rig.tasks["once"].delay(name)
    key = f"once:{refused}"
    assert rig.key_free(key, FREE_WAIT_S), "a send that raised ServerUnavailable left its key held"
    assert sent.get(timeout=RESULT_TIMEOUT_S) == name
    again = rig.tasks["once"].delay(name)
    assert again.get(timeout=RESULT_TIMEOUT_S) == name
    assert [b["task_id"] for b in rig.log.entries("started", name=name)] == [sent.id, again.id]


def test_a_hold_granted_after_its_send_gave_up_is_freed_when_the_server_answers(
    tmp_path: Path,
) -> None:
    """The lock server stopped (SIGSTOP) past the 10 s a publish waits for its hold: the send
    raises ServerUnavailable and sends nothing. When the server goes on, it grants the hold it
    had read (no journal holds the reply back) on a connection of the publisher's client
    session; that grant is released as soon as it arrives. Before, the publisher's close ended
    nothing (a session connection's grants are the session's), so the key stayed held until
    the session ended: never, while the publisher held a lock of its own (its keep-alives
    renewed the orphan hold)."""
    require_redis()
    queue = unique("dflock-qedges-late-grant")
    args = ("--state-dir", "none", "--restart-grace", "0")  # no journal: the reply leaves
    with (
        dflockd_subprocess(tmp_path / "dflockd.log", *args) as (proc, address),
        open_rig(
            tmp_path,
            "apps.queue_once",
            # A session that lives through the stall for sure, kept alive by the lock below.
            {**redis_settings(queue, db=REDIS_DB), "dflock_session_ttl": 60},
            server=address,
            main="qonce-late-grant-client",
            define_tasks=define_tasks,
            cleanup=lambda: redis_cleanup(queue, db=REDIS_DB),
        ) as rig,
    ):
        rig.start_worker(pool="threads", concurrency=1)
        with app_client(rig.app).lock(unique("publisher-busy"), acquire_timeout_s=0) as busy:
            warm = unique("warm")  # a pooled connection with hello done, the 300 s bound recorded
            assert rig.tasks["once_raise"].delay(warm).get(timeout=RESULT_TIMEOUT_S) == warm
            name = unique("late-grant")
            with paused(proc.pid), pytest.raises(ServerUnavailable, match="nothing was sent"):
                rig.tasks["once_raise"].delay(name)
            assert rig.key_free(f"once:{name}", FREE_WAIT_S), (
                "a hold granted after its publish gave up stayed held"
            )
            assert busy.owned()
            sent = rig.tasks["once_raise"].delay(name)
            assert sent.get(timeout=RESULT_TIMEOUT_S) == name
        assert [b["task_id"] for b in rig.log.entries("started", name=name)] == [sent.id]


# ------------------------------------------------------------------------ canvas


def test_a_group_with_a_duplicate_member_completes(rig: Rig) -> None:
    """Two members on one key: one run; the duplicate's place gets the holder's result."""
    name = unique("group")
    release = rig.release_file(name)  # the first runs until both are sent
    member = rig.tasks["once"].si(name, str(release))
    result = group(member, member.clone()).apply_async()
    release.touch()
    assert result.get(timeout=RESULT_TIMEOUT_S) == [name, name]
    assert len(rig.log.entries("started", name=name)) == 1


def test_a_chord_with_a_duplicate_member_runs_its_callback(rig: Rig) -> None:
    name = unique("chord")
    release = rig.release_file(name)  # the first runs until both are sent
    member = rig.tasks["once"].si(name, str(release))
    result = chord([member, member.clone()])(rig.tasks["collect"].s())
    release.touch()
    assert result is not None
    assert result.get(timeout=RESULT_TIMEOUT_S) == [name, name]
    assert len(rig.log.entries("started", name=name)) == 1


def test_a_chord_member_whose_key_an_earlier_send_holds(rig: Rig) -> None:
    name = unique("chord-held")
    release = rig.release_file(name)
    first = rig.tasks["once"].delay(name, str(release))
    rig.log.wait_event("started", timeout=EVENT_TIMEOUT_S, name=name)
    other = unique("chord-other")
    result = chord([rig.tasks["once"].si(name, str(release)), rig.tasks["once"].si(other)])(
        rig.tasks["collect"].s()
    )
    release.touch()
    assert result is not None
    assert result.get(timeout=RESULT_TIMEOUT_S) == [name, other]
    assert [b["task_id"] for b in rig.log.entries("started", name=name)] == [first.id]


def test_a_chain_with_a_duplicate_head_runs_its_tail(rig: Rig) -> None:
    name = unique("chain")
    release = rig.release_file(name)
    first = rig.tasks["once"].delay(name, str(release))
    rig.log.wait_event("started", timeout=EVENT_TIMEOUT_S, name=name)
    result = chain(rig.tasks["once"].si(name, str(release)), rig.tasks["collect"].s()).apply_async()
    release.touch()
    assert result is not None
    assert result.get(timeout=RESULT_TIMEOUT_S) == name
    assert first.get(timeout=RESULT_TIMEOUT_S) == name
    assert len(rig.log.entries("started", name=name)) == 1


def test_a_chain_whose_tail_s_key_a_running_task_holds(rig: Rig) -> None:
    """A chain's last member is sent by the worker that ran the one before it; its key held
    by a running task, it stands in for that task (as any other member does) and the chain's
    result is the holder's: it was not sent at all, and the chain's ``.get()`` waited for
    ever."""
    name = unique("chain-tail")
    release = rig.release_file(name)
    first = rig.tasks["once"].delay(name, str(release))
    rig.log.wait_event("started", timeout=EVENT_TIMEOUT_S, name=name)
    head = unique("chain-tail-head")
    result = chain(rig.tasks["once"].si(head), rig.tasks["once"].si(name)).apply_async()
    assert result is not None
    assert result.parent.get(timeout=RESULT_TIMEOUT_S) == head  # the tail is sent before
    release.touch()
    assert result.get(timeout=RESULT_TIMEOUT_S) == name
    assert [b["task_id"] for b in rig.log.entries("started", name=name)] == [first.id]


def test_nested_canvas_with_duplicates_completes(rig: Rig) -> None:
    """A group of a chain and a member on one key, inside a chord: one run of the key, every
    place gets its result, and the callback runs."""
    name = unique("nested")
    release = rig.release_file(name)
    member = rig.tasks["once"].si(name, str(release))
    inner = group(chain(member, rig.tasks["collect"].s()), member.clone())
    result = chord([inner, rig.tasks["once"].si(unique("nested-other"))])(rig.tasks["collect"].s())
    release.touch()
    assert result is not None
    got = result.get(timeout=RESULT_TIMEOUT_S)
    assert got[:2] == [name, name]
    assert len(rig.log.entries("started", name=name)) == 1


def test_a_group_with_a_duplicate_member_on_gevent(rig: Rig) -> None:
    queue = unique("dflock-qedges-gevent")
    rig.start_worker(pool="gevent", concurrency=4, settings={"task_default_queue": queue})
    name = unique("group-gevent")
    release = rig.release_file(name)
    member = rig.tasks["once"].si(name, str(release)).set(queue=queue)
    result = group(member, member.clone(), member.clone()).apply_async()
    release.touch()
    assert result.get(timeout=RESULT_TIMEOUT_S) == [name, name, name]
    assert len(rig.log.entries("started", name=name)) == 1
    redis_cleanup(queue, db=REDIS_DB)


def test_a_group_under_on_duplicate_raise_is_sent_whole(rig: Rig) -> None:
    """``on_duplicate="raise"``: the group is sent whole (never half), and the duplicate's
    place fails at once with AlreadyQueued naming the holder."""
    name = unique("group-raise")
    release = rig.release_file(name)  # the first runs until both are sent
    member = rig.tasks["once_raise"].si(name, str(release))
    result = group(member, member.clone()).apply_async()
    release.touch()
    assert result.join(timeout=RESULT_TIMEOUT_S, propagate=False) is not None
    first, second = result.results
    assert first.get(timeout=RESULT_TIMEOUT_S) == name
    assert second.failed()
    error = second.result
    assert isinstance(error, AlreadyQueued), error
    assert first.id in str(error)
    assert len(rig.log.entries("started", name=name)) == 1


# ------------------------------------------------------------------------ eager


def test_eager_apply_of_a_key_a_queued_message_holds(rig: Rig) -> None:
    """A message waits in a queue no worker takes, holding its key: ``apply()`` fails at once
    with AlreadyQueued naming it (it used to wait for the hold to run out, then run beside the
    message); per-call lock options apply to eager runs, and a bad one is refused; the message
    then runs once."""
    parked = unique("dflock-qedges-parked")
    name = unique("eager")
    queued = rig.tasks["once"].apply_async((name,), queue=parked)
    outcome = rig.tasks["once"].apply((name,))
    assert outcome.failed()
    assert isinstance(outcome.result, AlreadyQueued)
    assert outcome.result.task_id == queued.id
    with pytest.raises(AlreadyQueued):
        rig.tasks["once"].apply((name,), throw=True)
    skipped = rig.tasks["once"].apply((name,), lock_from="run", on_locked="skip")
    assert isinstance(skipped.result, LockSkipped), skipped.result
    with pytest.raises(InvalidValueError, match="lock_timeout"):
        rig.tasks["once"].apply((name,), lock_timeout=-1)
    assert not rig.log.entries("started", name=name)

    rig.start_worker(pool="prefork", concurrency=1, settings={"task_default_queue": parked})
    assert queued.get(timeout=RESULT_TIMEOUT_S) == name
    assert [b["task_id"] for b in rig.log.entries("started", name=name)] == [queued.id]
    redis_cleanup(parked, db=REDIS_DB)


def test_eager_apply_of_a_free_key_runs_once(rig: Rig) -> None:
    name = unique("eager-free")
    assert rig.tasks["once"].apply((name,)).get() == name
    assert rig.key_free(f"once:{name}", wait_s=0)


# ------------------------------------------------------------------------ a restart grace


def test_a_restart_grace_is_not_a_duplicate(tmp_path: Path) -> None:
    """A lock server in its restart grace grants no key: a publish is refused with no holder.
    ``on_duplicate="return"`` sends the task without a hold (it used to raise AlreadyQueued,
    blaming "a holder that left no task id"); ``"raise"`` raises ServerUnavailable naming the
    grace, and sends nothing."""
    require_redis()
    queue = unique("dflock-qedges-grace")
    process = DflockdProcess(["--host", "127.0.0.1", "--port", "0", "--restart-grace", "120"], {})
    try:
        host, port = process.wait_listening()
        app = make_app("qonce-grace", redis_settings(queue, db=REDIS_DB), servers=f"{host}:{port}")
        tasks = define_tasks(app)
        try:
            name = unique("grace")
            sent = tasks["once"].delay(name)
            again = tasks["once"].delay(name)
            assert sent.id != again.id  # no hold: both sent (each run still locks the key)
            with pytest.raises(ServerUnavailable, match="restart grace") as raised:
                tasks["once_raise"].delay(name)
            assert "left no task id" not in str(raised.value)
            with app.connection_for_write() as conn:
                assert conn.default_channel.client.llen(queue) == 2
        finally:
            close_app(app)
            redis_cleanup(queue, db=REDIS_DB)
    finally:
        process.kill()


# ------------------------------------------------------------------------ an autoretry


def test_an_autoretried_outage_at_take_over_keeps_the_hold(tmp_path: Path) -> None:
    """The lock server is down (killed -9) when a run takes its publish-time hold over, and
    the task's ``autoretry_for=(ServerUnavailable,)`` retries it: the retry carries the hold
    (restored by the restarted server from its journal) and its run takes that grant over.
    Before, the retry was sent with no hold: its run queued behind its own hold."""
    require_redis()
    port = free_port()
    args = ("--state-dir", str(tmp_path / "state"))
    log = tmp_path / "dflockd.log"
    queue = unique("dflock-qedges-autoretry")
    with open_rig(
        tmp_path,
        "apps.queue_once",
        redis_settings(queue, db=REDIS_DB),
        server=("127.0.0.1", port),
        main="qonce-autoretry-client",
        define_tasks=define_tasks,
        cleanup=lambda: redis_cleanup(queue, db=REDIS_DB),
    ) as rig:
        name = unique("autoretry")
        with dflockd_subprocess(log, *args, port=port) as (proc, _):
            result = rig.tasks["once_autoretry"].delay(name)
            proc.kill()
            proc.wait(10)
        worker = rig.start_worker(pool="prefork", concurrency=1)
        assert worker.wait_output("retry: Retry in", EVENT_TIMEOUT_S), worker.output()
        with dflockd_subprocess(log, *args, port=port):
            assert result.get(timeout=RESULT_TIMEOUT_S) == name
        (started,) = rig.log.entries("started", name=name)
        assert started["retries"] == 1
        assert started["hold_token"] is not None
        assert started["token"] == started["hold_token"]


# ------------------------------------------------------------------------ a retry due too late


def test_a_retry_due_after_the_longest_lease_says_it_goes_without_its_hold(
    tmp_path: Path,
) -> None:
    """A retry whose countdown passes the lock server's ``--max-lease-ttl`` cannot keep its
    hold (the server refuses the lease): the worker says so, naming the key and the setting,
    and releases the grant the server left bound; the retry then takes the key at run time.
    Before, nothing was logged and the grant stayed bound, unrenewed, for the run's lease."""
    require_redis()
    queue = unique("dflock-qedges-long-retry")
    with open_rig(
        tmp_path,
        "apps.queue_once",
        redis_settings(queue, db=REDIS_DB),
        server=Config(
            host="127.0.0.1", port=0, default_lease_ttl_s=3, max_lease_ttl_s=LONG_RETRY_MAX_LEASE_S
        ),
        main="qonce-long-retry-client",
        define_tasks=define_tasks,
        cleanup=lambda: redis_cleanup(queue, db=REDIS_DB),
    ) as rig:
        worker = rig.start_worker(pool="prefork", concurrency=1)
        name = unique("long-retry")
        result = rig.tasks["once_long_retry"].delay(name)
        assert worker.wait_output("retry: Retry in", EVENT_TIMEOUT_S), worker.output()
        assert rig.key_free(f"once:{name}", wait_s=0), "the refused hand-off left the key held"
        assert worker.wait_output("--max-lease-ttl", EVENT_TIMEOUT_S), worker.output()
        assert f"once:{name}" in worker.output()
        assert result.get(timeout=RESULT_TIMEOUT_S) == name
        assert [b["retries"] for b in rig.log.entries("started", name=name)] == [0, 1]
