"""Reading a lock table's per-key state in tests."""

from __future__ import annotations

from dflockd_server.keys import KeyState, lock_state
from dflockd_server.table import LockTable


def key_state(table: LockTable, key: str) -> KeyState | None:
    """The state of ``key`` for reading, or ``None`` if the table has no entry for it (a lock
    that keeps none gets one made up)."""
    entry = table.grants.keys.get(key)
    if entry is None or isinstance(entry, KeyState):
        return entry
    return lock_state(entry) if entry.live else KeyState(key, False, 1, entry.expires_at)
