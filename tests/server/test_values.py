"""The settings' parsers (``values``): each bad value is refused with its own short reason,
never a message of Python's own."""

from __future__ import annotations

import pytest

from dflockd_server.values import parse_int


@pytest.mark.parametrize("raw", ["--5", "-", "- 5", "+5", "5-", "1.0", "0x10", "1_000", "٣", ""])
def test_parse_int_refuses_what_is_no_integer_in_its_own_words(raw: str) -> None:
    with pytest.raises(ValueError, match=r"^not an integer$"):
        parse_int(raw)


@pytest.mark.parametrize(("raw", "value"), [("5", 5), (" -5 ", -5), ("007", 7)])
def test_parse_int_reads_integers(raw: str, value: int) -> None:
    assert parse_int(raw) == value
