"""The demo's verdict: it must be able to fail, so every way it can is shown here."""

from pathlib import Path

from celery_dflock.demo.timeline import Event, judge, read_events, record, render


def _run(key: str, tid: str, fence: int, start: float, end: float) -> list[Event]:
    return [Event("start", key, start, tid, fence, "w1"), Event("end", key, end, tid, fence, "w1")]


def test_sequential_runs_pass_and_render_a_row_per_run() -> None:
    events = [*_run("a", "t1", 1, 0.0, 1.0), *_run("a", "t2", 2, 1.0, 2.0)]
    events += [*_run("b", "t3", 3, 0.5, 1.5), Event("beat", "hb", 0.2, worker="beat-1")]
    verdict = judge(events)
    assert verdict.passed(expect_beat=True)
    text = render(verdict, expect_beat=True)
    assert text.count("|") >= 2 * 3
    assert "verdict: PASS" in text
    assert "beat-1 sent 1" in text


def test_overlap_fails() -> None:
    verdict = judge([*_run("a", "t1", 1, 0.0, 1.0), *_run("a", "t2", 2, 0.5, 2.0)])
    assert len(verdict.overlaps) == 1
    assert not verdict.passed()
    assert "OVERLAP on a" in render(verdict)


def test_fence_going_backwards_fails() -> None:
    verdict = judge([*_run("a", "t1", 5, 0.0, 1.0), *_run("a", "t2", 4, 1.0, 2.0)])
    assert verdict.fence_order_errors
    assert "verdict: FAIL" in render(verdict)


def test_unfinished_run_and_two_active_beats_fail() -> None:
    unfinished = judge([Event("start", "a", 0.0, "t1", 1)])
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
    assert not judge([*_run("a", "t1", 1, 0, 1)]).passed(expect_beat=True)


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
