"""Server-side TLS: a self-signed certificate for loopback tests, and the server context."""

from __future__ import annotations

import ipaddress
import shutil
import ssl
import subprocess
from pathlib import Path


def make_self_signed_cert(directory: str | Path, common_name: str = "127.0.0.1") -> tuple[Path, Path]:
    """Write `cert.pem` and `key.pem` (EC P-256, 30 days) into `directory`.

    Uses the `openssl` command line tool (Debian's `openssl` package), so no
    Python crypto package is needed. Returns (cert_path, key_path).
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError(
            "the `openssl` command is needed to make a self-signed certificate (apt-get install openssl)"
        )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    command = [
        openssl,
        "req",
        "-x509",
        "-nodes",
        "-days",
        "30",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-keyout",
        str(key_path),
        "-out",
        str(cert_path),
        "-subj",
        f"/CN={common_name}",
        "-addext",
        f"subjectAltName=IP:{common_name}" if _is_ip(common_name) else f"subjectAltName=DNS:{common_name}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"openssl could not make a certificate: {result.stderr.strip()}")
    return cert_path, key_path


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def server_context(cert_path: str | Path, key_path: str | Path) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certfile=str(cert_path), keyfile=str(key_path))
    return context
