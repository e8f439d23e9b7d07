"""The grants a lease journal holds, as a restart reads them (``replay``): each as it was last
recorded (``RecordedGrant``), and those not released yet, found by token (``RecordedGrants``).

A restart of a million leases looks up a token for each record, and the look-ups were the
largest part of its reading (issue 52): a dict keyed by the tokens themselves, a million new
strings of random digits, was a third of a second of cache misses (each collision in a dict
of strings compares with a string elsewhere in memory). ``RecordedGrants`` keys the usual
token by its fence (``FENCE_HEX_CHARS``), an int: a server issues fences in increasing order,
so a journal's grants take neighbouring slots, and a collision compares two ints in the table
itself. A token the fence does not find (two tokens with one fence, as grants issued by two
cluster members could have, or a token whose start is not hex) is kept by itself, beside.
"""

from __future__ import annotations

from collections.abc import Iterator

from dflockd_server.constants import FENCE_HEX_CHARS

__all__ = ["RecordedGrant", "RecordedGrants"]


class RecordedGrant:
    """One grant as the journal last recorded it.

    A class with its own ``__init__``, not a dataclass: compiled, a dataclass's ``__init__``
    is the one ``dataclasses`` writes, interpreted (a restart makes a million of these: half
    a microsecond each, against a native constructor's tenth)."""

    __slots__ = (
        "detached",
        "is_sem",
        "key",
        "lease_ttl",
        "left",
        "limit",
        "note",
        "on_close",
        "token",
        "until_ms",
    )

    def __init__(  # noqa: PLR0917 (the record's fields in order, made a million times)
        self,
        token: str,
        key: str,
        limit: int,
        is_sem: bool,
        lease_ttl: int,
        until_ms: int,
        detached: bool,
        on_close: int | None,
        note: str | None,
        left: float = 0.0,
    ) -> None:
        self.token = token
        self.key = key
        self.limit = limit
        self.is_sem = is_sem
        self.lease_ttl = lease_ttl
        self.until_ms = until_ms
        self.detached = detached
        self.on_close = on_close
        self.note = note
        self.left = left
        """Seconds from the restart to its end, set by ``restored_leases`` on the records it
        returns (a field, not a tuple beside each record: a million tuples left holes in the
        memory a restart keeps)."""

    def fields(self) -> tuple[str, str, int, bool, int, int, bool, int | None, str | None, float]:
        """Every field, in ``__init__``'s order (what equality compares)."""
        return (
            self.token,
            self.key,
            self.limit,
            self.is_sem,
            self.lease_ttl,
            self.until_ms,
            self.detached,
            self.on_close,
            self.note,
            self.left,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RecordedGrant):
            return NotImplemented
        return self.fields() == other.fields()

    __hash__ = None  # type: ignore[assignment]  # (mutable, compared by value)

    def __repr__(self) -> str:
        return "RecordedGrant" + repr(self.fields())


def _fence(token: str) -> int:
    """The fence a token starts with (its first ``FENCE_HEX_CHARS`` characters read as hex),
    or -1 when they are not that. Only a look-up's first guess: the token found is compared
    with the one looked for (``int`` takes a few forms besides the hex digits a server writes,
    such as a sign or an underscore, so two tokens may give one fence)."""
    try:
        fence = int(token[:FENCE_HEX_CHARS], 16)
    except ValueError:
        return -1
    return fence if fence >= 0 else -1


class RecordedGrants:
    """The grants not released, by token, in the order they were first recorded (a token the
    fence does not find comes after those it does). A mapping of token to ``RecordedGrant``
    for reading (``in``, ``[]``, ``len``, iteration over the tokens, equality with a dict);
    the journal's reader changes it with ``put`` and ``pop``."""

    __slots__ = ("_by_fence", "_others")

    def __init__(self) -> None:
        self._by_fence: dict[int, RecordedGrant] = {}
        """The grants whose token's fence no other grant kept here has."""
        self._others: dict[str, RecordedGrant] = {}
        """The rest, by token (usually none)."""

    def put(self, rec: RecordedGrant) -> None:
        """Keep ``rec``, in place of the grant of the same token if one is kept (where that
        one was: a token is recorded by one ``G``; a second one replaces it, as a dict's
        item would be)."""
        token = rec.token
        others = self._others
        if others and token in others:
            others[token] = rec
            return
        fence = _fence(token)
        if fence < 0:
            others[token] = rec
            return
        kept = self._by_fence.setdefault(fence, rec)
        if kept is rec:
            return
        if kept.token == token:
            self._by_fence[fence] = rec
        else:
            others[token] = rec

    def get(self, token: str) -> RecordedGrant | None:
        """The grant kept for ``token``, or ``None``."""
        rec = self._by_fence.get(_fence(token))
        if rec is not None and rec.token == token:
            return rec
        others = self._others
        return others.get(token) if others else None

    def pop(self, token: str) -> RecordedGrant | None:
        """Let go of the grant kept for ``token`` and return it, or ``None`` when none is."""
        fence = _fence(token)
        by_fence = self._by_fence
        rec = by_fence.get(fence)
        if rec is not None and rec.token == token:
            del by_fence[fence]
            return rec
        others = self._others
        return others.pop(token, None) if others else None

    def values(self) -> list[RecordedGrant]:
        """Every grant kept, in order."""
        out = list(self._by_fence.values())
        if self._others:
            out.extend(self._others.values())
        return out

    def __len__(self) -> int:
        return len(self._by_fence) + len(self._others)

    def __iter__(self) -> Iterator[str]:
        return iter([rec.token for rec in self.values()])

    def __contains__(self, token: object) -> bool:
        return isinstance(token, str) and self.get(token) is not None

    def __getitem__(self, token: str) -> RecordedGrant:
        rec = self.get(token)
        if rec is None:
            raise KeyError(token)
        return rec

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RecordedGrants):
            other = {rec.token: rec for rec in other.values()}
        if not isinstance(other, dict):
            return NotImplemented
        return {rec.token: rec for rec in self.values()} == other

    __hash__ = None  # type: ignore[assignment]  # (mutable)

    def __repr__(self) -> str:
        return f"RecordedGrants({len(self)} grant(s))"
