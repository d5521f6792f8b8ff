"""Reading a real daemon's /metrics in tests: one scrape over 127.0.0.1, parsed with prometheus-client's
own parser, and the value of one sample."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` of one scrape."""
    assert address.startswith("http://127.0.0.1:")
    text = urllib.request.urlopen(address, timeout=30).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: dict, name: str, **labels: str) -> float:
    """The value of sample ``name`` with exactly ``labels`` (0.0 when absent)."""
    return m.get((name, tuple(sorted(labels.items()))), 0.0)
