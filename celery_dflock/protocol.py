"""The dflockd wire protocol, without I/O.

Requests are built by the ``encode_*`` functions (they validate keys, tokens and numbers and
return the exact bytes to send). Replies are decoded by `ReplyParser`, which is fed bytes as they
arrive (in any chunking) and hands out one typed reply per complete line, checked against the
command it answers::

    parser = ReplyParser()
    sock.sendall(encode_lock("jobs", 10))
    while (reply := parser.next_reply(Command.LOCK)) is None:
        parser.feed(sock.recv(4096))
    # reply is Granted(token, lease), TimedOut() or ErrorReply(code)

Anything that is not a valid reply to that command raises `ProtocolError` naming what arrived.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from typing import Final

from celery_dflock.errors import InvalidValueError, ProtocolError
from dflockd_server import constants

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_STATS_LINE_BYTES",
    "Bound",
    "Command",
    "ErrorReply",
    "Granted",
    "Hello",
    "Moved",
    "Ok",
    "Queued",
    "Renewed",
    "Reply",
    "ReplyParser",
    "Shards",
    "Stats",
    "TimedOut",
    "decode_reply",
    "encode_auth",
    "encode_enqueue",
    "encode_hand_down",
    "encode_hello",
    "encode_hold",
    "encode_lock",
    "encode_note",
    "encode_ping",
    "encode_release",
    "encode_renew",
    "encode_sem_enqueue",
    "encode_sem_lock",
    "encode_sem_release",
    "encode_sem_renew",
    "encode_sem_wait",
    "encode_shards",
    "encode_stats",
    "encode_take",
    "encode_wait",
    "fence_of",
    "validate_key",
    "validate_note",
    "validate_token",
]

MAX_KEY_BYTES: Final = constants.MAX_LINE_BYTES
"""A key is one request line, so it holds at most this many bytes of UTF-8."""
MAX_STATS_LINE_BYTES: Final = 64 * 1024 * 1024
"""Longest ``stats`` reply the parser accepts (every other reply is one short line)."""

_TOKEN_RE: Final = re.compile(rf"[0-9a-f]{{{constants.TOKEN_HEX_CHARS}}}")
_ERROR_CODE_RE: Final = re.compile(r"error(_[a-z_]+)?")
_GRANT_LINE_RE: Final = re.compile(rb"ok ([0-9a-f]{%d}) ([1-9][0-9]*)" % constants.TOKEN_HEX_CHARS)
_RENEWED_LINE_RE: Final = re.compile(rb"ok ([0-9]+)")
_WHITESPACE_RE: Final = re.compile(r"\s")
"""Matches exactly the characters ``str.isspace`` accepts (one scan in C, not a loop)."""


class Command(enum.StrEnum):
    """The request commands, valued as they are spelled on the wire."""

    LOCK = constants.CMD_LOCK
    RENEW = constants.CMD_RENEW
    RELEASE = constants.CMD_RELEASE
    ENQUEUE = constants.CMD_ENQUEUE
    WAIT = constants.CMD_WAIT
    SEM_LOCK = constants.CMD_SEM_LOCK
    SEM_ENQUEUE = constants.CMD_SEM_ENQUEUE
    SEM_WAIT = constants.CMD_SEM_WAIT
    SEM_RENEW = constants.CMD_SEM_RENEW
    SEM_RELEASE = constants.CMD_SEM_RELEASE
    AUTH = constants.CMD_AUTH
    STATS = constants.CMD_STATS
    PING = constants.CMD_PING
    HELLO = constants.CMD_HELLO
    SHARDS = constants.CMD_SHARDS
    HOLD = constants.CMD_HOLD
    NOTE = constants.CMD_NOTE
    TAKE = constants.CMD_TAKE
    HAND_DOWN = constants.CMD_HAND_DOWN
    ASKING = constants.CMD_ASKING

    @property
    def label(self) -> str:
        """What the request does, with its wire letter: ``"a renewal ('n')"``, for messages."""
        return f"{_DOING[self]} ({self.value!r})"


_DOING: Final[dict[Command, str]] = {
    Command.LOCK: "an acquire",
    Command.RENEW: "a renewal",
    Command.RELEASE: "a release",
    Command.ENQUEUE: "an enqueue",
    Command.WAIT: "a wait",
    Command.SEM_LOCK: "a semaphore acquire",
    Command.SEM_ENQUEUE: "a semaphore enqueue",
    Command.SEM_WAIT: "a semaphore wait",
    Command.SEM_RENEW: "a semaphore renewal",
    Command.SEM_RELEASE: "a semaphore release",
    Command.AUTH: "authentication",
    Command.STATS: "a stats request",
    Command.PING: "a ping",
    Command.HELLO: "a hello",
    Command.SHARDS: "a shards request",
    Command.HOLD: "a hold",
    Command.NOTE: "a note",
    Command.TAKE: "a take-over",
    Command.HAND_DOWN: "a hand-down",
    Command.ASKING: "an asking",
}


# ------------------------------------------------------------------------------- validation


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_key(key: str) -> str:
    """Return ``key`` if the protocol can carry it, else raise `ValueError` saying why."""
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
    """Return ``token`` if it looks like a dflockd token (32 lowercase hex), else `ValueError`."""
    if not isinstance(token, str) or not _TOKEN_RE.fullmatch(token):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise InvalidValueError(
            f"a token is {constants.TOKEN_HEX_CHARS} lowercase hex characters, got {token!r}"
        )
    return token


_NOTE_RE: Final = re.compile(rf"[!-~]{{1,{constants.MAX_NOTE_BYTES}}}")


def validate_note(note: str, name: str = "note") -> str:
    """Return ``note`` if it is an owner note the protocol carries (1 to 200 printable ASCII
    characters, no space: ``!`` to ``~``), else `ValueError` naming ``name``."""
    if not isinstance(note, str) or not _NOTE_RE.fullmatch(note):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise InvalidValueError(
            f"{name} must be 1 to {constants.MAX_NOTE_BYTES} printable ASCII characters without "
            f"spaces ('!' to '~'; percent-encode anything else), got {note!r}"
        )
    return note


def _number(name: str, value: int, *, minimum: int, maximum: int = constants.MAX_NUMBER) -> str:
    if not _is_int(value):
        raise InvalidValueError(f"{name} must be an int number of seconds/units, got {value!r}")
    if not minimum <= value <= maximum:
        raise InvalidValueError(f"{name} must be between {minimum} and {maximum}, got {value}")
    return str(value)


def _timeout(value: int) -> str:
    return _number("timeout_s", value, minimum=0)


def _lease_suffix(lease_s: int | None) -> str:
    return "" if lease_s is None else " " + _number("lease_s", lease_s, minimum=1)


def _limit(limit: int) -> str:
    return _number(
        "limit",
        limit,
        minimum=constants.MIN_SEMAPHORE_LIMIT,
        maximum=constants.MAX_SEMAPHORE_LIMIT,
    )


def _request(command: Command, key: str, argument: str) -> bytes:
    return f"{command}\n{key}\n{argument}\n".encode()


# ------------------------------------------------------------------------------- encoders


def encode_lock(key: str, timeout_s: int, lease_s: int | None = None) -> bytes:
    """``l``: acquire, waiting up to ``timeout_s`` (0: try once)."""
    return _request(Command.LOCK, validate_key(key), _timeout(timeout_s) + _lease_suffix(lease_s))


def encode_hold(key: str, timeout_s: int, lease_s: int, note: str, *, detached: bool) -> bytes:
    """``hl``: acquire the lock ``key`` with the owner note ``note``, bound to this connection
    or ``detached`` from it (freed only by ``r`` or its lease)."""
    mode = constants.HOLD_MODE_DETACHED if detached else constants.HOLD_MODE_CONNECTION
    argument = (
        f"{_timeout(timeout_s)} {_number('lease_s', lease_s, minimum=1)} {mode} "
        f"{validate_note(note)}"
    )
    return _request(Command.HOLD, validate_key(key), argument)


def encode_note(key: str, token: str, note: str) -> bytes:
    """``note``: replace the owner note of the grant ``token`` holds on ``key``."""
    return _request(
        Command.NOTE, validate_key(key), f"{validate_token(token)} {validate_note(note)}"
    )


def encode_take(key: str, token: str, lease_s: int, on_close_s: int | None, note: str) -> bytes:
    """``ht``: bind the detached grant ``token`` holds on ``key`` to this connection, with a
    lease of ``lease_s`` and the owner note ``note``; when the connection closes the grant is
    released (``on_close_s`` None: ``r``) or detached again with a lease of ``on_close_s``."""
    on_close = (
        constants.ON_CLOSE_RELEASE
        if on_close_s is None
        else _number("on_close_lease", on_close_s, minimum=1)
    )
    argument = (
        f"{validate_token(token)} {_number('lease_s', lease_s, minimum=1)} {on_close} "
        f"{validate_note(note)}"
    )
    return _request(Command.TAKE, validate_key(key), argument)


def encode_hand_down(key: str, token: str, lease_s: int) -> bytes:
    """``hd``: detach the grant ``token`` holds on ``key`` from its connection, with a lease of
    ``lease_s``."""
    argument = f"{validate_token(token)} {_number('lease_s', lease_s, minimum=1)}"
    return _request(Command.HAND_DOWN, validate_key(key), argument)


def encode_renew(key: str, token: str, lease_s: int | None = None) -> bytes:
    """``n``: extend the lease of ``token`` to now + ``lease_s`` (default: the server's)."""
    return _request(
        Command.RENEW, validate_key(key), validate_token(token) + _lease_suffix(lease_s)
    )


def encode_release(key: str, token: str) -> bytes:
    """``r``: release ``token``'s hold on ``key``."""
    return _request(Command.RELEASE, validate_key(key), validate_token(token))


def encode_enqueue(key: str, lease_s: int | None = None) -> bytes:
    """``e``: join ``key``'s queue without blocking (two-phase step 1)."""
    return _request(Command.ENQUEUE, validate_key(key), _lease_suffix(lease_s).lstrip())


def encode_wait(key: str, timeout_s: int) -> bytes:
    """``w``: wait up to ``timeout_s`` for the grant of an earlier ``e`` (same connection)."""
    return _request(Command.WAIT, validate_key(key), _timeout(timeout_s))


def encode_sem_lock(key: str, timeout_s: int, limit: int, lease_s: int | None = None) -> bytes:
    """``sl``: take one of ``limit`` slots of semaphore ``key``."""
    argument = f"{_timeout(timeout_s)} {_limit(limit)}{_lease_suffix(lease_s)}"
    return _request(Command.SEM_LOCK, validate_key(key), argument)


def encode_sem_enqueue(key: str, limit: int, lease_s: int | None = None) -> bytes:
    """``se``: join semaphore ``key``'s queue without blocking."""
    argument = f"{_limit(limit)}{_lease_suffix(lease_s)}"
    return _request(Command.SEM_ENQUEUE, validate_key(key), argument)


def encode_sem_wait(key: str, timeout_s: int) -> bytes:
    """``sw``: wait for the semaphore slot of an earlier ``se``."""
    return _request(Command.SEM_WAIT, validate_key(key), _timeout(timeout_s))


def encode_sem_renew(key: str, token: str, lease_s: int | None = None) -> bytes:
    """``sn``: extend a semaphore slot's lease."""
    return _request(
        Command.SEM_RENEW, validate_key(key), validate_token(token) + _lease_suffix(lease_s)
    )


def encode_sem_release(key: str, token: str) -> bytes:
    """``sr``: give a semaphore slot back."""
    return _request(Command.SEM_RELEASE, validate_key(key), validate_token(token))


def encode_auth(secret: str) -> bytes:
    """``auth``: present the server's shared secret (must be a connection's first request)."""
    if not isinstance(secret, str) or not secret:  # pyright: ignore[reportUnnecessaryIsInstance]
        raise InvalidValueError("auth_token must be a non-empty str")
    if "\n" in secret or "\r" in secret or secret != secret.strip():
        raise InvalidValueError(
            "auth_token must not contain line breaks or leading/trailing whitespace "
            "(check how the secret was read, e.g. a trailing newline from a file)"
        )
    if len(secret.encode("utf-8")) > constants.MAX_AUTH_LINE_BYTES:
        raise InvalidValueError(
            f"auth_token is longer than the protocol's {constants.MAX_AUTH_LINE_BYTES} bytes"
        )
    return _request(Command.AUTH, constants.PLACEHOLDER, secret)


def encode_stats() -> bytes:
    """``stats``: ask for the server's state as one line of JSON."""
    return _request(Command.STATS, constants.PLACEHOLDER, constants.PLACEHOLDER)


def encode_ping() -> bytes:
    """``ping``: liveness check."""
    return _request(Command.PING, constants.PLACEHOLDER, constants.PLACEHOLDER)


def encode_hello() -> bytes:
    """``hello``: what this server is and supports (a server that predates it: ``error``)."""
    return _request(Command.HELLO, constants.PLACEHOLDER, constants.PLACEHOLDER)


def encode_asking() -> bytes:
    """``asking``: the next acquire follows an ``error_ask`` (``Asked``; a key-level move)."""
    return _request(Command.ASKING, constants.PLACEHOLDER, constants.PLACEHOLDER)


def encode_shards() -> bytes:
    """``shards``: which keys the server serves (``Shards``)."""
    return _request(Command.SHARDS, constants.PLACEHOLDER, constants.PLACEHOLDER)


def fence_of(token: str) -> int:
    """The fencing counter carried in a token: ``int(token[:16], 16)``."""
    return int(token[: constants.FENCE_HEX_CHARS], 16)


# ------------------------------------------------------------------------------- replies


@dataclass(frozen=True, slots=True)
class Granted:
    """``ok <token> <lease>`` (or ``acquired ...`` to an enqueue): the lock is held."""

    token: str
    lease: int

    @property
    def fence(self) -> int:
        """The fencing counter of `token`."""
        return fence_of(self.token)

    def __repr__(self) -> str:  # never print a bearer credential in full
        return f"Granted(token='{self.token[:8]}...', lease={self.lease})"


@dataclass(frozen=True, slots=True)
class Queued:
    """``queued``: enqueued, the grant comes with a later ``w``."""


@dataclass(frozen=True, slots=True)
class TimedOut:
    """``timeout``: not granted within the timeout. To ``hl``: ``timeout <holder-note>``,
    ``holder`` the note of the key's holder (None when it gave none, ``_`` on the wire)."""

    holder: str | None = None


@dataclass(frozen=True, slots=True)
class Renewed:
    """``ok <seconds_remaining>``: the lease was extended."""

    seconds_remaining: int


@dataclass(frozen=True, slots=True)
class Ok:
    """Bare ``ok`` (release, auth, ping)."""


@dataclass(frozen=True, slots=True)
class Stats:
    """``ok <json>`` to ``stats``: the decoded JSON object."""

    data: dict[str, object]


@dataclass(frozen=True, slots=True)
class Hello:
    """``ok <json>`` to ``hello``: the decoded JSON object (``server``, ``version``,
    ``features``)."""

    data: dict[str, object]


@dataclass(frozen=True, slots=True)
class Shards:
    """``ok <json>`` to ``shards``: the decoded JSON object (``mode`` and what it implies)."""

    data: dict[str, object]


@dataclass(frozen=True, slots=True)
class Moved:
    """``error_moved <HOST:PORT>`` to an acquire: the key is served by that member."""

    address: str


@dataclass(frozen=True, slots=True)
class Asked:
    """``error_ask <HOST:PORT>`` to an acquire: the key's shard moves key by key and this key
    is to be asked for there, once, with ``asking`` first (the shard map stays as it is)."""

    address: str


@dataclass(frozen=True, slots=True)
class Bound:
    """``error_bound <holder-note>`` to ``ht``: the grant is bound to a live connection (another
    holder has taken it over); ``holder`` its note (None for ``_``)."""

    holder: str | None


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """``error`` or ``error_<reason>``: the server refused the request."""

    code: str


Reply = (
    Granted
    | Queued
    | TimedOut
    | Renewed
    | Ok
    | Stats
    | Hello
    | Shards
    | Moved
    | Asked
    | Bound
    | ErrorReply
)

_COMMON_ERRORS: Final = frozenset(
    {constants.STATUS_ERROR, constants.STATUS_ERROR_AUTH, constants.STATUS_ERROR_DRAINING}
)
_LOCK_ERRORS: Final = _COMMON_ERRORS | {
    constants.STATUS_ERROR_MAX_LOCKS,
    constants.STATUS_ERROR_MAX_WAITERS,
    # A key is one resource: a lock (limit 1) on a key busy as a semaphore is refused too.
    constants.STATUS_ERROR_LIMIT_MISMATCH,
    # A key this server does not serve now (cluster mode: try again shortly).
    constants.STATUS_ERROR_UNAVAILABLE,
}
_ENQUEUE_ERRORS: Final = _LOCK_ERRORS | {constants.STATUS_ERROR_ALREADY_ENQUEUED}
_WAIT_ERRORS: Final = _COMMON_ERRORS | {
    constants.STATUS_ERROR_UNAVAILABLE,
    constants.STATUS_ERROR_NOT_ENQUEUED,
    constants.STATUS_ERROR_LEASE_EXPIRED,
}
_ALLOWED_ERRORS: Final[dict[Command, frozenset[str]]] = {
    Command.LOCK: _LOCK_ERRORS,
    Command.SEM_LOCK: _LOCK_ERRORS,
    Command.ENQUEUE: _ENQUEUE_ERRORS,
    Command.SEM_ENQUEUE: _ENQUEUE_ERRORS,
    Command.WAIT: _WAIT_ERRORS,
    Command.SEM_WAIT: _WAIT_ERRORS,
    Command.RENEW: _COMMON_ERRORS,
    Command.SEM_RENEW: _COMMON_ERRORS,
    Command.RELEASE: _COMMON_ERRORS,
    Command.SEM_RELEASE: _COMMON_ERRORS,
    Command.AUTH: _COMMON_ERRORS,
    Command.STATS: _COMMON_ERRORS,
    Command.PING: _COMMON_ERRORS,
    Command.HELLO: _COMMON_ERRORS,
    Command.SHARDS: _COMMON_ERRORS,
    Command.HOLD: _LOCK_ERRORS,
    Command.NOTE: _COMMON_ERRORS,
    Command.TAKE: _COMMON_ERRORS | {constants.STATUS_ERROR_MAX_LOCKS},
    Command.HAND_DOWN: _COMMON_ERRORS,
    Command.ASKING: _COMMON_ERRORS,
}
_MOVABLE: Final = frozenset(
    {
        Command.LOCK,
        Command.SEM_LOCK,
        Command.HOLD,
        Command.ENQUEUE,
        Command.SEM_ENQUEUE,
        Command.WAIT,
        Command.SEM_WAIT,
    }
)
"""The requests a server may answer ``error_moved <HOST:PORT>``."""
_MOVED_ADDRESS_RE: Final = re.compile(r"[^\s:]+:[0-9]{1,5}|\[[0-9A-Fa-f:.]+\]:[0-9]{1,5}")


def _show(line: bytes | bytearray, limit: int = 80) -> str:
    shown = bytes(line[:limit])
    return repr(shown) + (f" (+{len(line) - limit} more bytes)" if len(line) > limit else "")


def _unexpected(command: Command, line: bytes | bytearray, why: str = "") -> ProtocolError:
    detail = f": {why}" if why else ""
    return ProtocolError(
        f"unexpected reply {_show(line)} to {command.label}{detail}; "
        "is the server a dflockd-compatible lock server on the right port?"
    )


def _parse_uint(command: Command, line: bytes, text: str) -> int:
    if not text.isascii() or not text.isdigit():
        raise _unexpected(command, line, f"{text!r} is not a non-negative integer")
    return int(text)


def _parse_grant(command: Command, line: bytes, fields: list[str]) -> Granted:
    if len(fields) != 2:
        raise _unexpected(command, line, "a grant is '<status> <token> <lease>'")
    token, lease = fields
    if not _TOKEN_RE.fullmatch(token):
        raise _unexpected(
            command, line, f"the token is not {constants.TOKEN_HEX_CHARS} lowercase hex"
        )
    seconds = _parse_uint(command, line, lease)
    if seconds == 0:
        # A lease of 0 s is over when it is granted: renewing it would spin.
        raise _unexpected(command, line, "a granted lease must be at least 1 second")
    return Granted(token, seconds)


_GRANTING: Final = frozenset(
    {Command.LOCK, Command.SEM_LOCK, Command.WAIT, Command.SEM_WAIT, Command.HOLD}
)
_RENEWING: Final = frozenset({Command.RENEW, Command.SEM_RENEW, Command.TAKE})
_ANSWERED_OK: Final = frozenset(
    {
        Command.RELEASE,
        Command.SEM_RELEASE,
        Command.AUTH,
        Command.PING,
        Command.NOTE,
        Command.HAND_DOWN,
        Command.ASKING,
    }
)
_OK: Final = Ok()


def decode_reply(command: Command, line: bytes) -> Reply:
    """Decode one reply line (without its ``\\n``; a trailing ``\\r`` is ignored).

    Raises `ProtocolError` when the line is not a valid reply to ``command``.
    """
    # The usual replies first, matched whole; anything else takes the general path below,
    # which decodes these exactly the same way.
    if command in _ANSWERED_OK:
        if line == b"ok":
            return _OK
    elif command in _GRANTING:
        if (match := _GRANT_LINE_RE.fullmatch(line)) is not None:
            return Granted(match[1].decode("ascii"), int(match[2]))
    elif command in _RENEWING and (match := _RENEWED_LINE_RE.fullmatch(line)) is not None:
        return Renewed(int(match[1]))
    if line.endswith(b"\r"):
        line = line[:-1]
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        raise _unexpected(command, line, "not UTF-8") from None
    if not text or text != text.strip(" "):
        raise _unexpected(command, line, "empty or padded line")
    status, *fields = text.split(" ")
    if _ERROR_CODE_RE.fullmatch(status):
        if status == constants.STATUS_ERROR_MOVED and command in _MOVABLE:
            if len(fields) != 1 or not _MOVED_ADDRESS_RE.fullmatch(fields[0]):
                raise _unexpected(command, line, "error_moved takes one HOST:PORT")
            return Moved(fields[0])
        if status == constants.STATUS_ERROR_ASK and command in _MOVABLE:
            if len(fields) != 1 or not _MOVED_ADDRESS_RE.fullmatch(fields[0]):
                raise _unexpected(command, line, "error_ask takes one HOST:PORT")
            return Asked(fields[0])
        if status == constants.STATUS_ERROR_BOUND and command is Command.TAKE:
            holder = fields[0] if len(fields) == 1 else ""
            if not _NOTE_RE.fullmatch(holder):
                raise _unexpected(command, line, "error_bound takes the holder's note")
            return Bound(None if holder == constants.NO_NOTE else holder)
        if fields or status not in _ALLOWED_ERRORS[command]:
            raise _unexpected(command, line)
        return ErrorReply(status)
    match command, status:
        case (
            Command.LOCK | Command.SEM_LOCK | Command.WAIT | Command.SEM_WAIT | Command.HOLD,
            "ok",
        ):
            return _parse_grant(command, line, fields)
        case (Command.HOLD, "timeout") if len(fields) <= 1:
            holder = fields[0] if fields else constants.NO_NOTE
            if not _NOTE_RE.fullmatch(holder):
                raise _unexpected(command, line, "the holder's note is not printable ASCII")
            return TimedOut(None if holder == constants.NO_NOTE else holder)
        case (
            Command.LOCK | Command.SEM_LOCK | Command.WAIT | Command.SEM_WAIT,
            "timeout",
        ) if not fields:
            return TimedOut()
        case (Command.ENQUEUE | Command.SEM_ENQUEUE, "acquired"):
            return _parse_grant(command, line, fields)
        case (Command.ENQUEUE | Command.SEM_ENQUEUE, "queued") if not fields:
            return Queued()
        case (Command.RENEW | Command.SEM_RENEW | Command.TAKE, "ok") if len(fields) == 1:
            return Renewed(_parse_uint(command, line, fields[0]))
        case (
            Command.RELEASE
            | Command.SEM_RELEASE
            | Command.AUTH
            | Command.PING
            | Command.NOTE
            | Command.HAND_DOWN
            | Command.ASKING,
            "ok",
        ) if not fields:
            return Ok()
        case (Command.STATS, "ok") if fields:
            return Stats(_parse_json_object(command, line, text[len(status) + 1 :]))
        case (Command.HELLO, "ok") if fields:
            return Hello(_parse_json_object(command, line, text[len(status) + 1 :]))
        case (Command.SHARDS, "ok") if fields:
            return Shards(_parse_json_object(command, line, text[len(status) + 1 :]))
        case _:
            raise _unexpected(command, line)


def _parse_json_object(command: Command, line: bytes, payload: str) -> dict[str, object]:
    try:
        data: object = json.loads(payload)
    except ValueError as exc:
        raise _unexpected(command, line, f"invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise _unexpected(command, line, "the JSON is not an object")
    return {str(k): v for k, v in data.items()}  # pyright: ignore[reportUnknownVariableType, reportUnknownArgumentType]


_JSON_REPLIES: Final = frozenset({Command.STATS, Command.HELLO, Command.SHARDS})


class ReplyParser:
    """Incremental reply decoder: `feed` bytes as they arrive, take replies with `next_reply`.

    Bytes after a complete reply stay buffered for the next one. A line longer than the limit
    (``max_line_bytes``, or ``max_stats_line_bytes`` for ``stats``) raises `ProtocolError` as
    soon as it is known to be too long, without buffering more of it.
    """

    __slots__ = ("_buffer", "_scanned", "max_line_bytes", "max_stats_line_bytes")

    def __init__(
        self,
        max_line_bytes: int = constants.MAX_LINE_BYTES,
        max_stats_line_bytes: int = MAX_STATS_LINE_BYTES,
    ) -> None:
        self.max_line_bytes = max_line_bytes
        self.max_stats_line_bytes = max_stats_line_bytes
        self._buffer = bytearray()
        self._scanned = 0  # bytes of _buffer already known to hold no newline

    def feed(self, data: bytes) -> None:
        """Append received bytes."""
        self._buffer += data

    def feed_reply(self, command: Command, data: bytes) -> Reply | None:
        """`feed` ``data``, then `next_reply`: one call for the usual case.

        When nothing is buffered and ``data`` is exactly one line within the limit (how a
        reply almost always arrives), it is decoded without passing through the buffer.
        """
        if not self._buffer and data.endswith(b"\n"):
            end = data.find(b"\n")
            if end == len(data) - 1 and end <= self._line_limit(command):
                return decode_reply(command, data[:end])
        self._buffer += data
        return self.next_reply(command)

    @property
    def buffered(self) -> int:
        """Bytes received and not yet consumed by a reply."""
        return len(self._buffer)

    def _line_limit(self, command: Command) -> int:
        if command in _JSON_REPLIES:
            return self.max_stats_line_bytes
        return self.max_line_bytes

    def next_reply(self, command: Command) -> Reply | None:
        """The next reply to ``command``, or None until its whole line has been fed."""
        limit = self._line_limit(command)
        end = self._buffer.find(b"\n", self._scanned)
        if end < 0:
            self._scanned = len(self._buffer)
            if self._scanned > limit:
                raise _unexpected(command, self._buffer, f"no newline within {limit} bytes")
            return None
        if end > limit:
            raise _unexpected(command, self._buffer[:end], f"line longer than {limit} bytes")
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        self._scanned = 0
        return decode_reply(command, line)
