"""Operator operations on a cluster's shard map, and the ``dflockd`` commands that run them:
``rebalance`` (``ShardMap.rebalance_plan`` over the live members), ``pin`` / ``unpin`` and
``shards`` (``summary``). Every write is conditioned on the shard being unchanged since read
(``mapwrite``): a concurrent write is never clobbered.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TextIO

from dflockd_server.cluster.etcd import EtcdClient, EtcdError, EtcdTransport, tls_context
from dflockd_server.cluster.mapwrite import ShardWrite, write_shards
from dflockd_server.cluster.membership import ClusterKeys, ClusterView, read_view
from dflockd_server.cluster.shardmap import SHARD_COUNT, Move, ShardAssignment, ShardMap
from dflockd_server.config import ETCD_PASSWORDS, check_pairs, check_user, read_secret
from dflockd_server.constants import CLUSTER_COMMAND_HELP
from dflockd_server.settings import BY_FIELD, ETCD_ACCESS, names
from dflockd_server.values import split_cluster_url

_CLUSTER = BY_FIELD["cluster"]


class ClusterOpError(Exception):
    """An operator's request cannot be carried out (the message says why)."""


def parse_cluster_url(url: str) -> tuple[str, str]:
    """``etcd://HOST:PORT[,HOST:PORT...][/PREFIX]`` -> (``http://HOST:PORT,...``, the key
    prefix); ``etcds://`` -> ``https://``. Read and checked as the server reads it: a
    ``ValueError`` naming the setting."""
    parsed = split_cluster_url(_CLUSTER.take(url, f"{_CLUSTER.flag} (or {_CLUSTER.env[0]})"))
    scheme = "https" if parsed.tls else "http"
    return f"{scheme}://{parsed.format().split('://', 1)[1].split('/', 1)[0]}", parsed.prefix


@dataclass(frozen=True, slots=True)
class EtcdAccess:
    """TLS files and a user for the cluster's etcd (``ETCD_ACCESS``)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    user: str | None = None
    password: str | None = None


def etcd_client(
    url: str, access: EtcdAccess = EtcdAccess(), *, lease_ttl_s: float = 5.0
) -> tuple[EtcdClient, str]:
    """The etcd client of a ``--cluster`` URL and the cluster's key prefix (``ValueError``
    naming the setting that is wrong)."""
    etcd_url, prefix = parse_cluster_url(url)
    context = None
    if etcd_url.startswith("https://"):
        try:
            context = tls_context(access.ca_file, access.cert_file, access.key_file)
        except ValueError as exc:
            names = "--cluster-ca-file" if "CA file" in str(exc) else "--cluster-cert/--cluster-key"
            raise ValueError(f"{names}: {exc}") from None
    # A call: 5 s or the lease if longer. One of several endpoints is waited for a fifth of
    # the lease, so a keep-alive can move to another and still renew in time.
    timeout = max(5.0, lease_ttl_s)
    transport = EtcdTransport(
        etcd_url,
        timeout=timeout,
        attempt_timeout=max(lease_ttl_s / 5, 0.5) if "," in etcd_url else timeout,
        ssl_context=context,
        user=access.user,
        password=access.password,
    )
    return EtcdClient(transport), prefix


def _found(client: EtcdClient, prefix: str) -> ClusterView:
    """The view under ``prefix``, refused if nothing of a cluster is there (a mistyped prefix)."""
    view = read_view(client, prefix)
    if not view.members and len(view.shard_map) == 0:
        raise ClusterOpError(
            f"no cluster under the prefix {prefix!r} in etcd at {client.url} (no member, no shard "
            f"map): check the prefix in {_CLUSTER.flag} (or {_CLUSTER.env[0]})"
        )
    return view


@dataclass(frozen=True, slots=True)
class RebalanceResult:
    plan: list[Move]
    written: list[int]
    conflicted: list[int]


def rebalance(client: EtcdClient, prefix: str, *, dry_run: bool = False) -> RebalanceResult:
    """Plan (and unless ``dry_run`` write) the fewest moves that even out the live members."""
    view = _found(client, prefix)
    if not view.members:
        raise ClusterOpError(f"no live member under {prefix!r}: nothing to balance over")
    if 0 < (written := len(view.shard_map)) < SHARD_COUNT:
        # Planned over, the shards not written yet would get a target and no current member:
        # nobody serves them before a whole failover wait.
        raise ClusterOpError(
            f"the first shard map under {prefix!r} is still being written ({written} of "
            f"{SHARD_COUNT} shards): run rebalance again in a moment"
        )
    plan = view.shard_map.rebalance_plan(view.members)
    if dry_run or not plan:
        return RebalanceResult(plan, [], [])
    # No map yet: the first map, as the leader would write it (as moves, no shard would have a
    # current member until a whole failover wait).
    new_map = view.shard_map.apply(plan) if len(view.shard_map) else ShardMap.initial(view.members)
    writes = {m.shard: ShardWrite(view.revisions.get(m.shard, 0), new_map[m.shard]) for m in plan}
    result = write_shards(client, ClusterKeys(prefix).shards, writes)
    return RebalanceResult(plan, sorted(result.written), sorted(result.conflicted))


CHANGE_ATTEMPTS = 3  # a pin's or unpin's read-and-write tries (members write shards as they move)


def change_shard(
    client: EtcdClient, prefix: str, shard: int, change: str, node: str | None = None
) -> ShardAssignment:
    """``dflockd pin`` (``change`` "pin", to ``node`` or where it is) or ``unpin``."""
    if not 0 <= shard < SHARD_COUNT:
        raise ClusterOpError(f"shard {shard} is outside 0..{SHARD_COUNT - 1}")
    for _ in range(CHANGE_ATTEMPTS):
        view = _found(client, prefix)
        if node is not None and node not in view.members:
            # Pinned there, the shard would move out of its member towards nobody.
            live = ", ".join(sorted(view.members)) or "none"
            raise ClusterOpError(
                f"cannot pin shard {shard}: {node} is not a live member (live: {live}); "
                "give a member's --advertise address"
            )
        try:
            new_map = (
                view.shard_map.pin(shard, node) if change == "pin" else view.shard_map.unpin(shard)
            )
        except ValueError as exc:
            raise ClusterOpError(f"cannot {change} shard {shard}: {exc}") from None
        new = new_map[shard]
        write = ShardWrite(view.revisions.get(shard, 0), new)
        if write_shards(client, ClusterKeys(prefix).shards, {shard: write}).written:
            return new
    raise ClusterOpError(
        f"shard {shard} changed while being written, {CHANGE_ATTEMPTS} times: try again"
    )


def summary(view: ClusterView) -> list[str]:
    m = view.shard_map
    lines = [
        f"leader: {view.leader or '(none)'}",
        f"live members: {', '.join(sorted(view.members)) or '(none)'}",
        f"assigned shards: {len(m)} of {SHARD_COUNT}",
    ]
    serving = Counter(a.current for _, a in m.items() if a.current and not a.moving)
    for node, count in m.counts().items():
        state = "" if node in view.members else "  (not live)"
        lines.append(f"  {node}: target of {count}, serving {serving.get(node, 0)}{state}")
    lines.append(f"moving: {len(m.moves_in_progress())}")
    lines.append(f"pinned: {', '.join(map(str, m.pinned_shards())) or '(none)'}")
    if stranded := m.unavailable_pinned(view.members):
        lines.append(f"pinned to a node that is not live: {', '.join(map(str, stranded))}")
    if view.members:
        lines.append(f"a rebalance would move {len(m.rebalance_plan(view.members))} shard(s)")
    return lines


def _access(args: argparse.Namespace, environ: Mapping[str, str]) -> EtcdAccess:
    """The access settings of the server's (``settings``: flags, variables), a flag winning
    over its variable."""
    given: dict[str, str | None] = {}
    for field in ETCD_ACCESS:
        found = BY_FIELD[field].in_environment(environ)
        given[field] = getattr(args, field) or (found[1] if found is not None else None)
    check_pairs(given.get, ETCD_PASSWORDS)  # as the server's Config refuses both
    password, path = given["cluster_password"], given["cluster_password_file"]
    if path is not None:
        password = read_secret(path, names("cluster_password_file"), lambda s: s.rstrip("\r\n"))
    user = given["cluster_user"]
    check_user(user, has_password=password is not None)
    return EtcdAccess(
        given["cluster_ca_file"], given["cluster_cert"], given["cluster_key"], user, password
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflockd", description="Operate a dflockd cluster's shard map in etcd."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    url_help = (
        "the cluster: etcd://HOST:PORT[,HOST:PORT...][/PREFIX] (prefix default /dflockd; "
        "etcds:// for TLS)"
    )
    commands: dict[str, argparse.ArgumentParser] = {}
    for name in ("rebalance", "pin", "unpin", "shards"):
        p = commands[name] = sub.add_parser(name, help=CLUSTER_COMMAND_HELP[name][1])
        p.add_argument(_CLUSTER.flag, help=f"{url_help} (or {_CLUSTER.env[0]})")
        for field in ETCD_ACCESS:
            s = BY_FIELD[field]
            p.add_argument(s.flag, dest=field, metavar=s.metavar, help=f"{s.help} (or {s.env[0]})")
    p = commands["rebalance"]
    p.add_argument("--dry-run", action="store_true", help="show the moves, write nothing")
    p.add_argument("--verbose", action="store_true", help="list every shard moved")
    for name in ("pin", "unpin"):
        commands[name].add_argument("shard", type=int, metavar="SHARD")
    commands["pin"].add_argument("node", nargs="?", metavar="NODE", help="HOST:PORT to pin it onto")
    return parser


def cluster_command(
    argv: Sequence[str], *, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    """``dflockd rebalance|pin|unpin|shards --cluster URL ...``: 0 on success, 1 when it
    could not be done, 2 on bad usage."""
    out = out or sys.stdout
    err = err or sys.stderr
    args = _parser().parse_args(list(argv))
    found = _CLUSTER.in_environment(os.environ)
    url = args.cluster or (found[1] if found is not None else None)
    if url is None:
        print(
            f"dflockd {args.command}: give the cluster: {_CLUSTER.flag} URL or {_CLUSTER.env[0]} "
            f"(as the members have it; dflockd {args.command} --help)",
            file=err,
        )
        return 2
    try:
        client, prefix = etcd_client(url, _access(args, os.environ))
    except ValueError as exc:
        print(f"dflockd {args.command}: {exc}", file=err)
        return 2
    try:
        if args.command == "rebalance":
            result = rebalance(client, prefix, dry_run=args.dry_run)
            pairs = Counter((move.from_node or "(none)", move.to_node) for move in result.plan)
            for (source, target), count in sorted(pairs.items()):
                print(f"{source} -> {target}: {count} shard(s)", file=out)
            if args.verbose:
                for m in result.plan:
                    print(f"shard {m.shard}: {m.from_node or '(none)'} -> {m.to_node}", file=out)
            verb = "would move" if args.dry_run else "moved"
            done = len(result.plan) if args.dry_run else len(result.written)
            print(f"{verb} {done} shard(s)", file=out)
            if result.conflicted:
                print(
                    f"{len(result.conflicted)} shard(s) changed meanwhile and were left: "
                    "run rebalance again",
                    file=err,
                )
                return 1
        elif args.command in ("pin", "unpin"):
            node = args.node if args.command == "pin" else None
            new = change_shard(client, prefix, args.shard, args.command, node)
            print(f"shard {args.shard}: {new.format()}", file=out)
        else:
            for line in summary(_found(client, prefix)):
                print(line, file=out)
    except (EtcdError, ClusterOpError) as exc:
        print(f"dflockd {args.command}: {exc}", file=err)
        return 1
    return 0
