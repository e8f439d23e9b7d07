"""What the restart grace's reason tells an operator to do, on a server started as a user
starts it."""

from __future__ import annotations

from collections.abc import Callable

from tests.support.ports import free_port
from tests.support.servers import DflockdProcess
from tests.support.wire import Wire


def test_a_server_without_a_state_dir_is_told_to_give_one(
    dflockd_process: Callable[..., DflockdProcess],
) -> None:
    """``dflockd --state-dir none`` on a fixed port waits ``max_lease_ttl_s`` at each start;
    its reason (the start-up log, ``stats``, the status page's banner) told the operator to
    "set fence_state_file", a deprecated setting that would not end the wait (the journal
    lives in the state dir). It names ``--state-dir`` now."""
    proc = dflockd_process(
        "--host", "127.0.0.1", "--port", str(free_port()), "--state-dir", "none",
        "--max-lease-ttl", "60",
    )  # fmt: skip
    address = proc.wait_listening()
    with Wire(address) as w:
        reason = str(w.stats()["grace_reason"])
    assert "fence_state_file" not in reason, reason
    assert "--state-dir" in reason, reason
    logged = " ".join(proc.drain())
    assert "set fence_state_file" not in logged, logged
