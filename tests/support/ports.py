"""Local TCP ports for servers a test starts on a port it chooses (to restart them in place).

They come from below the kernel's ephemeral range, where no connection's own end is ever put.
A port from inside it (what ``bind(("127.0.0.1", 0))`` gives) could be taken, while a test's
server was down for a restart in place, by the local end of any process's outgoing connection:
CI once saw a cluster member restarted in place fail with "address already in use".

Each port handed out is noted, with the process it went to, in a registry that every process
on the machine shares (a file, read and written under a lock), and is not handed out again
while that process lives: two processes (pytest-xdist's, CI's other jobs) never get the same
port, and a test's ports stay its own while its servers are down.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import random
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import cast

SPAN = 20_000
"""How many ports below the ephemeral range are handed out."""
REGISTRY = Path(tempfile.gettempdir()) / "celery-dflock-test-ports.json"
"""Port -> the pid it was handed out to (shared by every process of every run here)."""
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A local TCP port nothing listens on now, and no other process of the machine's tests
    was given (see the module's doc)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct local TCP ports nothing is bound to now (a server of another run
    included), from below the ephemeral range, none handed out before to a process that still
    runs."""
    pool = handed_out_range()
    with _registry_lock():
        owners = {port: pid for port, pid in _read_registry().items() if _alive(pid)}
        ports: list[int] = []
        start = random.randrange(len(pool))
        for i in range(len(pool)):
            port = pool[(start + i) % len(pool)]
            if port not in owners and _bindable(port):
                ports.append(port)
                if len(ports) == count:
                    break
        if len(ports) < count:
            raise RuntimeError(
                f"no {count} free port(s) among {pool.start}-{pool.stop - 1}: {len(owners)} are "
                f"handed out to live processes ({REGISTRY})"
            )
        owners.update(dict.fromkeys(ports, os.getpid()))
        _write_registry(owners)
    return ports


def handed_out_range() -> range:
    """The ``SPAN`` ports just below the kernel's ephemeral range (Linux's default: 32768)."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(max(1024, low - SPAN), low)


@contextlib.contextmanager
def _registry_lock() -> Iterator[None]:
    with open(REGISTRY.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _read_registry() -> dict[int, int]:
    try:
        raw: object = json.loads(REGISTRY.read_text())
    except (OSError, ValueError):
        return {}  # none yet (or cut short by a crash: the bind check still guards)
    if not isinstance(raw, dict):
        return {}
    owners: dict[int, int] = {}
    for port, pid in cast(dict[str, object], raw).items():
        if port.isdigit() and isinstance(pid, int):
            owners[int(port)] = pid
    return owners


def _write_registry(owners: dict[int, int]) -> None:
    fd, tmp = tempfile.mkstemp(dir=REGISTRY.parent, prefix=REGISTRY.name + ".")
    with os.fdopen(fd, "w") as out:
        json.dump({str(port): pid for port, pid in owners.items()}, out)
    os.replace(tmp, REGISTRY)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            return False
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
