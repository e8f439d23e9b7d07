"""The dflockd protocol's requests, without I/O: the commands, the checks of what a request carries,
and one function per request returning its bytes (``checked_*``: of parts checked before;
``encode_*``: checking what it is given), or its bytes (``*_REQUEST``) when it carries nothing."""

from __future__ import annotations

import enum
import re
from typing import Final

from celery_dflock.client import wire
from celery_dflock.client.errors import InvalidValueError

MAX_KEY_BYTES: Final = wire.MAX_LINE_BYTES  # a key is one request line

TOKEN_RE: Final = re.compile(rf"[0-9a-f]{{{wire.TOKEN_HEX_CHARS}}}")
_WHITESPACE_RE: Final = re.compile(r"\s")  # exactly what ``str.isspace`` accepts


class Command(enum.StrEnum):
    """The request commands as spelled on the wire; `label` for messages (``"a renewal ('n')"``)."""

    label: str

    LOCK = wire.CMD_LOCK, "an acquire"
    RENEW = wire.CMD_RENEW, "a renewal"
    RELEASE = wire.CMD_RELEASE, "a release"
    ENQUEUE = wire.CMD_ENQUEUE, "an enqueue"
    WAIT = wire.CMD_WAIT, "a wait"
    SEM_LOCK = wire.CMD_SEM_LOCK, "a semaphore acquire"
    SEM_ENQUEUE = wire.CMD_SEM_ENQUEUE, "a semaphore enqueue"
    SEM_WAIT = wire.CMD_SEM_WAIT, "a semaphore wait"
    SEM_RENEW = wire.CMD_SEM_RENEW, "a semaphore renewal"
    SEM_RELEASE = wire.CMD_SEM_RELEASE, "a semaphore release"
    AUTH = wire.CMD_AUTH, "authentication"
    STATS = wire.CMD_STATS, "a stats request"
    PING = wire.CMD_PING, "a ping"
    HELLO = wire.CMD_HELLO, "a hello"
    SHARDS = wire.CMD_SHARDS, "a shards request"
    HOLD = wire.CMD_HOLD, "an acquire or a hold"
    NOTE = wire.CMD_NOTE, "a note"
    TAKE = wire.CMD_TAKE, "a take-over"
    HAND_DOWN = wire.CMD_HAND_DOWN, "a hand-down"
    ASKING = wire.CMD_ASKING, "an asking"
    FORCE_RELEASE = wire.CMD_FORCE_RELEASE, "a force release"

    def __new__(cls, value: str, doing: str) -> Command:
        member = str.__new__(cls, value)
        member._value_ = value
        member.label = f"{doing} ({value!r})"
        return member


def validate_key(key: str) -> str:
    if not isinstance(key, str):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise InvalidValueError(f"a lock key must be a str, got {type(key).__name__}: {key!r}")
    if not key:
        raise InvalidValueError("a lock key must not be empty")
    if _WHITESPACE_RE.search(key):
        raise InvalidValueError(
            f"lock key {key!r} contains whitespace, which the protocol cannot carry: "
            "replace spaces and newlines (e.g. with ':' or '_')"
        )
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidValueError(f"lock key {key!r} is not encodable as UTF-8: {exc}") from None
    if size > MAX_KEY_BYTES:
        raise InvalidValueError(
            f"lock key is {size} bytes of UTF-8, over the protocol's {MAX_KEY_BYTES}: "
            f"shorten it or digest it (key starts {key[:40]!r})"
        )
    return key


def validate_token(token: str) -> str:
    if not isinstance(token, str) or not TOKEN_RE.fullmatch(token):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise InvalidValueError(
            f"a token is {wire.TOKEN_HEX_CHARS} lowercase hex characters, got {token!r}"
        )
    return token


NOTE_RE: Final = re.compile(rf"[!-~]{{1,{wire.MAX_NOTE_BYTES}}}")


def validate_note(note: str, name: str = "note") -> str:
    if not isinstance(note, str):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise InvalidValueError(f"{name} must be a str, got {type(note).__name__}: {note!r}")
    if not NOTE_RE.fullmatch(note):
        raise InvalidValueError(
            f"{name} must be 1 to {wire.MAX_NOTE_BYTES} printable ASCII characters without "
            f"spaces ('!' to '~'; percent-encode anything else), got {note!r}"
        )
    return note


def _request(command: Command, key: str, argument: str) -> bytes:
    return f"{command}\n{key}\n{argument}\n".encode()


# A lock object's parts are checked once, when it is made, and its token is one a grant reply
# matched: these build its requests without checking again.


_LOCK: Final = wire.CMD_LOCK.encode() + b"\n%s\n%d\n"
_LOCK_LEASE: Final = wire.CMD_LOCK.encode() + b"\n%s\n%d %d\n"
_HOLD: Final = wire.CMD_HOLD.encode() + b"\n%s\n%d %d %s %s\n"
_HOLD_MODES: Final = (wire.HOLD_MODE_CONNECTION.encode(), wire.HOLD_MODE_DETACHED.encode())
_RELEASE: Final = wire.CMD_RELEASE.encode() + b"\n%s\n%s\n"


def checked_lock(key: str, timeout_s: int, lease_s: int | None) -> bytes:
    if lease_s is None:
        return _LOCK % (key.encode(), timeout_s)
    return _LOCK_LEASE % (key.encode(), timeout_s, lease_s)


def checked_hold(key: str, timeout_s: int, lease_s: int, note: str, *, detached: bool) -> bytes:
    return _HOLD % (key.encode(), timeout_s, lease_s, _HOLD_MODES[detached], note.encode())


def checked_release(key: str, token: str) -> bytes:
    return _RELEASE % (key.encode(), token.encode())


def _checked_lease(lease_s: int | None) -> str:
    return "" if lease_s is None else f" {lease_s}"


def checked_sem_lock(key: str, timeout_s: int, limit: int, lease_s: int | None) -> bytes:
    return _request(Command.SEM_LOCK, key, f"{timeout_s} {limit}{_checked_lease(lease_s)}")


def checked_enqueue(key: str, limit: int | None, lease_s: int | None) -> bytes:
    if limit is None:
        return _request(Command.ENQUEUE, key, _checked_lease(lease_s).lstrip())
    return _request(Command.SEM_ENQUEUE, key, f"{limit}{_checked_lease(lease_s)}")


def checked_renew(command: Command, key: str, token: str, lease_s: int | None) -> bytes:
    """``n`` or ``sn`` (``command``)."""
    return _request(command, key, token + _checked_lease(lease_s))


def checked_hand_down(key: str, token: str, lease_s: int) -> bytes:
    return _request(Command.HAND_DOWN, key, f"{token} {lease_s}")


def checked_take(key: str, token: str, lease_s: int, on_close_s: int | None, note: str) -> bytes:
    on_close = wire.ON_CLOSE_RELEASE if on_close_s is None else str(on_close_s)
    return _request(Command.TAKE, key, f"{token} {lease_s} {on_close} {note}")


def checked_note(key: str, token: str, note: str) -> bytes:
    return _request(Command.NOTE, key, f"{token} {note}")


def checked_force_release(key: str, note: str | None = None) -> bytes:
    return _request(Command.FORCE_RELEASE, key, wire.PLACEHOLDER if note is None else note)


def checked_wait(command: Command, key: str, timeout_s: int) -> bytes:
    """``w`` or ``sw`` (``command``)."""
    return _request(command, key, str(timeout_s))


def checked_sem_release(key: str, token: str) -> bytes:
    return _request(Command.SEM_RELEASE, key, token)


def checked_auth(secret: str) -> bytes:
    return _request(Command.AUTH, wire.PLACEHOLDER, secret)


STATS_REQUEST: Final = _request(Command.STATS, wire.PLACEHOLDER, wire.PLACEHOLDER)
PING_REQUEST: Final = _request(Command.PING, wire.PLACEHOLDER, wire.PLACEHOLDER)
SHARDS_REQUEST: Final = _request(Command.SHARDS, wire.PLACEHOLDER, wire.PLACEHOLDER)
HELLO_REQUEST: Final = _request(Command.HELLO, wire.PLACEHOLDER, wire.HELLO_SESSION)
"""``hello _ session``: on a server that lists ``session``, this connection is a session
connection from now on."""


def encode_join_session(session_id: str, ttl: int) -> bytes:
    """``hello _ session <id> <ttl>``: this connection joins the client session ``<id>``."""
    return _request(Command.HELLO, wire.PLACEHOLDER, f"{wire.HELLO_SESSION} {session_id} {ttl}")


def encode_keepalive(session_id: str) -> bytes:
    return _request(Command.PING, wire.PLACEHOLDER, f"{wire.HELLO_SESSION} {session_id}")


def checked_asking(key: str, ticket: str | None) -> bytes:
    """``asking <key> <ticket>`` (``asking _ _`` without a ticket)."""
    if ticket is None:
        return _request(Command.ASKING, wire.PLACEHOLDER, wire.PLACEHOLDER)
    return _request(Command.ASKING, key, ticket)


def fence_of(token: str) -> int:
    """``int(token[:16], 16)``."""
    return int(token[: wire.FENCE_HEX_CHARS], 16)
