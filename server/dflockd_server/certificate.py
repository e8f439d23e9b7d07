"""The certificate a TLS server serves, watched: ``ServedCertificate``, the context made from
``--tls-cert`` and ``--tls-key``, made again when the files change (the server's loop asks every
``--tls-reload-interval``: cert-manager rewrites them before they expire); a pair that does not
load is logged and the previous one stays. ``validity``: when the PEM's first certificate
starts and ends, by a small DER walk (the server depends on no X.509 library)."""

from __future__ import annotations

import base64
import calendar
import logging
import os
import time
from typing import Final

from dflockd_server.tls import build_ssl_context

log = logging.getLogger("dflockd_server")

EXPIRY_WARNING_S: Final = 14 * 86400
"""A certificate is warned about (at the start and each reload) once it has less than this left,
or less than a third of its life (when renewals are due: cert-manager's default, certbot's)."""
_UTC_TIME, _GENERALIZED_TIME, _VERSION = 0x17, 0x18, 0xA0


def _element(der: bytes, at: int) -> tuple[int, int, int]:
    """The tag, the start and the end of the contents of the DER element at ``at``."""
    length, start = der[at + 1], at + 2
    if length & 0x80:  # long form: the next (length & 0x7F) bytes hold it
        start += length & 0x7F
        length = int.from_bytes(der[at + 2 : start], "big")
    return der[at], start, start + length


def _time(tag: int, text: str) -> float:
    if tag == _UTC_TIME:  # YYMMDDHHMMSSZ: years 50 to 99 are 19xx (RFC 5280)
        text = ("19" if text[:2] >= "50" else "20") + text
    elif tag != _GENERALIZED_TIME:
        raise ValueError(f"its validity holds no UTCTime or GeneralizedTime (tag {tag:#x})")
    return calendar.timegm(time.strptime(text, "%Y%m%d%H%M%SZ"))


def validity(pem: bytes) -> tuple[float, float]:
    """When the first certificate of ``pem`` starts and ends (notBefore, notAfter), in seconds
    since the epoch; ``ValueError`` when there is none to read."""
    begin, end = b"-----BEGIN CERTIFICATE-----", b"-----END CERTIFICATE-----"
    first, last = pem.find(begin), pem.find(end)
    if not 0 <= first < last:
        raise ValueError("no PEM certificate in it")
    der = base64.b64decode(pem[first + len(begin) : last])
    try:
        at = _element(der, _element(der, 0)[1])[1]  # into the Certificate, its tbsCertificate
        for _ in range(4 if der[at] == _VERSION else 3):  # [0] version, serial, signature, issuer
            at = _element(der, at)[2]
        tag, start, stop = _element(der, _element(der, at)[1])  # into the validity
        tag_after, start_after, stop_after = _element(der, stop)
    except IndexError:
        raise ValueError("the certificate's DER is cut short") from None
    return (
        _time(tag, der[start:stop].decode("ascii")),
        _time(tag_after, der[start_after:stop_after].decode("ascii")),
    )


class ServedCertificate:
    """The context new TLS handshakes take, and its certificate's validity (see the module's
    doc)."""

    def __init__(self, cert: str, key: str) -> None:
        self.cert, self.key = cert, key
        self._seen = self._files()
        self.context = build_ssl_context(cert, key)  # a bad pair at the start: the start fails
        self.validity = self._validity()

    def _files(self) -> tuple[int, ...] | None:
        """What tells a rewrite of the files: their inodes, sizes and modification times."""
        try:
            stats = [os.stat(self.cert), os.stat(self.key)]
        except OSError:
            return None  # gone for now: loaded again, and the error logged, once it is back
        return tuple(n for s in stats for n in (s.st_ino, s.st_size, s.st_mtime_ns))

    def _validity(self) -> tuple[float, float] | None:
        """When the certificate starts and ends (None: unreadable), with a warning when its
        renewal is due (`EXPIRY_WARNING_S`)."""
        try:
            with open(self.cert, "rb") as file:
                starts, expires = validity(file.read())
        except (OSError, ValueError) as exc:
            log.warning("TLS: cannot read when %s expires (%s)", self.cert, exc)
            return None
        if (left := expires - time.time()) < min(EXPIRY_WARNING_S, (expires - starts) / 3):
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(expires))
            log.warning(
                "TLS: the certificate in %s %s: renew it in place (with cert-manager, `kubectl "
                "describe certificate` says why it was not renewed yet); new connections get the "
                "new one within --tls-reload-interval of the change, no restart needed",
                self.cert,
                f"expires at {when}, in {left / 86400:.1f} days"
                if left > 0
                else f"expired at {when}: TLS clients refuse it",
            )
        return starts, expires

    def reload(self) -> bool:
        """Load the files again if they changed since last seen; whether ``context`` is new."""
        if (seen := self._files()) == self._seen:
            return False
        self._seen = seen
        try:
            context = build_ssl_context(self.cert, self.key)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            log.error(
                "TLS: cannot load the new %s / %s: %s; the previous certificate is still served, "
                "and they are loaded again at their next change",
                self.cert,
                self.key,
                exc,
            )
            return False
        log.info("TLS: new connections get the new certificate in %s", self.cert)
        self.context, self.validity = context, self._validity()
        return True
