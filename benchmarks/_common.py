"""What every benchmark shares: server subprocesses it owns, /proc readings, tables, results.

Linux only: CPU time and memory are read from ``/proc/<pid>`` of processes the benchmark
started itself (a ``dflockd`` or ``redis-server`` child), so the figures are the server's own
and not the load generator's.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import http.client
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 15.0
POLL_S = 0.02
LOOPS = ("asyncio", "uvloop")
"""The event loops the bundled server runs on (uvloop when installed, asyncio otherwise)."""
GO_SERVER = "dflockd Go"
"""The label of dflockd's Go server, measured beside ours where a benchmark is given its
binary (``--dflockd-go``)."""


def available_loops() -> tuple[str, ...]:
    """``LOOPS`` without uvloop where it is not installed."""
    if importlib.util.find_spec("uvloop") is None:
        return LOOPS[:1]
    return LOOPS


_LISTENING = re.compile(r"listening on (\S+):(\d+) \(.*loop (\w+)[,)]")
_NO_UVLOOP_BOOT = (
    "import sys\n"
    "sys.modules['uvloop'] = None  # import uvloop now fails: the server picks asyncio's loop\n"
    "from dflockd_server.cli import main\n"
    "main(sys.argv[1:])\n"
)


# ---------------------------------------------------------------------------- /proc readings
def cpu_ns(pid: int) -> int:
    """CPU time of every live thread of ``pid`` in nanoseconds (``/proc/<pid>/task/*/schedstat``).

    Falls back to utime + stime of ``/proc/<pid>/stat`` (10 ms resolution) where schedstat
    is missing.
    """
    total = 0
    found = False
    with contextlib.suppress(FileNotFoundError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as fh:
                    total += int(fh.read().split()[0])
                found = True
    if found:
        return total
    return stat_cpu_ns(pid)


def _stat_ticks(pid: int, first: int) -> int:
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    ticks = int(fields[first]) + int(fields[first + 1])
    return ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def stat_cpu_ns(pid: int) -> int:
    """CPU time of ``pid``, threads that have ended included (utime + stime of
    ``/proc/<pid>/stat``, 10 ms resolution). ``cpu_ns`` sums the live threads only: over a
    long window the difference is what short-lived threads (dflockd's everysec fsync) used."""
    return _stat_ticks(pid, 11)


def children_cpu_ns(pid: int) -> int:
    """CPU time of the children ``pid`` has forked and reaped (cutime + cstime of
    ``/proc/<pid>/stat``, 10 ms resolution): Redis's AOF rewrites, which its own CPU time
    leaves out."""
    return _stat_ticks(pid, 13)


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (``VmRSS`` of ``/proc/<pid>/status``)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def written_bytes(pid: int) -> int:
    """Bytes ``pid`` sent towards the disk (``write_bytes`` of ``/proc/<pid>/io``: the page
    cache it dirtied, fsynced or not); -1 where the kernel does not account it."""
    try:
        with open(f"/proc/{pid}/io", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def raise_fd_limit(wanted: int) -> int:
    """Raise this process's open-file limit towards ``wanted`` (children inherit it).

    Returns the soft limit in force afterwards (may be below ``wanted`` if the hard limit
    cannot be raised).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= wanted:
        return soft
    target = wanted
    if hard != resource.RLIM_INFINITY and hard < wanted:
        try:  # only a privileged process may raise the hard limit
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, wanted))
            return wanted
        except (ValueError, OSError):
            target = hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct free local ports, each bound until all are chosen (ports asked for
    one after another, each released first, may repeat)."""
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


# ---------------------------------------------------------------------------- server children
@dataclass
class ServerProcess:
    """A lock server subprocess this benchmark started (and alone stops)."""

    label: str
    proc: subprocess.Popen[bytes]
    host: str
    port: int
    log_path: Path
    state_dir: Path | None = None
    """Where it keeps its state: dflockd's ``--state-dir`` (the lease journal), Redis's
    ``--dir`` (its append-only file); None when it keeps none."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_ns(self) -> int:
        return cpu_ns(self.proc.pid)

    def rss(self) -> int:
        return rss_bytes(self.proc.pid)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``STOP_TIMEOUT_S``."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)


COMPILED_SUFFIX = "+mypyc"
"""A loop name ending so (``uvloop+mypyc``) runs the server built as its compiled wheel
(server/hatch_build.py), whose request path mypyc compiled."""


def default_loops(quick: bool) -> list[str]:
    """Both event loops, the pure-Python server (the workspace's editable install; what a
    ``pip install`` builds without a C compiler) and, but in a quick run, the compiled one
    (what ``pip install`` and the container image run) on each."""
    loops = list(available_loops())
    return loops if quick else [*loops, *(loop + COMPILED_SUFFIX for loop in loops)]


def split_build(loop: str) -> tuple[str, bool]:
    """``uvloop+mypyc`` -> (``uvloop``, True); ``uvloop`` -> (``uvloop``, False)."""
    if loop.endswith(COMPILED_SUFFIX):
        return loop.removesuffix(COMPILED_SUFFIX), True
    return loop, False


def compiled_site(workdir: Path) -> Path:
    """The compiled wheel of this checkout's server, built (once per ``workdir``) as
    docs/server.md says and unpacked: a folder to put first on ``PYTHONPATH``."""
    site = workdir / "mypyc-site"
    if site.is_dir():
        return site
    dist = workdir / "mypyc-dist"
    env = {**os.environ, "DFLOCKD_SERVER_BUILD": "compiled"}  # no compiler: an error
    command = ["uv", "build", "--package", "dflockd-server", "--wheel", "--out-dir", str(dist)]
    command += ["--python", sys.executable]  # for the CPython the benchmark runs on
    print("building the compiled server wheel (mypyc, about a minute)", flush=True)
    subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True)
    (wheel,) = dist.glob("dflockd_server-*.whl")
    partial = workdir / "mypyc-site.partial"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(partial)
    probe = subprocess.run(
        [sys.executable, "-c", "import dflockd_server.dispatch as d; print(d.__file__)"],
        env={**os.environ, "PYTHONPATH": str(partial)},
        capture_output=True,
        text=True,
        check=True,
    )
    if not probe.stdout.strip().endswith(str(sysconfig.get_config_var("EXT_SUFFIX"))):
        raise RuntimeError(f"the compiled wheel's dispatch is not compiled: {probe.stdout}")
    partial.rename(site)
    return site


def dflockd_command(loop: str) -> list[str]:
    """The command that runs the real ``dflockd`` entry point on ``loop``.

    ``uvloop``: the ``dflockd`` console script (it uses uvloop when installed). ``asyncio``:
    the same entry point (``dflockd_server.cli:main``) with uvloop made unimportable, which is
    exactly how the server runs where uvloop is not installed.
    """
    if loop == "uvloop":
        script = Path(sys.executable).parent / "dflockd"
        if not script.exists():
            raise RuntimeError(f"the dflockd console script is missing at {script}; run uv sync")
        return [str(script)]
    if loop == "asyncio":
        return [sys.executable, "-c", _NO_UVLOOP_BOOT]
    raise ValueError(f"unknown loop {loop!r}; expected one of {LOOPS}")


def start_dflockd(
    loop: str,
    workdir: Path,
    *extra_args: str,
    command: list[str] | None = None,
    journal: bool = True,
    journal_fsync: str | None = None,
    cpu: int | None = None,
    start_timeout_s: float = START_TIMEOUT_S,
) -> ServerProcess:
    """Start ``dflockd`` on 127.0.0.1 (free port) on ``loop`` (on the one CPU ``cpu``, if
    given: ``on_cpu``); returns once it listens.

    As users run it: with a state directory, so its lease journal is on (a fresh directory in
    ``workdir``, ``--state-dir``), fsyncing at the server's default unless ``journal_fsync``
    says otherwise. ``journal=False``: no state at all (``--state-dir none``), for what
    measures the journal's cost. ``command`` replaces the ``dflockd`` command (it must take
    dflockd's flags and log like it).
    """
    stamp = time.monotonic_ns()
    log_path = workdir / f"dflockd-{loop}-{stamp}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLOCKD_")}
    label = f"dflockd ({loop})"
    loop, compiled = split_build(loop)
    if compiled:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(compiled_site(workdir)), *filter(None, [env.get("PYTHONPATH")])]
        )
    state_dir: Path | None = None
    if journal:
        state_dir = workdir / f"dflockd-state-{loop}-{stamp}"
        state = ["--state-dir", str(state_dir)]
        if journal_fsync is not None:
            state += ["--journal-fsync", journal_fsync]
    elif journal_fsync is not None:
        raise ValueError("journal_fsync needs journal=True")
    else:
        state = ["--state-dir", "none"]
    args = ["--host", "127.0.0.1", "--port", "0", "--log-level", "info", *state, *extra_args]
    argv = [*(command or dflockd_command(loop)), *args]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            argv if cpu is None else on_cpu(cpu, argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    server = ServerProcess(label, proc, "127.0.0.1", 0, log_path, state_dir)
    deadline = time.monotonic() + start_timeout_s
    while True:
        match = _LISTENING.search(server.log_tail(100_000))
        if match:
            if match.group(3) != loop:
                server.stop()
                raise RuntimeError(f"dflockd started on loop {match.group(3)!r}, not {loop!r}")
            server.port = int(match.group(2))
            return server
        if not server.alive() or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"{label} did not start:\n{server.log_tail()}")
        time.sleep(POLL_S)


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


def start_redis(
    workdir: Path,
    *,
    maxclients: int = 10_000,
    appendfsync: str | None = None,
    wrapper: Sequence[str] = (),
    start_timeout_s: float = START_TIMEOUT_S,
) -> ServerProcess:
    """Start a private ``redis-server`` on a free port; returns once it answers.

    No persistence, unless ``appendfsync`` (``always``, ``everysec`` or ``no``): then its
    append-only file is on (``--appendonly yes --appendfsync <it>``, Redis's own settings
    otherwise), in a fresh directory in ``workdir``. Never an RDB snapshot. ``wrapper``: a
    command the server runs under (``valgrind ...``).
    """
    binary = redis_server_binary()
    if binary is None:
        raise RuntimeError("redis-server is not on PATH (the benchmarks compare against it)")
    tail = ""
    for _attempt in range(5):
        port = free_port()
        log_path = workdir / f"redis-{port}.log"
        data_dir: Path | None = None
        persistence = ["--appendonly", "no"]
        if appendfsync is not None:
            data_dir = workdir / f"redis-data-{port}"
            data_dir.mkdir()
            persistence = ["--appendonly", "yes", "--appendfsync", appendfsync]
            persistence += ["--dir", str(data_dir)]
        # Redis needs maxclients + 32 descriptors.
        raise_fd_limit(maxclients + 64)
        proc = subprocess.Popen(
            [
                *wrapper,
                binary,
                "--bind",
                "127.0.0.1",
                "--port",
                str(port),
                "--save",
                "",
                *persistence,
                "--daemonize",
                "no",
                "--maxclients",
                str(maxclients),
                "--logfile",
                str(log_path),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        server = ServerProcess("redis", proc, "127.0.0.1", port, log_path, data_dir)
        deadline = time.monotonic() + start_timeout_s
        while server.alive() and time.monotonic() < deadline:
            if redis_ping(server.host, port):
                return server
            time.sleep(POLL_S)
        tail = server.log_tail()
        server.stop()  # port taken in the meantime, or it did not come up: try another port
    raise RuntimeError(f"redis-server did not start:\n{tail}")


_ON_CPU = (
    "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); "
    "os.execvp(sys.argv[2], sys.argv[2:])"
)
"""What ``on_cpu`` runs before the command: the affinity, then the command in its place."""


def on_cpu(cpu: int, command: list[str]) -> list[str]:
    """``command`` run confined to the one CPU ``cpu`` (its affinity set before it starts, so
    a Go program's runtime sees one CPU and sizes GOMAXPROCS to it; threads inherit it)."""
    return [sys.executable, "-c", _ON_CPU, str(cpu), *command]


def start_dflockd_go(
    binary: str,
    workdir: Path,
    *,
    max_locks: int,
    cpu: int | None = None,
    start_timeout_s: float = START_TIMEOUT_S,
) -> ServerProcess:
    """Start dflockd's Go server (a binary the user built, ``--dflockd-go``) on a free
    127.0.0.1 port with ``--max-locks`` (on the one CPU ``cpu``, if given: ``on_cpu``); returns
    once it accepts a connection. It has no lease journal: it keeps nothing across a restart."""
    tail = ""
    for _attempt in range(5):
        port = free_port()
        log_path = workdir / f"dflockd-go-{port}.log"
        command = [binary, "--host", "127.0.0.1", "--port", str(port)]
        command += ["--max-locks", str(max_locks)]
        if cpu is not None:
            command = on_cpu(cpu, command)
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        server = ServerProcess(GO_SERVER, proc, "127.0.0.1", port, log_path)
        deadline = time.monotonic() + start_timeout_s
        while server.alive() and time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                return server
            time.sleep(POLL_S)
        tail = server.log_tail()
        server.stop()  # port taken in the meantime, or it did not come up: try another port
    raise RuntimeError(f"--dflockd-go: {binary} did not start:\n{tail}")


def etcd_binary() -> str | None:
    """The etcd server binary: ``ETCD_BIN``, else ``etcd`` on PATH (None: not installed)."""
    return os.environ.get("ETCD_BIN") or shutil.which("etcd")


def _etcd_healthy(port: int) -> bool:
    """etcd's ``/health`` on 127.0.0.1:``port`` says it is."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
    try:
        try:
            conn.request("GET", "/health")
            response = conn.getresponse()
            body = json.loads(response.read())
        finally:
            conn.close()
    except (OSError, ValueError, http.client.HTTPException):
        return False
    return response.status == 200 and isinstance(body, dict) and body.get("health") == "true"


def start_etcd(workdir: Path) -> ServerProcess:
    """Start a private single-member etcd on free 127.0.0.1 ports (its data under ``workdir``);
    returns once its ``/health`` answers. ``port`` is the client port."""
    binary = etcd_binary()
    if binary is None:
        raise RuntimeError("no etcd binary (install etcd-server, or set ETCD_BIN)")
    tail = ""
    for attempt in range(5):
        client_port, peer_port = free_ports(2)
        url = f"http://127.0.0.1:{client_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        log_path = workdir / f"etcd-{client_port}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [
                    binary,
                    "--name=bench",
                    f"--data-dir={workdir / f'etcd-data-{attempt}'}",
                    f"--listen-client-urls={url}",
                    f"--advertise-client-urls={url}",
                    f"--listen-peer-urls={peer_url}",
                    f"--initial-advertise-peer-urls={peer_url}",
                    f"--initial-cluster=bench={peer_url}",
                    "--initial-cluster-state=new",
                    "--logger=zap",
                    "--log-outputs=stderr",
                    "--log-level=warn",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        server = ServerProcess("etcd", proc, "127.0.0.1", client_port, log_path)
        deadline = time.monotonic() + START_TIMEOUT_S
        while server.alive() and time.monotonic() < deadline:
            if _etcd_healthy(client_port):
                return server
            time.sleep(POLL_S * 5)
        tail = server.log_tail()
        server.stop()  # a port taken in the meantime, or it did not come up: try others
    raise RuntimeError(f"etcd did not start:\n{tail}")


def redis_ping(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def resp(*parts: bytes) -> bytes:
    """A Redis command in RESP (an array of bulk strings)."""
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


def read_line(sock: socket.socket, buf: bytearray) -> bytes:
    """The next line from ``sock`` (without its end), what came after it kept in ``buf``."""
    while b"\n" not in buf:
        data = sock.recv(1 << 16)
        if not data:
            raise ConnectionError("the server closed the connection")
        buf += data
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return line


class LineClient:
    """A blocking client for both protocols, reading replies line by line (a dflockd reply is
    one line; a Redis reply to the commands used here is one, or a bulk string's two)."""

    def __init__(self, server: ServerProcess, timeout_s: float = 60.0) -> None:
        self.sock = socket.create_connection((server.host, server.port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def lines(self, n: int) -> list[bytes]:
        buf = self.buf
        while buf.count(b"\n") < n:
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("the server closed the connection")
            buf += data
        parts = buf.split(b"\n", n)
        self.buf = parts.pop()
        return parts

    def call(self, request: bytes) -> bytes:
        """Send ``request``; its reply's first line."""
        self.sock.sendall(request)
        return self.lines(1)[0]

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def workdir(prefix: str) -> Iterator[Path]:
    """A temporary directory for logs of this run (removed afterwards)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def owned_servers() -> Iterator[list[ServerProcess]]:
    """A list to put started servers in; every one is stopped on the way out."""
    servers: list[ServerProcess] = []
    try:
        yield servers
    finally:
        for server in reversed(servers):
            server.stop()


# ---------------------------------------------------------------------------- machine
def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def redis_server_version() -> str:
    binary = redis_server_binary()
    if binary is None:
        return "not installed"
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    match = re.search(r"v=(\S+)", out.stdout)
    return match.group(1) if match else out.stdout.strip()


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    return {
        "cores": os.cpu_count(),
        "cpu": cpu_model(),
        "kernel": f"{platform.system()} {platform.release()}",
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "versions": {
            "celery-dflock": _version("celery-dflock"),
            "dflockd-server": _version("dflockd-server"),
            "uvloop": _version("uvloop"),
            "celery": _version("celery"),
            "kombu": _version("kombu"),
            "redis-py": _version("redis"),
            "redis-server": redis_server_version(),
        },
    }


# ---------------------------------------------------------------------------- statistics
def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of already sorted values; NaN when empty."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), round(q / 100 * len(sorted_values) + 0.5)))
    return float(sorted_values[rank - 1])


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def ratio(ours: float, theirs: float) -> float:
    return ours / theirs if theirs else float("nan")


def fmt_num(value: float, digits: int = 1) -> str:
    if math.isnan(value):
        return "n/a"
    if abs(round(value, digits)) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def fmt_ratio(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}x"


# ---------------------------------------------------------------------------- tables, goals
@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list[list[str]])
    notes: list[str] = field(default_factory=list[str])

    def render_text(self) -> str:
        widths = [len(c) for c in self.columns]
        for row in self.rows:
            widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
        line = "  ".join("-" * w for w in widths)
        out = [self.title, line]
        out.append("  ".join(c.ljust(w) for c, w in zip(self.columns, widths, strict=True)))
        out.append(line)
        for row in self.rows:
            out.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
        out.append(line)
        out.extend(f"  {note}" for note in self.notes)
        return "\n".join(out)


@dataclass
class Goal:
    """One of the issue's goals, decided from the figures of this run."""

    goal: str
    measured: str
    met: bool
    detail: str = ""


@dataclass
class BenchRun:
    """Collects one benchmark's tables, goals and raw figures, then writes its results file."""

    name: str
    args: argparse.Namespace
    argv: list[str]
    params: dict[str, Any]
    tables: list[Table] = field(default_factory=list[Table])
    goals: list[Goal] = field(default_factory=list[Goal])
    data: dict[str, Any] = field(default_factory=dict[str, Any])
    started: float = field(default_factory=time.time)
    load_start: tuple[float, float, float] = field(default_factory=os.getloadavg)

    def add(self, table: Table) -> None:
        self.tables.append(table)
        print(table.render_text(), end="\n\n", flush=True)

    def command(self) -> str:
        return " ".join(["uv run python -m", f"benchmarks.{self.name}", *self.argv]).strip()

    def write(self, *, with_same_run: bool = False) -> Path:
        """Write the results file. ``with_same_run``: a benchmark run in parts (``contention``
        and ``contention --only busy``) keeps what an earlier part of the same run id wrote
        there, but for the tables and goals this part measured again."""
        finished = time.time()
        results_dir = Path(self.args.results_dir)
        results_dir.mkdir(parents=True, exist_ok=True)
        path = results_dir / f"{self.name}.json"
        earlier: dict[str, Any] = {}
        if with_same_run and path.exists():
            earlier = json.loads(path.read_text())
            if earlier.get("run_id") != self.args.run_id or not self.args.run_id:
                earlier = {}
        payload = {
            "benchmark": self.name,
            "run_id": self.args.run_id,
            "command": self.command(),
            "quick": bool(self.args.quick),
            "started": _iso(self.started),
            "finished": _iso(finished),
            "duration_s": round(finished - self.started, 1),
            "loadavg_start": [round(x, 2) for x in self.load_start],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
            "machine": machine_info(),
            "params": self.params,
            "tables": [asdict(t) for t in self.tables],
            "goals": [asdict(g) for g in self.goals],
            "data": self.data,
        }
        if earlier:
            titles = {t.title for t in self.tables}
            goals = {g.goal for g in self.goals}
            payload["command"] = f"{earlier['command']}; {payload['command']}"
            payload["started"] = earlier["started"]
            payload["loadavg_start"] = earlier["loadavg_start"]
            payload["params"] = {**earlier["params"], **self.params}
            payload["tables"] = [
                *(t for t in earlier["tables"] if t["title"] not in titles),
                *payload["tables"],
            ]
            payload["goals"] = [
                *(g for g in earlier["goals"] if g["goal"] not in goals),
                *payload["goals"],
            ]
            payload["data"] = {**earlier["data"], **self.data}
        path.write_text(json.dumps(payload, indent=1) + "\n")
        for goal in self.goals:
            verdict = "MET" if goal.met else "NOT MET"
            print(f"goal: {goal.goal}: {goal.measured} -> {verdict}")
        print(f"{self.name}: {payload['duration_s']} s; results in {path}", flush=True)
        return path


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def base_parser(name: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=description)
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes (seconds): the smoke test's run"
    )
    parser.add_argument(
        "--results-dir",
        default=str(RESULTS_DIR),
        help=f"where to write {name}.json (default: benchmarks/results)",
    )
    parser.add_argument(
        "--run-id", default="", help="label shared by the benchmarks of one run (run_all sets it)"
    )
    return parser
