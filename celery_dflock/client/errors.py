"""The client's exceptions: one hierarchy rooted at `DflockError`.

Every exception carries a single message string (so it pickles, which Celery needs when a task
fails with one) that says what went wrong and what to do about it.
"""

from __future__ import annotations

__all__ = [
    "AlreadyQueued",
    "AuthError",
    "DflockError",
    "ForceReleaseUnsupported",
    "HoldsUnsupported",
    "InvalidValueError",
    "KeyHeld",
    "LimitMismatchError",
    "LockLost",
    "LockNotAcquired",
    "LockNotOwned",
    "LockSkipped",
    "MaxLocksError",
    "MaxWaitersError",
    "ProtocolError",
    "ServerDraining",
    "ServerReadOnly",
    "ServerUnavailable",
    "ShardingMismatchError",
]


class DflockError(Exception):
    """Base class of every error raised by celery-dflock."""


class InvalidValueError(DflockError, ValueError):
    """An argument or setting has a value that cannot work (the message names it and says
    what would be accepted). Also a `ValueError`.

    In Celery, a bad ``dflock_*`` setting or lock option raises its subclass
    ``celery_dflock.config.DflockConfigError`` (also Celery's ``ImproperlyConfigured``).
    """


class LockNotAcquired(DflockError, TimeoutError):
    """The lock (or a semaphore slot) was not granted within the acquire timeout. Also a
    `TimeoutError`, as the dflockd clients raise on a timed-out acquire.
    """


class LockSkipped(LockNotAcquired):
    """A task run was not started because its lock was busy (``on_locked="skip"``).

    The run ends as a failure with this error, so its result is ready at once (``.get()``
    raises it, a chord or chain with the run in it fails with it); Celery logs it at INFO
    without a traceback, as one of the task's expected errors (``Task.throws``).
    """


class KeyHeld(LockNotAcquired):
    """A hold (`Client.hold`) was not taken: the key stayed busy. ``key`` is the key,
    ``holder`` the note its holder gave (None when it gave none, e.g. a plain lock)."""

    def __init__(self, message: str, key: str = "", holder: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.holder = holder

    def __reduce__(self) -> tuple[type[KeyHeld], tuple[str, str, str | None]]:
        return type(self), (str(self), self.key, self.holder)


class HoldsUnsupported(DflockError):
    """A hold, or a note on a grant, was asked of a server that does not offer them: a
    foreign dflockd server (only celery-dflock's ``dflockd-server`` lists the ``holds``
    feature). The message names the server and what it is."""


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
    """A lock or semaphore was requested with a limit other than the one its busy key already
    has (a key is one resource; a lock is a semaphore of limit 1)."""


class AuthError(DflockError):
    """The server requires an auth token, or refused the one sent."""


class ProtocolError(DflockError):
    """The server sent something that is not a valid reply to the request in flight."""


class ServerUnavailable(DflockError):
    """A lock server could not be reached, or the connection to it broke."""


class ServerDraining(ServerUnavailable):
    """The server is shutting down and refuses new requests."""


class ServerReadOnly(ServerUnavailable):
    """The server cannot write its lease journal now (a full or failing disk): it grants
    nothing new until it can, and keeps every lock held (renewals and releases go on)."""


class ShardingMismatchError(DflockError):
    """A server serves another share of the keys than this client's server list and sharding
    strategy give it (it was started with another ``--members`` list, or is a cluster member):
    the message names both and says what to change. Never retried: two views of where a key
    lives would let two holders take it on two servers."""


class AlreadyQueued(DflockError):
    """A task sent with ``lock_from="publish"`` and ``on_duplicate="raise"`` was not sent: its
    key is held by another task, queued or running.

    ``task_id`` is the holder's task id (``AsyncResult(task_id)`` follows it; None when the
    holder left no task id, e.g. a lock taken outside Celery), ``key`` the lock key.
    """

    def __init__(self, message: str, *, task_id: str | None = None, key: str = "") -> None:
        super().__init__(message)
        self.task_id = task_id
        self.key = key

    def __reduce__(self) -> tuple[object, ...]:  # (a result backend, a pool child)
        return (_already_queued, (str(self), self.task_id, self.key))


def _already_queued(message: str, task_id: str | None, key: str) -> AlreadyQueued:
    return AlreadyQueued(message, task_id=task_id, key=key)
