"""Shared by the test apps: settings from the environment, the run log, readiness.

A worker subprocess gets its whole Celery configuration as JSON in
``DFLOCK_TEST_SETTINGS`` (broker, backend, queue, ``dflock_*``), so one app
module serves every test. Task bodies call :func:`record`, which appends one
JSON line to the file named by ``DFLOCK_TEST_LOG`` (``O_APPEND``: lines from
concurrent processes never interleave) and sends the same line as a datagram
to the test's socket ``DFLOCK_TEST_EVENTS`` so the test can wait for it
instead of sleeping.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from typing import Any

from celery import Celery
from celery.signals import worker_ready

SETTINGS_ENV = "DFLOCK_TEST_SETTINGS"
LOG_ENV = "DFLOCK_TEST_LOG"
EVENTS_ENV = "DFLOCK_TEST_EVENTS"
WORKER_ENV = "DFLOCK_TEST_WORKER"


def settings_from_env() -> dict[str, Any]:
    raw = os.environ.get(SETTINGS_ENV)
    return json.loads(raw) if raw else {}


def make_app(name: str, settings: dict[str, Any] | None = None, **kwargs: Any) -> Celery:
    """A Celery app configured from ``settings`` (default: the environment)."""
    app = Celery(name, set_as_current=False, **kwargs)
    app.conf.update(settings if settings is not None else settings_from_env())
    return app


def _send_event(line: bytes) -> None:
    path = os.environ.get(EVENTS_ENV)
    if not path:
        return
    # OSError: the test stopped listening (the log file still has the line).
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock, contextlib.suppress(OSError):
        sock.sendto(line, path)


def record(event: str, **fields: Any) -> None:
    """Append ``{"event": event, "pid": ..., "t": ..., **fields}`` to the run log."""
    entry = {
        "event": event,
        "pid": os.getpid(),
        "worker": os.environ.get(WORKER_ENV, ""),
        "t": time.time(),
        **fields,
    }
    line = (json.dumps(entry, default=str) + "\n").encode()
    path = os.environ.get(LOG_ENV)
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    _send_event(line)


@worker_ready.connect
def _announce_ready(sender: Any = None, **_: Any) -> None:
    record("worker_ready")
