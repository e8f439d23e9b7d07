"""Requests about a grant named by its token, without a lock object (no I/O here): release,
renew, detach, note and force release, each one request and its reply, built and read here
and sent by the shells over a pooled connection to the key's server. Their key comes checked;
the rest is checked here, where it enters.
"""

from __future__ import annotations

from celery_dflock.client import _replies, _requests, wire
from celery_dflock.client._refusals import describe_lock, refusal_error
from celery_dflock.client._replies import ErrorReply, Freed, Moved, Renewed, Reply
from celery_dflock.client._requests import (
    Command,
    checked_hand_down,
    checked_release,
    checked_renew,
)
from celery_dflock.client._servers import ServerInfo, require_force_release, require_holds
from celery_dflock.client._settings import REPLY_GRACE_S, Endpoint, lease_seconds
from celery_dflock.client.errors import ForceReleaseUnsupported, ProtocolError, ServerUnavailable

Request = tuple[Command, bytes, float]
"""What a request is to the shells: (command, bytes, reply timeout)."""


def release_request(key: str, token: str, limit: int | None = None) -> Request:
    """``r <token>`` (``sr`` for a semaphore's slot)."""
    token = _requests.validate_token(token)
    if limit is None:
        return Command.RELEASE, checked_release(key, token), REPLY_GRACE_S
    return Command.SEM_RELEASE, _requests.encode_sem_release(key, token), REPLY_GRACE_S


def released(reply: Reply) -> bool:
    """The reply to `release_request`: True if the server released the grant, False if it
    no longer held it."""
    return isinstance(reply, _replies.Ok)


def renew_request(key: str, token: str, lease_ttl: int) -> Request:
    """``n <token> <lease>``: renew a grant to ``lease_ttl`` seconds from now."""
    token, lease = _requests.validate_token(token), lease_seconds("lease_ttl", lease_ttl)
    data = checked_renew(key, token, lease, semaphore=False)
    return Command.RENEW, data, REPLY_GRACE_S


def detach_request(
    server: ServerInfo | None, where: str, key: str, token: str, lease_ttl: int
) -> Request:
    """``hd <token> <lease>``: detach a grant from the connection it is bound to
    (`HoldsUnsupported` unless ``server``, at ``where``, has holds)."""
    require_holds(server, where, describe_lock(key))
    token, lease = _requests.validate_token(token), lease_seconds("lease_ttl", lease_ttl)
    data = checked_hand_down(key, token, lease)
    return Command.HAND_DOWN, data, REPLY_GRACE_S


def note_request(server: ServerInfo | None, where: str, key: str, token: str, note: str) -> Request:
    """``note <token> <note>`` (`HoldsUnsupported` unless ``server``, at ``where``, has
    holds)."""
    require_holds(server, where, describe_lock(key))
    return Command.NOTE, _requests.encode_note(key, token, note), REPLY_GRACE_S


def force_release_request(
    server: ServerInfo | None, where: str, key: str, note: str | None
) -> Request:
    """``fr <note>``: free every grant on ``key``, whoever holds it (`ForceReleaseUnsupported`
    unless ``server``, at ``where``, lists it). ``key`` and ``note`` are checked."""
    require_force_release(server, where)
    return Command.FORCE_RELEASE, _requests.encode_force_release(key, note), REPLY_GRACE_S


def freed(command: Command, reply: Reply, key: str, endpoint: Endpoint) -> int:
    """The reply to `force_release_request`: how many grants it freed; raises for a refusal
    (a server that knows no ``fr`` answers ``error``: `ForceReleaseUnsupported`)."""
    if isinstance(reply, Freed):
        return reply.grants
    if isinstance(reply, ErrorReply) and reply.code == wire.STATUS_ERROR:
        raise ForceReleaseUnsupported(
            f"server {endpoint.address} refused the force release of {describe_lock(key)} "
            "('error'): it does not know the request (a server that predates it)"
        )
    if isinstance(reply, ErrorReply):
        raise refusal_error(command, reply, what=describe_lock(key), endpoint=endpoint)
    if isinstance(reply, Moved):
        raise ServerUnavailable(
            f"the cluster's members kept redirecting the force release of {describe_lock(key)} "
            f"(last to {reply.address}): its shard is moving; try again in a moment"
        )
    raise ProtocolError(f"unexpected reply {reply!r} to {command.label}")


def done(command: Command, reply: Reply, key: str, endpoint: Endpoint) -> bool:
    """The reply to `renew_request`, `detach_request` or `note_request`: True done, False
    when the token no longer holds the key; raises for other refusals."""
    if isinstance(reply, Renewed | _replies.Ok):
        return True
    if isinstance(reply, ErrorReply) and reply.code == wire.STATUS_ERROR:
        return False
    if isinstance(reply, ErrorReply):
        raise refusal_error(command, reply, what=describe_lock(key), endpoint=endpoint)
    raise ProtocolError(f"unexpected reply {reply!r} to {command.label}")
