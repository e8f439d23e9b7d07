"""The client's copy of the wire protocol's names and limits agrees with the server's.

`celery_dflock.client.wire` exists so that a worker needs no server code installed; the lock
server defines the same values in `dflockd_server.constants`. A value changed on one side only
would make the client send what the server refuses, or misread what it answers.
"""

from __future__ import annotations

from typing import Final

from celery_dflock.client import wire
from dflockd_server import constants

NAMES: Final = sorted(name for name in vars(wire) if name.isupper())


def test_the_client_has_the_wire_names_it_uses() -> None:
    assert len(NAMES) > 50
    assert {"CMD_LOCK", "STATUS_ERROR_ASK", "FEATURE_HOLDS", "MAX_LINE_BYTES"} <= set(NAMES)


def test_every_wire_value_of_the_client_is_the_servers() -> None:
    differ = {
        name: (getattr(wire, name), getattr(constants, name, "<missing on the server>"))
        for name in NAMES
        if getattr(wire, name) != getattr(constants, name, object())
    }
    assert differ == {}


def test_the_client_knows_every_command_and_status_the_server_has() -> None:
    """A command or status added to the server is added to the client's copy too."""
    wanted = {
        name for name in vars(constants) if name.startswith(("CMD_", "STATUS_")) and name.isupper()
    }
    assert wanted - set(NAMES) == set()
