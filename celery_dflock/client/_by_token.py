"""Requests about a grant named by its token, without a lock object (no I/O here): release, renew,
detach, note and force release, built and read here. What they carry comes checked, but for a
release's token (checked here); a lease is also checked here against the server's longest lease."""

from __future__ import annotations

from celery_dflock.client import _replies, _requests, wire
from celery_dflock.client._refusals import describe_lock, refusal_error
from celery_dflock.client._requests import Command
from celery_dflock.client._servers import (
    ServerInfo,
    check_lease,
    require_force_release,
    require_holds,
)
from celery_dflock.client._settings import REPLY_GRACE_S, Endpoint
from celery_dflock.client.errors import ForceReleaseUnsupported, ServerUnavailable

Request = tuple[Command, bytes, float]  # (command, bytes, reply timeout)


def release_request(key: str, token: str, *, semaphore: bool = False) -> Request:
    token = _requests.validate_token(token)
    if semaphore:
        return Command.SEM_RELEASE, _requests.checked_sem_release(key, token), REPLY_GRACE_S
    return Command.RELEASE, _requests.checked_release(key, token), REPLY_GRACE_S


def renew_request(
    server: ServerInfo | None, where: str, key: str, token: str, lease_ttl: int
) -> Request:
    check_lease(server, where, describe_lock(key), lease_ttl)
    data = _requests.checked_renew(Command.RENEW, key, token, lease_ttl)
    return Command.RENEW, data, REPLY_GRACE_S


def detach_request(
    server: ServerInfo | None, where: str, key: str, token: str, lease_ttl: int
) -> Request:
    require_holds(server, where, describe_lock(key))
    check_lease(server, where, describe_lock(key), lease_ttl)
    return Command.HAND_DOWN, _requests.checked_hand_down(key, token, lease_ttl), REPLY_GRACE_S


def note_request(server: ServerInfo | None, where: str, key: str, token: str, note: str) -> Request:
    require_holds(server, where, describe_lock(key))
    return Command.NOTE, _requests.checked_note(key, token, note), REPLY_GRACE_S


def force_release_request(
    server: ServerInfo | None, where: str, key: str, note: str | None
) -> Request:
    require_force_release(server, where)
    return Command.FORCE_RELEASE, _requests.checked_force_release(key, note), REPLY_GRACE_S


def freed(command: Command, reply: _replies.Reply, key: str, endpoint: Endpoint) -> int:
    """How many grants a force release freed; raises for a refusal."""
    if isinstance(reply, _replies.Freed):
        return reply.grants
    if isinstance(reply, _replies.Moved | _replies.Asked) or command is Command.ASKING:
        raise ServerUnavailable(
            f"the cluster's members kept redirecting the force release of {describe_lock(key)} "
            f"(last from {endpoint.address}): its shard is moving; try again in a moment"
        )
    if isinstance(reply, _replies.ErrorReply) and reply.code == wire.STATUS_ERROR:
        raise ForceReleaseUnsupported(
            f"server {endpoint.address} refused the force release of {describe_lock(key)} "
            "('error'): it does not know the request (a server that predates it)"
        )
    raise refusal_error(command, reply, what=describe_lock(key), endpoint=endpoint)


def done(command: Command, reply: _replies.Reply, key: str, endpoint: Endpoint) -> bool:
    """True done, False when the token no longer holds the key; raises for other refusals."""
    if isinstance(reply, _replies.Renewed | _replies.Ok):
        return True
    if isinstance(reply, _replies.ErrorReply) and reply.code == wire.STATUS_ERROR:
        return False
    raise refusal_error(command, reply, what=describe_lock(key), endpoint=endpoint)
