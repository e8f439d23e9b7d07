"""The requests the benchmarks send, in the bytes of the client's codec
(`celery_dflock.client._requests`), never spelled by hand.

A request sent many times with a different key or token is a ``%`` template the codec built
once (its key or token given as ``"%s"``), filled in with bytes in the hot loop at the cost of
one ``%``: ``RELEASE % (key, token)``.
"""

from __future__ import annotations

from typing import Final

from celery_dflock.client._requests import (
    PING_REQUEST,
    SHARDS_REQUEST,
    STATS_REQUEST,
    Command,
    checked_enqueue,
    checked_hold,
    checked_lock,
    checked_release,
    checked_renew,
    checked_sem_lock,
)

__all__ = [
    "PING",
    "RELEASE",
    "SEM_RELEASE",
    "SHARDS",
    "STATS",
    "TRY_LOCK",
    "enqueue",
    "hold",
    "lock",
    "renew",
    "sem_lock",
]

SLOT: Final = "%s"
"""A key's or a token's place in a template."""

PING: Final = PING_REQUEST
STATS: Final = STATS_REQUEST
SHARDS: Final = SHARDS_REQUEST
TRY_LOCK: Final = checked_lock(SLOT, 0, None)
"""``l <key> 0``: try once, the server's default lease; ``% key``."""
RELEASE: Final = checked_release(SLOT, SLOT)
"""``r <key> <token>``; ``% (key, token)``."""
SEM_RELEASE: Final = b"s" + RELEASE
"""``sr <key> <token>``, the semaphore's ``r``; ``% (key, token)``."""


def lock(timeout_s: int, lease_s: int | None = None, key: str = SLOT) -> bytes:
    """``l <key> <timeout> [<lease>]`` (``% key`` unless ``key`` is given)."""
    return checked_lock(key, timeout_s, lease_s)


def hold(lease_s: int, note: str, key: str = SLOT) -> bytes:
    """``hl <key> 0 <lease> c <note>``: try once, bound to the connection (``% key`` unless
    ``key`` is given; a template doubles the note's ``%``, which percent-encoding puts there)."""
    return checked_hold(
        key, 0, lease_s, note.replace("%", "%%") if key == SLOT else note, detached=False
    )


def sem_lock(limit: int, lease_s: int, key: str = SLOT) -> bytes:
    """``sl <key> 0 <limit> <lease>``: try once for one of ``limit`` slots (``% key`` unless
    ``key`` is given)."""
    return checked_sem_lock(key, 0, limit, lease_s)


def enqueue(key: str = SLOT) -> bytes:
    """``e <key>``: join the key's queue, the server's default lease (``% key``)."""
    return checked_enqueue(key, None, None)


def renew(key: str, token: str, lease_s: int) -> bytes:
    """``n <key> <token> <lease>``."""
    return checked_renew(Command.RENEW, key, token, lease_s)
