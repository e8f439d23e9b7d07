"""decode_reply's fast paths for the usual replies decode exactly as its general path does.

The fast paths match a whole line without a trailing CR; the general path strips one CR
first. So ``line`` and ``line + b"\\r"`` must always decode alike (or fail alike): the first
may take a fast path, the second never does.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from celery_dflock.client import _replies
from celery_dflock.client._replies import decode_reply
from celery_dflock.client._requests import Command
from celery_dflock.client.errors import ProtocolError

TOKEN = "0000000000000001a1b2c3d4e5f60718"

hex_text = st.text(alphabet="0123456789abcdefABCDEF", min_size=30, max_size=34)
digits = st.text(alphabet="0123456789", min_size=1, max_size=6)
lines = st.one_of(
    st.builds(lambda t, d: f"ok {t} {d}".encode(), hex_text, digits),
    st.builds(lambda d: f"ok {d}".encode(), digits),
    st.sampled_from([b"ok", b"ok ", b" ok", b"timeout", b"queued", b"error", b"error_auth"]),
    st.builds(lambda d: f"ok {TOKEN} {d}".encode(), st.text(max_size=4)),
    st.binary(max_size=50),
)


def _decoded(command: Command, line: bytes) -> object:
    try:
        return decode_reply(command, line)
    except (ProtocolError, ValueError) as exc:
        return type(exc)


@settings(max_examples=2000)
@given(command=st.sampled_from(list(Command)), line=lines)
def test_fast_and_general_paths_agree(command: Command, line: bytes) -> None:
    if line.endswith(b"\r"):
        line = line[:-1]
    assert _decoded(command, line) == _decoded(command, line + b"\r")


@pytest.mark.parametrize(
    ("command", "line", "reply"),
    [
        (Command.LOCK, f"ok {TOKEN} 33".encode(), _replies.Granted(TOKEN, 33)),
        (Command.SEM_WAIT, f"ok {TOKEN} 007".encode(), _replies.Granted(TOKEN, 7)),
        (Command.RENEW, b"ok 12", _replies.Renewed(12)),
        (Command.RELEASE, b"ok", _replies.Ok()),
        (Command.PING, b"ok", _replies.Ok()),
    ],
)
def test_the_usual_replies(command: Command, line: bytes, reply: _replies.Reply) -> None:
    assert decode_reply(command, line) == reply


@pytest.mark.parametrize(
    ("command", "line"),
    [
        (Command.LOCK, f"ok {TOKEN.upper()} 33".encode()),  # tokens are lowercase hex
        (Command.LOCK, f"ok {TOKEN} 3x".encode()),
        (Command.LOCK, b"ok"),  # a release's reply is not a grant
        (Command.RELEASE, f"ok {TOKEN} 33".encode()),
        (Command.RENEW, b"ok"),
        (Command.ENQUEUE, f"ok {TOKEN} 33".encode()),  # an enqueue is granted "acquired"
    ],
)
def test_near_misses_are_still_refused(command: Command, line: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_reply(command, line)


def _step(parser: _replies.ReplyParser, command: Command, chunk: bytes, fast: bool) -> object:
    try:
        if fast:
            return parser.feed_reply(command, chunk)
        parser.feed(chunk)
        return parser.next_reply(command)
    except (ProtocolError, ValueError) as exc:
        return type(exc)


@settings(max_examples=1000)
@given(
    command=st.sampled_from(list(Command)),
    chunks=st.lists(
        st.one_of(
            st.builds(lambda line: line + b"\n", lines),
            st.binary(max_size=20),
            st.sampled_from([b"\n", b"ok\nok\n", b"x" * 300 + b"\n"]),
        ),
        min_size=1,
        max_size=4,
    ),
    limit=st.sampled_from([256, 8]),
)
def test_feed_reply_is_feed_then_next_reply(
    command: Command, chunks: list[bytes], limit: int
) -> None:
    fast, slow = _replies.ReplyParser(), _replies.ReplyParser()
    fast.max_line_bytes = slow.max_line_bytes = limit
    for chunk in chunks:
        assert _step(fast, command, chunk, True) == _step(slow, command, chunk, False)
        assert fast.buffered == slow.buffered
