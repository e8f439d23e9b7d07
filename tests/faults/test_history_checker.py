"""The history checker on hand-made histories: clean ones pass, each violation is flagged."""

from __future__ import annotations

from typing import Any

import pytest

from tests.faults.history import Cut, Hold, check_double_grants, check_history
from tests.faults.workload import holds_from_events, read_events

LEASE = 2.0


def hold(
    client: str,
    fence: int | None,
    requested: float,
    granted: float | None,
    released: float | None = None,
    *,
    key: str = "k",
    outcome: str = "released",
    release_ok: bool | None = None,
    enqueued: float | None = None,
    renewed: tuple[float, ...] = (),
    holding_until: float | None = None,
) -> Hold:
    return Hold(
        key=key,
        client=client,
        requested_t=requested,
        enqueued_t=enqueued,
        granted_t=granted,
        fence=fence,
        lease_s=LEASE,
        outcome=outcome,
        released_t=released,
        release_ok=outcome == "released" if release_ok is None else release_ok,
        renewed_t=renewed,
        holding_until=holding_until,
    )


def kinds(holds: list[Hold], cuts: tuple[Cut, ...] = ()) -> list[str]:
    return [v.kind for v in check_history(holds, cuts).violations]


# ---------------------------------------------------------------------------- clean histories


def test_a_clean_serial_history_passes() -> None:
    holds = [
        hold("a", 10, 0.0, 0.01, 0.5),
        hold("b", 11, 0.2, 0.51, 0.9, enqueued=0.21),
        hold("c", 12, 0.3, 0.91, 1.2, enqueued=0.31),
        hold("a", 13, 1.3, 1.31, 1.4, key="other"),
        hold("d", None, 0.4, None, outcome="timeout", enqueued=0.41),
    ]
    result = check_history(holds)
    assert result.ok, result.summary()
    assert result.holds == 4
    assert result.attempts == 5
    assert result.ordered_pairs > 0
    assert result.fifo_pairs > 0
    assert result.proven == 4


def test_an_empty_history_passes() -> None:
    assert check_history([]).ok


def test_a_holder_paused_past_its_lease_is_not_a_double_grant() -> None:
    # a is granted at 0, stopped, and resumes at 5 believing it still holds the lock; the
    # server let its lease run out at 2 and granted b at 2.1. a's release is refused.
    holds = [
        hold("a", 10, 0.0, 0.01, 5.0, outcome="lost"),
        hold("b", 11, 0.5, 2.1, 2.5),
    ]
    assert kinds(holds) == []


def test_a_grant_delivered_late_proves_nothing_before_the_lease_started() -> None:
    # a asked at 0; its grant reply was stalled in a proxy until 3.0 (the lease had already
    # run out on the server, which granted b at 2.5). Nothing proves a valid at 3.0.
    holds = [
        hold("a", 10, 0.0, 3.0, 3.1, outcome="lost"),
        hold("b", 11, 1.0, 2.5, 3.5),
    ]
    assert kinds(holds) == []


def test_holds_cut_off_by_a_killed_client_end_at_the_cut() -> None:
    # a was SIGKILLed at 0.3 inside a long hold it had announced (until 1.0): the server
    # freed the lock when the connection closed, well inside a's lease, and granted b.
    holds = [
        hold("a", 10, 0.0, 0.01, None, outcome="killed", holding_until=1.0),
        hold("b", 11, 0.1, 0.31, 0.6),
    ]
    assert [v.kind for v in check_double_grants(holds)] == ["double_grant"]  # without the cut
    assert kinds(holds, (Cut(0.3, "a", done_t=0.301),)) == []


def test_a_server_restart_does_not_end_a_hold() -> None:
    # The server was killed at 0.3 while a held (lease 2 s from 0.0): a restarted server that
    # granted b at 0.31 granted inside a's lease (no restart grace): a double grant. One that
    # waited out the lease (its restart grace) granted b after 2.0: none.
    early = [hold("a", 10, 0.0, 0.01, None, outcome="lost"), hold("b", 11, 0.1, 0.31, 0.6)]
    assert kinds(early, (Cut(0.3, None, done_t=0.301),)) == ["double_grant"]
    late = [hold("a", 10, 0.0, 0.01, None, outcome="lost"), hold("b", 11, 0.1, 2.01, 2.2)]
    assert kinds(late, (Cut(0.3, None, done_t=0.301),)) == []


def test_a_cut_of_another_client_does_not_end_a_hold() -> None:
    holds = [
        hold("a", 10, 0.0, 0.01, None, outcome="killed", holding_until=1.0),
        hold("b", 11, 0.1, 0.31, 0.6),
    ]
    assert kinds(holds, (Cut(0.3, "c"),)) == ["double_grant"]


def test_a_cut_before_the_request_does_not_end_the_hold() -> None:
    holds = [
        hold("a", 10, 1.0, 1.01, None, outcome="killed", holding_until=2.0),
        hold("b", 11, 1.1, 1.31, 1.6),
    ]
    assert kinds(holds, (Cut(0.3, "a", done_t=0.31),)) == ["double_grant"]


def test_a_cut_injected_while_the_request_was_sent_may_end_the_hold() -> None:
    # a sent its request while the fault was being injected (between t and done_t): the
    # fault may have cut the new connection too.
    holds = [hold("a", 10, 0.305, 0.31, None, outcome="killed"), hold("b", 11, 0.4, 0.5, 0.6)]
    assert kinds(holds, (Cut(0.3, "a", done_t=0.31),)) == []


def test_a_killed_hold_is_proven_only_while_it_certainly_had_not_released() -> None:
    # a was killed at 0.3, right after the server had answered its release (sent at 0.2) but
    # before a could record it: the server rightly granted b at 0.25. Nothing proves a's hold
    # past the arrival of its grant, unless a had announced a long hold.
    holds = [hold("a", 10, 0.0, 0.01, None, outcome="killed"), hold("b", 11, 0.1, 0.25, 0.6)]
    assert kinds(holds, (Cut(0.3, "a", done_t=0.301),)) == []
    assert holds[0].valid_until() == 0.01
    announced = hold("a", 10, 0.0, 0.01, None, outcome="killed", holding_until=1.0)
    assert kinds([announced, holds[1]], (Cut(0.3, "a", done_t=0.301),)) == ["double_grant"]


# ---------------------------------------------------------------------------- (a) double grants


def test_two_holders_within_their_leases_are_a_double_grant() -> None:
    holds = [hold("a", 10, 0.0, 0.01, 0.5), hold("b", 11, 0.1, 0.2, 0.3)]
    result = check_history(holds)
    assert [v.kind for v in result.double_grants] == ["double_grant"]
    violation = result.double_grants[0]
    assert (violation.first.client, violation.second.client) == ("a", "b")
    assert "provably valid" in violation.detail


def test_a_confirmed_release_proves_the_hold_beyond_its_lease() -> None:
    # a held for 3 s (renewals not recorded); its release was accepted at 3.0, so the
    # server still counted it as the holder when it granted b at 2.5.
    holds = [hold("a", 10, 0.0, 0.01, 3.0), hold("b", 11, 0.5, 2.5, 3.5)]
    assert kinds(holds) == ["double_grant"]


def test_an_accepted_renewal_extends_the_proven_window() -> None:
    holds = [
        hold("a", 10, 0.0, 0.01, 5.0, outcome="lost", renewed=(1.0,)),
        hold("b", 11, 0.5, 2.5, 3.5),
    ]
    assert kinds(holds) == ["double_grant"]  # valid until 1.0 + 2 = 3.0 > 2.5
    later = [holds[0], hold("b", 11, 0.5, 3.2, 3.5)]
    assert kinds(later) == []


def test_a_refused_release_proves_nothing() -> None:
    holds = [hold("a", 10, 0.0, 0.01, 3.0, outcome="lost"), hold("b", 11, 0.5, 2.5, 3.5)]
    assert kinds(holds) == []


def test_the_window_ends_at_the_release_even_when_the_lease_runs_longer() -> None:
    holds = [hold("a", 10, 0.0, 0.01, 0.3), hold("b", 11, 0.1, 0.31, 0.6)]
    assert kinds(holds) == []


def test_double_grants_are_per_key() -> None:
    holds = [hold("a", 10, 0.0, 0.01, 0.5, key="x"), hold("b", 11, 0.1, 0.2, 0.3, key="y")]
    assert kinds(holds) == []


def test_a_hold_overlapping_an_earlier_long_one_is_found_past_a_short_one() -> None:
    holds = [
        hold("a", 10, 0.0, 0.01, 1.5),  # long, confirmed
        hold("b", 11, 0.0, 0.02, 0.05, outcome="lost", release_ok=False),  # overlaps a too
        hold("c", 12, 0.9, 1.0, 1.1),  # overlaps a, not b
    ]
    found = check_double_grants(holds)
    assert [(v.first.client, v.second.client) for v in found] == [("a", "b"), ("a", "c")]


# ---------------------------------------------------------------------------- (b) fences


def test_a_later_grant_with_a_smaller_fence_is_flagged() -> None:
    holds = [hold("a", 11, 0.0, 0.01, 0.1), hold("b", 10, 0.2, 0.21, 0.3)]
    result = check_history(holds)
    assert [v.kind for v in result.fence_violations] == ["fence_order"]
    assert result.double_grants == []


def test_fence_order_is_checked_across_keys() -> None:
    holds = [hold("a", 11, 0.0, 0.01, 0.1, key="x"), hold("b", 10, 0.2, 0.21, 0.3, key="y")]
    violations = check_history(holds).fence_violations
    assert [v.kind for v in violations] == ["fence_order"]
    assert violations[0].key == "x|y"
    assert "global order" in violations[0].detail


def test_fences_after_a_server_restart_must_stay_above_those_before() -> None:
    before = [hold("a", 1000 + i, i, i + 0.01, i + 0.1) for i in range(3)]
    restarted_low = [hold("b", 500, 10.0, 10.5, 10.6)]
    assert kinds(before + restarted_low, (Cut(5.0, None),)) == ["fence_order"]
    restarted_high = [hold("b", 5000, 10.0, 10.5, 10.6)]
    assert kinds(before + restarted_high, (Cut(5.0, None),)) == []


def test_an_equal_fence_is_a_duplicate() -> None:
    holds = [hold("a", 10, 0.0, 0.01, 0.1, key="x"), hold("b", 10, 0.2, 0.21, 0.3, key="y")]
    assert sorted(kinds(holds)) == ["duplicate_fence", "fence_order"]


def test_several_servers_order_fences_per_key_only() -> None:
    # Two cluster members count fences of their own: across keys neither order nor
    # uniqueness is promised, on one key both are.
    across = [hold("a", 11, 0.0, 0.01, 0.1, key="x"), hold("b", 10, 0.2, 0.21, 0.3, key="y")]
    assert check_history(across, one_server=False).fence_violations == []
    same_fence = [hold("a", 10, 0.0, 0.01, 0.1, key="x"), hold("b", 10, 0.2, 0.21, 0.3, key="y")]
    assert check_history(same_fence, one_server=False).fence_violations == []
    one_key = [hold("a", 11, 0.0, 0.01, 0.1), hold("b", 10, 0.2, 0.21, 0.3)]
    result = check_history(one_key, one_server=False)
    assert [v.kind for v in result.fence_violations] == ["fence_order"]
    assert result.ordered_pairs == 1
    equal_on_one_key = [hold("a", 10, 0.0, 0.01, 0.1), hold("b", 10, 0.2, 0.21, 0.3)]
    assert sorted(v.kind for v in check_history(equal_on_one_key, one_server=False).violations) == [
        "duplicate_fence",
        "fence_order",
    ]


def test_concurrent_grants_may_come_in_any_order() -> None:
    # b asked before a's grant reached a: which grant the server made first is unknown.
    holds = [hold("a", 11, 0.0, 0.02, 0.1, key="x"), hold("b", 10, 0.01, 0.015, 0.1, key="y")]
    assert kinds(holds) == []


# ---------------------------------------------------------------------------- (c) FIFO


def test_a_waiter_overtaken_by_a_later_one_is_flagged() -> None:
    holds = [
        hold("h", 10, 0.0, 0.01, 1.0),
        hold("a", 12, 0.1, 1.5, 1.6, enqueued=0.11),  # queued first, granted second
        hold("b", 11, 0.2, 1.01, 1.4, enqueued=0.21),
    ]
    result = check_history(holds)
    assert [v.kind for v in result.fifo_violations] == ["fifo"]
    assert (result.fifo_violations[0].first.client, result.fifo_violations[0].second.client) == (
        "a",
        "b",
    )
    assert result.fence_violations == []


def test_fifo_compares_with_a_blocking_acquire_sent_after_the_enqueue() -> None:
    holds = [
        hold("h", 10, 0.0, 0.01, 1.0),
        hold("a", 12, 0.1, 1.5, 1.6, enqueued=0.11),
        hold("b", 11, 0.2, 1.01, 1.4),  # ``l``: no enqueue acknowledgement of its own
    ]
    assert kinds(holds) == ["fifo"]


def test_fifo_ignores_waiters_whose_queue_order_is_unknown() -> None:
    holds = [
        hold("h", 10, 0.0, 0.01, 1.0),
        hold("a", 12, 0.1, 1.5, 1.6, enqueued=0.25),  # acknowledged after b asked
        hold("b", 11, 0.2, 1.01, 1.4, enqueued=0.21),
    ]
    assert kinds(holds) == []


def test_fifo_ignores_waiters_that_timed_out() -> None:
    holds = [
        hold("h", 10, 0.0, 0.01, 1.0, enqueued=0.01),  # ``e`` answered ``acquired``
        hold("a", None, 0.1, None, outcome="timeout", enqueued=0.11),
        hold("b", 11, 0.2, 1.01, 1.4, enqueued=0.21),
    ]
    result = check_history(holds)
    assert result.ok, result.summary()
    assert result.fifo_pairs == 1  # h before b only


def test_fifo_is_per_key() -> None:
    holds = [
        hold("a", 12, 0.1, 1.5, 1.6, enqueued=0.11, key="x"),
        hold("b", 11, 0.2, 1.01, 1.4, enqueued=0.21, key="y"),
    ]
    assert kinds(holds) == []


# ---------------------------------------------------------------------------- records


def test_a_hold_has_a_fence_and_a_grant_time_or_neither() -> None:
    with pytest.raises(ValueError, match="both a fence and a grant time"):
        hold("a", 10, 0.0, None)
    with pytest.raises(ValueError, match="unknown outcome"):
        hold("a", 10, 0.0, 0.1, outcome="vanished")


def test_worker_events_become_holds(tmp_path: Any) -> None:
    path = tmp_path / "w.jsonl"
    lines = [
        '{"ev": "grant", "id": 1, "key": "k", "fence": 7, "req": 0.0, "enq": null, '
        '"ok": 0.1, "lease": 2}',
        '{"ev": "end", "id": 1, "outcome": "released", "rel": 0.2, "rel_ok": true, "done": 0.3}',
        '{"ev": "nogrant", "id": 2, "key": "k", "req": 0.4, "enq": 0.41, "outcome": "timeout"}',
        '{"ev": "grant", "id": 3, "key": "k", "fence": 9, "req": 0.5, "enq": 0.51, '
        '"ok": 0.6, "lease": 2}',
        '{"ev": "end", "id": 3, "outc',  # torn by a SIGKILL
        '{"ev": "grant", "id": 4, "key": "k", "fence": 11, "req": 0.7, "enq": null, '
        '"ok": 0.8, "lease": 2}',
        '{"ev": "long", "id": 4, "key": "k", "fence": 11, "t": 0.85, "s": 5.0}',
    ]
    path.write_text("\n".join(lines))
    holds = holds_from_events("w", read_events(path))
    assert [(h.fence, h.outcome, h.release_ok) for h in holds] == [
        (7, "released", True),
        (None, "timeout", False),
        (9, "killed", False),
        (11, "killed", False),
    ]
    assert holds[2].enqueued_t == 0.51
    assert holds[0].valid_until() == 0.2
    assert holds[2].valid_until() == 0.6  # killed: proven only until its grant arrived
    assert holds[3].valid_until() == 0.7 + 2  # inside an announced long hold: its lease
