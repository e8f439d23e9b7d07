# pyright: reportMissingTypeStubs=false
"""``celery -A proj dflock status|locks|ping|shards|release``: what the lock servers hold, from the
shell, and an operator's release of a key whoever holds it.

Registered through Celery's ``celery.commands`` entry point, so it reads the app's own
``dflock_*`` settings. ``--json`` prints one JSON document for scripts. Every sub-command names
every server it could not reach, and what a reachable one does not support. Exit status 0
when every server answered, 1 when one did not.
"""

from __future__ import annotations

import getpass
import json
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast
from urllib.parse import quote

import click
from celery.bin.base import CeleryCommand

from celery_dflock.client.errors import DflockError, InvalidValueError
from celery_dflock.client.wire import FEATURE_FENCE, FEATURE_HELLO, FEATURE_PING, FEATURE_STATS

if TYPE_CHECKING:
    from celery_dflock.client.clients import Client, ServerInfo, ServerShards, ServerStatus
    from celery_dflock.config import DflockConfig

# Celery loads this module for every ``celery`` command: what only a ``dflock`` command needs
# is imported when it runs.

__all__ = [
    "RESTORED_MARK",
    "ServerReport",
    "collect",
    "collect_shards",
    "dflock",
    "format_locks",
    "format_ping",
    "format_shards",
    "format_status",
    "operator_note",
    "release_keys",
    "shards_json",
]


@dataclass(frozen=True, slots=True)
class ServerReport:
    """One server's answer: ``server`` is what it said to ``hello`` (None when it could not
    be reached), ``stats`` its ``stats`` (None when unreachable or not supported)."""

    address: str
    stats: dict[str, Any] | None
    error: str | None = None
    server: ServerInfo | None = None

    @classmethod
    def of(cls, status: ServerStatus) -> ServerReport:
        return cls(status.address, status.stats, status.error, status.server)

    @property
    def reachable(self) -> bool:
        """True when the server answered ``hello`` (even with ``error``: an older dflockd)."""
        return self.server is not None

    @property
    def lacks(self) -> list[str]:
        """What a reachable server does not support, of what this command uses or reports."""
        if self.server is None:
            return []
        answered = () if self.stats is None else (FEATURE_STATS,)  # supported, whatever hello said
        return [f for f in _REPORTED_FEATURES if not self.server.supports(f) and f not in answered]

    @property
    def note(self) -> str:
        """Why a server is unreachable, or what a reachable one does not support ('' if all)."""
        if self.server is None:
            return self.error or "unreachable"
        lacks = [f for f in self.lacks if f != FEATURE_HELLO]
        who = "older dflockd (no hello)" if self.server.legacy else self.server.describe()
        if not lacks:
            return "" if not self.server.legacy else who
        said = [_LACKING.get(feature, f"no {feature}") for feature in lacks]
        return f"{who}: {'; '.join(said)}"

    @property
    def degraded(self) -> list[tuple[str, str, str]]:
        """(name, severity, "Title: message") of each degraded state ``stats`` lists."""
        found: list[tuple[str, str, str]] = []
        for item in _items(self.stats, "degraded"):
            name, severity = item.get("name"), item.get("severity")
            title, message = item.get("title"), item.get("message")
            if isinstance(name, str) and isinstance(severity, str) and isinstance(message, str):
                if severity == DEGRADED_ERROR:
                    title = f"{title or name}".upper()
                found.append((name, severity, f"{title or name}: {message}"))
        return found

    @property
    def failing(self) -> list[tuple[str, str, str]]:
        """The degraded states in which the server grants nothing new (`DEGRADED_ERROR`)."""
        return [item for item in self.degraded if item[1] == DEGRADED_ERROR]

    @property
    def healthy(self) -> bool:
        """Reachable, and granting (no `failing` state)."""
        return self.reachable and not self.failing

    def as_json(self) -> dict[str, Any]:
        """The report as plain JSON data, each held lock with its holder (`_with_holder`)."""
        info = self.server
        stats = self.stats
        if stats is not None:
            stats = {**stats, "locks": [_with_holder(lock) for lock in _items(stats, "locks")]}
        return {
            "server": self.address,
            "reachable": self.reachable,
            "error": self.error,
            "stats": stats,
            "software": None
            if info is None or info.legacy
            else {"name": info.name, "version": info.version, "features": sorted(info.features)},
            "unsupported": self.lacks,
        }


DEGRADED_ERROR: Final = "error"
"""The severity of a degraded state in which a server grants nothing new."""
_SHORT: Final = {
    "journal_read_only": "READ-ONLY (journal cannot be written)",
    "draining": "DRAINING",
    "fenced": "FENCED (etcd)",
    "restart_grace": "restart grace",
    "shards_moving": "shards moving",
}
_GRACE: Final = "restart_grace"  # the degraded state format_status says from the grace fields
RESTORED_MARK: Final = "restored, not yet reattached"
"""`format_locks`' note on a lease restored from the journal that no connection renewed since."""

_REPORTED_FEATURES: Final = (FEATURE_HELLO, FEATURE_STATS, FEATURE_PING, FEATURE_FENCE)
_LACKING: Final = {
    FEATURE_STATS: "no stats, so its locks cannot be listed",
    FEATURE_FENCE: "no fencing tokens (lock.fence is None)",
}


def collect(config: DflockConfig) -> list[ServerReport]:
    """Ask every configured server for its ``stats``."""
    with config.new_client() as client:
        return [ServerReport.of(status) for status in client.stats()]


def collect_shards(config: DflockConfig) -> list[ServerShards]:
    """Ask every configured server ``shards``."""
    with config.new_client() as client:
        return client.shards()


def shards_json(answers: Sequence[ServerShards]) -> list[dict[str, Any]]:
    """`collect_shards` for ``--json``."""
    return [_shard_json(answer) for answer in answers]


def _shard_json(answer: ServerShards) -> dict[str, Any]:
    info = answer.shards
    if info is None:
        return {"server": answer.address, "error": answer.error}
    return {
        "server": answer.address,
        "mode": info.mode,
        "self": info.self_address,
        "members": list(info.members),
        "leader": info.leader,
        "shards_per_member": info.shards_per_member(),
        "moving": len(info.moving),
    }


def format_shards(answers: Sequence[ServerShards]) -> str:
    """Per server: its mode and members; in cluster mode the leader, the shards each member
    serves and the moves in progress."""
    lines: list[str] = []
    for answer in answers:
        info = answer.shards
        if info is None:
            lines.append(f"{answer.address}: UNREACHABLE or no shards: {answer.error}")
            continue
        members = ",".join(info.members) or "-"
        head = f"{answer.address}: mode {info.mode}"
        if info.mode == "single":
            lines.append(f"{head} (serves every key)")
            continue
        lines.append(f"{head}, self {info.self_address or '?'}, members {members}")
        if info.cluster is not None:
            lines.append(f"  leader {info.leader or 'none'}; moves in progress {len(info.moving)}")
            for node, count in sorted(info.shards_per_member().items()):
                lines.append(f"  {node}: {count} shard(s)")
    return "\n".join(lines)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _items(stats: dict[str, Any] | None, name: str) -> list[dict[str, Any]]:
    """The JSON objects listed under ``name`` in ``stats`` (none when it has no ``stats``)."""
    raw = (stats or {}).get(name, [])
    return [cast(dict[str, Any], item) for item in cast(list[Any], raw) if isinstance(item, dict)]


def _with_holder(lock: dict[str, Any]) -> dict[str, Any]:
    """A ``stats`` lock entry with its holder read from its owner note (a singleton beat's
    leader lock: ``holder_beat_pid``)."""
    from celery_dflock._request import beat_pid, note_parts

    owner = lock.get("owner")
    note = note_parts(owner if isinstance(owner, str) else None)
    pid = beat_pid(note.task_id)
    return {
        **lock,
        "holder_task_id": None if pid is not None else note.task_id,
        "holder_host": note.host,
        "holder_pid": note.pid,
        "holder_task_name": note.task_name,
        "holder_beat_pid": pid,
        "detached": bool(lock.get("detached", False)),
    }


def _shown(text: str) -> str:
    """``text`` (a key, a part of a holder's note: whatever a client sent) for the terminal:
    each character that is not printable (a backspace, an escape, a bidi override) written
    as Python writes it (``\\x08``), so nothing a client sent moves the cursor or hides a
    row; ``--json`` has the text exactly."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _durability(address: str, stats: dict[str, Any], *, said_read_only: bool) -> list[str]:
    """What a server says of its restart grace and its journal (the fields it sends)."""
    lines: list[str] = []
    if (grace := _number(stats.get("grace_remaining_s")) or 0.0) > 0:
        reason = stats.get("grace_reason")
        why = f" ({reason})" if isinstance(reason, str) and reason else ""
        until = time.strftime("%H:%M:%S", time.gmtime(time.time() + grace))
        lines.append(
            f"{address}: restart grace until {until} UTC ({grace:.1f} s left), no key granted{why}"
        )
    journal: Any = stats.get("journal")
    if "journal" in stats and journal is None:
        lines.append(f"{address}: journal off")
    if not isinstance(journal, dict):
        return lines
    journal = cast(dict[str, Any], journal)
    parts = [f"state dir {journal['state_dir']}"] if "state_dir" in journal else []
    if "fsync" in journal:
        parts.append(f"fsync {journal['fsync']}")
    if (restored := _number(journal.get("restored"))) is not None:
        parts.append(f"{restored:.0f} lease(s) restored")
    if (dropped := _number(journal.get("dropped_records"))) is not None:
        parts.append(f"{dropped:.0f} record(s) dropped")
    lines.append(f"{address}: journal on" + (f": {', '.join(parts)}" if parts else ""))
    if journal.get("writable") is False and not said_read_only:
        failure = journal.get("write_failure") or "a write failed"
        lines.append(
            f"{address}: READ-ONLY: the journal cannot be written ({failure}): nothing new "
            "is granted (error_read_only), locks held stay held"
        )
    return lines


def format_status(reports: Sequence[ServerReport]) -> str:
    """One row per server, then its restart grace, journal and degraded states."""
    rows: list[list[str]] = []
    for rep in reports:
        if rep.stats is None:  # unreachable (-), or no stats (?)
            unknown = [*["?" if rep.reachable else "-"] * 5, rep.note]
            rows.append([rep.address, "yes" if rep.reachable else "NO", *unknown])
            continue
        locks = _items(rep.stats, "locks")
        sems = _items(rep.stats, "semaphores")
        waiters = sum(_number(i.get("waiters")) or 0 for i in (*locks, *sems))
        counts = (rep.stats.get("connections", "?"), rep.stats.get("sessions", "-"))
        counts += (len(locks), len(sems), f"{waiters:.0f}")
        states = [_SHORT.get(name, name) for name, _, _ in rep.degraded]
        note = "; ".join([*states, rep.note] if rep.note else states)
        rows.append([rep.address, "yes", *map(str, counts), note])
    header = ["server", "reachable", "connections", "sessions", "locks", "semaphores"]
    header += ["waiters", "note"]
    lines = _table(header, rows)
    for rep in reports:
        if rep.stats is not None:
            shown = [(name, line) for name, _, line in rep.degraded if name != _GRACE]
            said = any(name == "journal_read_only" for name, _ in shown)
            lines += _durability(rep.address, rep.stats, said_read_only=said)
            lines += [f"{rep.address}: {line}" for _, line in shown]
    return "\n".join(lines)


def format_locks(reports: Sequence[ServerReport]) -> str:
    """One row per held lock or semaphore, with the task (or beat) holding a lock; "queued"
    while its message waits under a publish-time hold. A note column marks restored leases."""
    rows: list[list[str]] = []
    for rep in reports:
        for lock in _items(rep.stats, "locks"):
            key = _shown(str(lock.get("key", "?")))
            lease = _number(lock.get("lease_expires_in_s"))
            left = "-" if lease is None else f"{lease:.1f}s"
            held = _with_holder(lock)
            beat = held["holder_beat_pid"]
            name = f"celery beat, pid {beat}" if beat is not None else held["holder_task_name"]
            host = held["holder_host"] or ("queued" if held["holder_task_id"] else "-")
            holder = [_shown(name or "-"), _shown(held["holder_task_id"] or "-"), _shown(host)]
            note = RESTORED_MARK if lock.get("restored") is True else ""
            counts = ["1", str(lock.get("waiters", 0))]
            rows.append([rep.address, key, "lock", left, *counts, *holder, note])
        for sem in _items(rep.stats, "semaphores"):
            key = _shown(str(sem.get("key", "?")))
            kind = f"semaphore/{sem.get('limit', '?')}"
            counts = [str(sem.get("holders", "?")), str(sem.get("waiters", 0))]
            rows.append([rep.address, key, kind, "-", *counts, "-", "-", "-", ""])
    if rows:
        header = ["server", "key", "kind", "lease left", "holders", "waiters"]
        header += ["task", "task id", "host"]  # the holder
        if any(row[-1] for row in rows):  # a restored lease
            header.append("note")
        else:
            rows = [row[:-1] for row in rows]
        lines = _table(header, rows)
    elif all(rep.stats is not None for rep in reports):
        lines = ["no locks held"]
    else:
        lines = ["no locks held on the servers that answered stats"]
    for rep in reports:
        if not rep.reachable:
            lines.append(f"{rep.address}: UNREACHABLE, its locks are unknown: {rep.note}")
        elif rep.stats is None:
            lines.append(f"{rep.address}: reachable, {rep.note}")
    return "\n".join(lines)


_Answer = TypeVar("_Answer")


def _answer(
    ctx: click.Context,
    as_json: bool,
    ask: Callable[[DflockConfig], list[_Answer]],
    *,
    json_of: Callable[[list[_Answer]], object],
    render: Callable[[list[_Answer]], str],
    ok: Callable[[_Answer], bool],
) -> None:
    """Ask every server, print the answers, and exit 1 unless every answer is ``ok``."""
    from celery_dflock.config import DflockConfigError, get_config

    try:
        answers = ask(get_config(ctx.obj.app))
    except DflockConfigError:
        raise  # the app's settings, not the command line: one line, exit 1, as a worker's
    except (DflockError, ValueError) as exc:
        raise click.UsageError(str(exc)) from exc
    # Escaped line by line: a server's or a worker's words (a journal's path, a failure, a
    # degraded state's message) are shown as `_shown` shows a key.
    shown = "\n".join(map(_shown, render(answers).split("\n")))
    click.echo(json.dumps(json_of(answers), indent=2) if as_json else shown)
    if not all(ok(answer) for answer in answers):
        ctx.exit(1)


def _reports_json(reports: list[ServerReport]) -> list[dict[str, Any]]:
    return [r.as_json() for r in reports]


_JSON = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")


@click.group(name="dflock")
def dflock() -> None:
    """Inspect the dflockd lock servers this app uses (dflock_servers)."""


def _command(function: Callable[..., None]) -> click.Command:
    """A ``dflock`` sub-command that asks the servers: ``--json`` first, then its own options."""
    return dflock.command(cls=CeleryCommand)(_JSON(click.pass_context(function)))


WORKERS_TIMEOUT_S: Final = 1.0


def ask_workers(app: Any, timeout_s: float = WORKERS_TIMEOUT_S) -> dict[str, dict[str, Any]]:
    """Each running worker's answer to `OUTAGES_COMMAND` (through the broker), by name."""
    from celery_dflock._worker_hooks import OUTAGES_COMMAND

    try:
        answered = app.control.broadcast(OUTAGES_COMMAND, reply=True, timeout=timeout_s)
    except Exception as exc:  # whatever the broker's transport raises (refused, no login)
        raise click.ClickException(
            f"--workers asks the workers through the broker, which this command cannot use "
            f"({exc}); run it again without --workers for the lock servers alone"
        ) from None
    replies = cast("list[dict[str, dict[str, Any]]]", answered or [])
    return {name: answer for reply in replies for name, answer in reply.items()}


def format_outages(workers: dict[str, dict[str, Any]], now: float) -> str:
    """One line per worker: its outage retries, the longest outage, what it cannot reach."""
    if not workers:
        return "workers: none answered (is one running, on this broker?)"
    lines: list[str] = []
    for name, answer in sorted(workers.items()):
        retries = _number(answer.get("outage_retries")) or 0
        line = f"{name}: {retries:.0f} outage retries"
        if (last := _number(answer.get("last_outage_retry_at"))) is not None:
            longest = _number(answer.get("longest_outage_s")) or 0
            line += f" (last {now - last:.0f} s ago, longest outage {longest:.0f} s)"
        since = answer.get("unreachable_since")
        if isinstance(since, dict) and since:
            down = cast("dict[str, Any]", since)
            line += "; cannot reach " + ", ".join(
                address
                if (at := _number(down[address])) is None
                else f"{address} (for {now - at:.0f} s)"
                for address in sorted(down)
            )
        lines.append(line)
    return "\n".join(lines)


@_command
@click.option(
    "--workers",
    "with_workers",
    is_flag=True,
    help="Also ask the running workers (through the broker, 1 s) about the lock-server "
    "outages they met: outage retries, servers they cannot reach.",
)
def status(ctx: click.Context, as_json: bool, with_workers: bool) -> None:
    """Per server: reachable or not, connections, held locks and waiters, restart grace,
    journal and any degraded state (read-only journal, draining, fenced, shards moving); with
    --workers, each worker's outage retries. Exit 1 when a server is unreachable or grants
    nothing new (read-only, draining, fenced)."""
    workers = ask_workers(ctx.obj.app) if with_workers else None
    now = time.time()

    def json_of(reports: list[ServerReport]) -> object:
        servers = _reports_json(reports)
        return servers if workers is None else {"servers": servers, "workers": workers}

    def render(reports: list[ServerReport]) -> str:
        shown = format_status(reports)
        return shown if workers is None else f"{shown}\n{format_outages(workers, now)}"

    _answer(ctx, as_json, collect, json_of=json_of, render=render, ok=lambda r: r.healthy)


@_command
def locks(ctx: click.Context, as_json: bool) -> None:
    """Every held lock and semaphore with its lease left and waiters."""
    _answer(
        ctx, as_json, collect, json_of=_reports_json, render=format_locks, ok=lambda r: r.reachable
    )


@_command
def ping(ctx: click.Context, as_json: bool) -> None:
    """Whether every server answers and grants: exit 1 when one is unreachable or grants
    nothing new (read-only, draining, fenced)."""
    _answer(
        ctx, as_json, collect, json_of=_reports_json, render=format_ping, ok=lambda r: r.healthy
    )


def format_ping(reports: Sequence[ServerReport]) -> str:
    """One line per server: ``ok`` (and any state in which some keys wait), or why it grants
    nothing new, or ``UNREACHABLE``."""
    return "\n".join(_ping_line(rep) for rep in reports)


def _ping_line(rep: ServerReport) -> str:
    if not rep.reachable:
        return f"{rep.address}: UNREACHABLE: {rep.note}"
    note = f" ({rep.note})" if rep.note else ""
    if failing := [line for _, _, line in rep.failing]:
        return f"{rep.address}: answers, but grants nothing new{note}: " + "; ".join(failing)
    waits = [line for _, severity, line in rep.degraded if severity != DEGRADED_ERROR]
    return f"{rep.address}: ok{note}" + "".join(f"; {w}" for w in waits)


@_command
def shards(ctx: click.Context, as_json: bool) -> None:
    """Which keys each server serves: mode, members, shards per member, moves, leader."""
    _answer(
        ctx,
        as_json,
        collect_shards,
        json_of=shards_json,
        render=format_shards,
        ok=lambda a: a.shards is not None,
    )


OPERATOR_NOTE_PREFIX: Final = "dflock-cli/"


def operator_note() -> str:
    """``dflock-cli/<user>@<host>``, percent-encoded, at most 200 characters."""
    try:
        user = getpass.getuser()
    except (OSError, KeyError):
        user = "unknown"
    return (OPERATOR_NOTE_PREFIX + quote(f"{user}@{socket.gethostname()}", safe="@"))[:200]


def keys_with_prefix(reports: Sequence[ServerReport], prefix: str) -> dict[str, list[str]]:
    """By server, the keys its ``stats`` listed that start with ``prefix``, sorted."""
    found: dict[str, list[str]] = {}
    for rep in reports:
        items = (*_items(rep.stats, "locks"), *_items(rep.stats, "semaphores"))
        keys = {k for i in items if isinstance(k := i.get("key"), str) and k.startswith(prefix)}
        if keys:
            found[rep.address] = sorted(keys)
    return found


def release_keys(client: Client, keys: Sequence[str], note: str) -> list[tuple[str, int | str]]:
    """Force-release each key: per key, the grants freed or why it could not be done."""
    done: list[tuple[str, int | str]] = []
    for key in keys:
        try:
            done.append((key, client.force_release(key, note=note)))
        except InvalidValueError:
            raise
        except DflockError as exc:
            done.append((key, str(exc)))
    return done


@dflock.command(cls=CeleryCommand)
@click.argument("key", required=False)
@click.option(
    "--all",
    "purge",
    is_flag=True,
    help="Release every held key that starts with --prefix (listed by stats).",
)
@click.option("--prefix", default=None, help="With --all: the keys' common start (not empty).")
@click.option(
    "--note",
    default=None,
    help="Who asks, for the server's log (printable ASCII, no spaces; "
    "default dflock-cli/<user>@<host>).",
)
@_JSON
@click.pass_context
def release(
    ctx: click.Context,
    key: str | None,
    *,
    purge: bool,
    prefix: str | None,
    note: str | None,
    as_json: bool,
) -> None:
    """Free KEY whoever holds it (the key as `dflock locks` shows it): the next waiter gets
    it at once with a higher fence, and the holder's task learns at once that its lock is lost
    (lock_lost, self.lock.lost). With --all --prefix P: every held key starting
    with P. Needs lock servers that list 'force_release' in their hello."""
    if purge == (key is not None):
        raise click.UsageError("give a KEY, or --all --prefix PREFIX (not both)")
    if purge and not prefix:
        raise click.UsageError("--all needs --prefix PREFIX (a non-empty start of the keys)")
    if prefix is not None and not purge:
        raise click.UsageError("--prefix goes with --all")
    from celery_dflock._settings import parse_servers
    from celery_dflock.client.clients import Client
    from celery_dflock.config import DflockConfigError, get_config

    note = operator_note() if note is None else note
    try:
        config = get_config(ctx.obj.app)
        with config.new_client() as client:
            reports = [ServerReport.of(status) for status in client.stats()]
            # Each key where stats lists it, also where routing would not send it (the server
            # list changed while it was held); KEY listed nowhere, where routing sends it.
            listed = keys_with_prefix(reports, key or prefix or "")
            unreachable = [r for r in reports if r.stats is None and key is None]
            if key is not None:
                listed = {address: [key] for address, keys in listed.items() if key in keys}
            done = [] if listed or key is None else release_keys(client, [key], note)
            for address, keys in listed.items():
                there = replace(config.client, servers=parse_servers(address))
                with Client.from_settings(there) as one:
                    done += release_keys(one, keys, note)
    except DflockConfigError:
        raise  # the app's settings, not the command line: one line, exit 1, as a worker's
    except (DflockError, ValueError) as exc:  # a bad key or note, no stats
        raise click.UsageError(str(exc)) from exc
    failed = {k: why for k, why in done if isinstance(why, str)}
    if as_json:
        released = {k: n for k, n in done if isinstance(n, int)}
        unlisted = {r.address: r.note for r in unreachable}
        report = {"released": released, "failed": failed, "unlisted_servers": unlisted}
        click.echo(json.dumps(report, indent=2))
    else:
        lines: list[str] = []
        for freed, result in done:
            k = _shown(freed)
            if isinstance(result, str):
                lines.append(f"{k}: NOT released: {result}")
            elif result:
                lines.append(f"{k}: released ({result} grant(s) freed)")
            else:
                lines.append(f"{k}: nothing held it")
        if purge and not done:
            where = " on the servers listed" if unreachable else ""
            lines.append(f"no held key starts with {prefix!r}{where}")
        lines += [f"{rep.address}: its keys could not be listed: {rep.note}" for rep in unreachable]
        click.echo("\n".join(lines))
    if failed or unreachable:
        ctx.exit(1)
