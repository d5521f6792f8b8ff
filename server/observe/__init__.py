"""Observability of the daemon without grpc: Prometheus metrics read from snapshots at scrape time
(``metrics``, ``daemon_metrics``) and structured logs (``logs``).

A scrape never takes a pool, prefix-cache, store or tier index lock: it reads plain integers and
takes only leaf locks (a tier's counters, the stack's move counters), so monitoring can never stop the
data path (README "Concurrency").
"""
