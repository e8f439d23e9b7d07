"""Owner notes as people read them: the parts of celery-dflock's note, and a note for a log.

celery-dflock's LockedTask sends ``<task id>/<host>/<pid>/<task name>``, each part
percent-encoded (a worker named ``celery@ops1`` is ``celery%40ops1`` on the wire); a singleton
beat sends ``beat:<pid>/<host>``. The status page shows the parts (``holder_of``), the server's
log the note with its parts decoded (``readable_note``); any other note is shown as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final
from urllib.parse import quote, unquote

from dflockd_server import constants as c

__all__ = ["HolderNote", "holder_of", "readable_note"]

_BEAT_PREFIX: Final = "beat:"
"""The task part of a singleton beat's note (``beat:<pid>/<host>``)."""


@dataclass(frozen=True, slots=True)
class HolderNote:
    """What a holder's owner note says, as the page shows it (a part it lacks: None)."""

    task_id: str | None = None
    host: str | None = None
    pid: int | None = None
    task_name: str | None = None


def holder_of(note: object) -> HolderNote:
    """The parts of an owner note in celery-dflock's form (``<task id>/<host>/<pid>/<task
    name>``, percent-encoded, trailing parts optional); a singleton beat's (``beat:<pid>``)
    names the beat. A note of another form is its task id, as it is."""
    if not isinstance(note, str) or not note or note == c.NO_NOTE:
        return HolderNote()
    parts: list[str | None] = [unquote(part) or None for part in note.split("/", 3)]
    parts += [None] * (4 - len(parts))
    task_id, host, pid, name = parts
    if task_id is not None and task_id.startswith(_BEAT_PREFIX) and pid is None:
        beat_pid = task_id.removeprefix(_BEAT_PREFIX)
        pid, task_id, name = beat_pid, None, "celery beat"
    return HolderNote(task_id, host, int(pid) if pid and pid.isdigit() else None, name)


def readable_note(note: str | None) -> str:
    """``note`` for a log line: each ``/``-separated part percent-decoded
    (``4f1c/celery%40w1/42/t`` -> ``4f1c/celery@w1/42/t``), except what would not be one
    printable word once decoded (a space, a line break: left encoded, so a note cannot
    forge a log line); ``no note`` for none."""
    if not note or note == c.NO_NOTE:
        return "no note"
    return "/".join(_decoded(part) for part in note.split("/", 3))


def _decoded(part: str) -> str:
    text = unquote(part, errors="replace")
    return "".join(ch if ch.isprintable() and not ch.isspace() else quote(ch) for ch in text)
