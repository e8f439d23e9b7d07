"""Owner notes as people read them: the parts of celery-dflock's note, and a note for a log.

celery-dflock's LockedTask sends ``<task id>/<host>/<pid>/<task name>``, each part
percent-encoded; a singleton beat sends ``beat:<pid>/<host>``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final
from urllib.parse import quote, unquote

from dflockd_server import constants as c

__all__ = ["HolderNote", "holder_of", "readable_note"]

_BEAT_PREFIX: Final = "beat:"


@dataclass(frozen=True, slots=True)
class HolderNote:
    """What a holder's owner note says, as the page shows it (a part it lacks: None)."""

    task_id: str | None = None
    host: str | None = None
    pid: int | None = None
    task_name: str | None = None


def holder_of(note: object) -> HolderNote:
    """The parts of an owner note in celery-dflock's form (trailing parts optional); a note of
    another form is its task id, as it is."""
    if not isinstance(note, str) or not note or note == c.NO_NOTE:
        return HolderNote()
    parts: list[str | None] = [unquote(part) or None for part in note.split("/", 3)]
    parts += [None] * (4 - len(parts))
    task_id, host, pid, name = parts
    if task_id is not None and task_id.startswith(_BEAT_PREFIX) and pid is None:
        pid, task_id, name = task_id.removeprefix(_BEAT_PREFIX), None, "celery beat"
    # ASCII digits only: ``str.isdigit`` takes "²" too, which ``int`` refuses.
    number = int(pid) if pid and pid.isascii() and pid.isdigit() else None
    return HolderNote(task_id, host, number, name)


def readable_note(note: str | None) -> str:
    """``note`` for a log line: each ``/``-separated part percent-decoded, except what would not
    be printable and spaceless (left encoded, so a note cannot forge a log line)."""
    if not note or note == c.NO_NOTE:
        return "no note"
    return "/".join(_decoded(part) for part in note.split("/", 3))


def _decoded(part: str) -> str:
    text = unquote(part, errors="replace")
    return "".join(ch if ch.isprintable() and not ch.isspace() else quote(ch) for ch in text)
