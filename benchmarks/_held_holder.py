"""The holding process of the ``held`` benchmark: one process takes N locks through the
blocking client, as a user would (``Client.lock(key)``, ``acquire()``), and holds them.

Run by ``benchmarks.held`` as ``python -P benchmarks/_held_holder.py HOST PORT N PREFIX``,
with the ``celery_dflock`` of the side measured first on ``PYTHONPATH`` (``-P``: neither this
folder nor the current one goes before it). It imports nothing of ``benchmarks``.

It speaks one JSON object per line on stdout: ``{"held": ...}`` once every lock is held, then,
after a line on stdin (the benchmark's window is over), ``{"lost": ...}`` once every lock has
been released: how many had been lost (``lock.lost``), how many were not ``owned()``, how many
releases the server confirmed.
"""

from __future__ import annotations

import json
import sys
import time

import celery_dflock
from celery_dflock.client import Client, DistributedLock


def say(**fields: object) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    host, port, n, prefix = argv[0], int(argv[1]), int(argv[2]), argv[3]
    client = Client([(host, port)])
    locks: list[DistributedLock] = []
    start = time.perf_counter()
    for i in range(n):
        lock = client.lock(f"{prefix}{i}")
        if not lock.acquire():
            say(error=f"lock {i} of {n} not acquired")
            return 1
        locks.append(lock)
    say(held=n, acquire_s=round(time.perf_counter() - start, 3), client=celery_dflock.__file__)
    sys.stdin.readline()  # the window is over
    lost = sum(lock.lost for lock in locks)
    not_owned = sum(not lock.owned() for lock in locks)
    start = time.perf_counter()
    released = sum(lock.release() for lock in locks)
    say(
        lost=lost,
        not_owned=not_owned,
        released=released,
        release_s=round(time.perf_counter() - start, 3),
    )
    client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
