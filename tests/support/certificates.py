"""Self-signed TLS certificates for 127.0.0.1: made with the ``cryptography`` package where
installed, else with the ``openssl`` command; the test skips when neither is there."""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import ipaddress
import shutil
import ssl
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest


def _with_cryptography(cert: Path, key: Path, common_name: str, days: int) -> None:
    x509: Any = importlib.import_module("cryptography.x509")
    hashes: Any = importlib.import_module("cryptography.hazmat.primitives.hashes")
    ec: Any = importlib.import_module("cryptography.hazmat.primitives.asymmetric.ec")
    serialization: Any = importlib.import_module("cryptography.hazmat.primitives.serialization")
    oid: Any = importlib.import_module("cryptography.x509.oid")
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(oid.NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(common_name))]),
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


def _with_openssl(cert: Path, key: Path, common_name: str, days: int) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("neither the cryptography package nor the openssl command is available")
    subprocess.run(
        [
            openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", str(key), "-out", str(cert), "-days", str(days),
            "-subj", f"/CN={common_name}", "-addext", f"subjectAltName=IP:{common_name}",
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )  # fmt: skip


def make_certificate(
    directory: Path, name: str = "cert", common_name: str = "127.0.0.1", days: int = 1
) -> Path:
    """A self-signed certificate for the IP address ``common_name``, valid for ``days`` from
    now, as ``<name>.pem`` in ``directory``; its key is ``<name>.key`` beside it
    (:func:`key_of`)."""
    cert = directory / f"{name}.pem"
    if importlib.util.find_spec("cryptography") is not None:
        _with_cryptography(cert, key_of(cert), common_name, days)
    else:
        _with_openssl(cert, key_of(cert), common_name, days)
    return cert


def make_dated_certificate(directory: Path, starts: float, expires: float) -> Path:
    """A self-signed certificate for 127.0.0.1 valid from ``starts`` to ``expires`` (seconds
    since the epoch, whole seconds), as ``dated.pem`` in ``directory`` with its key beside it:
    ``openssl ca`` sets both dates (``openssl req`` starts a certificate now)."""
    openssl = shutil.which("openssl") or pytest.skip("the openssl command is not available")
    cert, work = directory / "dated.pem", directory / "dated-ca"
    work.mkdir()
    (work / "index.txt").touch()
    (work / "serial").write_text("01\n")
    (work / "ca.cnf").write_text(
        "[ca]\ndefault_ca = dated\n[dated]\ndatabase = index.txt\nnew_certs_dir = .\n"
        "serial = serial\ndefault_md = sha256\npolicy = any\ncopy_extensions = copy\n"
        "[any]\ncommonName = supplied\n"
    )
    csr, date = work / "request.csr", "%Y%m%d%H%M%SZ"
    subprocess.run(
        [openssl, "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key_of(cert)), "-out", str(csr), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    subprocess.run(
        [openssl, "ca", "-batch", "-selfsign", "-config", "ca.cnf", "-keyfile",
         str(key_of(cert)), "-in", str(csr), "-notext", "-out", str(cert),
         "-startdate", time.strftime(date, time.gmtime(starts)),
         "-enddate", time.strftime(date, time.gmtime(expires))],
        check=True, capture_output=True, timeout=30, cwd=work,
    )  # fmt: skip
    return cert


def key_of(cert: Path) -> Path:
    """The key file :func:`make_certificate` wrote beside ``cert``."""
    return cert.with_suffix(".key")


def openssl_not_after(cert: Path) -> float:
    """When ``cert`` expires, as the ``openssl`` command reads it (seconds since the epoch)."""
    openssl = shutil.which("openssl") or pytest.skip("the openssl command is not available")
    done = subprocess.run(
        [openssl, "x509", "-in", str(cert), "-noout", "-enddate"],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return ssl.cert_time_to_seconds(done.stdout.strip().removeprefix("notAfter="))
