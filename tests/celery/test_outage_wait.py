"""How long a run reconnects to an unreachable lock server inside its pool slot (issue 69),
decided without sockets: `OutageWait.for_run` over a request as Celery gives it."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest

from celery_dflock._outage import (
    OUTAGE_HEADER,
    OUTAGE_RECONNECT_S,
    OutageState,
    OutageWait,
    parse_outage,
)
from celery_dflock.client.errors import ServerUnavailable


def request(*, direct: bool = False, eager: bool = False, outage: bool = False) -> object:
    state = {"since": time.time() - 5, "retries": 1} if outage else None
    return SimpleNamespace(
        called_directly=direct, is_eager=eager, headers={}, **{OUTAGE_HEADER: state}
    )


def reconnect_s(req: object, wait_s: float) -> float:
    now = time.monotonic()
    return OutageWait.for_run(req, now, wait_s).deadline - now


def test_a_worker_run_reconnects_briefly_the_first_time_its_message_meets_the_outage() -> None:
    assert reconnect_s(request(), 30.0) == pytest.approx(OUTAGE_RECONNECT_S, abs=0.05)
    assert reconnect_s(request(), 0.5) == pytest.approx(0.5, abs=0.05)  # never past lock_timeout


def test_a_run_sent_again_for_an_outage_does_not_wait_in_its_slot() -> None:
    wait = OutageWait.for_run(request(outage=True), time.monotonic(), 30.0)
    assert wait.deadline - time.monotonic() <= 0.05
    assert wait.next_pause(ServerUnavailable("refused"), "127.0.0.1:1") is None  # sent again


@pytest.mark.parametrize("how", ["direct", "eager"])
def test_a_run_without_a_message_to_send_again_waits_its_whole_lock_timeout(how: str) -> None:
    req = request(direct=how == "direct", eager=how == "eager", outage=True)
    assert reconnect_s(req, 30.0) == pytest.approx(30.0, abs=0.05)


@pytest.mark.parametrize("since", [math.nan, math.inf, -math.inf])
def test_an_outage_header_whose_since_is_no_time_is_not_read(since: float) -> None:
    """A ``since`` that is no time (NaN compares false to everything: the run's budget was
    never spent, and each outage retry sent the NaN on) is read as no outage header: the
    outage counts from now, and the next retry carries a real time."""
    assert parse_outage({"since": since, "retries": 3}) is None
    assert parse_outage({"since": 1.0e9, "retries": 3}) == OutageState(1.0e9, 3)
