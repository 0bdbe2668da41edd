"""--enable-ssl-refresh: a server over HTTPS (self-signed certificates made with the openssl
command) whose key and certificate files are replaced while it serves; a new connection sees
the new certificate, and a half-done renewal (a certificate without its key) keeps the old
one served (a mismatched pair loaded into the live context would break every handshake)."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from octavo.entrypoints.server.app import ServerConfig
from octavo.entrypoints.server.http_server import SSLCertRefresher

from .mock_server import mock_server

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def make_cert(folder: Path, name: str) -> tuple[Path, Path]:
    key, cert = folder / f"{name}.key", folder / f"{name}.crt"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-subj", f"/CN={name}", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return key, cert


def served_cert(port: int) -> str:
    """The server's certificate, PEM, from a new connection."""
    return ssl.get_server_certificate(("127.0.0.1", port))


def same(pem_a: str, pem_b: str) -> bool:
    return ssl.PEM_cert_to_DER_cert(pem_a) == ssl.PEM_cert_to_DER_cert(pem_b)


def test_a_replaced_certificate_is_served_to_new_connections(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(SSLCertRefresher, "poll_interval_s", 0.05)
    old_key, old_cert = make_cert(tmp_path, "old")
    new_key, new_cert = make_cert(tmp_path, "new")
    key, cert = tmp_path / "server.key", tmp_path / "server.crt"
    shutil.copy(old_key, key)
    shutil.copy(old_cert, cert)
    config = ServerConfig(ssl_keyfile=str(key), ssl_certfile=str(cert), enable_ssl_refresh=True)
    with mock_server(config) as running:
        port = int(running.base_url.rsplit(":", 1)[1])
        assert same(served_cert(port), old_cert.read_text())
        https = f"https://127.0.0.1:{port}"
        with httpx.Client(verify=False, timeout=30) as client:
            assert client.get(https + "/health").status_code == 200
        # 1) Half a renewal: the new certificate with the old key fails to load; the old
        #    pair goes on being served.
        shutil.copy(new_cert, tmp_path / "next.crt")
        os.replace(tmp_path / "next.crt", cert)
        time.sleep(0.5)
        assert same(served_cert(port), old_cert.read_text())
        # 2) The key arrives too: the next poll loads the pair.
        shutil.copy(new_key, tmp_path / "next.key")
        os.replace(tmp_path / "next.key", key)
        deadline = time.monotonic() + 10
        while not same(served_cert(port), new_cert.read_text()):
            assert time.monotonic() < deadline, "the new certificate was never served"
            time.sleep(0.05)
        # The self-signed certificate names no host: check the chain, not the name.
        ctx = ssl.create_default_context(cafile=str(new_cert))
        ctx.check_hostname = False
        with httpx.Client(verify=ctx, timeout=30) as client:
            assert client.get(https + "/health").status_code == 200


def test_without_the_flag_the_certificate_stays(tmp_path) -> None:
    old_key, old_cert = make_cert(tmp_path, "old")
    new_key, new_cert = make_cert(tmp_path, "new")
    key, cert = tmp_path / "server.key", tmp_path / "server.crt"
    shutil.copy(old_key, key)
    shutil.copy(old_cert, cert)
    config = ServerConfig(ssl_keyfile=str(key), ssl_certfile=str(cert))
    with mock_server(config) as running:
        port = int(running.base_url.rsplit(":", 1)[1])
        shutil.copy(new_key, key)
        shutil.copy(new_cert, cert)
        time.sleep(1.5)
        assert same(served_cert(port), old_cert.read_text())
        assert running.server.ssl_refresher is None
