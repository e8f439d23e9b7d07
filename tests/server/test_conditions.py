"""What ``stats``' ``degraded`` list (and the status page's banners) says of the server, held
against what the server does."""

from __future__ import annotations

from pathlib import Path

from dflockd_server import Config
from dflockd_server.testing import ServerThread
from tests.support.disks import own_ext4, turn_read_only
from tests.support.waiting import wait_until
from tests.support.wire import Wire


def test_a_read_only_state_dir_is_said_to_refuse_renewals_when_it_does(tmp_path: Path) -> None:
    """A disk error that turns the state directory read-only leaves the journal's ``complete``
    mark in place: renewals are refused then (a restart could not know of them). The
    ``journal_read_only`` condition says so, not that renewals go on."""
    image = tmp_path / "state.img"
    with own_ext4(tmp_path / "state", image, "16M", options="errors=remount-ro") as state:
        server = ServerThread(Config(host="127.0.0.1", port=0, state_dir=str(state))).start()
        try:
            with Wire(server.address) as w:
                token = w.lock("held", lease=60)
                turn_read_only(state)
                wait_until(lambda: w.req("l", "new", "0") == "error_read_only", timeout=10)
                assert w.req("n", "held", f"{token} 60") == "error"  # what the server does
                (said,) = [c for c in w.stats()["degraded"] if c["name"] == "journal_read_only"]
                assert "renewals and releases go on" not in said["message"]
                assert "renewals and keep-alives are refused" in said["message"]
                assert w.req("r", "held", token) == "ok"  # releases do go on
        finally:
            server.stop()
