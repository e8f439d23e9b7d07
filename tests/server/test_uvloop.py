"""The server on uvloop's event loop (only where uvloop is installed)."""

from __future__ import annotations

import pytest

from dflockd_server import Config
from dflockd_server.testing import ServerThread
from tests.support.wire import Wire

uvloop = pytest.importorskip("uvloop", reason="uvloop is optional and not installed here")


def test_commands_on_uvloop() -> None:
    config = Config(host="127.0.0.1", port=0, shutdown_timeout_s=1)
    with ServerThread(config, loop_factory=uvloop.new_event_loop) as srv:
        with Wire(srv.address) as a, Wire(srv.address) as b:
            token = a.lock("k")
            b.send("l", "k", "10")
            assert a.req("r", "k", token) == "ok"
            assert b.recv().startswith("ok ")
            assert a.req("ping") == "ok"
            assert a.req("bad", "k", "1") == "error"
        with Wire(srv.address) as c:
            c.send("l", "k" * 300, "1")
            assert c.recv() == "error"
            assert c.closed_by_server()
