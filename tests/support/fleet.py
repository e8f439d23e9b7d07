"""Lock clusters of real ``dflockd --cluster`` member processes on a real etcd, each started as
a user starts it (the console script), and what the tests do to them: pause (SIGSTOP), kill,
restart in place. :class:`Fleet` starts the members of one test and reads their view in etcd."""

from __future__ import annotations

import signal
import subprocess
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

from dflockd_server.cluster.etcd import EtcdClient
from dflockd_server.cluster.membership import ClusterView, read_view
from dflockd_server.cluster.ops import rebalance
from dflockd_server.cluster.shardmap import SHARD_COUNT, shard_id
from tests.support.etcd import EtcdServer
from tests.support.ports import free_port
from tests.support.processes import paused
from tests.support.servers import STARTUP_TIMEOUT_S, clean_env, dflockd_executable
from tests.support.waiting import wait_until

WAIT_S = 60.0
"""How long :meth:`Fleet.start` and :meth:`Fleet.wait_settled` wait (a deadline, not a bound)."""


def cluster_url(etcd_url: str, prefix: str) -> str:
    """``--cluster``'s value for the etcd at ``etcd_url`` (``http://HOST:PORT``), keys under
    ``prefix``."""
    return f"etcd://{etcd_url.removeprefix('http://')}{prefix}"


class Member:
    """A ``dflockd --cluster CLUSTER`` process on a port of its own, advertised as
    ``127.0.0.1:PORT``, with its state directory and its log (all its runs) in ``state``;
    ``extra``: more command-line arguments. Started at once; nothing awaited."""

    def __init__(self, cluster: str, state: Path, *extra: str) -> None:
        port = free_port()
        self.advertise = f"127.0.0.1:{port}"
        self.address = ("127.0.0.1", port)
        state.mkdir(parents=True, exist_ok=True)
        self.log_path = state / f"member-{port}.log"
        self.args = [
            dflockd_executable(), "--host", "127.0.0.1", "--port", str(port),
            "--advertise", self.advertise, "--cluster", cluster,
            "--state-dir", str(state / f"state-{port}"), *extra,
        ]  # fmt: skip
        self.start()

    def start(self) -> None:
        """A new run, in place: same port, advertised address and state directory (its lease
        journal)."""
        self._run_from = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.args,
                env=clean_env({}),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait_listening(self) -> None:
        """Wait until this run logs that it listens; fails if it exits first."""

        def listening() -> bool:
            with self.log_path.open("rb") as log:
                log.seek(self._run_from)
                said = log.read().decode(errors="replace")
            code = self.proc.poll()
            assert code is None or "listening on" in said, f"dflockd exited ({code}): {said}"
            return "listening on" in said

        wait_until(listening, timeout=STARTUP_TIMEOUT_S, what=f"{self.advertise} listening")

    def log(self) -> list[str]:
        """Every line it logged, over all its runs."""
        return self.log_path.read_text(errors="replace").splitlines()

    def paused(self) -> AbstractContextManager[None]:
        """Stopped (SIGSTOP, every thread) for a ``with`` block, SIGCONT after it."""
        return paused(self.proc.pid)

    def kill(self) -> None:
        """SIGKILL (after a SIGCONT, were it stopped), and reaped."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(30)

    def restart(self) -> None:
        """Killed and started again in place (`kill`, `start`)."""
        self.kill()
        self.start()


@dataclass
class Fleet:
    """The members of one test, registered in ``etcd`` under ``prefix`` (``cluster``: their
    ``--cluster``), each started with ``extra``; every one killed when the ``with`` ends."""

    etcd: EtcdClient
    prefix: str
    state: Path
    cluster: str
    extra: tuple[str, ...] = ()
    members: list[Member] = field(default_factory=list[Member])

    @classmethod
    def on(cls, etcd_server: EtcdServer, prefix: str, state: Path, *extra: str) -> Fleet:
        """A fleet on ``etcd_server``, under ``prefix`` (a trailing ``/`` dropped)."""
        prefix = prefix.rstrip("/")
        return cls(etcd_server.client(), prefix, state, cluster_url(etcd_server.url, prefix), extra)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        for member in self.members:
            member.kill()

    def start(self, cluster: str | None = None) -> Member:
        """A new member, once it listens and is registered (``cluster``: its ``--cluster``, if
        not the fleet's: the same etcd through a proxy, say)."""
        member = Member(cluster or self.cluster, self.state, *self.extra)
        self.members.append(member)
        member.wait_listening()
        wait_until(
            lambda: member.advertise in self.view().members,
            timeout=WAIT_S,
            what=f"{member.advertise} registered",
        )
        return member

    def view(self) -> ClusterView:
        return read_view(self.etcd, self.prefix)

    def settled(self) -> bool:
        """Every shard has a current member, none is moving."""
        shard_map = self.view().shard_map
        return len(shard_map) == SHARD_COUNT and not shard_map.moves_in_progress()

    def wait_settled(self, what: str) -> None:
        wait_until(self.settled, timeout=WAIT_S, what=what)

    def even_out(self) -> None:
        """Even the map out over the members now, as an operator's ``dflockd rebalance`` does,
        and wait until each serves its share and no shard moves. Settled alone is not enough:
        the leader evens out a member that joined only once membership has been still for 10 s
        (``AUTO_REBALANCE_S``), so until then the first member serves every shard, and a key
        picked as its own moves away under the test. The rebalance waits for the leader's
        whole first map (it refuses one written halfway)."""
        self.wait_settled("the first shard map written whole")
        rebalance(self.etcd, self.prefix)
        everyone = sorted(m.advertise for m in self.members)
        wait_until(
            lambda: self.settled() and sorted(self.view().shard_map.counts()) == everyone,
            timeout=WAIT_S,
            what=f"the map evened out over {len(everyone)} members",
        )

    def owner(self, key: str) -> str:
        """The member serving ``key``'s shard."""
        return self.view().shard_map[shard_id(key)].current

    def split_of(self, key: str) -> str:
        """The member ``key``'s shard is split to ("" when none)."""
        return self.view().shard_map[shard_id(key)].split

    def key_of(self, member: Member, stem: str) -> str:
        """A key ``STEM<n>`` that ``member`` serves."""
        return next(
            f"{stem}{i}" for i in range(10**6) if self.owner(f"{stem}{i}") == member.advertise
        )

    def seeds(self) -> list[tuple[str, int]]:
        return [m.address for m in self.members]
