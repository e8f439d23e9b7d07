"""`celery_dflock.fencing.sqlalchemy.fenced_upsert` against real databases: PostgreSQL (a schema
of each test's own), SQLite (a file of its own) and MariaDB (a database of its own), each
through its own upsert; and what a naive upsert does instead (docs/fencing.md warns of it)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.exc import ProgrammingError
from sqlalchemy.orm import (
    DeclarativeBase,
    Mapped,
    Session,
    mapped_column,
    scoped_session,
    sessionmaker,
)

from celery_dflock.client.errors import InvalidValueError
from celery_dflock.fencing import FenceMissing, StaleFence
from celery_dflock.fencing.sqlalchemy import fence_column, fenced_update, fenced_upsert
from tests.fencing.stores import ACCOUNTS, METADATA, mariadb_engine
from tests.support.services import require_mariadb


@pytest.fixture(params=["postgresql", "sqlite", "mariadb"])
def any_engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sa.Engine]:
    """An engine with the ``account`` table, on each database whose upsert is written."""
    if request.param == "postgresql":
        yield request.getfixturevalue("engine")
    elif request.param == "sqlite":
        made = sa.create_engine(f"sqlite:///{tmp_path / 'fenced.db'}")
        METADATA.create_all(made)
        try:
            yield made
        finally:
            made.dispose()
    else:
        require_mariadb()
        with mariadb_engine() as made:
            yield made


def row(engine: sa.Engine, account: int) -> tuple[int, int] | None:
    with engine.connect() as db:
        found = db.execute(
            sa.select(ACCOUNTS.c.balance, ACCOUNTS.c.dflock_fence).where(ACCOUNTS.c.id == account)
        ).one_or_none()
    return None if found is None else (int(found[0]), int(found[1]))


def credit(engine: sa.Engine, account: int, fence: int | None, amount: int = 1) -> None:
    """Insert the account with ``amount``, or add ``amount`` to it: an upsert with an update
    over the row's own column."""
    with engine.begin() as db:
        fenced_upsert(
            db,
            ACCOUNTS,
            key={"id": account},
            fence=fence,
            values={"balance": amount},
            update={"balance": ACCOUNTS.c.balance + amount},
        )


def test_an_upsert_inserts_then_updates_only_under_a_fence_not_lower(
    any_engine: sa.Engine,
) -> None:
    assert row(any_engine, 7) is None
    credit(any_engine, 7, 100, amount=5)
    assert row(any_engine, 7) == (5, 100)
    credit(any_engine, 7, 100)  # the same holder again: accepted
    credit(any_engine, 7, 250)
    assert row(any_engine, 7) == (7, 250)
    with pytest.raises(StaleFence, match=r"its fence 249 is lower than 250") as refused:
        credit(any_engine, 7, 249, amount=1000)
    assert "account row id=7" in str(refused.value)
    assert row(any_engine, 7) == (7, 250)
    with pytest.raises(FenceMissing, match="carries no fence"):
        credit(any_engine, 8, None)
    assert row(any_engine, 8) is None


def test_the_upserts_fence_never_goes_back(any_engine: sa.Engine) -> None:
    """Fences in a shuffled order, each written as the whole row (``values`` alone): after
    each write the row holds the highest fence so far and that write's value; each lower one
    raised `StaleFence`."""
    fences = list(range(1, 41))
    random.Random(72).shuffle(fences)
    highest = 0
    for fence in fences:
        try:
            with any_engine.begin() as db:
                fenced_upsert(db, ACCOUNTS, key={"id": 1}, fence=fence, values={"balance": fence})
        except StaleFence as refused:
            assert fence < highest and refused.highest == highest
        else:
            assert fence > highest
            highest = fence
        assert row(any_engine, 1) == (highest, highest)
    assert highest == 40


def test_a_naive_upsert_moves_the_fence_back_and_a_guarded_one_refuses_in_silence(
    engine: sa.Engine,
) -> None:
    """What docs/fencing.md warns against, on PostgreSQL: a plain ``ON CONFLICT DO UPDATE``
    writes a stale run's value and fence over a later one's; with ``WHERE dflock_fence <=
    :fence`` it writes nothing but raises nothing either, so the stale run goes on as if it had
    written. `fenced_upsert` refuses it with `StaleFence`, and the row keeps the later fence."""
    credit(engine, 3, 250, amount=10)

    stale = postgresql.insert(ACCOUNTS).values(id=3, balance=0, dflock_fence=249)
    assigned = {"balance": stale.excluded.balance, "dflock_fence": stale.excluded.dflock_fence}
    naive = stale.on_conflict_do_update(index_elements=[ACCOUNTS.c.id], set_=assigned)
    with engine.begin() as db:
        db.execute(naive)
    assert row(engine, 3) == (0, 249)  # the stale run's write, and the fence moved back

    credit(engine, 3, 250, amount=10)
    guarded = stale.on_conflict_do_update(
        index_elements=[ACCOUNTS.c.id],
        set_=assigned,
        where=ACCOUNTS.c.dflock_fence <= stale.excluded.dflock_fence,
    )
    with engine.begin() as db:
        db.execute(guarded)  # refused, and nothing says so
    assert row(engine, 3) == (10, 250)

    with pytest.raises(StaleFence, match="its fence 249 is lower than 250"):
        credit(engine, 3, 249, amount=1000)
    assert row(engine, 3) == (10, 250)


def test_the_orm_face_through_a_session(engine: sa.Engine) -> None:
    class Base(DeclarativeBase):
        pass

    class Account(Base):
        __tablename__ = "account"
        id: Mapped[int] = mapped_column(primary_key=True)
        balance: Mapped[int]
        dflock_fence: Mapped[int]

    with Session(engine) as session:
        fenced_upsert(session, Account, key={"id": 5}, fence=20, values={"balance": 2})
        session.commit()
        with pytest.raises(StaleFence, match="its fence 19 is lower than 20"):
            fenced_upsert(session, Account, key={"id": 5}, fence=19, values={"balance": 9})
        session.rollback()
    assert row(engine, 5) == (2, 20)
    scoped = scoped_session(sessionmaker(engine))  # as Flask-SQLAlchemy's db.session
    try:
        fenced_upsert(scoped, Account, key={"id": 5}, fence=21, values={"balance": 3})
        scoped.commit()
    finally:
        scoped.remove()
    assert row(engine, 5) == (3, 21)


def test_bad_arguments_are_named(engine: sa.Engine) -> None:
    with engine.begin() as db:
        with pytest.raises(ValueError, match="the column 'dflock_fence' holds the fence"):
            fenced_upsert(db, ACCOUNTS, key={"id": 1}, fence=1, values={"dflock_fence": 9})
        with pytest.raises(ValueError, match="key names no column"):
            fenced_upsert(db, ACCOUNTS, key={}, fence=1, values={"balance": 1})
        with pytest.raises(ValueError, match="key names nope, which is no column of table 'ac"):
            fenced_upsert(db, ACCOUNTS, key={"nope": 1}, fence=1, values={"balance": 1})
        # NULL conflicts with no row: each call inserted a new row, which no fence guards
        with pytest.raises(InvalidValueError, match="key id is None"):
            fenced_upsert(db, ACCOUNTS, key={"id": None}, fence=1, values={"balance": 1})
        # the key's own column in values: the key's value was written, the other dropped
        with pytest.raises(InvalidValueError, match="values give the key's id another value"):
            fenced_upsert(db, ACCOUNTS, key={"id": 1}, fence=1, values={"id": 2, "balance": 1})
        # with an expression for it in values: comparing the two raised SQLAlchemy's
        # "TypeError: Boolean value of this clause is not defined" (`expr != None`)
        with pytest.raises(InvalidValueError, match="key id is None"):
            values = {"id": sa.literal(1) + 1, "balance": 1}
            fenced_upsert(db, ACCOUNTS, key={"id": None}, fence=1, values=values)
    assert row(engine, 1) is None and row(engine, 2) is None
    with engine.begin() as db:  # the key's own value again in values: the same row
        fenced_upsert(db, ACCOUNTS, key={"id": 1}, fence=1, values={"id": 1, "balance": 1})
    assert row(engine, 1) == (1, 1)


def test_a_value_for_no_column_is_named(engine: sa.Engine) -> None:
    """A misspelt column in ``values`` (or ``update``) raised a bare ``KeyError: 'balanse'``."""
    with engine.begin() as db:
        for values, update in (({"balanse": 1}, None), ({"balance": 1}, {"balanse": 2})):
            with pytest.raises(ValueError, match=r"row id=1: no column balanse in values or upd"):
                fenced_upsert(db, ACCOUNTS, key={"id": 1}, fence=1, values=values, update=update)
    assert row(engine, 1) is None


def test_an_upsert_that_collides_on_another_unique_key_is_not_silent() -> None:
    """MariaDB's ``ON DUPLICATE KEY UPDATE`` takes a conflict on any unique key: a row of a new
    ``key`` whose unique ``email`` another row holds updated that other row (under its fence)
    or, refused by its fence, wrote nothing; either way the call returned as if it had written
    the row of ``key``."""
    require_mariadb()
    users = sa.Table(
        "users",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("email", sa.String(40), unique=True),
        sa.Column("n", sa.Integer, nullable=False),
        fence_column(),
    )
    with mariadb_engine() as engine:
        with engine.begin() as db:
            users.create(db)
            db.execute(sa.insert(users).values(id=3, email="a@x", n=0, dflock_fence=100))
        for fence in (50, 150):  # refused by the other row's fence; accepted by it
            with engine.begin() as db, pytest.raises(InvalidValueError, match="another row"):
                fenced_upsert(
                    db, users, key={"id": 7}, fence=fence, values={"email": "a@x", "n": 1}
                )
        with engine.connect() as db:
            assert db.execute(sa.select(users)).all() == [(3, "a@x", 0, 100)]


@pytest.mark.parametrize("any_engine", ["postgresql"], indirect=True)
def test_another_error_of_an_upsert_is_the_databases_own(any_engine: sa.Engine) -> None:
    """PostgreSQL quotes the statement around an error: one in its ``ON CONFLICT ... DO
    UPDATE`` part (a function that does not exist) was named a key that is no unique key."""
    update = {"balance": sa.func.lower(ACCOUNTS.c.balance)}
    with any_engine.begin() as db, pytest.raises(ProgrammingError, match="lower"):
        fenced_upsert(db, ACCOUNTS, key={"id": 9}, fence=5, values={"balance": 1}, update=update)


@pytest.mark.parametrize("any_engine", ["postgresql", "sqlite"], indirect=True)
def test_an_upsert_whose_key_is_no_unique_key_is_named(any_engine: sa.Engine) -> None:
    """PostgreSQL and SQLite refuse ``ON CONFLICT`` on columns that are no unique key: the
    refusal names the key's columns and what to do (it was the driver's raw error)."""
    with any_engine.begin() as db, pytest.raises(InvalidValueError) as refused:
        fenced_upsert(db, ACCOUNTS, key={"balance": 1}, fence=5, values={"id": 9})
    said = str(refused.value)
    assert "fenced upsert into account row balance=1: key names balance" in said
    assert "not the primary key or a unique key of the table" in said
    assert "ON CONFLICT" in said  # the database's own words
    assert row(any_engine, 9) is None


def test_a_row_whose_fence_is_null_is_not_passed_over_in_silence(engine: sa.Engine) -> None:
    """A fence column made nullable by hand: NULL compares with no fence, so the guarded write
    wrote nothing, and the update answered 0 (no such row), the upsert nothing at all."""
    with engine.begin() as db:
        db.execute(sa.text("ALTER TABLE account ALTER COLUMN dflock_fence DROP NOT NULL"))
        db.execute(sa.insert(ACCOUNTS).values(id=1, balance=0, dflock_fence=None))
    with engine.begin() as db, pytest.raises(InvalidValueError, match="holds NULL"):
        fenced_update(db, ACCOUNTS, ACCOUNTS.c.id == 1, fence=5, values={"balance": 1})
    with engine.begin() as db, pytest.raises(InvalidValueError, match="holds NULL"):
        fenced_upsert(db, ACCOUNTS, key={"id": 1}, fence=5, values={"balance": 1})
    with engine.begin() as db:
        assert fenced_update(db, ACCOUNTS, ACCOUNTS.c.id == 2, fence=5, values={}) == 0
    assert row_balance(engine, 1) == 0


def row_balance(engine: sa.Engine, account: int) -> int:
    with engine.connect() as db:
        return int(
            db.execute(sa.select(ACCOUNTS.c.balance).where(ACCOUNTS.c.id == account)).scalar_one()
        )
