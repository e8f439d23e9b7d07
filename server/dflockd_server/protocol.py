"""Sans-I/O request parsing and reply encoding for the dflockd protocol (PROTOCOL.md).

``RequestFramer`` cuts a byte stream into three-line frames, never buffering an over-long line;
one ``parse_<command>`` per command turns a frame's key and argument into its fields (a tuple)
or raises ``Malformed`` (the frame was consumed: the stream stays in step). The ``REPLY_*``
constants and ``reply_*`` functions are every reply's bytes.
"""

from __future__ import annotations

import json
from typing import Final

from dflockd_server import constants as c

# A byte is looked for in bytes as an int (``32 in key``): ``b" " in key`` costs CPython a
# TypeError raised and cleared.
_CR: Final = 13  # b"\r"
_SP: Final = 32  # b" "
_TAB: Final = 9  # b"\t"
_AUTH: Final = c.CMD_AUTH.encode()

_SESSION: Final = c.HELLO_SESSION.encode()
_PLACEHOLDER: Final = c.PLACEHOLDER.encode()
_DETACHED: Final = c.HOLD_MODE_DETACHED.encode()
_ON_CLOSE_RELEASE: Final = c.ON_CLOSE_RELEASE.encode()
_MODES: Final = (c.HOLD_MODE_CONNECTION.encode(), _DETACHED)
_MAX_LINE: Final = c.MAX_LINE_BYTES
_NUMBERS: Final[dict[bytes, int]] = {b"%d" % n: n for n in range(c.QUICK_NUMBERS)}
"""A request's usual numbers as clients write them -> their value (``_number``'s): one look-up
instead of ``isdigit`` and ``int``."""
_NOTE_BYTES: Final = bytes(range(0x21, 0x7F))
"""The bytes an owner note may hold (``!``..``~``), deleted by ``bytes.translate``."""


class LineTooLong(Exception):
    """A request line exceeds its limit: reply ``error`` and close the connection."""


class Malformed(Exception):
    """A complete request that breaks a rule: reply ``error``, keep the connection open."""


Frame = tuple[bytes, bytes, bytes]


def _all_short(lines: list[bytes]) -> bool:
    """Whether no line is over ``_MAX_LINE`` (a loop: cheaper than ``max`` or ``all``)."""
    for line in lines:  # noqa: SIM110 (see the docstring)
        if len(line) > _MAX_LINE:
            return False
    return True


class RequestFramer:
    """Accumulates received bytes and yields complete ``(command, key, argument)`` frames.
    Whole requests per read (no line over the limit, no CR) are split into lines once, each
    frame then three lines of that list; anything else is cut frame by frame. An incomplete
    frame is kept in a ``bytearray`` that grows in place."""

    __slots__ = ("_buf", "_line", "_lines", "_pos")

    def __init__(self) -> None:
        self._buf: bytes | bytearray = b""  # unparsed bytes start at _pos
        self._pos = 0
        self._lines: list[bytes] | None = None
        """``_buf`` split at every LF while its frames are taken from it; ``_line`` is the next
        frame's first line in it."""
        self._line = 0

    def feed(self, data: bytes) -> None:
        """Add received bytes. Call ``next_frame`` until it returns ``None`` afterwards."""
        buf = self._buf
        self._lines = None
        if self._pos >= len(buf):
            self._buf = data
            self._pos = 0
        elif isinstance(buf, bytearray) and self._pos == 0:
            buf += data
        else:
            grown = bytearray(memoryview(buf)[self._pos :])
            grown += data
            self._buf = grown
            self._pos = 0

    def buffered(self) -> int:
        return len(self._buf) - self._pos

    def clear(self) -> None:
        """Drop everything buffered (the connection is closing)."""
        self._buf = b""
        self._pos = 0
        self._lines = None

    def next_frame(self) -> Frame | None:
        """The next complete frame, or ``None`` (needs more bytes). Raises ``LineTooLong`` as
        soon as a line, complete or not, exceeds its limit."""
        lines = self._lines
        if lines is not None:
            i = self._line
            if i + 3 < len(lines):
                self._line = i + 3
                cmd, key, arg = lines[i], lines[i + 1], lines[i + 2]
                self._pos += len(cmd) + len(key) + len(arg) + 3
                return cmd, key, arg
            self._lines = None  # what is left is no whole frame: cut as below
            return None
        buf = self._buf
        pos = start = self._pos
        end = len(buf)
        if pos >= end:
            return None
        if pos == 0 and type(buf) is bytes and _CR not in buf:
            # Whole requests per read: split once, unless a line is over the limit (an ``auth``
            # secret may be): those are cut frame by frame below.
            lines = buf.split(b"\n")
            if len(lines) > 3 and (end <= _MAX_LINE or _all_short(lines)):
                self._lines = lines
                self._line = 3
                cmd, key, arg = lines[0], lines[1], lines[2]
                self._pos = len(cmd) + len(key) + len(arg) + 3
                return cmd, key, arg
        # Fast path: three complete short lines without CR (the usual request).
        nl1 = buf.find(b"\n", pos)
        if 0 <= nl1 - pos <= _MAX_LINE:
            nl2 = buf.find(b"\n", nl1 + 1)
            if 0 <= nl2 - nl1 - 1 <= _MAX_LINE:
                nl3 = buf.find(b"\n", nl2 + 1)
                if 0 <= nl3 - nl2 - 1 <= _MAX_LINE and buf.find(b"\r", pos, nl3) < 0:
                    self._pos = nl3 + 1
                    if type(buf) is bytes:  # slices of bytes are bytes already: no copies
                        return buf[pos:nl1], buf[nl1 + 1 : nl2], buf[nl2 + 1 : nl3]
                    return bytes(buf[pos:nl1]), bytes(buf[nl1 + 1 : nl2]), bytes(buf[nl2 + 1 : nl3])
        frame: list[bytes] = []
        for index in range(3):
            nl = buf.find(b"\n", pos)
            limit = c.MAX_AUTH_LINE_BYTES if index == 2 and frame[0] == _AUTH else _MAX_LINE
            if nl < 0:
                # The line is incomplete; allow one byte for a trailing CR.
                if end - pos > limit + 1:
                    raise LineTooLong
                self._keep(start)
                return None
            line = bytes(buf[pos:nl])
            if len(line) > limit and not (len(line) == limit + 1 and line[-1] == _CR):
                raise LineTooLong
            frame.append(line[:-1] if line and line[-1] == _CR else line)
            pos = nl + 1
        self._pos = pos
        return frame[0], frame[1], frame[2]

    def _keep(self, start: int) -> None:
        """Keep an incomplete frame, starting at ``start``, in a growable buffer."""
        self._lines = None
        buf = self._buf
        if isinstance(buf, bytearray):
            del buf[:start]
        else:
            self._buf = bytearray(memoryview(buf)[start:])
        self._pos = 0


def _number(raw: bytes, what: str) -> int:
    if not raw.isdigit():  # ASCII digits only: rejects signs, spaces, "", unicode digits
        raise Malformed(f"{what} is not a non-negative integer: {raw[:40]!r}")
    value = int(raw)
    if value > c.MAX_NUMBER:
        raise Malformed(f"{what} above {c.MAX_NUMBER}: {raw[:40]!r}")
    return value


def _lease(raw: bytes) -> int:
    value = _number(raw, "lease")
    if value <= 0:
        raise Malformed("lease must be > 0")
    return value


def _limit(raw: bytes) -> int:
    value = _number(raw, "limit")
    if not c.MIN_SEMAPHORE_LIMIT <= value <= c.MAX_SEMAPHORE_LIMIT:
        raise Malformed(f"limit must be {c.MIN_SEMAPHORE_LIMIT}..{c.MAX_SEMAPHORE_LIMIT}")
    return value


def _key(raw: bytes) -> str:
    if not raw:
        raise Malformed("empty key")
    if _SP in raw or _TAB in raw or _CR in raw:
        raise Malformed("key holds whitespace")
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise Malformed("key is not UTF-8") from None


def _token(raw: bytes) -> str:
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise Malformed("token is not ASCII") from None


def _note(raw: bytes) -> str:
    """An owner note: 1..``MAX_NOTE_BYTES`` printable ASCII bytes without space (``!``..``~``)."""
    if not 1 <= len(raw) <= c.MAX_NOTE_BYTES:
        raise Malformed(f"note must be 1..{c.MAX_NOTE_BYTES} bytes, got {len(raw)}")
    if raw.translate(None, _NOTE_BYTES):  # what is left is outside '!'..'~'
        raise Malformed(f"note holds a byte outside '!'..'~': {raw[:40]!r}")
    return raw.decode("ascii")


def _fields(arg: bytes, fewest: int, most: int, cmd: str | bytes, usage: str) -> list[bytes]:
    """``arg`` split at whitespace; ``Malformed`` naming ``cmd``'s ``usage`` unless it has
    ``fewest`` to ``most`` fields."""
    parts = arg.split()
    if not fewest <= len(parts) <= most:
        raise Malformed(f"{cmd if isinstance(cmd, str) else cmd.decode()} takes {usage}")
    return parts


# Each parser checks its frame against PROTOCOL.md's rules, in the order the fields come; the
# usual shapes cost a look-up, any other goes the rest of the same function.


def parse_lock(key: bytes, arg: bytes) -> tuple[str, int, int | None]:
    """``l <key>`` ``<timeout> [<lease>]`` -> (key, timeout, lease or None)."""
    name = _key(key)
    timeout = _NUMBERS.get(arg)
    if timeout is not None:  # ``<timeout>`` alone, a usual number
        return name, timeout, None
    parts = arg.split()  # not _fields: a call more per lock with a lease, the usual shape
    n = len(parts)
    if not 1 <= n <= 2:
        raise Malformed(f"{c.CMD_LOCK} takes <timeout> [<lease>]")
    timeout = _NUMBERS.get(parts[0])
    if timeout is None:
        timeout = _number(parts[0], "timeout")
    if n == 1:
        return name, timeout, None
    return name, timeout, _NUMBERS.get(parts[1]) or _lease(parts[1])  # 0: _lease refuses it


def parse_sem_lock(key: bytes, arg: bytes) -> tuple[str, int, int, int | None]:
    """``sl <key>`` ``<timeout> <limit> [<lease>]`` -> (key, timeout, limit, lease or None)."""
    name = _key(key)
    parts = arg.split()  # not _fields: a call more per acquire
    n = len(parts)
    if not 2 <= n <= 3:
        raise Malformed(f"{c.CMD_SEM_LOCK} takes <timeout> <limit> [<lease>]")
    timeout = _NUMBERS.get(parts[0])
    if timeout is None:
        timeout = _number(parts[0], "timeout")
    limit = _limit(parts[1])
    return name, timeout, limit, (_NUMBERS.get(parts[2]) or _lease(parts[2])) if n == 3 else None


def parse_hold(key: bytes, arg: bytes) -> tuple[str, int, int, bool, str]:
    """``hl <key>`` ``<timeout> <lease> <mode> <note>`` -> (key, timeout, lease, detached,
    note)."""
    name = _key(key)
    parts = arg.split(b" ")  # single spaces, as clients send
    if len(parts) == 4:
        timeout_raw, lease_raw, mode, note = parts
        timeout = _NUMBERS.get(timeout_raw)
        lease = _NUMBERS.get(lease_raw)
        if (
            timeout is not None
            and lease
            and mode in _MODES
            and 1 <= len(note) <= c.MAX_NOTE_BYTES
            and not note.translate(None, _NOTE_BYTES)
        ):
            return name, timeout, lease, mode == _DETACHED, note.decode("ascii")
    parts = _fields(arg, 4, 4, c.CMD_HOLD, "<timeout> <lease> <mode> <note>")  # the rules in full
    timeout_raw, lease_raw, mode, note = parts
    timeout = _number(timeout_raw, "timeout")
    lease = _lease(lease_raw)
    if mode not in _MODES:
        raise Malformed(f"{c.CMD_HOLD} mode must be c or d: {mode[:40]!r}")
    return name, timeout, lease, mode == _DETACHED, _note(note)


def parse_release(cmd: bytes, key: bytes, arg: bytes) -> tuple[str, str]:
    """``r`` / ``sr`` (``cmd``) ``<key>`` ``<token>`` -> (key, token)."""
    name = _key(key)
    if arg.isalnum():  # a plain token (ASCII letters and digits, no space): as it is
        return name, arg.decode("ascii")
    return name, _token(_fields(arg, 1, 1, cmd, "<token>")[0])


def parse_renew(cmd: bytes, key: bytes, arg: bytes) -> tuple[str, str, int | None]:
    """``n`` / ``sn`` (``cmd``) ``<key>`` ``<token> [<lease>]`` -> (key, token, lease or
    None)."""
    name = _key(key)
    parts = _fields(arg, 1, 2, cmd, "<token> [<lease>]")
    token = _token(parts[0])
    if len(parts) == 1:
        return name, token, None
    return name, token, _NUMBERS.get(parts[1]) or _lease(parts[1])


def parse_note(key: bytes, arg: bytes) -> tuple[str, str, str]:
    """``note <key>`` ``<token> <note>`` -> (key, token, note)."""
    name = _key(key)
    parts = _fields(arg, 2, 2, c.CMD_NOTE, "<token> <note>")
    return name, _token(parts[0]), _note(parts[1])


def parse_take(key: bytes, arg: bytes) -> tuple[str, str, int, int | None, str]:
    """``ht <key>`` ``<token> <lease> <onclose> <note>`` -> (key, token, lease, on_close,
    note); ``on_close``: ``None`` for ``r`` (released at the close)."""
    name = _key(key)
    parts = _fields(arg, 4, 4, c.CMD_TAKE, "<token> <lease> <onclose> <note>")
    token = _token(parts[0])
    lease = _lease(parts[1])
    on_close: int | None = None
    if parts[2] != _ON_CLOSE_RELEASE:
        try:
            on_close = _lease(parts[2])
        except Malformed:
            raise Malformed(
                f"{c.CMD_TAKE} onclose must be r or a lease > 0: {parts[2][:40]!r}"
            ) from None
    return name, token, lease, on_close, _note(parts[3])


def parse_hand_down(key: bytes, arg: bytes) -> tuple[str, str, int]:
    """``hd <key>`` ``<token> <lease>`` -> (key, token, lease)."""
    name = _key(key)
    parts = _fields(arg, 2, 2, c.CMD_HAND_DOWN, "<token> <lease>")
    return name, _token(parts[0]), _lease(parts[1])


def parse_force_release(key: bytes, arg: bytes) -> tuple[str, str | None]:
    """``fr <key>`` ``<note>`` (or ``_``) -> (key, who asks or None)."""
    name = _key(key)
    note = _fields(arg, 1, 1, c.CMD_FORCE_RELEASE, "<note> (or _)")[0]
    return name, None if note == _PLACEHOLDER else _note(note)


def parse_enqueue(key: bytes, arg: bytes) -> tuple[str, int | None]:
    """``e <key>`` ``[<lease>]`` (or ``_``) -> (key, lease or None)."""
    name = _key(key)
    parts = _fields(arg, 0, 1, c.CMD_ENQUEUE, "[<lease>]")
    return name, _lease(parts[0]) if parts and parts[0] != _PLACEHOLDER else None


def parse_sem_enqueue(key: bytes, arg: bytes) -> tuple[str, int, int | None]:
    """``se <key>`` ``<limit> [<lease>]`` -> (key, limit, lease or None)."""
    name = _key(key)
    parts = _fields(arg, 1, 2, c.CMD_SEM_ENQUEUE, "<limit> [<lease>]")
    limit = _limit(parts[0])
    return name, limit, _lease(parts[1]) if len(parts) == 2 else None


def parse_wait(cmd: bytes, key: bytes, arg: bytes) -> tuple[str, int]:
    """``w`` / ``sw`` (``cmd``) ``<key>`` ``<timeout>`` -> (key, timeout)."""
    return _key(key), _number(_fields(arg, 1, 1, cmd, "<timeout>")[0], "timeout")


def check_text(key: bytes, arg: bytes) -> None:
    """A request that reads no key (``ping``, ``hello``, ``stats``, ``shards``): its lines are
    UTF-8 all the same, else ``Malformed`` as for any other command."""
    if not (key.isascii() and arg.isascii()):
        try:
            key.decode()
            arg.decode()
        except UnicodeDecodeError:
            raise Malformed("request is not UTF-8") from None


def parse_auth(arg: bytes) -> bytes:
    """``auth _`` ``<secret>`` -> the secret (its surrounding whitespace dropped)."""
    return arg.strip()


def parse_hello(arg: bytes) -> bool:
    """``hello _`` ``[session]`` -> whether the client asks for a session connection."""
    return arg.strip() == _SESSION


def parse_client_session(arg: bytes) -> tuple[str, int] | None:
    """``hello _`` ``session <id> <ttl>`` -> (id, ttl) (a TTL of 0: the session ends now), else
    ``None``; ``Malformed`` for ``session`` followed by anything but a valid id and a TTL."""
    parts = arg.split()
    if len(parts) < 2 or parts[0] != _SESSION:
        return None
    if len(parts) != 3:
        raise Malformed("hello session takes an id and a ttl")
    return session_id(parts[1]), _number(parts[2], "session ttl")


def session_id(raw: bytes) -> str:
    """A client session's id as sent (``hello _ session``, ``ping _ session``), checked."""
    text = raw.decode("ascii", "replace")
    if not c.SESSION_ID_MIN <= len(text) <= c.SESSION_ID_MAX or not c.SESSION_ID_CHARS.issuperset(
        text
    ):
        raise Malformed(
            f"a session id is {c.SESSION_ID_MIN} to {c.SESSION_ID_MAX} letters, digits, - or _"
        )
    return text


def parse_keepalive(arg: bytes) -> str | None:
    """``ping _`` ``[session <id>]`` -> the client session to keep alive; ``None`` for any
    other argument (ignored); ``Malformed`` for ``session`` followed by anything but one id."""
    if not arg.startswith(_SESSION):
        return None
    parts = arg.split()
    if parts[0] != _SESSION:
        return None
    if len(parts) != 2:
        raise Malformed("ping session takes one id")
    return session_id(parts[1])


def parse_asking(key: bytes, arg: bytes) -> tuple[str, str]:
    """``asking <key>`` ``<ticket>`` -> (key, ticket), as sent (undecodable bytes replaced)."""
    return key.decode("utf-8", "replace").strip(), arg.decode("ascii", "replace").strip()


def unknown_command(cmd: bytes) -> Malformed:
    """The error of a frame whose command is none of PROTOCOL.md's."""
    return Malformed(f"unknown command {cmd[:40]!r}")


def _fixed(status: str) -> bytes:
    return f"{status}\n".encode()


REPLY_OK: Final = _fixed(c.STATUS_OK)
REPLY_QUEUED: Final = _fixed(c.STATUS_QUEUED)
REPLY_TIMEOUT: Final = _fixed(c.STATUS_TIMEOUT)
REPLY_ERROR: Final = _fixed(c.STATUS_ERROR)
REPLY_ERROR_AUTH: Final = _fixed(c.STATUS_ERROR_AUTH)
REPLY_ERROR_MAX_LOCKS: Final = _fixed(c.STATUS_ERROR_MAX_LOCKS)
REPLY_ERROR_MAX_WAITERS: Final = _fixed(c.STATUS_ERROR_MAX_WAITERS)
REPLY_ERROR_LIMIT_MISMATCH: Final = _fixed(c.STATUS_ERROR_LIMIT_MISMATCH)
REPLY_ERROR_NOT_ENQUEUED: Final = _fixed(c.STATUS_ERROR_NOT_ENQUEUED)
REPLY_ERROR_ALREADY_ENQUEUED: Final = _fixed(c.STATUS_ERROR_ALREADY_ENQUEUED)
REPLY_ERROR_LEASE_EXPIRED: Final = _fixed(c.STATUS_ERROR_LEASE_EXPIRED)
REPLY_ERROR_DRAINING: Final = _fixed(c.STATUS_ERROR_DRAINING)
REPLY_ERROR_UNAVAILABLE: Final = _fixed(c.STATUS_ERROR_UNAVAILABLE)
REPLY_ERROR_READ_ONLY: Final = _fixed(c.STATUS_ERROR_READ_ONLY)


def reply_moved(address: str) -> bytes:
    """``error_moved <HOST:PORT>``: ``address`` serves the key."""
    return f"{c.STATUS_ERROR_MOVED} {address}\n".encode()


def reply_ask(address: str, ticket: str = "") -> bytes:
    """``error_ask <HOST:PORT> [<ticket>]``: ask ``address`` for this key, once."""
    return f"{c.STATUS_ERROR_ASK} {address}{' ' if ticket else ''}{ticket}\n".encode()


_GRANTED: Final = b"%s %%s %%d\n" % c.STATUS_OK.encode()
_ACQUIRED: Final = b"%s %%s %%d\n" % c.STATUS_ACQUIRED.encode()


def reply_granted(token: str, lease: int) -> bytes:
    """``ok <token> <lease>``: a grant (to ``l``, ``sl``, ``hl``, ``w``, ``sw``)."""
    return _GRANTED % (token.encode(), lease)


def reply_acquired(token: str, lease: int) -> bytes:
    """``acquired <token> <lease>``: a grant at once to ``e`` / ``se``."""
    return _ACQUIRED % (token.encode(), lease)


def reply_held_by(note: str | None) -> bytes:
    """``timeout <holder-note>`` (``hl``): the note of the key's holder, ``_`` for none."""
    return f"{c.STATUS_TIMEOUT} {note or c.NO_NOTE}\n".encode()


def reply_bound(note: str | None) -> bytes:
    """``error_bound <holder-note>`` (``ht``): the grant is bound to a live connection."""
    return f"{c.STATUS_ERROR_BOUND} {note or c.NO_NOTE}\n".encode()


def reply_number(number: int) -> bytes:
    """``ok <number>``: a renewal's seconds left (``n``, ``ht``), the grants ``fr`` freed."""
    return f"{c.STATUS_OK} {number}\n".encode()


def reply_json(body: object) -> bytes:
    """``ok <one-line JSON>`` (``stats``, ``shards``, ``hello``)."""
    return f"{c.STATUS_OK} {json.dumps(body, separators=(',', ':'))}\n".encode()


def reply_hello(
    version: str,
    *,
    max_lease_ttl_s: int,
    default_lease_ttl_s: int,
    run: str,
    durable: bool = False,
    grace_s: float = 0.0,
    session_ttl_s: int = c.DEFAULT_SESSION_TTL_S,
    build: str = "",
    loop: str = "",
) -> bytes:
    """``ok {"server": ..., "version": ..., "features": [...]}`` on one line. ``durable``: a
    lease journal (adds ``durable`` and ``read_only``); ``grace_s`` > 0: the restart grace
    still to run; ``session_ttl_s`` 0: no sessions (neither ``session`` nor ``keepalive``
    listed); ``build`` and ``loop``: what runs, for people and benchmarks; ``run``: this start
    of the server (random), by which a session's client sees a restart."""
    features: list[str] = list(c.FEATURES)
    if durable:
        features += (c.FEATURE_DURABLE, c.FEATURE_READ_ONLY)
    if session_ttl_s > 0:
        features += (c.FEATURE_SESSION, c.FEATURE_KEEPALIVE)
    body: dict[str, object] = {"server": c.SERVER_NAME, "version": version, "features": features}
    if build:
        body["build"] = build
    if loop:
        body["loop"] = loop
    body["max_lease_ttl_s"] = max_lease_ttl_s
    body["default_lease_ttl_s"] = default_lease_ttl_s
    if session_ttl_s > 0:
        body["session_ttl_s"] = session_ttl_s
    if grace_s > 0:
        body["grace_remaining_s"] = round(grace_s, 3)
    body["run"] = run
    return reply_json(body)
