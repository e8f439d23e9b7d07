"""Which keys a server serves (issue 16): the settings of static members and cluster mode, the
ownership objects, the refusals on the wire (``error_moved``, ``error_unavailable``), the
``shards`` request and the thread-safe calls the cluster node uses, on real servers."""

from __future__ import annotations

import json
import threading
import zlib

import pytest

from dflockd_server import Config, constants, protocol as p
from dflockd_server.cli import UsageError, load_config
from dflockd_server.cluster.shardmap import shard_id
from dflockd_server.config import ConfigError
from dflockd_server.net import make_ownership
from dflockd_server.ownership import SingleOwnership, StaticOwnership
from dflockd_server.testing import ServerThread
from tests.support.ports import free_port
from tests.support.waiting import wait_until
from tests.support.wire import Wire

KEYS = [f"key-{i}" for i in range(60)]


# ------------------------------------------------------------------------------ settings
def test_members_and_advertise_from_flags_and_environment() -> None:
    config = load_config(["--members", "a:1, b:2,c:3", "--advertise", "b:2"], {})
    assert config.members == ("a:1", "b:2", "c:3")
    assert config.advertise == "b:2"
    env = {"DFLOCKD_MEMBERS": "x:1,[::1]:2", "DFLOCKD_ADVERTISE": "[::1]:2"}
    config = load_config(["--members", "a:1", "--advertise", "a:1"], env)
    assert config.members == ("x:1", "[::1]:2")
    assert config.advertise == "[::1]:2"


def test_cluster_url_is_parsed_with_its_default_prefix() -> None:
    config = load_config(["--cluster", "etcd://127.0.0.1:2379", "--advertise", "h:6388"], {})
    assert config.cluster == "etcd://127.0.0.1:2379/dflockd"
    env = {"DFLOCKD_CLUSTER": "etcd://etcd:2379/locks/", "DFLOCKD_ADVERTISE": "h:6388"}
    assert load_config([], env).cluster == "etcd://etcd:2379/locks"


@pytest.mark.parametrize(
    ("argv", "env", "names"),
    [
        (["--members", "a:1,b:2"], {}, ["--advertise", "DFLOCKD_ADVERTISE", "--members"]),
        (
            ["--members", "a:1,b:2", "--advertise", "c:3"],
            {},
            ["--advertise", "DFLOCKD_ADVERTISE", "not one of", "DFLOCKD_MEMBERS"],
        ),
        (
            [],
            {
                "DFLOCKD_MEMBERS": "a:1",
                "DFLOCKD_CLUSTER": "etcd://e:2379",
                "DFLOCKD_ADVERTISE": "a:1",
            },
            ["--members", "--cluster", "DFLOCKD_CLUSTER", "not both"],
        ),
        (["--cluster", "etcd://e:2379"], {}, ["--cluster", "--advertise", "DFLOCKD_ADVERTISE"]),
        (["--advertise", "a:1"], {}, ["--advertise", "only used with"]),
        (["--members", "a:1,a:1", "--advertise", "a:1"], {}, ["--members", "twice"]),
        (["--members", "a", "--advertise", "a:1"], {}, ["--members", "HOST:PORT"]),
        ([], {"DFLOCKD_MEMBERS": "a:99999"}, ["DFLOCKD_MEMBERS", "1..65535"]),
        (["--members", "a:1", "--advertise", "::1:1"], {}, ["--advertise", "brackets"]),
        (["--cluster", "http://e:2379", "--advertise", "a:1"], {}, ["--cluster", "etcd://"]),
    ],
)
def test_bad_membership_settings_name_the_flag_and_the_variable(
    argv: list[str], env: dict[str, str], names: list[str]
) -> None:
    with pytest.raises(UsageError) as failure:
        load_config(argv, env)
    for name in names:
        assert name in str(failure.value), (name, str(failure.value))


def test_a_cluster_member_without_its_etcd_is_a_clear_start_up_error() -> None:
    port = free_port()  # nothing listens there
    config = Config(
        host="127.0.0.1", port=0, cluster=f"etcd://127.0.0.1:{port}", advertise="127.0.0.1:1"
    )
    with pytest.raises(ConfigError, match=r"--cluster / DFLOCKD_CLUSTER .*cannot join") as exc:
        ServerThread(config).start()
    assert f"127.0.0.1:{port}" in str(exc.value)


def test_make_ownership_by_mode() -> None:
    assert isinstance(make_ownership(Config()), SingleOwnership)
    ownership = make_ownership(Config(members=("a:1", "b:2"), advertise="b:2"))
    assert isinstance(ownership, StaticOwnership)
    assert ownership.describe()["self"] == "b:2"


# ------------------------------------------------------------------------------ ownership
def test_static_ownership_is_the_crc32_strategy_over_the_list() -> None:
    members = ["a:1", "b:2", "c:3"]
    owners = [StaticOwnership(members, member) for member in members]
    for key in KEYS:
        index = zlib.crc32(key.encode()) % 3
        for position, ownership in enumerate(owners):
            verdict = ownership.check(key)
            if position == index:
                assert verdict is None
            else:
                assert verdict == f"error_moved {members[index]}\n".encode()
    assert StaticOwnership(["only:1"], "only:1").check("anything") is None


# ------------------------------------------------------------------------------ static servers
def test_a_static_member_serves_its_keys_and_refuses_the_others_in_step(
    static_fleet: list[ServerThread],
) -> None:
    members = [f"127.0.0.1:{s.port}" for s in static_fleet]
    for key in KEYS[:20]:
        owner = zlib.crc32(key.encode()) % 3
        for position, server in enumerate(static_fleet):
            with Wire(server.address) as wire:
                if position == owner:
                    token = wire.lock(key)
                    assert wire.req("n", key, token).startswith("ok ")
                    assert wire.req("r", key, token) == "ok"
                    continue
                moved = f"error_moved {members[owner]}"
                assert wire.req("l", key, "5") == moved
                assert wire.req("sl", key, "5 3") == moved
                assert wire.req("e", key) == moved
                assert wire.req("se", key, "3") == moved
                assert wire.req("ping") == "ok"  # still in step


def test_refused_acquires_never_reach_the_table(static_fleet: list[ServerThread]) -> None:
    server = static_fleet[0]
    foreign = [k for k in KEYS if zlib.crc32(k.encode()) % 3 != 0]
    with Wire(server.address) as wire:
        for key in foreign:
            assert wire.req("l", key, "0").startswith("error_moved ")
    assert server.call(lambda: len(server.server.table.grants.keys)) == 0


def test_shards_in_static_mode(static_fleet: list[ServerThread]) -> None:
    members = [f"127.0.0.1:{s.port}" for s in static_fleet]
    with Wire(static_fleet[1].address) as wire:
        status, payload = wire.req("shards").split(" ", 1)
    assert status == "ok"
    assert json.loads(payload) == {
        "mode": "static",
        "self": members[1],
        "members": members,
        "strategy": "crc32",
    }


def test_shards_in_single_mode_and_the_hello_feature(dflock_server: ServerThread) -> None:
    with Wire(dflock_server.address) as wire:
        assert wire.req("shards") == 'ok {"mode":"single"}'
        status, payload = wire.req("hello").split(" ", 1)
    assert status == "ok"
    assert constants.FEATURE_SHARDS in json.loads(payload)["features"]


def test_the_reply_bytes() -> None:
    assert p.reply_moved("10.0.0.2:6388") == b"error_moved 10.0.0.2:6388\n"
    assert p.REPLY_ERROR_UNAVAILABLE == b"error_unavailable\n"
    assert p.reply_json({"mode": "single"}) == b'ok {"mode":"single"}\n'


# ------------------------------------------------------------------------------ cluster-style
class FixedOwnership:
    """A cluster-style verdict for tests: keys of ``served`` shards served, the others
    answered ``reply``."""

    def __init__(self, served: set[int], reply: bytes, renew: bool = True) -> None:
        self.served = served
        self.reply = reply
        self.renew = renew

    def check(self, key: str) -> bytes | None:
        return None if shard_id(key) in self.served else self.reply

    def check_asked(self, key: str) -> bytes | None:
        return self.check(key)

    def admit_ask(self, key: str, ticket: str) -> bytes | None:
        return None

    def may_hold(self, key: str) -> bool:
        return self.renew and shard_id(key) in self.served

    def describe(self) -> dict[str, object]:
        return {"mode": "cluster", "served": sorted(self.served)}


def test_an_ownership_given_to_the_server_and_swapped_from_another_thread() -> None:
    key = "orders:1"
    everything = FixedOwnership({shard_id(key)}, p.REPLY_ERROR_UNAVAILABLE)
    with ServerThread(ownership=everything) as server, Wire(server.address) as wire:
        assert wire.req("shards") == f'ok {{"mode":"cluster","served":[{shard_id(key)}]}}'
        token = wire.lock(key)
        swapped = FixedOwnership(set(), p.reply_moved("elsewhere:1"))
        threading.Thread(target=server.server.set_ownership, args=(swapped,)).start()
        wait_until(lambda: server.server.serving.ownership is swapped)
        assert wire.req("l", "other", "0") == "error_moved elsewhere:1"
        assert wire.req("l", key, "0") == "error_moved elsewhere:1"
        # The key's shard is no longer this member's: its grant is not renewed here any more
        # (the shard's new owner may grant it once the lease ran out).
        assert wire.req("n", key, token) == "error"
        server.server.set_ownership(everything)
        assert wire.req("n", key, token).startswith("ok ")  # its own again
        server.server.set_ownership(
            FixedOwnership({shard_id(key)}, p.REPLY_ERROR_UNAVAILABLE, renew=False)
        )
        assert wire.req("n", key, token) == "error"  # a fenced member refuses renewals
        assert wire.req("r", key, token) == "ok"  # releases still go through


class CountedStatic(StaticOwnership):
    """A static member that counts the ``may_hold`` questions it is asked."""

    def __init__(self, members: list[str], advertise: str) -> None:
        super().__init__(members, advertise)
        self.asked = 0

    def may_hold(self, key: str) -> bool:
        self.asked += 1
        return super().may_hold(key)


def test_a_static_members_keep_alive_asks_nothing_of_its_grants() -> None:
    """A static member may hold every key it granted (``may_hold`` is always True): a session's
    keep-alive renews its grants without asking it key by key, as on a single server."""
    ownership = CountedStatic(["127.0.0.1:1"], "127.0.0.1:1")
    with ServerThread(ownership=ownership) as server, Wire(server.address) as wire:
        assert wire.req("hello", "_", "session s-0123456789abcdef 3").startswith("ok ")
        for key in KEYS[:5]:
            wire.lock(key)
        assert wire.req("ping", "_", "session s-0123456789abcdef") == "ok"
        assert wire.req("ping", "_", "session s-0123456789abcdef") == "ok"
    assert ownership.asked == 0


def test_a_keep_alive_is_refused_where_a_grant_may_not_be_held() -> None:
    """Where the ownership may refuse (a cluster member), the keep-alive asks it of every grant
    of the session, and a refused key refuses the whole keep-alive."""
    key = "orders:1"
    ownership = FixedOwnership({shard_id(key)}, p.REPLY_ERROR_UNAVAILABLE)
    with ServerThread(ownership=ownership) as server, Wire(server.address) as wire:
        assert wire.req("hello", "_", "session s-0123456789abcdef 3").startswith("ok ")
        wire.lock(key)
        assert wire.req("ping", "_", "session s-0123456789abcdef") == "ok"
        ownership.renew = False
        assert wire.req("ping", "_", "session s-0123456789abcdef") == "error"


def test_holders_in_fail_waiters_and_renewals_allowed_from_another_thread() -> None:
    held, waited = "held-key", "waited-key"
    with ServerThread() as server, Wire(server.address) as a, Wire(server.address) as b:
        token = a.lock(held)
        token2 = a.lock(waited)
        b.send("l", waited, "30")
        table = server.server.table
        wait_until(lambda: server.call(lambda: table.queued) == 1)
        shards = {shard_id(held), shard_id(waited), shard_id("idle-key")}
        assert server.server.serving.holders_in(shards) == {shard_id(held), shard_id(waited)}
        b.assert_silent()
        failed = server.server.serving.fail_waiters({shard_id(waited)}, p.reply_moved("t:1"))
        assert failed == 1
        assert b.recv() == "error_moved t:1"
        assert b.req("ping") == "ok"  # in step
        server.server.serving.renewals_allowed(False)
        assert a.req("n", held, token) == "error"
        server.server.serving.renewals_allowed(True)
        assert a.req("n", held, token).startswith("ok ")
        assert a.req("r", waited, token2) == "ok"
        assert server.server.serving.holders_in(shards) == {shard_id(held)}


def test_fail_waiters_drops_a_pending_two_phase_enqueue() -> None:
    key = "two-phase"
    with ServerThread() as server, Wire(server.address) as a, Wire(server.address) as b:
        token = a.lock(key)
        assert b.req("e", key) == "queued"
        assert server.server.serving.fail_waiters([shard_id(key)], p.reply_moved("t:1")) == 1
        assert a.req("r", key, token) == "ok"
        assert b.req("w", key, "0") == "error_moved t:1"  # the w that comes is told
        assert b.req("w", key, "0") == "error_not_enqueued"  # once
