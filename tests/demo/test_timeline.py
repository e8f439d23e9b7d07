"""The demo's verdict: it must be able to fail, so every way it can is shown here."""

from pathlib import Path

from celery_dflock.demo import runner
from celery_dflock.demo.timeline import Event, judge, read_events, record, render

BEAT = Event("beat", "hb", 0.2, worker="beat-1")
"""One beat's send: with it, a verdict fails only for what a test adds."""


def _run(key: str, tid: str, fence: int, start: float, end: float) -> list[Event]:
    return [Event("start", key, start, tid, fence, "w1"), Event("end", key, end, tid, fence, "w1")]


def test_sequential_runs_pass_and_render_a_row_per_run() -> None:
    events = [*_run("a", "t1", 1, 0.0, 1.0), *_run("a", "t2", 2, 1.0, 2.0)]
    events += [*_run("b", "t3", 3, 0.5, 1.5), BEAT]
    verdict = judge(events)
    assert verdict.passed()
    text = render(verdict)
    assert text.count("|") >= 2 * 3
    assert "verdict: PASS" in text
    assert "beat-1 sent 1" in text


def test_overlap_fails() -> None:
    verdict = judge([*_run("a", "t1", 1, 0.0, 1.0), *_run("a", "t2", 2, 0.5, 2.0), BEAT])
    assert len(verdict.overlaps) == 1
    assert not verdict.passed()
    assert "OVERLAP on a" in render(verdict)


def test_fence_going_backwards_fails() -> None:
    verdict = judge([*_run("a", "t1", 5, 0.0, 1.0), *_run("a", "t2", 4, 1.0, 2.0), BEAT])
    assert verdict.fence_order_errors
    assert not verdict.passed()
    assert "verdict: FAIL" in render(verdict)


def test_unfinished_run_and_two_active_beats_fail() -> None:
    unfinished = judge([*_run("b", "t0", 1, 0, 1), Event("start", "a", 0.0, "t1", 1), BEAT])
    assert unfinished.unfinished == ["a/t1"]
    assert not unfinished.passed()
    two = judge(
        [
            *_run("a", "t1", 1, 0, 1),
            Event("beat", "hb", 0, worker="b1"),
            Event("beat", "hb", 1, worker="b2"),
        ]
    )
    assert not two.passed()
    assert not judge([*_run("a", "t1", 1, 0, 1)]).passed()
    assert judge([*_run("a", "t1", 1, 0, 1), BEAT]).passed()


def test_retries_and_skips_are_counted(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    for ev in [
        *_run("a", "t1", 1, 0, 1),
        Event("retry", "a", 0.5, "t2"),
        Event("skip", "a", 0.6, "t3"),
    ]:
        record(path, ev)
    verdict = judge(read_events(path))
    assert (verdict.retries, verdict.skips, len(verdict.runs)) == (1, 1, 1)
    assert "retried on contention: 1; skipped on contention: 1" in render(verdict)


def test_the_demo_waits_for_a_beats_first_send() -> None:
    """Every task finished past the few seconds a beat needs, but no beat has sent yet (slow
    to start on a loaded machine): the demo keeps waiting, up to its finish timeout, instead
    of ending with "NO BEAT sent the periodic task"."""
    tasks = [
        *(
            ev
            for i, account in enumerate(runner.ACCOUNTS)
            for ev in _run(f"account:{account}", f"t{i}", i + 1, 0.0, 1.0)
        ),
        *_run("report:daily", "r1", 9, 1.0, 2.0),
        Event("skip", "report:daily", 1.2, "r2"),
        Event("skip", "report:daily", 1.4, "r3"),
    ]
    expected = len(runner.ACCOUNTS)
    no_beat = judge(tasks)
    assert runner.progress_state(no_beat, runner.MIN_BEAT_S + 1, expected) == "running"
    with_beat = judge([*tasks, Event("beat", "hb", 3.0, worker="beat-1")])
    assert runner.progress_state(with_beat, runner.MIN_BEAT_S + 1, expected) == "done"
    # No beat ever: the demo ends at its finish timeout and the verdict says so.
    late = runner.FINISH_TIMEOUT_S + 1
    assert runner.progress_state(no_beat, late, expected) == "done"
    assert "NO BEAT" in render(no_beat)
    # Tasks unfinished at the timeout: an error, not a verdict.
    assert runner.progress_state(judge(tasks[:2]), late, expected) == "tasks late"


def test_judging_is_linear_in_the_keys() -> None:
    """Each key's runs were gathered by a pass over every run: keys x runs comparisons of
    keys (4,000,000 for 2,000 one-run keys). Counted, not timed: a few per run now."""
    compared: list[object] = []

    class CountedKey(str):  # a key that counts how often it is compared with another key
        __slots__ = ()

        def __eq__(self, other: object) -> bool:
            compared.append(other)
            return str.__eq__(self, other)

        __hash__ = str.__hash__

    keys = 2000
    events = [
        *(
            event
            for n in range(keys)
            for event in _run(CountedKey(f"k{n}"), f"t{n}", n + 1, n, n + 0.5)
        ),
        BEAT,
    ]
    verdict = judge(events)
    assert verdict.passed() and len(verdict.runs) == keys
    assert len(compared) <= 4 * keys
