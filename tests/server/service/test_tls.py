"""Mutual TLS (``--tls-client-ca``): a client without a certificate the CA signed is refused; PullKV
reaches a TLS peer with ``--peer-tls-ca``, presenting the daemon's own certificate."""

from __future__ import annotations

import pytest
import torch
from pki import make_pki

from kvtier.client import KVTierClient, KVTierError
from kvtier.client.spawn import DaemonProcess

PS = 64


def test_mutual_tls_refuses_clients_without_a_certificate_and_pulls_between_tls_peers(tmp_path):
    pki = make_pki(tmp_path)
    cert, key, ca = str(pki["server.pem"]), str(pki["server.key"]), str(pki["ca.pem"])
    args = ["--device", "cpu", "--log-level", "WARNING", "--pool", "glm-5.2:512", "--pool-layers", "4",
            "--tls-cert", cert, "--tls-key", key, "--tls-client-ca", ca, "--peer-tls-ca", ca]
    with DaemonProcess("127.0.0.1:0", allow_unauthenticated=True, extra_args=args, tls_root_cert=ca, tls_client_cert=pki["client.pem"],
                       tls_client_key=pki["client.key"]) as d:
        with pytest.raises(KVTierError), KVTierClient(d.address, tls_root_cert=ca, timeout=5, retries=0) as anonymous:
            anonymous.list_pools()
        with KVTierClient(d.address, tls_root_cert=ca, tls_client_cert=pki["client.pem"], tls_client_key=pki["client.key"],
                          timeout=60) as c:
            assert [p.pool_id for p in c.list_pools()] == ["default"]
            c.create_pool("glm-5.2", num_layers=4, size_tokens=512, pool_id="dst")
            src, dst = c.allocate_slots("default", PS), c.allocate_slots("dst", PS)
            rows = torch.randint(0, 256, (PS, 656), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
            c.write_kv("default", src, latent={x: rows for x in range(4)})
            # the daemon is its own peer: the pull goes out over TLS with the daemon's certificate as client's
            assert c.pull_kv("dst", d.address, "default", src_slots=src, dst_slots=dst, transport="grpc").num_pages == 1
            assert torch.equal(c.read_kv("dst", dst, index_layers=[]).latent[2], rows)


def test_the_cli_reaches_a_tls_daemon_through_the_environment(tmp_path):
    """Regression (new-user pass): ``kvtier status`` had no way to speak TLS and told a user of a TLS
    daemon that no daemon was running. The client (so every CLI command) takes KVTIER_TLS_CA,
    KVTIER_TLS_CERT and KVTIER_TLS_KEY when its arguments leave them out; without them the error says so."""
    import json
    import os
    import subprocess
    import sys

    pki = make_pki(tmp_path)
    cert, key, ca = str(pki["server.pem"]), str(pki["server.key"]), str(pki["ca.pem"])
    args = ["--device", "cpu", "--log-level", "WARNING", "--pool", "glm-5.2:512", "--pool-layers", "4",
            "--tls-cert", cert, "--tls-key", key, "--tls-client-ca", ca]
    with DaemonProcess("127.0.0.1:0", allow_unauthenticated=True, extra_args=args, tls_root_cert=ca, tls_client_cert=pki["client.pem"],
                       tls_client_key=pki["client.key"]) as d:
        cli = [sys.executable, "-m", "kvtier.cli", "pools", "--server", d.address, "--json", "--timeout", "10"]
        base = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        plain = subprocess.run(cli, env=base, capture_output=True, text=True, timeout=120)
        assert plain.returncode != 0 and "KVTIER_TLS_CA" in plain.stderr and "Traceback" not in plain.stderr
        env = {**base, "KVTIER_TLS_CA": ca, "KVTIER_TLS_CERT": str(pki["client.pem"]), "KVTIER_TLS_KEY": str(pki["client.key"])}
        ok = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=120)
        assert ok.returncode == 0, ok.stderr
        assert [p["pool_id"] for p in json.loads(ok.stdout)] == ["default"]
