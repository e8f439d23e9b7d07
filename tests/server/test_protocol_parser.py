"""The sans-I/O request framer, byte by byte, and the reply bytes. (The parsers of the frames:
``test_protocol_parsing.py``.)"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from dflockd_server import constants
from dflockd_server.protocol import (
    LineTooLong,
    RequestFramer,
    reply_acquired,
    reply_granted,
)

STREAM = b"l\nk1\n5 10\nping\n_\n_\nr\r\nk1\r\ntok\r\n"
FRAMES = [(b"l", b"k1", b"5 10"), (b"ping", b"_", b"_"), (b"r", b"k1", b"tok")]


def drain(framer: RequestFramer) -> list[tuple[bytes, bytes, bytes]]:
    out: list[tuple[bytes, bytes, bytes]] = []
    while (frame := framer.next_frame()) is not None:
        out.append(frame)
    return out


def test_whole_stream_at_once() -> None:
    framer = RequestFramer()
    framer.feed(STREAM)
    assert drain(framer) == FRAMES
    assert framer.buffered() == 0


def test_one_byte_at_a_time() -> None:
    framer = RequestFramer()
    got: list[tuple[bytes, bytes, bytes]] = []
    for i in range(len(STREAM)):
        framer.feed(STREAM[i : i + 1])
        got.extend(drain(framer))
    assert got == FRAMES


@pytest.mark.parametrize("cut", range(1, len(STREAM)))
def test_split_anywhere_with_trailing_data(cut: int) -> None:
    framer = RequestFramer()
    framer.feed(STREAM[:cut])
    got = drain(framer)
    framer.feed(STREAM[cut:] + b"l\nk")
    got.extend(drain(framer))
    assert got == FRAMES
    assert framer.buffered() == 3


def test_feeding_while_frames_are_still_buffered() -> None:
    framer = RequestFramer()
    framer.feed(STREAM)
    assert framer.next_frame() == FRAMES[0]
    framer.feed(b"ping\n_\n_\n")  # the caller was busy; two frames were still waiting
    assert drain(framer) == [*FRAMES[1:], (b"ping", b"_", b"_")]


def test_line_limit_complete_and_incomplete() -> None:
    limit = constants.MAX_LINE_BYTES
    ok = RequestFramer()
    ok.feed(b"l\n" + b"k" * limit + b"\r\n0\n")
    assert ok.next_frame() == (b"l", b"k" * limit, b"0")
    too_long = RequestFramer()
    too_long.feed(b"l\n" + b"k" * (limit + 1) + b"\n0\n")
    with pytest.raises(LineTooLong):
        too_long.next_frame()
    dripping = RequestFramer()
    dripping.feed(b"l\n" + b"k" * limit)
    assert dripping.next_frame() is None
    dripping.feed(b"kk")  # no newline yet, but already over the limit
    with pytest.raises(LineTooLong):
        dripping.next_frame()


def test_auth_argument_may_be_64_kib() -> None:
    secret = b"s" * constants.MAX_AUTH_LINE_BYTES
    framer = RequestFramer()
    framer.feed(b"auth\n_\n" + secret[:1000])
    assert framer.next_frame() is None
    framer.feed(secret[1000:] + b"\n")
    assert framer.next_frame() == (b"auth", b"_", secret)
    framer.feed(b"auth\n_\n" + secret + b"ss")
    with pytest.raises(LineTooLong):
        framer.next_frame()
    other = RequestFramer()  # other commands keep the short limit on their argument
    other.feed(b"l\nk\n" + b"1" * 300)
    with pytest.raises(LineTooLong):
        other.next_frame()


def test_reply_encoding() -> None:
    assert reply_granted("ab", 33) == b"ok ab 33\n"
    assert reply_acquired("ab", 5) == b"acquired ab 5\n"


_LINES = st.sampled_from(
    [
        b"l",
        b"r",
        b"auth",
        b"k1",
        b"0",
        b"5 10",
        b"",
        b"x\r",
        b"\r",
        b"a" * constants.MAX_LINE_BYTES,
        b"a" * (constants.MAX_LINE_BYTES + 1),
        b"a" * (constants.MAX_LINE_BYTES - 1) + b"\r",
        b"s" * (constants.MAX_LINE_BYTES + 40),
    ]
)


def _frames_until_error(
    framer: RequestFramer, chunks: list[bytes], budget: int
) -> tuple[list[tuple[bytes, bytes, bytes]], bool]:
    """The frames the framer yields over ``chunks`` (taking at most ``budget`` after each
    feed, as a pass of the server does), and whether it found a line too long."""
    got: list[tuple[bytes, bytes, bytes]] = []
    try:
        for chunk in chunks:
            framer.feed(chunk)
            for _ in range(budget):
                frame = framer.next_frame()
                if frame is None:
                    break
                got.append(frame)
        while (frame := framer.next_frame()) is not None:
            got.append(frame)
    except LineTooLong:
        return got, True
    return got, False


@settings(max_examples=400)
@given(
    st.lists(_LINES, max_size=24),
    st.lists(st.integers(min_value=1, max_value=700), max_size=8),
    st.integers(min_value=1, max_value=5),
)
def test_any_cut_of_any_stream_frames_as_byte_by_byte(
    lines: list[bytes], cuts: list[int], budget: int
) -> None:
    """However the stream comes in (whole requests per read, pieces, frames left for a later
    pass), the frames and the line-too-long verdict are those of reading it byte by byte."""
    stream = b"".join(line + b"\n" for line in lines)
    chunks: list[bytes] = []
    rest = stream
    for cut in cuts:
        if rest:
            chunks.append(rest[:cut])
            rest = rest[cut:]
    if rest:
        chunks.append(rest)
    expected = _frames_until_error(RequestFramer(), [bytes([b]) for b in stream], 1)
    assert _frames_until_error(RequestFramer(), chunks, budget) == expected
