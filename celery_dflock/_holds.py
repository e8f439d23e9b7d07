"""Queue-once's small parts: the owner note stored with a key, and the message header that names
a publish-time hold.

A task sent with ``lock_from="publish"`` takes a *detached* hold on its key before the message
is published (`celery_dflock._queue_once.publish_hold`): it survives the publishing process,
and the message carries it in the `HOLD_HEADER` header (``{"key": ..., "token": ...}``). The
run that takes the message adopts the hold (`DistributedLock.adopt`), a retry hands it on to
the retry message, a revoke of the queued message releases it (`celery_dflock.signals`), and
``lock_pending_ttl`` frees it when no worker ever takes the message.

Each hold and each run-time lock carries an owner note: the task id, and while a run holds the
key, the worker's host name, the pid of the process running it and the task's name
(`encode_note`: ``<task id>/<host>/<pid>/<task name>``, each part percent-encoded; a note of
an older release stops after the host, and an older reader takes what follows the task id as
the host). The server stores it with the grant; a refused
publish or acquire reads the holder's task id back from it (`decode_note`), and so does
``celery dflock locks``. The singleton beat's leader lock carries a note too (`beat_note`: the
beat's pid and host), so ``celery dflock locks`` names the beat that sends.

Nothing here talks to a server; this module imports nothing of the rest of the Celery layer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, cast
from urllib.parse import quote, unquote

__all__ = [
    "FOLLOW_HEADER",
    "HOLD_HEADER",
    "NOTE_MAX_BYTES",
    "Follow",
    "HoldRef",
    "HolderNote",
    "beat_note",
    "beat_pid",
    "decode_note",
    "encode_note",
    "follow_of",
    "hold_of",
    "note_parts",
]

HOLD_HEADER: Final = "dflock_hold"
"""Message header of a task sent under a publish-time hold: ``{"key": ..., "token": ...}``."""
FOLLOW_HEADER: Final = "dflock_follow"
"""Message header of a canvas member sent in a duplicate's place: ``{"task_id": ..., "key": ...,
"error": ...}`` (the holder's task id; ``error`` set: fail at once with it)."""
NOTE_MAX_BYTES: Final = 200
"""The longest owner note the server stores (printable ASCII, no space)."""
_NO_NOTE: Final = "_"
"""What the server says for a holder that gave no note."""


def encode_note(
    task_id: str | None,
    host: str | None = None,
    *,
    pid: int | None = None,
    name: str | None = None,
) -> str | None:
    """The owner note of ``task_id`` (with ``host``, ``pid`` and the task's ``name`` while a
    run holds the key): each part percent-encoded (``quote(part, safe="")``), joined by ``/``.

    A note that would be too long loses its last parts (the name, then the pid, then the
    host); None when the task id alone is too long (or there is none): the lock is then taken
    without a note."""
    if not task_id:
        return None
    note = _quoted(task_id)
    if len(note) > NOTE_MAX_BYTES:
        return None
    for part in (host, None if pid is None else str(pid), name):
        if not part:
            break
        longer = f"{note}/{_quoted(part)}"
        if len(longer) > NOTE_MAX_BYTES:
            break
        note = longer
    return note


_PLAIN: Final = re.compile(r"[A-Za-z0-9_.~@-]*")
"""Characters ``quote(part, safe="")`` leaves as they are, and ``@``: a Celery task id (a
UUID) and a worker's name (``celery@host``) are made of these."""


def _quoted(part: str) -> str:
    """``quote(part, safe="")``: for the usual task id and worker name, without its work (one
    scan, and ``@`` replaced); anything else through ``quote``."""
    if _PLAIN.fullmatch(part):
        return part.replace("@", "%40")
    return quote(part, safe="")


@dataclass(frozen=True, slots=True)
class HolderNote:
    """What an owner note says (`encode_note`); a part it does not carry is None."""

    task_id: str | None = None
    host: str | None = None
    pid: int | None = None
    task_name: str | None = None


def note_parts(note: str | None) -> HolderNote:
    """Every part of an owner note (an empty `HolderNote` for no note)."""
    if not note or note == _NO_NOTE:
        return HolderNote()
    parts = [unquote(part) or None for part in note.split("/", 3)]
    parts += [None] * (4 - len(parts))
    task_id, host, pid, name = parts
    return HolderNote(task_id, host, int(pid) if pid and pid.isdigit() else None, name)


def decode_note(note: str | None) -> tuple[str | None, str | None]:
    """(task id, host or None) from an owner note; (None, None) for no note or a foreign one."""
    parts = note_parts(note)
    return parts.task_id, parts.host


_BEAT_PREFIX: Final = "beat:"
"""The task part of a beat's owner note: ``beat:<pid>`` (no task id starts so: Celery's are
UUIDs)."""


def beat_note(pid: int, host: str) -> str | None:
    """The owner note of a singleton beat's leader lock: its pid and host (`beat_pid` reads
    the pid back from the decoded task part)."""
    return encode_note(f"{_BEAT_PREFIX}{pid}", host)


def beat_pid(task_part: str | None) -> int | None:
    """The beat's pid when a decoded note's task part is a beat's (`beat_note`), else None."""
    if task_part is None or not task_part.startswith(_BEAT_PREFIX):
        return None
    digits = task_part.removeprefix(_BEAT_PREFIX)
    return int(digits) if digits.isdigit() else None


@dataclass(frozen=True, slots=True)
class HoldRef:
    """A publish-time hold as a message names it (`HOLD_HEADER`)."""

    key: str
    token: str

    def header(self) -> dict[str, str]:
        """The header value (plain JSON)."""
        return {"key": self.key, "token": self.token}


def hold_of(value: object) -> HoldRef | None:
    """The hold a `HOLD_HEADER` value names (None when absent or malformed)."""
    if not isinstance(value, Mapping):
        return None
    fields = cast("Mapping[str, Any]", value)
    key, token = fields.get("key"), fields.get("token")
    if isinstance(key, str) and key and isinstance(token, str) and token:
        return HoldRef(key, token)
    return None


@dataclass(frozen=True, slots=True)
class Follow:
    """A canvas member sent in a duplicate's place (`FOLLOW_HEADER`): its run gives the
    result of ``task_id`` (the task holding ``key``), or fails at once with ``error``."""

    key: str
    task_id: str | None
    error: str | None

    def header(self) -> dict[str, str | None]:
        """The header value (plain JSON)."""
        return {"key": self.key, "task_id": self.task_id, "error": self.error}


def follow_of(value: object) -> Follow | None:
    """The `Follow` a `FOLLOW_HEADER` value names (None when absent or malformed)."""
    if not isinstance(value, Mapping):
        return None
    fields = cast("Mapping[str, Any]", value)
    key, task_id, error = fields.get("key"), fields.get("task_id"), fields.get("error")
    if not isinstance(key, str) or not key:
        return None
    if task_id is not None and not isinstance(task_id, str):
        return None
    if error is not None and not isinstance(error, str):
        return None
    if task_id is None and error is None:
        return None
    return Follow(key, task_id, error)
