"""What an acquire+release pair costs in instructions, counted by callgrind: figures that do
not move with whatever else the machine runs.

    uv run python -m benchmarks.instructions            # every target, 1,000 pairs each
    uv run python -m benchmarks.instructions --quick    # smoke: one short run per target

The timing benchmarks (``server``, ``celery_tasks``) move by tens of percent between runs on a
shared 2-core machine; an instruction count of the same build doing the same pairs moves by
well under 1%. So this is the benchmark to decide a change to a hot path by, and the timing
ones say what it is worth. Each target runs twice under ``valgrind --tool=callgrind`` (the
process's user-space instructions): ``--base`` pairs, then ``--base`` + ``--pairs`` pairs; the
difference divided by ``--pairs`` is the cost of one pair, start-up and shut-down left out.
What it does not count: the kernel (system calls, the loopback network, which are most of a
round trip's CPU here) and what an instruction costs (cache misses); the timing benchmarks do.

Servers, one connection; the server under callgrind, driven by a plain socket client outside
it, the same for every server:

* dflockd on each loop (its compiled build on each too, unless ``--quick``), its lease
  journal on as users run it: ``l`` + ``r`` round trips, ``hl`` with an owner note + ``r``
  (what each LockedTask run sends), and ``l`` + ``r`` pipelined 16 deep (``benchmarks.server``'s
  pipelined load; not in ``--quick``);
* Redis: ``SET key token NX PX`` + a compare-and-delete script by ``EVALSHA`` (what redis-py's
  Lock sends), round trips and pipelined.

Clients, the client process under callgrind, the server outside it: a plain socket loop (the
floor: ``l`` + ``r``), ``celery_dflock.Client.lock`` (as ``with client.lock(key): ...``, the
renewal scheduled and cancelled, the connection pooled), redis-py's ``Lock`` against Redis.

Celery task runs, the process running them under callgrind (``--pairs``/2 runs over
``--base``/2): ``benchmarks.celery_app``'s plain task, its LockedTask and its task taking
redis-py's ``Lock``, each by Celery's ``apply()`` (the tracer, signals and the task's
``__call__`` a pool process runs). What a LockedTask run adds to a plain one in the worker,
beside what redis-py's Lock adds; not in ``--quick`` (Celery's start-up under callgrind
is about 40 s a count).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks import _codec
from benchmarks._codec import RELEASE, TRY_LOCK
from benchmarks._common import (
    REPO,
    BenchRun,
    LineClient,
    ServerProcess,
    Table,
    available_loops,
    base_parser,
    default_loops,
    dflockd_command,
    fmt_num,
    fmt_ratio,
    owned_servers,
    ratio,
    resp,
    split_build,
    start_dflockd,
    start_redis,
    workdir,
)

NAME = "instructions"
START_UNDER_VALGRIND_S = 120.0
"""A Python server starts 20-50 times slower under callgrind."""
NOTE = "03a309e9-ee62-413a-80bd-049e40478dd4/celery%40worker-1"
"""An owner note of the shape LockedTask sends (the task id, then the worker)."""
LEASE_S = 33
RELEASE_SCRIPT = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
)
"""Delete the key only while it holds the caller's token: the release a Redis lock needs."""
_TOTAL = re.compile(rb"^(?:summary|totals): (\d+)", re.M)


def valgrind() -> str:
    found = shutil.which("valgrind")
    if found is None:
        raise SystemExit(
            "benchmarks.instructions counts with valgrind's callgrind, which is not installed "
            "(Debian: apt-get install valgrind)"
        )
    return found


def callgrind(out: Path) -> list[str]:
    return [valgrind(), "--tool=callgrind", f"--callgrind-out-file={out}"]


def total(out: Path) -> int:
    """The instructions a callgrind output file counted."""
    match = _TOTAL.search(out.read_bytes())
    if match is None:
        raise RuntimeError(f"no instruction total in {out}")
    return int(match.group(1))


# ------------------------------------------------------------------ the server-side drivers
def dflockd_pairs(acquire: str, depth: int = 1) -> Callable[[ServerProcess, str, int], None]:
    """``acquire`` ``l``, ``hl`` (with an owner note) or ``sl`` (a slot of a semaphore), then
    its release. ``depth`` 1: round trips, a new key per pair. More: as ``benchmarks.server``'s
    pipelined load, ``depth`` acquires on the connection's own keys in one write, then their
    releases (``n`` a multiple of ``depth``)."""

    def drive(server: ServerProcess, prefix: str, n: int) -> None:
        wire = LineClient(server)
        try:
            if depth > 1:
                keys = [b"%s:%d" % (prefix.encode(), i) for i in range(depth)]
                acquires = b"".join(TRY_LOCK % key for key in keys)
                for _ in range(n // depth):
                    wire.sock.sendall(acquires)
                    tokens = [line.split()[1] for line in wire.lines(depth)]
                    releases = zip(keys, tokens, strict=True)
                    wire.sock.sendall(b"".join(RELEASE % kt for kt in releases))
                    if wire.lines(depth) != [b"ok"] * depth:
                        raise RuntimeError("release refused")
                return
            request = {
                "l": _codec.lock(0, LEASE_S),
                "hl": _codec.hold(LEASE_S, NOTE),
                "sl": _codec.sem_lock(SEMAPHORE_LIMIT, LEASE_S),
            }[acquire]
            release = _codec.SEM_RELEASE if acquire == "sl" else RELEASE
            for i in range(n):
                key = b"%s:%d" % (prefix.encode(), i)
                reply = wire.call(request % key).split()
                if reply[0] != b"ok":
                    raise RuntimeError(f"acquire refused: {reply!r}")
                if wire.call(release % (key, reply[1])) != b"ok":
                    raise RuntimeError("release refused")
        finally:
            wire.close()

    return drive


def redis_pairs(depth: int = 1) -> Callable[[ServerProcess, str, int], None]:
    """As ``dflockd_pairs``, with redis-py ``Lock``'s commands."""

    def drive(server: ServerProcess, prefix: str, n: int) -> None:
        wire = LineClient(server)
        try:
            sha = wire.call(resp(b"SCRIPT", b"LOAD", RELEASE_SCRIPT.encode()))  # "$40", then it
            if not sha.startswith(b"$"):
                raise RuntimeError(f"SCRIPT LOAD refused: {sha!r}")
            digest = wire.lines(1)[0].rstrip(b"\r")
            ttl = b"%d" % (LEASE_S * 1000)
            if depth > 1:
                keys = [b"%s:%d" % (prefix.encode(), i) for i in range(depth)]
                for batch in range(n // depth):
                    tokens = [b"%032x" % (batch * depth + i) for i in range(depth)]
                    pairs = list(zip(keys, tokens, strict=True))
                    wire.sock.sendall(
                        b"".join(resp(b"SET", k, t, b"NX", b"PX", ttl) for k, t in pairs)
                    )
                    if wire.lines(depth) != [b"+OK\r"] * depth:
                        raise RuntimeError("SET NX refused")
                    wire.sock.sendall(
                        b"".join(resp(b"EVALSHA", digest, b"1", k, t) for k, t in pairs)
                    )
                    if wire.lines(depth) != [b":1\r"] * depth:
                        raise RuntimeError("release script refused")
                return
            for i in range(n):
                key, token = b"%s:%d" % (prefix.encode(), i), b"%032x" % i
                if wire.call(resp(b"SET", key, token, b"NX", b"PX", ttl)) != b"+OK\r":
                    raise RuntimeError("SET NX refused")
                if wire.call(resp(b"EVALSHA", digest, b"1", key, token)) != b":1\r":
                    raise RuntimeError("release script refused")
        finally:
            wire.close()

    return drive


PIPELINE = 16
"""The pipelined forms' depth, ``benchmarks.server``'s."""
SEMAPHORE_LIMIT = 4
FORMS = (
    ("l + r", "l", 1),
    ("hl + r", "hl", 1),
    (f"l + r, {PIPELINE} pipelined", "l", PIPELINE),
)
"""dflockd's request pairs: (label, acquire, depth)."""
AB_FORMS = (*FORMS, ("sl + sr", "sl", 1))
"""The A/B's pairs: ``FORMS`` and a semaphore's."""
REDIS_FORMS = (("SET NX PX + EVALSHA", 1), (f"SET NX PX + EVALSHA, {PIPELINE} pipelined", PIPELINE))


# ------------------------------------------------------------------ the client-side loops
CLIENT_LOOPS = {
    "plain socket (l + r)": (
        "import socket, sys\n"
        "host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])\n"
        "s = socket.create_connection((host, port))\n"
        "s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
        "for i in range(n):\n"
        "    s.sendall(b'l\\nk-%d\\n0\\n' % i)\n"
        "    token = s.recv(100).split()[1]\n"
        "    s.sendall(b'r\\nk-%d\\n%s\\n' % (i, token))\n"
        "    s.recv(100)\n"
    ),
    "celery_dflock Client.lock": (
        "import sys\n"
        "from celery_dflock import Client\n"
        "host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])\n"
        "client = Client([(host, port)])\n"
        "for i in range(n):\n"
        "    with client.lock(f'k-{i}'):\n"
        "        pass\n"
        "client.close()\n"
    ),
    "redis-py Lock": (
        "import sys\n"
        "import redis\n"
        "host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])\n"
        f"r = redis.Redis(host=host, port=port)\n"
        "for i in range(n):\n"
        f"    with r.lock(f'k-{{i}}', timeout={LEASE_S}):\n"
        "        pass\n"
        "r.close()\n"
    ),
}


TASK_LOOP = (
    "import json, os, sys\n"
    "task, host, port, redis_url, log, n = sys.argv[1:7]\n"
    "os.environ['DFLOCK_BENCH_LOG'] = log\n"
    "os.environ['DFLOCK_BENCH_REDIS_LOCK_URL'] = redis_url\n"
    "os.environ['DFLOCK_BENCH_SETTINGS'] = json.dumps({'broker_url': 'memory://',\n"
    "    'task_ignore_result': True, 'dflock_servers': f'{host}:{port}'})\n"
    "from benchmarks import celery_app\n"
    "run = celery_app.app.tasks[task].apply\n"
    "run(args=(10**9,))  # the first run: the task's plan, the connections\n"
    "for i in range(int(n)):\n"
    "    run(args=(i,))\n"
)
"""One process running a ``benchmarks.celery_app`` task ``n`` times with Celery's ``apply()``
(the tracer, signals and ``LockedTask.__call__`` a worker runs, without the broker)."""
TASKS = {
    "plain task": "bench.plain",
    "LockedTask": "bench.locked",
    "redis-py Lock in the task": "bench.redis_lock",
}
"""The task runs counted in the worker's process: ``benchmarks.celery_tasks``' variants."""


@dataclass
class Counted:
    target: str
    per_pair: float
    base: int
    longer: int


def _lengths(base: int, pairs: int) -> tuple[int, ...]:
    """The run lengths: ``base`` and ``base + pairs``; ``base`` 0 (``--quick``): one run of
    ``pairs``, its start-up counted in (a smoke test's figure, meaning nothing)."""
    return (pairs,) if base == 0 else (base, base + pairs)


def _counted(label: str, totals: list[int], pairs: int) -> Counted:
    if len(totals) == 1:
        return Counted(label, totals[0] / pairs, 0, totals[0])
    return Counted(label, (totals[1] - totals[0]) / pairs, *totals)


def count_server(
    label: str,
    start: Callable[[list[str]], ServerProcess],
    drive: Callable[[ServerProcess, str, int], None],
    tmp: Path,
    *,
    base: int,
    pairs: int,
) -> Counted:
    totals: list[int] = []
    for n in _lengths(base, pairs):
        out = tmp / f"callgrind.{re.sub(r'[^A-Za-z0-9]+', '-', label)}.{n}"
        with owned_servers() as servers:
            server = start(callgrind(out))
            servers.append(server)
            drive(server, "dflock-bench:instructions", n)
            server.stop()  # SIGTERM: the server exits and callgrind writes its file
        totals.append(total(out))
    return _counted(label, totals, pairs)


def _count_python(
    label: str, argv: list[str], tmp: Path, *, base: int, runs: int, timeout: float
) -> Counted:
    """Instructions per run of ``python -c <argv...> <n>`` under callgrind: run with ``base``
    and with ``base + runs`` as ``n``, the difference over ``runs``."""
    totals: list[int] = []
    for n in _lengths(base, runs):
        out = tmp / f"callgrind.python.{re.sub(r'[^A-Za-z0-9]+', '-', label)}.{n}"
        command = [*callgrind(out), sys.executable, "-c", *argv, str(n)]
        subprocess.run(command, check=True, capture_output=True, timeout=timeout, cwd=REPO)
        totals.append(total(out))
    return _counted(label, totals, runs)


def count_client(label: str, server: ServerProcess, tmp: Path, base: int, pairs: int) -> Counted:
    argv = [CLIENT_LOOPS[label], server.host, str(server.port)]
    return _count_python(label, argv, tmp, base=base, runs=pairs, timeout=600)


def count_task(
    label: str,
    servers: tuple[ServerProcess, ServerProcess],
    tmp: Path,
    *,
    base: int,
    runs: int,
) -> Counted:
    """Instructions per run of ``TASKS[label]`` in the process that runs it; ``servers``:
    dflockd and the Redis holding redis-py's locks."""
    dflockd, redis_server = servers
    redis_url = f"redis://{redis_server.host}:{redis_server.port}/0"
    argv = [TASK_LOOP, TASKS[label], dflockd.host, str(dflockd.port), redis_url]
    argv.append(str(tmp / "bodies.log"))
    return _count_python(label, argv, tmp, base=base, runs=runs, timeout=900)


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    parser = base_parser(NAME, __doc__.split("\n", 1)[0] if __doc__ else NAME)
    parser.add_argument("--pairs", type=int, default=0, help="pairs counted (the difference)")
    parser.add_argument(
        "--base",
        type=int,
        default=-1,
        help="pairs of the shorter run (0: one run, start-up counted in; --quick's)",
    )
    args = parser.parse_args(args_in)
    valgrind()
    pairs = args.pairs or (100 if args.quick else 1000)
    base = args.base if args.base >= 0 else (0 if args.quick else 200)
    loops = ["uvloop"] if args.quick else default_loops(quick=False)
    forms = FORMS[:1] if args.quick else FORMS
    client_loops = list(CLIENT_LOOPS)[:2] if args.quick else list(CLIENT_LOOPS)
    task_runs, task_base = pairs // 2, base // 2
    # Not in --quick: a task run under callgrind starts Celery first (about 40 s of the smoke
    # test for one count); the full run counts all three.
    tasks: list[str] = [] if args.quick else list(TASKS)
    run = BenchRun(
        NAME,
        args,
        args_in,
        params={
            "pairs": pairs,
            "base": base,
            "loops": loops,
            "clients": client_loops,
            "task_runs": task_runs,
            "task_base": task_base,
            "tasks": tasks,
        },
    )
    with workdir("dflock-bench-instructions-") as tmp:
        servers: list[Counted] = []
        depths: dict[str, int] = {}
        for loop in loops:
            for form, acquire, depth in forms:

                def start(wrapper: list[str], loop: str = loop) -> ServerProcess:
                    return start_dflockd(
                        loop,
                        tmp,
                        command=[*wrapper, *dflockd_command(split_build(loop)[0])],
                        start_timeout_s=START_UNDER_VALGRIND_S,
                    )

                label = f"dflockd ({loop}) {form}"
                servers.append(
                    count_server(
                        label,
                        start,
                        dflockd_pairs(acquire, depth),
                        tmp,
                        base=base - base % depth,
                        pairs=pairs - pairs % depth,
                    )
                )
                depths[label] = depth
                print(f"{label}: {servers[-1].per_pair:,.0f} per pair", flush=True)

        def start_redis_counted(wrapper: list[str]) -> ServerProcess:
            return start_redis(tmp, wrapper=wrapper, start_timeout_s=START_UNDER_VALGRIND_S)

        redis_by_depth: dict[int, Counted] = {}
        for form, depth in REDIS_FORMS if len(forms) > 1 else REDIS_FORMS[:1]:
            label = f"redis {form}"
            redis_by_depth[depth] = count_server(
                label,
                start_redis_counted,
                redis_pairs(depth),
                tmp,
                base=base - base % depth,
                pairs=pairs - pairs % depth,
            )
            depths[label] = depth
            servers.append(redis_by_depth[depth])
            print(f"{label}: {servers[-1].per_pair:,.0f} per pair", flush=True)
        table = Table(
            "Server: instructions per acquire+release pair (callgrind, user space, one connection)",
            ["server and requests", "instructions per pair", "/ redis, same shape"],
            notes=[
                (
                    f"the difference of {base:,} and {base + pairs:,} pairs (rounded down to "
                    f"a multiple of {PIPELINE} when pipelined), divided by their difference"
                    if base
                    else f"one run of {pairs:,} pairs, start-up included (a smoke test's)"
                )
                + "; "
                "dflockd with its lease journal on (everysec); round trips on a new key per "
                f"pair; hl: with an owner note of {len(NOTE)} bytes, as each LockedTask run "
                f"sends; pipelined: {PIPELINE} acquires on the connection's own keys in one "
                "write, then their releases, as benchmarks.server's pipelined load; the "
                "kernel's share is not counted",
            ],
        )
        for c in servers:
            same = redis_by_depth[depths[c.target]]
            table.rows.append(
                [c.target, fmt_num(c.per_pair, 0), fmt_ratio(ratio(c.per_pair, same.per_pair))]
            )
        run.add(table)

        clients: list[Counted] = []
        with owned_servers() as running:
            dflockd = start_dflockd("uvloop" if "uvloop" in available_loops() else "asyncio", tmp)
            running.append(dflockd)
            redis_server = start_redis(tmp)
            running.append(redis_server)
            for label in client_loops:
                target = redis_server if label.startswith("redis") else dflockd
                clients.append(count_client(label, target, tmp, base, pairs))
                print(f"{label}: {clients[-1].per_pair:,.0f} per pair", flush=True)
            task_counts: list[Counted] = []
            for label in tasks:
                task_counts.append(
                    count_task(label, (dflockd, redis_server), tmp, base=task_base, runs=task_runs)
                )
                print(f"{label}: {task_counts[-1].per_pair:,.0f} per run", flush=True)
        floor = clients[0].per_pair
        table = Table(
            "Client: instructions per acquire+release pair in the client process (callgrind, "
            "user space)",
            ["client", "instructions per pair", "/ plain socket"],
            notes=[
                "the server runs outside callgrind; celery_dflock's and redis-py's lock each "
                "wait for the grant, then release; the plain socket loop is the floor of "
                "sending two requests and reading two replies from Python",
            ],
        )
        for c in clients:
            table.rows.append(
                [c.target, fmt_num(c.per_pair, 0), fmt_ratio(ratio(c.per_pair, floor))]
            )
        run.add(table)
        if task_counts:
            plain = task_counts[0]  # TASKS' first: the plain task
            table = Table(
                "Celery task runs: instructions per run in the process that runs the task "
                "(callgrind, user space)",
                ["task", "instructions per run", "over a plain task's run"],
                notes=[
                    f"the difference of {task_base:,} and {task_base + task_runs:,} runs, "
                    "divided by their difference; Celery's apply() of benchmarks.celery_app's "
                    "tasks (what a worker's pool process runs for a message, without the "
                    "broker): LockedTask with lock_key per run on dflockd (uvloop), redis-py's "
                    "Lock on a redis-server; the lock servers run outside callgrind",
                ],
            )
            for c in task_counts:
                over = "-" if c is plain else fmt_num(c.per_pair - plain.per_pair, 0)
                table.rows.append([c.target, fmt_num(c.per_pair, 0), over])
            run.add(table)
        run.data = {
            "servers": {c.target: c.per_pair for c in servers},
            "clients": {c.target: c.per_pair for c in clients},
            "tasks": {c.target: c.per_pair for c in task_counts},
            "totals": {c.target: [c.base, c.longer] for c in (*servers, *clients, *task_counts)},
        }
    run.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
