# pyright: reportMissingTypeStubs=false, reportUnknownVariableType=false, reportUnknownMemberType=false
"""Celery's objects as the integration uses them, typed ``Any``: the one place where Celery's
untyped names enter the strictly typed package; and the two loggers a run writes to."""

from __future__ import annotations

from typing import Any, Final

from celery import Task as _Task, exceptions as _exceptions, signals as _signals
from celery._state import _task_stack as _stack  # pyright: ignore[reportPrivateUsage]
from celery.utils.dispatch import Signal as _Signal
from celery.utils.log import get_logger as _get_logger, get_task_logger as _get_task_logger
from celery.utils.time import get_exponential_backoff_interval as _backoff_interval
from celery.worker.control import inspect_command as _inspect_command

BaseTask: Final[Any] = _Task  # for calling celery.Task's methods from overrides
signals: Final[Any] = _signals
Signal: Final[Any] = _Signal
task_stack: Final[Any] = _stack  # Celery's running tasks (current_task), pushed by direct calls
Reject: Final[Any] = _exceptions.Reject
Retry: Final[Any] = _exceptions.Retry
backoff_interval: Final[Any] = _backoff_interval
TimeLimitExceeded: Final[type[Exception]] = _exceptions.TimeLimitExceeded
WorkerLostError: Final[type[Exception]] = _exceptions.WorkerLostError
get_logger: Final[Any] = _get_logger
inspect_command: Final[Any] = _inspect_command
task_logger: Final[Any] = _get_task_logger("celery_dflock.task")
"""For what a run logs while it runs (Celery prefixes it with ``name[id]``)."""
worker_logger: Final[Any] = _get_logger("celery_dflock.worker")
"""For the renewal thread, where Celery's task prefix would read ``???[???]``."""
