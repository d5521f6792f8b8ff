"""Reading a real daemon's /metrics in tests: the flags that serve them with a bearer token, one scrape
over 127.0.0.1 with that token, parsed with prometheus-client's own parser, and the value of one sample."""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

METRICS_TOKEN = "metrics-scrape-token-0123456789abcdef"


def metrics_flags(directory: Path, token: str = METRICS_TOKEN) -> list[str]:
    """``kvtier serve`` flags for metrics on a free port guarded by ``token`` (written to a 0600 file
    in ``directory``, as a Prometheus ``credentials_file`` would be)."""
    path = Path(directory) / "metrics.token"
    path.write_text(token + "\n")
    os.chmod(path, 0o600)
    return ["--metrics-port", "0", "--metrics-token-file", str(path)]


def get(address: str, token: str | None = METRICS_TOKEN, scheme: str = "Bearer") -> tuple[int, dict[str, str], bytes]:
    """``(status, headers, body)`` of one GET of ``address`` (``Authorization: SCHEME TOKEN`` unless
    ``token`` is None); an HTTP error status is returned, not raised."""
    request = urllib.request.Request(address)
    if token is not None:
        request.add_header("Authorization", f"{scheme} {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, dict(e.headers), e.read()


def scrape(address: str, token: str | None = METRICS_TOKEN) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` of one scrape."""
    assert address.startswith("http://127.0.0.1:")
    status, _, body = get(address, token)
    assert status == 200, status
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: dict, name: str, **labels: str) -> float:
    """The value of sample ``name`` with exactly ``labels`` (0.0 when absent)."""
    return m.get((name, tuple(sorted(labels.items()))), 0.0)
