"""TLS over memory buffers: the server's own TLS layer, the same on every event loop.

A TLS connection is a plain TCP connection to the event loop; ``TlsSession`` turns the bytes
read from the socket into request bytes and reply bytes into bytes to send, through OpenSSL's
``ssl.SSLObject`` on two ``ssl.MemoryBIO`` buffers. Nothing here does I/O. Not the loop's own
TLS: its transports give each connection in its handshake a 256 KiB read buffer, so connections
that never finish their handshake grow the server; here a handshake costs its ``SSLObject``."""

from __future__ import annotations

import ssl
from typing import Final

READ_CHUNK: Final = 65536


class TlsSession:
    """Server side of one TLS connection, without I/O: after each call, ``outgoing()`` holds what it
    must send; an ``ssl.SSLError`` from any call means the peer broke the protocol: close it."""

    __slots__ = ("_incoming", "_object", "_outgoing", "handshake_done", "peer_closed")

    def __init__(self, context: ssl.SSLContext) -> None:
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._object = context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        self.handshake_done = False
        self.peer_closed = False  # the peer sent `close_notify`: no more requests can come

    def receive(self, data: bytes) -> bytes:
        """The plaintext ``data`` completes (until a ``close_notify``: then ``peer_closed``)."""
        self._incoming.write(data)
        if not self.handshake_done:
            try:
                self._object.do_handshake()
            except ssl.SSLWantReadError:
                return b""
            self.handshake_done = True
        chunks: list[bytes] = []
        try:
            while chunk := self._object.read(READ_CHUNK):
                chunks.append(chunk)
            self.peer_closed = True  # a close_notify (nothing to read yet raises SSLWantReadError)
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
        """The bytes of a ``close_notify`` alert, to send before closing (``b""``: none)."""
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
    ctx.load_cert_chain(cert, key, password=no_passphrase)
    return ctx


def no_passphrase() -> str:
    """``load_cert_chain``'s ``password``: OpenSSL's question for an encrypted key's
    passphrase, answered (it would ask on the terminal, or fail with ``EINVAL`` without one)."""
    raise ValueError(
        "the key is encrypted, and dflockd takes no passphrase: give it the key decrypted "
        "(openssl pkey -in KEY -out PLAIN.key), readable by the server's user alone"
    )
