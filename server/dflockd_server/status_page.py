"""The status page: ``/status`` on the metrics port, a small HTML page of what the server holds.

One row per held lock (its holder read from the owner note: ``ownernotes``), then each
semaphore; above them, one banner per degraded state the snapshot lists, or "Healthy". Under
760 px each lock is a card. It is made from a ``stats`` snapshot asked through the server's
rationed snapshots (``snapshots``), so loading it costs no more than ``stats`` requests. All a
client sent is HTML-escaped, and the page loads nothing (no script, no outside resource).
"""

from __future__ import annotations

import concurrent.futures
import html
import json
import time
from collections.abc import Callable, Iterable
from typing import Any, Final, cast
from urllib.parse import parse_qs

from dflockd_server import constants as c
from dflockd_server.ownernotes import HolderNote, holder_of
from dflockd_server.snapshots import Asker

__all__ = ["PATH", "HolderNote", "StatusPage", "holder_of", "route"]

PATH: Final = "/status"
REFRESH_S: Final = 2
"""The page reloads itself this often (``?refresh=N`` for another period, 0 for never)."""
_MAX_REFRESH_S: Final = 3600

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class _Reply(concurrent.futures.Future[bytes]):
    """The ``stats`` reply a page waits for, across threads."""

    def stats_ready(self, reply: bytes) -> None:
        if not self.done():
            self.set_result(reply)


class StatusPage:
    """Makes the page from a ``stats`` snapshot. ``ask`` (``RationedSnapshots.request``) is
    called on the loop: the reply now, or ``None`` and the asker's ``stats_ready`` later."""

    def __init__(
        self,
        call_soon: Callable[[Callable[[], None]], object],
        ask: Callable[[Asker], bytes | None],
        title: str,
    ) -> None:
        self._call_soon = call_soon
        self._ask = ask
        self.title = title

    def snapshot(self, timeout: float = c.METRICS_SCRAPE_TIMEOUT_S) -> dict[str, Any]:
        """The server's ``stats``, asked on its loop (call from another thread)."""
        waiter = _Reply()

        def ask() -> None:
            try:
                reply = self._ask(waiter)
            except BaseException as exc:
                waiter.set_exception(exc)
                return
            if reply is not None:
                waiter.stats_ready(reply)

        self._call_soon(ask)
        reply = waiter.result(timeout)
        status, _, payload = reply.decode().partition(" ")
        if status != c.STATUS_OK:
            raise RuntimeError(f"stats answered {reply[:80]!r}")
        return cast("dict[str, Any]", json.loads(payload))

    def app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        """The page as a WSGI application (GET and HEAD)."""
        if environ.get("REQUEST_METHOD") not in {"GET", "HEAD"}:
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b""]
        refresh = _refresh(parse_qs(str(environ.get("QUERY_STRING", ""))).get("refresh", [""])[0])
        try:
            stats = self.snapshot()
        except (concurrent.futures.TimeoutError, RuntimeError) as exc:
            status = "503 Service Unavailable"
            page = _page(self.title, refresh, [f"<p>No snapshot: {html.escape(str(exc))}</p>"])
        else:
            status, page = "200 OK", render(self.title, stats, refresh, time.time())
        body = page.encode()
        start_response(status, [*_HEADERS, ("Content-Length", str(len(body)))])
        return [b""] if environ["REQUEST_METHOD"] == "HEAD" else [body]  # HEAD: no content


def route(metrics: WsgiApp, page: StatusPage) -> WsgiApp:
    """The metrics port's application: ``PATH`` is the page, any other path the metrics."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == PATH:
            return page.app(environ, start_response)
        if environ.get("REQUEST_METHOD") != "HEAD":
            return metrics(environ, start_response)
        # prometheus_client answers HEAD 405: a GET's headers, without its content
        answer: list[Any] = []
        body = b"".join(metrics({**environ, "REQUEST_METHOD": "GET"}, lambda *a: answer.extend(a)))
        start_response(answer[0], [*answer[1], ("Content-Length", str(len(body)))])
        return [b""]

    return app


_HEADERS: Final = (
    ("Content-Type", "text/html; charset=utf-8"),
    ("Cache-Control", "no-store"),
    ("X-Content-Type-Options", "nosniff"),
    ("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'"),
)


def _refresh(raw: str) -> int:
    return min(int(raw), _MAX_REFRESH_S) if raw.isascii() and raw.isdigit() else REFRESH_S


_STYLE: Final = """
body { font-family: system-ui, sans-serif; font-size: 16px; margin: 24px; color: #1b1b1b; }
h1 { font-size: 22px; margin: 0 0 6px; overflow-wrap: anywhere; }
h2 { font-size: 18px; margin: 24px 0 8px; }
p.summary { margin: 0 0 12px; color: #444; }
.banner { padding: 8px 12px; margin: 0 0 8px; border-left: 6px solid; }
.banner.ok { background: #e7f5ea; border-color: #2e7d32; }
.banner.warning { background: #fff3cd; border-color: #b58100; }
.banner.error { background: #fde2e1; border-color: #b3261e; }
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
@media (max-width: 760px) {
  body { margin: 12px 20px; }
  table, tbody, tr, td { display: block; }
  thead { position: absolute; width: 1px; height: 1px; overflow: hidden;
    clip-path: inset(50%); }
  tr { border: 1px solid #ccc; border-radius: 6px; margin: 0 0 12px; padding: 4px 10px; }
  td, td.num { display: grid; grid-template-columns: 7rem minmax(0, 1fr); column-gap: 10px;
    border: none; padding: 3px 0; text-align: left; white-space: normal; min-width: 0;
    overflow-wrap: anywhere; }
  td.key, td.id, td.fence { min-width: 0; }
  td::before { content: attr(data-label); font-family: system-ui, sans-serif;
    font-weight: 600; color: #555; }
}
"""


def _cell(label: str, value: object, kind: str = "") -> str:
    """One ``<td>`` of the column ``label`` (a card's caption), its text escaped: HTML, and
    each character that is not printable shown as its escape (``\u202e``), so a key cannot
    turn the text around it (a bidi override) or hide what it is."""
    caption = f' data-label="{html.escape(label)}"'
    if value is None or value == "":
        return f'<td class="none"{caption}>-</td>'
    css = f' class="{kind}"' if kind else ""
    shown = "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode() for ch in str(value)
    )
    return f"<td{css}{caption}>{html.escape(shown)}</td>"


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
    listed = cast("list[Any]", raw) if isinstance(raw, list) else []
    return [cast("dict[str, Any]", item) for item in listed if isinstance(item, dict)]


def _state(lock: dict[str, Any]) -> str:
    if lock.get("restored") is True:
        return "restored (holder not back yet)"
    return "detached" if lock.get("detached") is True else "held"


Cell = tuple[str, object, str]
"""A row's cell: its column's label, its value, its CSS class ("" for none)."""
Row = Callable[[dict[str, Any]], list[Cell]]
"""An item's cells (``_lock_row``, ``_semaphore_row``)."""


def _lock_row(lock: dict[str, Any]) -> list[Cell]:
    holder = holder_of(lock.get("owner"))
    worker = holder.host
    if worker is None and holder.task_id is not None:
        worker = "none yet (publish-time hold, message queued)"
    return [
        ("Key", lock.get("key"), "key"),
        ("Task", holder.task_name, ""),
        ("Task id", holder.task_id, "id"),
        ("Worker", worker, ""),
        ("PID", holder.pid, "num"),
        ("Held for", _seconds(lock.get("held_s")), "num"),
        ("Lease left", _seconds(lock.get("lease_expires_in_s")), "num"),
        ("Waiters", lock.get("waiters", 0), "num"),
        ("Fence", lock.get("fence"), "fence"),
        ("State", _state(lock), ""),
    ]


def _semaphore_row(sem: dict[str, Any]) -> list[Cell]:
    return [
        ("Key", sem.get("key"), "key"),
        ("Limit", sem.get("limit"), "num"),
        ("Holders", sem.get("holders"), "num"),
        ("Waiters", sem.get("waiters", 0), "num"),
    ]


def _table(heading: str, items: list[dict[str, Any]], row: Row, empty: str) -> str:
    """Under ``heading``, a table of one ``row`` per item, by key (its header: the rows'
    labels), or ``empty``."""
    rows = [row(item) for item in sorted(items, key=lambda item: str(item.get("key", "")))]
    if not rows:
        return f"<h2>{heading}</h2><p>{html.escape(empty)}</p>"
    head = "".join(f"<th>{html.escape(label)}</th>" for label, _, _ in rows[0])
    body = "".join(f"<tr>{''.join(_cell(*cell) for cell in cells)}</tr>" for cells in rows)
    return f"<h2>{heading}</h2><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _page(title: str, refresh: int, parts: Iterable[str]) -> str:
    meta = f'<meta http-equiv="refresh" content="{refresh}">' if refresh else ""
    name = html.escape(title)
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">{meta}'
        f"<title>{name}</title><style>{_STYLE}</style></head>"
        f"<body><h1>{name}</h1>{''.join(parts)}</body></html>"
    )


def _banners(stats: dict[str, Any]) -> list[str]:
    """One banner per degraded state the snapshot lists, the errors first; else "Healthy"."""
    found = _items(stats, "degraded")
    if not found:
        return ['<p class="banner ok" data-condition="healthy"><strong>Healthy</strong>: '
                "granting new locks.</p>"]  # fmt: skip
    found.sort(key=lambda entry: entry.get("severity") != "error")
    out: list[str] = []
    for entry in found:
        css = "error" if entry.get("severity") == "error" else "warning"
        said = {
            part: html.escape(str(entry.get(part, ""))) for part in ("name", "title", "message")
        }
        out.append(
            f'<p class="banner {css}" role="alert" data-condition="{said["name"]}">'
            f"<strong>{said['title']}</strong>: {said['message']}</p>"
        )
    return out


def render(title: str, stats: dict[str, Any], refresh: int, now: float) -> str:
    """The page for one ``stats`` snapshot taken at ``now`` (Unix time)."""
    locks, sems = _items(stats, "locks"), _items(stats, "semaphores")
    waiters = sum(int(item.get("waiters", 0) or 0) for item in (*locks, *sems))
    taken = time.strftime("%H:%M:%S UTC", time.gmtime(now))
    again = f"; refreshes every {refresh} s" if refresh else ""
    summary = (
        f'<p class="summary">{html.escape(str(stats.get("connections", "?")))} connection(s), '
        f"{stats.get('sessions', 0)} client session(s) keeping {stats.get('session_grants', 0)} "
        "grant(s), "
        f"{len(locks)} lock(s) held, {len(sems)} semaphore(s) in use, {waiters} waiter(s); "
        f"snapshot at {taken}{again}</p>"
    )
    parts = [*_banners(stats), summary, _table("Locks", locks, _lock_row, "No lock is held.")]
    parts.append(_table("Semaphores", sems, _semaphore_row, "No semaphore slot is held."))
    return _page(title, refresh, parts)
