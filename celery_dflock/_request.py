"""What a locked run reads from and writes on Celery's request and message.

The lock's message headers (``*_HEADER``). A run reads its request once into a `Message`,
which its policies take whole. The lock a run holds is kept on its request (`mark_held`,
`held_lock`); `resend` sends the message again (a lock retry, an outage retry, a follower's
poll).

The owner note on each hold, run-time lock (`encode_note`) and beat's leader lock (`beat_note`),
read back by a refused publish or acquire and ``celery dflock locks`` (`decode_note`); its form:
[celery-dflock's owner notes](../protocol.md#celery-dflocks-owner-notes).
"""

from __future__ import annotations

import random
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, cast
from urllib.parse import quote, unquote

from celery_dflock._celery import Reject, Retry
from celery_dflock._runtime import AnyLock
from celery_dflock._settings import GivenOptions, read_call_options
from celery_dflock.client.errors import DflockError
from celery_dflock.config import LockOptions

LOCK_OPTIONS_HEADER: Final = "dflock_options"
"""Message header carrying per-call lock options (``apply_async(..., lock_timeout=5)``)."""
LOCK_RETRIES_HEADER: Final = "dflock_lock_retries"
"""Message header counting the retries ``on_locked="retry"`` made."""
OUTAGE_HEADER: Final = "dflock_outage"
"""Message header of a run sent again because its lock server was unreachable
(`celery_dflock._outage`): ``{"since": <epoch seconds>, "retries": <outage retries>}``."""
HOLD_HEADER: Final = "dflock_hold"
"""Message header of a task sent under a publish-time hold: ``{"key": ..., "token": ...}``."""
FOLLOW_HEADER: Final = "dflock_follow"
"""Message header of a canvas member sent in a duplicate's place: ``{"task_id": ..., "key": ...,
"error": ...}`` (the holder's task id; ``error`` set: fail at once with it)."""
BEAT_ENTRY_HEADER: Final = "dflock_beat_entry"
"""Message header naming the beat entry that sent a task (with ``dflock_beat_nonoverlap``); the
entry is named under this name in its `LOCK_OPTIONS_HEADER` too, where the run reads it
(`read_message_options`): a run without that header reads nothing more."""
NONOVERLAP_KEY_PREFIX: Final = "beat-entry:"

MAX_BACKOFF_EXPONENT: Final = 32  # the most doublings of a backoff


def backoff(first: float, done: int, cap: float, *, jitter: bool = False) -> float:
    """The pause after ``done`` tries: ``first`` doubled each time, at most ``cap``; with
    ``jitter``, a random point of its upper half."""
    pause = min(first * 2 ** min(done, MAX_BACKOFF_EXPONENT), cap)
    return pause / 2 + random.uniform(0, pause / 2) if jitter else pause


Call = tuple[tuple[Any, ...], dict[str, Any]]  # a run's (args, kwargs)


def read_message_options(raw: object, what: str) -> tuple[GivenOptions, GivenOptions | None]:
    """A message's `LOCK_OPTIONS_HEADER`, checked: its call options, and the options of beat's
    non-overlap when beat sent it for an entry (named there under `BEAT_ENTRY_HEADER`): the
    entry's own key, skipped while taken. Those rank below the task's own (``dflock_task_locks``,
    its attributes) and above the app's settings: a task with a ``lock_key`` keeps it, so its
    beat runs still exclude its other runs on that key."""
    given = mapping_of(raw)
    if given is None or BEAT_ENTRY_HEADER not in given:
        return read_call_options(raw, what), None
    options = {name: value for name, value in given.items() if name != BEAT_ENTRY_HEADER}
    if not (entry := given[BEAT_ENTRY_HEADER]):
        return read_call_options(options, what), None
    escaped = str(entry).replace("{", "{{").replace("}", "}}")  # a literal template
    beat = {"lock_key": NONOVERLAP_KEY_PREFIX + escaped, "on_locked": "skip"}
    return read_call_options(options, what), read_call_options(beat, f"beat entry {entry!r}")


def mapping_of(value: object) -> Mapping[str, Any] | None:
    """``value`` when it is a mapping (a header's value, or ``request.headers``)."""
    return cast("Mapping[str, Any]", value) if isinstance(value, Mapping) else None


def header(request: Any, name: str) -> object:
    """A message header of the current request (a request attribute on a worker, an entry of
    ``request.headers`` in eager runs)."""
    value = getattr(request, name, None)
    if value is None and (headers := mapping_of(getattr(request, "headers", None))) is not None:
        value = headers.get(name)
    return cast("object", value)


@dataclass(slots=True)
class Message:
    """One run, with its per-call lock options checked (None: none), and those of beat's
    non-overlap (`read_message_options`)."""

    task: Any
    request: Any
    call: Call
    options: GivenOptions | None
    task_id: str | None
    beat: GivenOptions | None = None

    @classmethod
    def read(cls, task: Any, request: Any, call: Call) -> Message:
        # Celery takes any id (an int too): the notes hold it as text
        task_id = None if request.id is None else str(request.id)
        if not (raw := header(request, LOCK_OPTIONS_HEADER)):
            return cls(task, request, call, None, task_id)
        what = f"call options of task {getattr(request, 'task', '?')!r}"
        options, beat = read_message_options(raw, what)
        return cls(task, request, call, options, task_id, beat)

    @property
    def label(self) -> str:
        """``task NAME[ID]``, or ``task NAME (called directly)`` for a run without an id."""
        name, task_id = self.task.name, self.request.id
        return f"task {name}[{task_id}]" if task_id else f"task {name} (called directly)"

    @property
    def retries(self) -> int:
        """The lock retries this message was sent again for so far."""
        value = header(self.request, LOCK_RETRIES_HEADER)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def mark_held(
    request: Any, key: str | None, lock: AnyLock | None, options: LockOptions | None
) -> None:
    """Record the run's lock on its request (``LockedTask.lock``, ``request.dflock_fence``,
    ...); all None once it is released."""
    request.dflock_lock = lock
    request.dflock_key = key
    request.dflock_fence = None if lock is None else lock.fence
    request.dflock_token = None if lock is None else lock.token
    request.dflock_run_options = options


def held_lock(request: Any) -> AnyLock | None:
    """The lock the run of ``request`` holds (None: none)."""
    return cast("AnyLock | None", getattr(request, "dflock_lock", None))


def held_options(request: Any) -> LockOptions | None:
    """The resolved lock options of the run of ``request``, while it holds its lock."""
    return cast("LockOptions | None", getattr(request, "dflock_run_options", None))


def resend(
    message: Message,
    *,
    countdown: float,
    retries: int,
    busy: DflockError,
    extra: Mapping[str, object] | None = None,
) -> BaseException:
    """Send the run again in ``countdown`` s as ``Task.retry`` does, but counted in
    `LOCK_RETRIES_HEADER`, not Celery's ``retries`` (a busy key never uses up the task's
    ``max_retries``). ``busy``: the `Retry`'s exception; ``extra``: more headers."""
    request = message.request
    headers = dict(mapping_of(getattr(request, "headers", None)) or {})
    # A worker's request keeps these as attributes.
    for name in (FOLLOW_HEADER, HOLD_HEADER, LOCK_OPTIONS_HEADER):
        if (value := header(request, name)) is not None:
            headers[name] = value
    headers.update(extra or {})
    headers[LOCK_RETRIES_HEADER] = retries
    headers.setdefault(HOLD_HEADER, None)  # sent again, not a new publish: no hold taken
    signature: Any = message.task.signature_from_request(
        request, *message.call, countdown=countdown, headers=headers
    )
    if request.is_eager:
        again = _EagerLockRetry(signature, int(request.retries or 0))
        return Retry(exc=busy, when=countdown, is_eager=True, sig=again)
    try:
        signature.apply_async()
    except Exception as exc:
        return Reject(exc, requeue=False)
    return Retry(exc=busy, when=countdown, sig=signature)


class _EagerLockRetry:
    """An eager lock retry's signature, as Celery's ``apply`` runs it again: with the run's
    own ``retries``, not one more (a lock retry is no retry of Celery's, as in a worker)."""

    def __init__(self, signature: Any, retries: int) -> None:
        self._signature = signature
        self._retries = retries

    def apply(self, **options: Any) -> Any:
        return self._signature.apply(**{**options, "retries": self._retries})


NOTE_MAX_BYTES: Final = 200  # the longest owner note the server stores (printable ASCII, no space)
_NO_NOTE: Final = "_"  # what the server says for a holder that gave no note


def encode_note(
    task_id: str | None, host: str | None = None, *, pid: int | None = None, name: str | None = None
) -> str | None:
    """The owner note; a part not given is left empty (``<id>///<name>``). A note too long
    loses its last parts, keeping a ``/`` after the id (``<id>/``: still a task's note); None
    when that is too long (or there is no task id)."""
    if not task_id:
        return None
    quoted = _quoted(task_id)
    note, gap = quoted, ""
    for part in (host, None if pid is None else str(pid), name):
        if not part:
            gap += "/"
            continue
        longer = f"{note}{gap}/{_quoted(part)}"
        if len(longer) > NOTE_MAX_BYTES:
            break
        note, gap = longer, ""
    if note == quoted and (host or pid is not None or name):
        note += "/"
    return note if len(note) <= NOTE_MAX_BYTES else None


_PLAIN: Final = re.compile(r"[A-Za-z0-9_.~@-]*")  # what quote(part, safe="") keeps, and @


def _quoted(part: str) -> str:
    """``quote(part, safe="")``, with one scan for the usual task id and worker name."""
    return part.replace("@", "%40") if _PLAIN.fullmatch(part) else quote(part, safe="")


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
    # ASCII digits only: ``str.isdigit`` takes "²" too, which ``int`` refuses.
    number = int(pid) if pid and pid.isascii() and pid.isdigit() else None
    return HolderNote(task_id, host, number, name)


def decode_note(note: str | None) -> tuple[str | None, str | None]:
    """(task id, host or None) from an owner note; (None, None) for no note or one without a
    ``/`` (not a task's: a lock taken outside Celery), unless it is a UUID alone (an older
    celery-dflock's publish-time hold)."""
    parts = note_parts(note)
    if (note is None or "/" not in note) and not _is_uuid(parts.task_id):
        return None, None
    return parts.task_id, parts.host


def _is_uuid(text: str | None) -> bool:
    try:
        return text is not None and str(uuid.UUID(text)) == text
    except ValueError:
        return False


_BEAT_PREFIX: Final = "beat:"  # the task part of a beat's owner note: beat:<pid>


def beat_note(pid: int, host: str) -> str | None:
    """The owner note of a singleton beat's leader lock: its pid and host."""
    return encode_note(f"{_BEAT_PREFIX}{pid}", host)


def beat_pid(task_part: str | None) -> int | None:
    """The beat's pid when a decoded note's task part is a beat's (`beat_note`), else None."""
    if task_part is None or not task_part.startswith(_BEAT_PREFIX):
        return None
    digits = task_part.removeprefix(_BEAT_PREFIX)
    return int(digits) if digits.isascii() and digits.isdigit() else None


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
    if (fields := mapping_of(value)) is None:  # (no header: every run without a hold)
        return None
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
    if (fields := mapping_of(value)) is None:
        return None
    key, task_id, error = fields.get("key"), fields.get("task_id"), fields.get("error")
    if not (isinstance(key, str) and key) or (task_id is None and error is None):
        return None
    if isinstance(task_id, str | None) and isinstance(error, str | None):
        return Follow(key, task_id, error)
    return None
