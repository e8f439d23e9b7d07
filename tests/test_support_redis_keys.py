"""tests/support/workers: the Redis settings of one test keep its broker's bookkeeping to itself."""

from __future__ import annotations

import time

import redis
from kombu.connection import Connection

from tests.support.rigs import unique
from tests.support.services import require_redis
from tests.support.workers import redis_cleanup, redis_settings

SWEEPER_VISIBILITY_S = 0.5


def test_a_short_visibility_timeout_of_another_test_leaves_reserved_messages_alone() -> None:
    """A message a test's worker reserved and has not acknowledged (a countdown it holds
    until due) stays where it is when another test's worker, on the same Redis database,
    sweeps with a visibility timeout shorter than the time it has been held (before: the
    sweep gave it back to its queue, and the test's worker ran it twice)."""
    require_redis()
    mine, other = unique("dflock-unacked-mine"), unique("dflock-unacked-other")
    settings = redis_settings(mine)
    sweeper_settings = redis_settings(other)
    sweeper_options = {
        **sweeper_settings["broker_transport_options"],
        "visibility_timeout": SWEEPER_VISIBILITY_S,
        "unacked_restore_throttle": 1,
    }
    client = redis.Redis.from_url(settings["broker_url"])
    try:
        with Connection(
            settings["broker_url"], transport_options=settings["broker_transport_options"]
        ) as mine_conn:
            queue = mine_conn.SimpleQueue(mine)
            queue.put({"n": 1})
            held = queue.get(timeout=10)  # reserved, not acknowledged
            assert client.llen(mine) == 0
            time.sleep(SWEEPER_VISIBILITY_S * 2)
            with Connection(
                sweeper_settings["broker_url"], transport_options=sweeper_options
            ) as sweeper:
                sweeper.default_channel.qos.restore_visible(num=100, interval=1)
            assert client.llen(mine) == 0, "another test's sweep gave the message back"
            held.ack()
            queue.close()
    finally:
        client.close()
        redis_cleanup(mine)
        redis_cleanup(other)
