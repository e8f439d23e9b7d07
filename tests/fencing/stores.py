# pyright: reportMissingTypeStubs=false
"""The real stores of the fenced-write tests: a PostgreSQL schema of each test's own (other runs
share the database), the table both SQL faces write to, Redis, and (for the upserts of other
databases) MariaDB and SQLite.

Imported by the tests, by the worker app (``fencing_app``) and by the docs runner: PostgreSQL is
reached as ``POSTGRES_URL`` (``CELERY_DFLOCK_TEST_POSTGRES_URL``) with ``search_path`` set to
the schema, through SQLAlchemy (psycopg 3) or a Django configured in-process.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any, Final
from urllib.parse import quote, urlsplit

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from celery_dflock.fencing.sqlalchemy import fence_column
from tests.support.services import MARIADB_URL, POSTGRES_URL, redis_url

STORE_REDIS_URL: Final = redis_url("fenced_stores")
"""The Redis database of fenced keys (tests/fencing and docs/fencing.md's examples)."""
DJANGO_APP: Final = "tests.fencing"
"""The Django app of the tests' model (``tests/fencing/models.py``, table ``fencing_account``)."""

SQLITE_ALIAS: Final = "lite"
MARIADB_ALIAS: Final = "maria"
"""Django's aliases of the other upserts' databases (``default`` is PostgreSQL)."""
REPLICA_ALIAS: Final = "replica"
"""Django's alias of a PostgreSQL database standing for a lagging replica of ``default``."""

SCHEMA_ENV: Final = "DFLOCK_FENCING_SCHEMA"
"""The schema of the workers of ``fencing_app`` (the test module's own)."""
CREDIT: Final = "fencing.credit"
"""``fencing_app.credit``'s name, for ``send_task``."""

METADATA: Final = sa.MetaData()
ACCOUNTS: Final = sa.Table(
    "account",
    METADATA,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("balance", sa.BigInteger, nullable=False, server_default=sa.text("0")),
    fence_column(),
)
"""The SQLAlchemy face's table (Django's model has the same columns, in ``fencing_account``)."""


def redis_key(schema: str, account: int) -> str:
    """The Redis hash of ``account`` in the run of ``schema``."""
    return f"fencing-test:{schema}:{account}"


def new_schema_name() -> str:
    return f"fencing_{uuid.uuid4().hex[:12]}"


def sqlalchemy_url(schema: str | None = None) -> str:
    """``POSTGRES_URL`` for SQLAlchemy's psycopg 3 dialect, on ``schema`` when given."""
    url = POSTGRES_URL.replace("postgresql://", "postgresql+psycopg://", 1)
    if schema is None:
        return url
    return f"{url}{'&' if '?' in url else '?'}options={quote(f'-csearch_path={schema}')}"


def engine_for(schema: str | None = None) -> sa.Engine:
    return sa.create_engine(sqlalchemy_url(schema), pool_pre_ping=True)


def async_engine_for(schema: str) -> AsyncEngine:
    """An asyncio engine on ``schema`` (psycopg 3's async driver)."""
    url = sqlalchemy_url(schema).replace("postgresql+psycopg://", "postgresql+psycopg_async://")
    return create_async_engine(url)


@contextlib.contextmanager
def postgres_database() -> Iterator[str]:
    """The name of a PostgreSQL database of the caller's own (empty), dropped after with the
    connections still open to it."""
    name = new_schema_name()
    server = engine_for().execution_options(isolation_level="AUTOCOMMIT")
    try:
        with server.connect() as db:
            db.execute(sa.text(f'CREATE DATABASE "{name}"'))
        try:
            yield name
        finally:
            with server.connect() as db:
                db.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        server.dispose()


@contextlib.contextmanager
def mariadb_engine() -> Iterator[sa.Engine]:
    """An engine on a MariaDB database of the caller's own (``account`` in it), dropped after
    (pymysql)."""
    parts = urlsplit(MARIADB_URL)
    server = f"mysql+pymysql://{parts.netloc}"
    database = new_schema_name()
    admin = sa.create_engine(server)
    try:
        with admin.begin() as db:
            db.execute(sa.text(f"CREATE DATABASE `{database}`"))
        engine = sa.create_engine(f"{server}/{database}")
        try:
            METADATA.create_all(engine)
            yield engine
        finally:
            engine.dispose()
            with admin.begin() as db:
                db.execute(sa.text(f"DROP DATABASE IF EXISTS `{database}`"))
    finally:
        admin.dispose()


def create_schema(schema: str, *, tables: bool = True) -> None:
    """The schema, with (``tables``) the SQLAlchemy face's ``account`` and Django's
    ``fencing_account``."""
    engine = engine_for()
    try:
        with engine.begin() as db:
            db.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        if not tables:
            return
        scoped = engine_for(schema)
        try:
            METADATA.create_all(scoped)
            with scoped.begin() as db:
                db.execute(
                    sa.text(
                        "CREATE TABLE fencing_account (id integer PRIMARY KEY, "
                        "balance bigint NOT NULL DEFAULT 0, "
                        "dflock_fence bigint NOT NULL DEFAULT 0)"
                    )
                )
        finally:
            scoped.dispose()
    finally:
        engine.dispose()


def drop_schema(schema: str) -> None:
    engine = engine_for()
    try:
        with engine.begin() as db:
            db.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    finally:
        engine.dispose()


def django_database(schema: str | None) -> dict[str, Any]:
    """Django's ``DATABASES["default"]`` for ``POSTGRES_URL`` (on ``schema`` when given)."""
    parts = urlsplit(POSTGRES_URL)
    options = {} if schema is None else {"options": f"-c search_path={schema}"}
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parts.path.lstrip("/") or "test",
        "USER": parts.username or "postgres",
        "PASSWORD": parts.password or "",
        "HOST": parts.hostname or "127.0.0.1",
        "PORT": str(parts.port or 5432),
        "OPTIONS": options,
    }


def configure_django(schema: str | None) -> None:
    """Django configured in this process (once): the tests' app, PostgreSQL on ``schema``."""
    import django
    from django.conf import settings

    if settings.configured:
        return
    settings.configure(
        INSTALLED_APPS=[DJANGO_APP],
        DATABASES={
            "default": django_database(schema),
            # the other databases, pointed at a test's own when used
            # (``point_django_alias_at``): SQLite, a PostgreSQL replica, and MariaDB
            # through pymysql
            SQLITE_ALIAS: {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
            REPLICA_ALIAS: django_database(None),
            MARIADB_ALIAS: {
                "ENGINE": "django.db.backends.mysql",
                "NAME": urlsplit(MARIADB_URL).path.lstrip("/") or "test",
                "USER": urlsplit(MARIADB_URL).username or "root",
                "PASSWORD": urlsplit(MARIADB_URL).password or "",
                "HOST": urlsplit(MARIADB_URL).hostname or "127.0.0.1",
                "PORT": str(urlsplit(MARIADB_URL).port or 3306),
            },
        },
        USE_TZ=True,
        TIME_ZONE="UTC",
        DEFAULT_AUTO_FIELD="django.db.models.AutoField",
    )
    django.setup()


def point_django_alias_at(alias: str, name: str) -> None:
    """Django's connection ``alias``, from its next query on, on the database ``name`` (a
    SQLite file, a PostgreSQL or MariaDB database). For MariaDB, pymysql stands in for
    mysqlclient (which needs a compiler and the client's headers): it says it is the mysqlclient
    Django wants."""
    from django.db import connections

    if alias == MARIADB_ALIAS:
        import pymysql

        pymysql.version_info = (2, 2, 1, "final", 0)
        pymysql.install_as_MySQLdb()
    connection = connections[alias]
    connection.close()
    connection.settings_dict["NAME"] = name


@contextlib.contextmanager
def mariadb_database() -> Iterator[str]:
    """A MariaDB database of the caller's own, dropped after: its name."""
    with mariadb_engine() as engine:
        name = engine.url.database
        assert name is not None
        yield name


def point_django_at(schema: str) -> None:
    """Django's default connection, from its next query on, on ``schema``."""
    from django.db import connection

    connection.close()
    connection.settings_dict["OPTIONS"] = {"options": f"-c search_path={schema}"}
