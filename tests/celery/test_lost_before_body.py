"""A lock lost between its grant and the body's start, on real workers and a real server.

The worker app (``apps.lost_at_grant``) frees the key with a real force release in the step
between the grant and the body, and goes on only once the run's guard has been told of the
loss: the loss lands in that window every time.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflockd_server import Config
from tests.support.rigs import Rig, open_rig
from tests.support.workers import filesystem_settings

TOLD_WITHIN_S = 30.0


@pytest.fixture(scope="module", params=["prefork", "threads"])
def grant_rig(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Rig]:
    pool: str = request.param
    tmp: Path = tmp_path_factory.mktemp(f"grant-{pool}")
    base = filesystem_settings(tmp, f"dflock-grant-{uuid.uuid4().hex[:8]}")
    with open_rig(tmp, "apps.lost_at_grant", base, server=Config(host="127.0.0.1", port=0)) as rig:
        rig.start_worker(pool=pool, concurrency=1)
        yield rig


def test_interrupt_does_not_start_a_body_whose_lock_is_already_lost(grant_rig: Rig) -> None:
    name = uuid.uuid4().hex[:8]
    result = grant_rig.send("lost_at_grant_interrupt", name)
    result.get(timeout=TOLD_WITHIN_S, propagate=False)
    (window,) = grant_rig.log.entries("lost_before_body", key=f"grant:{name}")
    assert window["freed"] == 1
    assert window["told"] is True
    assert window["lost"] is True
    assert not grant_rig.log.entries("body_started", name=name)
    assert result.state == "FAILURE"
    assert type(result.result).__name__ == "LockLost", result.result
    assert "the body was not started" in str(result.result)
    (lost,) = grant_rig.log.entries("lock_lost", key=f"grant:{name}")
    assert lost["policy"] == "interrupt"


def test_flag_runs_the_body_with_its_lock_flagged_lost(grant_rig: Rig) -> None:
    name = uuid.uuid4().hex[:8]
    result = grant_rig.send("lost_at_grant_flag", name)
    assert result.get(timeout=TOLD_WITHIN_S) == {"lost": True}
    (window,) = grant_rig.log.entries("lost_before_body", key=f"grant:{name}")
    assert window["told"] is True
    (started,) = grant_rig.log.entries("body_started", name=name)
    assert started["lost"] is True
