"""Test helpers that talk to a server over a plain socket, independently of the client."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

from celery_dflock import protocol


def raw_request(address: tuple[str, int], request: bytes, timeout: float = 10.0) -> bytes:
    """Send one request on a fresh connection and return the reply line (without newline)."""
    with socket.create_connection(address, timeout=timeout) as sock:
        sock.sendall(request)
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"server closed the connection after {data!r}")
            data += chunk
    return data[:-1]


def stats(address: tuple[str, int]) -> dict[str, object]:
    """The server's ``stats`` JSON."""
    line = raw_request(address, protocol.encode_stats())
    assert line.startswith(b"ok "), line
    return cast(dict[str, object], json.loads(line[3:]))


def held_keys(address: tuple[str, int]) -> set[str]:
    """Keys of the locks currently held on that server."""
    locks = cast(list[dict[str, object]], stats(address)["locks"])
    return {str(entry["key"]) for entry in locks}


def holders_and_waiters(
    address: tuple[str, int], key: str, semaphore: bool = False
) -> tuple[int, int]:
    """(holders, waiters) of a lock or semaphore key, as the server's ``stats`` shows them."""
    section = "semaphores" if semaphore else "locks"
    for entry in cast(list[dict[str, object]], stats(address)[section]):
        if entry["key"] == key:
            held = cast(int, entry["holders"]) if semaphore else 1
            return held, cast(int, entry["waiters"])
    return 0, 0


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Poll ``predicate`` (server state that cannot be awaited) until true, or fail."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(0.01)


def connection_count(address: tuple[str, int]) -> int:
    """Connections the server counts (including the one asking)."""
    return cast(int, stats(address)["connections"])


def release_behind_its_back(
    address: tuple[str, int], key: str, token: str, semaphore: bool = False
) -> None:
    """Release ``token`` from another connection (tokens are bearer credentials)."""
    encode = protocol.encode_sem_release if semaphore else protocol.encode_release
    assert raw_request(address, encode(key, token)) == b"ok"


FORK_CHILD_TIMEOUT_S = 20.0


def run_in_fork(
    child: Callable[[], dict[str, object]], timeout: float = FORK_CHILD_TIMEOUT_S
) -> tuple[int, dict[str, object]]:
    """Run ``child()`` in a forked child; its exit code and the dict it returned (as JSON).

    An exception in the child is reported as ``{"error": repr(exc)}`` with exit code 1.
    """
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads
        pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child, reported through the pipe
        code = 1
        try:
            os.close(read_fd)
            report = child()
            code = 0
        except BaseException as exc:
            report = {"error": repr(exc)}
        try:
            os.write(write_fd, json.dumps(report).encode())
        finally:
            os._exit(code)
    os.close(write_fd)
    data = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([read_fd], [], [], deadline - time.monotonic())
            if not ready:
                break
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            data += chunk
        while (waited := os.waitpid(pid, os.WNOHANG)) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise AssertionError("the forked child did not finish")
            time.sleep(0.01)
    finally:
        os.close(read_fd)
    return os.waitstatus_to_exitcode(waited[1]), json.loads(data or b"{}")


@contextmanager
def dflockd_subprocess(
    log_path: Path, *args: str
) -> Iterator[tuple[subprocess.Popen[bytes], tuple[str, int]]]:
    """A real ``dflockd`` subprocess on a free local port (it can be SIGSTOPped or killed),
    with extra command-line ``args``; its process and address. Killed on exit."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    script = Path(sys.executable).parent / "dflockd"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLOCKD_")}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                str(script),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--restart-grace",
                "0",
                *args,
            ],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        address = ("127.0.0.1", port)

        def listening() -> bool:
            try:
                socket.create_connection(address, timeout=0.5).close()
            except OSError:
                return False
            return True

        try:
            wait_until(listening, timeout=15.0, what="dflockd listening")
            yield proc, address
        finally:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(10)
