"""The dflockd wire protocol, without I/O.

Requests are built by the ``encode_*`` functions (they validate keys, tokens and numbers and
return the exact bytes to send). Replies are decoded by `ReplyParser`, which is fed bytes as they
arrive (in any chunking) and hands out one typed reply per complete line, checked against the
command it answers::

    parser = ReplyParser()
    sock.sendall(encode_ping())
    while (reply := parser.next_reply(Command.PING)) is None:
        parser.feed(sock.recv(4096))
    # reply is Ok() or ErrorReply(code)

Anything that is not a valid reply to that command raises `ProtocolError` naming what arrived.

The requests are built in `celery_dflock.client._requests`, the replies read in
`celery_dflock.client._replies`; this module is their one public face.
"""

from __future__ import annotations

from celery_dflock.client._replies import (
    MAX_STATS_LINE_BYTES,
    Asked,
    Bound,
    ErrorReply,
    Freed,
    Granted,
    Hello,
    Moved,
    Ok,
    Queued,
    Renewed,
    Reply,
    ReplyParser,
    Shards,
    Stats,
    TimedOut,
    decode_reply,
)
from celery_dflock.client._requests import (
    MAX_KEY_BYTES,
    Command,
    encode_asking,
    encode_auth,
    encode_force_release,
    encode_hello,
    encode_join_session,
    encode_keepalive,
    encode_note,
    encode_ping,
    encode_sem_release,
    encode_sem_wait,
    encode_shards,
    encode_stats,
    encode_wait,
    fence_of,
    validate_key,
    validate_note,
    validate_token,
)

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_STATS_LINE_BYTES",
    "Asked",
    "Bound",
    "Command",
    "ErrorReply",
    "Freed",
    "Granted",
    "Hello",
    "Moved",
    "Ok",
    "Queued",
    "Renewed",
    "Reply",
    "ReplyParser",
    "Shards",
    "Stats",
    "TimedOut",
    "decode_reply",
    "encode_asking",
    "encode_auth",
    "encode_force_release",
    "encode_hello",
    "encode_join_session",
    "encode_keepalive",
    "encode_note",
    "encode_ping",
    "encode_sem_release",
    "encode_sem_wait",
    "encode_shards",
    "encode_stats",
    "encode_wait",
    "fence_of",
    "validate_key",
    "validate_note",
    "validate_token",
]
