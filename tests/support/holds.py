"""A hold taken over (``adopt``) by another process, which holds it until it is killed: a run
of a queued message on another worker, for tests that kill that run."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_ADOPTER = """
import sys
from celery_dflock import Client

host, port, key, token, note, on_close = sys.argv[1:7]
# A session of 2 s: killed, it frees what it holds without an <onclose> lease 2 s later
with Client([(host, int(port))], session_ttl_s=2) as client:
    lock = client.lock(key, lease_ttl_s=30)
    held = lock.adopt(token, note=note, on_close_lease=int(on_close) or None)
    print("adopted" if held else "refused", lock.fence, flush=True)
    sys.stdin.read()  # held until killed
"""


@dataclass(frozen=True)
class Adopter:
    pid: int
    fence: int
    """The fence of the grant it took over."""


@contextlib.contextmanager
def adopted_in_a_child(
    address: tuple[str, int], key: str, token: str, on_close: int, note: str = "run/child"
) -> Iterator[Adopter]:
    """A process that adopts ``token`` with the owner ``note`` (``on_close``: its
    ``on_close_lease``, 0 for None) and holds it; yields it once it holds, and kills it
    (SIGKILL) at the end of the block, if nothing killed it before."""
    args = [address[0], str(address[1]), key, token, note, str(on_close)]
    with subprocess.Popen(
        [sys.executable, "-c", _ADOPTER, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    ) as child:
        try:
            assert child.stdout is not None
            status, fence_seen = child.stdout.readline().split()
            assert status == "adopted"
            yield Adopter(child.pid, int(fence_seen))
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)
            child.wait(10)
