"""The grants a journal holds, found by token (``recorded.RecordedGrants``): kept by their fence
for speed (issue 52), and still found exactly as in a dict of token to grant when two tokens
share a fence or a token does not start with one."""

from __future__ import annotations

import random
import zlib
from pathlib import Path

import pytest

from dflockd_server.recorded import RecordedGrant, RecordedGrants
from dflockd_server.replay import read_journal, restored_leases
from tests.support.tables import by_token, fields, recorded, tokens_of

FENCE = "18ebc8acc95861db"
"""A fence as a server writes it: 16 lowercase hex digits."""


def grant(token: str, key: str = "k") -> RecordedGrant:
    return RecordedGrant(token, key, 1, False, 30, 1_030_000, False, None, None)


def test_tokens_that_share_a_fence_are_each_found_and_let_go_of_alone() -> None:
    first, second, third = FENCE + "0" * 16, FENCE + "1" * 16, FENCE + "2" * 16
    grants = RecordedGrants()
    for token in (first, second, third):
        grants.put(grant(token, key=token[-1]))
    assert [by_token(grants)[t].key for t in (first, second, third)] == ["0", "1", "2"]
    assert tokens_of(grants) == [first, second, third]
    popped = grants.pop(first)
    assert popped is not None and popped.token == first
    assert grants.get(first) is None
    assert grants.get(second) is not None and grants.get(third) is not None
    assert grants.pop(first) is None  # released once
    # The fence is free again: a grant put now takes it, and the others are still found.
    fourth = FENCE + "3" * 16
    grants.put(grant(fourth, key="3"))
    assert {t: rec.key for t, rec in by_token(grants).items()} == {
        second: "1",
        third: "2",
        fourth: "3",
    }
    assert grants.pop(third) is not None and grants.pop(second) is not None
    assert tokens_of(grants) == [fourth]


def test_a_second_grant_of_a_token_replaces_the_first_wherever_it_is_kept() -> None:
    kept, beside = FENCE + "a" * 16, FENCE + "b" * 16
    grants = RecordedGrants()
    grants.put(grant(kept, key="old"))
    grants.put(grant(beside, key="old"))  # same fence: kept beside
    assert grants.pop(kept) is not None  # the fence's slot is free, the other still beside
    grants.put(grant(beside, key="new"))
    grants.put(grant(kept, key="again"))
    assert len(grants.values()) == 2
    assert by_token(grants)[beside].key == "new" and by_token(grants)[kept].key == "again"
    grants.put(grant(kept, key="newer"))
    assert len(grants.values()) == 2 and by_token(grants)[kept].key == "newer"


def test_tokens_of_other_shapes_are_found_as_they_are_and_one_without_a_fence_is_refused() -> None:
    odd = ["aaaa", "0x1", "1", "+1", "AAAA"]
    grants = RecordedGrants()
    for n, token in enumerate(odd):
        grants.put(grant(token, key=str(n)))
    for token in ("not-hex-at-all", "-1", ""):
        with pytest.raises(ValueError, match="has no fence"):
            grants.put(grant(token))
        assert grants.get(token) is None and grants.pop(token) is None
    assert len(grants.values()) == len(odd)
    assert {t: by_token(grants)[t].key for t in odd} == {t: str(n) for n, t in enumerate(odd)}
    assert recorded(grants) == {t: fields(grant(t, key=str(n))) for n, t in enumerate(odd)}
    assert grants.get("aaab") is None and grants.get("0x2") is None
    for token in odd:
        assert grants.pop(token) is not None
    assert grants.values() == []


def test_runs_of_fences_with_gaps_jumps_and_earlier_fences_read_as_a_dict_of_tokens_would() -> None:
    """Random puts and pops against a dict of tokens, the model: fences one after another, a
    gap inside a run, a jump that begins a new run (a restart's counter), fences below the
    last one, tokens seen before, released and put again, and tokens that are not a server's."""
    rng = random.Random(52)
    base = int(FENCE, 16)
    issued: list[str] = []
    fence = base
    for _ in range(3_000):
        step = rng.choice([1] * 20 + [2, 50, 70_000, 10**12])
        fence += step
        issued.append(f"{fence:016x}{rng.getrandbits(64):016x}")
    issued += [f"{base + 5:016x}{'f' * 16}", "aaaa", "0x5", FENCE]
    model: dict[str, RecordedGrant] = {}
    grants = RecordedGrants()
    for n in range(20_000):
        token = rng.choice(issued) if rng.random() < 0.5 else issued[min(n // 6, len(issued) - 1)]
        if rng.random() < 0.6:
            rec = grant(token, key=str(n))
            model[token] = rec
            grants.put(rec)
        else:
            assert grants.pop(token) is model.pop(token, None)
        if n % 1_000 == 0:
            assert by_token(grants) == model and len(grants.values()) == len(model)
            assert all(grants.get(t) is rec for t, rec in model.items())
    assert sorted(tokens_of(grants)) == sorted(model)
    assert {id(rec) for rec in grants.values()} == {id(rec) for rec in model.values()}


def test_grants_in_no_order_of_their_fences_read_as_a_dict_of_tokens_would() -> None:
    """A rewritten journal lists its grants by key, not by fence: shuffled fences, then more
    grants in order after them (the records appended after a rewrite), popped in another
    order."""
    rng = random.Random(7)
    base = int(FENCE, 16)
    tokens = [f"{base + n:016x}{rng.getrandbits(64):016x}" for n in range(5_000)]
    rewritten, appended = tokens[:4_000], tokens[4_000:]
    rng.shuffle(rewritten)
    model: dict[str, RecordedGrant] = {}
    grants = RecordedGrants()
    for token in [*rewritten, *appended]:
        model[token] = rec = grant(token)
        grants.put(rec)
    assert by_token(grants) == model and sorted(tokens_of(grants)) == sorted(tokens)
    popped = list(model)
    rng.shuffle(popped)
    for token in popped[:2_500]:
        assert grants.pop(token) is model.pop(token)
        assert grants.get(token) is None
    assert by_token(grants) == model and all(grants.get(t) is rec for t, rec in model.items())


def _line(payload: str) -> bytes:
    return b"%08x %s\n" % (zlib.crc32(payload.encode()), payload.encode())


def test_a_journal_whose_grants_share_a_fence_restores_each_and_releases_only_its_own(
    tmp_path: Path,
) -> None:
    tokens = [FENCE + suffix * 16 for suffix in "abc"]
    payloads = [
        "H 3 b00t 1000000 500 everysec",
        *(f"G {t} key-{n} 1 0 30 1030000 c -" for n, t in enumerate(tokens)),
        f"R {tokens[1]}",
        f"X {tokens[2]} 40 1040000",
    ]
    path = tmp_path / "journal"
    path.write_bytes(b"".join(map(_line, payloads)))
    read = read_journal(str(path))
    assert not read.damage
    assert tokens_of(read.leases) == [tokens[0], tokens[2]]
    assert by_token(read.leases)[tokens[2]].until_ms == 1_040_000
    got = restored_leases(read, monotonic_ms=500, this_boot="b00t")
    assert [(r.key, r.left) for r in got.leases] == [("key-0", 30.0), ("key-2", 40.0)]
