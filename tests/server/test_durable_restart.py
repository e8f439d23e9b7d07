"""A lock outlives a restart of its lock server, started the way a user starts it (issue 26,
acceptance 1).

The server is the installed ``dflockd`` script, run as ``dflockd --host 127.0.0.1 --port P``
(plus the two TLS flags in the TLS variant) from a fresh working directory, with a fresh
``HOME``, no ``XDG_STATE_HOME`` and no ``DFLOCKD_*`` variable: whatever keeps the lease across
the restart is the server's default. Its first acquire is granted at once (a new state
directory has nothing to wait for). Client A holds a key (a lock, or with A2 both slots of a
semaphore) through celery_dflock's blocking client; the server is killed (SIGKILL, or SIGTERM
and its whole drain) and started again with the same command. Then:

* a key nobody held is granted by a try-once acquire as soon as the server listens (no
  restart grace);
* a rival's try-once acquire of A's key is refused (A's lease came back);
* once A has renewed against the new server, A was never told its lock is lost and its
  release is confirmed;
* the rival is then granted the key, with a fence above A's;
* the start log says what it restored.
"""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest

from celery_dflock import DistributedLock, DistributedSemaphore
from tests.support.certificates import key_of, make_certificate
from tests.support.ports import free_port
from tests.support.servers import DflockdProcess
from tests.support.waiting import wait_until
from tests.support.wire import Wire

LEASE_S = 20
RENEW_RATIO = 0.1
"""A renews every 2 s (instead of every 10 s at the default ratio): the test waits for one
renewal against the restarted server, and a shorter interval makes that wait shorter."""
SEMAPHORE_LIMIT = 2
STOP_TIMEOUT_S = 60.0
"""SIGTERM: at most the default shutdown timeout (30 s) of draining while A holds its key."""
RENEWAL_TIMEOUT_S = 15.0
"""A's renewals come every 2 s; its first one on the restarted server comes well within this."""
GRACE = "restart grace: granting no key"
"""What the start log says when a restart grace holds back every grant."""
_RESTORED = re.compile(r"journal: restored (\d+) lease\(s\) from (\S+)")

Lock = DistributedLock | DistributedSemaphore


@dataclass
class UserShell:
    """What a user has: a home, a working directory, an environment without our settings."""

    home: Path
    cwd: Path
    port: int
    tls: tuple[Path, Path] | None
    env: dict[str, str] = field(default_factory=lambda: {})
    started: list[DflockdProcess] = field(default_factory=lambda: [])

    def __post_init__(self) -> None:
        self.env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("DFLOCKD_") and k != "XDG_STATE_HOME"
        }
        self.env["HOME"] = str(self.home)

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    @property
    def command(self) -> list[str]:
        args = ["--host", "127.0.0.1", "--port", str(self.port)]
        if self.tls is not None:
            args += ["--tls-cert", str(self.tls[0]), "--tls-key", str(self.tls[1])]
        return args

    @property
    def state_dir(self) -> Path:
        """The contract's default: ``~/.local/state/dflockd/<host>-<port>``."""
        return self.home / ".local" / "state" / "dflockd" / f"127.0.0.1-{self.port}"

    def ssl_context(self) -> ssl.SSLContext | None:
        if self.tls is None:
            return None
        return ssl.create_default_context(cafile=str(self.tls[0]))

    def start(self) -> DflockdProcess:
        proc = DflockdProcess(self.command, self.env, inherit_env=False, cwd=self.cwd)
        self.started.append(proc)
        assert proc.wait_listening() == self.address
        return proc

    def stats(self) -> dict[str, Any]:
        with Wire(self.address, ssl_context=self.ssl_context()) as wire:
            reply = wire.req("stats")
        assert reply.startswith("ok "), reply[:200]
        return cast(dict[str, Any], json.loads(reply[3:]))

    def kill_all(self) -> None:
        for proc in self.started:
            proc.kill()


@pytest.fixture(params=["plain", "tls"])
def shell(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[UserShell]:
    home = tmp_path / "home"
    cwd = tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    tls = None
    if request.param == "tls":
        certs = tmp_path / "certs"
        certs.mkdir()
        cert = make_certificate(certs)
        tls = (cert, key_of(cert))
    user = UserShell(home=home, cwd=cwd, port=free_port(), tls=tls)
    try:
        yield user
    finally:
        user.kill_all()


def _make(shell: UserShell, kind: str, key: str, timeout_s: float, **extra: Any) -> Lock:
    common: dict[str, Any] = {
        "acquire_timeout_s": timeout_s,
        "lease_ttl_s": LEASE_S,
        "servers": [shell.address],
        "renew_ratio": RENEW_RATIO,
        "ssl_context": shell.ssl_context(),
        **extra,
    }
    if kind == "lock":
        return DistributedLock(key, **common)
    return DistributedSemaphore(key, SEMAPHORE_LIMIT, **common)


def _renewed_since_restart(shell: UserShell, kind: str, key: str, holders: int) -> bool:
    """Whether A has renewed against the restarted server.

    A lock: its ``stats`` entry no longer says ``"restored": true`` (restored from the journal,
    renewed by no connection yet). A semaphore's entry names no holder, so there it is each
    holder's connection to the new server (their renewals open them; ``stats`` counts its
    own connection too): a renewal that was refused shows as a lost lock afterwards, as the
    release waits for a renewal under way."""
    seen = shell.stats()
    section = "locks" if kind == "lock" else "semaphores"
    entries = [e for e in seen[section] if e["key"] == key]
    assert entries, f"{key!r} is not held on the restarted server: {seen[section]}"
    if kind == "lock":
        assert "restored" in entries[0], f"stats has no 'restored' for locks: {entries[0]}"
        return entries[0]["restored"] is False
    return cast(int, seen["connections"]) >= 1 + holders


@pytest.mark.parametrize("kind", ["lock", "semaphore"])
@pytest.mark.parametrize("stop", ["sigkill", "sigterm"])
def test_a_lock_outlives_a_restart_of_a_server_started_as_a_user_starts_it(
    shell: UserShell, kind: str, stop: str
) -> None:
    server = shell.start()
    assert not any(GRACE in line for line in server.lines), server.lines
    # A new server on a new state dir grants at once.
    first = _make(shell, "lock", "first", 0)
    assert first.acquire(), "the first acquire on a new server was refused"
    assert first.release()
    assert stat.S_IMODE(shell.state_dir.stat().st_mode) == 0o700, shell.state_dir
    assert (shell.state_dir / "journal").is_file(), sorted(shell.state_dir.iterdir())

    key = f"durable:{kind}"
    lost: list[str] = []
    holders = [
        _make(shell, kind, key, 0, on_lost=lambda lock: lost.append(repr(lock)))
        for _ in range(1 if kind == "lock" else SEMAPHORE_LIMIT)
    ]
    for holder in holders:
        assert holder.acquire()
    fences = [holder.fence for holder in holders]
    assert all(f is not None for f in fences), fences

    if stop == "sigkill":
        server.kill()
    else:
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait_exit(STOP_TIMEOUT_S) == 0, server.lines
    restarted = shell.start()

    # Granted at once: no restart grace.
    free = _make(shell, "lock", "never-held", 0)
    assert free.acquire(), f"a free key was refused after the restart: {restarted.lines}"
    assert free.release()
    # A's lease came back: the rival is refused.
    assert not any(GRACE in line for line in restarted.lines), restarted.lines
    rival = _make(shell, kind, key, 0)
    assert not rival.acquire(), "the rival was granted a key held across the restart"

    restored = [m for line in restarted.lines if (m := _RESTORED.search(line))]
    assert restored, f"the start log does not say what it restored: {restarted.lines}"
    assert int(restored[0][1]) == len(holders), restored[0][0]
    assert Path(restored[0][2]).parent == shell.state_dir, restored[0][0]

    def renewed() -> bool:
        assert not lost, f"A was told its lock is lost: {lost}"
        return _renewed_since_restart(shell, kind, key, len(holders))

    wait_until(
        renewed,
        timeout=RENEWAL_TIMEOUT_S,
        what=f"A's renewal of {key!r} on the restarted server",
    )
    assert not rival.acquire(), "the rival was granted the key while A held it"
    for holder in holders:
        assert not holder.lost, holder
        assert holder.owned(), holder
    assert lost == [], f"on_lost was called: {lost}"
    for holder in holders:
        assert holder.release(), f"{holder} was not released by the server"
    assert lost == [], f"on_lost was called at release: {lost}"
    assert rival.acquire(), "the key stayed held after A released it"
    assert rival.fence is not None and rival.fence > max(f for f in fences if f is not None)
    assert rival.release()
    # The restarted server went on writing its journal in the same place.
    assert (shell.state_dir / "journal").stat().st_size > 0
