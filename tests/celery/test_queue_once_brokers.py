"""Queue once (issue 17), acceptance 1-6 on real workers, a real lock server, and both brokers.

Each broker (Redis, RabbitMQ) gets one rig for the module: a ``ServerThread``, a run log, a
client app in the test process with the tasks of ``apps.queue_once`` (``lock_from="publish"``)
and one shared prefork worker. A test that needs messages to wait in the broker publishes to a
queue of its own that no worker consumes yet, counts the messages there (``queue_declare``
passive: the ready messages, on either broker), and then starts a worker on it, or lets the
shared worker consume it (``add_consumer``). Publishers that must be separate processes (or be
killed) are ``python -m apps.queue_once_publish`` subprocesses.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest
import redis
from kombu.connection import Connection

from celery_dflock.client.errors import AlreadyQueued
from dflockd_server import Config
from tests.celery.apps.queue_once import PURGE_PENDING_TTL_S, define_tasks
from tests.support.processes import kill_group, python_path
from tests.support.rigs import Rig, open_rig, unique
from tests.support.services import require_rabbitmq, require_redis
from tests.support.waiting import wait_until
from tests.support.workers import (
    CELERY_APPS_DIR,
    REPO,
    Entry,
    Worker,
    iter_overlaps,
    rabbitmq_settings,
    redis_cleanup,
    redis_settings,
)

EVENT_TIMEOUT_S = 30.0
PUBLISHER_TIMEOUT_S = 60.0
PUBLISHERS = 5
PUBLISHES_EACH = 4
VISIBILITY_TIMEOUT_S = 5
"""Redis: a message reserved by a worker that died comes back after this (acks_late)."""
FREED_WITHIN_S = 20.0
"""Generous bound for a hold to be freed once what frees it has happened."""

REDELIVERY_GRACE_S = 5.0
"""How long a second delivery is given to start a second run (it must not)."""
PRIORITY_SEP = "\x06\x16"
"""kombu's Redis transport keeps priority ``n`` of a queue in the list ``<queue>\\x06\\x16<n>``."""

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------- the rig


CONTROL_ATTEMPTS = 3
"""How many times a control command is sent before a missing reply fails the test."""


@dataclass
class BrokerRig(Rig):
    """One broker's lock server, run log, client app, shared worker and scratch queues."""

    broker: str = "redis"
    queues: list[str] = field(default_factory=list[str])
    _shared: Worker | None = None

    @property
    def base_queue(self) -> str:
        return str(self.settings["task_default_queue"])

    def fresh_queue(self) -> str:
        """A queue of this test's own, which no worker consumes until told to."""
        name = f"{self.base_queue}-{uuid.uuid4().hex[:8]}"
        self.queues.append(name)
        return name

    def shared_worker(self) -> Worker:
        """The module's prefork worker (started on first use), consuming the base queue."""
        if self._shared is None or not self._shared.alive():
            self._shared = self.start_worker(pool="prefork", concurrency=2)
        return self._shared

    def consume(self, queue_name: str, worker: Worker | None = None) -> None:
        """Make ``worker`` (default: the shared one) consume ``queue_name`` as well."""
        target = worker or self.shared_worker()
        # A broadcast that finds the worker busy (or its control consumer not yet listening)
        # can go unanswered; asking again is harmless (the worker says it already consumes).
        for _ in range(CONTROL_ATTEMPTS):
            replies = self.app.control.add_consumer(
                queue_name, destination=[target.name], reply=True, timeout=10
            )
            if replies:
                return
        raise AssertionError(f"no reply from {target.name} to add_consumer({queue_name})")

    def publish(self, task: str, name: str, queue_name: str, release: Path | None = None) -> Any:
        """``apply_async`` through the task in this process (a duplicate returns the holder)."""
        return self.tasks[task].apply_async(
            (name, None if release is None else str(release)), queue=queue_name
        )

    def ready_messages(self, queue_name: str) -> int:
        """Messages waiting in ``queue_name`` on the broker (not those a worker reserved):
        on Redis the length of its lists (one per priority step), on RabbitMQ the count that a
        passive ``queue_declare`` reports."""
        if self.broker == "redis":
            client = redis.Redis.from_url(self.settings["broker_url"])
            try:
                lists = [queue_name, *client.scan_iter(match=f"{queue_name}{PRIORITY_SEP}*")]
                return sum(int(client.llen(name)) for name in lists)
            finally:
                client.close()
        with Connection(self.settings["broker_url"]) as conn:
            declared = conn.default_channel.queue_declare(queue=queue_name, passive=True)
        return int(declared.message_count)

    def purge(self, queue_name: str) -> int:
        with Connection(self.settings["broker_url"]) as conn:
            return int(conn.default_channel.queue_purge(queue_name) or 0)

    def runs(self, name: str) -> list[Entry]:
        return self.log.entries("started", name=name)

    def close(self) -> None:
        super().close()
        if self.broker != "redis":
            with Connection(self.settings["broker_url"]) as conn:
                for name in [self.base_queue, *self.queues]:
                    with contextlib.suppress(Exception):
                        conn.default_channel.queue_delete(name)


@pytest.fixture(scope="module", params=["redis", "rabbitmq"])
def rig(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BrokerRig]:
    broker: str = request.param
    require_redis()  # the result backend is Redis for both brokers
    if broker == "rabbitmq":
        require_rabbitmq()
    tmp = tmp_path_factory.mktemp(f"qonce-{broker}")
    base_queue = f"dflock-qonce-{uuid.uuid4().hex[:8]}"
    if broker == "redis":
        base = redis_settings(base_queue)
        base["broker_transport_options"] = {
            **base["broker_transport_options"],
            "visibility_timeout": VISIBILITY_TIMEOUT_S,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        }
    else:
        base = rabbitmq_settings(base_queue)
    with open_rig(
        tmp,
        "apps.queue_once",
        base,
        server=Config(host="127.0.0.1", port=0),
        main="qonce-client",
        define_tasks=define_tasks,
        cleanup=(lambda: redis_cleanup(base_queue)) if broker == "redis" else None,
        rig_class=BrokerRig,
    ) as made:
        made.broker = broker
        yield made


# --------------------------------------------------------------------------- publishers


class Publisher:
    """``python -m apps.queue_once_publish`` in its own process group; its JSON lines."""

    def __init__(
        self,
        rig: BrokerRig,
        task: str,
        name: str,
        queue_name: str,
        *,
        count: int = 1,
        go: Path | None = None,
        release: Path | None = None,
        linger: bool = False,
    ) -> None:
        settings = {**rig.settings, "task_default_queue": queue_name}
        env = {
            **os.environ,
            "DFLOCK_TEST_SETTINGS": json.dumps(settings),
            "PYTHONPATH": python_path(CELERY_APPS_DIR, REPO),
            "PYTHONUNBUFFERED": "1",
        }
        command = [sys.executable, "-m", "apps.queue_once_publish", task, name]
        command += ["--count", str(count)]
        if go is not None:
            command += ["--go", str(go)]
        if release is not None:
            command += ["--release-file", str(release)]
        if linger:
            command.append("--linger")
        self.stderr_path = rig.tmp / f"publisher-{uuid.uuid4().hex[:8]}.err"
        with self.stderr_path.open("wb") as err:
            self.proc = subprocess.Popen(
                command,
                cwd=rig.tmp,
                env=env,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                start_new_session=True,
            )
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(json.loads(line))
        self._lines.put(None)

    def next_line(self, timeout: float = PUBLISHER_TIMEOUT_S) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"publisher silent for {timeout}s: {self.stderr()}") from None
        assert line is not None, f"publisher exited early: {self.stderr()}"
        return line

    def results(self, count: int) -> list[dict[str, Any]]:
        """The ``count`` publish lines (after the ``ready`` line)."""
        ready = self.next_line()
        assert "ready" in ready, ready
        return [self.next_line() for _ in range(count)]

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-3000:]

    def kill(self) -> None:
        kill_group(self.proc)
        if self.proc.stdout is not None:
            self._reader.join(5)
            self.proc.stdout.close()


@contextlib.contextmanager
def publishers(*made: Publisher) -> Iterator[tuple[Publisher, ...]]:
    try:
        yield made
    finally:
        for publisher in made:
            publisher.kill()


# --------------------------------------------------------------------------- checks


def wait_finished(rig: BrokerRig, task_id: str, count: int = 1) -> Entry:
    return rig.log.wait_event("finished", EVENT_TIMEOUT_S, count=count, task_id=task_id)


def wait_freed(
    rig: BrokerRig, task: str, name: str, queue_name: str, holder: str
) -> tuple[Any, float]:
    """Publish until a publish enqueues a new task instead of returning ``holder``; that
    task's result and when it was published (monotonic)."""
    found: list[tuple[Any, float]] = []

    def new_publish() -> bool:
        result = rig.publish(task, name, queue_name)
        if result.id != holder:
            found.append((result, time.monotonic()))
            return True
        return False

    wait_until(new_publish, timeout=FREED_WITHIN_S, what=f"the key of {name} to be free", poll=0.1)
    return found[0]


def assert_no_overlap(rig: BrokerRig, name: str) -> None:
    overlaps = list(iter_overlaps(rig.log.entries("finished", name=name)))
    assert not overlaps, f"runs of {name} overlapped: {overlaps}"


def locks_listed(rig: BrokerRig, *args: str) -> subprocess.CompletedProcess[str]:
    """``celery -A apps.queue_once dflock locks [args]`` with the rig's settings."""
    env = {
        **os.environ,
        "DFLOCK_TEST_SETTINGS": json.dumps(rig.settings),
        "PYTHONPATH": python_path(CELERY_APPS_DIR, REPO),
    }
    command = [sys.executable, "-m", "celery", "-A", "apps.queue_once", "dflock", "locks", *args]
    shown = subprocess.run(
        command, env=env, cwd=rig.tmp, capture_output=True, text=True, timeout=60, check=False
    )
    assert shown.returncode == 0, (shown.stdout, shown.stderr)
    return shown


def listed_lock(rig: BrokerRig, key: str) -> dict[str, Any] | None:
    """The entry of ``key`` in ``dflock locks --json`` (None when it is not listed)."""
    reports = cast("list[dict[str, Any]]", json.loads(locks_listed(rig, "--json").stdout))
    for report in reports:
        stats = cast("dict[str, Any]", report.get("stats") or {})
        for entry in cast("list[dict[str, Any]]", stats.get("locks", [])):
            if entry.get("key") == key:
                return entry
    return None


# --------------------------------------------------------------------------- acceptance 1


def test_twenty_publishes_from_five_processes_queue_one_message(rig: BrokerRig) -> None:
    """With no worker on the queue, 20 publishes of one key from 5 processes: one message in
    the broker, one id; a worker then runs it once; after it ends a publish enqueues anew."""
    queue_name = rig.fresh_queue()
    name = unique("one")
    go = rig.tmp / f"go-{name}"
    made = [
        Publisher(rig, "once", name, queue_name, count=PUBLISHES_EACH, go=go)
        for _ in range(PUBLISHERS)
    ]
    with publishers(*made):
        for publisher in made:  # every process has imported the app and waits for go
            assert "ready" in publisher.next_line()
        go.touch()
        lines = [line for publisher in made for line in
                 [publisher.next_line() for _ in range(PUBLISHES_EACH)]]  # fmt: skip
    assert len(lines) == PUBLISHERS * PUBLISHES_EACH
    ids = {line.get("id") for line in lines}
    assert len(ids) == 1 and None not in ids, lines
    first_id = str(lines[0]["id"])
    assert rig.ready_messages(queue_name) == 1

    worker = rig.start_worker(
        settings={"task_default_queue": queue_name}, pool="threads", concurrency=2
    )
    first = wait_finished(rig, first_id)
    # The body's "finished" comes before the release; the result is stored after it.
    rig.app.AsyncResult(first_id).get(timeout=EVENT_TIMEOUT_S)
    again = rig.publish("once", name, queue_name)
    assert again.id != first_id  # the run ended: the key is free, a new task is queued
    second = wait_finished(rig, again.id)
    assert [r["task_id"] for r in rig.runs(name)] == [first_id, again.id]
    assert second["fence"] > first["fence"]
    assert_no_overlap(rig, name)
    worker.kill()


# --------------------------------------------------------------------------- acceptance 2


def test_a_publisher_killed_after_publishing_does_not_free_the_key(rig: BrokerRig) -> None:
    queue_name = rig.fresh_queue()
    name = unique("killed")
    with publishers(Publisher(rig, "once", name, queue_name, linger=True)) as (victim,):
        (published,) = victim.results(1)
        victim.kill()  # kill -9, right after it published
    assert victim.proc.returncode == -signal.SIGKILL
    held_id = published["id"]
    with publishers(Publisher(rig, "once", name, queue_name)) as (duplicate,):
        (again,) = duplicate.results(1)
    assert again == {"id": held_id}
    assert rig.ready_messages(queue_name) == 1

    rig.consume(queue_name)
    wait_finished(rig, held_id)
    assert [r["task_id"] for r in rig.runs(name)] == [held_id]
    fresh, _ = wait_freed(rig, "once", name, queue_name, held_id)
    wait_finished(rig, fresh.id)


# --------------------------------------------------------------------------- acceptance 3


def test_revoking_the_queued_task_frees_the_key(rig: BrokerRig) -> None:
    queue_name = rig.fresh_queue()
    name = unique("revoked")
    queued = rig.publish("once", name, queue_name)
    assert rig.publish("once", name, queue_name).id == queued.id
    worker = rig.shared_worker()
    replies = rig.app.control.revoke(queued.id, destination=[worker.name], reply=True, timeout=10)
    assert replies, "the worker did not answer the revoke"
    rig.consume(queue_name)  # the worker now meets the revoked message
    fresh, _ = wait_freed(rig, "once", name, queue_name, queued.id)
    wait_finished(rig, fresh.id)
    assert [r["task_id"] for r in rig.runs(name)] == [fresh.id]  # the revoked one never ran
    wait_until(lambda: queued.state == "REVOKED", timeout=EVENT_TIMEOUT_S, what="REVOKED")


def test_a_message_the_broker_drops_as_expired_frees_its_key(rig: BrokerRig) -> None:
    """RabbitMQ drops a message whose ``expires`` passed while it waited (Celery sends it as
    the message's ``expiration``): no worker ever receives it to free its hold, so the hold
    lasts no longer than the message can run. On Redis the expired message stays queued (a
    worker would drop it as a revoked one): its hold ends at its ``expires`` all the same."""
    queue_name = rig.fresh_queue()  # no worker ever consumes it
    name = unique("expired")
    expired = rig.tasks["once"].apply_async((name, None), queue=queue_name, expires=1)
    assert rig.publish("once", name, queue_name).id == expired.id
    if rig.broker == "rabbitmq":
        wait_until(
            lambda: rig.ready_messages(queue_name) == 0,
            timeout=EVENT_TIMEOUT_S,
            what="RabbitMQ to drop the expired message",
        )
    fresh, _ = wait_freed(rig, "once", name, queue_name, expired.id)
    assert fresh.id != expired.id
    assert rig.runs(name) == []


def test_a_purged_queue_frees_the_key_after_lock_pending_ttl(rig: BrokerRig) -> None:
    queue_name = rig.fresh_queue()  # no worker ever consumes it
    name = unique("purged")
    before = time.monotonic()
    lost = rig.publish("once_short_pending", name, queue_name)
    assert rig.publish("once_short_pending", name, queue_name).id == lost.id
    assert rig.ready_messages(queue_name) == 1
    assert rig.purge(queue_name) == 1
    assert rig.ready_messages(queue_name) == 0
    fresh, freed_at = wait_freed(rig, "once_short_pending", name, queue_name, lost.id)
    # The hold was granted after `before`: it cannot have run out before its pending ttl.
    assert freed_at - before >= PURGE_PENDING_TTL_S
    assert rig.ready_messages(queue_name) == 1  # the new publish, alone
    assert fresh.id != lost.id
    assert rig.runs(name) == []


# --------------------------------------------------------------------------- acceptance 4


def test_a_retry_keeps_the_key_through_its_countdown(rig: BrokerRig) -> None:
    worker = rig.shared_worker()
    queue_name = rig.base_queue
    name = unique("retry")
    release = rig.tmp / f"release-{name}"
    first = rig.publish("once_retry", name, queue_name, release)
    ran = wait_finished(rig, first.id)
    assert ran["retries"] == 0
    # The first run has ended and asked for a retry in RETRY_COUNTDOWN_S: the key stays held.
    during_countdown = rig.publish("once_retry", name, queue_name, release)
    assert during_countdown.id == first.id
    retried = rig.log.wait_event("started", EVENT_TIMEOUT_S, task_id=first.id, retries=1)
    assert retried["fence"] == ran["fence"]  # the same hold
    assert retried["hold_token"] == ran["hold_token"] and ran["hold_token"] is not None
    assert rig.publish("once_retry", name, queue_name, release).id == first.id  # running
    release.touch()
    wait_finished(rig, first.id, count=2)
    fresh, _ = wait_freed(rig, "once", name, queue_name, first.id)  # same key
    wait_finished(rig, fresh.id)
    # No duplicate message ever ran: the run, its retry, then the new task.
    assert [r["task_id"] for r in rig.runs(name)] == [first.id, first.id, fresh.id]
    assert_no_overlap(rig, name)
    assert worker.alive()


def test_a_run_killed_with_acks_late_is_redelivered_under_the_same_hold(rig: BrokerRig) -> None:
    queue_name = rig.fresh_queue()
    name = unique("late")
    release = rig.tmp / f"release-{name}"
    doomed = rig.start_worker(
        settings={"task_default_queue": queue_name}, pool="prefork", concurrency=1
    )
    held = rig.publish("once_acks_late", name, queue_name, release)
    first = rig.log.wait_event("started", EVENT_TIMEOUT_S, task_id=held.id)
    assert first["worker"] == doomed.name
    doomed.kill()  # kill -9 of the whole worker: the message was never acknowledged
    assert rig.publish("once_acks_late", name, queue_name, release).id == held.id
    survivor = rig.shared_worker()
    rig.consume(queue_name)  # RabbitMQ delivers it again at once; Redis after the visibility
    second = rig.log.wait_event("started", EVENT_TIMEOUT_S, count=2, task_id=held.id)
    assert second["worker"] == survivor.name
    assert second["fence"] == first["fence"]  # the same hold, the same fence
    assert second["hold_token"] == first["hold_token"]
    assert rig.publish("once_acks_late", name, queue_name, release).id == held.id
    release.touch()
    wait_finished(rig, held.id)
    fresh, _ = wait_freed(rig, "once_acks_late", name, queue_name, held.id)
    wait_finished(rig, fresh.id)
    assert [r["task_id"] for r in rig.runs(name)] == [held.id, held.id, fresh.id]
    assert_no_overlap(rig, name)


def reserved_again(rig: BrokerRig, task_id: str) -> bool:
    """Redis: a worker holds ``task_id``'s message unacknowledged after the broker restored it
    (kombu marks a restored message ``redelivered``; its delivery tag stays the same)."""
    unacked = rig.settings["broker_transport_options"]["unacked_key"]
    client = redis.Redis.from_url(rig.settings["broker_url"])
    try:
        found = cast("list[bytes]", client.hvals(unacked))
    finally:
        client.close()
    headers = [cast("dict[str, Any]", json.loads(raw)[0]["headers"]) for raw in found]
    return any(h.get("id") == task_id and h.get("redelivered") for h in headers)


@pytest.mark.parametrize("rig", ["redis"], indirect=True)
def test_a_message_delivered_again_while_its_run_lasts_does_not_overlap(rig: BrokerRig) -> None:
    """Redis delivers an unacknowledged (acks_late) message again once its visibility timeout
    passes, even while its first run is still going: the second delivery must not run beside
    the first under the same hold (RabbitMQ delivers again only when the connection is gone)."""
    worker = rig.shared_worker()
    name = unique("overdue")
    release = rig.tmp / f"release-{name}"
    held = rig.publish("once_acks_late", name, rig.base_queue, release)
    first = rig.log.wait_event("started", EVENT_TIMEOUT_S, task_id=held.id)
    wait_until(
        lambda: reserved_again(rig, held.id),
        timeout=VISIBILITY_TIMEOUT_S + FREED_WITHIN_S,
        what="Redis to deliver the message again",
        poll=0.1,
    )
    # The worker has the second delivery: give it every chance to start a second run.
    with contextlib.suppress(AssertionError):
        rig.log.wait_event("started", REDELIVERY_GRACE_S, count=2, task_id=held.id)
    release.touch()
    started = len(rig.runs(name))
    wait_finished(rig, held.id, count=started)
    assert worker.alive()
    runs = rig.log.entries("finished", name=name)
    assert not list(iter_overlaps(runs)), (
        f"a second delivery ran beside the first under fence {first['fence']}: {runs}"
    )


# --------------------------------------------------------------------------- acceptance 5


def test_on_duplicate_raise_raises_already_queued_with_the_holders_id(rig: BrokerRig) -> None:
    queue_name = rig.fresh_queue()
    name = unique("raise")
    held = rig.publish("once_raise", name, queue_name)
    with pytest.raises(AlreadyQueued) as raised:
        rig.publish("once_raise", name, queue_name)
    assert raised.value.task_id == held.id
    assert raised.value.key.endswith(f"once:{name}")
    assert held.id in str(raised.value)
    assert rig.ready_messages(queue_name) == 1


# --------------------------------------------------------------------------- acceptance 6


def test_dflock_locks_lists_the_holders_task_id(rig: BrokerRig) -> None:
    queue_name = rig.fresh_queue()
    name = unique("listed")
    release = rig.tmp / f"release-{name}"
    held = rig.publish("once", name, queue_name, release)
    key = f"once:{name}"
    queued = listed_lock(rig, key)
    assert queued is not None, f"{key} not listed"
    assert queued["holder_task_id"] == held.id
    assert queued["holder_host"] is None
    assert queued["detached"] is True

    rig.consume(queue_name)
    started = rig.log.wait_event("started", EVENT_TIMEOUT_S, task_id=held.id)
    running = listed_lock(rig, key)
    assert running is not None, f"{key} not listed while running"
    assert running["holder_task_id"] == held.id
    hosts = {started["host"], started["host"].partition("@")[2], socket.gethostname()}
    assert running["holder_host"] in hosts, (running, hosts)
    table = locks_listed(rig).stdout
    (row,) = [line for line in table.splitlines() if key in line]
    assert held.id in row and running["holder_host"] in row, table

    release.touch()
    wait_finished(rig, held.id)
    wait_until(lambda: listed_lock(rig, key) is None, timeout=FREED_WITHIN_S, what=f"{key} freed")
