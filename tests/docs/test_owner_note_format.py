"""docs/protocol.md's "celery-dflock's owner notes" is the form the plugin writes, and what
both of its readers (the plugin's and the bundled server's status page) read back."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final

from celery_dflock._request import beat_note, beat_pid, encode_note, note_parts
from dflockd_server.ownernotes import holder_of

PAGE: Final = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def section() -> str:
    text = PAGE.read_text(encoding="utf-8")
    return text.split("### celery-dflock's owner notes", 1)[1].split("\n### ", 1)[0]


def test_the_documented_example_is_what_a_run_writes_and_both_readers_read() -> None:
    example = re.search(r"```text\n<task id>/<host>/<pid>/<task name>\n(\S+)\n```", section())
    assert example is not None
    note = example.group(1)
    assert encode_note("6f1c2e", "celery@worker-1", pid=4242, name="reports.build") == note
    parts = note_parts(note)
    assert (parts.task_id, parts.host, parts.pid, parts.task_name) == (
        "6f1c2e",
        "celery@worker-1",
        4242,
        "reports.build",
    )
    shown = holder_of(note)
    assert (shown.task_id, shown.host, shown.pid, shown.task_name) == (
        parts.task_id,
        parts.host,
        parts.pid,
        parts.task_name,
    )


def test_the_documented_beat_note_is_what_a_beat_writes_and_both_readers_read() -> None:
    assert "`beat%3A4242/ops-1`" in section()
    note = beat_note(4242, "ops-1")
    assert note == "beat%3A4242/ops-1"
    parts = note_parts(note)
    assert (beat_pid(parts.task_id), parts.host) == (4242, "ops-1")
    shown = holder_of(note)
    assert (shown.pid, shown.host) == (4242, "ops-1")


def test_a_published_task_sends_its_task_id_and_name_and_no_parts_read_as_unknown() -> None:
    assert "`6f1c2e///reports.build`" in section()
    assert encode_note("6f1c2e", name="reports.build") == "6f1c2e///reports.build"
    assert encode_note("6f1c2e") == "6f1c2e"
    assert encode_note("x" * 201) is None
    for note in ("6f1c2e", "6f1c2e//notapid", "6f1c2e///reports.build", "_"):
        parts, shown = note_parts(note), holder_of(note)
        assert (parts.task_id, parts.host, parts.pid, parts.task_name) == (
            shown.task_id,
            shown.host,
            shown.pid,
            shown.task_name,
        )
    assert note_parts("6f1c2e//notapid").pid is None
