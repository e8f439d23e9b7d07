"""A healthy client to watch the lock server while it is abused.

``HealthyClient(address)`` starts a separate process that loops acquire + release on its own
key, one cycle every ``CYCLE_INTERVAL_S``, and reports how long each cycle took (two round
trips). A separate process, not a thread: the abuse is generated in the test process, and a
thread there would measure the test process's GIL (a 5 ms switch interval) instead of the
server. The parent collects the samples: ``collect(n)`` returns the next ``n`` of them,
``window()`` every sample taken while its ``with`` block runs, and ``Phases`` splits them into
quiet and abuse spans that alternate::

    with HealthyClient(server.address, key="healthy") as healthy:
        phases = Phases(healthy)
        for wave in range(waves):
            phases.quiet_interlude()
            with phases.abuse():
                ...  # abuse the server
        assert_p99_within_bound(
            phases.quiet_latencies(), phases.abuse_latencies(), "the abuse"
        )

Any unexpected reply, a dropped connection or a reply slower than ``REPLY_TIMEOUT_S`` ends
the child with an ``error`` line; the parent then fails the test (``check()``, ``collect``,
leaving a window, ``stop()``). ``python healthy.py HOST PORT KEY [--cafile F]`` runs the loop
alone (the secret, if any, comes from ``DFLOCK_HEALTHY_SECRET``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

CYCLE_INTERVAL_S = 0.002
"""Pause between two acquire + release cycles (about 400 cycles, 800 requests a second)."""
REPLY_TIMEOUT_S = 10.0
LEASE_S = 30
SECRET_ENV = "DFLOCK_HEALTHY_SECRET"
START_TIMEOUT_S = 15.0
COLLECT_TIMEOUT_S = 60.0

P99_FLOOR_MS = 1.0
"""The smallest quiet p99 the 10x rule is applied to for the abuses that acceptance 3 does not
name (connection floods, waiters past the cap, over-long lines, auth brute force, bad TLS).
A quiet acquire + release on loopback takes 0.1-0.3 ms, and the p99 of that jitters by more
than 10x from one second to the next on this shared 2-core machine: one scheduler wake-up of
the server or of the healthy process, or a neighbouring test's burst, costs about a
millisecond, and these abuses keep the machine's kernel busy (thousands of connects, hundreds
of MiB of over-long lines). Slowloris and fuzzing, the two that acceptance 3 names, are held
to the letter: ``floor_ms=0``."""
ALLOWED_SLOWDOWN = 10.0
INTERLUDE_MIN = 10
INTERLUDE_MAX = 100
MIN_P99_SAMPLES = 200
"""Acceptance 3: under abuse the healthy p99 stays below this many times its quiet value."""


@dataclasses.dataclass(frozen=True)
class Latencies:
    """Acquire + release cycle times in milliseconds."""

    samples_ms: tuple[float, ...]

    def __len__(self) -> int:
        return len(self.samples_ms)

    def __add__(self, other: Latencies) -> Latencies:
        return Latencies(self.samples_ms + other.samples_ms)

    def percentile(self, q: float) -> float:
        """The nearest-rank ``q``-th percentile (0 < q <= 100)."""
        if not self.samples_ms:
            raise AssertionError("no latency samples were taken")
        ordered = sorted(self.samples_ms)
        rank = max(1, math.ceil(q / 100 * len(ordered)))
        return ordered[rank - 1]

    @property
    def p50(self) -> float:
        return self.percentile(50)

    @property
    def p99(self) -> float:
        return self.percentile(99)

    @property
    def max(self) -> float:
        return max(self.samples_ms)

    def summary(self) -> str:
        return f"p50 {self.p50:.2f} ms, p99 {self.p99:.2f} ms, max {self.max:.1f} ms, n={len(self)}"


def p99_bound_ms(quiet: Latencies, floor_ms: float = P99_FLOOR_MS) -> float:
    """The healthy p99 allowed under abuse: ``ALLOWED_SLOWDOWN * max(quiet p99, floor_ms)``."""
    return ALLOWED_SLOWDOWN * max(quiet.p99, floor_ms)


def assert_p99_within_bound(
    quiet: Latencies, under: Latencies, what: str, floor_ms: float = P99_FLOOR_MS
) -> None:
    """Acceptance 3 for one abuse: the p99 under it stays below the bound (both taken from
    at least ``MIN_P99_SAMPLES`` cycles, or a p99 would be a maximum)."""
    for name, latencies in (("quiet", quiet), (what, under)):
        assert len(latencies) >= MIN_P99_SAMPLES, (
            f"only {len(latencies)} healthy cycles {name}: too few for a p99"
        )
    bound = p99_bound_ms(quiet, floor_ms)
    assert under.p99 < bound, (
        f"healthy client under {what}: {under.summary()}; quiet {quiet.summary()}; "
        f"bound {bound:.2f} ms"
    )


def compare(quiet: Latencies, under: Latencies) -> str:
    """One phrase for the report's observed column."""
    return f"healthy p99 {quiet.p99:.2f} ms quiet -> {under.p99:.2f} ms under abuse"


class Window:
    """The samples a ``HealthyClient`` took between two points in time."""

    def __init__(self, client: HealthyClient, start: int) -> None:
        self._client = client
        self._start = start
        self._end: int | None = None

    def close(self) -> None:
        self._end = self._client.sample_count()

    def count(self) -> int:
        """Cycles completed in the window so far."""
        end = self._end if self._end is not None else self._client.sample_count()
        return end - self._start

    def latencies(self) -> Latencies:
        end = self._end if self._end is not None else self._client.sample_count()
        return self._client.samples(self._start, end)


class Phases:
    """A healthy client's cycles split into quiet and abuse spans that alternate.

    On a shared machine the background load drifts over seconds; quiet cycles taken only
    before an abuse can meet a calm machine while the abuse meets a neighbour's burst, and
    the other way round. Alternating short spans (``quiet_interlude()`` before each wave of
    abuse) exposes both to the same background, so their ratio measures the abuse::

        phases = Phases(healthy)
        for wave in range(waves):
            phases.quiet_interlude()
            with phases.abuse():
                ...  # one wave
        quiet, under = phases.quiet_latencies(), phases.abuse_latencies()
    """

    def __init__(self, client: HealthyClient) -> None:
        self._client = client
        self._quiet: list[tuple[int, int]] = []
        self._abuse: list[tuple[int, int]] = []
        self._open: int | None = None  # start of the abuse span under way

    def quiet(self, n: int) -> None:
        """Take ``n`` quiet cycles now (pausing the abuse span under way, if any)."""
        reopen = self._open is not None
        if reopen:
            self._close()
        start = self._client.sample_count()
        self._client.collect(n)
        self._quiet.append((start, start + n))
        if reopen:
            self._open = self._client.sample_count()

    def quiet_interlude(self) -> None:
        """As many quiet cycles as the last abuse span had (``INTERLUDE_MIN``-``_MAX``)."""
        last = self._abuse[-1][1] - self._abuse[-1][0] if self._abuse else INTERLUDE_MAX
        self.quiet(min(INTERLUDE_MAX, max(INTERLUDE_MIN, last)))

    @contextlib.contextmanager
    def abuse(self) -> Iterator[None]:
        """The cycles completed while the block runs count as under abuse."""
        self._open = self._client.sample_count()
        try:
            yield
        finally:
            self._close()

    def _close(self) -> None:
        assert self._open is not None
        self._abuse.append((self._open, self._client.sample_count()))
        self._open = None

    def _count(self, spans: list[tuple[int, int]], open_start: int | None) -> int:
        done = sum(end - start for start, end in spans)
        return done + (self._client.sample_count() - open_start if open_start is not None else 0)

    def quiet_count(self) -> int:
        return self._count(self._quiet, None)

    def abuse_count(self) -> int:
        return self._count(self._abuse, self._open)

    def _latencies(self, spans: list[tuple[int, int]]) -> Latencies:
        out = Latencies(())
        for start, end in spans:
            out += self._client.samples(start, end)
        return out

    def quiet_latencies(self) -> Latencies:
        return self._latencies(self._quiet)

    def abuse_latencies(self) -> Latencies:
        return self._latencies(self._abuse)


class HealthyClient:
    """Handle on the healthy-client process (see the module docstring)."""

    def __init__(
        self,
        address: tuple[str, int],
        *,
        key: str = "healthy",
        secret: str | None = None,
        cafile: Path | None = None,
    ) -> None:
        self.address = address
        self.key = key
        self._secret = secret
        self._cafile = cafile
        self._samples: list[float] = []
        self._errors: list[str] = []
        self._cond = threading.Condition()
        self._eof = False
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> HealthyClient:
        """Start the process and wait for its first cycle."""
        host, port = self.address
        args = [sys.executable, str(Path(__file__).resolve()), host, str(port), self.key]
        if self._cafile is not None:
            args += ["--cafile", str(self._cafile)]
        env = dict(os.environ)
        env.pop(SECRET_ENV, None)
        if self._secret is not None:
            env[SECRET_ENV] = self._secret
        self._proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        from tests.support.processes import favour

        favour(self._proc.pid)  # its latency is what the abuse tests judge
        self._reader = threading.Thread(target=self._read, name="healthy-reader", daemon=True)
        self._reader.start()
        self._wait_for(1, START_TIMEOUT_S)
        return self

    def stop(self) -> None:
        """End the loop (closing its stdin) and fail if it reported an error."""
        proc = self._proc
        if proc is None:
            return
        if proc.stdin is not None and not proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()
        try:
            code = proc.wait(REPLY_TIMEOUT_S + 5)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait(10)
        if self._reader is not None:
            self._reader.join(10)
        if proc.stdout is not None:
            proc.stdout.close()
        self._proc = None
        self.check()
        assert code == 0, f"healthy client exited with {code}"

    def __enter__(self) -> HealthyClient:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.stop()
        else:  # do not hide the test's own failure behind ours
            with contextlib.suppress(AssertionError):
                self.stop()

    # ------------------------------------------------------------------ samples
    def _read(self) -> None:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        for line in proc.stdout:
            with self._cond:
                if line.startswith("cycle "):
                    self._samples.append(int(line.split()[1]) / 1e6)
                else:
                    self._errors.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def check(self) -> None:
        """Fail if the healthy client has reported a problem."""
        with self._cond:
            if self._errors:
                raise AssertionError(f"healthy client failed: {' | '.join(self._errors)}")

    def sample_count(self) -> int:
        with self._cond:
            return len(self._samples)

    def samples(self, start: int, end: int) -> Latencies:
        self.check()
        with self._cond:
            return Latencies(tuple(self._samples[start:end]))

    def _wait_for(self, count: int, timeout: float) -> None:
        with self._cond:
            done = self._cond.wait_for(
                lambda: len(self._samples) >= count or self._errors or self._eof, timeout
            )
        self.check()
        if not done or self.sample_count() < count:
            raise AssertionError(
                f"healthy client took {self.sample_count()} of {count} samples in {timeout} s"
            )

    def collect(self, n: int) -> Latencies:
        """The next ``n`` cycles (blocks until they are done)."""
        start = self.sample_count()
        self._wait_for(start + n, COLLECT_TIMEOUT_S)
        return self.samples(start, start + n)

    @contextlib.contextmanager
    def window(self) -> Iterator[Window]:
        """Every cycle completed while the block runs."""
        win = Window(self, self.sample_count())
        try:
            yield win
        finally:
            win.close()
        self.check()


# ---------------------------------------------------------------------- the child process
class _Line:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = sock.makefile("rb")

    def req(self, cmd: str, key: str, arg: str) -> str:
        self.sock.sendall(f"{cmd}\n{key}\n{arg}\n".encode())
        line = self.reader.readline()
        if not line.endswith(b"\n"):
            raise ConnectionError(f"connection closed by the server (read {line!r})")
        return line[:-1].decode()


def _connect(host: str, port: int, cafile: str | None) -> _Line:
    sock = socket.create_connection((host, port), timeout=REPLY_TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if cafile is not None:
        sock = ssl.create_default_context(cafile=cafile).wrap_socket(sock, server_hostname=host)
    return _Line(sock)


def _loop(conn: _Line, key: str, stop: threading.Event) -> None:
    while not stop.is_set():
        t0 = time.perf_counter_ns()
        grant = conn.req("l", key, f"{int(REPLY_TIMEOUT_S)} {LEASE_S}").split()
        if len(grant) != 3 or grant[0] != "ok":
            raise AssertionError(f"acquire got {grant}")
        released = conn.req("r", key, grant[1])
        if released != "ok":
            raise AssertionError(f"release got {released!r}")
        elapsed = time.perf_counter_ns() - t0
        print(f"cycle {elapsed}", flush=True)
        stop.wait(CYCLE_INTERVAL_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="loop acquire + release, print cycle times")
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("key")
    parser.add_argument("--cafile")
    args = parser.parse_args(argv)
    stop = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.read()  # returns when the parent closes our stdin
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    try:
        conn = _connect(args.host, args.port, args.cafile)
        secret = os.environ.get(SECRET_ENV)
        if secret is not None:
            reply = conn.req("auth", "_", secret)
            if reply != "ok":
                raise AssertionError(f"auth got {reply!r}")
        _loop(conn, args.key, stop)
    except (OSError, AssertionError, ValueError) as exc:
        print(f"error {type(exc).__name__}: {exc}", flush=True)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
