# pyright: reportMissingTypeStubs=false
"""Run the python blocks of one docs page, in order, in one namespace, against a real server.

    python tests/docs/run_doc_page.py docs/locked-tasks.md 127.0.0.1:PORT

Started by tests/docs/test_docs_examples.py in a fresh process per page (a page's tasks and
signal receivers stay out of the test process). The preamble, the only thing added to a page:

* ``app``: a Celery app named ``proj``, for pages whose blocks configure an app they assume;
  ``store``: a store with ``write_if_newer(key, value, fence=...)`` that refuses older fences;
  ``log``: a logger.
* The addresses the examples name (``("127.0.0.1", 6388)``, ``"127.0.0.1:6388"``) become the
  test server's address.
* Every Celery app the page makes runs its tasks eagerly, with an in-memory broker and result
  backend, against the test server (no secret): ``celery.Celery`` is a subclass that sets this
  when an app is made, and it is set again after every block (blocks that change ``dflock_*``
  settings).
* Each block runs as a module of its own name (``docs_example_<n>``), so a page may define two
  tasks of one name, as two modules of a project would.
* The fenced stores' page (docs/fencing.md) gets real stores from its test, in the environment:
  ``DFLOCK_DOCS_POSTGRES_URL`` (a schema of the test's own) stands for the PostgreSQL URL the
  page names (``DFLOCK_DOCS_POSTGRES_ASYNC_URL`` for its async driver's),
  ``DFLOCK_DOCS_REDIS_URL`` for its Redis URL, and ``DFLOCK_DOCS_DJANGO_DATABASE`` (JSON)
  configures Django in the preamble, as a project's settings module would.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import celery
from celery import Celery

from celery_dflock.config import reset_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for ``tests``
from tests.docs.docs_blocks import blocks


class FencedStore:
    """Refuses a write whose fence is smaller than the largest it has accepted for the key."""

    def __init__(self) -> None:
        self.highest: dict[str, int] = {}

    def write_if_newer(self, key: str, value: object, *, fence: int | None) -> None:
        if fence is None or fence < self.highest.get(key, 0):
            raise RuntimeError(f"stale or missing fence {fence} for {key}")
        self.highest[key] = fence


STORES: dict[str, str] = {
    '"postgresql+psycopg://postgres@127.0.0.1:5432/test"': "DFLOCK_DOCS_POSTGRES_URL",
    '"postgresql+psycopg_async://postgres@127.0.0.1:5432/test"': "DFLOCK_DOCS_POSTGRES_ASYNC_URL",
    '"redis://127.0.0.1:6379/0"': "DFLOCK_DOCS_REDIS_URL",
}
"""A store's address as a page names it -> the variable that holds the test's own."""


def configure_django() -> None:
    """Django configured from ``DFLOCK_DOCS_DJANGO_DATABASE``, when the test sets it."""
    database = os.environ.get("DFLOCK_DOCS_DJANGO_DATABASE")
    if database is None:
        return
    import django
    from django.conf import settings

    settings.configure(
        DATABASES={"default": json.loads(database)},
        USE_TZ=True,
        DEFAULT_AUTO_FIELD="django.db.models.AutoField",
    )
    django.setup()


def main(page: str, address: str) -> int:
    host, _, port = address.rpartition(":")
    configure_django()
    overrides: dict[str, Any] = {
        "broker_url": "memory://",
        "result_backend": "cache+memory://",
        "task_always_eager": True,
        "task_store_eager_result": True,
        "dflock_servers": address,
        "dflock_auth_token": None,
    }

    def point_at_test_server(app: Celery) -> None:
        app.conf.update(overrides)
        reset_config(app)

    class DocsCelery(Celery):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            point_at_test_server(self)

    celery.Celery = DocsCelery  # what `from celery import Celery` in a block gets
    preamble_app = DocsCelery("proj", set_as_current=False)
    namespace: dict[str, Any] = {
        "__name__": "docs_example",
        "app": preamble_app,
        "store": FencedStore(),
        "log": logging.getLogger("docs_example"),
    }
    ran = 0
    for block in blocks(Path(page).resolve()):
        if block.lang != "python" or block.not_run:
            continue
        code = block.code.replace('("127.0.0.1", 6388)', f'("{host}", {port})').replace(
            '"127.0.0.1:6388"', f'"{address}"'
        )
        for named, variable in STORES.items():
            if variable in os.environ:
                code = code.replace(named, json.dumps(os.environ[variable]))
        print(f"--- {block.where}", flush=True)
        namespace["__name__"] = f"docs_example_{ran}"
        exec(compile(code, block.where, "exec"), namespace)
        ran += 1
        for value in list(namespace.values()):
            if isinstance(value, Celery):
                point_at_test_server(value)
    print(f"ran {ran} block(s)")
    close_stores(namespace)
    return 0


def close_stores(namespace: dict[str, Any]) -> None:
    """Close what a page opened to its stores (SQLAlchemy's pools, Django's connections), so
    that none is left to the garbage collector at exit."""
    if "sqlalchemy" in sys.modules:
        from sqlalchemy import Engine

        for value in namespace.values():
            if isinstance(value, Engine):
                value.dispose()
    if "django.db" in sys.modules:
        from django.db import connections

        connections.close_all()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
