"""A throwaway certificate authority for TLS tests: a CA, a server certificate for 127.0.0.1 and a
client certificate, all signed by the CA (real openssl, EC P-256 keys)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def _run(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_pki(d: Path) -> dict[str, Path]:
    """Write ``ca.pem``/``ca.key``, ``server.pem``/``server.key`` (SAN IP:127.0.0.1, localhost) and
    ``client.pem``/``client.key`` into ``d``; returns their paths by name."""
    p = {n: d / n for n in ("ca.pem", "ca.key", "server.pem", "server.key", "client.pem", "client.key")}
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _run("req", "-x509", *ec, "-keyout", str(p["ca.key"]), "-out", str(p["ca.pem"]), "-days", "1", "-subj", "/CN=kvtier-test-ca")
    for name, extra in (("server", ["-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"]), ("client", [])):
        csr = d / f"{name}.csr"
        _run("req", *ec, "-keyout", str(p[f"{name}.key"]), "-out", str(csr), "-subj", f"/CN=kvtier-test-{name}", *extra)
        _run("x509", "-req", "-in", str(csr), "-CA", str(p["ca.pem"]), "-CAkey", str(p["ca.key"]), "-CAcreateserial",
             "-out", str(p[f"{name}.pem"]), "-days", "1", "-copy_extensions", "copy")
    return p
