"""The dispatch step alone: frames in, reply bytes (or an action for the transport) out, on a
lock table with a fake clock. No socket, no event loop: what a request does is decided here,
the transport only carries it out."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from dflockd_server import protocol as p
from dflockd_server.dispatch import AUTH_FAILED, STATS, Close, Session, Wait
from dflockd_server.table import LockTable

LEASE = 33
MAX_LEASE = 3600


@dataclass
class Host:
    draining: bool = False
    secret: bytes | None = None
    hello_reply: bytes = b'ok {"server":"test"}\n'
    key_check: Callable[[str], bytes | None] | None = None
    renewals_ok: bool = True

    def asked_check(self, key: str) -> bytes | None:
        return None if self.key_check is None else self.key_check(key)

    def admit_ask(self, key: str, ticket: str) -> bytes | None:
        return None if ticket == f"ticket-for-{key}" else b"error\n"

    def may_hold(self, key: str) -> bool:
        return self.renewals_ok

    @property
    def hold_check(self) -> Callable[[str], bool] | None:
        return None if self.key_check is None else self.may_hold

    def shards_reply(self) -> bytes:
        return b'ok {"mode":"single"}\n'

    def over_ip_share(self, session: Session) -> bool:
        return False  # one session: no other connection of its address to add up


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def table() -> LockTable:
    serial = itertools.count(1)
    return LockTable(clock=Clock(), new_token=lambda: f"{next(serial):032x}", max_locks=100)


def session(table: LockTable, host: Host | None = None) -> Session:
    return Session(host or Host(), table, LEASE, MAX_LEASE, "test:1")


def ask(s: Session, cmd: bytes, key: bytes, arg: bytes) -> bytes | None:
    return s.handle((cmd, key, arg))


def token_of(reply: bytes | None) -> bytes:
    assert reply is not None and reply.startswith(b"ok "), reply
    return reply.split()[1]


def test_the_usual_shapes_and_the_others_get_the_same_answers(table: LockTable) -> None:
    s = session(table)
    token = token_of(ask(s, b"l", b"k", b"0"))
    assert ask(s, b"l", b"k", b"0") == p.REPLY_TIMEOUT
    assert ask(s, b"n", b"k", token) == f"ok {LEASE}\n".encode()
    assert ask(s, b"n", b"k", token + b"  60") == b"ok 60\n"  # not the usual shape: decoded
    assert ask(s, b"r", b"k", token + b" 5") == p.REPLY_ERROR  # r takes no lease
    assert ask(s, b"r", b"k", token) == p.REPLY_OK
    assert ask(s, b"r", b"k", token) == p.REPLY_ERROR
    assert ask(s, b"l", b"k", b"-1") == p.REPLY_ERROR  # malformed: error, nothing else
    assert s.action is None
    assert ask(s, b"l", b"k", f"0 {MAX_LEASE + 1}".encode()) == p.REPLY_ERROR
    assert ask(s, b"nope", b"k", b"0") == p.REPLY_ERROR
    assert ask(s, b"ping", b"_", b"_") == p.REPLY_OK
    assert ask(s, b"hello", b"_", b"_") == Host.hello_reply


def test_a_blocking_acquire_is_a_wait_answered_when_granted(table: LockTable) -> None:
    holder, waiter = session(table), session(table)
    token = token_of(ask(holder, b"l", b"k", b"0"))
    assert ask(waiter, b"l", b"k", b"5") is None
    action = waiter.action
    assert isinstance(action, Wait) and action.timeout == 5
    woken: list[bytes] = []
    action.waiter.wake = lambda w: woken.append(waiter.granted(w))
    assert ask(holder, b"r", b"k", token) == p.REPLY_OK
    assert len(woken) == 1 and woken[0].startswith(b"ok ")


def test_after_eof_an_acquire_is_tried_once(table: LockTable) -> None:
    holder, late = session(table), session(table)
    token_of(ask(holder, b"l", b"k", b"0"))
    late.eof = True
    assert ask(late, b"l", b"k", b"5") == p.REPLY_TIMEOUT


def test_two_phase_and_give_up(table: LockTable) -> None:
    holder, other = session(table), session(table)
    token_of(ask(holder, b"l", b"k", b"0"))
    assert ask(other, b"e", b"k", b"_") == p.REPLY_QUEUED
    assert ask(other, b"w", b"k", b"5") is None
    action = other.action
    assert isinstance(action, Wait)
    other.give_up(action.waiter)  # its timer fired
    assert ask(other, b"w", b"k", b"0") == p.REPLY_ERROR_NOT_ENQUEUED


def test_auth_draining_and_stats_are_actions_or_replies(table: LockTable) -> None:
    host = Host(secret=b"s3cret")
    s = session(table, host)
    assert ask(s, b"l", b"k", b"0") is None
    assert isinstance(s.action, Close) and s.action.reply == p.REPLY_ERROR_AUTH
    assert ask(s, b"auth", b"_", b"wrong") is None and s.action is AUTH_FAILED
    assert ask(s, b"auth", b"_", b"s3cret") == p.REPLY_OK
    assert ask(s, b"stats", b"_", b"_") is None and s.action is STATS
    host.draining = True
    assert ask(s, b"l", b"k", b"0") == p.REPLY_ERROR_DRAINING
    assert ask(s, b"ping", b"_", b"_") == p.REPLY_OK


# ------------------------------------------------------------------------------ ownership
def test_a_key_not_served_is_refused_before_the_table_is_touched(table: LockTable) -> None:
    moved = b"error_moved b:6388\n"
    host = Host(key_check=lambda key: None if key == "mine" else moved)
    s = session(table, host)
    assert ask(s, b"l", b"theirs", b"5") == moved
    assert ask(s, b"l", b"theirs", b"5  7") == moved  # not the usual shape: decoded, refused
    assert ask(s, b"sl", b"theirs", b"5 2") == moved
    assert ask(s, b"e", b"theirs", b"_") == moved
    assert ask(s, b"se", b"theirs", b"2") == moved
    assert s.action is None
    assert "theirs" not in table.grants.keys
    token = token_of(ask(s, b"l", b"mine", b"0"))
    host.key_check = lambda key: p.REPLY_ERROR_UNAVAILABLE  # swapped: counts from now on
    assert ask(s, b"l", b"mine", b"0") == p.REPLY_ERROR_UNAVAILABLE
    assert ask(s, b"n", b"mine", token) == f"ok {LEASE}\n".encode()  # no check on renew
    host.renewals_ok = False  # a fenced member: it cannot tell whether the grant is still its
    assert ask(s, b"n", b"mine", token) == p.REPLY_ERROR_UNAVAILABLE  # (the holder asks again)
    host.key_check = lambda key: moved  # the shard is another's: the grant is lost
    assert ask(s, b"n", b"mine", token) == p.REPLY_ERROR
    host.key_check = lambda key: p.REPLY_ERROR_UNAVAILABLE
    assert ask(s, b"r", b"mine", token) == p.REPLY_OK  # no check on release
    assert ask(s, b"n", b"mine", token) == p.REPLY_ERROR  # a token that holds nothing here


def test_a_take_over_or_hand_down_a_member_cannot_confirm_is_answered_as_a_renewal(
    table: LockTable,
) -> None:
    """``ht`` and ``hd`` renew a held grant: while the member cannot tell whether it serves the
    key they are answered ``error_unavailable`` (the hold may well still be there), ``error``
    once the shard is another's or the token holds nothing."""
    host = Host(key_check=lambda key: None)
    s = session(table, host)
    token = token_of(ask(s, b"hl", b"k", b"0 30 d task-1"))
    host.renewals_ok = False
    host.key_check = lambda key: p.REPLY_ERROR_UNAVAILABLE  # cut off from etcd, or starting
    assert ask(s, b"ht", b"k", token + b" 30 r task-2") == p.REPLY_ERROR_UNAVAILABLE
    assert ask(s, b"hd", b"k", token + b" 30") == p.REPLY_ERROR_UNAVAILABLE
    assert ask(s, b"ht", b"k", b"f" * 32 + b" 30 r task-2") == p.REPLY_ERROR  # holds nothing
    host.key_check = lambda key: b"error_moved b:6388\n"  # the shard is another's
    assert ask(s, b"ht", b"k", token + b" 30 r task-2") == p.REPLY_ERROR
    assert ask(s, b"hd", b"k", token + b" 30") == p.REPLY_ERROR
    host.renewals_ok, host.key_check = True, lambda key: None
    assert ask(s, b"ht", b"k", token + b" 30 r task-2") == b"ok 30\n"  # kept meanwhile


def test_shards_is_answered_by_the_host_even_while_draining(table: LockTable) -> None:
    host = Host(draining=True)
    assert ask(session(table, host), b"shards", b"_", b"_") == b'ok {"mode":"single"}\n'


# ------------------------------------------------------------------------------ force release
def test_force_release_frees_the_key_and_grants_the_next_waiter_a_higher_fence(
    table: LockTable, caplog: pytest.LogCaptureFixture
) -> None:
    holder, waiter, operator = session(table), session(table), session(table)
    token = token_of(ask(holder, b"hl", b"k", b"0 30 d task-1/celery%40w1"))
    assert ask(waiter, b"l", b"k", b"5") is None
    action = waiter.action
    assert isinstance(action, Wait)
    woken: list[bytes] = []
    action.waiter.wake = lambda w: woken.append(waiter.granted(w))
    with caplog.at_level("WARNING", logger="dflockd_server"):
        assert ask(operator, b"fr", b"k", b"ops:alice") == b"ok 1\n"
    assert len(woken) == 1
    new_token = token_of(woken[0])
    assert int(new_token, 16) > int(token, 16)  # this table's tokens: a plain counter
    assert ask(holder, b"n", b"k", token) == p.REPLY_ERROR  # the old holder learns it lost
    assert ask(holder, b"r", b"k", token) == p.REPLY_ERROR
    assert ask(waiter, b"n", b"k", new_token) == f"ok {LEASE}\n".encode()
    logged = caplog.text
    assert "force release of 'k' by test:1 (ops:alice): 1 grant(s) freed" in logged
    assert "held by task-1/celery@w1" in logged  # decoded (issue 73: it said celery%40w1)
    assert table.grants.counts.forced == [1, 0] and table.held == 1


def test_force_release_of_a_free_key_a_semaphore_and_bad_requests(table: LockTable) -> None:
    s = session(table)
    assert ask(s, b"fr", b"nothing", b"_") == b"ok 0\n"
    for _ in range(3):
        token_of(ask(session(table), b"sl", b"sem", b"0 3"))
    assert ask(s, b"fr", b"sem", b"_") == b"ok 3\n"
    token_of(ask(s, b"sl", b"sem", b"0 3"))
    assert ask(s, b"fr", b"k", b"") == p.REPLY_ERROR  # no note: '_' is how to send none
    assert ask(s, b"fr", b"k", b"a b") == p.REPLY_ERROR
    assert ask(s, b"fr", b"a b", b"_") == p.REPLY_ERROR
    assert ask(s, b"fr", b"", b"_") == p.REPLY_ERROR
    assert s.action is None


def test_force_release_goes_to_the_key_s_member_and_works_while_draining(
    table: LockTable,
) -> None:
    moved = b"error_moved b:6388\n"
    host = Host(key_check=lambda key: None if key == "mine" else moved)
    s = session(table, host)
    token_of(ask(s, b"l", b"mine", b"0"))
    assert ask(s, b"fr", b"theirs", b"_") == moved
    host.draining = True
    assert ask(s, b"fr", b"mine", b"_") == b"ok 1\n"


@dataclass
class AskingHost(Host):
    """A cluster member's host that serves every admitted asked acquire (and records it)."""

    asked: list[str] = field(default_factory=list[str])

    def asked_check(self, key: str) -> bytes | None:
        self.asked.append(key)
        return None


def test_asking_is_admitted_with_the_ticket_for_its_key_and_counts_for_that_key_only(
    table: LockTable,
) -> None:
    """Issue 48: in cluster mode `asking <key> <ticket>` is admitted only when the ownership
    admits the ticket for that key; the next acquire of that key then gets the asked check,
    any other request the usual one."""
    moved = b"error_moved a:1\n"
    host = AskingHost(key_check=lambda key: moved)
    s = session(table, host)
    assert ask(s, b"asking", b"_", b"_") == b"error\n"
    assert ask(s, b"l", b"k", b"0") == moved
    assert ask(s, b"asking", b"k", b"ticket-for-j") == b"error\n"
    assert ask(s, b"l", b"k", b"0") == moved
    assert ask(s, b"asking", b"k", b"ticket-for-k") == b"ok\n"
    assert ask(s, b"l", b"j", b"0") == moved  # admitted for k, not for j
    assert ask(s, b"l", b"k", b"0") == moved  # one request only
    assert ask(s, b"asking", b"k", b"ticket-for-k") == b"ok\n"
    reply = ask(s, b"l", b"k", b"0")
    assert reply is not None and reply.startswith(b"ok "), reply
    assert host.asked == ["k"]
    # Outside cluster mode `asking` changes nothing and is answered ok.
    assert ask(session(table), b"asking", b"_", b"_") == b"ok\n"
