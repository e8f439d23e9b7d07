"""First real-socket checks: acquire, release, renew, ping, stats over TCP."""

from __future__ import annotations

import json

from dflockd_server import constants
from dflockd_server.testing import ServerThread
from tests.support.wire import Wire, fence


def test_lock_release_renew_ping_stats(dflock_server: ServerThread) -> None:
    with Wire(dflock_server.address) as a:
        reply = a.req("l", "job", "5").split()
        assert reply[0] == "ok"
        assert len(reply[1]) == constants.TOKEN_HEX_CHARS
        assert reply[2] == str(constants.DEFAULT_LEASE_TTL_S)
        token = reply[1]
        assert a.req("n", "job", f"{token} 7") == "ok 7"
        assert a.req("ping") == "ok"
        status, payload = a.req("stats").split(" ", 1)
        assert status == "ok"
        stats = json.loads(payload)
        assert stats["connections"] == 1
        assert [entry["key"] for entry in stats["locks"]] == ["job"]
        assert a.req("r", "job", token) == "ok"
        assert a.req("r", "job", token) == "error"
        again = a.lock("job")
        assert fence(again) > fence(token)
