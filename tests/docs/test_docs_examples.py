"""Every python block of the docs pages and the README runs, as written, against a real lock
server (in eager mode: see run_doc_page.py for the small preamble). Blocks that cannot run alone
are marked ``<!-- not-run: reason -->`` and must name the test that runs them instead."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflockd_server.testing import ServerThread
from tests.docs.docs_blocks import README, ROOT, blocks, pages
from tests.fencing.stores import (
    STORE_REDIS_URL,
    create_schema,
    django_database,
    drop_schema,
    new_schema_name,
    sqlalchemy_url,
)
from tests.support.services import require_postgres, require_redis

RUNNER = Path(__file__).with_name("run_doc_page.py")
PAGES_WITH_PYTHON = [p for p in [*pages(), README] if any(b.lang == "python" for b in blocks(p))]


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.fixture
def fencing_stores() -> Iterator[dict[str, str]]:
    """docs/fencing.md's stores: a PostgreSQL schema of this run's own, and Redis."""
    require_postgres()
    require_redis()
    schema = new_schema_name()
    create_schema(schema, tables=False)
    try:
        yield {
            "DFLOCK_DOCS_POSTGRES_URL": sqlalchemy_url(schema),
            "DFLOCK_DOCS_POSTGRES_ASYNC_URL": sqlalchemy_url(schema).replace(
                "postgresql+psycopg://", "postgresql+psycopg_async://"
            ),
            "DFLOCK_DOCS_REDIS_URL": STORE_REDIS_URL,
            "DFLOCK_DOCS_DJANGO_DATABASE": json.dumps(django_database(schema)),
        }
    finally:
        drop_schema(schema)


@pytest.mark.parametrize("page", PAGES_WITH_PYTHON, ids=_id)
def test_the_python_blocks_of_a_page_run(
    page: Path, dflock_server: ServerThread, request: pytest.FixtureRequest
) -> None:
    runnable = [b for b in blocks(page) if b.lang == "python" and not b.not_run]
    stores: dict[str, str] = {}
    if page.name == "fencing.md":  # the one page that writes to real stores
        stores = request.getfixturevalue("fencing_stores")
    done = subprocess.run(
        [
            sys.executable,
            "-W",
            "error",
            str(RUNNER),
            str(page),
            f"{dflock_server.host}:{dflock_server.port}",
        ],
        cwd=ROOT,
        env={**os.environ, **stores},
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"ran {len(runnable)} block(s)" in done.stdout


def test_every_block_not_run_names_the_test_that_runs_it() -> None:
    for page in [*pages(), README]:
        for block in blocks(page):
            if block.not_run is None:
                continue
            named = re.findall(r"tests/[\w/]+\.py", block.not_run)
            assert named, f"{block.where}: a not-run block must name the test that runs it"
            for path in named:
                assert (ROOT / path).is_file(), f"{block.where}: {path} does not exist"


def test_the_docs_have_runnable_examples() -> None:
    """Guards the extraction itself: a broken fence regex would make every test above pass."""
    names = {p.name for p in PAGES_WITH_PYTHON}
    pages_known = {"README.md", "locked-tasks.md", "client.md", "getting-started.md", "fencing.md"}
    assert pages_known <= names
