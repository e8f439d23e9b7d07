"""The lost-lock guard of one locked run: what ``on_lock_lost`` does when the run's lock is
lost while its body runs (interrupt the body, flag it, or terminate the pool child), the
``lock_lost`` signal, and the log line.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any, cast

from celery_dflock._celery import get_logger
from celery_dflock._held_records import AnyLock, HeldRecord
from celery_dflock._interrupt import BodyTarget, current_body
from celery_dflock._lock_signals import lock_lost
from celery_dflock._request import run_name
from celery_dflock._runtime import Runtime
from celery_dflock._values import OnLockLost
from celery_dflock.client.errors import LockLost

__all__ = ["RunGuard"]

worker_logger: Any = get_logger("celery_dflock.worker")
"""For messages from the renewal thread, where Celery's task prefix would read ``???[???]``
(the message names the run itself)."""


class _Interrupted(LockLost):
    """Raised asynchronously in the body's thread by ``on_lock_lost="interrupt"``."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(args or ("the task's lock was lost while it ran",)))


class RunGuard:
    """One locked run: its lock, the body's thread, and the ``on_lock_lost`` policy."""

    def __init__(
        self,
        task: object,
        task_id: str | None,
        key: str,
        policy: OnLockLost,
        runtime: Runtime,
    ) -> None:
        self.task = task
        self.label = run_name(str(cast("Any", task).name), task_id)
        self.task_id = task_id
        self.key = key
        self.policy: OnLockLost = policy
        self.runtime = runtime
        self.lock: AnyLock | None = None
        self.record: HeldRecord | None = None
        self._state = threading.Lock()
        self._body: BodyTarget | None = None
        self._interrupt_sent = False
        self._interrupt_missed = False
        self._body_ended = False

    def on_lost(self, lock: Any) -> None:
        """Called once when the lock is lost: from the renewal thread, or from the release
        after the body if only the server's refusal to release shows it.

        An interrupt goes out first, before the log line and the signal (a body that polls
        ``lock.lost`` is stopped before it can act on it); a termination comes last, after
        them (it ends the process)."""
        policy = self.policy
        if policy == "terminate" and not self.runtime.in_pool_child:
            policy = "interrupt"  # only a prefork child can be replaced
        with self._state:
            ended = self._body_ended
        if policy == "interrupt" and not ended:
            self._interrupt()
        worker_logger.error(
            "dflock: %s lost its lock %r (fence %s)%s; on_lock_lost=%r",
            self.label,
            self.key,
            getattr(lock, "fence", None),
            " (noticed after its body ended)" if ended else "",
            policy,
        )
        lock_lost.send(
            sender=self.task, task_id=self.task_id, key=self.key, lock=lock, policy=policy
        )
        if self._interrupt_missed:
            worker_logger.error(
                "dflock: %s: the body could not be interrupted where it runs; "
                "it fails with LockLost when it returns",
                self.label,
            )
        if policy == "terminate" and not ended:
            if self.record is not None:
                self.record.remove()
            os.kill(os.getpid(), signal.SIGKILL)

    def _interrupt(self) -> None:
        with self._state:
            body = self._body
            if body is None or self._interrupt_sent:
                return
            self._interrupt_sent = True
            if not body.interrupt(_Interrupted):
                self._interrupt_missed = True

    @property
    def interrupt_due(self) -> bool:
        """An interrupt was sent (or could not be) while the body ran: a body that returned
        all the same must not count as a success."""
        return self._interrupt_sent

    def run_body(
        self,
        run: Callable[..., Any],
        call: tuple[tuple[Any, ...], dict[str, Any]],
        lock: AnyLock,
    ) -> Any:
        """``run(*args, **kwargs)`` in this thread, the target of an interrupt while it runs;
        an interrupt that reaches it ends it with `LockLost`."""
        try:
            with self.body():
                return run(*call[0], **call[1])
        except _Interrupted:
            raise LockLost(
                f"{self.label} lost its lock {self.key!r} (fence {lock.fence}) "
                f"while it ran, and was interrupted (on_lock_lost='interrupt')"
            ) from None

    def body(self) -> RunGuard:
        """``with guard.body():`` marks the body as running in this thread (the target of an
        interrupt) until the block ends."""
        return self

    def __enter__(self) -> None:
        body = current_body()
        with self._state:
            self._body = body

    def __exit__(self, *exc_info: object) -> None:
        with self._state:
            body, self._body = self._body, None
            self._body_ended = True
            if self._interrupt_sent and body is not None:
                body.cancel()  # not delivered yet: drop it
