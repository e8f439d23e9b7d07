"""A lock cluster on a three-node etcd (issue 27): ``--cluster`` lists every etcd endpoint, and
one etcd node killed (kill -9: the node the members talk to, or raft's leader) or paused
(SIGSTOP: it keeps its connections open and answers nothing) fences no member and loses no
lock. Also TLS to etcd (``etcds://``, ``--cluster-ca-file``) and etcd's authentication
(``--cluster-user``, ``--cluster-password-file``), with the start-up errors a wrong setting gets.

The members are real ``dflockd`` processes with the shipped defaults (a 5 s etcd lease, so each
etcd endpoint is given a second before the next is tried). A member that fences logs
"fenced, granting nothing" and, when etcd answers again, "joined again" under a new etcd lease:
the tests read those events (the logs, and the member's lease in etcd), not the clock. The
window they watch is two whole etcd leases after the fault: without keep-alives reaching the
etcd quorum through another endpoint, each member's lease would have run out in it.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dflockd_server import constants
from dflockd_server.cluster.etcd import EtcdClient, EtcdError, prefix_end
from dflockd_server.cluster.shardmap import shard_id
from tests.support.certificates import key_of, make_certificate
from tests.support.etcd import EtcdCluster, EtcdNode, etcd_cluster_or_skip, lease_time_to_live
from tests.support.fleet import Fleet, Member
from tests.support.ports import free_port
from tests.support.servers import rebalance, run_dflockd
from tests.support.shards import pin
from tests.support.waiting import wait_until
from tests.support.wire import Wire, held_keys, shards

PREFIX = "/ha"
LEASE_S = constants.DEFAULT_CLUSTER_LEASE_TTL_S
"""The members' etcd lease: the shipped default."""
WAIT_S = 60.0
LOCK_LEASE_S = 120
KEYS_PER_MEMBER = 4
FENCED = "fenced, granting nothing"
REJOINED = "joined again"


def served_keys(member: Member, stem: str, count: int) -> list[str]:
    """``count`` keys ``STEM<n>`` that ``member`` serves, by its own ``shards`` answer."""
    info = shards(member.address)
    nodes: list[str] = info["nodes"]
    current: list[int] = info["current"]
    out: list[str] = []
    for i in range(10**6):
        key = f"{stem}{i}"
        index = current[shard_id(key)]
        if index >= 0 and nodes[index] == member.advertise:
            out.append(key)
            if len(out) == count:
                return out
    raise AssertionError(f"{member.advertise} serves no key {stem}*")


def _every_view(members: list[Member], check: Callable[[dict[str, Any], list[str]], bool]) -> bool:
    """``check(info, names)`` holds for every member's ``shards`` answer (one read each)."""
    names = sorted(m.advertise for m in members)
    return all(check(shards(member.address), names) for member in members)


def _sees_all(info: dict[str, Any], names: list[str]) -> bool:
    return info.get("members") == names and bool(info.get("leader"))


def _mapped(info: dict[str, Any], names: list[str]) -> bool:
    return _sees_all(info, names) and all(i >= 0 for i in info["current"])


def _settled(info: dict[str, Any], names: list[str]) -> bool:
    nodes: list[str] = info["nodes"]
    return (
        _mapped(info, names)
        and not info["moving"]
        and sorted({nodes[i] for i in info["current"]}) == names
    )


def mapped(members: list[Member]) -> bool:
    """Every member sees all of them, a leader, and every shard served by some member: the
    leader has written the first map."""
    return _every_view(members, _mapped)


def settled(members: list[Member]) -> bool:
    """As ``mapped``, with no shard moving and every member serving shards (so each has keys
    of its own for the tests to hold)."""
    return _every_view(members, _settled)


def member_lease(etcd: EtcdClient, member: Member) -> int:
    kv = etcd.get(f"{PREFIX}/members/{member.advertise}")
    assert kv is not None, f"{member.advertise} is not registered in etcd"
    return kv.lease


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    yield from etcd_cluster_or_skip(tmp_path / "etcd")


@pytest.fixture
def cluster(etcd_cluster: EtcdCluster, tmp_path: Path) -> Iterator[list[Member]]:
    url = f"etcd://{etcd_cluster.endpoints}{PREFIX}"
    with Fleet(etcd_cluster.client(), PREFIX, tmp_path / "state", url) as fleet:
        members = [fleet.start(), fleet.start()]
        # The first map goes to the members registered when membership has been still for a
        # moment (two seconds); a member that starts later (a loaded machine) joins with no
        # shard until membership has been still for 10 s (the leader rebalances then) or an
        # operator rebalances. So the test does what they do, once the first map is there (a
        # no-op when it names both).
        wait_until(lambda: mapped(members), timeout=WAIT_S, what="the first map")
        rebalance(url, WAIT_S)
        wait_until(lambda: settled(members), timeout=WAIT_S, what="the cluster's map")
        yield members


Held = dict[str, tuple[Wire, str, Member]]
"""Locks a test holds: key -> its connection, token, member."""


@pytest.fixture
def held() -> Iterator[Held]:
    """The test's held locks, their connections closed however the test ends."""
    locks: Held = {}
    yield locks
    for wire, _, _ in locks.values():
        wire.close()


def hold_locks(members: list[Member], held: Held) -> None:
    """``KEYS_PER_MEMBER`` locks held on each member, into ``held``."""
    for n, member in enumerate(members):
        for key in served_keys(member, f"held{n}:", KEYS_PER_MEMBER):
            wire = Wire(member.address)
            held[key] = (wire, "", member)  # closed by the fixture even if the lock fails
            held[key] = (wire, wire.lock(key, lease=LOCK_LEASE_S), member)


def outlive_the_lease(etcd: EtcdClient, members: list[Member], leases: dict[str, int]) -> None:
    """Wait two etcd leases from now, then: each member still holds the etcd lease it had
    before the fault, alive (it never lost it, so it never fenced)."""
    until = time.monotonic() + 2 * LEASE_S
    wait_until(lambda: time.monotonic() > until, timeout=WAIT_S, what="two etcd leases")
    for member in members:
        said = "\n".join(member.log()[-60:])  # its own account, for a failure's report
        assert member_lease(etcd, member) == leases[member.advertise], (
            f"{member.advertise}:\n{said}"
        )
        left = lease_time_to_live(etcd, leases[member.advertise])
        assert left > 0, f"{member.advertise}:\n{said}"


def assert_nothing_lost(members: list[Member], held: Held) -> None:
    for member in members:
        lines = member.log()
        assert not [line for line in lines if FENCED in line or REJOINED in line], lines
    for key, (wire, token, member) in held.items():
        assert key in held_keys(member.address), key
        assert wire.req("n", key, f"{token} {LOCK_LEASE_S}") == f"ok {LOCK_LEASE_S}", key
    for n, member in enumerate(members):
        for key in served_keys(member, f"new{n}:", 2):
            with Wire(member.address) as wire:
                token = wire.lock(key, lease=5)
                assert wire.req("r", key, token) == "ok", key


def switched_away_from(member: Member, node: EtcdNode) -> bool:
    return any(f"etcd endpoint {node.address} failed" in line for line in member.log())


@pytest.mark.parametrize("victim", ["used", "leader"])
def test_one_etcd_node_killed_fences_no_member_and_loses_no_lock(
    etcd_cluster: EtcdCluster, cluster: list[Member], held: Held, victim: str
) -> None:
    """Acceptance 5: kill -9 of the etcd node the members talk to (the first listed), or of
    raft's leader: every member fails over to another endpoint in time, none fences, every held
    lock is still held and renewable, and new keys are granted."""
    members = cluster
    etcd = etcd_cluster.client()
    leases = {m.advertise: member_lease(etcd, m) for m in members}
    hold_locks(members, held)
    node = etcd_cluster.nodes[0] if victim == "used" else etcd_cluster.leader(etcd)
    node.kill()
    if node is etcd_cluster.nodes[0]:
        for member in members:
            wait_until(
                lambda member=member: switched_away_from(member, node),
                timeout=WAIT_S,
                what=f"{member.advertise} moving off the killed etcd node",
            )
    outlive_the_lease(etcd, members, leases)
    assert_nothing_lost(members, held)


def test_a_paused_etcd_node_fences_no_member(
    etcd_cluster: EtcdCluster, cluster: list[Member], held: Held
) -> None:
    """The slow answer: the etcd node the members talk to, raft's leader too, is paused
    (SIGSTOP: its connections stay open, nothing answers; and the other nodes keep a renewal
    waiting until they have elected another leader). Each member waits a fifth of its etcd
    lease for it, moves to another endpoint, keeps its lease, fences not; the locks stay held
    and renewable, new keys are granted; and their watch of etcd moved too: a change of the map
    reaches them."""
    members = cluster
    etcd = etcd_cluster.client()
    leases = {m.advertise: member_lease(etcd, m) for m in members}
    hold_locks(members, held)
    node = etcd_cluster.nodes[0]
    etcd_cluster.make_leader(etcd, node)
    node.pause()
    try:
        for member in members:
            wait_until(
                lambda member=member: switched_away_from(member, node),
                timeout=WAIT_S,
                what=f"{member.advertise} moving off the paused etcd node",
            )
        outlive_the_lease(etcd, members, leases)
        assert_nothing_lost(members, held)
        pin(etcd, PREFIX, 17)
        for member in members:
            wait_until(
                lambda member=member: 17 in shards(member.address)["pinned"],
                timeout=WAIT_S,
                what=f"{member.advertise} seeing shard 17 pinned",
            )
    finally:
        node.resume()


ETCD_USER = "dflockd"
ETCD_PASSWORD = "etcd-s3cret"


def enable_auth(etcd: EtcdClient) -> None:
    """etcd's authentication on (through etcd's own JSON API): ``root``, needed to turn it on,
    and the members' user, whose role may read and write the cluster's prefix and nothing else."""
    range_ = {"key": b64(f"{PREFIX}/"), "range_end": b64(prefix_end(f"{PREFIX}/"))}
    for user, role in (("root", "root"), (ETCD_USER, "dflockd")):
        add(etcd, "/v3/auth/user/add", {"name": user, "password": ETCD_PASSWORD}, "user add")
        add(etcd, "/v3/auth/role/add", {"name": role}, "role add")
        etcd.transport.call("/v3/auth/user/grant", {"user": user, "role": role}, "user grant")
    perm = {"permType": "READWRITE", **range_}
    etcd.transport.call("/v3/auth/role/grant", {"name": "dflockd", "perm": perm}, "role grant")
    etcd.transport.call("/v3/auth/enable", {}, "auth enable")


def add(etcd: EtcdClient, path: str, body: dict[str, Any], what: str) -> None:
    """An ``add`` that a resend makes idempotent: the transport sends a request again when
    etcd did not answer within its attempt's timeout, and when the first was applied the
    second is refused as a duplicate (CI, 2 loaded cores: "user name already exists")."""
    try:
        etcd.transport.call(path, body, what)
    except EtcdError as exc:
        if "already exists" not in str(exc):
            raise


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.fixture
def tls_etcd_cluster(tmp_path: Path) -> Iterator[tuple[EtcdCluster, Path]]:
    """A three-node etcd serving its clients over TLS, with authentication on. One self-signed
    certificate for 127.0.0.1 is etcd's, the CA both sides trust, and the clients' own."""
    (tmp_path / "tls").mkdir()
    cert = make_certificate(tmp_path / "tls")
    for cluster in etcd_cluster_or_skip(tmp_path / "etcd", tls=(cert, cert, key_of(cert))):
        enable_auth(cluster.client())
        yield cluster, cert


def test_tls_and_authentication_to_etcd(
    tls_etcd_cluster: tuple[EtcdCluster, Path], tmp_path: Path, held: Held
) -> None:
    """``etcds://`` with ``--cluster-ca-file``, ``--cluster-user`` and
    ``--cluster-password-file``, and a client certificate (``--cluster-cert``,
    ``--cluster-key``): the member joins and serves; with the node it talks to killed
    it authenticates at another node (etcd's tokens are per node) and fences not."""
    etcd_cluster, ca = tls_etcd_cluster
    password = tmp_path / "etcd-password"
    password.write_text(ETCD_PASSWORD + "\n")
    url = f"etcds://{etcd_cluster.endpoints}{PREFIX}"
    access = (
        "--cluster-ca-file", str(ca),
        "--cluster-cert", str(ca),
        "--cluster-key", str(key_of(ca)),
        "--cluster-user", ETCD_USER,
        "--cluster-password-file", str(password),
    )  # fmt: skip
    etcd = etcd_cluster.client(user=ETCD_USER, password=ETCD_PASSWORD)
    with Fleet(etcd, PREFIX, tmp_path / "state", url, access) as fleet:
        member = fleet.start()
        wait_until(lambda: settled([member]), timeout=WAIT_S, what="the cluster's map")
        # The operator's commands take the same settings.
        done = run_dflockd(["shards", "--cluster", url, *access], {})
        assert done.returncode == 0 and member.advertise in done.stdout, done
        leases = {member.advertise: member_lease(etcd, member)}
        hold_locks([member], held)
        node = etcd_cluster.nodes[0]
        node.kill()
        wait_until(
            lambda: switched_away_from(member, node),
            timeout=WAIT_S,
            what="the member moving off the killed etcd node",
        )
        outlive_the_lease(etcd, [member], leases)
        assert_nothing_lost([member], held)


def start_error(*args: str) -> str:
    """``dflockd`` started with ``args`` exits with an error: its output."""
    port = free_port()
    done = run_dflockd(
        [
            "--host", "127.0.0.1",
            "--port", str(port),
            "--advertise", f"127.0.0.1:{port}",
            "--state-dir", "none",
            *args,
        ],
        {},
        timeout=60,
    )  # fmt: skip
    assert done.returncode != 0, done.stderr
    return done.stderr


def test_wrong_etcd_settings_are_clear_start_up_errors(
    tls_etcd_cluster: tuple[EtcdCluster, Path], tmp_path: Path
) -> None:
    etcd_cluster, ca = tls_etcd_cluster
    url = f"etcds://{etcd_cluster.endpoints}{PREFIX}"
    wrong = tmp_path / "wrong-password"
    wrong.write_text("not-it\n")
    cert_args = ("--cluster-cert", str(ca), "--cluster-key", str(key_of(ca)))
    ca_args = ("--cluster-ca-file", str(ca), *cert_args)
    user_args = ("--cluster-user", ETCD_USER, "--cluster-password-file", str(wrong))

    text = start_error("--cluster", url, *ca_args, *user_args)
    assert f"etcd refused the user {ETCD_USER!r}" in text and "authentication failed" in text, text
    assert "--cluster-password-file" in text, text

    text = start_error("--cluster", url, *ca_args)
    assert "without a user" in text and "--cluster-user" in text, text

    text = start_error("--cluster", url, *cert_args, *user_args)
    assert "CERTIFICATE_VERIFY_FAILED" in text and "--cluster-ca-file" in text, text

    text = start_error("--cluster", url, "--cluster-ca-file", str(tmp_path / "nope.pem"))
    assert "--cluster-ca-file" in text and "cannot read it" in text, text

    plain = f"etcd://{etcd_cluster.endpoints}{PREFIX}"
    text = start_error("--cluster", plain, "--cluster-ca-file", str(ca))
    assert "--cluster-ca-file" in text and "etcds://" in text, text

    text = start_error("--cluster", f"etcd://127.0.0.1:1,,127.0.0.1:2{PREFIX}")
    assert "--cluster" in text and "empty etcd endpoint" in text, text


def test_after_a_round_of_silent_endpoints_the_next_round_waits_first_on_another(
    etcd_cluster: EtcdCluster,
) -> None:
    """The paused leader: while etcd's other nodes wait to elect a new one, they too leave a
    call unanswered, so one round over the endpoints can fail whole. The next round must not
    spend its time on the node that failed first (the paused one, where calls went): here every
    node is paused, the second comes back after its turn in the first round, and the call,
    given a round and a half, is answered there (before the change, the second round began
    by waiting on the first node again, to the end of the call's time, and the call failed)."""
    etcd = etcd_cluster.client(timeout=4.5, attempt_timeout=1.0)
    transport = etcd.transport
    assert transport.preferred == 0
    nodes = etcd_cluster.nodes
    answer: list[dict[str, Any] | BaseException] = []

    def status() -> None:
        try:
            answer.append(transport.call("/v3/maintenance/status", {}, "status"))
        except BaseException as exc:
            answer.append(exc)

    for node in nodes:
        node.pause()
    try:
        caller = threading.Thread(target=status)
        began = time.monotonic()
        caller.start()
        # The first round: node 0 from 0 s to 1 s, node 1 to 2 s, node 2 to 3 s. Node 1 comes
        # back in the middle of node 2's turn, so it answered nothing in the first round.
        time.sleep(max(2.6 - (time.monotonic() - began), 0))
        nodes[1].resume()
        caller.join(WAIT_S)
        took = time.monotonic() - began
    finally:
        for node in nodes:
            node.resume()
    assert answer, f"the call had not returned after {took:.1f} s (its time: 4.5 s)"
    assert len(answer) == 1 and isinstance(answer[0], dict), answer
    assert transport.preferred == 1, f"answered by endpoint {transport.preferred} in {took:.1f} s"
