"""tests/support/services' ``REDIS_DBS``: the one table of the tests' Redis databases. A test
module that empties its database (FLUSHDB) shares it with no other: two that did emptied a
queue under a message another module's worker was about to take."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.services import REDIS_DBS

TESTS = Path(__file__).resolve().parent
PURPOSE = re.compile(r"""(?:redis_url\(|REDIS_DBS\[)["'](\w+)["']""")
NUMBERED = re.compile(
    r"""REDIS_URL_BASE\}/\d|redis://[^"'\s]*:\d+/(?:[1-9]|1[0-5])\b|_DB\s*=\s*\d"""
)
"""A database number written outside the table (the docs' own ``redis://...:6379/0``, which
tests replace, aside)."""


def _sources() -> dict[Path, str]:
    return {
        path: path.read_text(encoding="utf-8")
        for path in sorted(TESTS.rglob("*.py"))
        if path.name != "services.py" and path != Path(__file__).resolve()
    }


def test_no_two_purposes_share_a_database() -> None:
    numbers = list(REDIS_DBS.values())
    assert len(set(numbers)) == len(numbers), REDIS_DBS
    assert all(0 <= n <= 15 for n in numbers), REDIS_DBS


def test_a_database_number_is_written_only_in_the_table() -> None:
    found = [
        f"{path.relative_to(TESTS)}: {match.group(0)}"
        for path, text in _sources().items()
        for match in NUMBERED.finditer(text)
    ]
    assert not found, found


def test_a_database_a_module_empties_is_used_by_no_other_module() -> None:
    sources = _sources()
    named = {path: set(PURPOSE.findall(text)) for path, text in sources.items()}
    users: dict[str, set[Path]] = {}
    for path, purposes in named.items():
        for purpose in purposes:
            assert purpose in REDIS_DBS, f"{path}: {purpose!r} is not in REDIS_DBS"
            users.setdefault(purpose, set()).add(path)
    emptying = [path for path, text in sources.items() if "flushdb(" in text]
    assert emptying, "no module empties a database: the check below checks nothing"
    for path in emptying:
        assert named[path], f"{path} empties a database that is not from REDIS_DBS"
        for purpose in named[path]:
            assert users[purpose] == {path}, f"{purpose!r}: {sorted(map(str, users[purpose]))}"
