"""A waiter whose connection closes just as the key is granted to it: the grant was never told
(its reply cannot leave a closing connection), so it ends at once and the key passes to the next
waiter, instead of being kept for the session's time (``--session-ttl``) as a grant whose
holder may know of it is.

The real ``dflockd`` process; the race is made exact by stopping it (SIGSTOP): the waiter's
close and the holder's release both reach its socket buffers, in that order (each seen
acknowledged by the kernel), and the server, resumed, reads them in one turn: the waiter's EOF
first, then the release, which grants the key to that waiter before the close is done."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.processes import paused
from tests.support.servers import DflockdProcess
from tests.support.waiting import wait_until
from tests.support.wire import Wire, fence, holders_and_waiters

SESSION_TTL_S = 10
"""Long, so that a grant kept for the session shows: the next waiter would wait that long."""
BOUND_S = 2.0
"""How soon the next waiter must be granted: the issue's bound is 0.5 s; this leaves room for a
loaded machine to resume the server, and is far below the session's time."""

_FIN_WAIT2 = "05"


def _tcp_state(local_port: int, server_port: int) -> tuple[str, int] | None:
    """The kernel's (state, bytes unacknowledged) of this machine's IPv4 connection from
    127.0.0.1:``local_port`` to 127.0.0.1:``server_port``, or None. Both ends, not the local
    port alone: the kernel gives one ephemeral port to connections towards different peers,
    and with the suite's other processes connecting meanwhile, another connection from the
    same port (to Redis, to another server) was read instead, and never reached FIN_WAIT2."""
    wanted = (f"0100007F:{local_port:04X}", f"0100007F:{server_port:04X}")
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if (fields[1], fields[2]) == wanted:
            tx_queue = int(fields[4].split(":")[0], 16)
            return fields[3], tx_queue
    return None


@pytest.mark.parametrize("journal", [False, True], ids=["no-journal", "journal"])
def test_a_waiter_closing_as_it_is_granted_passes_the_key_on_at_once(
    dflockd_process: Callable[..., DflockdProcess], tmp_path: Path, journal: bool
) -> None:
    state = ["--state-dir", str(tmp_path / "state")] if journal else []
    proc = dflockd_process("--port", "0", "--session-ttl", str(SESSION_TTL_S), *state)
    address = proc.wait_listening()
    with (
        Wire(address) as holder,
        Wire(address) as closer,
        Wire(address, timeout=SESSION_TTL_S + 10) as nxt,
    ):
        token = holder.lock("k", lease=60)
        assert closer.req("hello", "_", "session").startswith("ok ")
        closer.send_lock("k", timeout=30, lease=60)  # queued first ...
        wait_until(lambda: holders_and_waiters(address, "k") == (1, 1), what="closer queued")
        nxt.send_lock("k", timeout=30, lease=60)  # ... then the next waiter
        wait_until(lambda: holders_and_waiters(address, "k") == (1, 2), what="next queued")
        closer_port = closer.sock.getsockname()[1]
        holder_port = holder.sock.getsockname()[1]
        with paused(proc.proc.pid):
            closer.close()  # its FIN reaches the server's buffers first ...
            wait_until(
                lambda: (_tcp_state(closer_port, address[1]) or ("", 0))[0] == _FIN_WAIT2,
                what="the closer's FIN acknowledged by the stopped server's kernel",
            )
            holder.send("r", "k", token)  # ... then the release
            wait_until(
                lambda: _tcp_state(holder_port, address[1]) == ("01", 0),
                what="the release acknowledged by the stopped server's kernel",
            )
            resumed = time.monotonic()
        next_token = nxt.granted_token()
        waited = time.monotonic() - resumed
        assert holder.recv() == "ok"
        print(f"the next waiter was granted {waited:.3f} s after the server resumed")
        # The closing waiter was granted in between (the race happened): one fence between.
        assert fence(next_token) == fence(token) + 2
        assert waited < BOUND_S, f"the key stayed busy {waited:.1f} s after its waiter closed"
        assert holders_and_waiters(address, "k") == (1, 0)
