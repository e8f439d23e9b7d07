"""The dflockd protocol's replies, without I/O: one typed reply per line, checked against the
command it answers (`decode_reply`; anything else raises `ProtocolError` naming what arrived),
and `ReplyParser`, fed bytes as they arrive in any chunking."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Final

from celery_dflock.client import wire
from celery_dflock.client._requests import NOTE_RE, TOKEN_RE, Command
from celery_dflock.client.errors import ProtocolError

MAX_STATS_LINE_BYTES: Final = 64 * 1024 * 1024  # the longest `stats` reply (others: one line)

_ERROR_CODE_RE: Final = re.compile(r"error(_[a-z_]+)?")
_GRANT_LINE_RE: Final = re.compile(rb"ok ([0-9a-f]{%d}) ([1-9][0-9]*)" % wire.TOKEN_HEX_CHARS)
_RENEWED_LINE_RE: Final = re.compile(rb"ok ([0-9]+)")


@dataclass(frozen=True, slots=True)
class Granted:
    """``ok <token> <lease>`` (or ``acquired ...`` to an enqueue): the lock is held."""

    token: str
    lease: int

    def __repr__(self) -> str:  # never print a bearer credential in full
        return f"Granted(token='{self.token[:8]}...', lease={self.lease})"


@dataclass(frozen=True, slots=True)
class Queued:
    """``queued``: enqueued, the grant comes with a later ``w``."""


@dataclass(frozen=True, slots=True)
class TimedOut:
    """``timeout``: not granted within the timeout (to ``hl``: with the holder's note)."""

    holder: str | None = None


@dataclass(frozen=True, slots=True)
class Renewed:
    """``ok <seconds_remaining>``: the lease was extended."""

    seconds_remaining: int


@dataclass(frozen=True, slots=True)
class Freed:
    """``ok <grants>`` to ``fr``: how many grants the force release freed (0: none held)."""

    grants: int


@dataclass(frozen=True, slots=True)
class Ok:
    """Bare ``ok`` (release, auth, ping)."""


@dataclass(frozen=True, slots=True)
class JsonReply:
    """``ok <json>`` to ``stats``, ``hello`` or ``shards``: the decoded JSON object."""

    data: dict[str, object]


@dataclass(frozen=True, slots=True)
class Moved:
    """``error_moved <HOST:PORT>`` to an acquire: the key is served by that member."""

    address: str


@dataclass(frozen=True, slots=True)
class Asked:
    """``error_ask <HOST:PORT> [<ticket>]`` to an acquire: ask for this key there, once, with
    ``asking`` first passing ``ticket`` along (the member's proof that it let the key go)."""

    address: str
    ticket: str | None = None


@dataclass(frozen=True, slots=True)
class Bound:
    """``error_bound <holder-note>`` to ``ht``: the grant is bound to another live connection."""

    holder: str | None


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """``error`` or ``error_<reason>``: the server refused the request."""

    code: str


Reply = (
    Granted | Queued | TimedOut | Renewed | Ok | Freed | JsonReply
    | Moved | Asked | Bound | ErrorReply
)  # fmt: skip

_COMMON_ERRORS: Final = frozenset(
    {wire.STATUS_ERROR, wire.STATUS_ERROR_AUTH, wire.STATUS_ERROR_DRAINING}
)
_LOCK_ERRORS: Final = _COMMON_ERRORS | {
    wire.STATUS_ERROR_MAX_LOCKS, wire.STATUS_ERROR_MAX_WAITERS, wire.STATUS_ERROR_LIMIT_MISMATCH,
    wire.STATUS_ERROR_UNAVAILABLE, wire.STATUS_ERROR_READ_ONLY,
}  # fmt: skip
_ENQUEUE_ERRORS: Final = _LOCK_ERRORS | {wire.STATUS_ERROR_ALREADY_ENQUEUED}
_WAIT_ERRORS: Final = _COMMON_ERRORS | {
    wire.STATUS_ERROR_UNAVAILABLE, wire.STATUS_ERROR_READ_ONLY,
    wire.STATUS_ERROR_NOT_ENQUEUED, wire.STATUS_ERROR_LEASE_EXPIRED,
}  # fmt: skip
_RENEW_ERRORS: Final = _COMMON_ERRORS | {
    wire.STATUS_ERROR_MAX_LOCKS,  # a reattach by token refused for --max-locks-per-ip: lost
    wire.STATUS_ERROR_UNAVAILABLE,  # a cluster member not knowing its shards yet: asked again
    wire.STATUS_ERROR_READ_ONLY,  # a longer lease whose bound the server's disk cannot record
}
_REBIND_ERRORS: Final = _COMMON_ERRORS | {
    wire.STATUS_ERROR_READ_ONLY,
    wire.STATUS_ERROR_UNAVAILABLE,  # a longer lease's bound a cluster member could not publish
}
_ALLOWED_ERRORS: Final[dict[Command, frozenset[str]]] = {
    **dict.fromkeys(Command, _COMMON_ERRORS),
    **dict.fromkeys((Command.LOCK, Command.SEM_LOCK, Command.HOLD), _LOCK_ERRORS),
    **dict.fromkeys((Command.ENQUEUE, Command.SEM_ENQUEUE), _ENQUEUE_ERRORS),
    **dict.fromkeys((Command.WAIT, Command.SEM_WAIT), _WAIT_ERRORS),
    **dict.fromkeys((Command.RENEW, Command.SEM_RENEW), _RENEW_ERRORS),
    Command.NOTE: _COMMON_ERRORS | {wire.STATUS_ERROR_READ_ONLY},
    Command.TAKE: _REBIND_ERRORS | {wire.STATUS_ERROR_MAX_LOCKS},
    Command.HAND_DOWN: _REBIND_ERRORS,
    Command.FORCE_RELEASE: _COMMON_ERRORS | {wire.STATUS_ERROR_UNAVAILABLE},
    # A keep-alive to a cluster member not knowing its shards yet: asked again.
    Command.PING: _COMMON_ERRORS | {wire.STATUS_ERROR_UNAVAILABLE},
}
_GRANTING: Final = frozenset(
    {Command.LOCK, Command.SEM_LOCK, Command.WAIT, Command.SEM_WAIT, Command.HOLD}
)
_RENEWING: Final = frozenset({Command.RENEW, Command.SEM_RENEW, Command.TAKE})
_ANSWERED_OK: Final = frozenset({
    Command.RELEASE, Command.SEM_RELEASE, Command.AUTH, Command.PING, Command.NOTE,
    Command.HAND_DOWN, Command.ASKING,
})  # fmt: skip
MAY_GRANT: Final = _GRANTING | {Command.ENQUEUE, Command.SEM_ENQUEUE}
"""The requests whose reply may be a grant (an enqueue's: ``acquired <token> <lease>``)."""
_MOVABLE: Final = MAY_GRANT | {Command.FORCE_RELEASE}  # may be answered `error_moved <HOST:PORT>`
_MOVED_ADDRESS_RE: Final = re.compile(r"[^\s:]+:[0-9]{1,5}|\[[0-9A-Fa-f:.]+\]:[0-9]{1,5}")
_TICKET_RE: Final = re.compile(r"[!-~]{1,200}")  # an ask ticket, passed on as it came, never read


def _unexpected(command: Command, line: bytes | bytearray, why: str = "") -> ProtocolError:
    detail = f": {why}" if why else ""
    more = f" (+{len(line) - 80} more bytes)" if len(line) > 80 else ""
    return ProtocolError(
        f"unexpected reply {bytes(line[:80])!r}{more} to {command.label}{detail}; "
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
    if not TOKEN_RE.fullmatch(token):
        raise _unexpected(command, line, f"the token is not {wire.TOKEN_HEX_CHARS} lowercase hex")
    seconds = _parse_uint(command, line, lease)
    if seconds == 0:
        # A lease of 0 s is over when it is granted: renewing it would spin.
        raise _unexpected(command, line, "a granted lease must be at least 1 second")
    return Granted(token, seconds)


_OK: Final = Ok()
_JSON_REPLIES: Final = frozenset({Command.STATS, Command.HELLO, Command.SHARDS})


def decode_reply(command: Command, line: bytes) -> Reply:
    """Decode one reply line (without its ``\\n``; a trailing ``\\r`` is ignored)."""
    # The usual replies first, matched whole; the general path below decodes them the same.
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
        if status == wire.STATUS_ERROR_MOVED and command in _MOVABLE:
            if len(fields) != 1 or not _MOVED_ADDRESS_RE.fullmatch(fields[0]):
                raise _unexpected(command, line, "error_moved takes one HOST:PORT")
            return Moved(fields[0])
        if status == wire.STATUS_ERROR_ASK and command in _MOVABLE:
            if (
                not 1 <= len(fields) <= 2
                or not _MOVED_ADDRESS_RE.fullmatch(fields[0])
                or (len(fields) == 2 and not _TICKET_RE.fullmatch(fields[1]))
            ):
                raise _unexpected(command, line, "error_ask takes one HOST:PORT and a ticket")
            return Asked(fields[0], fields[1] if len(fields) == 2 else None)
        if status == wire.STATUS_ERROR_BOUND and command is Command.TAKE:
            holder = fields[0] if len(fields) == 1 else ""
            if not NOTE_RE.fullmatch(holder):
                raise _unexpected(command, line, "error_bound takes the holder's note")
            return Bound(None if holder == wire.NO_NOTE else holder)
        if fields or status not in _ALLOWED_ERRORS[command]:
            raise _unexpected(command, line)
        return ErrorReply(status)
    if status == "ok":
        if command in _GRANTING:
            return _parse_grant(command, line, fields)
        if command in _RENEWING and len(fields) == 1:
            return Renewed(_parse_uint(command, line, fields[0]))
        if command in _ANSWERED_OK and not fields:
            return _OK
        if command is Command.FORCE_RELEASE and len(fields) == 1:
            return Freed(_parse_uint(command, line, fields[0]))
        if command in _JSON_REPLIES and fields:
            return JsonReply(_parse_json_object(command, line, text[3:]))
    elif status == "timeout" and command in _GRANTING:
        if command is Command.HOLD and len(fields) <= 1:
            holder = fields[0] if fields else wire.NO_NOTE
            if not NOTE_RE.fullmatch(holder):
                raise _unexpected(command, line, "the holder's note is not printable ASCII")
            return TimedOut(None if holder == wire.NO_NOTE else holder)
        if not fields:
            return TimedOut()
    elif command is Command.ENQUEUE or command is Command.SEM_ENQUEUE:
        if status == "acquired":
            return _parse_grant(command, line, fields)
        if status == "queued" and not fields:
            return Queued()
    raise _unexpected(command, line)


def _parse_json_object(command: Command, line: bytes, payload: str) -> dict[str, object]:
    try:
        data: object = json.loads(payload)
    except ValueError as exc:
        raise _unexpected(command, line, f"invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise _unexpected(command, line, "the JSON is not an object")
    return {str(k): v for k, v in data.items()}  # pyright: ignore[reportUnknownVariableType, reportUnknownArgumentType]


class ReplyParser:
    """Incremental reply decoder: `feed` bytes as they arrive, take replies with `next_reply`.
    A line over the limit raises `ProtocolError` as soon as it is known."""

    __slots__ = ("_buffer", "_scanned", "max_line_bytes", "max_stats_line_bytes")

    def __init__(self) -> None:
        self.max_line_bytes = wire.MAX_LINE_BYTES  # (tests set smaller limits)
        self.max_stats_line_bytes = MAX_STATS_LINE_BYTES
        self._buffer = bytearray()
        self._scanned = 0  # bytes of _buffer already known to hold no newline

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def feed_reply(self, command: Command, data: bytes) -> Reply | None:
        """`feed` ``data``, then `next_reply` (a whole line with the buffer empty skips it)."""
        if not self._buffer and data.endswith(b"\n"):
            end = data.find(b"\n")
            if end == len(data) - 1 and end <= self._line_limit(command):
                return decode_reply(command, data[:end])
        self._buffer += data
        return self.next_reply(command)

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def _line_limit(self, command: Command) -> int:
        return self.max_stats_line_bytes if command in _JSON_REPLIES else self.max_line_bytes

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
