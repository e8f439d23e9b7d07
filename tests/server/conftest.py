"""Fixtures for the server tests: TLS files and a real ``dflockd`` subprocess."""

from __future__ import annotations

import asyncio
import datetime
import importlib
import importlib.util
import ipaddress
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from dflock_proc import DflockdProcess


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


@pytest.fixture
def dflockd_process() -> Iterator[Callable[..., DflockdProcess]]:
    """``start(*args, env=None)`` -> a running ``dflockd`` subprocess; all killed at teardown."""
    started: list[DflockdProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> DflockdProcess:
        proc = DflockdProcess(list(args), env or {})
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()


def _event_loops() -> list[Any]:
    loops: list[Any] = [pytest.param(asyncio.new_event_loop, id="asyncio")]
    if importlib.util.find_spec("uvloop") is None:
        return loops
    uvloop: Any = importlib.import_module("uvloop")
    return [*loops, pytest.param(uvloop.new_event_loop, id="uvloop")]


@pytest.fixture(params=_event_loops())
def loop_factory(request: pytest.FixtureRequest) -> Callable[[], asyncio.AbstractEventLoop]:
    """Each event loop the server runs on here: asyncio's, and uvloop's where installed."""
    factory: Callable[[], asyncio.AbstractEventLoop] = request.param
    return factory
