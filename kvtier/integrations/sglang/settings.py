"""The backend's settings: every key of SGLang's ``--hicache-storage-backend-extra-config`` it reads.

SGLang's dynamic loader hands the whole extra-config JSON to the backend as
``storage_config.extra_config`` (after taking out its own prefetch keys). The keys it uses to find
the class (``backend_name``, ``module_path``, ``class_name``) and ``interface_v1`` (which makes SGLang
call the zero-copy ``batch_get_v1``/``batch_set_v1``) are SGLang's; the rest are fields here, and an
unknown key is an error naming the known ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
TRANSPORTS = ("auto", "grpc", "shm")
MiB = 1 << 20


@dataclass(frozen=True)
class BackendSettings:
    """How the backend reaches its daemon.

    Attributes:
        address: the daemon's address (``unix:///path``, a bare socket path, or ``HOST:PORT``); empty:
            kvtier's default unix socket (where ``kvtier serve`` listens by default).
        token: bearer token of a daemon with tenants (``--auth-tokens``); empty: ``$KVTIER_TOKEN``.
        timeout_s: deadline of each daemon call, seconds (a call past it is a miss or a False).
        transport: ``auto`` (the default: shared memory when ``address`` is a unix socket -- the daemon
            is on this machine --, gRPC streams on TCP), ``shm`` (shared memory only: a unix socket;
            a call that cannot get a staging buffer fails), ``grpc`` (gRPC streams, any daemon).
            With shared memory the page bytes go through a staging buffer of a storage session on
            the daemon's attach channel; only keys and offsets travel over gRPC.
        chunk_bytes: data bytes per gRPC message; max_message_bytes: the daemon's message limit.
        staging_bytes: the most bytes one daemon call moves; bigger batches are split. With shared
            memory also at most a quarter of the daemon's ``attach_staging_bytes`` (one staging buffer
            for each of up to 4 threads).
        model_name: the name units are stored under; empty: SGLang's ``model_name``.
        tls_root_cert, tls_client_cert, tls_client_key: PEM files for a daemon that serves TLS.
    """

    address: str = ""
    token: str = ""
    timeout_s: float = 30.0
    transport: str = "auto"
    chunk_bytes: int = 1 * MiB
    max_message_bytes: int = 4 * MiB
    staging_bytes: int = 256 * MiB
    model_name: str = ""
    tls_root_cert: str = ""
    tls_client_cert: str = ""
    tls_client_key: str = ""

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"kvtier backend: transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if not isinstance(self.timeout_s, (int, float)) or isinstance(self.timeout_s, bool):
            raise ValueError(f"kvtier backend: timeout_s must be a number of seconds (JSON 30, not \"30\"), "
                             f"got {self.timeout_s!r}")
        if not 0 < self.timeout_s <= 86400:  # NaN and Infinity (JSON allows them) included
            raise ValueError(f"kvtier backend: timeout_s must be > 0 and at most 86400 seconds, got {self.timeout_s!r}")
        for name in ("address", "token", "model_name", "tls_root_cert", "tls_client_cert", "tls_client_key"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kvtier backend: {name} must be a string, got {getattr(self, name)!r}")
        for name in ("chunk_bytes", "max_message_bytes", "staging_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"kvtier backend: {name} must be a positive integer number of bytes "
                                 f"(JSON 268435456, not \"256MiB\"), got {v!r}")
        # checked here, where the config is read, not later inside the client (attack pass 5, A5-4)
        if not 65536 <= self.max_message_bytes <= (1 << 31) - 1:
            raise ValueError(f"kvtier backend: max_message_bytes must be 65536..2147483647 (gRPC's limit), "
                             f"got {self.max_message_bytes}")
        if not 4096 <= self.chunk_bytes <= self.max_message_bytes - 1024:
            raise ValueError(f"kvtier backend: chunk_bytes must be 4096..max_message_bytes - 1024 "
                             f"({self.max_message_bytes - 1024}), got {self.chunk_bytes}")
        if self.staging_bytes > 1 << 40:
            raise ValueError(f"kvtier backend: staging_bytes must be at most 1 TiB, got {self.staging_bytes}")
        if self.timeout_s < 0.001:
            raise ValueError(f"kvtier backend: timeout_s must be at least 0.001 seconds, got {self.timeout_s!r}")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> BackendSettings:
        """Settings from SGLang's extra config. Raises ValueError: unknown keys, bad values."""
        extra = dict(extra or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known - SGLANG_KEYS)
        if unknown:
            raise ValueError(f"kvtier backend: unknown extra-config keys {unknown}; known: {sorted(known)}")
        return cls(**{k: v for k, v in extra.items() if k in known})
