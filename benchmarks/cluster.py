"""Cluster mode's cost: one server against a 3-member cluster and 3 static members, in one run.

    uv run python -m benchmarks.cluster            # full size (about 1.5 minutes on 2 cores)
    uv run python -m benchmarks.cluster --quick    # seconds, tiny sizes (the smoke test)

Starts three topologies side by side, every server a real ``dflockd`` child process on the
same event loop: one plain server (``single``, the client ``Client([server])``); three members
of a lock cluster on a private etcd (``cluster``: ``--cluster etcd://... --advertise``, the
client ``Client(seeds, sharding_strategy="cluster")``); three static members (``static``:
``--members a,b,c --advertise x``, the client ``Client([a, b, c])`` on its default crc32
strategy). Then, for every round and with the topologies' order rotating each round, the same
key load through the blocking ``Client.lock(key)`` (acquire, then release) on each:

- *one client*: pairs one after another from one process (latency p50/p99);
- *load*: ``--workers`` client processes for ``--seconds`` (pairs/s), each with its own client;
- keys *distinct* (a new key per pair, spread over the shards) and *reused* (each client cycles
  through its own ``REUSED_KEYS`` keys);
- *fresh client*: the first acquire+release of a new ``Client`` (connect, hello, and in cluster
  mode the ``shards`` map fetch), then its second.

Server CPU per pair is the sum over the topology's members (``/proc/<pid>/task/*/schedstat``,
read before and after each phase); the cluster's etcd is shown apart. An idle window shows
what each topology costs doing nothing (the cluster members' etcd lease and watch). Last, an
in-process micro-benchmark of what each mode adds per acquire: the server's ownership check
(none, crc32 over the member list, FNV-1a into the shard map) and the client's routing.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
import timeit
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnProcess
from pathlib import Path
from typing import Any, cast

from benchmarks._codec import SHARDS
from benchmarks._common import (
    BenchRun,
    ServerProcess,
    Table,
    available_loops,
    base_parser,
    cpu_ns,
    etcd_binary,
    fmt_num,
    fmt_ratio,
    free_ports,
    median,
    owned_servers,
    percentile,
    ratio,
    start_dflockd,
    start_etcd,
    workdir,
)

NAME = "cluster"
SINGLE, CLUSTER, STATIC = "single", "cluster", "static"
TOPOLOGIES = (SINGLE, CLUSTER, STATIC)
MEMBERS = 3
DISTINCT, REUSED = "distinct", "reused"
VARIANTS = (DISTINCT, REUSED)
REUSED_KEYS = 64
"""Keys each client cycles through in the *reused* variant (its own: no contention)."""
LATENCY, LOAD, FRESH = "latency", "load", "fresh"
MAX_LOCKS = "1000000"
MAP_TIMEOUT_S = 60.0
START_DELAY_S = 0.05
"""The load phase starts this long after its jobs are sent, in every worker at once."""
WORKER_TIMEOUT_S = 120.0
MICRO_KEY_LEN = 64
SETTLE_POLL_S = 0.2


# ------------------------------------------------------------------------------ topologies
@dataclass
class Topology:
    """One way of serving the keys: its server processes and how a client names them."""

    name: str
    members: list[ServerProcess]
    cluster: bool
    etcd: ServerProcess | None = None

    @property
    def seeds(self) -> tuple[tuple[str, int], ...]:
        return tuple((m.host, m.port) for m in self.members)

    def cpu_ns(self) -> int:
        return sum(m.cpu_ns() for m in self.members)

    def etcd_cpu_ns(self) -> int:
        return 0 if self.etcd is None else self.etcd.cpu_ns()

    def describe(self) -> str:
        if self.name == SINGLE:
            return "one dflockd; Client([server])"
        if self.cluster:
            return (
                f"{len(self.members)} members on etcd; Client(seeds, sharding_strategy='cluster')"
            )
        return f"{len(self.members)} members (--members); Client(members), crc32"


def request_line(server: ServerProcess, payload: bytes) -> bytes:
    """One request on a new connection; the reply's first line."""
    with socket.create_connection((server.host, server.port), timeout=10.0) as sock:
        sock.sendall(payload)
        buf = bytearray()
        while b"\n" not in buf:
            data = sock.recv(1 << 16)
            if not data:
                raise ConnectionError(f"{server.label} closed the connection")
            buf += data
    return bytes(buf).partition(b"\n")[0]


def shards_answer(server: ServerProcess) -> dict[str, Any]:
    reply = request_line(server, SHARDS)
    if not reply.startswith(b"ok "):
        raise RuntimeError(f"shards refused by {server.label}: {reply[:200]!r}")
    return cast("dict[str, Any]", json.loads(reply[3:]))


def shards_per_member(info: dict[str, Any]) -> dict[str, int]:
    nodes: list[str] = info["nodes"]
    counts = dict.fromkeys(cast("list[str]", info["members"]), 0)
    for index in cast("list[int]", info["current"]):
        if index >= 0:
            counts[nodes[index]] = counts.get(nodes[index], 0) + 1
    return counts


def wait_cluster(members: list[ServerProcess], etcd_url: str) -> dict[str, Any]:
    """Until every member is live, serves shards and none moves (a rebalance if one started
    after the first map was written); returns the map as a member answers ``shards``."""
    advertised = {f"{m.host}:{m.port}" for m in members}
    deadline = time.monotonic() + MAP_TIMEOUT_S
    rebalanced = False
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            last = shards_answer(members[0])
        except (OSError, RuntimeError):
            time.sleep(SETTLE_POLL_S)
            continue
        current = cast("list[int]", last.get("current") or [])
        live = set(cast("list[str]", last.get("members") or []))
        if live == advertised and current and min(current) >= 0 and not last.get("moving"):
            if all(shards_per_member(last).get(a, 0) > 0 for a in advertised):
                return last
            if not rebalanced:  # a member joined after the first map: spread the shards
                dflockd = Path(sys.executable).parent / "dflockd"
                subprocess.run(
                    [str(dflockd), "rebalance", "--cluster", etcd_url],
                    capture_output=True,
                    check=True,
                    timeout=MAP_TIMEOUT_S,
                )
                rebalanced = True
        time.sleep(SETTLE_POLL_S)
    brief = {k: v for k, v in last.items() if k not in {"current", "target"}}
    raise RuntimeError(f"the cluster did not settle with {len(members)} members: {brief}")


def start_all(
    loop: str, tmp: Path, flag_sets: Sequence[tuple[str, ...]], servers: list[ServerProcess]
) -> list[ServerProcess]:
    """``dflockd`` with each set of flags, all starting at once (threads wait for their logs);
    every one that started is appended to ``servers``, even when another failed."""
    with concurrent.futures.ThreadPoolExecutor(len(flag_sets)) as pool:
        futures = [pool.submit(start_dflockd, loop, tmp, *flags) for flags in flag_sets]
        concurrent.futures.wait(futures)
    started = [f.result() for f in futures if f.exception() is None]
    servers.extend(started)
    for future in futures:
        error = future.exception()
        if error is not None:
            raise error
    return started


def start_topologies(loop: str, tmp: Path, servers: list[ServerProcess]) -> list[Topology]:
    """The three topologies, every process appended to ``servers`` (stopped by the caller)."""
    common = ("--restart-grace", "0", "--max-locks", MAX_LOCKS)
    etcd = start_etcd(tmp)
    servers.append(etcd)
    etcd_url = f"etcd://127.0.0.1:{etcd.port}/dflock-bench"
    ports = free_ports(2 * MEMBERS)
    cluster_ports, static_ports = ports[:MEMBERS], ports[MEMBERS:]
    member_list = ",".join(f"127.0.0.1:{p}" for p in static_ports)
    flag_sets = [
        *(
            ("--port", str(p), "--cluster", etcd_url, "--advertise", f"127.0.0.1:{p}", *common)
            for p in cluster_ports
        ),
        common,
        *(
            ("--port", str(p), "--members", member_list, "--advertise", f"127.0.0.1:{p}", *common)
            for p in static_ports
        ),
    ]
    started = start_all(loop, tmp, flag_sets, servers)
    cluster, single, static = started[:MEMBERS], started[MEMBERS], started[MEMBERS + 1 :]
    wait_cluster(cluster, etcd_url)
    return [
        Topology(SINGLE, [single], cluster=False),
        Topology(CLUSTER, cluster, cluster=True, etcd=etcd),
        Topology(STATIC, static, cluster=False),
    ]


# ------------------------------------------------------------------------------ client workers
@dataclass(frozen=True)
class Job:
    """What a client worker does next (sent through its pipe)."""

    kind: str
    topology: str
    seeds: tuple[tuple[str, int], ...]
    cluster: bool
    prefix: str
    variant: str = DISTINCT
    pairs: int = 0
    """LATENCY: pairs one after another; FRESH: fresh clients."""
    start_at: float = 0.0
    """LOAD: ``time.monotonic()`` to start at (one clock for every process on Linux)."""
    seconds: float = 0.0


@dataclass
class JobResult:
    pairs: int = 0
    refused: int = 0
    elapsed_s: float = 0.0
    latencies_ns: list[int] = field(default_factory=list[int])
    first_ns: list[int] = field(default_factory=list[int])
    """FRESH: each new client's first acquire+release."""
    second_ns: list[int] = field(default_factory=list[int])
    """FRESH: the same client's second (another key)."""


def new_client(job: Job) -> Any:
    from celery_dflock import Client
    from celery_dflock.client.sharding import CLUSTER as CLUSTER_ROUTING

    if job.cluster:
        return Client(list(job.seeds), sharding_strategy=CLUSTER_ROUTING)
    return Client(list(job.seeds))


def one_pair(client: Any, key: str) -> bool:
    """``Client.lock(key)``: acquire (the client's default timeout), then release."""
    lock = client.lock(key)
    if not lock.acquire():
        return False
    lock.release()
    return True


def run_job(job: Job, clients: dict[str, Any]) -> JobResult:
    out = JobResult()
    if job.kind == FRESH:
        for i in range(job.pairs):
            client = new_client(job)
            try:
                for n, into in enumerate((out.first_ns, out.second_ns)):
                    t0 = time.perf_counter_ns()
                    ok = one_pair(client, f"{job.prefix}:{i}:{n}")
                    into.append(time.perf_counter_ns() - t0)
                    out.pairs += ok
                    out.refused += not ok
            finally:
                client.close()
        return out
    client = clients.get(job.topology)
    if client is None:
        client = clients[job.topology] = new_client(job)
    reused = [f"{job.prefix}:r{i}" for i in range(REUSED_KEYS)]
    distinct = job.variant == DISTINCT
    latencies = out.latencies_ns
    clock = time.perf_counter_ns
    if job.kind == LATENCY:
        start = time.monotonic()
        for i in range(job.pairs):
            key = f"{job.prefix}:{i}" if distinct else reused[i % REUSED_KEYS]
            t0 = clock()
            ok = one_pair(client, key)
            latencies.append(clock() - t0)
            out.pairs += ok
            out.refused += not ok
        out.elapsed_s = time.monotonic() - start
        return out
    time.sleep(max(0.0, job.start_at - time.monotonic()))
    end = job.start_at + job.seconds
    for i in itertools.count():
        key = f"{job.prefix}:{i}" if distinct else reused[i % REUSED_KEYS]
        t0 = clock()
        ok = one_pair(client, key)
        latencies.append(clock() - t0)
        out.pairs += ok
        out.refused += not ok
        if time.monotonic() >= end:
            break
    out.elapsed_s = time.monotonic() - job.start_at
    return out


def worker_main(conn: Connection) -> None:
    """A client process: runs the jobs it is sent, keeping one client per topology."""
    clients: dict[str, Any] = {}
    try:
        while True:
            job = cast("Job | None", conn.recv())
            if job is None:
                break
            conn.send(run_job(job, clients))
    finally:
        for client in clients.values():
            client.close()
        conn.close()


class Workers:
    """``count`` client processes (spawned: nothing of this process is inherited)."""

    def __init__(self, count: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[SpawnProcess] = []
        for _ in range(count):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(child,), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, jobs: Sequence[Job]) -> list[JobResult]:
        """Job ``i`` on worker ``i``; waits for every result."""
        for conn, job in zip(self.conns, jobs, strict=False):
            conn.send(job)
        results: list[JobResult] = []
        for conn in self.conns[: len(jobs)]:
            if not conn.poll(WORKER_TIMEOUT_S):
                raise RuntimeError(f"a client worker gave no result in {WORKER_TIMEOUT_S} s")
            results.append(cast("JobResult", conn.recv()))
        return results

    def cpu_ns(self) -> int:
        """CPU time of every client process."""
        return sum(cpu_ns(p.pid) for p in self.procs if p.pid is not None)

    def stop(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()


# ------------------------------------------------------------------------------ the figures
@dataclass
class Phase:
    """One phase of one round on one topology."""

    pairs: int
    refused: int
    seconds: float
    cpu_ns: int
    etcd_cpu_ns: int
    client_cpu_ns: int
    latencies_ns: list[int]

    @property
    def cpu_us_per_pair(self) -> float:
        return self.cpu_ns / 1000 / self.pairs if self.pairs else float("nan")

    @property
    def etcd_us_per_pair(self) -> float:
        return self.etcd_cpu_ns / 1000 / self.pairs if self.pairs else float("nan")

    @property
    def client_us_per_pair(self) -> float:
        return self.client_cpu_ns / 1000 / self.pairs if self.pairs else float("nan")

    @property
    def pairs_per_s(self) -> float:
        return self.pairs / self.seconds if self.seconds else float("nan")


@dataclass
class Cell:
    """The rounds of one topology, phase kind and key variant."""

    topology: str
    kind: str
    variant: str
    phases: list[Phase] = field(default_factory=list[Phase])

    def summary(self) -> dict[str, Any]:
        latencies = sorted(itertools.chain.from_iterable(p.latencies_ns for p in self.phases))
        return {
            "topology": self.topology,
            "kind": self.kind,
            "variant": self.variant,
            "rounds": len(self.phases),
            "pairs": sum(p.pairs for p in self.phases),
            "refused": sum(p.refused for p in self.phases),
            "p50_us": round(percentile(latencies, 50) / 1000, 1),
            "p99_us": round(percentile(latencies, 99) / 1000, 1),
            "pairs_per_s": round(median([p.pairs_per_s for p in self.phases]), 1),
            "cpu_us_per_pair": round(median([p.cpu_us_per_pair for p in self.phases]), 2),
            "etcd_cpu_us_per_pair": round(median([p.etcd_us_per_pair for p in self.phases]), 2),
            "client_cpu_us_per_pair": round(median([p.client_us_per_pair for p in self.phases]), 2),
            "cpu_us_per_pair_rounds": [round(p.cpu_us_per_pair, 2) for p in self.phases],
        }


def measured(topology: Topology, fleet: Workers, jobs: Sequence[Job], *, wall: bool) -> Phase:
    """Run the jobs, reading the CPU of the topology's servers, of its etcd and of the client
    workers around them. ``wall``: the phase's seconds are the longest worker's (the load),
    else the sum of the workers' own (one client)."""
    cpu0, etcd0, clients0 = topology.cpu_ns(), topology.etcd_cpu_ns(), fleet.cpu_ns()
    results = fleet.run(jobs)
    cpu1, etcd1, clients1 = topology.cpu_ns(), topology.etcd_cpu_ns(), fleet.cpu_ns()
    seconds = max(r.elapsed_s for r in results) if wall else sum(r.elapsed_s for r in results)
    return Phase(
        pairs=sum(r.pairs for r in results),
        refused=sum(r.refused for r in results),
        seconds=seconds,
        cpu_ns=cpu1 - cpu0,
        etcd_cpu_ns=etcd1 - etcd0,
        client_cpu_ns=clients1 - clients0,
        latencies_ns=[n for r in results for n in r.latencies_ns],
    )


def idle_cost(topologies: list[Topology], seconds: float) -> dict[str, dict[str, float]]:
    """CPU each topology's servers (and etcd) use doing nothing, in ms per second."""
    before = {t.name: (t.cpu_ns(), t.etcd_cpu_ns()) for t in topologies}
    start = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - start
    out: dict[str, dict[str, float]] = {}
    for t in topologies:
        cpu0, etcd0 = before[t.name]
        out[t.name] = {
            "servers_ms_per_s": round((t.cpu_ns() - cpu0) / 1e6 / elapsed, 2),
            "etcd_ms_per_s": round((t.etcd_cpu_ns() - etcd0) / 1e6 / elapsed, 2),
        }
    return out


# ------------------------------------------------------------------------------ micro-benchmark
def per_call_ns(fn: Callable[[Any], object], arg: object, number: int) -> float:
    """Best of five: nanoseconds per call of ``fn(arg)``."""
    best = min(timeit.Timer(lambda: fn(arg)).repeat(repeat=5, number=number))
    return best / number * 1e9


def micro(topologies: list[Topology], sample_key: str, number: int) -> list[dict[str, Any]]:
    """What each mode adds per acquire, timed in this process: the server's ownership check
    (as the server calls it) and the client's routing of a key (``Client.server_for``)."""
    import math
    import zlib

    from celery_dflock import Client
    from celery_dflock.client.sharding import CLUSTER as CLUSTER_ROUTING
    from dflockd_server.cluster.membership import ClusterView
    from dflockd_server.cluster.shardmap import SHARD_COUNT, ShardMap, fnv1a_32, shard_id
    from dflockd_server.cluster.snapshot import ClusterOwnership
    from dflockd_server.ownership import SingleOwnership, StaticOwnership

    by_name = {t.name: t for t in topologies}
    names = [f"127.0.0.1:{1000 + i}" for i in range(MEMBERS)]
    shard_map = ShardMap.initial(names)
    me = names[1]
    verdicts = tuple(
        None if a.current == me else f"error_moved {a.current}\n".encode()
        for _, a in sorted(shard_map.items())
    )
    assert len(verdicts) == SHARD_COUNT
    checks: dict[str, Callable[[str], object]] = {
        SINGLE: SingleOwnership().check,
        STATIC: StaticOwnership(names, me).check,
        CLUSTER: ClusterOwnership(
            me,
            ClusterView(frozenset(names), names[0], shard_map),
            verdicts,
            math.inf,
            time.monotonic,
        ).check,
    }
    clients = {
        SINGLE: Client(list(by_name[SINGLE].seeds)),
        STATIC: Client(list(by_name[STATIC].seeds)),
        CLUSTER: Client(list(by_name[CLUSTER].seeds), sharding_strategy=CLUSTER_ROUTING),
    }
    rows: list[dict[str, Any]] = []
    try:
        one_pair(clients[CLUSTER], f"{sample_key}:map")  # the map fetched once, then cached
        long_key = (sample_key + ":" + "x" * MICRO_KEY_LEN)[:MICRO_KEY_LEN]
        for key in (sample_key, long_key):
            row: dict[str, Any] = {"key_len": len(key.encode())}
            for name in TOPOLOGIES:
                row[f"server_{name}_ns"] = round(per_call_ns(checks[name], key, number), 1)
                route = clients[name].server_for
                row[f"client_{name}_ns"] = round(per_call_ns(route, key, number), 1)
            row["fnv1a_ns"] = round(per_call_ns(fnv1a_32, key.encode(), number), 1)
            row["shard_id_ns"] = round(per_call_ns(shard_id, key, number), 1)
            row["crc32_ns"] = round(per_call_ns(zlib.crc32, key.encode(), number), 1)
            rows.append(row)
    finally:
        for client in clients.values():
            client.close()
    return rows


# ------------------------------------------------------------------------------ a round
def one_round(
    fleet: Workers, t: Topology, r: int, sizes: Sizes, cells: dict[tuple[str, str, str], Cell]
) -> None:
    """One round's one-client and load phases on ``t``, both key variants."""
    for variant in VARIANTS:
        job = Job(LATENCY, t.name, t.seeds, t.cluster, f"bench:{t.name}:{variant[0]}:r{r}:one")
        job = dataclasses.replace(job, variant=variant, pairs=sizes.pairs)
        cells[t.name, LATENCY, variant].phases.append(measured(t, fleet, [job], wall=False))
    for variant in VARIANTS:
        start_at = time.monotonic() + START_DELAY_S
        jobs = [
            Job(
                LOAD,
                t.name,
                t.seeds,
                t.cluster,
                # distinct: new keys every round; reused: each worker's own keys, every round
                f"bench:{t.name}:d:r{r}:w{w}" if variant == DISTINCT else f"bench:{t.name}:w{w}",
                variant,
                start_at=start_at,
                seconds=sizes.seconds,
            )
            for w in range(sizes.workers)
        ]
        cells[t.name, LOAD, variant].phases.append(measured(t, fleet, jobs, wall=True))


def fresh_round(fleet: Workers, t: Topology, r: int, sizes: Sizes, fresh: FreshCell) -> None:
    job = Job(FRESH, t.name, t.seeds, t.cluster, f"bench:{t.name}:f{r}", pairs=sizes.fresh)
    (result,) = fleet.run([job])
    fresh.first_ns += result.first_ns
    fresh.second_ns += result.second_ns
    fresh.refused += result.refused
    if t.cluster:  # the map fetch alone, at the wire: the server's describe and the transfer
        for _ in range(sizes.fresh):
            t0 = time.perf_counter_ns()
            request_line(t.members[0], SHARDS)
            fresh.map_fetch_ns.append(time.perf_counter_ns() - t0)


@dataclass(frozen=True)
class Sizes:
    rounds: int
    pairs: int
    seconds: float
    workers: int
    fresh: int
    idle_s: float
    micro_calls: int


@dataclass
class FreshCell:
    """Fresh clients of one topology: the first and the second acquire+release of each."""

    first_ns: list[int] = field(default_factory=list[int])
    second_ns: list[int] = field(default_factory=list[int])
    map_fetch_ns: list[int] = field(default_factory=list[int])
    """Cluster: a ``shards`` request on a new connection, at the wire."""
    refused: int = 0

    def summary(self) -> dict[str, Any]:
        first, second = sorted(self.first_ns), sorted(self.second_ns)
        return {
            "clients": len(first),
            "first_p50_us": round(percentile(first, 50) / 1000, 1),
            "first_p99_us": round(percentile(first, 99) / 1000, 1),
            "second_p50_us": round(percentile(second, 50) / 1000, 1),
            "map_fetch_p50_us": round(percentile(sorted(self.map_fetch_ns), 50) / 1000, 1),
            "refused": self.refused,
        }


# ------------------------------------------------------------------------------ tables
def report(
    run: BenchRun,
    *,
    cells: dict[tuple[str, str, str], Cell],
    fresh: dict[str, FreshCell],
    idle: dict[str, dict[str, float]],
    micro_rows: list[dict[str, Any]],
    topologies: list[Topology],
    sizes: Sizes,
) -> None:
    s = {k: c.summary() for k, c in cells.items()}
    f = {name: c.summary() for name, c in fresh.items()}
    p = run.params
    members = ", ".join(f"{m}: {n}" for m, n in p["shards_per_member"].items())
    where = [f"{t.name}: {t.describe()}" for t in topologies]

    summary = Table(
        "Cluster mode against one server: cost per acquire+release (ratios to single)",
        [
            "topology",
            "server CPU/pair, load, distinct",
            "server CPU/pair, load, reused",
            "p50, one client, distinct",
            "p50, one client, reused",
            "first pair of a fresh Client",
        ],
        notes=[
            f"same loop ({p['loop']}), same key load, rounds alternating; CPU summed over every "
            "member of the topology (etcd not included: see the load table); ratios above 1 "
            "cost more than one server",
        ],
    )
    for name in (CLUSTER, STATIC):
        summary.rows.append(
            [
                name,
                *(
                    fmt_ratio(ratio(s[name, kind, v][col], s[SINGLE, kind, v][col]))
                    for kind, v, col in (
                        (LOAD, DISTINCT, "cpu_us_per_pair"),
                        (LOAD, REUSED, "cpu_us_per_pair"),
                        (LATENCY, DISTINCT, "p50_us"),
                        (LATENCY, REUSED, "p50_us"),
                    )
                ),
                fmt_ratio(ratio(f[name]["first_p50_us"], f[SINGLE]["first_p50_us"])),
            ]
        )
    run.add(summary)

    one = Table(
        f"One client, pairs one after another through Client.lock(key) "
        f"(microseconds; {sizes.pairs} pairs per round and key variant)",
        ["topology", "keys", "p50", "p99", "p50 vs single", "server CPU/pair", "CPU vs single"],
        notes=[
            "acquire (the client's default timeout, granted at once: the keys are free) then "
            "release, timed from Client.lock to the release's reply; latencies pooled over the "
            "rounds, CPU per pair the median round; distinct: a new key per pair; reused: "
            f"{REUSED_KEYS} keys in turn",
            *where,
        ],
    )
    for name, variant in itertools.product(TOPOLOGIES, VARIANTS):
        c, base = s[name, LATENCY, variant], s[SINGLE, LATENCY, variant]
        one.rows.append(
            [
                name,
                variant,
                fmt_num(c["p50_us"]),
                fmt_num(c["p99_us"]),
                fmt_ratio(ratio(c["p50_us"], base["p50_us"])),
                fmt_num(c["cpu_us_per_pair"]),
                fmt_ratio(ratio(c["cpu_us_per_pair"], base["cpu_us_per_pair"])),
            ]
        )
    run.add(one)

    load = Table(
        f"Load: {sizes.workers} client processes, {sizes.seconds:g} s per round and key variant",
        [
            "topology",
            "keys",
            "pairs/s",
            "p50 us",
            "p99 us",
            "server CPU us/pair",
            "CPU vs single",
            "etcd CPU us/pair",
            "client CPU us/pair",
        ],
        notes=[
            "each process its own Client, pairs one after another; pairs/s and CPU per pair: "
            "median round; latencies pooled; server CPU summed over the topology's members; "
            f"on {os.cpu_count()} cores the client processes share the CPUs with the servers, "
            "so pairs/s is bounded by the clients as much as by the servers",
            f"cluster shards per member: {members}",
        ],
    )
    for name, variant in itertools.product(TOPOLOGIES, VARIANTS):
        c, base = s[name, LOAD, variant], s[SINGLE, LOAD, variant]
        load.rows.append(
            [
                name,
                variant,
                fmt_num(c["pairs_per_s"], 0),
                fmt_num(c["p50_us"]),
                fmt_num(c["p99_us"]),
                fmt_num(c["cpu_us_per_pair"], 2),
                fmt_ratio(ratio(c["cpu_us_per_pair"], base["cpu_us_per_pair"])),
                fmt_num(c["etcd_cpu_us_per_pair"], 2) if name == CLUSTER else "-",
                fmt_num(c["client_cpu_us_per_pair"], 2),
            ]
        )
    run.add(load)
    run.add(where_it_goes(s, idle, micro_rows[0]))

    first = Table(
        f"The first acquire+release of a fresh Client (microseconds; {sizes.fresh} new clients "
        "per round)",
        [
            "topology",
            "first p50",
            "first p99",
            "second p50",
            "first minus single's first",
            "shards at the wire p50",
        ],
        notes=[
            "the first pair connects (and says hello) to the key's server; in cluster mode it "
            f"first fetches the shard map from a seed (`shards`: {p['shards_reply_bytes']:,} "
            "bytes) and builds the client's map; the second pair (another key) shows the "
            "steady cost on the same client; shards at the wire: the same request on a new "
            "connection (the member's answer and the transfer; the rest of the extra is the "
            "client's parsing and map building)",
        ],
    )
    for name in TOPOLOGIES:
        c = f[name]
        first.rows.append(
            [
                name,
                fmt_num(c["first_p50_us"]),
                fmt_num(c["first_p99_us"]),
                fmt_num(c["second_p50_us"]),
                fmt_num(c["first_p50_us"] - f[SINGLE]["first_p50_us"]),
                fmt_num(c["map_fetch_p50_us"]) if name == CLUSTER else "-",
            ]
        )
    run.add(first)

    quiet = Table(
        f"Idle: CPU used doing nothing ({sizes.idle_s:g} s, milliseconds per second)",
        ["topology", "servers", "etcd"],
        notes=["cluster members keep their etcd lease alive and watch the map"],
    )
    for name in TOPOLOGIES:
        quiet.rows.append(
            [
                name,
                fmt_num(idle[name]["servers_ms_per_s"], 2),
                fmt_num(idle[name]["etcd_ms_per_s"], 2) if name == CLUSTER else "-",
            ]
        )
    run.add(quiet)

    calls = Table(
        "What each mode adds per acquire, timed in-process (nanoseconds per call)",
        [
            "key bytes",
            "server check: single",
            "cluster (FNV-1a)",
            "static (crc32)",
            "client route: single",
            "cluster",
            "static",
            "FNV-1a alone",
            "crc32 alone",
        ],
        notes=[
            "server check: the ownership object's check(key) the server calls before an "
            "acquire-type request (single: none is called; shown for scale); client route: "
            "Client.server_for(key) with the map cached; FNV-1a is a Python loop over the key's "
            "bytes, so it grows with the key; best of 5",
        ],
    )
    for row in micro_rows:
        calls.rows.append(
            [
                str(row["key_len"]),
                *(fmt_num(row[f"server_{n}_ns"], 0) for n in TOPOLOGIES),
                *(fmt_num(row[f"client_{n}_ns"], 0) for n in TOPOLOGIES),
                fmt_num(row["fnv1a_ns"], 0),
                fmt_num(row["crc32_ns"], 0),
            ]
        )
    run.add(calls)

    sample = micro_rows[0]
    extra_load = {
        v: s[CLUSTER, LOAD, v]["cpu_us_per_pair"] - s[SINGLE, LOAD, v]["cpu_us_per_pair"]
        for v in VARIANTS
    }
    run.data = {
        "cells": [s[k] for k in cells],
        "fresh": f,
        "idle": idle,
        "micro": micro_rows,
        "summary": {
            "cpu_ratio_load": {
                n: {
                    v: ratio(
                        s[n, LOAD, v]["cpu_us_per_pair"], s[SINGLE, LOAD, v]["cpu_us_per_pair"]
                    )
                    for v in VARIANTS
                }
                for n in (CLUSTER, STATIC)
            },
            "cpu_ratio_one_client": {
                n: {
                    v: ratio(
                        s[n, LATENCY, v]["cpu_us_per_pair"],
                        s[SINGLE, LATENCY, v]["cpu_us_per_pair"],
                    )
                    for v in VARIANTS
                }
                for n in (CLUSTER, STATIC)
            },
            "p50_ratio_one_client": {
                n: {
                    v: ratio(s[n, LATENCY, v]["p50_us"], s[SINGLE, LATENCY, v]["p50_us"])
                    for v in VARIANTS
                }
                for n in (CLUSTER, STATIC)
            },
            "cluster_extra_cpu_us_per_pair_load": extra_load,
            "cluster_check_us": sample[f"server_{CLUSTER}_ns"] / 1000,
            "static_check_us": sample[f"server_{STATIC}_ns"] / 1000,
            "fresh_first_extra_us": {
                n: f[n]["first_p50_us"] - f[SINGLE]["first_p50_us"] for n in (CLUSTER, STATIC)
            },
        },
    }


def where_it_goes(
    s: dict[tuple[str, str, str], dict[str, Any]],
    idle: dict[str, dict[str, float]],
    sample: dict[str, Any],
) -> Table:
    """Cluster mode's extra server CPU per pair under load, split: what three processes cost
    whatever routes the keys (static members, the same spread) and what cluster mode adds on
    top, against what the micro-benchmark and the idle window account for."""
    check_us = sample[f"server_{CLUSTER}_ns"] / 1000
    table = Table(
        "Where cluster mode's extra server CPU per pair goes (load phase, microseconds per pair)",
        [
            "keys",
            "cluster - single",
            "static - single (3 processes)",
            "cluster - static (cluster's own)",
            "FNV-1a check (measured apart)",
            "idle work at this rate",
        ],
        notes=[
            "static members spread the same keys over three processes without any map: what "
            "they cost over one server is the price of three processes, not of cluster mode; "
            f"the FNV-1a check: the cluster column of the per-call table ({sample['key_len']}-byte "
            "key), once per pair (releases are not checked); idle work: the cluster members' "
            "idle CPU (ms/s) spread over the load's pairs/s",
        ],
    )
    for variant in VARIANTS:
        single, cluster, static = (s[name, LOAD, variant] for name in (SINGLE, CLUSTER, STATIC))
        idle_us = idle[CLUSTER]["servers_ms_per_s"] * 1000 / cluster["pairs_per_s"]
        table.rows.append(
            [
                variant,
                fmt_num(cluster["cpu_us_per_pair"] - single["cpu_us_per_pair"], 2),
                fmt_num(static["cpu_us_per_pair"] - single["cpu_us_per_pair"], 2),
                fmt_num(cluster["cpu_us_per_pair"] - static["cpu_us_per_pair"], 2),
                fmt_num(check_us, 2),
                fmt_num(idle_us, 2),
            ]
        )
    return table


# ------------------------------------------------------------------------------ main
def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(NAME, __doc__.split("\n", 1)[0] if __doc__ else NAME)
    parser.add_argument("--rounds", type=int, default=0, help="rounds, topologies rotating (5)")
    parser.add_argument("--pairs", type=int, default=0, help="one-client pairs per variant (800)")
    parser.add_argument("--seconds", type=float, default=0.0, help="load phase length (1.5)")
    parser.add_argument("--workers", type=int, default=0, help="client processes in the load (3)")
    parser.add_argument("--fresh", type=int, default=0, help="fresh clients per round (5)")
    parser.add_argument("--idle", type=float, default=0.0, help="idle window in seconds (3)")
    parser.add_argument(
        "--loop",
        default=available_loops()[-1],
        help="the servers' event loop (uvloop where installed)",
    )
    args = parser.parse_args(argv)
    if etcd_binary() is None:
        print("no etcd binary (install etcd-server, or set ETCD_BIN)", file=sys.stderr)
        return 2
    quick = bool(args.quick)
    sizes = Sizes(
        rounds=args.rounds or (1 if quick else 5),
        pairs=args.pairs or (40 if quick else 800),
        seconds=args.seconds or (0.2 if quick else 1.5),
        workers=args.workers or (2 if quick else 3),
        fresh=args.fresh or (2 if quick else 5),
        idle_s=args.idle or (0.2 if quick else 3.0),
        micro_calls=1_000 if quick else 50_000,
    )
    run = BenchRun(
        NAME,
        args,
        list(sys.argv[1:] if argv is None else argv),
        params={
            "loop": args.loop,
            "members": MEMBERS,
            **dataclasses.asdict(sizes),
            "reused_keys": REUSED_KEYS,
        },
    )
    cells = {
        (name, kind, variant): Cell(name, kind, variant)
        for name, kind, variant in itertools.product(TOPOLOGIES, (LATENCY, LOAD), VARIANTS)
    }
    fresh = {name: FreshCell() for name in TOPOLOGIES}
    fleet = Workers(sizes.workers)
    try:
        with workdir("dflock-bench-cluster-") as tmp, owned_servers() as servers:
            topologies = start_topologies(args.loop, tmp, servers)
            seed = next(t for t in topologies if t.name == CLUSTER).members[0]
            reply = request_line(seed, SHARDS)
            run.params["shards_per_member"] = shards_per_member(json.loads(reply[3:]))
            run.params["shards_reply_bytes"] = len(reply) + 1
            for t in topologies:  # warm-up: every worker's client connects to every member
                warm = [
                    Job(LATENCY, t.name, t.seeds, t.cluster, f"bench:{t.name}:warm:w{w}", pairs=50)
                    for w in range(sizes.workers)
                ]
                fleet.run(warm)
            idle = idle_cost(topologies, sizes.idle_s)
            for r in range(sizes.rounds):
                shift = r % len(topologies)
                for t in topologies[shift:] + topologies[:shift]:
                    one_round(fleet, t, r, sizes, cells)
                    fresh_round(fleet, t, r, sizes, fresh[t.name])
                print(f"round {r + 1}/{sizes.rounds} done", flush=True)
            micro_rows = micro(topologies, f"bench:{CLUSTER}:d:r0:w0:12345", sizes.micro_calls)
    finally:
        fleet.stop()
    report(
        run,
        cells=cells,
        fresh=fresh,
        idle=idle,
        micro_rows=micro_rows,
        topologies=topologies,
        sizes=sizes,
    )
    run.write()
    refused = sum(c.summary()["refused"] for c in cells.values())
    refused += sum(c.refused for c in fresh.values())
    if refused:
        print(f"{refused} acquire(s) refused on free keys", file=sys.stderr)
    return 1 if refused else 0


if __name__ == "__main__":
    raise SystemExit(main())
