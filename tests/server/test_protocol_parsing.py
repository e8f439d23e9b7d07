"""The server's one parser per command (``protocol.parse_<command>``) against PROTOCOL.md's rules.

Each parser reads the usual shapes by a look-up (numbers up to ``QUICK_NUMBERS``, a plain
token) and every other shape the long way, in one function (issue 52: before, quick parsers
beside a general one had to be kept equal by a test). Here a model of the rules, written from
PROTOCOL.md and nothing of the server's, says what each frame means or that it is malformed,
and every parser must agree with it on any bytes.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from hypothesis import given, settings, strategies as st

from dflockd_server import constants as c, protocol as p

TOKEN = b"0123456789abcdef0123456789abcdef"
NOTE = b"03a309e9-ee62-413a-80bd-049e40478dd4/celery%40host"


# ---------------------------------------------------------------------- the rules, modelled
class Refused(Exception):
    """The model's verdict: malformed."""


_FIELD = re.compile(rb"[^ \t\n\r\x0b\x0c]+")
"""A field of an argument: fields are separated by runs of ASCII whitespace."""
_DIGITS = re.compile(rb"[0-9]+")


def fields(arg: bytes) -> list[bytes]:
    return _FIELD.findall(arg)


def key_of(raw: bytes) -> str:
    """A key is non-empty UTF-8 with no space, tab, CR or LF."""
    if not raw or re.search(rb"[ \t\r\n]", raw):
        raise Refused
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise Refused from None


def number(raw: bytes) -> int:
    """Base-10 digits, at most 9,000,000,000."""
    if not _DIGITS.fullmatch(raw) or int(raw) > 9_000_000_000:
        raise Refused
    return int(raw)


def lease(raw: bytes) -> int:
    value = number(raw)
    if value == 0:
        raise Refused
    return value


def limit(raw: bytes) -> int:
    value = number(raw)
    if not 1 <= value <= 1_048_576:
        raise Refused
    return value


def token(raw: bytes) -> str:
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise Refused from None


def note(raw: bytes) -> str:
    """An owner note: 1 to 200 bytes, each from ``!`` to ``~``."""
    if not 1 <= len(raw) <= 200 or any(not 0x21 <= b <= 0x7E for b in raw):
        raise Refused
    return raw.decode("ascii")


def arity(parts: list[bytes], low: int, high: int) -> list[bytes]:
    if not low <= len(parts) <= high:
        raise Refused
    return parts


def model_lock(key: bytes, arg: bytes) -> object:
    name = key_of(key)
    parts = arity(fields(arg), 1, 2)
    return name, number(parts[0]), lease(parts[1]) if len(parts) == 2 else None


def model_sem_lock(key: bytes, arg: bytes) -> object:
    name = key_of(key)
    parts = arity(fields(arg), 2, 3)
    return name, number(parts[0]), limit(parts[1]), lease(parts[2]) if len(parts) == 3 else None


def model_hold(key: bytes, arg: bytes) -> object:
    name = key_of(key)
    t, le, mode, n = arity(fields(arg), 4, 4)
    timeout, held = number(t), lease(le)
    if mode not in (b"c", b"d"):
        raise Refused
    return name, timeout, held, mode == b"d", note(n)


def model_release(key: bytes, arg: bytes) -> object:
    name = key_of(key)
    (t,) = arity(fields(arg), 1, 1)
    return name, token(t)


def model_renew(key: bytes, arg: bytes) -> object:
    name = key_of(key)
    parts = arity(fields(arg), 1, 2)
    return name, token(parts[0]), lease(parts[1]) if len(parts) == 2 else None


def model_note(key: bytes, arg: bytes) -> object:
    name = key_of(key)
    t, n = arity(fields(arg), 2, 2)
    return name, token(t), note(n)


def model_take(key: bytes, arg: bytes) -> object:
    name = key_of(key)
    t, le, on_close, n = arity(fields(arg), 4, 4)
    got = token(t), lease(le)
    return name, *got, None if on_close == b"r" else lease(on_close), note(n)


def model_hand_down(key: bytes, arg: bytes) -> object:
    name = key_of(key)
    t, le = arity(fields(arg), 2, 2)
    return name, token(t), lease(le)


def model_force_release(key: bytes, arg: bytes) -> object:
    name = key_of(key)
    (n,) = arity(fields(arg), 1, 1)
    return name, None if n == b"_" else note(n)


def model_enqueue(key: bytes, arg: bytes) -> object:
    name = key_of(key)
    parts = arity(fields(arg), 0, 1)
    return name, lease(parts[0]) if parts and parts[0] != b"_" else None


def model_sem_enqueue(key: bytes, arg: bytes) -> object:
    name = key_of(key)
    parts = arity(fields(arg), 1, 2)
    return name, limit(parts[0]), lease(parts[1]) if len(parts) == 2 else None


def model_wait(key: bytes, arg: bytes) -> object:
    name = key_of(key)
    (t,) = arity(fields(arg), 1, 1)
    return name, number(t)


Parser = Callable[[bytes, bytes], object]
PARSERS: dict[str, tuple[Parser, Parser]] = {
    "l": (p.parse_lock, model_lock),
    "sl": (p.parse_sem_lock, model_sem_lock),
    "hl": (p.parse_hold, model_hold),
    "r": (lambda k, a: p.parse_release(b"r", k, a), model_release),
    "sr": (lambda k, a: p.parse_release(b"sr", k, a), model_release),
    "n": (lambda k, a: p.parse_renew(b"n", k, a), model_renew),
    "sn": (lambda k, a: p.parse_renew(b"sn", k, a), model_renew),
    "note": (p.parse_note, model_note),
    "ht": (p.parse_take, model_take),
    "hd": (p.parse_hand_down, model_hand_down),
    "fr": (p.parse_force_release, model_force_release),
    "e": (p.parse_enqueue, model_enqueue),
    "se": (p.parse_sem_enqueue, model_sem_enqueue),
    "w": (lambda k, a: p.parse_wait(b"w", k, a), model_wait),
    "sw": (lambda k, a: p.parse_wait(b"sw", k, a), model_wait),
}


def agree(command: str, key: bytes, arg: bytes) -> None:
    parse, model = PARSERS[command]
    try:
        expected = model(key, arg)
    except Refused:
        with pytest.raises(p.Malformed):
            parse(key, arg)
        return
    assert parse(key, arg) == expected, (command, key, arg)


# ---------------------------------------------------------------------- the frames tried
# Pieces that sit on every boundary the rules have: whitespace of every kind bytes.split()
# knows, signs, numbers at and around the ceiling and the look-up table's end, leading zeros,
# zero leases, limits at their bounds, bad and good UTF-8, the placeholder, modes, notes, a
# real token.
_PIECES = st.sampled_from(
    [
        b"0",
        b"1",
        b"33",
        b"007",
        b"1000",
        b"1001",
        b"1048576",
        b"1048577",
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
        b"c",
        b"d",
        b"r",
        b"ff",
        b"\xff",
        b"\x7f",
        b"\xc3\xa9",
        b"\xd9\xa3",  # an Arabic-Indic digit: a digit to str.isdigit, not to bytes.isdigit
        b"_",
        TOKEN,
        NOTE,
        b"x" * 201,
        b"",
    ]
)
_RAW = st.lists(_PIECES, max_size=6).map(b"".join) | st.binary(max_size=12)
_KEY = (st.sampled_from([b"report:7", "clé".encode(), b"_"]) | _RAW).filter(
    lambda key: b"\n" not in key  # the frame's lines end at LF: no key a parser is given holds one
)
_FIELDS = st.lists(_PIECES | st.binary(max_size=4), min_size=0, max_size=5)
_ARG = (
    _FIELDS.map(b" ".join)  # single spaces: the usual shape, with any fields
    | _RAW
)


@settings(max_examples=600)
@given(command=st.sampled_from(sorted(PARSERS)), key=_KEY, arg=_ARG)
def test_every_parser_follows_the_rules(command: str, key: bytes, arg: bytes) -> None:
    agree(command, key, arg)


_WELL_FORMED_HOLD = st.tuples(
    st.integers(0, 10**10).map(b"%d".__mod__),
    st.integers(0, 10**10).map(b"%d".__mod__),
    st.sampled_from([b"c", b"d", b"x"]),
    st.sampled_from([NOTE, b"x" * 200, b"x" * 201, b"~!", b"a\x7f"]),
).map(b" ".join)


@settings(max_examples=300)
@given(
    key=st.sampled_from([b"report:7", "clé".encode(), b"a b", b"\xff"]),
    number=st.integers(0, 10**10).map(b"%d".__mod__) | _PIECES,
    second=st.integers(0, 10**10).map(b"%d".__mod__) | _PIECES,
    hold=_WELL_FORMED_HOLD,
)
def test_the_usual_shapes_follow_the_rules(
    key: bytes, number: bytes, second: bytes, hold: bytes
) -> None:
    """The shapes clients send, around the look-up table's end and the ceiling."""
    for command, arg in [
        ("l", number),
        ("l", number + b" " + second),
        ("sl", number + b" " + second),
        ("w", number),
        ("e", number),
        ("hl", hold),
        ("r", TOKEN),
        ("n", TOKEN + b" " + number),
        ("hd", TOKEN + b" " + number),
    ]:
        agree(command, key, arg)


def test_usual_shapes() -> None:
    assert p.parse_lock(b"report:7", b"0") == ("report:7", 0, None)
    assert p.parse_lock(b"report:7", b"10 60") == ("report:7", 10, 60)
    assert p.parse_lock("clé".encode(), b"5") == ("clé", 5, None)
    assert p.parse_hold(b"k", b"30 33 c " + NOTE) == ("k", 30, 33, False, NOTE.decode())
    assert p.parse_hold(b"k", b"0 60 d " + NOTE) == ("k", 0, 60, True, NOTE.decode())
    assert p.parse_release(b"r", b"k", TOKEN) == ("k", TOKEN.decode())
    assert p.parse_renew(b"n", b"k", TOKEN + b" 33") == ("k", TOKEN.decode(), 33)


def test_every_command_decodes() -> None:
    assert p.parse_lock(b"k", b"5 10") == ("k", 5, 10)
    assert p.parse_sem_lock(b"s", b"1 3 7") == ("s", 1, 3, 7)
    assert p.parse_sem_lock(b"s", b"1 3") == ("s", 1, 3, None)
    assert p.parse_renew(b"n", b"k", b"tok 4") == ("k", "tok", 4)
    assert p.parse_renew(b"sn", b"k", b"tok") == ("k", "tok", None)
    assert p.parse_release(b"sr", b"k", b"to-k") == ("k", "to-k")  # any ASCII token
    assert p.parse_enqueue(b"k", b"") == ("k", None)
    assert p.parse_enqueue(b"k", b"_") == ("k", None)
    assert p.parse_enqueue(b"k", b"9") == ("k", 9)
    assert p.parse_sem_enqueue(b"k", b"2 9") == ("k", 2, 9)
    assert p.parse_wait(b"w", b"k", b"3") == ("k", 3)
    assert p.parse_note(b"k", b"tok " + NOTE) == ("k", "tok", NOTE.decode())
    assert p.parse_take(b"k", b"tok 5 r n") == ("k", "tok", 5, None, "n")
    assert p.parse_take(b"k", b"tok 5 7 n") == ("k", "tok", 5, 7, "n")
    assert p.parse_hand_down(b"k", b"tok 5") == ("k", "tok", 5)
    assert p.parse_force_release(b"k", b"_") == ("k", None)
    assert p.parse_force_release(b"k", b"ops@host") == ("k", "ops@host")
    assert p.parse_auth(b"secret ") == b"secret"
    assert p.parse_hello(b"session") is True
    assert p.parse_hello(b"_") is False
    assert p.parse_asking(b"k", b"t1") == ("k", "t1")


def test_every_number_reads_the_same_in_the_table_and_past_it() -> None:
    """The usual numbers (0 to ``QUICK_NUMBERS`` - 1) come from a table, the rest digit by
    digit: either way to the same value, leading zeros included."""
    for n in [*range(c.QUICK_NUMBERS + 200), 3600, 86_400, 9_999_999, 9_000_000_000]:
        for text in (b"%d" % n, b"0%d" % n, b"00%d" % n):
            assert p.parse_lock(b"k", text) == ("k", n, None), text
            assert p.parse_wait(b"w", b"k", text) == ("k", n)
            if n:
                assert p.parse_lock(b"k", b"0 " + text) == ("k", 0, n), text
                assert p.parse_renew(b"n", b"k", TOKEN + b" " + text) == ("k", TOKEN.decode(), n)
                hold = p.parse_hold(b"k", text + b" " + text + b" c " + NOTE)
                assert hold == ("k", n, n, False, NOTE.decode()), text
            else:
                with pytest.raises(p.Malformed):  # lease 0
                    p.parse_lock(b"k", b"0 " + text)
                with pytest.raises(p.Malformed):
                    p.parse_renew(b"n", b"k", TOKEN + b" " + text)


@pytest.mark.parametrize(
    ("command", "key", "arg"),
    [
        ("l", b"k", b"\xd9\xa3"),  # a non-ASCII digit
        ("l", b"k", b"1_000"),
        ("l", b"k", b"9000000001"),  # above the ceiling
        ("l", b"k", b"0 0"),  # lease 0
        ("l", b"k", b"0 1 2"),
        ("l", b"", b"0"),
        ("l", b"\xff", b"1"),
        ("l", b"a\rb", b"1"),
        ("l", b"a b", b"1"),
        ("n", b"k", b"\xff"),
        ("r", b"k", TOKEN + b" 33"),  # r takes no lease
        ("r", b"k", b""),
        ("sl", b"k", b"1 1 0"),
        ("sl", b"k", b"1 0"),  # limit 0
        ("hl", b"k", b"30 33 c"),  # no note
        ("hl", b"k", b"30 33 x " + NOTE),  # no such mode
        ("hl", b"k", b"30 33 c " + b"x" * 201),  # a note over 200 bytes
        ("hl", b"k", b"30 33 c no\x7fte"),  # a byte outside '!'..'~'
        ("ht", b"k", b"tok 5 0 n"),  # onclose 0
        ("e", b"k", b"1 2"),
        ("fr", b"k", b""),
    ],
)
def test_malformed(command: str, key: bytes, arg: bytes) -> None:
    with pytest.raises(p.Malformed):
        PARSERS[command][0](key, arg)


def test_unknown_command_is_malformed() -> None:
    assert isinstance(p.unknown_command(b"x"), p.Malformed)
    assert "unknown command" in str(p.unknown_command(b"x" * 300))
