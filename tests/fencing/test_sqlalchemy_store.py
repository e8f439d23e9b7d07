"""`celery_dflock.fencing.sqlalchemy` against a real PostgreSQL (a schema of each test's own),
and MariaDB where its isolation differs."""

from __future__ import annotations

import pickle
import re
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from celery_dflock import LockLost
from celery_dflock.client.errors import InvalidValueError
from celery_dflock.fencing import FenceMissing, StaleFence, sqlalchemy_aio
from celery_dflock.fencing.sqlalchemy import add_fence_column, fenced_update, fenced_upsert
from tests.fencing.stores import (
    ACCOUNTS,
    METADATA,
    async_engine_for,
    mariadb_engine,
    postgres_database,
    sqlalchemy_url,
)
from tests.support.services import require_mariadb


def row(engine: sa.Engine, account: int) -> tuple[int, int]:
    with engine.connect() as db:
        found = db.execute(
            sa.select(ACCOUNTS.c.balance, ACCOUNTS.c.dflock_fence).where(ACCOUNTS.c.id == account)
        ).one()
    return int(found[0]), int(found[1])


def credit(engine: sa.Engine, account: int, fence: int | None, amount: int = 1) -> int:
    with engine.begin() as db:
        return fenced_update(
            db,
            ACCOUNTS,
            ACCOUNTS.c.id == account,
            fence=fence,
            values={"balance": ACCOUNTS.c.balance + amount},
        )


@pytest.fixture
def account(engine: sa.Engine) -> int:
    with engine.begin() as db:
        db.execute(sa.insert(ACCOUNTS).values(id=7, balance=0))  # dflock_fence: its default 0
    return 7


def test_a_write_with_a_fence_at_least_the_rows_lands_and_keeps_it(
    engine: sa.Engine, account: int
) -> None:
    assert row(engine, account) == (0, 0)
    assert credit(engine, account, 100) == 1
    assert credit(engine, account, 100) == 1  # the same holder writes again: accepted
    assert credit(engine, account, 250) == 1
    assert row(engine, account) == (3, 250)


def test_a_lower_fence_is_refused_and_nothing_is_written(engine: sa.Engine, account: int) -> None:
    credit(engine, account, 250)
    with pytest.raises(StaleFence, match=r"fence 249 is lower than 250") as refused:
        credit(engine, account, 249, amount=1000)
    assert row(engine, account) == (1, 250)
    assert refused.value.fence == 249 and refused.value.highest == 250
    assert "account.id = 7" in str(refused.value)
    assert isinstance(refused.value, LockLost)
    again = pickle.loads(pickle.dumps(refused.value))  # as Celery carries a task's failure
    assert (type(again), str(again), again.highest) == (StaleFence, str(refused.value), 250)


def test_a_write_without_a_fence_is_refused_and_nothing_is_written(
    engine: sa.Engine, account: int
) -> None:
    """``lock.fence`` is None on a lock server without fencing tokens: refused, not applied."""
    with pytest.raises(FenceMissing, match="carries no fence"):
        credit(engine, account, None, amount=1000)
    assert row(engine, account) == (0, 0)
    for bad in (True, "12", -1, 1 << 63):
        with pytest.raises(InvalidValueError, match="fence"):
            credit(engine, account, bad)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    assert row(engine, account) == (0, 0)


def test_a_row_that_is_not_there_updates_nothing(engine: sa.Engine, account: int) -> None:
    assert credit(engine, 8, 100) == 0


def test_the_orm_face_through_a_session(engine: sa.Engine, account: int) -> None:
    class Base(DeclarativeBase):
        pass

    class Account(Base):
        __tablename__ = "account"
        id: Mapped[int] = mapped_column(primary_key=True)
        balance: Mapped[int]
        dflock_fence: Mapped[int]

    with Session(engine) as session:
        loaded = session.get(Account, account)
        assert loaded is not None
        where = Account.id == account
        assert fenced_update(session, Account, where, fence=5, values={"balance": 9}) == 1
        session.commit()
        assert (loaded.balance, loaded.dflock_fence) == (9, 5)
        with pytest.raises(StaleFence):
            fenced_update(session, Account, Account.id == account, fence=4, values={"balance": 0})
        session.rollback()
        assert row(engine, account) == (9, 5)
        loaded = session.get(Account, account)
        assert loaded is not None and loaded.dflock_fence == 5
        # Another holder writes behind the session's back: by the session's stale view of the
        # row (fence 5) a write with fence 260 passes; the database refuses it, and the
        # session's object is left as it was, not updated from that view.
        credit(engine, account, 300)
        with pytest.raises(StaleFence, match="fence 260 is lower than 300"):
            fenced_update(session, Account, where, fence=260, values={"balance": -1})
        assert (loaded.balance, loaded.dflock_fence) == (9, 5)
        session.rollback()
    assert row(engine, account) == (10, 300)


def test_add_fence_column_to_a_table_that_exists(engine: sa.Engine) -> None:
    table = sa.Table(
        "legacy",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("v", sa.Text),
    )
    with engine.begin() as db:
        table.create(db)
        db.execute(sa.insert(table).values(id=1, v="old"))
    with engine.begin() as db:
        assert add_fence_column(db, table) is True
        assert add_fence_column(db, table) is False
    fenced = sa.Table("legacy", sa.MetaData(), autoload_with=engine)
    with engine.begin() as db:
        assert db.execute(sa.select(fenced.c.dflock_fence)).scalar() == 0
        assert fenced_update(db, fenced, fenced.c.id == 1, fence=3, values={"v": "new"}) == 1


def test_values_that_set_the_fence_column_are_refused(engine: sa.Engine, account: int) -> None:
    """``values`` naming the fence column moved the row's fence to its number, back included
    (fence 20 wrote 1), so that any stale holder's write was accepted next."""
    credit(engine, account, 20)
    by_name_or_column: list[Any] = [{"dflock_fence": 1}, {ACCOUNTS.c.dflock_fence: 1}]
    for values in by_name_or_column:
        with engine.begin() as db, pytest.raises(ValueError, match="'dflock_fence' holds the"):
            fenced_update(db, ACCOUNTS, ACCOUNTS.c.id == account, fence=20, values=values)
        with engine.begin() as db, pytest.raises(ValueError, match="'dflock_fence' holds the"):
            fenced_upsert(
                db,
                ACCOUNTS,
                key={"id": account},
                fence=20,
                values={"balance": 0},
                update=values,
            )
    assert row(engine, account) == (1, 20)


def test_a_value_for_no_column_names_the_table_and_its_columns(
    engine: sa.Engine, account: int
) -> None:
    """A misspelt column in ``values`` raised SQLAlchemy's ``CompileError: Unconsumed column
    names: balanse``, naming no table, through a connection and through an ORM session."""

    class Base(DeclarativeBase):
        pass

    class Account(Base):
        __tablename__ = "account"
        id: Mapped[int] = mapped_column(primary_key=True)
        balance: Mapped[int]
        dflock_fence: Mapped[int]

    said = (
        "fenced update of account where account.id = 7: values name balanse, which is no "
        "column of table 'account' (its columns: id, balance, dflock_fence); "
    )
    with engine.begin() as db, pytest.raises(InvalidValueError, match=re.escape(said)):
        fenced_update(db, ACCOUNTS, ACCOUNTS.c.id == account, fence=3, values={"balanse": 1})
    with Session(engine) as session, pytest.raises(InvalidValueError, match=re.escape(said)):
        fenced_update(session, Account, Account.id == account, fence=3, values={"balanse": 1})
    assert row(engine, account) == (0, 0)


@pytest.mark.parametrize("where", [None, False, True])
def test_a_where_that_is_no_sql_condition_is_refused(
    engine: sa.Engine, account: int, where: object
) -> None:
    """None (and a bool, as ``row.id == 7`` on a loaded row gives) updated no row and returned 0,
    as for a row that is not there, or (True) every row of the table."""
    with engine.begin() as db, pytest.raises(InvalidValueError, match=f"where is {where},"):
        fenced_update(db, ACCOUNTS, where, fence=5, values={"balance": 9})  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
    assert row(engine, account) == (0, 0)


@pytest.fixture(params=["postgresql", "mariadb"])
def server_engine(request: pytest.FixtureRequest) -> Iterator[sa.Engine]:
    """An engine with the ``account`` table on a database server, at its default isolation
    (PostgreSQL's read committed, MariaDB's repeatable read)."""
    if request.param == "postgresql":
        yield request.getfixturevalue("engine")
        return
    require_mariadb()
    with mariadb_engine() as made:
        yield made


def test_a_stale_update_after_a_read_in_its_transaction_is_refused(
    server_engine: sa.Engine,
) -> None:
    """A paused holder that read the row in its transaction, then wrote once a later holder
    had: under MariaDB's repeatable read, the check of the refused ``UPDATE`` read the row's
    fence from the transaction's snapshot, older than the later holder's, so the call
    returned 0, as for a row that is not there, and the run went on as if nothing refused it."""
    with server_engine.begin() as db:
        db.execute(sa.insert(ACCOUNTS).values(id=7, balance=0))
    with server_engine.connect() as paused, paused.begin():
        paused.execute(sa.select(ACCOUNTS.c.balance).where(ACCOUNTS.c.id == 7)).one()
        assert credit(server_engine, 7, 250, amount=100) == 1  # the later holder, committed
        with pytest.raises(StaleFence, match=r"fence 249 is lower than 250"):
            fenced_update(paused, ACCOUNTS, ACCOUNTS.c.id == 7, fence=249, values={"balance": 1000})
    assert row(server_engine, 7) == (100, 250)


@pytest.fixture
def follower() -> Iterator[sa.Engine]:
    """An engine on a PostgreSQL database of this test's own with the ``account`` table,
    standing for a follower (a read replica) of the ``engine`` fixture's that lags; dropped
    after."""
    with postgres_database() as name:
        made = sa.create_engine(sa.make_url(sqlalchemy_url()).set(database=name))
        try:
            METADATA.create_all(made)
            yield made
        finally:
            made.dispose()


def reading_from(follower: sa.Engine, leader: sa.Engine) -> type[Session]:
    """A Session of SQLAlchemy's read/write splitting recipe (its docs' ``RoutingSession``):
    writes and flushes go to ``leader``, anything else (a ``SELECT``) to ``follower``."""

    class RoutingSession(Session):
        def get_bind(self, mapper: Any = None, clause: Any = None, **kw: Any) -> sa.Engine:
            if self._flushing or isinstance(clause, sa.Update | sa.Insert | sa.Delete):
                return leader
            return follower

    return RoutingSession


def test_a_refusal_is_told_from_no_row_on_the_database_written_not_a_lagging_follower(
    engine: sa.Engine, account: int, follower: sa.Engine
) -> None:
    """Through a Session that sends writes to the leader and reads to a follower, the check
    of a refused ``UPDATE`` read the follower: a stale write to a row whose copy there was
    older, or not there yet, returned 0, as for a row that is not there, and a row deleted
    from the leader but not yet from the follower raised `StaleFence` for a fence the leader
    never held; a refused upsert of a row whose copy there was older returned as if written,
    and of one not there yet raised `InvalidValueError` (a collision on another key)."""

    class Base(DeclarativeBase):
        pass

    class Account(Base):
        __tablename__ = "account"
        id: Mapped[int] = mapped_column(primary_key=True)
        balance: Mapped[int]
        dflock_fence: Mapped[int]

    credit(engine, account, 250)  # the leader's row 7
    with engine.begin() as db:  # not on the follower yet
        db.execute(sa.insert(ACCOUNTS).values(id=8, balance=1, dflock_fence=250))
    with follower.begin() as db:  # an older row 7, and a row 9 deleted from the leader since
        db.execute(sa.insert(ACCOUNTS).values(id=account, balance=0, dflock_fence=100))
        db.execute(sa.insert(ACCOUNTS).values(id=9, balance=0, dflock_fence=300))
    stale = r"fence 249 is lower than 250"
    with reading_from(follower, engine)() as session:
        for pk in (account, 8):
            with pytest.raises(StaleFence, match=stale):
                fenced_update(session, ACCOUNTS, ACCOUNTS.c.id == pk, fence=249, values={})
            with pytest.raises(StaleFence, match=stale):  # the ORM face: the update's mapper
                fenced_update(session, Account, Account.id == pk, fence=249, values={})
            with pytest.raises(StaleFence, match=stale):
                fenced_upsert(session, ACCOUNTS, key={"id": pk}, fence=249, values={})
        assert fenced_update(session, ACCOUNTS, ACCOUNTS.c.id == 9, fence=5, values={}) == 0
        session.commit()
    assert [row(engine, pk) for pk in (account, 8)] == [(1, 250), (1, 250)]
    assert [row(follower, pk) for pk in (account, 9)] == [(0, 100), (0, 300)]


async def test_the_async_face_checks_a_refusal_on_the_database_written_too(
    pg_schema: str, engine: sa.Engine, account: int, follower: sa.Engine
) -> None:
    """The asyncio face runs the blocking one on the ``AsyncSession``'s Session (its
    ``sync_session_class``, routing as above): it read the follower's older row, so the
    refused update returned 0 and the refused upsert returned as if it had written."""
    credit(engine, account, 250)
    with follower.begin() as db:  # an older row 7
        db.execute(sa.insert(ACCOUNTS).values(id=account, balance=0, dflock_fence=100))
    leader = async_engine_for(pg_schema)
    lagging = create_async_engine(follower.url.set(drivername="postgresql+psycopg_async"))
    routing = reading_from(lagging.sync_engine, leader.sync_engine)
    where = ACCOUNTS.c.id == account
    try:
        async with AsyncSession(sync_session_class=routing) as session:
            with pytest.raises(StaleFence, match=r"fence 249 is lower than 250"):
                await sqlalchemy_aio.fenced_update(session, ACCOUNTS, where, fence=249, values={})
            with pytest.raises(StaleFence, match=r"fence 249 is lower than 250"):
                await sqlalchemy_aio.fenced_upsert(
                    session, ACCOUNTS, key={"id": account}, fence=249, values={}
                )
    finally:
        await leader.dispose()
        await lagging.dispose()
    assert (row(engine, account), row(follower, account)) == ((1, 250), (0, 100))


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
@pytest.mark.parametrize("fence", [249, 300])
def test_under_postgresql_snapshot_isolation_an_overtaken_write_fails_as_the_database_says(
    engine: sa.Engine, isolation: str, fence: int
) -> None:
    """docs/fencing.md ("Isolation levels"): under PostgreSQL's repeatable read or serializable,
    a write to a row another transaction wrote after this one's snapshot is refused by the
    database itself, with its serialization failure (SQLSTATE 40001), whatever the fences:
    nothing is written, and the transaction, run again, gets `StaleFence` for a lower fence and
    writes with a higher one."""
    with engine.begin() as db:
        db.execute(sa.insert(ACCOUNTS).values(id=7, balance=0))
    snapshot = engine.execution_options(isolation_level=isolation)
    values = {"balance": ACCOUNTS.c.balance + 1}
    with snapshot.connect() as paused:
        with pytest.raises(OperationalError) as refused, paused.begin():
            paused.execute(sa.select(ACCOUNTS.c.balance).where(ACCOUNTS.c.id == 7)).one()
            assert credit(engine, 7, 250, amount=100) == 1  # another holder, committed
            fenced_update(paused, ACCOUNTS, ACCOUNTS.c.id == 7, fence=fence, values=values)
        assert getattr(refused.value.orig, "sqlstate", None) == "40001", refused.value
        assert row(engine, 7) == (100, 250)
        with paused.begin():  # run again
            if fence < 250:
                with pytest.raises(StaleFence, match=rf"fence {fence} is lower than 250"):
                    fenced_update(paused, ACCOUNTS, ACCOUNTS.c.id == 7, fence=fence, values=values)
            else:
                assert (
                    fenced_update(paused, ACCOUNTS, ACCOUNTS.c.id == 7, fence=fence, values=values)
                    == 1
                )
    assert row(engine, 7) == ((100, 250) if fence < 250 else (101, fence))
