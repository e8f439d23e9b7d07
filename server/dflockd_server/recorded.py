"""The grants a lease journal holds, as a restart reads them (``replay``): each as it was last
recorded (``RecordedGrant``), and those not released yet, found by token (``RecordedGrants``).

A restart of a million leases looks up a token per record; a dict keyed by tokens or fences costs
cache misses and scattered memory. So ``RecordedGrants`` puts a grant in a list's slot at its fence
(``FENCE_HEX_CHARS``, read as hex) less the list's first: fences are issued one after another, so a
journal's grants take consecutive slots, and finding one is an index. A fence far past the last
begins a new list (a *run*). A grant the runs cannot take (a fence below the last, as in a rewritten
journal) is kept by its token beside. A token with no fence (not starting with hex) is no server's:
``put`` refuses it, and the journal's reader takes its record as damage."""

from __future__ import annotations

import bisect

from dflockd_server.constants import FENCE_HEX_CHARS

__all__ = ["RecordedGrant", "RecordedGrants"]


class RecordedGrant:
    """One grant as the journal last recorded it (not a dataclass: compiled, its ``__init__``
    would stay interpreted, and a restart makes a million)."""

    __slots__ = ("detached", "is_sem", "key", "lease_ttl", "left", "limit", "note", "on_close",
                 "token", "until_ms")  # fmt: skip

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
        self.left = left  # seconds from the restart to its end, set by `restored_leases`


_GAP = 16  # a fence at most this far past the last run's end extends it; further on, a new run
_MIN_RUN = 64  # a last run of fewer slots is dissolved when a new run begins


def _fence(token: str) -> int:
    """The fence a token starts with, or -1. Only where to look (``int`` also takes a sign or
    an underscore): the grant found is compared with the token."""
    try:
        fence = int(token[:FENCE_HEX_CHARS], 16)
    except ValueError:
        return -1
    return fence if fence >= 0 else -1


class RecordedGrants:
    """The grants not released, found by token (``get``, ``values``); the journal's reader
    changes it with ``put`` and ``pop``."""

    __slots__ = ("_bases", "_end", "_others", "_runs")

    def __init__(self) -> None:
        self._bases: list[int] = []  # each run's first fence, in increasing order
        self._runs: list[list[RecordedGrant | None]] = []
        """Each run's slots: the grant of the fence ``base + i`` at ``i``, or ``None``."""
        self._end = 0  # the fence after the last run's last slot
        self._others: dict[str, RecordedGrant] = {}  # the grants the runs could not take, by token

    def _run_holding(self, token: str, fence: int) -> int:
        """The index of the run whose slot at ``fence`` holds ``token``'s grant, or -1."""
        bases = self._bases
        k = len(bases) - 1
        if k < 0 or fence >= self._end:
            return -1
        if fence < bases[k]:  # not the last run, where a journal's later records look
            k = bisect.bisect_right(bases, fence) - 1
            if k < 0 or fence - bases[k] >= len(self._runs[k]):
                return -1
        kept = self._runs[k][fence - bases[k]]
        return k if kept is not None and kept.token == token else -1

    def put(self, rec: RecordedGrant) -> None:
        """Keep ``rec``, in place of a grant of the same token; ``ValueError`` when its token
        has no fence (a start could not raise the fence counter above it)."""
        token = rec.token
        fence = _fence(token)
        end = self._end
        if fence >= end:  # (never -1: the end is 0 or more)
            runs = self._runs
            if runs and fence - end <= _GAP:  # the usual: the next fence of the last run
                run = runs[-1]
                while end < fence:
                    run.append(None)
                    end += 1
                run.append(rec)
                self._end = fence + 1
            else:
                self._start_run(fence, rec)
            return
        if fence < 0:
            raise ValueError(f"the token {token!r} has no fence")
        # Below the end: in a run's slot, or kept beside (never both).
        if (k := self._run_holding(token, fence)) >= 0:
            self._runs[k][fence - self._bases[k]] = rec
        else:
            self._others[token] = rec

    def _start_run(self, fence: int, rec: RecordedGrant) -> None:
        """Begin a run at ``fence`` with ``rec``, once the last run, if shorter than
        ``_MIN_RUN``, is dissolved into the grants kept beside (fences in no order would
        otherwise make a run of a slot or two each)."""
        runs = self._runs
        if runs and len(runs[-1]) < _MIN_RUN:
            run = runs[-1]
            self._others.update((kept.token, kept) for kept in run if kept is not None)
            run.clear()  # (the list is the new run's)
            run.append(rec)
            self._bases[-1] = fence
        else:
            self._bases.append(fence)
            runs.append([rec])
        self._end = fence + 1

    def get(self, token: str) -> RecordedGrant | None:
        fence = _fence(token)
        if (k := self._run_holding(token, fence)) >= 0:
            return self._runs[k][fence - self._bases[k]]
        others = self._others
        return others.get(token) if others else None

    def pop(self, token: str) -> RecordedGrant | None:
        """Let go of the grant kept for ``token`` and return it (``None``: none is)."""
        fence = _fence(token)
        if (k := self._run_holding(token, fence)) >= 0:
            run = self._runs[k]
            i = fence - self._bases[k]
            rec = run[i]
            run[i] = None
            return rec
        others = self._others
        return others.pop(token, None) if others else None

    def values(self) -> list[RecordedGrant]:
        """Every grant kept, in order."""
        out = [rec for run in self._runs for rec in run if rec is not None]
        out.extend(self._others.values())
        return out
