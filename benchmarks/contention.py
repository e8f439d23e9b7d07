"""Contention benchmark: many waiters on one key; handoff latency and FIFO order; busy keys.

    uv run python -m benchmarks.contention            # 100 waiters, 10 rounds (under a minute)
    uv run python -m benchmarks.contention --quick
    uv run python -m benchmarks.contention --only busy   # the busy-keys batch (3 minutes)

The two parts share one results file when they share a ``--run-id`` (either order).

One connection holds the key; ``--waiters`` connections then ask for it one after another
(each is seen queued in ``stats`` before the next asks). The holder releases, and every waiter
releases as soon as it is granted, so the key is handed down the whole queue. Handoff latency
is the time from sending a release to the next waiter reading its grant, on one clock.
The grant order must be the queue order (FIFO) and the fencing counters must increase.

Measured on both event loops at the wire (one client process, a selector over the
connections), through ``celery_dflock.DistributedLock`` (one thread per waiter), and, for
comparison, redis-py's ``Lock`` (one thread per waiter): Redis has no queue, so its waiters
poll every ``sleep`` seconds (redis-py's default 0.1 s) and nothing orders them.

Busy keys (``--only busy``): 200 tasks on 5 keys (``bench.busy``, a 0.25 s body, task ``i``
locks key ``i % 5``) are published to a fresh queue on a private ``redis-server``, then two
real workers (``-c 4`` each, prefork or gevent) take them. Per busy-key policy (the lock
options travel in each message): ``on_locked="retry"`` with no wait (``lock_timeout=0``, the
default before issue 31), a FIFO wait (``lock_timeout=120``), and the defaults as shipped
(retry after a 30 s FIFO wait). Ideal time: 40 bodies one after another on each key (10 s);
the batch's time runs from the first body's start to the last body's end. Every body must run
once (200 runs), and no two bodies of one key may overlap.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import _codec
from benchmarks._codec import RELEASE, STATS, TRY_LOCK
from benchmarks._common import (
    REPO,
    BenchRun,
    Goal,
    ServerProcess,
    Table,
    available_loops,
    base_parser,
    fmt_num,
    owned_servers,
    percentile,
    read_line,
    start_dflockd,
    start_redis,
    workdir,
)
from benchmarks.celery_app import BUSY_BODY_S, BUSY_KEYS, LOG_ENV, SETTINGS_ENV

NAME = "contention"
WAIT_S = 120
"""Seconds each waiter is willing to queue (never reached)."""
SETTLE_TIMEOUT_S = 30.0
REDIS_SLEEP_S = 0.1
"""redis-py ``Lock``'s default pause between attempts."""
FENCE_HEX = 16


@dataclass
class Outcome:
    """One way of handing a key down a queue of waiters, over all its rounds."""

    server: str
    client: str
    waiters: int
    rounds: int
    handoffs_ns: list[int] = field(default_factory=list[int])
    in_order: int = 0
    """Grants that went to the waiter whose turn it was (queue order)."""
    grants: int = 0
    fences_increasing: bool | None = True
    """None where the lock has no fencing counter."""

    @property
    def fifo(self) -> bool:
        return self.grants > 0 and self.in_order == self.grants

    def as_dict(self) -> dict[str, Any]:
        ordered = sorted(self.handoffs_ns)
        return {
            "server": self.server,
            "client": self.client,
            "waiters": self.waiters,
            "rounds": self.rounds,
            "handoffs": len(ordered),
            "p50_us": round(percentile(ordered, 50) / 1000, 1),
            "p99_us": round(percentile(ordered, 99) / 1000, 1),
            "max_us": round(ordered[-1] / 1000, 1) if ordered else None,
            "grants": self.grants,
            "in_order": self.in_order,
            "fifo": self.fifo,
            "fences_increasing": self.fences_increasing,
        }


# ------------------------------------------------------------------------------ wire helpers
def _request(sock: socket.socket, request: bytes) -> bytes:
    sock.sendall(request)
    return read_line(sock, bytearray())


def _connect(server: ServerProcess) -> socket.socket:
    sock = socket.create_connection((server.host, server.port), timeout=SETTLE_TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def queued(monitor: socket.socket, key: str) -> int:
    """Waiters queued on ``key``, from the server's ``stats``."""
    reply = _request(monitor, STATS)
    if not reply.startswith(b"ok "):
        raise RuntimeError(f"stats failed: {reply[:80]!r}")
    for lock in json.loads(reply[3:])["locks"]:
        if lock["key"] == key:
            return int(lock["waiters"])
    return 0


def wait_queued(monitor: socket.socket, key: str, count: int) -> None:
    """Poll ``stats`` until ``count`` waiters are queued on ``key``."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while queued(monitor, key) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{count} waiter(s) never showed up queued on {key}")


def _fence(token: bytes | str) -> int:
    return int(token[:FENCE_HEX], 16)


# ------------------------------------------------------------------------------ dflockd, wire
def wire_round(server: ServerProcess, key: str, waiters: int, out: Outcome) -> None:
    """One round at the wire: queue ``waiters`` connections, hand the key down the queue."""
    bkey = key.encode()
    monitor = _connect(server)
    holder = _connect(server)
    socks: list[socket.socket] = []
    try:
        grant = _request(holder, TRY_LOCK % bkey)
        if not grant.startswith(b"ok "):
            raise RuntimeError(f"the holder was refused: {grant!r}")
        holder_token = grant.split()[1]
        wait = _codec.lock(WAIT_S)
        for i in range(waiters):
            sock = _connect(server)
            socks.append(sock)
            sock.sendall(wait % bkey)
            wait_queued(monitor, key, i + 1)
        sel = selectors.DefaultSelector()
        bufs = [bytearray() for _ in socks]
        for index, sock in enumerate(socks):
            sel.register(sock, selectors.EVENT_READ, index)
        granted: list[int] = []
        fences: list[int] = [_fence(holder_token)]
        released_at = time.monotonic_ns()
        holder.sendall(RELEASE % (bkey, holder_token))
        pending_ok = waiters
        while len(granted) < waiters or pending_ok:
            events = sel.select(SETTLE_TIMEOUT_S)
            if not events:
                raise RuntimeError(f"no grant within {SETTLE_TIMEOUT_S} s; granted {granted}")
            for sel_key, _mask in events:
                index: int = sel_key.data
                sock = socks[index]
                data = sock.recv(65536)
                now = time.monotonic_ns()
                if not data:
                    raise ConnectionError("the server closed a waiter's connection")
                buf = bufs[index]
                buf += data
                while b"\n" in buf:
                    line, _, rest = bytes(buf).partition(b"\n")
                    buf[:] = rest
                    if line.startswith(b"ok ") and index not in granted:
                        out.handoffs_ns.append(now - released_at)
                        granted.append(index)
                        token = line.split()[1]
                        fences.append(_fence(token))
                        released_at = time.monotonic_ns()
                        sock.sendall(RELEASE % (bkey, token))
                    elif line == b"ok":
                        pending_ok -= 1
                    else:
                        raise RuntimeError(f"waiter {index} got {line!r}")
        if read_line(holder, bytearray()) != b"ok":
            raise RuntimeError("the holder's release was refused")
        sel.close()
        out.grants += len(granted)
        out.in_order += sum(1 for turn, index in enumerate(granted) if turn == index)
        if any(b <= a for a, b in itertools.pairwise(fences)):
            out.fences_increasing = False
    finally:
        for sock in (*socks, holder, monitor):
            sock.close()


# ------------------------------------------------------------------------------ threads
@dataclass
class _Grant:
    waiter: int
    granted_ns: int
    released_ns: int
    fence: int | None


def threaded_round(
    acquire_release: Callable[[int, list[_Grant], threading.Lock], None],
    take_holder: Callable[[], Callable[[], None]],
    waiters: int,
    settle: Callable[[int], None],
    out: Outcome,
) -> None:
    """Waiters in threads (started in order, each settled before the next); the holder's
    release starts the handoffs."""
    release_holder = take_holder()
    grants: list[_Grant] = []
    lock = threading.Lock()
    threads: list[threading.Thread] = []
    for i in range(waiters):
        thread = threading.Thread(target=acquire_release, args=(i, grants, lock), daemon=True)
        thread.start()
        threads.append(thread)
        settle(i + 1)
    released_at = time.monotonic_ns()
    release_holder()
    for thread in threads:
        thread.join(WAIT_S)
    if len(grants) != waiters:
        raise RuntimeError(f"only {len(grants)} of {waiters} waiters were granted")
    grants.sort(key=lambda g: g.granted_ns)
    previous = released_at
    for turn, grant in enumerate(grants):
        out.handoffs_ns.append(grant.granted_ns - previous)
        previous = grant.released_ns
        out.in_order += grant.waiter == turn
    out.grants += len(grants)
    fences = [g.fence for g in grants]
    if any(f is None for f in fences):
        out.fences_increasing = None
    elif any(b <= a for a, b in itertools.pairwise(fences)):  # type: ignore[operator]
        out.fences_increasing = False


def dflock_client_round(server: ServerProcess, key: str, waiters: int, out: Outcome) -> None:
    from celery_dflock import DistributedLock

    servers = [(server.host, server.port)]
    monitor = _connect(server)

    def take_holder() -> Callable[[], None]:
        holder = DistributedLock(key, 0, servers=servers)
        if not holder.acquire():
            raise RuntimeError("the holder was refused")

        def release() -> None:
            holder.release()

        return release

    def acquire_release(i: int, grants: list[_Grant], guard: threading.Lock) -> None:
        lock = DistributedLock(key, WAIT_S, servers=servers)
        if not lock.acquire():
            return
        granted = time.monotonic_ns()
        fence = lock.fence
        released = time.monotonic_ns()
        lock.release()
        with guard:
            grants.append(_Grant(i, granted, released, fence))

    try:
        threaded_round(
            acquire_release,
            take_holder,
            waiters,
            lambda count: wait_queued(monitor, key, count),
            out,
        )
    finally:
        monitor.close()


def redis_round(
    server: ServerProcess, key: str, waiters: int, sleep_s: float, out: Outcome
) -> None:
    import redis

    client = redis.Redis(host=server.host, port=server.port, max_connections=waiters + 8)
    try:

        def take_holder() -> Callable[[], None]:
            holder = client.lock(key, timeout=WAIT_S)
            if not holder.acquire(blocking=False):
                raise RuntimeError("the holder was refused")
            return holder.release

        def acquire_release(i: int, grants: list[_Grant], guard: threading.Lock) -> None:
            lock = client.lock(key, timeout=WAIT_S, sleep=sleep_s, blocking_timeout=WAIT_S)
            if not lock.acquire():
                return
            granted = time.monotonic_ns()
            released = time.monotonic_ns()
            lock.release()
            with guard:
                grants.append(_Grant(i, granted, released, None))

        threaded_round(acquire_release, take_holder, waiters, lambda _count: None, out)
    finally:
        client.close()


# ------------------------------------------------------------------------------ busy keys
BUSY_TASKS = 200
BUSY_WORKERS = 2
BUSY_SLOTS = 4
BUSY_TIMEOUT_S = 600.0
BUSY_POLICIES: dict[str, dict[str, object]] = {
    "retry, no wait (lock_timeout=0; default before)": {"lock_timeout": 0},
    "FIFO wait (lock_timeout=120)": {"lock_timeout": 120},
    "defaults as shipped (30 s FIFO wait, then retry)": {},
}


@dataclass
class BusyBatch:
    pool: str
    policy: str
    tasks: int
    runs: int
    overlaps: int
    wall_s: float
    ideal_s: float
    lock_retries: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "policy": self.policy,
            "tasks": self.tasks,
            "runs": self.runs,
            "overlaps": self.overlaps,
            "wall_s": self.wall_s,
            "ideal_s": self.ideal_s,
            "x_ideal": self.wall_s / self.ideal_s,
            "lock_retries": self.lock_retries,
        }


def _busy_log(path: Path) -> list[tuple[int, float, float]]:
    if not path.exists():
        return []
    out: list[tuple[int, float, float]] = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            out.append((int(parts[0]), float(parts[1]), float(parts[2])))
    return out


def _overlaps(entries: list[tuple[int, float, float]]) -> int:
    count = 0
    for k in range(BUSY_KEYS):
        runs = sorted((s, e) for i, s, e in entries if i % BUSY_KEYS == k)
        count += sum(1 for a, b in itertools.pairwise(runs) if b[0] < a[1])
    return count


def busy_batch(
    tmp: Path, broker: ServerProcess, locks: ServerProcess, *, pool: str, policy: str, n: int
) -> BusyBatch:
    """Publish ``n`` busy-key tasks with ``policy``'s lock options, run them on the workers."""
    from celery import Celery

    queue = f"dflock-bench-busy-{uuid.uuid4().hex[:8]}"
    conf: dict[str, Any] = {
        "broker_url": f"redis://{broker.host}:{broker.port}/0",
        "task_default_queue": queue,
        "task_ignore_result": True,
        "broker_connection_retry_on_startup": True,
        "worker_hijack_root_logger": False,
        "broker_transport_options": {"polling_interval": 0.05},
        "dflock_servers": f"{locks.host}:{locks.port}",
    }
    options = BUSY_POLICIES[policy]
    headers = {"dflock_options": options} if options else None
    app = Celery("dflock-bench-busy-client", set_as_current=False)
    app.conf.update(conf)
    try:
        with app.producer_or_acquire() as producer:
            for i in range(n):
                app.send_task(
                    "bench.busy", args=(i, i % BUSY_KEYS), producer=producer, headers=headers
                )
    finally:
        app.close()
    log = tmp / f"{queue}.log"
    env = {
        **os.environ,
        SETTINGS_ENV: json.dumps(conf),
        LOG_ENV: str(log),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    workers: list[subprocess.Popen[bytes]] = []
    outputs: list[Path] = []
    try:
        for w in range(BUSY_WORKERS):
            output = tmp / f"{queue}.w{w}.out"
            outputs.append(output)
            with output.open("wb") as out:
                workers.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "celery",
                            "-A",
                            "benchmarks.celery_app",
                            "worker",
                            "-P",
                            pool,
                            "-c",
                            str(BUSY_SLOTS),
                            "-Q",
                            queue,
                            "-n",
                            f"{queue}-{w}@bench",
                            "--without-gossip",
                            "--without-mingle",
                            "--without-heartbeat",
                            "-l",
                            "INFO",
                        ],
                        cwd=REPO,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while len({i for i, _s, _e in _busy_log(log)}) < n:
            entries = _busy_log(log)
            if time.monotonic() > deadline or any(w.poll() is not None for w in workers):
                raise RuntimeError(
                    f"busy keys, {pool}, {policy}: {len(entries)} of {n} ran; worker output:\n"
                    + outputs[0].read_text(errors="replace")[-3000:]
                )
            time.sleep(0.1)
        time.sleep(BUSY_BODY_S * 2)  # a second run of a key (there must be none) shows up
        entries = _busy_log(log)
    finally:
        for worker in workers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(30)
    retries = sum(o.read_text(errors="replace").count(" retries in ") for o in outputs)
    first = min(s for _i, s, _e in entries)
    last = max(e for _i, _s, e in entries)
    ideal = (n / BUSY_KEYS) * BUSY_BODY_S
    return BusyBatch(
        pool, policy, n, len(entries), _overlaps(entries), last - first, ideal, retries
    )


def busy_keys(run: BenchRun, tmp: Path, servers: list[ServerProcess], quick: bool) -> bool:
    """The busy-keys batch on prefork and gevent for every policy; True when every batch ran
    each task once without an overlap."""
    n = 20 if quick else BUSY_TASKS
    locks = start_dflockd("uvloop" if "uvloop" in available_loops() else "asyncio", tmp)
    servers.append(locks)
    broker = start_redis(tmp)
    servers.append(broker)
    batches: list[BusyBatch] = []
    for pool in ("prefork", "gevent"):
        for policy in BUSY_POLICIES:
            batch = busy_batch(tmp, broker, locks, pool=pool, policy=policy, n=n)
            print(f"busy keys: {batch.as_dict()}", flush=True)
            batches.append(batch)
    run.params["busy_keys"] = {
        "tasks": n,
        "keys": BUSY_KEYS,
        "body_s": BUSY_BODY_S,
        "workers": f"{BUSY_WORKERS} x {BUSY_SLOTS}",
        "policies": BUSY_POLICIES,
    }
    table = Table(
        f"Busy keys: {n} tasks on {BUSY_KEYS} keys, {BUSY_BODY_S:g} s bodies, "
        f"{BUSY_WORKERS} workers x {BUSY_SLOTS} slots",
        ["pool", "busy-key policy", "runs", "overlaps", "time (s)", "ideal (s)", "x ideal",
         "lock retries"],
        notes=[
            "time: first body start to last body end; ideal: each key's bodies back to back; "
            "lock retries: runs sent again because their key was busy",
        ],
    )  # fmt: skip
    for b in batches:
        table.rows.append(
            [b.pool, b.policy, str(b.runs), str(b.overlaps), f"{b.wall_s:.1f}",
             f"{b.ideal_s:.1f}", f"{b.wall_s / b.ideal_s:.2f}x", str(b.lock_retries)]
        )  # fmt: skip
    run.add(table)
    ok = all(b.runs == b.tasks and b.overlaps == 0 for b in batches)
    shipped = [b for b in batches if not BUSY_POLICIES[b.policy]]
    run.goals.append(
        Goal(
            goal="busy keys with the defaults as shipped: within 1.5x the ideal, every task "
            "run once, no overlap (prefork and gevent)",
            measured=", ".join(f"{b.pool}: {b.wall_s / b.ideal_s:.2f}x" for b in shipped),
            met=ok and all(b.wall_s / b.ideal_s <= 1.5 for b in shipped),
        )
    )
    run.data["busy_keys"] = [b.as_dict() for b in batches]
    return ok


# ------------------------------------------------------------------------------ main
def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(NAME, __doc__.split("\n", 1)[0] if __doc__ else NAME)
    parser.add_argument("--waiters", type=int, default=0, help="waiters on the key (100)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds per dflockd measurement")
    parser.add_argument(
        "--redis-sleep",
        type=float,
        default=REDIS_SLEEP_S,
        help="redis-py Lock's pause between attempts (its default: 0.1 s)",
    )
    parser.add_argument("--loops", default=",".join(available_loops()), help="dflockd event loops")
    parser.add_argument(
        "--only",
        choices=("handoff", "busy"),
        default="handoff",
        help="the handoff latency (default), or the busy-keys batch of Celery workers",
    )
    args = parser.parse_args(argv)
    quick = bool(args.quick)
    waiters = args.waiters or (10 if quick else 100)
    rounds = args.rounds or (1 if quick else 10)
    loops = [x for x in args.loops.split(",") if x]
    run = BenchRun(
        NAME,
        args,
        list(sys.argv[1:] if argv is None else argv),
        params={
            "waiters": waiters,
            "rounds": rounds,
            "client_rounds": max(1, rounds // 5),
            "redis_rounds": 1,
            "redis_sleep_s": args.redis_sleep,
            "loops": loops,
        },
    )
    outcomes: list[Outcome] = []
    busy_ok = True
    with workdir("dflock-bench-contention-") as tmp, owned_servers() as servers:
        if args.only == "busy":
            busy_ok = busy_keys(run, tmp, servers, quick)
            run.write(with_same_run=True)
            return 0 if busy_ok else 1
        for loop in loops:
            server = start_dflockd(loop, tmp, "--max-locks", "100000")
            servers.append(server)
            wire = Outcome(server.label, "wire (selector, one process)", waiters, rounds)
            for r in range(rounds):
                wire_round(server, f"dflock-bench:contention:wire:{r}", waiters, wire)
            outcomes.append(wire)
            print(f"{server.label} wire: {len(wire.handoffs_ns)} handoffs", flush=True)
            client_rounds = run.params["client_rounds"]
            threaded = Outcome(
                server.label, "DistributedLock (thread per waiter)", waiters, client_rounds
            )
            for r in range(client_rounds):
                dflock_client_round(
                    server, f"dflock-bench:contention:client:{r}", waiters, threaded
                )
            outcomes.append(threaded)
            print(f"{server.label} DistributedLock: {len(threaded.handoffs_ns)} handoffs")
        redis_server = start_redis(tmp, maxclients=waiters + 100)
        servers.append(redis_server)
        polled = Outcome(
            "redis", f"redis-py Lock (thread per waiter, sleep {args.redis_sleep:g} s)", waiters, 1
        )
        redis_round(
            redis_server, "dflock-bench:contention:redis", waiters, args.redis_sleep, polled
        )
        outcomes.append(polled)
        print(f"redis: {len(polled.handoffs_ns)} handoffs", flush=True)

    table = Table(
        f"Handoff latency, {waiters} waiters on one key "
        "(microseconds, from sending a release to reading the next grant)",
        ["server", "client", "handoffs", "p50", "p99", "max", "in queue order", "fences increase"],
        notes=[
            "every waiter releases as soon as it is granted; queue order = the order the waiters "
            "asked (each seen queued before the next asked; Redis: thread start order)",
        ],
    )
    for o in outcomes:
        d = o.as_dict()
        table.rows.append(
            [
                o.server,
                o.client,
                str(d["handoffs"]),
                fmt_num(d["p50_us"]),
                fmt_num(d["p99_us"]),
                fmt_num(d["max_us"] or float("nan")),
                f"{o.in_order}/{o.grants}",
                "n/a" if o.fences_increasing is None else ("yes" if o.fences_increasing else "NO"),
            ]
        )
    run.add(table)
    ours = [o for o in outcomes if o.server != "redis"]
    run.goals.append(
        Goal(
            goal=f"FIFO grants and increasing fences, {waiters} waiters on one key (check)",
            measured=", ".join(
                f"{o.server} {o.client}: {o.in_order}/{o.grants} in order" for o in ours
            ),
            met=all(o.fifo and o.fences_increasing for o in ours),
        )
    )
    run.data["outcomes"] = [o.as_dict() for o in outcomes]
    run.write(with_same_run=True)
    return 0 if busy_ok and all(o.fifo and o.fences_increasing for o in ours) else 1


if __name__ == "__main__":
    raise SystemExit(main())
