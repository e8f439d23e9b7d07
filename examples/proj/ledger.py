"""A fenced store: it refuses writes carrying a fence lower than the last one it accepted.

This is the pattern a lease-based lock needs for safety: a holder that paused past its lease
(and lost the lock to someone else) still carries its old fence, so its late write is refused.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path


class StaleFenceError(Exception):
    """A write came with a fence lower than one the store has already accepted."""


class NoFenceError(Exception):
    """A write came without a fence: its lock server issues no fencing tokens."""


class FencedLedger:
    """Account balances in SQLite, each write conditional on its fencing token."""

    def __init__(self, path: Path) -> None:
        self._path = path
        db = self._connect()
        try:
            db.execute(
                "CREATE TABLE IF NOT EXISTS balance "
                "(account TEXT PRIMARY KEY, amount INTEGER NOT NULL, fence INTEGER NOT NULL)"
            )
        finally:
            db.close()

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self._path, timeout=10, isolation_level=None)

    def add(self, account: str, amount: int, fence: int | None) -> int:
        """Add ``amount`` under ``fence``; return the new balance or raise StaleFenceError.

        ``fence`` None (``lock.fence`` on a server that issues no fencing tokens, such as
        dflockd 0.4/0.5 or the Go server) is refused: there is nothing safe to compare.
        """
        if fence is None:
            raise NoFenceError(
                f"write to {account!r} refused: it carries no fence, because its lock server "
                "issues no fencing tokens (lock.fence is None); run the lock server "
                "dflockd-server, whose tokens are fences"
            )
        db = self._connect()
        try:
            db.execute("BEGIN IMMEDIATE")  # read and write under one write lock
            try:
                row = db.execute(
                    "SELECT amount, fence FROM balance WHERE account = ?", (account,)
                ).fetchone()
                current, last_fence = (0, -1) if row is None else (int(row[0]), int(row[1]))
                if fence < last_fence:
                    raise StaleFenceError(
                        f"write to {account!r} with fence {fence} refused: "
                        f"fence {last_fence} was already used"
                    )
                db.execute(
                    "INSERT INTO balance (account, amount, fence) VALUES (?, ?, ?) "
                    "ON CONFLICT(account) DO UPDATE SET amount = excluded.amount, "
                    "fence = excluded.fence",
                    (account, current + amount, fence),
                )
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
            return current + amount
        finally:
            db.close()

    def balance(self, account: str) -> int:
        """The account's balance (0 when never written)."""
        db = self._connect()
        try:
            row = db.execute("SELECT amount FROM balance WHERE account = ?", (account,)).fetchone()
            return 0 if row is None else int(row[0])
        finally:
            db.close()
