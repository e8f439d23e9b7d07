"""The one Celery app factory of the tests: in-process apps of the tests, client apps beside
real workers, and the worker apps themselves (tests/celery/apps/, tests/faults/) all come from
:func:`make_app`.

Imports nothing but Celery at run time: worker subprocesses import it too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from celery import Celery

if TYPE_CHECKING:
    from dflockd_server.testing import ServerThread

IN_MEMORY: Mapping[str, Any] = {"broker_url": "memory://", "result_backend": "cache+memory://"}
"""Kombu's in-memory broker and the in-memory cache result backend: a test process alone."""


def make_app(
    main: str = "dflock-test",
    settings: Mapping[str, Any] | None = None,
    *,
    eager: bool = False,
    servers: ServerThread | Sequence[tuple[str, int]] | str | None = None,
    celery_kwargs: Mapping[str, Any] | None = None,
    **conf: Any,
) -> Celery:
    """A Celery app named ``main`` (never the current app), configured with ``settings`` and then
    ``conf``.

    ``eager``: tasks run in the calling process (``task_always_eager``) over :data:`IN_MEMORY`.
    ``servers``: the ``dflock_servers`` setting (a ``ServerThread`` stands for its address).
    ``celery_kwargs``: more arguments of ``Celery(...)`` itself (``task_cls=...``).
    """
    app = Celery(main, set_as_current=False, **(celery_kwargs or {}))
    values: dict[str, Any] = dict(settings or {})
    if eager:
        values.update(IN_MEMORY)
        values["task_always_eager"] = True
    if servers is not None:
        address = getattr(servers, "address", None)
        values["dflock_servers"] = [address] if address is not None else servers
    values.update(conf)
    app.conf.update(values)
    return app
