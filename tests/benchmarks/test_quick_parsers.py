"""The server's fast path for ``l`` / ``r`` / ``n`` decodes exactly as ``decode_request`` does.

The hot-path work of the benchmarks issue added ``quick_lock`` and ``quick_token``: the server
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
    assert p.quick_token(b"k", TOKEN) == ("k", TOKEN.decode(), None)
    assert p.quick_token(b"k", TOKEN + b" 33") == ("k", TOKEN.decode(), 33)


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
    for key, arg in [(b"k", b""), (b"k", TOKEN + b"\t33"), (b"k", b"to-ken"), (b"k k", TOKEN)]:
        assert p.quick_token(key, arg) is None, (key, arg)
