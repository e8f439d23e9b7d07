# pyright: reportAttributeAccessIssue=false, reportCallIssue=false, reportFunctionMemberAccess=false
# (Celery's @app.task is untyped: pyright takes a task for the plain function it decorates.)
"""Queue-once (``lock_from="publish"``, issue 17) with a real server and real prefork workers on
the filesystem broker: one message per key, the run takes the publish-time hold over, a
duplicate gets the holder's result or `AlreadyQueued`, a retry keeps the hold, a revoke and
``lock_pending_ttl`` free it, and the holder's task id is shown."""

from __future__ import annotations

import math
import os
import pickle
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import quote

import pytest
from kombu.exceptions import OperationalError

from celery_dflock import AlreadyQueued, DflockError, LockedTask
from celery_dflock._request import (
    HolderNote,
    beat_note,
    beat_pid,
    decode_note,
    encode_note,
    note_parts,
)
from celery_dflock._settings import read_attributes
from celery_dflock.cli import collect, format_locks
from celery_dflock.client import DistributedLock
from celery_dflock.config import DflockConfigError, get_config, resolve_options
from dflockd_server import Config
from dflockd_server.status_page import HolderNote as PageNote, holder_of
from tests.celery.apps.queue_once import define_tasks
from tests.support.apps import make_app
from tests.support.ports import free_port
from tests.support.rigs import Rig, open_rig, unique
from tests.support.workers import (
    close_app,
    filesystem_settings,
)

EVENT_TIMEOUT_S = 30.0
RESULT_TIMEOUT_S = 60.0
FREE_WAIT_S = 20.0
"""How long a test waits in the key's FIFO queue for a hold to be freed."""
PER_CALL_PENDING_TTL_S = 8
"""The per-call ``lock_pending_ttl`` of a message no worker takes: long enough for the checks
made while it holds (three publishes, a message count, a look at the key) on a loaded CI
machine, where 2 s was not; well inside `FREE_WAIT_S`, which waits for it to run out."""


def messages(rig: Rig, queue: str) -> int:
    """Messages waiting in ``queue`` (files of the filesystem broker)."""
    data = Path(rig.settings["broker_transport_options"]["data_folder_in"])
    return len(list(data.glob(f"*.{queue}.msg")))


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    """A lock server, a prefork worker (-c 2) and a client app whose tasks go through
    ``LockedTask.apply_async`` (the publish path)."""
    tmp = tmp_path_factory.mktemp("qonce")
    with open_rig(
        tmp,
        "apps.queue_once",
        filesystem_settings(tmp, unique("dflock-qonce")),
        server=Config(host="127.0.0.1", port=0, default_lease_ttl_s=30),
        main="qonce-client",
        define_tasks=define_tasks,
    ) as made:
        made.start_worker(pool="prefork", concurrency=2)
        yield made


# ------------------------------------------------------------------------ no worker needed


def test_note_round_trip() -> None:
    assert encode_note("a b/c") == "a%20b%2Fc"
    assert decode_note(encode_note("a b/c", "celery@host 1")) == ("a b/c", "celery@host 1")
    assert encode_note("abc", name="t.x") == "abc///t.x"  # a publish-time hold's
    assert decode_note(encode_note("abc", name="t.x")) == ("abc", None)
    # A note naming no host and no task name is not a task's: a lock taken outside Celery.
    assert decode_note("nightly-sync") == (None, None)
    assert note_parts("nightly-sync") == HolderNote("nightly-sync")
    assert decode_note(None) == (None, None)
    assert decode_note("_") == (None, None)
    assert encode_note("x" * 300) is None
    long_host = encode_note("id", "h" * 300)
    assert long_host == "id/"  # too long with the host: the task id alone, still a task's
    assert decode_note(long_host) == ("id", None)
    assert encode_note("i" * 199, name="t") == "i" * 199 + "/"
    assert encode_note("i" * 200, name="t") is None


def test_a_run_s_note_names_its_pid_and_task_and_older_readers_still_find_the_task_id() -> None:
    note = encode_note("4f1c", "celery@w1", pid=4242, name="proj.tasks.report")
    assert note == "4f1c/celery%40w1/4242/proj.tasks.report"
    assert note_parts(note) == HolderNote("4f1c", "celery@w1", 4242, "proj.tasks.report")
    assert decode_note(note) == ("4f1c", "celery@w1")
    assert note_parts("4f1c/celery%40w1") == HolderNote("4f1c", "celery@w1")  # an older note
    assert note_parts("a/b%2Fc/x/n%2F1") == HolderNote("a", "b/c", None, "n/1")
    # Too long: the name goes first, then the pid, then the host.
    assert encode_note("id", "h", pid=1, name="n" * 300) == "id/h/1"
    assert encode_note("id", "h" * 196, pid=12, name="n") == "id/" + "h" * 196


@pytest.mark.parametrize(
    "note",
    [
        encode_note("4f1c", "celery@w1", pid=4242, name="proj.tasks.report"),
        encode_note("4f1c", "celery@w1"),  # an older run's
        encode_note("4f1c", name="proj.tasks.report"),  # a publish-time hold
        encode_note("4f1c"),  # an older publish-time hold, or a note of another client
        encode_note("a/b", "celery@host 1", pid=7, name="n/1"),  # slashes, a space
        encode_note("é€", "h%st\tname", pid=1, name="t"),  # non-ASCII, a percent, a tab
        encode_note("id", "h" * 196, pid=12, name="n"),  # shortened: the host alone
        encode_note("i" * 190, "celery@w1", pid=1, name="t"),  # shortened: the id alone
        "a/b/notapid/c%2Fd",  # not a pid
        "a/b/%C2%B2/c",  # not a pid either: a digit, but no decimal one (a superscript two)
        beat_note(77, "host-b"),
        None,
        "_",
    ],
)
def test_the_status_page_reads_a_note_as_celery_dflock_does(note: str | None) -> None:
    """The lock server's status page parses the notes celery-dflock writes with a copy of its
    own (the server does not import celery-dflock, nor it the server): the two read every
    part alike, a singleton beat's note included (the page names it "celery beat")."""
    parts = note_parts(note)
    shown = holder_of(note)
    pid = beat_pid(parts.task_id)
    if pid is not None:
        assert shown == PageNote(None, parts.host, pid, "celery beat")
    else:
        assert shown == PageNote(parts.task_id, parts.host, parts.pid, parts.task_name)


@pytest.mark.parametrize(
    ("task_id", "host"),
    [
        ("4f1c7a3e-8c1b-4f5e-9a0e-1c2d3e4f5a6b", "celery@worker-1.example"),  # the usual
        ("a~b.c_d-E9", "x@y@z"),  # every character the quick path keeps
        ("a/b", "celery@host 1"),  # a slash, a space
        ("é€", "h%st\tname"),  # non-ASCII, a percent, a tab
        ("id+1=2&", "celery@[::1]"),
    ],
)
def test_a_note_is_percent_encoded_as_quote_does(task_id: str, host: str) -> None:
    """The owner note's parts are exactly ``quote(part, safe="")``, whether they take the
    quick path (a UUID, ``celery@host``) or ``quote`` itself."""
    assert encode_note(task_id, host) == f"{quote(task_id, safe='')}/{quote(host, safe='')}"
    assert decode_note(encode_note(task_id, host)) == (task_id, host)


def test_options_resolve_and_refuse_a_semaphore() -> None:
    app = make_app("qonce-options", dflock_lock_from="publish", dflock_lock_pending_ttl=60)
    options = resolve_options(get_config(app), "t", read_attributes({"on_duplicate": "raise"}, "t"))
    assert (options.lock_from, options.on_duplicate, options.pending_ttl) == (
        "publish",
        "raise",
        60,
    )
    with pytest.raises(DflockConfigError, match="lock_from='publish' cannot be combined"):
        resolve_options(get_config(app), "t", read_attributes({"lock_limit": 2}, "t"))

    @app.task(base=LockedTask, lock_from="publish", lock_limit=2, shared=False)
    def both() -> None: ...

    with pytest.raises(DflockConfigError, match="lock_limit=2"):
        app.finalize()
        _ = app.tasks[both.name]
    app.close()

    bad = make_app("qonce-bad", dflock_lock_from="queue")
    with pytest.raises(DflockConfigError, match="dflock_lock_from must be 'run'"):
        get_config(bad)
    bad.conf.update(dflock_lock_from=None, dflock_on_duplicate="ignore")
    with pytest.raises(DflockConfigError, match="dflock_on_duplicate must be 'return'"):
        get_config(bad)


def test_already_queued_pickles_with_its_fields() -> None:
    error = AlreadyQueued("busy", task_id="t-1", key="k")
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.task_id, copy.key) == ("busy", "t-1", "k")


# ------------------------------------------------------------------------ the publish path


def test_duplicates_send_one_message_and_the_run_takes_the_hold_over(rig: Rig) -> None:
    """With no worker on the queue, repeated publishes leave one message, all answered with
    its id; a worker then runs it once, under the hold the publish took; afterwards a new
    publish sends a new task."""
    parked = unique("dflock-parked")
    name = unique("parked")
    results = [rig.tasks["once"].apply_async((name,), queue=parked) for _ in range(5)]
    assert len({r.id for r in results}) == 1
    assert messages(rig, parked) == 1
    assert not rig.key_free(f"once:{name}", wait_s=0)

    rig.start_worker(pool="prefork", concurrency=1, settings={"task_default_queue": parked})
    assert results[0].get(timeout=RESULT_TIMEOUT_S) == name
    bodies = rig.log.entries("started", name=name)
    assert len(bodies) == 1
    assert bodies[0]["task_id"] == results[0].id
    assert bodies[0]["token"] == bodies[0]["hold_token"]  # the publish's grant, taken over
    assert rig.key_free(f"once:{name}", wait_s=5)
    again = rig.tasks["once"].apply_async((name,), queue=parked)
    assert again.id != results[0].id


def test_duplicate_of_a_running_task(rig: Rig) -> None:
    """While the first runs: a duplicate returns its result, ``on_duplicate="raise"`` raises
    AlreadyQueued with its id, ``celery dflock locks`` shows it with the worker's name, and a
    run-time lock skipped on the key names it."""
    name = unique("running")
    key = f"once:{name}"
    release = rig.release_file(name)
    first = rig.tasks["once"].delay(name, str(release))
    rig.log.wait_event("started", timeout=EVENT_TIMEOUT_S, name=name)
    try:
        assert rig.tasks["once"].delay(name, str(release)).id == first.id
        # ``chain=None``, as a message sent again from its request has it (Celery's
        # signature_from_request): no canvas member, so no stand-in is sent.
        again = rig.tasks["once"].apply_async((name, str(release)), chain=None)
        assert again.id == first.id
        with pytest.raises(AlreadyQueued, match=first.id) as raised:
            rig.tasks["once_raise"].delay(name, str(release))
        assert (raised.value.task_id, raised.value.key) == (first.id, key)

        reports = collect(get_config(rig.app))
        table = format_locks(reports)
        row = next(line for line in table.splitlines() if key in line)
        assert first.id in row
        assert rig.worker.name in row
        (entry,) = [lock for lock in reports[0].as_json()["stats"]["locks"] if lock["key"] == key]
        assert entry["holder_task_id"] == first.id
        assert entry["holder_host"] == rig.worker.name
        assert entry["detached"] is False  # taken over: bound to the run's connection

        skipped = rig.tasks["run_skip"].delay(name)
        event = rig.log.wait_event("skipped", timeout=EVENT_TIMEOUT_S, task_id=skipped.id)
        assert event["holder"] == first.id
        with pytest.raises(Exception, match=first.id):
            skipped.get(timeout=RESULT_TIMEOUT_S)
    finally:
        release.touch()
    assert first.get(timeout=RESULT_TIMEOUT_S) == name
    assert rig.key_free(key, wait_s=5)
    assert rig.tasks["once"].delay(name, None).id != first.id


def test_a_long_custom_task_id_is_named_as_its_holder_or_refused_saying_so(rig: Rig) -> None:
    """A custom task id too long to go with its worker and task name in the 200-byte owner
    note: the note was the id alone, read back as a lock taken outside Celery, so a duplicate
    publish raised AlreadyQueued saying no Celery task held the key, and a skipped run named
    no holder. It is still the holder's id now; an id too long for the note itself is refused
    at publish, naming the longest, and a run-time lock runs without a note."""
    name = unique("long-id")
    key = f"once:{name}"
    long_id = "i" * 190
    release = rig.release_file(name)
    first = rig.tasks["once"].apply_async((name, str(release)), task_id=long_id)
    rig.log.wait_event("started", timeout=EVENT_TIMEOUT_S, name=name)
    try:
        assert rig.tasks["once"].delay(name, str(release)).id == long_id
        skipped = rig.tasks["run_skip"].delay(name)
        event = rig.log.wait_event("skipped", timeout=EVENT_TIMEOUT_S, task_id=skipped.id)
        assert event["holder"] == long_id
    finally:
        release.touch()
    assert first.get(timeout=RESULT_TIMEOUT_S) == name
    too_long = "i" * 201
    with pytest.raises(DflockError, match=r"task_id 'i+' is too long .* at most \d+ characters"):
        rig.tasks["once"].apply_async((name,), task_id=too_long)
    assert rig.key_free(key, wait_s=5)
    sent = rig.tasks["plain"].apply_async((name,), task_id=too_long)
    assert sent.get(timeout=RESULT_TIMEOUT_S) == name


def test_a_key_held_outside_celery_is_no_task_to_return(rig: Rig) -> None:
    """A key held by a lock taken outside Celery with a note of its own: a duplicate publish
    under ``on_duplicate="return"`` raises AlreadyQueued naming the key and that note (it
    returned ``AsyncResult(<the note>)``, whose ``.get()`` waited for ever), an eager run
    names no task either, and once the lock is released the task is sent and runs once."""
    name = unique("foreign")
    key = f"once:{name}"
    assert rig.address is not None
    foreign = DistributedLock(key, acquire_timeout_s=5, servers=[rig.address], note="nightly-sync")
    assert foreign.acquire()
    try:
        with pytest.raises(AlreadyQueued, match="nightly-sync") as raised:
            rig.tasks["once"].delay(name)
        assert (raised.value.task_id, raised.value.key) == (None, key)
        assert key in str(raised.value)
        eager = rig.tasks["once"].apply((name,))
        assert isinstance(eager.result, AlreadyQueued)
        assert eager.result.task_id is None
    finally:
        foreign.release()
    sent = rig.tasks["once"].delay(name)
    assert sent.get(timeout=RESULT_TIMEOUT_S) == name
    assert [b["task_id"] for b in rig.log.entries("started", name=name)] == [sent.id]


def test_an_older_publishers_hold_is_still_a_task_to_return(rig: Rig) -> None:
    """A publish-time hold of an older celery-dflock, whose note is the task id alone (a
    UUID, as Celery makes them): a duplicate publish returns that task's result, during a
    rolling upgrade as before it (it raised AlreadyQueued as for a lock outside Celery)."""
    name = unique("older")
    key = f"once:{name}"
    assert rig.address is not None
    task_id = str(uuid.uuid4())
    older = DistributedLock(key, acquire_timeout_s=5, servers=[rig.address], note=task_id)
    assert older.acquire()
    try:
        assert rig.tasks["once"].delay(name).id == task_id
    finally:
        older.release()


def test_per_call_lock_from_and_pending_ttl(rig: Rig) -> None:
    """``apply_async(..., lock_from="publish")`` on a run-time task holds from publish; a
    message no worker takes frees its key after ``lock_pending_ttl``."""
    parked = unique("dflock-nobody")
    name = unique("percall")
    sent = [
        rig.tasks["plain"].apply_async(
            (name,), queue=parked, lock_from="publish", lock_pending_ttl=PER_CALL_PENDING_TTL_S
        )
        for _ in range(3)
    ]
    assert len({r.id for r in sent}) == 1
    assert messages(rig, parked) == 1
    assert not rig.key_free(f"once:{name}", wait_s=0)
    assert rig.key_free(f"once:{name}", wait_s=FREE_WAIT_S)  # the pending lease ran out
    assert (
        rig.tasks["plain"].apply_async((name,), queue=parked, lock_from="publish").id != sent[0].id
    )


def test_a_naive_eta_is_utc_as_celery_reads_it(rig: Rig) -> None:
    """Celery takes a naive ``eta`` for UTC; the hold's lease did too only on a host whose
    local time is UTC: five hours west of it, an eta 2 s ahead asked a lease of five hours,
    above the server's limit, and the task was not sent."""
    parked = unique("dflock-nobody")
    name = unique("naive-eta")
    eta = datetime.now(UTC).replace(tzinfo=None) + timedelta(seconds=2)
    before = os.environ.get("TZ")
    os.environ["TZ"] = "EST5"  # UTC-5, no daylight saving
    time.tzset()
    try:
        rig.tasks["plain"].apply_async(
            (name,), queue=parked, lock_from="publish", lock_pending_ttl=3, eta=eta
        )
    finally:
        if before is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = before
        time.tzset()
    assert messages(rig, parked) == 1
    assert not rig.key_free(f"once:{name}", wait_s=0)
    assert rig.key_free(f"once:{name}", wait_s=FREE_WAIT_S)


def test_a_countdown_wins_over_an_eta_for_the_holds_lease(rig: Rig) -> None:
    """Given both, Celery sends the message due at its ``countdown``; the hold's lease followed
    the ``eta``, so a message due after its ``lock_pending_ttl`` lost its hold before it was
    due, and a duplicate could be queued."""
    parked = unique("dflock-nobody")
    name = unique("countdown-eta")
    eta = datetime.now(UTC) + timedelta(seconds=1)
    rig.tasks["plain"].apply_async(
        (name,), queue=parked, lock_from="publish", lock_pending_ttl=2, countdown=60, eta=eta
    )
    assert messages(rig, parked) == 1
    time.sleep(4)  # past lock_pending_ttl and the eta, long before the message is due
    assert not rig.key_free(f"once:{name}", wait_s=0)


def test_a_delayed_message_once_due_keeps_its_hold_for_lock_pending_ttl(rig: Rig) -> None:
    """A message sent with a ``countdown`` waits in the queue once due, as any message does:
    its hold lasted until it was due or ``lock_pending_ttl``, whichever was later, so a
    message due at 8 s with ``lock_pending_ttl=8`` lost its hold the moment it was due, and a
    duplicate was queued behind it while it waited for a worker (measured: 2 s after it was
    due, on a worker with its one slot busy)."""
    parked = unique("dflock-nobody")
    name = unique("due")
    sent = rig.tasks["plain"].apply_async(
        (name,),
        queue=parked,
        lock_from="publish",
        lock_pending_ttl=PER_CALL_PENDING_TTL_S,
        countdown=PER_CALL_PENDING_TTL_S,
    )
    time.sleep(PER_CALL_PENDING_TTL_S + 3)  # due 3 s ago, waiting well within its pending ttl
    again = rig.tasks["plain"].apply_async((name,), queue=parked, lock_from="publish")
    assert again.id == sent.id, "a duplicate was queued while the delayed message waited"
    assert messages(rig, parked) == 1


def test_retry_keeps_the_hold(rig: Rig) -> None:
    """A run that retries hands its hold to the retry: during the countdown a duplicate still
    gets its id, and the retried run holds the same grant."""
    name = unique("retry")
    # The retried run waits for the release file, so the key stays held until the duplicates
    # below were sent: without it the retry ended at once, and a loaded CI machine could
    # reach them only after the 2 s countdown and that run were both over. A hold dropped
    # during the countdown still shows: the retried run's tokens are checked below.
    release = rig.release_file(name)
    result = rig.tasks["once_retry"].delay(name, str(release))
    try:
        rig.log.wait_event("finished", timeout=EVENT_TIMEOUT_S, name=name)
        assert rig.tasks["once_retry"].delay(name).id == result.id
        assert rig.tasks["once"].delay(name).id == result.id  # any task on the key
    finally:
        release.touch()
    assert result.get(timeout=RESULT_TIMEOUT_S) == 1
    first, second = rig.log.entries("started", name=name)
    assert (first["retries"], second["retries"]) == (0, 1)
    assert first["token"] == second["token"] == second["hold_token"]
    assert rig.key_free(f"once:{name}", wait_s=5)


def _consume(rig: Rig, queue: str, *, on: bool) -> None:
    """Make the rig's first worker start (``on``) or stop consuming ``queue``, and wait for it."""
    control = rig.app.control.add_consumer if on else rig.app.control.cancel_consumer
    replies = control(queue, reply=True, timeout=EVENT_TIMEOUT_S, destination=[rig.worker.name])
    assert replies, f"the worker did not {'start' if on else 'stop'} consuming {queue}"


def test_a_requeued_reject_keeps_the_hold_for_its_message(rig: Rig) -> None:
    """An acks_late run that raises ``Reject(requeue=True)`` puts its message back in the queue
    and hands its hold on to it: while the message waits (no worker consumes its queue), a
    duplicate gets its id and nothing is sent; the requeued run takes the same grant over."""
    name = unique("rejected")
    key = f"once:{name}"
    waiting = unique("dflock-rejected")
    release = rig.release_file(name)
    first = rig.tasks["once_reject"].apply_async((name, str(release)), queue=waiting)
    _consume(rig, waiting, on=True)
    try:
        rig.log.wait_event("started", timeout=EVENT_TIMEOUT_S, name=name)
        _consume(rig, waiting, on=False)  # the requeued message waits in the queue
    finally:
        release.touch()
    rig.log.wait_event("rejecting", timeout=EVENT_TIMEOUT_S, name=name)
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while messages(rig, waiting) != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert messages(rig, waiting) == 1, "the rejected message was not put back in its queue"
    again = rig.tasks["once_reject"].apply_async((name, str(release)), queue=waiting)
    assert again.id == first.id, "a duplicate was queued beside the requeued message"
    assert messages(rig, waiting) == 1

    _consume(rig, waiting, on=True)
    assert first.get(timeout=RESULT_TIMEOUT_S) == name
    rejected, requeued = rig.log.entries("started", name=name)
    assert requeued["task_id"] == first.id
    assert requeued["hold_token"] == rejected["hold_token"]  # the message's header, unchanged
    assert requeued["token"] == rejected["token"] == requeued["hold_token"]
    assert requeued["fence"] == rejected["fence"]
    assert rig.key_free(key, wait_s=5)


def test_a_reject_without_requeue_frees_the_key(rig: Rig) -> None:
    """``Reject(requeue=False)`` drops the message, and its run releases the key at once."""
    name = unique("dropped")
    release = rig.release_file(name)
    release.touch()
    rig.tasks["once_reject"].delay(name, str(release), requeue=False)
    rig.log.wait_event("rejecting", timeout=EVENT_TIMEOUT_S, name=name)
    assert rig.key_free(f"once:{name}", wait_s=5)
    assert len(rig.log.entries("started", name=name)) == 1


def test_revoking_a_queued_task_frees_its_key(rig: Rig) -> None:
    """Both pool slots busy, a queued task is revoked: the worker drops it and releases its
    hold; the body never runs."""
    blockers = [unique("blocker") for _ in range(2)]
    for blocker in blockers:
        rig.tasks["once"].delay(blocker, str(rig.release_file(blocker)))
    for blocker in blockers:
        rig.log.wait_event("started", timeout=EVENT_TIMEOUT_S, name=blocker)
    name = unique("revoked")
    # Queued where the worker does not look yet: a prefork worker on a polling transport that
    # takes a task while its pool is full waits for a free slot before it reads its next
    # message, so a revoke sent after the task could be read only once a blocker ended. The
    # worker is told to consume that queue once it has the revoke.
    waiting = unique("dflock-revoked")
    queued = rig.tasks["once"].apply_async((name,), queue=waiting)
    try:
        assert rig.tasks["once"].delay(name).id == queued.id  # held while it waits in the queue
        # The worker holding the queued task must be the one that answers: the module's rig
        # also runs the parked-queue worker of an earlier test, and its reply alone satisfied
        # `limit=1` in a CI run while the first worker had not yet seen the revoke (the body ran).
        acknowledged = rig.app.control.revoke(
            queued.id,
            reply=True,
            limit=1,
            timeout=EVENT_TIMEOUT_S,
            destination=[rig.worker.name],
        )
        assert acknowledged, "no worker acknowledged the revoke"
        consuming = rig.app.control.add_consumer(
            waiting, reply=True, timeout=EVENT_TIMEOUT_S, destination=[rig.worker.name]
        )
        assert consuming, "the worker did not start consuming the queue of the revoked task"
        assert rig.key_free(f"once:{name}", wait_s=FREE_WAIT_S)
    finally:
        for blocker in blockers:
            rig.release_file(blocker).touch()
    assert not rig.log.entries("started", name=name)


def test_eager_calls_take_no_publish_hold(rig: Rig) -> None:
    app = make_app(
        "qonce-eager", rig.settings, task_always_eager=True, task_store_eager_result=True
    )
    tasks = define_tasks(app)
    try:
        name = unique("eager")
        assert tasks["once"].delay(name).get() == name
        assert tasks["once"].delay(name).get() == name  # ran again: no hold was left behind
        assert rig.key_free(f"once:{name}", wait_s=0)
    finally:
        close_app(app)


def test_a_publish_that_fails_releases_its_hold(rig: Rig) -> None:
    app = make_app(
        "qonce-nobroker",
        rig.settings,
        broker_url=f"redis://127.0.0.1:{free_port()}/0",
        broker_transport=None,
        broker_transport_options={},
        broker_connection_timeout=1,
        task_publish_retry=False,
    )
    tasks = define_tasks(app)
    try:
        name = unique("nobroker")
        with pytest.raises(OperationalError):
            tasks["once"].delay(name)
        assert rig.key_free(f"once:{name}", wait_s=0)
    finally:
        close_app(app)


@pytest.mark.parametrize("countdown", [1e12, math.inf])
def test_a_countdown_no_lease_can_cover_is_refused_by_name(rig: Rig, countdown: float) -> None:
    """A message due further off than any lease the server grants: refused before it is sent,
    naming the countdown (``inf`` raised ``OverflowError`` from the hold's lease arithmetic)."""
    parked = unique("dflock-nobody")
    name = unique("far-off")
    with pytest.raises(DflockError, match="countdown") as refused:
        rig.tasks["plain"].apply_async(
            (name,), queue=parked, lock_from="publish", countdown=countdown
        )
    print(refused.value)
    assert messages(rig, parked) == 0
    assert rig.key_free(f"once:{name}", wait_s=0)
