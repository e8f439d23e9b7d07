"""Bad input over real sockets. Each case gets PROTOCOL.md's reply (or a close), a second
client keeps being served, and a lock held by another client is left alone."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from dflockd_server import constants
from dflockd_server.testing import ServerThread
from tests.support.waiting import wait_until
from tests.support.wire import Wire

ServerFactory = Callable[..., ServerThread]


@dataclass
class Scene:
    server: ServerThread
    victim: Wire
    token: str

    def assert_undisturbed(self) -> None:
        """The server still serves a fresh client, and the victim still holds its lock."""
        with Wire(self.server.address) as fresh:
            assert fresh.req("ping") == "ok"
            assert fresh.req("l", "victim-lock", "0") == "timeout"
        assert self.victim.req("n", "victim-lock", f"{self.token} 60") == "ok 60"


@pytest.fixture
def scene(dflock_server_factory: ServerFactory) -> Iterator[Scene]:
    # No per-connection or per-address cap: one connection fills the table to make stats
    # replies large.
    server = dflock_server_factory(
        write_timeout_s=1.0, max_locks_per_connection=0, max_locks_per_ip=0
    )
    with Wire(server.address) as victim:
        token = victim.lock("victim-lock", lease=60)
        yield Scene(server, victim, token)


MALFORMED = [
    pytest.param("nope", "k", "1", id="unknown-command"),
    pytest.param("L", "k", "1", id="command-is-case-sensitive"),
    pytest.param("l", "k", "abc", id="non-integer-timeout"),
    pytest.param("l", "k", "1.5", id="fractional-timeout"),
    pytest.param("l", "k", "-1", id="negative-timeout"),
    pytest.param("l", "k", "+1", id="signed-timeout"),
    pytest.param("l", "k", "9000000001", id="huge-timeout"),
    pytest.param("l", "k", "9" * 200, id="enormous-timeout"),
    pytest.param("l", "k", "1 0", id="zero-lease"),
    pytest.param("l", "k", "1 -5", id="negative-lease"),
    pytest.param("l", "k", "1 9000000001", id="huge-lease"),
    pytest.param("l", "k", "", id="missing-timeout"),
    pytest.param("l", "k", "1 2 3", id="too-many-arguments"),
    pytest.param("l", "", "1", id="empty-key"),
    pytest.param("l", " ", "1", id="space-key"),
    pytest.param("l", "a b", "1", id="key-with-space"),
    pytest.param("l", "a\tb", "1", id="key-with-tab"),
    pytest.param("n", "k", "", id="renew-without-token"),
    pytest.param("n", "k", "tok x", id="renew-bad-lease"),
    pytest.param("r", "k", "", id="release-without-token"),
    pytest.param("r", "k", "a b", id="release-two-tokens"),
    pytest.param("e", "k", "x", id="enqueue-bad-lease"),
    pytest.param("e", "k", "1 2", id="enqueue-two-arguments"),
    pytest.param("w", "k", "", id="wait-without-timeout"),
    pytest.param("w", "k", "-1", id="wait-negative-timeout"),
    pytest.param("sl", "s", "1", id="semaphore-without-limit"),
    pytest.param("sl", "s", "1 0", id="semaphore-zero-limit"),
    pytest.param("sl", "s", f"1 {constants.MAX_SEMAPHORE_LIMIT + 1}", id="semaphore-limit-too-big"),
    pytest.param("se", "s", "", id="semaphore-enqueue-without-limit"),
    pytest.param("sw", "s", "x", id="semaphore-wait-bad-timeout"),
    pytest.param("sn", "s", "", id="semaphore-renew-without-token"),
    pytest.param("sr", "s", "", id="semaphore-release-without-token"),
]


@pytest.mark.parametrize(("cmd", "key", "arg"), MALFORMED)
def test_malformed_request_gets_error_and_stays_open(
    scene: Scene, cmd: str, key: str, arg: str
) -> None:
    with Wire(scene.server.address) as bad:
        assert bad.req(cmd, key, arg) == "error"
        assert bad.req("ping") == "ok"  # still in step
    scene.assert_undisturbed()


def test_largest_number_is_accepted(scene: Scene) -> None:
    longest = constants.DEFAULT_MAX_LEASE_TTL_S
    with Wire(scene.server.address) as w:
        assert w.req("l", "big", f"{constants.MAX_NUMBER} {longest}").startswith("ok ")


def test_a_lease_above_max_lease_ttl_is_a_bad_number(scene: Scene) -> None:
    longest = constants.DEFAULT_MAX_LEASE_TTL_S
    with Wire(scene.server.address) as w:
        for command, arg in (("l", f"0 {longest + 1}"), ("e", f"{longest + 1}")):
            assert w.req(command, "long", arg) == "error"
        assert w.req("sl", "long", f"0 2 {constants.MAX_NUMBER}") == "error"
        token = w.lock("long")
        assert w.req("n", "long", f"{token} {longest + 1}") == "error"
        assert w.req("n", "long", f"{token} {longest}") == f"ok {longest}"
        assert w.req("ping") == "ok"  # the connection stays open, in step


def test_invalid_utf8_is_malformed_and_keeps_the_connection(scene: Scene) -> None:
    with Wire(scene.server.address) as bad:
        bad.send_raw(b"l\n\xff\xfekey\n1\n")
        assert bad.recv() == "error"
        bad.send_raw(b"\xc3\x28\n_\n_\n")
        assert bad.recv() == "error"
        bad.send_raw(b"r\nvictim-lock\n\xe2\x82\n")
        assert bad.recv() == "error"
        assert bad.req("ping") == "ok"
    scene.assert_undisturbed()


def test_invalid_utf8_is_malformed_in_requests_without_a_key(scene: Scene) -> None:
    """``ping``, ``hello``, ``stats`` and ``shards`` read neither line much, but their lines
    are UTF-8 text all the same: refused as every other command's are, the connection kept."""
    with Wire(scene.server.address) as bad:
        for command in (b"ping", b"hello", b"stats", b"shards"):
            for key, arg in ((b"\xff", b"_"), (b"_", b"\xc3\x28"), (b"_", b"session \xff")):
                bad.send_raw(b"%s\n%s\n%s\n" % (command, key, arg))
                assert bad.recv() == "error", (command, key, arg)
        assert bad.req("ping") == "ok"
        assert bad.req("stats").startswith("ok ")
    scene.assert_undisturbed()


def test_utf8_key_and_crlf_lines_are_fine(scene: Scene) -> None:
    with Wire(scene.server.address) as w:
        w.send_raw("l\r\nschlüssel\r\n0\r\n".encode())
        status, token, _ = w.recv().split()
        assert status == "ok"
        assert w.req("r", "schlüssel", token) == "ok"


def test_line_over_256_bytes_gets_error_and_close(scene: Scene) -> None:
    with Wire(scene.server.address) as bad:
        bad.send("l", "k" * 300, "1")
        assert bad.recv() == "error"
        assert bad.closed_by_server()
    with Wire(scene.server.address) as ok:
        key = "k" * constants.MAX_LINE_BYTES  # exactly at the limit is allowed
        assert ok.req("l", key, "0").startswith("ok ")
    scene.assert_undisturbed()


def test_megabyte_line_without_newline_is_cut_off(scene: Scene) -> None:
    with Wire(scene.server.address) as bad:
        # The server may hang up while we are still sending: that is a close too.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            bad.send_raw(b"x" * (1 << 20))
        try:
            reply = bad.reader.readline()
        except ConnectionResetError:
            reply = b""
        assert reply in (b"error\n", b"")
        assert bad.closed_by_server()
    scene.assert_undisturbed()


def test_disconnect_mid_request(scene: Scene) -> None:
    for partial in (b"l", b"l\n", b"l\nvictim-lock", b"l\nvictim-lock\n", b"l\nvictim-lock\n5"):
        bad = Wire(scene.server.address)
        bad.send_raw(partial)
        bad.close()
    scene.assert_undisturbed()


def test_half_sent_request_is_completed_later(scene: Scene) -> None:
    with Wire(scene.server.address) as slow:
        for byte in b"l\nslow\n0\n":
            slow.send_raw(bytes([byte]))
        assert slow.recv().startswith("ok ")


def _hold_keys(filler: Wire, n_keys: int, name_bytes: int) -> None:
    """Hold ``n_keys`` keys with names of about ``name_bytes`` (large stats replies)."""
    name = "x" * name_bytes
    filler.send_raw(b"".join(f"l\n{i:04d}{name}\n0\n".encode() for i in range(n_keys)))
    for _ in range(n_keys):
        assert filler.recv().startswith("ok ")


def _reads_little() -> socket.socket:
    """A socket, not yet connected, whose own kernel buffers little of what it is sent."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    return sock


def test_client_that_never_reads_is_dropped(scene: Scene) -> None:
    address = scene.server.address
    # Make every stats reply large: hold many keys with long names.
    with Wire(address) as filler:
        _hold_keys(filler, 900, name_bytes=200)
        stuck = _reads_little()
        stuck.connect(address)
        stuck.sendall(b"l\nstuck-lock\n0 3\n")
        assert stuck.recv(64).startswith(b"ok ")
        # ~200 replies of ~250 KB each, never read: far beyond any socket buffer.
        stuck.sendall(b"stats\n_\n_\n" * 200)
        with Wire(address) as healthy:
            assert healthy.req("ping") == "ok"
            # The server drops the stuck client (write timeout, 1 s): its own act, which frees
            # nothing early (issue 47), so the lock is granted once its 3 s lease has run out.
            assert healthy.req("l", "stuck-lock", "10").startswith("ok ")
        stuck.close()
    scene.assert_undisturbed()


def test_a_client_that_never_reads_a_150_kb_reply_is_dropped(scene: Scene) -> None:
    # Unread replies must not hide in kernel buffers: those are bounded (SOCKET_BUFFER_BYTES),
    # so a reply of 150 KB that is never read passes the user-space threshold (64 KiB) and the
    # write timeout drops the connection, whatever follows it (here an acquire that would
    # wait). Before, the reply sat below the old 256 KiB threshold and the connection stayed.
    address = scene.server.address
    with Wire(address) as filler:
        _hold_keys(filler, 1000, name_bytes=60)
        token = filler.lock("busy-key")
        before = len(scene.server.server.admission.connections)
        stuck = _reads_little()
        try:
            stuck.connect(address)
            # One stats reply of ~150 KB (below the old 256 KiB threshold), then an acquire
            # that waits; never reading.
            stuck.sendall(b"stats\n_\n_\nl\nbusy-key\n60\n")
            connections = scene.server.server.admission.connections
            wait_until(lambda: len(connections) == before + 1, what="the connection counted")
            wait_until(
                lambda: len(connections) == before,
                what="the server to drop the connection that does not read (write timeout 1 s)",
            )
        finally:
            stuck.close()
        assert filler.req("r", "busy-key", token) == "ok"
    scene.assert_undisturbed()


def test_a_half_closed_connection_gets_every_reply_before_the_close(scene: Scene) -> None:
    """1,000 pipelined requests then EOF (shutdown SHUT_WR): every one is answered (a pass
    answers at most MAX_REQUESTS_PER_PASS; the rest used to be dropped with the connection),
    and only then is the connection closed. (Whether a waiting acquire among them is tried once
    or dropped depends on whether the EOF arrived before the server reached it: a wait in
    flight at the EOF is dropped with the connection, as a killed client's is.)"""
    with socket.create_connection(scene.server.address, timeout=10) as sock:
        sock.sendall(b"ping\n_\n_\n" * 1000 + b"l\nvictim-lock\n0\n")
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    lines = data.decode().splitlines()
    assert lines[:1000] == ["ok"] * 1000
    assert lines[1000:] == ["timeout"]  # the victim holds it
    scene.assert_undisturbed()
