"""Prometheus metrics for the lock server.

On the event loop, plain integers only: the table's running ``Counts``, and ``RequestTimes``,
a histogram per command kept as bucket counters (nothing when metrics are off). Off the loop,
``MetricsExporter`` serves them with ``prometheus_client`` (the ``metrics`` extra): each scrape
asks the loop for a consistent snapshot and builds the families from it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import socket
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping
from itertools import accumulate
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, cast

from dflockd_server import constants as c
from dflockd_server.journal import Journal, JournalStats
from dflockd_server.loops import run_on
from dflockd_server.settings import names
from dflockd_server.status_page import StatusPage, route

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from dflockd_server.cluster.node import ClusterStats
    from dflockd_server.table import LockTable

__all__ = ["COMMAND_NAMES", "MetricsError", "MetricsExporter", "RequestTimes", "Snapshot"]

_INVALID = "invalid"
COMMAND_NAMES: Final[Mapping[str, str]] = MappingProxyType({
    c.CMD_LOCK: "acquire", c.CMD_RENEW: "renew", c.CMD_RELEASE: "release",
    c.CMD_ENQUEUE: "enqueue", c.CMD_WAIT: "wait",
    c.CMD_SEM_LOCK: "semaphore_acquire", c.CMD_SEM_ENQUEUE: "semaphore_enqueue",
    c.CMD_SEM_WAIT: "semaphore_wait", c.CMD_SEM_RENEW: "semaphore_renew",
    c.CMD_SEM_RELEASE: "semaphore_release",
    c.CMD_AUTH: "auth", c.CMD_STATS: "stats", c.CMD_PING: "ping", c.CMD_HELLO: "hello",
    c.CMD_SHARDS: "shards", c.CMD_HOLD: "hold", c.CMD_NOTE: "note", c.CMD_TAKE: "take_over",
    c.CMD_HAND_DOWN: "hand_down", c.CMD_ASKING: "asking", c.CMD_FORCE_RELEASE: "force_release",
    _INVALID: _INVALID,
})  # fmt: skip
"""Every command (the one list of them) and its ``command`` label of
``dflockd_request_duration_seconds`` (the opcode is ``opcode``)."""
_EXTRA_HINT = "install the metrics extra: pip install 'dflockd-server[metrics]'"


class MetricsError(RuntimeError):
    """The metrics endpoint cannot start: ``prometheus_client`` is missing or the port is
    unusable."""


class _Histogram:
    __slots__ = ("counts", "total_s")

    def __init__(self) -> None:
        # counts[i] is how many fell in (bound[i-1], bound[i]]; the last slot is +Inf.
        self.counts = [0] * (len(c.METRICS_LATENCY_BUCKETS_S) + 1)
        self.total_s = 0.0


class RequestTimes:
    """Request durations per command, from the parsed request to its reply. Malformed commands
    share one ``invalid`` label: garbage cannot grow the label set."""

    __slots__ = ("_by_command", "_invalid")

    def __init__(self) -> None:
        self._by_command = {cmd.encode(): _Histogram() for cmd in COMMAND_NAMES}
        self._invalid = self._by_command[_INVALID.encode()]

    def observe(self, cmd: bytes, seconds: float) -> None:
        hist = self._by_command.get(cmd) or self._invalid
        hist.counts[bisect_left(c.METRICS_LATENCY_BUCKETS_S, seconds)] += 1
        hist.total_s += seconds

    def copy(self) -> dict[str, tuple[list[int], float]]:
        """``{command: (bucket counts, sum of seconds)}`` for every command seen so far."""
        return {
            cmd.decode(): (list(h.counts), h.total_s)
            for cmd, h in self._by_command.items()
            if any(h.counts)
        }


Row = tuple[str, str, float, bool]
"""A family of one value as a scrape copies it: its name after ``dflockd_``, its help, its
value, and whether it is a counter (else a gauge)."""
KindRow = tuple[str, str, tuple[int, ...], bool]
"""A family labelled ``kind``: as ``Row``, with its ``(lock, semaphore)`` values."""


@dataclasses.dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything a scrape reports, copied on the event loop in one go (``take``)."""

    by_kind: list[KindRow]
    single: list[Row]
    requests: dict[str, tuple[list[int], float]]
    cluster: ClusterStats | None = None
    journal: JournalStats | None = None
    journal_writable: bool = True

    @classmethod
    def take(
        cls,
        table: LockTable,
        times: RequestTimes | None,
        connections: int,
        connections_accepted: int,
        connections_refused: int,
        *,
        cluster: ClusterStats | None = None,
        journal: Journal | None = None,
        tls_validity: tuple[float, float] | None = None,
    ) -> Snapshot:
        """Read the server's state; call on its event loop."""
        counts = table.grants.counts
        locks, sems, busy = table.census()
        by_kind: list[KindRow] = [
            ("grants", "Locks and semaphore slots granted.", tuple(counts.grants), True),
            ("releases", "Explicit releases by the holder's token.", tuple(counts.releases),
             True),
            ("force_releases",
             "Grants freed by an operator's force release (fr, celery dflock "
             "release), whoever held them (not counted in dflockd_releases).",
             tuple(counts.forced), True),
            ("expiries", "Leases that ran out without a renew.", tuple(counts.expiries), True),
            ("lost_by_disconnect", "Holds released because their connection closed.",
             tuple(counts.lost_by_disconnect), True),
            ("acquire_timeouts",
             "Acquires that gave up: try-once refusals and waits that timed out.",
             tuple(counts.timeouts), True),
            ("keys", "Keys known to the server (held, waited on or idle).", (locks[0], sems[0]),
             False),
            ("held", "Locks and semaphore slots held now.", (locks[1], sems[1]), False),
            ("waiters", "Acquires waiting in a queue now.", (locks[2], sems[2]), False),
        ]  # fmt: skip
        single: list[Row] = [
            ("keys_busy", "Keys held or waited on now (queue-once holds included): idle keys are "
             "pruned to make room for a new key, these are not.", busy, False),
            ("keys_max", "Most distinct keys (--max-locks): once dflockd_keys_busy reaches it, a "
             "new key is refused with error_max_locks.", table.grants.max_locks, False),
            ("connections", "Client connections open now.", connections, False),
            ("sessions", "Client sessions now, one a client process.", len(table.sessions), False),
            ("session_grants", "Grants client sessions keep now.", table.session_grants(), False),
            ("connections_accepted", "Client connections admitted.", connections_accepted, True),
            ("connections_refused",
             "Client connections closed at once (connection caps or draining).",
             connections_refused, True),
            ("restart_grace_remaining_seconds",
             "Seconds left of the restart grace, during which no key is granted (0 once over).",
             table.grace_remaining(), False),
        ]  # fmt: skip
        if tls_validity is not None:
            single += [("tls_certificate_start_timestamp_seconds", "When the certificate that new "
                "TLS connections get became valid (its notBefore), in seconds since the epoch.",
                tls_validity[0], False),
                ("tls_certificate_expiry_timestamp_seconds", "When the certificate that new TLS "
                "connections get expires (its notAfter), in seconds since the epoch.",
                tls_validity[1], False)]  # fmt: skip
        requests = times.copy() if times is not None else {}
        stats = None if journal is None else dataclasses.replace(journal.stats)
        return cls(by_kind, single, requests, cluster, stats, journal is None or journal.writable)


class MetricsExporter:
    """Serves ``/metrics`` (and ``page``, the status page) from a ``prometheus_client`` HTTP
    server thread."""

    def __init__(
        self, take: Callable[[], Snapshot], loop: asyncio.AbstractEventLoop, page: StatusPage
    ) -> None:
        self._take = take
        self._loop = loop
        self._page = page
        self._http: Any = None
        self._thread: Any = None
        self.address: tuple[str, int] | None = None

    def start(self, host: str, port: int) -> tuple[str, int]:
        """Bind and serve; returns the bound address (useful with port 0)."""
        try:
            from prometheus_client import start_http_server
            from prometheus_client.registry import CollectorRegistry
        except ImportError as exc:
            raise MetricsError(f"metrics need prometheus_client: {_EXTRA_HINT}") from exc
        registry = CollectorRegistry(auto_describe=False)
        registry.register(cast("Collector", self))
        try:
            self._http, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            # No such address here (a name no lookup finds): the host; else (in use) the port.
            unknown = isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL
            setting = names("metrics_host") if unknown else names("metrics_port")
            raise MetricsError(
                f"cannot serve metrics on {host}:{port}: {exc} (choose another {setting})"
            ) from exc
        self._http.set_app(route(self._http.get_app(), self._page))
        _bound_connections(self._http)
        name: Any = self._http.server_address
        self.address = (str(name[0]), int(name[1]))
        return self.address

    def stop(self) -> None:
        """Stop serving (blocks until the HTTP thread is done; run it off the loop)."""
        http, self._http = self._http, None
        if http is not None:
            http.shutdown()
            http.server_close()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def collect(self) -> Iterator[Any]:
        """One scrape's families (the registry's collector: ``start`` registers this)."""
        from prometheus_client.core import HistogramMetricFamily

        snap = run_on(self._loop, self._take, c.METRICS_SCRAPE_TIMEOUT_S)  # on the server's loop
        for name, doc, values, counter in snap.by_kind:
            family = _family(name, doc, counter, labels=["kind"])
            for kind, value in zip(("lock", "semaphore"), values, strict=True):
                family.add_metric([kind], value)
            yield family
        yield from _single_valued(snap.single)
        latency = HistogramMetricFamily(
            "dflockd_request_duration_seconds",
            "Time from a parsed request to its reply, per command "
            "(a waiting acquire counts its wait), by its name (command) and its wire "
            "opcode (opcode).",
            labels=["command", "opcode"],
        )
        bounds = [*(f"{b:g}" for b in c.METRICS_LATENCY_BUCKETS_S), "+Inf"]
        for command, (counts, total) in sorted(snap.requests.items()):
            cumulative = list(zip(bounds, accumulate(counts), strict=True))
            latency.add_metric([COMMAND_NAMES[command], command], cumulative, total)
        yield latency
        if snap.cluster is not None:
            yield from _cluster_families(snap.cluster)
        if snap.journal is not None:
            yield from _journal_families(snap.journal, snap.journal_writable)


def _bound_connections(http: Any) -> None:
    """Serve at most ``METRICS_MAX_HTTP_CONNECTIONS`` connections at once (one thread and one
    open file each; the others are closed at once), each dropped once silent for
    ``METRICS_HTTP_TIMEOUT_S``: clients that never finish a request (a stuck scraper, a
    slow-loris) cannot take the open files the lock server's clients need."""
    slots = threading.BoundedSemaphore(c.METRICS_MAX_HTTP_CONNECTIONS)
    process, finish = http.process_request, http.process_request_thread

    def process_request(request: Any, client_address: Any) -> None:
        if not slots.acquire(blocking=False):
            http.shutdown_request(request)
            return
        try:
            process(request, client_address)  # starts a thread running process_request_thread
        except BaseException:
            slots.release()
            raise

    def process_request_thread(request: Any, client_address: Any) -> None:
        try:
            finish(request, client_address)
        finally:
            slots.release()

    http.process_request = process_request
    http.process_request_thread = process_request_thread
    http.RequestHandlerClass = type(
        "TimedHandler", (http.RequestHandlerClass,), {"timeout": c.METRICS_HTTP_TIMEOUT_S}
    )


def _family(name: str, doc: str, counter: bool, **how: Any) -> Any:
    """The counter (else gauge) family ``dflockd_<name>``; ``how``: its ``labels`` or ``value``."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    return (CounterMetricFamily if counter else GaugeMetricFamily)(f"dflockd_{name}", doc, **how)


def _single_valued(rows: list[Row]) -> Iterator[Any]:
    return (_family(name, doc, counter, value=value) for name, doc, value, counter in rows)


def _journal_families(stats: JournalStats, writable: bool) -> Iterator[Any]:
    yield from _single_valued([
        ("journal_writable",
         "1 while the lease journal can be written; 0 while it cannot (a full disk, EIO, a "
         "failed fsync): nothing new is granted then, held locks are kept.",
         1 if writable else 0, False),
        ("journal_restored_leases", "Leases restored from the journal at start-up.",
         stats.restored, True),
        ("journal_dropped_records",
         "Journal lines dropped at start-up from the first damaged record on.",
         stats.dropped_records, True),
        ("journal_writes", "Writes of journal records (one per batch of replies).", stats.writes,
         True),
        ("journal_fsyncs", "fsyncs of the journal.", stats.fsyncs, True),
        ("journal_compactions", "Rewrites of the journal holding only the leases held.",
         stats.compactions, True),
        ("journal_write_failures",
         "Times the journal could not be written (each episode counted once).",
         stats.write_failures, True),
        ("journal_refused_grants",
         "Grants undone and refused because the batch holding them could not be written.",
         stats.refused_grants, True),
    ])  # fmt: skip


def _cluster_families(stats: ClusterStats) -> Iterator[Any]:
    shards = _family(
        "cluster_shards",
        "Shards by what this member does with them now: serving, moving_out, taking_over, "
        "failing_over (waiting for a gone member's leases, or released to it), other (another "
        "member's), unavailable (no assignment, or every shard while fenced).",
        counter=False,
        labels=["state"],
    )
    for state, count in stats.shards.items():
        shards.add_metric([state], count)
    yield shards
    yield from _single_valued([
        ("cluster_handovers",
         "Shards this member handed over: to their new target once no holder was left, or "
         "released to its heirs on a graceful leave.", stats.handovers, True),
        ("cluster_failovers",
         "Shards this member took over after their member was gone, once its longest lease "
         "had run out.", stats.failovers, True),
        ("cluster_released_takeovers",
         "Shards this member took over at once because their member released them on a "
         "graceful leave.", stats.released_takeovers, True),
        ("cluster_etcd_switches",
         "Times this member's etcd client moved to another of the --cluster endpoints because "
         "the one it used failed or did not answer in time.", stats.etcd_switches, True),
        ("cluster_etcd_step_failures",
         "Steps of this member's loop (its watch of the cluster, the election, the leader's map "
         "upkeep) that etcd failed; each is tried again, and the member logs while they last.",
         stats.etcd_step_failures, True),
        ("cluster_fenced",
         "1 while this member cannot show its etcd lease alive and grants nothing.",
         int(stats.fenced), False),
        ("cluster_clock_offset_seconds",
         "How far this member's wall clock was from another member's at the last ask ticket it "
         "checked (positive: ahead); past the ticket's life (60 s), keys of shards split to it "
         "wait for the split's end.", stats.clock_offset_s, False),
        ("cluster_stale_tickets",
         "Genuine ask tickets refused because they arrived expired by this member's clock (its "
         "clock ahead of the issuer's by more than a ticket lives).", stats.stale_tickets,
         True),
        ("cluster_leader", "1 on the member that leads the cluster (keeps the shard map).",
         int(stats.leader), False),
    ])  # fmt: skip
