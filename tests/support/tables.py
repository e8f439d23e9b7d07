"""Reading a lock table's per-key state, and the grants a journal holds, in tests."""

from __future__ import annotations

from dflockd_server.keys import KeyState, lock_state
from dflockd_server.recorded import RecordedGrant, RecordedGrants
from dflockd_server.table import LockTable


def key_state(table: LockTable, key: str) -> KeyState | None:
    """The state of ``key`` for reading, or ``None`` if the table has no entry for it (a lock
    that keeps none gets one made up)."""
    entry = table.grants.keys.get(key)
    if entry is None or isinstance(entry, KeyState):
        return entry
    return lock_state(entry) if entry.live else KeyState(key, False, 1, entry.expires_at)


def by_token(grants: RecordedGrants) -> dict[str, RecordedGrant]:
    """A journal's grants not released (``RecordedGrants``) as a dict of token to grant."""
    return {rec.token: rec for rec in grants.values()}


def tokens_of(grants: RecordedGrants) -> list[str]:
    """Their tokens, in the order ``values`` lists them (one per grant kept)."""
    return [rec.token for rec in grants.values()]


def fields(rec: RecordedGrant) -> tuple[object, ...]:
    """What a journal's grant holds, to compare (a grant compares by identity)."""
    return (
        *(rec.token, rec.key, rec.limit, rec.is_sem, rec.lease_ttl, rec.until_ms),
        *(rec.detached, rec.on_close, rec.note, rec.left),
    )


def recorded(grants: RecordedGrants) -> dict[str, tuple[object, ...]]:
    """Each grant kept, by token, as its ``fields``."""
    return {rec.token: fields(rec) for rec in grants.values()}
