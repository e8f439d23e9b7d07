"""The fenced workload: lock clients in real processes updating a protected counter.

Each worker is a separate process (forked from a ``forkserver``) that loops::

    acquire (DistributedLock: ``l``, or two-phase ``e`` + ``w``) -> read the counter
    -> work a little -> write counter + 1 -> release

recording every attempt in its own history file (JSON lines, one ``os.write`` each, so a
SIGKILL never leaves half a record behind except possibly a last partial line, which
`read_events` ignores). `holds_from_events` turns them into `history.Hold` records.

The protected resource is a SQLite file (`Resource`): one row per key with the counter and the
highest fence it has seen. In *fenced* mode a read or a write carrying a fence lower than the
highest seen is refused, and both register their fence. Registering on reads matters: with
write-only fencing, a new holder that reads before a paused old holder writes, and writes after
it, still loses the old holder's update. In *unfenced* mode nothing is refused. Every accepted
write records the value it was computed from and the value it replaced, so lost updates are
counted exactly: the increments accepted minus the final value.

The parent side: `LockServer` (the real ``dflockd`` on a fixed port, so it can be SIGKILLed
and restarted in place), `Worker` (a worker process: signals, its history, a one-shot "hold
the next lock long" request the fault tests aim their faults with) and `LockRun` (a server, a
resource, workers -- optionally each behind its own `proxy.FaultProxy` -- and a healthy client
on its own key, and at the end the checked history).
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import functools
import json
import math
import multiprocessing
import multiprocessing.context
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

from celery_dflock import Client, ConnectionPool, DistributedLock
from celery_dflock.client.errors import DflockError
from celery_dflock.client.sharding import stable_hash_shard
from tests.faults.conftest import FaultRow
from tests.faults.history import CheckResult, Cut, Hold, check_history
from tests.support.ports import free_ports
from tests.support.processes import paused
from tests.support.proxy import FaultProxy
from tests.support.servers import DflockdProcess

LEASE_S = 2
MAX_LEASE_S = 3
"""The server's ``--max-lease-ttl``: it bounds the restart grace when there is no state file."""
"""Lease of every workload lock: short, so faults that outlast it are quick to inject."""
SWEEP_S = 0.1
"""The server's lease sweep interval in these runs."""
ACQUIRE_TIMEOUT_S = 5
HOLD_S = 0.002
"""Simulated work between reading and writing the counter."""
LONG_HOLD_S = LEASE_S + 0.5
"""Work done when a test asks for a long hold: longer than the lease, so a fault that stops
renewals meanwhile leaves the worker writing after its lease ran out."""
HEALTHY_PACE_S = 0.005
"""Pause between two cycles of the healthy client (so it does not eat a core)."""
RETRY_PAUSE_S = 0.05
"""Pause after a failed request (server down, connection cut) before the next attempt."""
CONNECT_TIMEOUT_S = 2.0
EVENT_TIMEOUT_S = 20.0
POLL_S = 0.01
PROGRESS_POLL_S = 0.05
"""Between two reads of every worker's history while the test waits for grants (each read
tails all of them)."""
STOP_TIMEOUT_S = 15.0
DB_TIMEOUT_S = 60.0
STACK_DUMP_WAIT_S = 0.5
WRITE_TIMEOUT_S = 1.0
"""The server's write timeout in these runs (how long a client may leave replies unread)."""
HEALTHY = "healthy"


def now() -> float:
    return time.monotonic()


def percentile(values: list[float], fraction: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(fraction * len(ordered)) - 1)]


# ---------------------------------------------------------------------------- the resource


@dataclasses.dataclass(frozen=True)
class ResourceSummary:
    key: str
    value: int
    accepted: int
    """Writes accepted (each an increment of what its writer had read)."""
    refused_writes: int
    refused_reads: int
    stale_accepted: int
    """Accepted writes computed from a value that had changed since it was read."""

    @property
    def lost_updates(self) -> int:
        """Increments accepted but missing from the final value."""
        return self.accepted - self.value


class Resource:
    """A counter per key in a SQLite file, guarded by the highest fence seen (when fenced)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db = sqlite3.connect(path, timeout=DB_TIMEOUT_S, isolation_level=None)
        self._db.execute("PRAGMA synchronous=OFF")

    @classmethod
    def create(cls, path: Path, keys: list[str]) -> Resource:
        resource = cls(path)
        db = resource._db
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(
            "CREATE TABLE counter (key TEXT PRIMARY KEY, value INTEGER NOT NULL, "
            "fence INTEGER NOT NULL)"
        )
        db.execute(
            "CREATE TABLE op (key TEXT, client TEXT, fence INTEGER, kind TEXT, "
            "read_value INTEGER, prior_value INTEGER, accepted INTEGER, t REAL)"
        )
        db.executemany("INSERT INTO counter VALUES (?, 0, 0)", [(k,) for k in keys])
        return resource

    def close(self) -> None:
        self._db.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def read(self, key: str, client: str, fence: int, fenced: bool) -> int | None:
        """The counter, registering ``fence``; None when refused (a higher fence was seen)."""
        with self._transaction() as db:
            value, seen = db.execute(
                "SELECT value, fence FROM counter WHERE key = ?", (key,)
            ).fetchone()
            if fenced and fence < seen:
                db.execute(
                    "INSERT INTO op VALUES (?, ?, ?, 'read', NULL, ?, 0, ?)",
                    (key, client, fence, value, now()),
                )
                return None
            db.execute("UPDATE counter SET fence = ? WHERE key = ?", (max(seen, fence), key))
            return int(value)

    def write(self, key: str, client: str, fence: int, read_value: int, fenced: bool) -> bool:
        """Set the counter to ``read_value + 1`` unless refused; True if accepted."""
        with self._transaction() as db:
            value, seen = db.execute(
                "SELECT value, fence FROM counter WHERE key = ?", (key,)
            ).fetchone()
            accepted = not (fenced and fence < seen)
            if accepted:
                db.execute(
                    "UPDATE counter SET value = ?, fence = ? WHERE key = ?",
                    (read_value + 1, max(seen, fence), key),
                )
            db.execute(
                "INSERT INTO op VALUES (?, ?, ?, 'write', ?, ?, ?, ?)",
                (key, client, fence, read_value, value, int(accepted), now()),
            )
            return accepted

    def summary(self, key: str) -> ResourceSummary:
        db = self._db
        (value,) = db.execute("SELECT value FROM counter WHERE key = ?", (key,)).fetchone()

        def count(where: str) -> int:
            (n,) = db.execute(
                f"SELECT count(*) FROM op WHERE key = ? AND {where}", (key,)
            ).fetchone()
            return int(n)

        return ResourceSummary(
            key=key,
            value=int(value),
            accepted=count("kind = 'write' AND accepted = 1"),
            refused_writes=count("kind = 'write' AND accepted = 0"),
            refused_reads=count("kind = 'read' AND accepted = 0"),
            stale_accepted=count("kind = 'write' AND accepted = 1 AND prior_value != read_value"),
        )

    def accepted_write_after(self, key: str, t: float, fence_above: int) -> bool:
        """Was a write with a fence above ``fence_above`` accepted on ``key`` after ``t``?"""
        row = self._db.execute(
            "SELECT 1 FROM op WHERE key = ? AND kind = 'write' AND accepted = 1 AND t > ? "
            "AND fence > ? LIMIT 1",
            (key, t, fence_above),
        ).fetchone()
        return row is not None

    def writes_with(self, fence: int) -> list[bool]:
        """Whether each write carrying ``fence`` was accepted (empty: none tried yet)."""
        rows = self._db.execute(
            "SELECT accepted FROM op WHERE kind = 'write' AND fence = ?", (fence,)
        ).fetchall()
        return [bool(accepted) for (accepted,) in rows]


# ---------------------------------------------------------------------------- the worker


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    client: str
    host: str
    port: int
    keys: list[str]
    history: str
    db: str | None
    """The resource; None for the healthy client (lock and release only)."""
    control: str
    """A directory: a file ``<client>.long`` there asks for one long hold (its content: the
    seconds)."""
    fenced: bool = True
    two_phase: bool = False
    lease_s: int = LEASE_S
    acquire_timeout_s: int = ACQUIRE_TIMEOUT_S
    hold_s: float = HOLD_S
    pace_s: float = 0.0
    seed: int = 0
    servers: tuple[tuple[str, int], ...] = ()
    """When set, the worker locks through a `Client` on these servers (``host``/``port`` are
    then the first of them) with ``sharding``: ``"cluster"`` (they are seeds of a lock
    cluster) or ``"crc32"`` (the seed's list strategy, order matters)."""
    sharding: str = "crc32"


class _History:
    """Appends one JSON line per event, each with a single write."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, **fields: Any) -> None:
        os.write(self._fd, (json.dumps(fields) + "\n").encode())


def _long_hold_requested(cfg: WorkerConfig) -> float | None:
    """The seconds of a long hold the test asked for (once), or None."""
    path = os.path.join(cfg.control, f"{cfg.client}.long")
    try:
        with open(path, encoding="ascii") as fh:
            seconds = float(fh.read())
    except FileNotFoundError:
        return None
    os.unlink(path)
    return seconds


class StopRequest:
    """Set by a signal handler, waited on by the loop.

    Not a bare ``threading.Event``: the handler runs in the main thread between two
    bytecodes, and if that is inside the loop's own ``Event.wait``, while it holds the event's
    lock, the handler's ``set()`` waits for that lock forever. (A worker hung at the end of one
    CI run, right as its SIGTERM arrived, and wrote nothing; this is the likely cause.) The
    handler here only writes a byte to a pipe; a thread reading the pipe sets the event. The
    waits stay ``Event`` waits, whose timeouts run on the monotonic clock: a worker stopped
    (SIGSTOP) in the middle of one is not kept waiting after SIGCONT for the time it was
    stopped, as a ``select`` timeout would keep it.
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._read_fd, self._write_fd = os.pipe()
        self._requested = False
        threading.Thread(target=self._watch, name="stop-request", daemon=True).start()

    def _watch(self) -> None:
        os.read(self._read_fd, 1)
        self._event.set()

    def set(self) -> None:
        """From a signal handler: takes no lock."""
        if not self._requested:
            self._requested = True
            os.write(self._write_fd, b"x")

    def is_set(self) -> bool:
        return self._requested

    def wait(self, timeout: float) -> bool:
        """Up to ``timeout`` s, or until set; True if set."""
        return self._event.wait(timeout) or self._requested


def _told(history: _History, attempt: int, _lock: object) -> None:
    """``on_lost`` of the worker's locks: when it was told its lock was lost."""
    history.emit(ev="told", id=attempt, t=now())


def run_worker(cfg: WorkerConfig) -> None:
    """The worker loop; ends (after its current attempt) on SIGTERM, or when orphaned (the
    process that started it is gone, say a test run that was killed)."""
    stopping = StopRequest()
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.set())
    Path(f"{cfg.history}.ready").touch()  # from now on SIGTERM stops it gracefully
    parent = multiprocessing.parent_process()  # not the fork server: whoever asked for us
    history = _History(cfg.history)
    resource = Resource(Path(cfg.db)) if cfg.db is not None else None
    rng = random.Random(cfg.seed)
    pool = ConnectionPool()
    client = (
        Client(
            list(cfg.servers),
            sharding_strategy="cluster" if cfg.sharding == "cluster" else stable_hash_shard,
            connect_timeout_s=CONNECT_TIMEOUT_S,
        )
        if cfg.servers
        else None
    )
    attempt = 0
    while not stopping.is_set() and (parent is None or parent.is_alive()):
        attempt += 1
        key = rng.choice(cfg.keys)
        told = functools.partial(_told, history, attempt)
        lock = (
            client.lock(
                key,
                acquire_timeout_s=cfg.acquire_timeout_s,
                lease_ttl_s=cfg.lease_s,
                on_lost=told,
            )
            if client is not None
            else DistributedLock(
                key,
                acquire_timeout_s=cfg.acquire_timeout_s,
                lease_ttl_s=cfg.lease_s,
                servers=[(cfg.host, cfg.port)],
                connect_timeout_s=CONNECT_TIMEOUT_S,
                pool=pool,
                on_lost=told,
            )
        )
        requested = now()
        enqueued: float | None = None
        try:
            if cfg.two_phase:
                got = lock.enqueue()
                enqueued = now()
                if not got:
                    got = lock.wait()
            else:
                got = lock.acquire()
        except DflockError as exc:
            lock.release()  # gives up a queue position, if one was taken
            history.emit(
                ev="nogrant",
                id=attempt,
                key=key,
                req=requested,
                enq=enqueued,
                outcome="error",
                t=now(),
                detail=str(exc)[:200],
            )
            stopping.wait(RETRY_PAUSE_S)
            continue
        granted = now()
        if not got:
            history.emit(
                ev="nogrant", id=attempt, key=key, req=requested, enq=enqueued, outcome="timeout"
            )
            continue
        fence = lock.fence
        assert fence is not None
        history.emit(
            ev="grant",
            id=attempt,
            key=key,
            fence=fence,
            req=requested,
            enq=enqueued,
            ok=granted,
            lease=lock.lease,
        )
        if resource is not None:
            value = resource.read(key, cfg.client, fence, cfg.fenced)
            if value is not None:
                work = cfg.hold_s
                long_hold = _long_hold_requested(cfg)
                if long_hold is not None:
                    history.emit(ev="long", id=attempt, key=key, fence=fence, t=now(), s=long_hold)
                    work = long_hold
                # Simulated work inside the critical section (cut short by SIGTERM at the
                # end of a run). Deliberately no check of lock.lost before writing: the
                # fence alone has to keep the counter right.
                stopping.wait(work)
                resource.write(key, cfg.client, fence, value, cfg.fenced)
        release_sent = now()
        released = lock.release()
        history.emit(
            ev="end",
            id=attempt,
            outcome="released" if released else "lost",
            rel=release_sent,
            rel_ok=released,
            done=now(),
            told=lock.lost_event.is_set(),
        )
        if cfg.pace_s:
            stopping.wait(cfg.pace_s)
    pool.close()
    if client is not None:
        client.close()


def _worker_process(cfg: WorkerConfig) -> None:
    """The worker process: stderr to a file next to its history, then the loop."""
    fd = os.open(f"{cfg.history}.stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115 - the process's own stderr
    # A worker that does not stop when asked shows where it is stuck (see LockRun.finish).
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    run_worker(cfg)


def _process_context() -> multiprocessing.context.ForkServerContext:
    """Workers are forked from a fork server that has this module (and so celery_dflock and
    Celery) imported already: a new worker costs milliseconds, not an interpreter start."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


# ---------------------------------------------------------------------------- histories


def read_events(path: Path) -> list[dict[str, Any]]:
    """The events of one history file (a torn last line, from a SIGKILL, is skipped)."""
    events: list[dict[str, Any]] = []
    if not path.exists():
        return events
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            events.append(json.loads(line))
    return events


def holds_from_events(client: str, events: list[dict[str, Any]]) -> list[Hold]:
    """The attempts of one client; a grant without an end means the client died holding it."""
    holds: list[Hold] = []
    open_grants: dict[int, dict[str, Any]] = {}
    for event in events:
        kind = event["ev"]
        if kind == "nogrant":
            holds.append(
                Hold(
                    key=event["key"],
                    client=client,
                    requested_t=event["req"],
                    enqueued_t=event["enq"],
                    lease_s=LEASE_S,
                    outcome=event["outcome"],
                )
            )
        elif kind == "grant":
            open_grants[event["id"]] = event
        elif kind == "long":
            # Announced before the long hold's wait: no release can come before it ends.
            open_grants[event["id"]] = {
                **open_grants[event["id"]],
                "holding": event["t"] + event["s"],
            }
        elif kind == "told":
            if event["id"] in open_grants:
                open_grants[event["id"]] = {**open_grants[event["id"]], "told_t": event["t"]}
        elif kind == "end":
            grant = open_grants.pop(event["id"])
            holds.append(_hold(client, grant, event))
    holds.extend(_hold(client, grant, None) for grant in open_grants.values())
    return holds


def _hold(client: str, grant: dict[str, Any], end: dict[str, Any] | None) -> Hold:
    return Hold(
        holding_until=None if end is not None else grant.get("holding", grant["ok"]),
        key=grant["key"],
        client=client,
        requested_t=grant["req"],
        enqueued_t=grant["enq"],
        granted_t=grant["ok"],
        fence=grant["fence"],
        lease_s=grant["lease"],
        outcome="killed" if end is None else end["outcome"],
        released_t=None if end is None else end["rel"],
        release_ok=False if end is None else end["rel_ok"],
        reported_lost=False if end is None else end.get("told", False),
        told_t=grant.get("told_t"),
    )


class HistoryTail:
    """Reads a history file as it grows."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""
        self.grants = 0

    def new_events(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        events = [json.loads(line) for line in lines if line]
        self.grants += sum(1 for e in events if e["ev"] == "grant")
        return events


# ---------------------------------------------------------------------------- processes


class LockServer:
    """The real ``dflockd`` on 127.0.0.1:``port``: SIGKILL it and start it again in place."""

    def __init__(
        self,
        port: int,
        *,
        fence_state_file: Path | None = None,
        max_lease_s: int = MAX_LEASE_S,
        extra_args: tuple[str, ...] = (),
        state_dir: Path | str | None = None,
    ) -> None:
        self.port = port
        self.fence_state_file = fence_state_file
        self.state_dir = state_dir
        """``--state-dir``: the lease journal's directory, kept across restarts (``"none"``:
        no journal, every restart waits out a restart grace; None: the server's default,
        under ``$XDG_STATE_HOME``). With a directory, no start is given ``--restart-grace``
        (a user's server on a new state dir grants at once, and a restart restores the leases
        instead of waiting them out)."""
        self.max_lease_s = max_lease_s
        self.extra_args = extra_args
        """More flags (a cluster member's ``--cluster``, ``--advertise``)."""
        self.proc: DflockdProcess | None = None
        self.started = 0

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    @property
    def advertise(self) -> str:
        """``HOST:PORT``, as a cluster names its members."""
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None

    def start(self) -> None:
        args = [
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--default-lease-ttl",
            str(LEASE_S),
            "--lease-sweep-interval",
            str(SWEEP_S),
            "--write-timeout",
            str(WRITE_TIMEOUT_S),
            "--shutdown-timeout",
            "1",
            "--max-lease-ttl",
            str(self.max_lease_s),
        ]
        if self.state_dir is not None:
            args += ["--state-dir", str(self.state_dir)]
        if not self.started and self.state_dir in (None, "none"):
            # A port picked free for this run: no client holds a lease from an earlier server
            # there. Restarts on it keep the grace, as a real deployment does.
            args += ["--restart-grace", "0"]
        self.started += 1
        if self.fence_state_file is not None:
            args += ["--fence-state-file", str(self.fence_state_file)]
        args += self.extra_args
        self.proc = DflockdProcess(args, {})
        host, port = self.proc.wait_listening()
        assert (host, port) == self.address, (host, port)

    def kill(self) -> None:
        """SIGKILL (no goodbye to anyone) and reap."""
        assert self.proc is not None
        self.proc.kill()
        self.proc = None

    def terminate(self) -> None:
        """SIGTERM, as a service manager stops it, and wait until it has exited (it drains
        for ``--shutdown-timeout``)."""
        assert self.proc is not None
        self.proc.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait_exit(STOP_TIMEOUT_S)
        assert code == 0, (code, self.proc.lines[-20:])
        self.proc.kill()
        self.proc = None

    def stop(self) -> None:
        """Graceful stop (SIGTERM), then make sure it is gone."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.proc.poll() is None:
            proc.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait_exit(STOP_TIMEOUT_S)
        proc.kill()


class Worker:
    """A worker process and its history."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.client = cfg.client
        self.history = Path(cfg.history)
        self.tail = HistoryTail(self.history)
        self.proc = _process_context().Process(
            target=_worker_process, args=(cfg,), name=f"dflock-worker-{cfg.client}"
        )
        self.proc.start()

    @property
    def pid(self) -> int:
        pid = self.proc.pid
        assert pid is not None
        return pid

    def alive(self) -> bool:
        return self.proc.exitcode is None

    @property
    def exitcode(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float) -> bool:
        """Wait for the process to end; True if it did."""
        self.proc.join(timeout)
        return self.proc.exitcode is not None

    def wait_ready(self, timeout: float = EVENT_TIMEOUT_S) -> None:
        """Wait until the worker has set its SIGTERM handler (or has exited)."""
        ready = Path(f"{self.cfg.history}.ready")
        deadline = now() + timeout
        while not ready.exists() and self.alive():
            assert now() < deadline, f"{self.client}: not ready after {timeout}s"
            time.sleep(POLL_S)

    def poll_events(self) -> list[dict[str, Any]]:
        return self.tail.new_events()

    def request_long_hold(self, seconds: float = LONG_HOLD_S) -> None:
        """Ask for one hold of ``seconds`` (announced by a ``long`` event once the counter
        was read)."""
        staged = Path(self.cfg.control, f".{self.client}.long")
        staged.write_text(str(seconds))
        staged.rename(staged.with_name(f"{self.client}.long"))  # appears whole

    def wait_event(self, kind: str, timeout: float = EVENT_TIMEOUT_S) -> dict[str, Any]:
        """The next new event of ``kind``."""
        deadline = now() + timeout
        while True:
            for event in self.poll_events():
                if event["ev"] == kind:
                    return event
            assert self.alive(), f"{self.client} exited: {self.stderr()}"
            assert now() < deadline, f"{self.client}: no {kind!r} event in {timeout}s"
            time.sleep(POLL_S)

    def stopped(self) -> bool:
        """True while the process is stopped (SIGSTOP)."""
        with open(f"/proc/{self.pid}/stat", encoding="ascii") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        return state == "T"

    def signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def stderr(self) -> str:
        path = Path(f"{self.cfg.history}.stderr")
        return path.read_text()[-4000:] if path.exists() else ""

    def dump_stacks(self) -> None:
        """Have a stuck worker write its threads' stacks to its stderr (faulthandler)."""
        if self.alive():
            self.signal(signal.SIGUSR1)
            time.sleep(STACK_DUMP_WAIT_S)

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        assert self.wait(STOP_TIMEOUT_S), f"{self.client} survived SIGKILL"


@dataclasses.dataclass
class Injection:
    """One fault injected: when, at whom (a client, or None for the server), on which key."""

    name: str
    t: float
    client: str | None = None
    key: str | None = None


@dataclasses.dataclass
class RunResult:
    holds: list[Hold]
    cuts: list[Cut]
    resource: list[ResourceSummary]
    injections: list[Injection]
    healthy_latencies_s: list[float]
    one_server: bool = True
    """False for runs over several servers: fences are then ordered per key only."""

    def check(self) -> CheckResult:
        return check_history(self.holds, self.cuts, one_server=self.one_server)

    def row(self, fault: str, check: CheckResult, observed: str) -> FaultRow:
        """The report's row for this run, checked as ``check``."""
        return FaultRow(
            fault=fault,
            runs=len(self.injections),
            operations=check.holds,
            double_grants=len(check.double_grants),
            lost_updates=self.lost_updates,
            recovery_s=self.recovery_s(),
            healthy_p99_ms=self.healthy_p99_ms(),
            observed=observed,
        )

    @property
    def lost_updates(self) -> int:
        return sum(s.lost_updates for s in self.resource)

    @property
    def stale_accepted(self) -> int:
        return sum(s.stale_accepted for s in self.resource)

    @property
    def refused(self) -> int:
        return sum(s.refused_reads + s.refused_writes for s in self.resource)

    def healthy_p99_ms(self) -> float | None:
        p99 = percentile(self.healthy_latencies_s, 0.99)
        return None if p99 is None else p99 * 1000

    def recovery_s(self) -> float | None:
        """The longest time from a fault to the next grant to someone else: on the victim's
        key for a fault aimed at a holder, on any key for a server fault. Faults that struck
        a client wherever it was (no key) are not counted."""
        worst: float | None = None
        for inj in self.injections:
            if inj.key is None and inj.client is not None:
                continue
            later = [
                h.granted_t
                for h in self.holds
                if h.granted_t is not None
                and h.granted_t > inj.t
                # after a server fault, only a grant of the restarted server counts
                and (inj.client is not None or h.requested_t > inj.t)
                and h.client not in (inj.client, HEALTHY)
                and (inj.key is None or h.key == inj.key)
            ]
            if later:
                took = min(later) - inj.t
                worst = took if worst is None else max(worst, took)
        return worst


class LockRun:
    """A server, a resource, workers (optionally behind proxies) and a healthy client."""

    def __init__(
        self,
        directory: Path,
        *,
        workers: int = 4,
        keys: tuple[str, ...] = ("k1", "k2"),
        fenced: bool = True,
        proxied: bool = False,
        fence_state: bool = False,
        split_brain: bool = False,
        seed: int = 0,
        max_lease_s: int = MAX_LEASE_S,
        lease_s: int = LEASE_S,
        durable: bool | None = None,
        server_args: tuple[str, ...] = (),
    ) -> None:
        """``server_args``: more flags for the server (a nemesis about that flag)."""
        self.directory = directory
        self.lease_s = lease_s
        self.keys = list(keys)
        self.fenced = fenced
        self.proxied = proxied
        self.rng = random.Random(seed)
        port, second_port = free_ports(2)  # chosen together: never the same port
        self.server = LockServer(
            port,
            fence_state_file=directory / "fence.state" if fence_state else None,
            max_lease_s=max_lease_s,
            # True: a state dir of the run's own; False: none (no journal); None: the default.
            state_dir=None if durable is None else directory / "state" if durable else "none",
            extra_args=server_args,
        )
        self.second_server = (
            LockServer(second_port, max_lease_s=max_lease_s) if split_brain else None
        )
        """A misconfiguration for the control run: odd-numbered workers (w1, w3 and their
        replacements) use this server."""
        self.db_path = directory / "resource.sqlite3"
        self.control = directory / "control"
        self.control.mkdir()
        self.resource = Resource.create(self.db_path, self.keys)
        self.workers: dict[str, Worker] = {}
        self.retired: list[Worker] = []
        self.proxies: dict[str, FaultProxy] = {}
        self.cuts: list[Cut] = []
        self.injections: list[Injection] = []
        self.healthy: Worker | None = None
        self._n_workers = workers
        self.one_server = True
        """Whether every grant comes from one server (see `RunResult.one_server`)."""

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> LockRun:
        self._start_servers()
        for i in range(self._n_workers):
            self.spawn(f"w{i}", two_phase=i % 2 == 1)
        self.healthy = Worker(
            self._config(
                HEALTHY,
                self.server.address,
                keys=[HEALTHY],
                db=None,
                hold_s=0.0,
                pace_s=HEALTHY_PACE_S,
            )
        )
        return self

    def _start_servers(self) -> None:
        self.server.start()
        if self.second_server is not None:
            self.second_server.start()

    def _client_fields(self) -> dict[str, Any]:
        """More `WorkerConfig` fields of every client (a run over several servers: which)."""
        return {}

    def _config(self, client: str, address: tuple[str, int], **fields: Any) -> WorkerConfig:
        return WorkerConfig(
            client=client,
            host=address[0],
            port=address[1],
            history=str(self.directory / f"{client}.jsonl"),
            control=str(self.control),
            **{**self._client_fields(), **fields},  # a field given here wins
        )

    def spawn(self, name: str, *, two_phase: bool) -> Worker:
        """A new worker (behind a proxy of its own when the run is proxied)."""
        client = name
        address = self.server.address
        if self.second_server is not None and int(name.split(".", maxsplit=1)[0][1:]) % 2:
            address = self.second_server.address
        if self.proxied:
            proxy = FaultProxy(address).start()
            self.proxies[client] = proxy
            address = proxy.address
        worker = Worker(
            self._config(
                client,
                address,
                keys=self.keys,
                db=str(self.db_path),
                fenced=self.fenced,
                two_phase=two_phase,
                lease_s=self.lease_s,
                seed=self.rng.randrange(2**31),
            )
        )
        self.workers[client] = worker
        return worker

    def all_workers(self) -> list[Worker]:
        everyone = [*self.retired, *self.workers.values()]
        return everyone + ([self.healthy] if self.healthy is not None else [])

    def grants(self) -> int:
        """Grants recorded so far by every client."""
        total = 0
        for worker in self.all_workers():
            worker.poll_events()
            total += worker.tail.grants
        return total

    def wait_grants(self, target: int, timeout: float) -> None:
        """Poll until ``target`` grants were recorded (all clients together)."""
        deadline = now() + timeout
        while self.grants() < target:
            for worker in self.workers.values():
                assert worker.alive(), f"{worker.client} died: {worker.stderr()}"
            assert now() < deadline, f"only {self.grants()} of {target} grants in {timeout}s"
            time.sleep(PROGRESS_POLL_S)

    def wait_progress(self, seconds: float, grants: int = 1) -> None:
        """Let ``seconds`` pass, and at least ``grants`` more grants happen."""
        target = self.grants() + grants
        until = now() + seconds
        self.wait_grants(target, seconds + EVENT_TIMEOUT_S)
        while now() < until:
            time.sleep(min(PROGRESS_POLL_S, max(until - now(), 0.0)))

    def settle(self, timeout: float = EVENT_TIMEOUT_S) -> None:
        """Wait until every worker has been granted a lock again (a victim has finished its
        long hold, a replacement has started), so that faults do not pile up."""
        self.grants()
        marks = {name: w.tail.grants for name, w in self.workers.items()}
        deadline = now() + timeout
        while True:
            self.grants()
            behind = [n for n, w in self.workers.items() if w.tail.grants <= marks.get(n, 0)]
            if not behind:
                return
            for name in behind:
                worker = self.workers[name]
                assert worker.alive(), f"{name} died: {worker.stderr()}"
            assert now() < deadline, f"{behind} made no progress in {timeout}s"
            time.sleep(PROGRESS_POLL_S)

    def pick(self) -> Worker:
        return self.workers[self.rng.choice(sorted(self.workers))]

    # ------------------------------------------------------------------ faults
    def kill_worker(self, worker: Worker, name: str, key: str | None = None) -> Worker:
        """SIGKILL a worker (a cut of its connections) and start a replacement."""
        t = now()
        worker.kill()
        self.cuts.append(Cut(t, worker.client, done_t=now()))
        self.injections.append(Injection(name, t, worker.client, key))
        del self.workers[worker.client]
        self.retired.append(worker)
        proxy = self.proxies.pop(worker.client, None)
        if proxy is not None:
            proxy.stop()
        base = worker.client.split(".")[0]
        generation = sum(1 for w in self.retired if w.client.split(".")[0] == base)
        return self.spawn(f"{base}.{generation}", two_phase=worker.cfg.two_phase)

    def kill_server(self) -> None:
        t = now()
        self.server.kill()
        self.cuts.append(Cut(t, None, done_t=now()))
        self.injections.append(Injection("server SIGKILL", t))

    def pause_server(self, seconds: float) -> None:
        """SIGSTOP the server (a frozen VM, a node under memory pressure) for ``seconds`` from
        the moment every thread of it is stopped, then SIGCONT."""
        assert self.server.proc is not None
        t = now()
        with paused(self.server.proc.proc.pid):
            self.injections.append(Injection(f"server SIGSTOP {seconds:g} s", t))
            time.sleep(seconds)

    def terminate_server(self) -> None:
        """SIGTERM the server and wait for it to exit (a cut whose ``done_t`` is its exit)."""
        t = now()
        self.server.terminate()
        self.cuts.append(Cut(t, None, done_t=now()))
        self.injections.append(Injection("server SIGTERM", t))

    def cut_connections(self, worker: Worker, *, rst: bool, key: str | None = None) -> int:
        """Drop or reset every connection of ``worker`` at its proxy."""
        proxy = self.proxies[worker.client]
        t = now()
        n = proxy.reset() if rst else proxy.drop()
        self.cuts.append(Cut(t, worker.client, done_t=now()))
        self.injections.append(
            Injection("proxy reset" if rst else "proxy drop", t, worker.client, key)
        )
        return n

    # ------------------------------------------------------------------ the end
    def finish(self) -> RunResult:
        """Stop every client (SIGTERM; SIGKILL after a while, recorded as a cut) and the server;
        the checked material of the run."""
        everyone = [w for w in self.all_workers() if w not in self.retired]
        for worker in everyone:
            worker.wait_ready()  # a SIGTERM before its handler is set would kill it outright
        for worker in everyone:
            if worker.alive():
                worker.signal(signal.SIGCONT)
                worker.signal(signal.SIGTERM)
        stuck: list[str] = []
        for worker in everyone:
            if not worker.wait(STOP_TIMEOUT_S):
                t = now()
                worker.dump_stacks()
                worker.kill()
                self.cuts.append(Cut(t, worker.client, done_t=now()))
                stuck.append(worker.client)
        failed = {w.client: w.stderr() for w in everyone if w.exitcode != 0}
        assert not failed, f"workers failed (stuck: {stuck}): {failed}"
        for proxy in self.proxies.values():
            proxy.stop()
        self.stop_servers()
        holds: list[Hold] = []
        latencies: list[float] = []
        for worker in self.all_workers():
            events = read_events(worker.history)
            holds.extend(holds_from_events(worker.client, events))
            if worker.client == HEALTHY:
                grants = {e["id"]: e for e in events if e["ev"] == "grant"}
                latencies = [
                    e["done"] - grants[e["id"]]["req"]
                    for e in events
                    if e["ev"] == "end" and e["rel_ok"] and e["id"] in grants
                ]
        summaries = [self.resource.summary(k) for k in self.keys]
        return RunResult(
            holds, self.cuts, summaries, self.injections, latencies, one_server=self.one_server
        )

    def close(self) -> None:
        """Kill whatever is left (after a failure)."""
        for worker in self.all_workers():
            if worker.alive():
                worker.signal(signal.SIGCONT)
            worker.kill()
        for proxy in self.proxies.values():
            proxy.stop()
        self.stop_servers()
        self.resource.close()

    def stop_servers(self) -> None:
        """Stop every lock server of the run (gracefully)."""
        self.server.stop()
        if self.second_server is not None:
            self.second_server.stop()

    def __enter__(self) -> Self:
        try:
            self.start()
            return self
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.close()
