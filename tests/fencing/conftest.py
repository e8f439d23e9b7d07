"""Fixtures of the fenced-write tests: a PostgreSQL schema of the test's own, an engine on it,
Django pointed at it, and Redis (keys named per test)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
import sqlalchemy as sa

from tests.fencing.stores import (
    STORE_REDIS_URL,
    configure_django,
    create_schema,
    drop_schema,
    engine_for,
    new_schema_name,
    point_django_at,
)
from tests.support.services import require_postgres, require_redis


@pytest.fixture
def pg_schema() -> Iterator[str]:
    """A schema of this test's own (``account`` and ``fencing_account`` in it), dropped after."""
    require_postgres()
    schema = new_schema_name()
    create_schema(schema)
    try:
        yield schema
    finally:
        drop_schema(schema)


@pytest.fixture
def engine(pg_schema: str) -> Iterator[sa.Engine]:
    made = engine_for(pg_schema)
    try:
        yield made
    finally:
        made.dispose()


@pytest.fixture
def django_schema(pg_schema: str) -> Iterator[str]:
    """Django configured in this process, its connection on this test's schema."""
    configure_django(None)
    point_django_at(pg_schema)
    try:
        yield pg_schema
    finally:
        from django.db import connection

        connection.close()


@pytest.fixture
def store_redis() -> Iterator[redis.Redis]:
    require_redis()
    client = redis.Redis.from_url(STORE_REDIS_URL)
    try:
        yield client
    finally:
        client.close()
