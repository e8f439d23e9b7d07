# pyright: reportAttributeAccessIssue=false, reportCallIssue=false, reportFunctionMemberAccess=false
# (Celery's @app.task is untyped: pyright takes a task for the plain function it decorates.)
"""What LockedTask works out once per task instead of per run still follows every change, and
the fast paths (argument binding, key checks, routing) agree exactly with the slow ones they
stand in for; a pool child's held-lock records are one file rewritten in place."""

from __future__ import annotations

import inspect
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from hypothesis import given, settings, strategies as st

from celery_dflock import LockedTask
from celery_dflock._runtime import HeldRecords, HeldWriter
from celery_dflock.client._requests import validate_key
from celery_dflock.client.sharding import (
    IdentityShardingStrategy,
    _routes_by_identity,  # pyright: ignore[reportPrivateUsage]
    rendezvous_shard,
    select_server,
    stable_hash_shard,
)
from celery_dflock.config import reset_config
from celery_dflock.keys import KeyBuilder, KeyDerivationError, default_key
from dflockd_server.testing import ServerThread
from tests.support.apps import make_app


def fast_app(server: ServerThread, **conf: Any) -> Celery:
    return make_app("fastpaths", eager=True, servers=server, **conf)


# ------------------------------------------------------------------ per-task caches


def test_a_changed_task_attribute_applies_from_the_next_run(lock_server: ServerThread) -> None:
    app = fast_app(lock_server)
    seen: list[tuple[str, int]] = []

    @app.task(shared=False, bind=True, base=LockedTask, lock_key="attr:{n}", lock_ttl=20)
    def job(self: LockedTask, n: int) -> None:
        lock = self.lock
        assert lock is not None
        seen.append((self.request.dflock_key, lock.lease))

    job.apply(args=(1,))
    job.lock_ttl = 25
    job.lock_key = "changed:{n}"
    job.apply(args=(2,))
    assert seen == [("attr:1", 20), ("changed:2", 25)]


def test_call_options_win_over_what_was_worked_out_before(lock_server: ServerThread) -> None:
    app = fast_app(lock_server)
    seen: list[tuple[str, int]] = []

    @app.task(shared=False, bind=True, base=LockedTask, lock_key="plan:{n}", lock_ttl=20)
    def job(self: LockedTask, n: int) -> None:
        lock = self.lock
        assert lock is not None
        seen.append((self.request.dflock_key, lock.lease))

    job.apply(args=(1,))
    job.apply(args=(2,), headers={"dflock_options": {"lock_key": "call:{n}", "lock_ttl": 15}})
    job.apply(args=(3,))
    assert seen == [("plan:1", 20), ("call:2", 15), ("plan:3", 20)]


def test_a_reset_config_applies_from_the_next_run(lock_server: ServerThread) -> None:
    app = fast_app(lock_server, dflock_key_prefix="one:")
    seen: list[str] = []

    @app.task(shared=False, bind=True, base=LockedTask, lock_key="cfg:{n}")
    def job(self: LockedTask, n: int) -> None:
        seen.append(self.request.dflock_key)

    job.apply(args=(1,))
    app.conf.dflock_key_prefix = "two:"
    job.apply(args=(2,))  # the config is read once per app: unchanged until reset
    reset_config(app)
    job.apply(args=(3,))
    assert seen == ["one:cfg:1", "one:cfg:2", "two:cfg:3"]


def test_a_replaced_run_function_gets_its_own_signature(lock_server: ServerThread) -> None:
    app = fast_app(lock_server)

    @app.task(shared=False, base=LockedTask, lock_key="run:{a}")
    def job(a: int) -> int:
        return a

    assert job.apply(args=(1,)).get() == 1

    def other(b: int, a: int = 5) -> int:
        return a + b

    job.run = other  # the key template now binds against the new signature
    assert job.apply(args=(1,)).get() == 6
    assert job.apply(args=(1, 2)).get() == 3


# ------------------------------------------------------------------ argument binding


def f_plain(a: int, b: str = "x", *, c: float = 1.5) -> None: ...
def f_required_kwonly(a: int, *, c: int) -> None: ...
def f_varargs(a: int, *rest: int, **extra: int) -> None: ...
def f_positional_only(a: int, /, b: int = 2) -> None: ...
def f_none() -> None: ...


SIGNATURES: list[Callable[..., None]] = [
    f_plain,
    f_required_kwonly,
    f_varargs,
    f_positional_only,
    f_none,
]
NAMES = ["a", "b", "c", "d", "rest", "extra"]


def reference_key(run: Callable[..., None], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The key as it was built before the fast path: signature.bind + apply_defaults."""
    try:
        bound = inspect.signature(run).bind(*args, **kwargs)
    except TypeError:
        return "error"
    bound.apply_defaults()
    return default_key("t", dict(bound.arguments))


@settings(max_examples=300)
@given(
    run=st.sampled_from(SIGNATURES),
    args=st.lists(st.integers(-3, 3), max_size=4).map(tuple),
    kwargs=st.dictionaries(st.sampled_from(NAMES), st.integers(-3, 3), max_size=4),
)
def test_fast_binding_gives_exactly_the_slow_bindings_key(
    run: Callable[..., None], args: tuple[int, ...], kwargs: dict[str, int]
) -> None:
    builder = KeyBuilder(None, task_name="t", run=run)
    expected = reference_key(run, args, kwargs)
    if expected == "error":
        with pytest.raises(KeyDerivationError, match="do not match its signature"):
            builder.key(args, kwargs)
    else:
        assert builder.key(args, kwargs) == expected


def test_fast_binding_keeps_template_keys() -> None:
    builder = KeyBuilder("k:{a}:{b}:{c}", task_name="t", run=f_plain, prefix="p/")
    assert builder.key((1,), {}) == "p/k:1:x:1.5"
    assert builder.key((), {"a": 2, "c": 3}) == "p/k:2:x:3"
    assert builder.key((1, "y"), {"c": 0}) == "p/k:1:y:0"


# ------------------------------------------------------------------ checks and routing


def test_key_whitespace_check_matches_str_isspace_everywhere() -> None:
    for code in range(sys.maxunicode + 1):
        char = chr(code)
        if char.isspace():
            with pytest.raises(ValueError, match="whitespace"):
                validate_key(f"a{char}b")
        elif 0xD800 <= code <= 0xDFFF:
            continue  # a lone surrogate is not UTF-8 encodable either way
        else:
            assert validate_key(f"a{char}b") == f"a{char}b"


class _CallableWithIdentity:
    def __call__(self, key: str, num_servers: int) -> int:
        return 0

    def shard_by_identity(self, key: str, identities: Any) -> int:
        return len(identities) - 1


class _IdentityDisabled(_CallableWithIdentity):
    shard_by_identity = None  # type: ignore[assignment]  # pyright: ignore[reportAssignmentType]


class _NotCallable:
    def shard_by_identity(self, key: str, identities: Any) -> int:
        return 0


@pytest.mark.parametrize(
    "strategy",
    [
        stable_hash_shard,
        rendezvous_shard,
        _CallableWithIdentity(),
        _IdentityDisabled(),
        _NotCallable(),
        lambda key, n: 0,
    ],
)
def test_identity_routing_check_matches_the_protocol_check(strategy: object) -> None:
    assert _routes_by_identity(strategy) == isinstance(strategy, IdentityShardingStrategy)


def test_one_server_routes_every_key_to_it_without_asking_the_strategy() -> None:
    servers = [("10.0.0.1", 6388)]
    for key in ["a", "b", "report:42", "ü"]:
        assert select_server(key, servers, stable_hash_shard) == 0
        assert select_server(key, servers, rendezvous_shard) == 0
        # what the strategies compute themselves
        assert stable_hash_shard(key, 1) == 0
        assert rendezvous_shard.shard_by_identity(key, ["10.0.0.1:6388"]) == 0
    with pytest.raises(ValueError, match="returned 7"):
        select_server("a", servers, lambda key, n: 7)  # other strategies are still asked


# ------------------------------------------------------------------ held-lock records


class _Held:
    def __init__(self, key: str, token: str) -> None:
        self.key = key
        self.token = token


TOKEN_A = "0000000000000001a1b2c3d4e5f60718"
TOKEN_B = "0000000000000002a1b2c3d4e5f60718"


def _file_list(path: str) -> list[dict[str, Any]]:
    return json.loads(Path(path).read_bytes())


def test_a_child_keeps_one_record_file_rewritten_in_place(tmp_path: Path) -> None:
    records = HeldRecords(tmp_path)
    writer = HeldWriter(records.directory)
    outer = writer.add("task/1 ü", _Held("report:1", TOKEN_A), 3)  # type: ignore[arg-type]
    assert outer is not None
    path = writer.path
    assert [p.name for p in tmp_path.iterdir()] == [f"{os.getpid()}.held"]
    assert os.stat(path).st_mode & 0o777 == 0o600  # tokens are bearer credentials
    first = {
        "task_id": "task/1 ü",
        "key": "report:1",
        "token": TOKEN_A,
        "limit": 3,
        "pid": os.getpid(),
    }
    assert _file_list(path) == [first]
    # a nested locked run (e.g. an eager call inside the task) adds to the same file
    inner = writer.add("task-2", _Held("report:2", TOKEN_B), None)  # type: ignore[arg-type]
    assert inner is not None
    assert [e["task_id"] for e in _file_list(path)] == ["task/1 ü", "task-2"]
    inode = os.stat(path).st_ino
    inner()
    # shorter now: padded over what was there, so it still reads as exactly one entry
    assert _file_list(path) == [first]
    assert os.stat(path).st_ino == inode  # rewritten in place, not replaced
    assert records.entries("task/1 ü") == [(Path(path), first)]
    assert records.entries("task_1__") == []  # task ids are matched exactly
    outer()
    outer()  # idempotent
    assert _file_list(path) == []
    assert records.entries() == []
    writer.close()
    assert list(tmp_path.iterdir()) == []  # nothing recorded: the file goes with the writer


def test_the_main_process_forgets_released_entries(tmp_path: Path) -> None:
    records = HeldRecords(tmp_path)
    writer = HeldWriter(records.directory)
    assert writer.add("t1", _Held("k1", TOKEN_A), None) is not None  # type: ignore[arg-type]
    assert writer.add("t2", _Held("k2", TOKEN_B), 2) is not None  # type: ignore[arg-type]
    # (the child dies here holding both; its writer is never closed)
    ((path, entry),) = records.entries("t1")
    records.forget(path, entry)
    assert [e["task_id"] for _, e in records.entries()] == ["t2"]
    ((path, entry),) = records.entries("t2")
    records.forget(path, entry)
    assert records.entries() == [] and list(tmp_path.iterdir()) == []


def test_a_file_left_by_an_earlier_process_with_this_pid_is_started_afresh(
    tmp_path: Path,
) -> None:
    stale = tmp_path / f"{os.getpid()}.held"
    stale.write_text(json.dumps([{"task_id": "old", "key": "k" * 200, "pid": os.getpid()}]))
    writer = HeldWriter(tmp_path)
    assert writer.add("new", _Held("k", TOKEN_A), None) is not None  # type: ignore[arg-type]
    assert [e["task_id"] for e in _file_list(writer.path)] == ["new"]
    writer.close()
