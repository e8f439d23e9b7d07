"""The sans-I/O codec: request encoders and the incremental reply parser, byte by byte."""

from __future__ import annotations

import json

import pytest

from celery_dflock.client import _by_token, _replies, _requests
from celery_dflock.client._replies import (
    ErrorReply,
    Granted,
    JsonReply,
    Ok,
    Queued,
    Renewed,
    Reply,
    ReplyParser,
    TimedOut,
)
from celery_dflock.client._requests import Command
from celery_dflock.client._settings import (
    check_auth_token,
    check_limit,
    lease_seconds,
    whole_seconds,
)
from celery_dflock.client.errors import ProtocolError
from dflockd_server import constants
from tests.support.wire import SERVER_COMMANDS

TOKEN = "0000018f2b3c4d5e" + "a1b2c3d4e5f60718"
STATS_JSON = {"connections": 2, "locks": [{"key": "k", "owner_conn_id": 1}], "semaphores": []}
HELLO_JSON = {"server": "dflockd-server", "version": "0.2.0", "features": ["fence", "ping"]}

GRANT_COMMANDS = (Command.LOCK, Command.SEM_LOCK, Command.WAIT, Command.SEM_WAIT)
COMMON_ERRORS = ("error", "error_auth", "error_draining")

# (command, reply line, decoded reply): every reply the protocol defines, per command.
VALID: list[tuple[Command, bytes, Reply]] = [
    *[(c, f"ok {TOKEN} 33\n".encode(), Granted(TOKEN, 33)) for c in GRANT_COMMANDS],
    *[(c, b"timeout\n", TimedOut()) for c in GRANT_COMMANDS],
    *[
        (c, f"{code}\n".encode(), ErrorReply(code))
        for c in (Command.LOCK, Command.SEM_LOCK, Command.ENQUEUE, Command.SEM_ENQUEUE)
        for code in ("error_max_locks", "error_max_waiters", *COMMON_ERRORS)
    ],
    *[
        (c, b"error_limit_mismatch\n", ErrorReply("error_limit_mismatch"))
        for c in (Command.LOCK, Command.SEM_LOCK, Command.ENQUEUE, Command.SEM_ENQUEUE)
    ],
    *[
        (c, f"{code}\n".encode(), ErrorReply(code))
        for c in (Command.WAIT, Command.SEM_WAIT)
        for code in ("error_not_enqueued", "error_lease_expired", *COMMON_ERRORS)
    ],
    *[(c, f"acquired {TOKEN} 7\n".encode(), Granted(TOKEN, 7)) for c in (Command.ENQUEUE,)],
    (Command.SEM_ENQUEUE, f"acquired {TOKEN} 7\n".encode(), Granted(TOKEN, 7)),
    (Command.ENQUEUE, b"queued\n", Queued()),
    (Command.SEM_ENQUEUE, b"queued\n", Queued()),
    (Command.ENQUEUE, b"error_already_enqueued\n", ErrorReply("error_already_enqueued")),
    (Command.SEM_ENQUEUE, b"error_already_enqueued\n", ErrorReply("error_already_enqueued")),
    *[(c, b"ok 31\n", Renewed(31)) for c in (Command.RENEW, Command.SEM_RENEW)],
    *[
        (c, f"{code}\n".encode(), ErrorReply(code))
        for c in (Command.RENEW, Command.SEM_RENEW, Command.RELEASE, Command.SEM_RELEASE)
        for code in COMMON_ERRORS
    ],
    *[(c, b"ok\n", Ok()) for c in (Command.RELEASE, Command.SEM_RELEASE, Command.PING)],
    (Command.AUTH, b"ok\n", Ok()),
    (Command.AUTH, b"error_auth\n", ErrorReply("error_auth")),
    (Command.AUTH, b"error\n", ErrorReply("error")),
    (Command.PING, b"error_draining\n", ErrorReply("error_draining")),
    (Command.STATS, b"ok " + json.dumps(STATS_JSON).encode() + b"\n", JsonReply(STATS_JSON)),
    (Command.HELLO, b"ok " + json.dumps(HELLO_JSON).encode() + b"\n", JsonReply(HELLO_JSON)),
    *[(Command.HELLO, f"{code}\n".encode(), ErrorReply(code)) for code in COMMON_ERRORS],
    (Command.LOCK, f"ok {TOKEN} 33\r\n".encode(), Granted(TOKEN, 33)),  # CR tolerated
]


def _ids(case: tuple[Command, bytes, Reply]) -> str:
    return f"{case[0].value}:{case[1][:24]!r}"


@pytest.mark.parametrize("case", VALID, ids=[_ids(c) for c in VALID])
def test_reply_fed_whole(case: tuple[Command, bytes, Reply]) -> None:
    command, line, expected = case
    parser = ReplyParser()
    parser.feed(line)
    assert parser.next_reply(command) == expected
    assert parser.buffered == 0
    assert parser.next_reply(command) is None


@pytest.mark.parametrize("case", VALID, ids=[_ids(c) for c in VALID])
def test_reply_fed_one_byte_at_a_time(case: tuple[Command, bytes, Reply]) -> None:
    command, line, expected = case
    parser = ReplyParser()
    for byte in line[:-1]:
        parser.feed(bytes([byte]))
        assert parser.next_reply(command) is None
    parser.feed(line[-1:])
    assert parser.next_reply(command) == expected
    assert parser.buffered == 0


@pytest.mark.parametrize("case", VALID, ids=[_ids(c) for c in VALID])
def test_reply_with_trailing_data_kept_for_the_next(case: tuple[Command, bytes, Reply]) -> None:
    command, line, expected = case
    parser = ReplyParser()
    parser.feed(line + b"ok 12\nok")  # the next reply (to a renew) and the start of another
    assert parser.next_reply(command) == expected
    assert parser.buffered == len(b"ok 12\nok")
    assert parser.next_reply(Command.RENEW) == Renewed(12)
    assert parser.next_reply(Command.PING) is None
    parser.feed(b"\n")
    assert parser.next_reply(Command.PING) == Ok()


def test_two_replies_in_one_chunk_one_byte_at_a_time() -> None:
    parser = ReplyParser()
    replies: list[Reply] = []
    for byte in f"queued\nok {TOKEN} 5\n".encode():
        parser.feed(bytes([byte]))
        command = Command.ENQUEUE if not replies else Command.WAIT
        if (reply := parser.next_reply(command)) is not None:
            replies.append(reply)
    assert replies == [Queued(), Granted(TOKEN, 5)]


def test_granted_hides_token_in_repr() -> None:
    granted = Granted(TOKEN, 33)
    assert _requests.fence_of(granted.token) == 0x0000018F2B3C4D5E
    assert TOKEN not in repr(granted)


GARBAGE: list[tuple[Command, bytes]] = [
    (Command.LOCK, b"hello world\n"),
    (Command.LOCK, b"\xff\xfe\xfd\n"),
    (Command.LOCK, b"\n"),
    (Command.LOCK, b" ok 1 2\n"),
    (Command.LOCK, b"OK " + TOKEN.encode() + b" 33\n"),
    (Command.LOCK, b"ok\n"),
    (Command.LOCK, b"ok " + TOKEN.encode() + b"\n"),
    (Command.LOCK, b"ok nothex 33\n"),
    (Command.LOCK, b"ok " + TOKEN.upper().encode() + b" 33\n"),
    (Command.LOCK, b"ok " + TOKEN.encode() + b" -1\n"),
    (Command.LOCK, b"ok " + TOKEN.encode() + b" 33 extra\n"),
    (Command.LOCK, b"ok " + TOKEN.encode() + b"  33\n"),
    (Command.LOCK, b"timeout 5\n"),
    (Command.LOCK, b"error oops\n"),
    (Command.LOCK, b"error_bogus\n"),
    (Command.RENEW, b"ok\n"),
    (Command.RENEW, b"ok 1.5\n"),
    (Command.RENEW, b"ok \xd9\xa3\n"),  # an Arabic-Indic digit is not a wire number
    (Command.STATS, b"ok not json\n"),
    (Command.STATS, b"ok [1, 2]\n"),
    (Command.STATS, b"ok\n"),
    (Command.HELLO, b"ok\n"),
    (Command.HELLO, b"ok not json\n"),
    (Command.PING, b"pong\n"),
]

# Valid replies, but not to the request in flight.
UNEXPECTED: list[tuple[Command, bytes]] = [
    (Command.LOCK, b"queued\n"),
    (Command.LOCK, b"acquired " + TOKEN.encode() + b" 33\n"),
    (Command.LOCK, b"error_not_enqueued\n"),
    (Command.WAIT, b"acquired " + TOKEN.encode() + b" 33\n"),
    (Command.WAIT, b"error_max_locks\n"),
    (Command.ENQUEUE, b"ok " + TOKEN.encode() + b" 33\n"),
    (Command.ENQUEUE, b"timeout\n"),
    (Command.RENEW, b"ok " + TOKEN.encode() + b" 33\n"),
    (Command.RELEASE, b"ok 30\n"),
    (Command.RELEASE, b"timeout\n"),
    (Command.AUTH, b"queued\n"),
    (Command.PING, b'ok {"connections": 1}\n'),
    (Command.STATS, b"queued\n"),
    (Command.HELLO, b"queued\n"),
]


@pytest.mark.parametrize(("command", "line"), GARBAGE + UNEXPECTED)
def test_garbage_and_unexpected_replies_raise_protocol_error(command: Command, line: bytes) -> None:
    for chunks in ([line], [bytes([b]) for b in line]):
        parser = ReplyParser()
        with pytest.raises(ProtocolError) as info:
            for chunk in chunks:
                parser.feed(chunk)
                parser.next_reply(command)
        message = str(info.value)
        assert repr(line.rstrip(b"\n")[:20])[2:-1] in message  # names what it received
        assert repr(command.value) in message


def test_partial_line_waits_for_the_rest() -> None:
    parser = ReplyParser()
    parser.feed(b"ok 0123")
    assert parser.next_reply(Command.LOCK) is None
    assert parser.buffered == 7
    parser.feed(TOKEN[4:].encode() + b" 9")
    assert parser.next_reply(Command.LOCK) is None
    parser.feed(b"\n")
    assert parser.next_reply(Command.LOCK) == Granted("0123" + TOKEN[4:], 9)


def test_over_long_line_is_refused_without_buffering_more() -> None:
    limit = constants.MAX_LINE_BYTES
    parser = ReplyParser()
    parser.feed(b"x" * limit)
    assert parser.next_reply(Command.LOCK) is None  # could still end here
    parser.feed(b"x")
    with pytest.raises(ProtocolError, match=f"no newline within {limit} bytes"):
        parser.next_reply(Command.LOCK)

    parser = ReplyParser()
    parser.feed(b"e" * (limit + 1) + b"\n")
    with pytest.raises(ProtocolError, match=f"longer than {limit} bytes"):
        parser.next_reply(Command.LOCK)

    parser = ReplyParser()
    with pytest.raises(ProtocolError):
        for _ in range(limit + 2):
            parser.feed(b"y")
            parser.next_reply(Command.PING)
    assert parser.buffered == limit + 1


def test_stats_may_be_long_but_has_its_own_limit() -> None:
    big: dict[str, object] = {"locks": [{"key": f"k{i}", "waiters": i} for i in range(2000)]}
    line = b"ok " + json.dumps(big).encode() + b"\n"
    assert len(line) > constants.MAX_LINE_BYTES
    parser = ReplyParser()
    parser.feed(line)
    assert parser.next_reply(Command.STATS) == JsonReply(big)

    small = ReplyParser()
    small.max_stats_line_bytes = 100
    small.feed(line)
    with pytest.raises(ProtocolError, match="longer than 100 bytes"):
        small.next_reply(Command.STATS)


def test_decode_reply_single_line() -> None:
    assert _replies.decode_reply(Command.RENEW, b"ok 0") == Renewed(0)
    assert _replies.decode_reply(Command.SEM_LOCK, b"error_limit_mismatch\r") == ErrorReply(
        "error_limit_mismatch"
    )


# ----------------------------------------------------------------------------- encoders


def test_encoders_produce_exact_requests() -> None:
    assert _requests.checked_lock("k", 10, None) == b"l\nk\n10\n"
    assert _requests.checked_lock("k", 0, 60) == b"l\nk\n0 60\n"
    assert _requests.checked_renew(Command.RENEW, "k", TOKEN, None) == f"n\nk\n{TOKEN}\n".encode()
    assert _requests.checked_renew(Command.RENEW, "k", TOKEN, 5) == f"n\nk\n{TOKEN} 5\n".encode()
    assert _requests.checked_release("k", TOKEN) == f"r\nk\n{TOKEN}\n".encode()
    assert _requests.checked_enqueue("k", None, None) == b"e\nk\n\n"
    assert _requests.checked_enqueue("k", None, 30) == b"e\nk\n30\n"
    assert _requests.checked_wait(Command.WAIT, "k", 3) == b"w\nk\n3\n"
    assert _requests.checked_sem_lock("s", 5, 3, None) == b"sl\ns\n5 3\n"
    assert _requests.checked_sem_lock("s", 5, 3, 20) == b"sl\ns\n5 3 20\n"
    assert _requests.checked_enqueue("s", 3, None) == b"se\ns\n3\n"
    assert _requests.checked_enqueue("s", 3, 20) == b"se\ns\n3 20\n"
    assert _requests.checked_wait(Command.SEM_WAIT, "s", 0) == b"sw\ns\n0\n"
    assert (
        _requests.checked_renew(Command.SEM_RENEW, "s", TOKEN, 8) == f"sn\ns\n{TOKEN} 8\n".encode()
    )
    assert _requests.checked_sem_release("s", TOKEN) == f"sr\ns\n{TOKEN}\n".encode()
    assert _requests.checked_auth("s3cret with space") == b"auth\n_\ns3cret with space\n"
    assert _requests.STATS_REQUEST == b"stats\n_\n_\n"
    assert _requests.PING_REQUEST == b"ping\n_\n_\n"
    assert _requests.HELLO_REQUEST == b"hello\n_\nsession\n"
    assert _requests.checked_lock("ключ", 1, None) == "l\nключ\n1\n".encode()


def test_every_command_has_an_encoder() -> None:
    encoded = {
        _requests.checked_lock("k", 1, None),
        _requests.checked_renew(Command.RENEW, "k", TOKEN, None),
        _requests.checked_release("k", TOKEN),
        _requests.checked_enqueue("k", None, None),
        _requests.checked_wait(Command.WAIT, "k", 1),
        _requests.checked_sem_lock("k", 1, 2, None),
        _requests.checked_enqueue("k", 2, None),
        _requests.checked_wait(Command.SEM_WAIT, "k", 1),
        _requests.checked_renew(Command.SEM_RENEW, "k", TOKEN, None),
        _requests.checked_sem_release("k", TOKEN),
        _requests.checked_auth("x"),
        _requests.STATS_REQUEST,
        _requests.PING_REQUEST,
        _requests.HELLO_REQUEST,
        _requests.SHARDS_REQUEST,
        _requests.checked_hold("k", 0, 30, "note", detached=True),
        _requests.checked_note("k", TOKEN, "note"),
        _requests.checked_take("k", TOKEN, 30, None, "note"),
        _requests.checked_hand_down("k", TOKEN, 30),
        _requests.checked_asking("k", None),
        _requests.checked_force_release("k"),
    }
    assert {request.split(b"\n")[0].decode() for request in encoded} == SERVER_COMMANDS
    assert {c.value for c in Command} == SERVER_COMMANDS


@pytest.mark.parametrize(
    ("key", "match"),
    [
        ("", "must not be empty"),
        ("a b", "whitespace"),
        ("a\tb", "whitespace"),
        ("a\nb", "whitespace"),
        ("a\rb", "whitespace"),
        ("a\u00a0b", "whitespace"),
        ("x" * 257, "257 bytes of UTF-8, over the protocol's 256"),
        ("é" * 129, "258 bytes"),
        ("\udc80", "not encodable as UTF-8"),
        (b"bytes", "must be a str"),
        (None, "must be a str"),
    ],
)
def test_invalid_keys_are_refused_clearly(key: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _requests.validate_key(key)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]


def test_longest_key_is_accepted() -> None:
    assert _requests.validate_key("x" * 256) == "x" * 256
    assert _requests.validate_key("é" * 128) == "é" * 128


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: whole_seconds("timeout_s", -1, minimum=0), "timeout_s must be between 0"),
        (lambda: whole_seconds("timeout_s", True, minimum=0), "timeout_s must be a number"),
        (lambda: whole_seconds("timeout_s", "5", minimum=0), "timeout_s must be a number"),  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
        (lambda: whole_seconds("t", constants.MAX_NUMBER + 1, minimum=0), "9000000000"),
        (lambda: lease_seconds("lease_s", 0), "lease_s must be between 1"),
        (lambda: lease_seconds("lease_s", -5), "lease_s must be between 1"),
        (lambda: check_limit(0), "limit must be None .* from 1 to 1048576"),
        (lambda: check_limit(1_048_577), "limit must be None"),
        (lambda: _by_token.release_request("k", TOKEN.upper()), "32 lowercase hex"),
        (lambda: _by_token.release_request("k", TOKEN + "\n", semaphore=True), "32 lowercase hex"),
        (lambda: check_auth_token(""), "non-empty"),
        (lambda: check_auth_token("line\nbreak"), "line breaks"),
        (lambda: check_auth_token("secret\n"), "trailing newline"),
        (lambda: check_auth_token(" padded"), "whitespace"),
        (lambda: check_auth_token("x" * 65537), "65536"),
    ],
)
def test_invalid_numbers_tokens_and_secrets_are_refused_clearly(call: object, match: str) -> None:
    assert callable(call)
    with pytest.raises(ValueError, match=match):
        call()


def test_fence_of() -> None:
    assert _requests.fence_of(TOKEN) == int(TOKEN[:16], 16)
    assert _requests.fence_of("ffffffffffffffff" + "0" * 16) == constants.FENCE_MAX


def test_every_command_reads_as_words_in_messages() -> None:
    """Errors say "during a renewal ('n')", never a bare protocol letter."""
    assert Command.RENEW.label == "a renewal ('n')"
    for command in Command:
        assert command.label.endswith(f"({command.value!r})")
        assert command.label.split(" (")[0] != command.value


@pytest.mark.parametrize("command", GRANT_COMMANDS)
def test_a_grant_with_a_lease_of_0_is_refused(command: Command) -> None:
    """A lease that is over when granted would make the renewal spin (every 0.1 s)."""
    with pytest.raises(ProtocolError, match="at least 1 second"):
        _replies.decode_reply(command, b"ok " + b"a" * 32 + b" 0")
    assert _replies.decode_reply(command, b"ok " + b"a" * 32 + b" 1") == Granted("a" * 32, 1)
