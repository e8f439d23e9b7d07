"""The certificate files a TLS server serves, watched: a rotation on disk reaches new
connections without a restart while open ones keep theirs, a broken rewrite keeps the previous
certificate served and says so, and a certificate that expires soon is warned about and
exported; on ``dflockd`` started as users start it, with real TLS clients."""

from __future__ import annotations

import os
import shutil
import ssl
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dflockd_server.certificate import validity
from tests.support.certificates import (
    key_of,
    make_certificate,
    make_dated_certificate,
    openssl_not_after,
)
from tests.support.ports import free_port
from tests.support.servers import DflockdProcess
from tests.support.wire import Wire

Start = Callable[..., DflockdProcess]
RELOAD_INTERVAL = "0.2"  # --tls-reload-interval: seconds between looks at the files
NEW_CERTIFICATE = "new connections get the new certificate"
NOT_LOADED = "cannot load the new"


def _serve(dflockd_process: Start, cert: Path, key: Path, *args: str) -> DflockdProcess:
    return dflockd_process(
        "--host", "127.0.0.1", "--port", "0", "--tls-cert", str(cert), "--tls-key", str(key),
        "--tls-reload-interval", RELOAD_INTERVAL, *args,
    )  # fmt: skip


def _trusting(*certs: Path) -> ssl.SSLContext:
    context = ssl.create_default_context()
    for cert in certs:
        context.load_verify_locations(cert)
    return context


def _der(cert: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(cert.read_text())


def _shown(wire: Wire) -> bytes:
    """The certificate (DER) the server showed ``wire`` in its handshake."""
    assert isinstance(wire.sock, ssl.SSLSocket)
    shown = wire.sock.getpeercert(binary_form=True)
    assert shown is not None
    return shown


def _served(address: tuple[str, int], *trusted: Path) -> bytes:
    """The certificate a new TLS connection gets now."""
    with Wire(address, ssl_context=_trusting(*trusted)) as wire:
        assert wire.req("ping") == "ok"
        return _shown(wire)


def _mount(secret: Path, version: str, cert: Path) -> None:
    """``cert`` and its key as a Kubernetes secret volume shows them: ``tls.crt`` and
    ``tls.key`` link through ``..data`` to a directory of this version, and a new version is
    swapped in whole by renaming ``..data`` (the kubelet's atomic writer; cert-manager renews)."""
    (secret / version).mkdir(parents=True)
    shutil.copy(cert, secret / version / "tls.crt")
    shutil.copy(key_of(cert), secret / version / "tls.key")
    (secret / "..data_tmp").symlink_to(version)
    os.replace(secret / "..data_tmp", secret / "..data")
    for name in ("tls.crt", "tls.key"):
        if not (secret / name).is_symlink():
            (secret / name).symlink_to(f"..data/{name}")


def test_a_certificate_rotated_on_disk_reaches_new_connections_and_open_ones_keep_theirs(
    dflockd_process: Start, tmp_path: Path
) -> None:
    old, new = make_certificate(tmp_path, "old"), make_certificate(tmp_path, "new")
    secret = tmp_path / "secret"
    _mount(secret, "..v1", old)
    proc = _serve(dflockd_process, secret / "tls.crt", secret / "tls.key")
    address = proc.wait_listening()
    assert _served(address, old, new) == _der(old)
    with Wire(address, ssl_context=_trusting(old)) as held:
        token = held.lock("k")
        _mount(secret, "..v2", new)
        assert str(secret / "tls.crt") in proc.wait_for(NEW_CERTIFICATE)
        assert _served(address, old, new) == _der(new)
        # The connection opened before keeps its session, its certificate and its lock.
        assert held.req("n", "k", f"{token} 5") == "ok 5"
        assert _shown(held) == _der(old)
        assert held.req("r", "k", token) == "ok"
    assert not any(NOT_LOADED in line for line in proc.drain()), proc.lines


def test_a_broken_rewrite_keeps_the_previous_certificate_served_and_is_logged(
    dflockd_process: Start, tmp_path: Path
) -> None:
    old, new = make_certificate(tmp_path, "old"), make_certificate(tmp_path, "new")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(old, cert)
    shutil.copy(key_of(old), key)
    proc = _serve(dflockd_process, cert, key)
    address = proc.wait_listening()
    cert.write_bytes(new.read_bytes()[:200])  # half written
    said = proc.wait_for(NOT_LOADED)
    assert "ERROR" in said and str(cert) in said and str(key) in said, said
    assert "the previous certificate is still served" in said, said
    assert _served(address, old, new) == _der(old)
    cert.write_bytes(new.read_bytes())  # whole now, but the key is still the old certificate's
    proc.wait_for(NOT_LOADED)
    assert _served(address, old, new) == _der(old)
    key.write_bytes(key_of(new).read_bytes())  # the pair matches: loaded at this next change
    proc.wait_for(NEW_CERTIFICATE)
    assert _served(address, old, new) == _der(new)


def test_a_certificate_due_for_renewal_is_warned_about_at_start_and_exported(
    dflockd_process: Start, tmp_path: Path
) -> None:
    now = int(time.time())
    starts, expires = now - 20 * 86400, now + 3 * 86400  # 3 days left of 23: renewal is due
    cert = make_dated_certificate(tmp_path, starts, expires)
    metrics_port = free_port()
    proc = _serve(dflockd_process, cert, key_of(cert), "--metrics-port", str(metrics_port))
    warning = proc.wait_for("TLS: the certificate in")
    assert "WARNING" in warning and str(cert) in warning, warning
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(expires))
    assert f"expires at {when}, in 3.0 days" in warning, warning
    assert "renew it in place" in warning, warning
    proc.wait_listening()
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        families = {f.name: f for f in text_string_to_metric_families(reply.read().decode())}
    for name, value in (("expiry", expires), ("start", starts)):
        gauge = families[f"dflockd_tls_certificate_{name}_timestamp_seconds"]
        assert gauge.type == "gauge"
        assert [sample.value for sample in gauge.samples] == [value]


def test_an_expired_certificate_is_warned_about_at_start(
    dflockd_process: Start, tmp_path: Path
) -> None:
    now = int(time.time())
    expired = now - 86400
    cert = make_dated_certificate(tmp_path, now - 30 * 86400, expired)
    proc = _serve(dflockd_process, cert, key_of(cert))
    warning = proc.wait_for("TLS: the certificate in")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(expired))
    assert "WARNING" in warning and f"expired at {when}: TLS clients refuse it" in warning
    proc.wait_listening()  # it serves: a client that does not verify may still connect


def test_a_short_lived_certificate_is_not_warned_about_before_its_renewal_is_due(
    dflockd_process: Start, tmp_path: Path
) -> None:
    # A day-long certificate (cert-manager's short-lived ones) has less than 14 days left from
    # the start, but two thirds of its life: no renewal is due, no warning. Another certificate
    # whose last third has begun is, once it is served.
    cert = make_certificate(tmp_path, days=1)
    proc = _serve(dflockd_process, cert, key_of(cert))
    proc.wait_listening()  # every line logged until it listens
    assert not [line for line in proc.lines if "TLS: the certificate in" in line], proc.lines
    now = int(time.time())
    dated = make_dated_certificate(tmp_path, now - 2 * 3600, now + 3600)  # 1 h left of 3
    shutil.copy(dated, cert)
    shutil.copy(key_of(dated), key_of(cert))
    proc.wait_for(NEW_CERTIFICATE)
    warning = proc.wait_for("TLS: the certificate in")
    assert "WARNING" in warning and "in 0.0 days" in warning, warning


@pytest.mark.parametrize(
    ("days", "tag", "layout"),
    [(1, 0x17, "%y%m%d%H%M%SZ"), (15000, 0x18, "%Y%m%d%H%M%SZ")],
    ids=["UTCTime", "GeneralizedTime past 2050"],
)
def test_the_expiry_is_read_from_either_time_type(
    tmp_path: Path, days: int, tag: int, layout: str
) -> None:
    cert = make_certificate(tmp_path, days=days)
    expires = openssl_not_after(cert)
    encoded = time.strftime(layout, time.gmtime(expires)).encode()
    assert bytes([tag, len(encoded)]) + encoded in _der(cert)  # the certificate has that type
    assert validity(cert.read_bytes())[1] == expires
    # A chain: the first certificate's (the one served).
    chain = cert.read_bytes() + make_certificate(tmp_path, "other", days=9).read_bytes()
    assert validity(chain)[1] == expires
