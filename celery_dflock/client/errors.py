"""The client's exceptions, rooted at `DflockError`: each carries a single message string (so
it pickles, as Celery needs) that says what went wrong and what to do about it."""

from __future__ import annotations

__all__ = [
    "AlreadyQueued", "AuthError", "DflockError", "ForceReleaseUnsupported", "HoldsUnsupported",
    "InvalidValueError", "KeyHeld", "LimitMismatchError", "LockLost", "LockNotAcquired",
    "LockNotOwned", "LockSkipped", "MaxLocksError", "MaxWaitersError", "ProtocolError",
    "ServerDraining", "ServerReadOnly", "ServerUnavailable", "ShardingMismatchError",
]  # fmt: skip


class DflockError(Exception):
    """Base class of every error raised by celery-dflock."""


class InvalidValueError(DflockError, ValueError):
    """An argument or setting has a value that cannot work. Also a `ValueError`; in Celery a
    bad ``dflock_*`` setting raises its subclass ``celery_dflock.config.DflockConfigError``."""


class LockNotAcquired(DflockError, TimeoutError):
    """The lock (or a semaphore slot) was not granted within the acquire timeout. Also a
    `TimeoutError`, as the dflockd clients raise."""


class LockSkipped(LockNotAcquired):
    """A task run was not started because its lock was busy (``on_locked="skip"``): it fails
    with this error at once, logged at INFO without a traceback (``Task.throws``)."""


class KeyHeld(LockNotAcquired):
    """A hold (`Client.hold`) was not taken: the key stayed busy. ``key`` is the key,
    ``holder`` the note its holder gave (None when it gave none, e.g. a plain lock)."""

    def __init__(self, message: str, key: str = "", holder: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.holder = holder


class HoldsUnsupported(DflockError):
    """A hold, or a note on a grant, was asked of a server without the ``holds`` feature (a
    foreign dflockd)."""


class ForceReleaseUnsupported(DflockError):
    """A force release (`Client.force_release`, ``celery dflock release``) was asked of a
    server that does not offer it: one that predates it, or a foreign dflockd."""


class LockLost(DflockError):
    """A lock this process held is gone: its renewal was refused or its server went away."""


class LockNotOwned(DflockError):
    """An operation needs a held lock, and this object does not hold one."""


class MaxLocksError(DflockError):
    """The server refused a new key: it already tracks its maximum number of keys."""


class MaxWaitersError(DflockError):
    """The server refused to queue another waiter on this key (its per-key waiter cap)."""


class LimitMismatchError(DflockError):
    """A lock or semaphore was requested with a limit other than its busy key's (a lock is a
    semaphore of limit 1)."""


class AuthError(DflockError):
    """The server requires an auth token, or refused the one sent."""


class ProtocolError(DflockError):
    """The server sent something that is not a valid reply to the request in flight."""


class ServerUnavailable(DflockError):
    """A lock server could not be reached, or the connection to it broke."""


class ServerDraining(ServerUnavailable):
    """The server is shutting down and refuses new requests."""


class ServerReadOnly(ServerUnavailable):
    """The server cannot write its lease journal now: it grants nothing new until it can."""


class ShardingMismatchError(DflockError):
    """A server serves another share of the keys than this client's server list gives it.
    Never retried: two views of where a key lives would let two holders take it."""


class AlreadyQueued(DflockError):
    """A task sent with ``lock_from="publish"`` and ``on_duplicate="raise"`` was not sent: its
    key is held by another task (``task_id``, None when the holder left none)."""

    def __init__(self, message: str, *, task_id: str | None = None, key: str = "") -> None:
        super().__init__(message)
        self.task_id = task_id
        self.key = key
