"""On a real etcd, without members: fence ceilings, conditional map writes, operator commands."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import pytest

from dflockd_server.cluster.etcd import MAX_TXN_OPS, EtcdClient, EtcdTransport
from dflockd_server.cluster.etcd.messages import RangeResult
from dflockd_server.cluster.fencestore import (
    EtcdCeilingStore,
    highest_ceiling,
    published_longest,
)
from dflockd_server.cluster.mapwrite import ShardWrite, write_shards
from dflockd_server.cluster.membership import ClusterKeys, read_view
from dflockd_server.cluster.ops import ClusterOpError, cluster_command, rebalance
from dflockd_server.cluster.shardmap import SHARD_COUNT, ShardAssignment, ShardMap
from dflockd_server.fence import FenceStateError, fence_of
from dflockd_server.tokens import FenceCounter
from tests.support.etcd import EtcdServer, put
from tests.support.servers import run_dflockd
from tests.support.shards import pin, unpin


def test_fence_ceilings_survive_in_etcd_and_never_go_down(
    etcd: EtcdClient, etcd_prefix: str
) -> None:
    prefix = etcd_prefix.rstrip("/")
    store = EtcdCeilingStore(etcd, prefix, "a:1")
    assert store.read() == 0
    first = FenceCounter(store=store)
    token = first.next_token()
    assert store.read() == first.ceiling > fence_of(token)
    store.write(5)  # a stale writer cannot lower it
    assert store.read() == first.ceiling
    # A restart (a new counter) continues above everything the last one may have issued.
    assert fence_of(FenceCounter(store=store).next_token()) > first.ceiling
    other = EtcdCeilingStore(etcd, prefix, "b:1")
    other.write(first.ceiling + 10**9)
    assert highest_ceiling(etcd, prefix) == first.ceiling + 10**9
    assert highest_ceiling(etcd, prefix, "b:1") == store.read()
    put(etcd, store.key, "garbage")
    with pytest.raises(FenceStateError, match="decimal counter"):
        store.read()


def test_a_stored_counter_is_ascii_digits(etcd: EtcdClient, etcd_prefix: str) -> None:
    """A digit ``int`` cannot read (a superscript) is not a counter: a ceiling holding one is
    refused as any other garbage is, a longest lease holding one is skipped (both raised
    ``ValueError``, the second out of every failover wait's read)."""
    prefix = etcd_prefix.rstrip("/")
    store = EtcdCeilingStore(etcd, prefix, "a:1")
    put(etcd, store.key, "\u00b2")
    with pytest.raises(FenceStateError, match="decimal counter"):
        store.read()
    put(etcd, f"{prefix}/longest/a:1", "\u00b2")
    put(etcd, f"{prefix}/longest/b:1", " 7 ")
    assert published_longest(etcd, prefix) == {"b:1": 7}


def test_map_writes_never_clobber_a_concurrent_write(etcd: EtcdClient, etcd_prefix: str) -> None:
    keys = ClusterKeys(etcd_prefix.rstrip("/"))
    m = ShardMap({s: ShardAssignment("ab"[s % 2] + ":1", "ab"[s % 2] + ":1") for s in range(300)})
    result = write_shards(etcd, keys.shards, {s: ShardWrite(0, a) for s, a in m.items()})
    assert len(result.written) == len(m) and result.conflicted == ()
    seen = read_view(etcd, keys.prefix)
    assert seen.shard_map == m
    put(etcd, keys.shard(3), "b:1,b:1,f=pinned")  # an operator, meanwhile
    writes = {s: ShardWrite(seen.revisions[s], ShardAssignment("a:1", "a:1")) for s in (1, 3, 5)}
    result = write_shards(etcd, keys.shards, writes)
    assert sorted(result.written) == [1, 5] and result.conflicted == (3,)
    assert read_view(etcd, keys.prefix).shard_map[3] == ShardAssignment("b:1", "b:1", ("pinned",))
    # Creating a shard that someone created meanwhile conflicts too.
    assert write_shards(etcd, keys.shards, {3: ShardWrite(0, None)}).conflicted == (3,)


class CountingTransport(EtcdTransport):
    """The real transport to the real etcd, counting its requests."""

    requests = 0

    def call(self, path: str, body: dict[str, Any], what: str) -> dict[str, Any]:
        self.requests += 1
        return super().call(path, body, what)


def test_a_view_stale_by_thousands_of_shards_costs_a_few_requests_not_one_per_shard(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """A member that joined again while the leader rewrote the map writes from a stale view:
    the changed shards are found out by the failed transaction itself, not by one transaction
    per shard (2,016 requests here before, which kept a member's node busy for seconds under
    load, a handover it owed waiting behind them)."""
    counting = CountingTransport(etcd_server.url)
    etcd = EtcdClient(counting)
    keys = ClusterKeys(etcd_prefix.rstrip("/"))
    count = 2000
    write_shards(
        etcd, keys.shards, {s: ShardWrite(0, ShardAssignment("a:1", "a:1")) for s in range(count)}
    )
    seen = read_view(etcd, keys.prefix)
    meanwhile = ShardAssignment("b:1", "b:1")
    unchanged = {0, 500, 1000, 1500}
    write_shards(
        etcd,
        keys.shards,
        {s: ShardWrite(seen.revisions[s], meanwhile) for s in range(count) if s not in unchanged},
    )
    counting.requests = 0
    mine = ShardAssignment("c:1", "c:1")
    result = write_shards(
        etcd, keys.shards, {s: ShardWrite(seen.revisions[s], mine) for s in range(count)}
    )
    assert sorted(result.written) == sorted(unchanged)
    assert result.conflicted == tuple(s for s in range(count) if s not in unchanged)
    batches = math.ceil(count / MAX_TXN_OPS)
    assert counting.requests <= 2 * batches, (
        counting.requests
    )  # a transaction per batch, and a retry
    after = read_view(etcd, keys.prefix).shard_map
    assert all(after[s] == (mine if s in unchanged else meanwhile) for s in range(count))


def test_rebalance_before_the_first_map_writes_the_first_map(
    etcd: EtcdClient, etcd_prefix: str
) -> None:
    """Members registered, no map yet (the leader writes the first once membership has been
    still for two seconds): a rebalance then writes the map the leader would, every shard
    served at once by its target. (It had planned moves: each shard a target and no current
    member, which no member serves before a whole failover wait.)"""
    prefix = etcd_prefix.rstrip("/")
    keys = ClusterKeys(prefix)
    for member in ("b:1", "a:1"):
        put(etcd, keys.member(member), member)
    result = rebalance(etcd, prefix)
    assert len(result.written) == len(result.plan) == SHARD_COUNT
    shard_map = read_view(etcd, prefix).shard_map
    assert shard_map == ShardMap.initial(["a:1", "b:1"])
    assert not shard_map.moves_in_progress()
    assert rebalance(etcd, prefix).plan == []  # balanced: nothing more to do


def test_rebalance_while_the_first_map_is_being_written_is_refused(
    etcd: EtcdClient, etcd_prefix: str
) -> None:
    """The leader writes the first map in batches: a rebalance that read it halfway (a member
    started with ``dflockd rebalance`` right after it, as a deployment script would) planned
    moves for the shards not written yet, each a target and no current member, which no
    member serves before a whole failover wait (the longest lease and its margin: over five
    minutes by default). It is refused until the map is whole, and writes nothing."""
    prefix = etcd_prefix.rstrip("/")
    keys = ClusterKeys(prefix)
    for member in ("b:1", "a:1"):
        put(etcd, keys.member(member), member)
    first = ShardMap.initial(["a:1"])
    written = {s: ShardWrite(0, first[s]) for s in range(MAX_TXN_OPS)}  # the leader's first batch
    assert len(write_shards(etcd, keys.shards, written).written) == MAX_TXN_OPS
    with pytest.raises(ClusterOpError, match=r"first shard map .* is still being written"):
        rebalance(etcd, prefix)
    shard_map = read_view(etcd, prefix).shard_map
    assert len(shard_map) == MAX_TXN_OPS
    assert all(a.current for _, a in shard_map.items()), "a shard with no member to serve it"


class WrittenMeanwhile(EtcdClient):
    """The real client to the real etcd; after its first read of the whole cluster, the shard
    record ``key`` is written (as a member writes it at a step of a handover) before the
    operator's conditional write goes out."""

    key = ""
    value = ""

    def range(self, key: str, *, prefix: bool = False) -> RangeResult:
        result = super().range(key, prefix=prefix)
        if prefix and self.value:
            meanwhile, self.value = self.value, ""
            put(self, self.key, meanwhile)
        return result


@pytest.mark.parametrize("change", ["pin", "unpin"])
def test_a_pin_or_unpin_is_made_on_a_record_a_member_wrote_meanwhile(
    etcd_server: EtcdServer, etcd: EtcdClient, etcd_prefix: str, change: str
) -> None:
    """A member writes a shard's record at each step of its handover, so an operator's pin or
    unpin can meet a newer record than it read. It reads again and makes its change on that
    one, keeping the member's write (it had answered "changed while being written: try
    again", which the cluster tests met under load)."""
    prefix = etcd_prefix.rstrip("/")
    keys = ClusterKeys(prefix)
    start = ShardAssignment("a:1", "a:1", ("pinned",) if change == "unpin" else ())
    write_shards(etcd, keys.shards, {7: ShardWrite(0, start)})
    put(etcd, keys.member("b:1"), "b:1")  # a pin is onto a live member
    client = WrittenMeanwhile(etcd_server.url)
    client.key = keys.shard(7)
    moved = ShardAssignment("b:1", "b:1", start.flags)  # a handover done, meanwhile
    client.value = moved.format()
    done = pin(client, prefix, 7, "b:1") if change == "pin" else unpin(client, prefix, 7)
    assert not client.value, "the member's write did not happen"
    after = read_view(etcd, prefix).shard_map[7]
    assert after == done
    assert after.current == "b:1"  # the member's write is kept
    assert ("pinned" in after.flags) is (change == "pin")


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cluster_command(argv, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_operator_commands(etcd_server: EtcdServer, etcd: EtcdClient, etcd_prefix: str) -> None:
    prefix = etcd_prefix.rstrip("/")
    url = f"etcd://127.0.0.1:{etcd_server.client_port}{prefix}"
    keys = ClusterKeys(prefix)
    m = ShardMap.initial(["a:1", "b:1"])
    write_shards(etcd, keys.shards, {s: ShardWrite(0, a) for s, a in m.items()})
    put(etcd, keys.member("a:1"), "a:1")
    put(etcd, keys.member("c:1"), "c:1")
    code, out, _ = run(["shards", "--cluster", url])
    assert code == 0 and "live members: a:1, c:1" in out and "b:1: target of 4096" in out
    code, out, _ = run(["pin", "--cluster", url, "7", "c:1"])
    assert code == 0 and out.strip() == "shard 7: c:1,b:1,f=pinned"
    assert unpin(etcd, prefix, 7) == ShardAssignment("c:1", "b:1")
    assert pin(etcd, prefix, 7).pinned
    code, out, _ = run(["unpin", "--cluster", url, "7"])
    assert code == 0 and out.strip() == "shard 7: c:1,b:1"
    code, out, _ = run(["rebalance", "--cluster", url, "--dry-run"])
    assert code == 0 and out.strip().endswith("would move 4095 shard(s)")
    assert out.splitlines()[0] == "b:1 -> c:1: 4095 shard(s)"  # one line per pair of nodes
    assert read_view(etcd, prefix).shard_map[7] == ShardAssignment("c:1", "b:1")
    code, out, _ = run(["rebalance", "--cluster", url])
    assert code == 0 and out.strip().endswith("moved 4095 shard(s)")
    assert read_view(etcd, prefix).shard_map.counts() == {"a:1": 4096, "c:1": 4096}
    # The same commands through the real `dflockd` executable (its dispatch to them).
    shown = run_dflockd(["shards", "--cluster", url], {})
    assert shown.returncode == 0 and "a:1: target of 4096" in shown.stdout, shown
    code, _, err = run(["pin", "--cluster", url, "9000"])
    assert code == 1 and "outside 0..8191" in err
    code, _, err = run(["shards", "--cluster", "http://x:1"])
    assert code == 2 and "--cluster (or DFLOCKD_CLUSTER)" in err
    with pytest.raises(ClusterOpError, match="no cluster under the prefix '/nobody-here'"):
        rebalance(etcd, "/nobody-here")


def test_the_commands_read_etcds_user_as_the_server_does(
    etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    """The operator's commands take the server's settings for etcd's user (flags, variables,
    the password file read and checked by the same function): an empty password file is
    refused, naming the setting, before etcd is asked (it was sent as an empty password)."""
    url = f"etcd://127.0.0.1:{etcd_server.client_port}{etcd_prefix.rstrip('/')}"
    empty = tmp_path / "password"
    empty.write_text("\n")
    user = ["--cluster-user", "root"]
    code, _, err = run(["shards", "--cluster", url, *user, "--cluster-password-file", str(empty)])
    assert code == 2 and "--cluster-password-file / DFLOCKD_CLUSTER_PASSWORD_FILE" in err, err
    assert "is empty" in err, err
    code, _, err = run(["shards", "--cluster", url, *user])
    assert code == 2 and "go together" in err and "DFLOCKD_CLUSTER_PASSWORD" in err, err


def test_a_pin_onto_a_node_that_is_no_live_member_is_refused(
    etcd_server: EtcdServer, etcd: EtcdClient, etcd_prefix: str
) -> None:
    """A NODE that is no live member (a typo in its port, say) is refused, naming the live
    ones: written, the shard moved out of its member towards nobody and was unavailable until
    an unpin (the command said ``shard 7: a:2,a:1,f=pinned`` and exited 0)."""
    prefix = etcd_prefix.rstrip("/")
    url = f"etcd://127.0.0.1:{etcd_server.client_port}{prefix}"
    keys = ClusterKeys(prefix)
    m = ShardMap.initial(["a:1", "b:1"])
    write_shards(etcd, keys.shards, {s: ShardWrite(0, a) for s, a in m.items()})
    put(etcd, keys.member("a:1"), "a:1")
    put(etcd, keys.member("b:1"), "b:1")
    code, _, err = run(["pin", "--cluster", url, "7", "a:2"])
    assert code == 1, err
    assert "a:2 is not a live member" in err and "a:1, b:1" in err, err
    assert read_view(etcd, prefix).shard_map[7] == m[7]  # nothing written
    code, out, _ = run(["pin", "--cluster", url, "7", "a:1"])
    assert code == 0 and out.strip() == "shard 7: a:1,b:1,f=pinned"


def test_the_commands_refuse_a_password_given_twice_as_the_server_does(tmp_path: Path) -> None:
    """``--cluster-password`` (which the commands take since they read the server's settings)
    beside ``--cluster-password-file`` is refused by the server ("not both"); the commands
    took the file's and dropped the other without a word."""
    secret = tmp_path / "password"
    secret.write_text("from-the-file\n")
    url = "etcd://127.0.0.1:1/nowhere"  # refused before etcd is asked
    code, _, err = run([
        "shards", "--cluster", url, "--cluster-user", "root", "--cluster-password", "typed",
        "--cluster-password-file", str(secret),
    ])  # fmt: skip
    assert code == 2 and "not both" in err and "--cluster-password-file" in err, err


@pytest.mark.parametrize(
    "argv", [["shards"], ["rebalance"], ["rebalance", "--dry-run"], ["pin", "7"], ["unpin", "7"]]
)
def test_a_prefix_that_names_no_cluster_is_refused_by_every_command(
    etcd_server: EtcdServer, etcd: EtcdClient, etcd_prefix: str, argv: list[str]
) -> None:
    """A mistyped prefix in ``--cluster`` (no member, no shard map under it in that etcd)
    stops each command, naming the prefix and where it came from: ``shards`` printed an empty
    summary and exited 0, the others said something else (``pin``: that its node was no live
    member, ``unpin``: that the shard had no assignment, ``rebalance``: no live member)."""
    prefix = etcd_prefix.rstrip("/")
    keys = ClusterKeys(prefix)
    m = ShardMap.initial(["a:1"])
    write_shards(etcd, keys.shards, {s: ShardWrite(0, a) for s, a in m.items()})
    put(etcd, keys.member("a:1"), "a:1")
    typo = prefix + "x"
    url = f"etcd://127.0.0.1:{etcd_server.client_port}{typo}"
    if argv[0] == "pin":
        argv = [*argv, "a:1"]
    code, out, err = run([argv[0], "--cluster", url, *argv[1:]])
    assert code == 1 and not out, (code, out, err)
    assert f"no cluster under the prefix '{typo}'" in err, err
    assert "no member, no shard map" in err and "--cluster (or DFLOCKD_CLUSTER)" in err, err
    assert f"127.0.0.1:{etcd_server.client_port}" in err, err
    assert etcd.range(typo + "/", prefix=True).kvs == []  # nothing written there
