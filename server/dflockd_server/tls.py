"""TLS over memory buffers: the server's own TLS layer, the same on every event loop.

A TLS connection is a plain TCP connection to the event loop; ``TlsSession`` turns the bytes
read from the socket into request bytes and reply bytes into bytes to send, through OpenSSL's
``ssl.SSLObject`` on two ``ssl.MemoryBIO`` buffers. Nothing here does I/O.

Not the loop's own TLS (``create_server(ssl=...)``): its transports give a connection in its
handshake a 256 KiB read buffer (asyncio's and uvloop's), which uvloop did not all give back:
waves of 3,000 connections that never finished their handshake grew the server by about 45 MiB
a wave on uvloop, to about 1 GiB on asyncio's. Here a handshake costs its ``SSLObject``
(OpenSSL allocates record buffers as bytes arrive) and the bytes sent, all returned at the
close; the server caps handshakes under way (``max_tls_handshakes``) and their time
(``tls_handshake_timeout_s``).
"""

from __future__ import annotations

import ssl
from typing import Final

READ_CHUNK: Final = 65536
"""Most plaintext bytes taken from the TLS session at a time."""


class TlsSession:
    """Server side of one TLS connection, without I/O.

    ``receive(data)`` takes bytes read from the socket and returns the plaintext they complete
    (``b""`` while the handshake is under way or a record is incomplete); ``send(plaintext)``
    returns the bytes to write. After each call, ``outgoing()`` holds what the session itself
    must send (handshake messages, session tickets, alerts). ``ssl.SSLError`` from any call
    means the peer broke the protocol: close the connection.
    """

    __slots__ = ("_incoming", "_object", "_outgoing", "handshake_done", "peer_closed")

    def __init__(self, context: ssl.SSLContext) -> None:
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._object = context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        self.handshake_done = False
        self.peer_closed = False
        """The peer sent ``close_notify``: no more requests can come."""

    def receive(self, data: bytes) -> bytes:
        """The plaintext that ``data`` completes (what came before a ``close_notify``, which
        sets ``peer_closed``)."""
        self._incoming.write(data)
        if not self.handshake_done:
            try:
                self._object.do_handshake()
            except ssl.SSLWantReadError:
                return b""
            self.handshake_done = True
        chunks: list[bytes] = []
        try:
            while True:
                chunk = self._object.read(READ_CHUNK)
                if not chunk:
                    # Python's SSLObject.read answers a close_notify with b"" (it raises
                    # SSLZeroReturnError only where OpenSSL saw no clean shutdown); with
                    # nothing to read yet it raises SSLWantReadError instead.
                    self.peer_closed = True
                    break
                chunks.append(chunk)
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLZeroReturnError:
            self.peer_closed = True
        return b"".join(chunks)

    def send(self, plaintext: bytes) -> bytes:
        """The bytes that carry ``plaintext`` to the peer (with whatever was pending)."""
        self._object.write(plaintext)
        return self._outgoing.read()

    def outgoing(self) -> bytes:
        """Bytes the session wants sent (handshake messages, alerts); ``b""`` when none."""
        return self._outgoing.read() if self._outgoing.pending else b""

    def close_notify(self) -> bytes:
        """The bytes of a ``close_notify`` alert, to send before closing (``b""`` if the
        session cannot send one: its handshake never finished, or it is broken)."""
        if not self.handshake_done:
            return b""
        try:
            self._object.unwrap()
        except ssl.SSLWantReadError:
            pass  # our alert is written; the peer's answer is not waited for
        except (ssl.SSLError, ValueError):
            return b""
        return self._outgoing.read()


def build_ssl_context(cert: str, key: str) -> ssl.SSLContext:
    """A server-side TLS context from PEM files (TLS 1.2 or newer)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    return ctx
