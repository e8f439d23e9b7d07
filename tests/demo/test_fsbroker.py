"""The demo's filesystem transport hands a consumer whole messages only, and keeps every
queue's binding when workers start side by side.

kombu's own filesystem transport, in this same test (300 messages of 200 KB, a consumer
polling with no pause), handed the consumer 242 empty or half-written files out of 300 when we
measured it (kombu 5.7): the race that killed test workers with a JSON error under load.
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path
from typing import Any

from kombu.connection import Connection
from kombu.entity import Exchange, Queue

from celery_dflock.demo.fsbroker import TRANSPORT

MESSAGES = 150
PAD = "x" * 200_000  # a big message keeps the file half-written for longer


def _options(folder: Path, **extra: Any) -> dict[str, Any]:
    return {
        "data_folder_in": str(folder),
        "data_folder_out": str(folder),
        "control_folder": str(folder / "control"),  # kombu's default is ./control
        **extra,
    }


def _produce(folder: Path) -> None:
    with Connection("filesystem://", transport=TRANSPORT, transport_options=_options(folder)) as c:
        queue: Any = c.SimpleQueue("fsbroker-test")
        for i in range(MESSAGES):
            queue.put({"i": i, "pad": PAD})
        queue.close()


def test_a_consumer_polling_during_puts_gets_every_message_whole(tmp_path: Path) -> None:
    producer = multiprocessing.get_context("spawn").Process(target=_produce, args=(tmp_path,))
    producer.start()
    received: list[int] = []
    broken: list[str] = []
    options = _options(tmp_path, polling_interval=0)
    with Connection("filesystem://", transport=TRANSPORT, transport_options=options) as conn:
        queue: Any = conn.SimpleQueue("fsbroker-test")
        deadline = time.monotonic() + 60
        while len(received) + len(broken) < MESSAGES and time.monotonic() < deadline:
            try:
                message = queue.get(timeout=0.01)
            except queue.Empty:
                continue
            except ValueError as exc:  # a half-written file fails to decode
                broken.append(repr(exc))
                continue
            assert message.payload["pad"] == PAD
            received.append(message.payload["i"])
            message.ack()
        queue.close()
    producer.join(30)
    assert producer.exitcode == 0
    assert broken == []
    assert sorted(received) == list(range(MESSAGES))
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".partial-")]
    assert not (Path.cwd() / "control").exists()


BINDERS = 4
EXCHANGES = 80


def _bind(folder: Path, binder: int, together: Any) -> None:
    """Bind this binder's queue to each fanout exchange in turn, all binders at once, as
    starting workers bind their pidbox queues, and read the exchange's table back at once (as a
    fanout publish reads it)."""
    with Connection("filesystem://", transport=TRANSPORT, transport_options=_options(folder)) as c:
        channel: Any = c.default_channel
        mine = f"binder-{binder}"
        for i in range(EXCHANGES):
            together.wait(30)
            Queue(mine, Exchange(f"fanout-{i}", "fanout"), channel=channel).declare()
            queues = [entry.queue for entry in channel.get_table(f"fanout-{i}")]
            assert mine in queues, (i, queues)


def test_workers_binding_to_one_exchange_at_once_each_keep_their_binding(tmp_path: Path) -> None:
    # kombu's own _queue_bind creates a new table file and only then locks it: a second binder
    # could read it empty (the demo's worker-2 died on that JSON error in CI), or truncate what
    # the first had written (a worker deaf to broadcasts).
    context = multiprocessing.get_context("spawn")
    together = context.Barrier(BINDERS)
    binders = [context.Process(target=_bind, args=(tmp_path, n, together)) for n in range(BINDERS)]
    for binder in binders:
        binder.start()
    for binder in binders:
        binder.join(60)
    assert [b.exitcode for b in binders] == [0] * BINDERS
    options = _options(tmp_path)
    with Connection("filesystem://", transport=TRANSPORT, transport_options=options) as c:
        channel: Any = c.default_channel
        for i in range(EXCHANGES):
            table = channel.get_table(f"fanout-{i}")
            assert sorted(entry.queue for entry in table) == [
                f"binder-{n}" for n in range(BINDERS)
            ], i
    control = tmp_path / "control"
    assert not [p.name for p in control.iterdir() if p.name.startswith(".partial-")]


def test_a_deleted_queue_leaves_its_exchange_s_table(tmp_path: Path) -> None:
    options = _options(tmp_path)
    with Connection("filesystem://", transport=TRANSPORT, transport_options=options) as c:
        channel: Any = c.default_channel
        exchange = Exchange("fanout-deleted", "fanout")
        kept, deleted = (Queue(name, exchange, channel=channel) for name in ("kept", "deleted"))
        kept.declare()
        deleted.declare()
        assert sorted(e.queue for e in channel.get_table("fanout-deleted")) == ["deleted", "kept"]
        deleted.delete()
        assert [e.queue for e in channel.get_table("fanout-deleted")] == ["kept"]
