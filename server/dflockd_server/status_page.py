"""The status page: ``/status`` on the metrics port, a small HTML page of what the server holds.

One row per held lock: its key, its holder (task name and id, worker host and pid, read from
the owner note celery-dflock's LockedTask sends: ``<task id>/<host>/<pid>/<task name>``, each
part percent-encoded; any other note is shown as it is), how long it has been held, the lease
left, the waiters, the fence and whether the grant is detached or restored from the journal;
then each semaphore's holders and waiters. The page refreshes itself every few seconds.

The page is made from a ``stats`` snapshot, asked on the event loop through the server's
rationed snapshots (``snapshots``): however often the page is loaded, it costs the loop no
more than ``stats`` requests do. Everything a client sent (keys, notes) is HTML-escaped, and
the page loads nothing (no script, no outside resource; its Content-Security-Policy says so).
"""

from __future__ import annotations

import concurrent.futures
import html
import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Final, cast
from urllib.parse import parse_qs, unquote

from dflockd_server import constants as c
from dflockd_server.snapshots import Asker

__all__ = ["PATH", "HolderNote", "StatusPage", "holder_of", "route"]

PATH: Final = "/status"
"""Where the metrics port serves the page (``/metrics`` and any other path: the metrics)."""
REFRESH_S: Final = 2
"""The page reloads itself this often (``?refresh=N`` for another period, 0 for never)."""
_MAX_REFRESH_S: Final = 3600
_BEAT_PREFIX: Final = "beat:"
"""The task part of a singleton beat's note (``beat:<pid>/<host>``)."""

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
"""A WSGI application (the metrics' one, and the router around it)."""


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


class _Reply:
    """The ``stats`` reply a page waits for (the snapshots' ``Asker``), across threads."""

    __slots__ = ("future",)

    def __init__(self) -> None:
        self.future: concurrent.futures.Future[bytes] = concurrent.futures.Future()

    def stats_ready(self, reply: bytes) -> None:
        if not self.future.done():
            self.future.set_result(reply)


class StatusPage:
    """Makes the page from a ``stats`` snapshot asked on the server's loop. ``ask`` is called
    on the loop: the reply now, or ``None`` and the asker's ``stats_ready`` later (the
    server's ``RationedSnapshots.request``)."""

    def __init__(
        self,
        call_soon: Callable[[Callable[[], None]], object],
        ask: Callable[[Asker], bytes | None],
        title: str,
    ) -> None:
        self._call_soon = call_soon
        self._ask = ask
        self.title = title
        """Who the page is about: ``dflockd-server <version> on <host:port>``."""

    def snapshot(self, timeout: float = c.METRICS_SCRAPE_TIMEOUT_S) -> dict[str, Any]:
        """The server's ``stats``, asked on its loop (call from another thread)."""
        waiter = _Reply()

        def ask() -> None:
            try:
                reply = self._ask(waiter)
            except BaseException as exc:
                waiter.future.set_exception(exc)
                return
            if reply is not None:
                waiter.stats_ready(reply)

        self._call_soon(ask)
        reply = waiter.future.result(timeout)
        status, _, payload = reply.decode().partition(" ")
        if status != c.STATUS_OK:
            raise RuntimeError(f"stats answered {reply[:80]!r}")
        return cast("dict[str, Any]", json.loads(payload))

    def app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        """The page as a WSGI application (GET and HEAD)."""
        if environ.get("REQUEST_METHOD") not in {"GET", "HEAD"}:
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b""]
        query = parse_qs(str(environ.get("QUERY_STRING", "")))
        refresh = _refresh(query.get("refresh", [""])[0])
        try:
            stats = self.snapshot()
        except (concurrent.futures.TimeoutError, RuntimeError) as exc:
            start_response("503 Service Unavailable", list(_HEADERS))
            body = _page(self.title, refresh, [f"<p>No snapshot: {html.escape(str(exc))}</p>"])
            return [body.encode()]
        start_response("200 OK", list(_HEADERS))
        return [render(self.title, stats, refresh, time.time()).encode()]


def route(metrics: WsgiApp, page: StatusPage) -> WsgiApp:
    """The metrics port's application: ``PATH`` is the page, any other path the metrics."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == PATH:
            return page.app(environ, start_response)
        return metrics(environ, start_response)

    return app


_HEADERS: Final = (
    ("Content-Type", "text/html; charset=utf-8"),
    ("Cache-Control", "no-store"),
    ("X-Content-Type-Options", "nosniff"),
    ("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'"),
)
"""The page's response headers (a new list each time: the server adds to the one it gets)."""


def _refresh(raw: str) -> int:
    if raw.isascii() and raw.isdigit():
        return min(int(raw), _MAX_REFRESH_S)
    return REFRESH_S


# ------------------------------------------------------------------------------ the page
_STYLE: Final = """
body { font-family: system-ui, sans-serif; font-size: 16px; margin: 24px; color: #1b1b1b; }
h1 { font-size: 22px; margin: 0 0 6px; }
h2 { font-size: 18px; margin: 24px 0 8px; }
p.summary { margin: 0 0 12px; color: #444; }
p.grace { background: #fff3cd; padding: 8px 12px; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: 6px 8px; border-bottom: 1px solid #ddd;
  vertical-align: top; }
th { background: #f2f2f2; font-weight: 600; white-space: nowrap; }
td.key, td.id { overflow-wrap: anywhere; font-family: ui-monospace, monospace;
  font-size: 15px; }
td.key { min-width: 14ch; }
td.id { min-width: 19ch; }
td.fence { overflow-wrap: anywhere; min-width: 10ch; font-variant-numeric: tabular-nums; }
td.num { text-align: right; white-space: nowrap; font-variant-numeric: tabular-nums; }
td.none { color: #888; }
"""


def _cell(value: object, kind: str = "") -> str:
    """One ``<td>``, its text escaped (``None``: a dash)."""
    if value is None or value == "":
        return '<td class="none">-</td>'
    css = f' class="{kind}"' if kind else ""
    return f"<td{css}>{html.escape(str(value))}</td>"


def _seconds(value: object) -> str | None:
    """``2.5 s``, ``3 min 05 s``, ``2 h 03 min``."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    seconds = float(value)
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"


def _items(stats: dict[str, Any], name: str) -> list[dict[str, Any]]:
    raw = stats.get(name)
    if not isinstance(raw, list):
        return []
    listed = cast("list[Any]", raw)
    return [cast("dict[str, Any]", item) for item in listed if isinstance(item, dict)]


def _state(lock: dict[str, Any]) -> str:
    if lock.get("restored") is True:
        return "restored (holder not back yet)"
    if lock.get("detached") is True:
        return "detached"
    return "held"


def _lock_rows(locks: list[dict[str, Any]]) -> Iterator[str]:
    for lock in sorted(locks, key=lambda entry: str(entry.get("key", ""))):
        holder = holder_of(lock.get("owner"))
        worker = holder.host
        if worker is None and holder.task_id is not None:
            worker = "none yet (publish-time hold, message queued)"
        cells = (
            _cell(lock.get("key"), "key"),
            _cell(holder.task_name),
            _cell(holder.task_id, "id"),
            _cell(worker),
            _cell(holder.pid, "num"),
            _cell(_seconds(lock.get("held_s")), "num"),
            _cell(_seconds(lock.get("lease_expires_in_s")), "num"),
            _cell(lock.get("waiters", 0), "num"),
            _cell(lock.get("fence"), "fence"),
            _cell(_state(lock)),
        )
        yield f"<tr>{''.join(cells)}</tr>"


def _semaphore_rows(sems: list[dict[str, Any]]) -> Iterator[str]:
    for sem in sorted(sems, key=lambda entry: str(entry.get("key", ""))):
        cells = (
            _cell(sem.get("key"), "key"),
            _cell(sem.get("limit"), "num"),
            _cell(sem.get("holders"), "num"),
            _cell(sem.get("waiters", 0), "num"),
        )
        yield f"<tr>{''.join(cells)}</tr>"


def _table(header: Iterable[str], rows: Iterable[str], empty: str) -> str:
    body = "".join(rows)
    if not body:
        return f"<p>{html.escape(empty)}</p>"
    head = "".join(f"<th>{html.escape(name)}</th>" for name in header)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _page(title: str, refresh: int, parts: Iterable[str]) -> str:
    meta = f'<meta http-equiv="refresh" content="{refresh}">' if refresh else ""
    name = html.escape(title)
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">{meta}'
        f"<title>{name}</title><style>{_STYLE}</style></head>"
        f"<body><h1>{name}</h1>{''.join(parts)}</body></html>"
    )


def render(title: str, stats: dict[str, Any], refresh: int, now: float) -> str:
    """The page for one ``stats`` snapshot taken at ``now`` (Unix time)."""
    locks, sems = _items(stats, "locks"), _items(stats, "semaphores")
    waiters = sum(int(item.get("waiters", 0) or 0) for item in (*locks, *sems))
    taken = time.strftime("%H:%M:%S UTC", time.gmtime(now))
    again = f"; refreshes every {refresh} s" if refresh else ""
    summary = (
        f'<p class="summary">{html.escape(str(stats.get("connections", "?")))} connection(s), '
        f"{len(locks)} lock(s) held, {len(sems)} semaphore(s) in use, {waiters} waiter(s); "
        f"snapshot at {taken}{again}</p>"
    )
    parts = [summary]
    grace = stats.get("grace_remaining_s")
    if isinstance(grace, int | float) and grace > 0:
        parts.append(f'<p class="grace">Restart grace: {grace:.1f} s left, no key is granted.</p>')
    header = (
        "Key",
        "Task",
        "Task id",
        "Worker",
        "PID",
        "Held for",
        "Lease left",
        "Waiters",
        "Fence",
        "State",
    )
    parts.append("<h2>Locks</h2>")
    parts.append(_table(header, _lock_rows(locks), "No lock is held."))
    parts.append("<h2>Semaphores</h2>")
    parts.append(
        _table(
            ("Key", "Limit", "Holders", "Waiters"),
            _semaphore_rows(sems),
            "No semaphore slot is held.",
        )
    )
    return _page(title, refresh, parts)
