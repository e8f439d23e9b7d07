"""Shared-secret ``auth`` and TLS, over real sockets."""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import ipaddress
import shutil
import ssl
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from dflock_wire import Wire

from dflockd_server import constants
from dflockd_server.testing import ServerThread

ServerFactory = Callable[..., ServerThread]
SECRET = "correct horse battery staple"


def test_auth_required_before_anything_else(dflock_server_factory: ServerFactory) -> None:
    srv = dflock_server_factory(auth_token=SECRET)
    with Wire(srv.address) as w:
        assert w.req("ping") == "error_auth"
        assert w.closed_by_server()
    with Wire(srv.address) as w:
        assert w.req("bogus", "", "") == "error_auth"  # even a malformed request
        assert w.closed_by_server()


def test_wrong_secret_is_refused_and_closed(dflock_server_factory: ServerFactory) -> None:
    srv = dflock_server_factory(auth_token=SECRET)
    with Wire(srv.address) as holder:
        assert holder.req("auth", "_", SECRET) == "ok"
        token = holder.lock("k")
        with Wire(srv.address) as w:
            assert w.req("auth", "_", SECRET + "x") == "error_auth"
            assert w.closed_by_server()
        with Wire(srv.address) as w:
            assert w.req("auth", "_", "") == "error_auth"
            assert w.closed_by_server()
        assert holder.req("n", "k", f"{token} 5") == "ok 5"


def test_right_secret_then_commands(dflock_server_factory: ServerFactory) -> None:
    srv = dflock_server_factory(auth_token=SECRET)
    with Wire(srv.address) as w:
        assert w.req("auth", "_", SECRET) == "ok"
        token = w.lock("k")
        assert w.req("r", "k", token) == "ok"
        assert w.req("auth", "_", SECRET) == "ok"  # re-authenticating is harmless


def test_auth_without_a_configured_secret_is_an_error(dflock_server: ServerThread) -> None:
    with Wire(dflock_server.address) as w:
        assert w.req("auth", "_", "anything") == "error"
        assert w.req("ping") == "ok"


def test_secret_of_64_kib_and_secret_file(
    dflock_server_factory: ServerFactory, tmp_path: Path
) -> None:
    long_secret = "s" * constants.MAX_AUTH_LINE_BYTES
    path = tmp_path / "secret"
    path.write_text(long_secret + "\n")
    srv = dflock_server_factory(auth_token_file=str(path))
    with Wire(srv.address) as w:
        assert w.req("auth", "_", long_secret) == "ok"
        assert w.req("ping") == "ok"
    with Wire(srv.address) as w:
        w.send("auth", "_", long_secret + "ss")  # over the auth line limit
        assert w.recv() == "error"
        assert w.closed_by_server()


# ---------------------------------------------------------------------------------- TLS
def _self_signed_with_cryptography(cert: Path, key: Path) -> None:
    x509: Any = importlib.import_module("cryptography.x509")
    hashes: Any = importlib.import_module("cryptography.hazmat.primitives.hashes")
    ec: Any = importlib.import_module("cryptography.hazmat.primitives.asymmetric.ec")
    serialization: Any = importlib.import_module("cryptography.hazmat.primitives.serialization")
    oid: Any = importlib.import_module("cryptography.x509.oid")
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(oid.NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(private, hashes.SHA256())
    )
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _self_signed_with_openssl(cert: Path, key: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("neither the cryptography package nor the openssl CLI is available")
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    if importlib.util.find_spec("cryptography") is not None:
        _self_signed_with_cryptography(cert, key)
    else:
        _self_signed_with_openssl(cert, key)
    return cert, key


def test_tls_with_auth(dflock_server_factory: ServerFactory, tls_files: tuple[Path, Path]) -> None:
    cert, key = tls_files
    srv = dflock_server_factory(tls_cert=str(cert), tls_key=str(key), auth_token=SECRET)
    ctx = ssl.create_default_context(cafile=str(cert))
    with Wire(srv.address, ssl_context=ctx) as w:
        assert w.req("auth", "_", SECRET) == "ok"
        token = w.lock("k")
        assert w.req("r", "k", token) == "ok"
    # A plain-text client gets nowhere.
    with Wire(srv.address) as plain:
        plain.send("ping")
        try:
            reply = plain.reader.readline()
        except ConnectionResetError:
            reply = b""
        assert not reply.startswith(b"ok")
    # A client that does not trust the certificate fails its handshake.
    with pytest.raises(ssl.SSLError):
        Wire(srv.address, ssl_context=ssl.create_default_context())
