"""The exception for each refusal a server answers, saying what happened and what to do."""

from __future__ import annotations

from collections.abc import Sequence

from celery_dflock.client import errors, wire
from celery_dflock.client._replies import ErrorReply, Moved, Reply
from celery_dflock.client._requests import Command
from celery_dflock.client._servers import auth_required_error
from celery_dflock.client._settings import Endpoint, lease_name
from celery_dflock.client.cluster import ShardsInfo
from celery_dflock.client.sharding import Routing, server_identity


def describe_lock(key: str, limit: int | None = None) -> str:
    return f"lock {key!r}" if limit is None else f"semaphore {key!r} (limit {limit})"


def refusal_error(
    command: Command,
    reply: Reply,
    *,
    what: str,
    endpoint: Endpoint,
    limit: int | None = None,
    lease_ttl_s: int | None = None,
) -> errors.DflockError:
    """The error for ``reply``, a refusal, or a reply ``command`` does not take."""
    if not isinstance(reply, ErrorReply):
        return errors.ProtocolError(f"unexpected reply {reply!r} to {command.label}")
    where = endpoint.address
    code = reply.code
    if code == wire.STATUS_ERROR_MAX_LOCKS:
        return errors.MaxLocksError(
            f"server {where} refused {what}: it already tracks its maximum number of "
            "keys, or this connection or this client address holds its share of them; "
            "raise its --max-locks (DFLOCKD_MAX_LOCKS), --max-locks-per-ip (its log names an "
            "address that reached it) or --max-locks-per-connection, or use fewer keys at once"
        )
    if code == wire.STATUS_ERROR_MAX_WAITERS:
        return errors.MaxWaitersError(
            f"server {where} refused to queue on {what}: too many waiters already; "
            "raise its --max-waiters (DFLOCKD_MAX_WAITERS) or use a shorter acquire timeout"
        )
    if code == wire.STATUS_ERROR_LIMIT_MISMATCH:
        if limit is None:
            return errors.LimitMismatchError(
                f"{what} on {where} was refused: the key is in use as a semaphore "
                "(a limit other than 1), and a lock is a semaphore of limit 1 on the same "
                "key, so the two exclude each other; use another key for the lock, or the "
                "same limit everywhere the key is used, or wait until the key is idle"
            )
        return errors.LimitMismatchError(
            f"{what} on {where} was refused: the key is in use with a limit other "
            f"than {limit} (as a lock, limit 1, or a semaphore of another limit); "
            "every user of a key must pass the same limit (or wait until the key is idle)"
        )
    if code == wire.STATUS_ERROR_AUTH:
        return auth_required_error(endpoint)
    if code == wire.STATUS_ERROR_DRAINING:
        return errors.ServerDraining(
            f"server {where} is shutting down and refused {command.label} for "
            f"{what}; retry once it (or its replacement) is running"
        )
    if code == wire.STATUS_ERROR_ALREADY_ENQUEUED:
        return errors.DflockError(
            f"{what} is already enqueued on this connection; call wait() instead"
        )
    if code == wire.STATUS_ERROR_NOT_ENQUEUED:
        return errors.LockNotOwned(f"{what} is not enqueued on {where}: call enqueue() first")
    if code == wire.STATUS_ERROR_UNAVAILABLE:
        return errors.ServerUnavailable(
            f"no cluster member serves {what} right now ({where} answered "
            f"{code!r} to {command.label}: its shard is changing hands, or the member cannot "
            "reach etcd); retry shortly"
        )
    if code == wire.STATUS_ERROR_READ_ONLY:
        return errors.ServerReadOnly(
            f"server {where} refused {command.label} for {what}: it cannot write its lease "
            "journal (a full or failing disk under its --state-dir), so it grants nothing new "
            "until it can (locks held stay held while it answers their renewals); retry "
            "shortly, and free space on the server's disk"
        )
    lease = ""
    if lease_ttl_s is not None and code == wire.STATUS_ERROR:
        lease = (
            f", or the lease asked for ({lease_ttl_s} s, {lease_name(lease_ttl_s)}) is "
            "above its --max-lease-ttl (DFLOCKD_MAX_LEASE_TTL_S, default "
            f"{wire.DEFAULT_MAX_LEASE_TTL_S} s): ask for a shorter lease (renewal "
            "keeps it held) or raise the server's limit"
        )
    return errors.ProtocolError(
        f"server {where} answered {code!r} to {command.label} for {what}: it found "
        "the request malformed or does not know the command (an older dflockd server?)"
        f"{lease}"
    )


def mismatch_error(
    reply: Reply,
    shards: dict[str, object] | None,
    *,
    what: str,
    where: str,
    servers: Sequence[tuple[str, int]],
    strategy: Routing,
) -> errors.DflockError:
    """A list-mode client was redirected: the server ``where`` has another view of where keys
    live (``shards``: its answer to ``shards``)."""
    ours = ",".join(server_identity(server) for server in servers)
    named = getattr(strategy, "__name__", None) or repr(strategy)
    redirect = f"error_moved {reply.address}" if isinstance(reply, Moved) else "error_unavailable"
    try:
        info = None if shards is None else ShardsInfo.parse(shards, where)
    except errors.ProtocolError:
        info = None
    if info is not None and info.mode == wire.MODE_CLUSTER:
        return errors.ShardingMismatchError(
            f"server {where} is a member of a cluster (dflockd --cluster) and answered "
            f"{redirect} for {what}, but this client shards keys itself over "
            f"servers={ours} (strategy {named}; in Celery the `dflock_servers` setting): "
            "use sharding_strategy='cluster' (in Celery dflock_sharding_strategy = "
            '"cluster"), the servers then being seeds of the cluster'
        )
    theirs = ",".join(info.members) if info is not None and info.members else "unknown"
    self_name = info.self_address if info is not None else None
    return errors.ShardingMismatchError(
        f"server {where} refused {what} ({redirect}): it was started with "
        f"--members {theirs}"
        + (f" --advertise {self_name}" if self_name else "")
        + f" and serves only its crc32 share of that list, but this client's servers are "
        f"{ours} (sharding strategy {named}; in Celery the `dflock_servers` setting). "
        "List the same servers in the same order on both sides (servers= / "
        "dflock_servers and every server's --members / DFLOCKD_MEMBERS), with the default "
        "stable_hash_shard strategy"
    )
