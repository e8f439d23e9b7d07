"""A setting's environment variable and its alias (dflockd's name and this server's), both set,
on ``dflockd`` started as a user starts it."""

from __future__ import annotations

from collections.abc import Callable

from tests.support.servers import DflockdProcess, run_dflockd


def test_a_variable_and_its_alias_that_disagree_stop_the_start() -> None:
    """``DFLOCKD_GC_LOOP_SLEEP=2`` beside ``DFLOCKD_GC_INTERVAL_S=abc`` (or ``=7``): the first
    won without a word, the other was not even read (its ``abc`` was no error). Now the start
    stops (exit 2) naming both."""
    for other in ("abc", "7"):
        env = {"DFLOCKD_GC_LOOP_SLEEP": "2", "DFLOCKD_GC_INTERVAL_S": other}
        done = run_dflockd(["--host", "127.0.0.1", "--port", "0"], env, timeout=10)
        assert done.returncode == 2, done
        assert "DFLOCKD_GC_LOOP_SLEEP" in done.stderr, done
        assert "DFLOCKD_GC_INTERVAL_S" in done.stderr, done


def test_a_variable_and_its_alias_that_agree_are_taken(
    dflockd_process: Callable[..., DflockdProcess],
) -> None:
    proc = dflockd_process(
        "--host", "127.0.0.1", "--port", "0",
        env={"DFLOCKD_GC_MAX_UNUSED_TIME": "30", "DFLOCKD_GC_MAX_IDLE_S": " 30 "},
    )  # fmt: skip
    assert "gc_max_idle_s=30.0" in proc.wait_for("listening on")
