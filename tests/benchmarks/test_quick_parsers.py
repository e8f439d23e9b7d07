"""The server's fast path for ``l`` / ``hl`` / ``r`` / ``n`` decodes exactly as ``decode_request``
does.

The hot-path work of the benchmarks issue added ``quick_lock``, ``quick_hold`` and
``quick_token``: the server
answers the usual request shapes from them and sends everything else through
``decode_request``. They must never accept what ``decode_request`` refuses, nor decode to
anything else. (These live here, next to the benchmarks that motivated them; they test
``dflockd_server.protocol`` only.)
"""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from dflockd_server import protocol as p

TOKEN = b"0123456789abcdef0123456789abcdef"

# Pieces that sit on every boundary the two decoders care about: whitespace of every kind
# bytes.split() knows, signs, numbers at and around the 9,000,000,000 ceiling, leading zeros,
# zero leases, bad and good UTF-8, the placeholder, a real token.
_PIECES = st.sampled_from(
    [
        b"0",
        b"1",
        b"33",
        b"007",
        b"999999999",
        b"9000000000",
        b"9000000001",
        b"1234567890",
        b" ",
        b"  ",
        b"\t",
        b"\x0b",
        b"\x0c",
        b"\r",
        b"-1",
        b"+1",
        b"a",
        b"ff",
        b"\xff",
        b"\xc3\xa9",
        b"\xd9\xa3",  # an Arabic-Indic digit: a digit to str.isdigit, not to bytes.isdigit
        b"_",
        TOKEN,
        b"",
    ]
)
_RAW = st.lists(_PIECES, max_size=5).map(b"".join) | st.binary(max_size=12)

NOTE = b"03a309e9-ee62-413a-80bd-049e40478dd4/celery%40host"
# ``hl``'s argument: four fields around each field's limits, mostly well formed, or anything.
_NUMBER = st.sampled_from(
    [
        b"0",
        b"1",
        b"33",
        b"007",
        b"1000",
        b"1001",
        b"999999999",
        b"9000000000",
        b"9000000001",
        b"-1",
        b"+1",
        b"",
        b"\xd9\xa3",
        b"1\t",
    ]
)
_MODE = st.sampled_from([b"c", b"d", b"cd", b"C", b"", b"\t"])
_NOTE = st.sampled_from(
    [NOTE, b"x" * 200, b"x" * 201, b"~!", b"\x7f", b"a\tb", b"", b"\xc3\xa9"]
) | st.binary(min_size=1, max_size=6)
_WELL_FORMED_HOLD = st.tuples(
    st.integers(0, 10**9).map(b"%d".__mod__),
    st.integers(0, 10**9).map(b"%d".__mod__),
    st.sampled_from([b"c", b"d"]),
    st.sampled_from([NOTE, b"x" * 200, b"~!"]),
).map(b" ".join)
_HOLD_ARG = (
    _WELL_FORMED_HOLD
    | st.tuples(_NUMBER, _NUMBER, _MODE, _NOTE).map(b" ".join)
    | st.lists(_NOTE | _PIECES, min_size=1, max_size=6).map(b" ".join)
    | _RAW
)
_HOLD_KEY = st.sampled_from([b"report:7", "clé".encode()]) | _RAW


def _decoded(cmd: bytes, key: bytes, arg: bytes) -> p.Request | None:
    try:
        return p.decode_request(cmd, key, arg)
    except p.Malformed:
        return None


@settings(max_examples=1000, deadline=None)
@given(key=_RAW, arg=_RAW)
def test_quick_lock_agrees_with_decode_request(key: bytes, arg: bytes) -> None:
    quick = p.quick_lock(key, arg)
    if quick is None:
        return
    req = _decoded(b"l", key, arg)
    assert req is not None, (key, arg, quick)
    assert (req.key, req.timeout, req.lease, req.limit) == (*quick, None)


@settings(max_examples=2000, deadline=None)
@given(key=_HOLD_KEY, arg=_HOLD_ARG)
def test_quick_hold_agrees_with_decode_request(key: bytes, arg: bytes) -> None:
    quick = p.quick_hold(key, arg)
    if quick is None:
        return
    req = _decoded(b"hl", key, arg)
    assert req is not None, (key, arg, quick)
    assert (req.key, req.timeout, req.lease, req.detached, req.note) == quick


@settings(max_examples=1000, deadline=None)
@given(key=_RAW, arg=_RAW)
def test_quick_token_agrees_with_decode_request(key: bytes, arg: bytes) -> None:
    quick = p.quick_token(key, arg)
    if quick is None:
        return
    renew = _decoded(b"n", key, arg)
    assert renew is not None, (key, arg, quick)
    assert (renew.key, renew.token, renew.lease) == quick
    release = _decoded(b"r", key, arg)
    if quick[2] is None:
        assert release is not None
        assert (release.key, release.token) == quick[:2]
    else:
        assert release is None  # the server sends such an r to decode_request: error


def test_usual_shapes_take_the_fast_path() -> None:
    assert p.quick_lock(b"report:7", b"0") == ("report:7", 0, None)
    assert p.quick_lock(b"report:7", b"10 60") == ("report:7", 10, 60)
    assert p.quick_lock("clé".encode(), b"5") == ("clé", 5, None)
    assert p.quick_hold(b"k", b"30 33 c " + NOTE) == ("k", 30, 33, False, NOTE.decode())
    assert p.quick_hold(b"k", b"0 60 d " + NOTE) == ("k", 0, 60, True, NOTE.decode())
    assert p.quick_token(b"k", TOKEN) == ("k", TOKEN.decode(), None)
    assert p.quick_token(b"k", TOKEN + b" 33") == ("k", TOKEN.decode(), 33)


def test_every_number_reads_the_same_in_the_table_and_past_it() -> None:
    """The quick parsers read the usual numbers from a table (0 to 1,000) and the rest digit
    by digit: either way to ``decode_request``'s value, leading zeros included."""
    for n in [*range(1200), 3600, 86_400, 9_999_999]:
        for text in (b"%d" % n, b"0%d" % n, b"00%d" % n):  # at most 9 digits: the quick kind
            assert p.quick_lock(b"k", text) == ("k", n, None), text
            if n:
                assert p.quick_lock(b"k", b"0 " + text) == ("k", 0, n), text
                assert p.quick_token(b"k", TOKEN + b" " + text) == ("k", TOKEN.decode(), n)
                hold = p.quick_hold(b"k", text + b" " + text + b" c " + NOTE)
                assert hold == ("k", n, n, False, NOTE.decode()), text
            else:
                assert p.quick_lock(b"k", b"0 " + text) is None, text  # lease 0: malformed
                assert p.quick_token(b"k", TOKEN + b" " + text) is None, text


def test_unusual_shapes_are_left_to_decode_request() -> None:
    for key, arg in [
        (b"k", b"0  33"),  # two spaces: valid, but decode_request's to split
        (b"k", b" 0"),
        (b"k", b"0 0"),  # lease 0: malformed
        (b"k", b"9000000001"),  # above the ceiling: malformed
        (b"", b"0"),
        (b"a b", b"0"),
        (b"\xff", b"0"),
    ]:
        assert p.quick_lock(key, arg) is None, (key, arg)
    for key, arg in [
        (b"k", b"30 33 c"),  # no note: malformed
        (b"k", b"30 33 x " + NOTE),  # no such mode: malformed
        (b"k", b"30 0 c " + NOTE),  # lease 0: malformed
        (b"k", b"30  33 c " + NOTE),  # two spaces: valid, but decode_request's to split
        (b"k", b"30 33 c " + b"x" * 201),  # a note over 200 bytes: malformed
        (b"k", b"30 33 c no\x7fte"),  # a byte outside '!'..'~': malformed
        (b"a b", b"30 33 c " + NOTE),
    ]:
        assert p.quick_hold(key, arg) is None, (key, arg)
    for key, arg in [(b"k", b""), (b"k", TOKEN + b"\t33"), (b"k", b"to-ken"), (b"k k", TOKEN)]:
        assert p.quick_token(key, arg) is None, (key, arg)
