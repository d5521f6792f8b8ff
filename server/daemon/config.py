"""The daemon's typed configuration: :class:`DaemonConfig`, from a TOML file and/or CLI flags.

Every key is a field below with a default and a docstring; a TOML file uses exactly these names
(byte sizes may be written ``"4GiB"``), pools go in ``[[pools]]`` tables with the fields of
:class:`PoolSpec`. Unknown keys are an error, never ignored.

Example ``kvtier.toml``::

    listen = "unix:///run/kvtier/kvtier.sock"
    device = "cpu"
    host_memory_bytes = "8GiB"
    workers = 16

    [[pools]]
    pool_id = "default"
    model = "glm-5.2"
    tokens = 65536
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.server.daemon.config_keys import check_field_types, check_known_keys
from kvtier.server.daemon.private_files import read_trusted_file
from kvtier.server.daemon.quotas import Quotas
from kvtier.server.daemon.tenants import DEFAULT_TENANT, TenantSettings, check_tenant_name
from kvtier.server.daemon.tier_settings import TierSettings
from kvtier.server.daemon.unit_settings import UnitSettings
from kvtier.sizes import GiB, MiB, parse_bytes  # noqa: F401  (re-exported: parse_bytes lives where the CLI imports it torch-free)

DEFAULT_MAX_MESSAGE_BYTES = 4 * MiB
CHUNK_OVERHEAD_BYTES = 1024  # room a KV chunk message needs beside its data (field tags, lengths)
MIN_CHUNK_BYTES = 4096  # smallest data piece of a KV stream (but the last piece of a segment)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")
DEVICES = ("auto", "cpu", "cuda")
TRANSFER_ENGINES = ("none", "mooncake")
MAX_ATTACH_SESSIONS = 1024  # live attach and storage sessions of the whole daemon

MAX_WORKERS = 1024
"""The most gRPC worker threads (each a thread of the daemon; the machine's thread limit is shared)."""
MAX_STREAMS = 65536
"""The most KV streams ``max_streams`` may allow at once."""

@dataclass(frozen=True)
class PoolSpec:
    """A pool the daemon creates at start (``--pool`` or a ``[[pools]]`` table)."""

    model: str
    """Preset name (``glm-5.2``, ``deepseek-v3.2``) or path to an HF ``config.json``."""
    pool_id: str = "default"
    """Name clients use for the pool."""
    tokens: int = 0
    """Token capacity (a multiple of the page size); 0 means: plan from ``memory_bytes``."""
    memory_bytes: int = 0
    """Byte budget planned with the exact accounting (``kvtier plan``) when ``tokens`` is 0."""
    role: str = "target"
    """``target`` (skip-aware), ``draft`` or ``hisparse`` (indexer on every layer)."""
    num_layers: int = 0
    """Use only N layers from ``start_layer`` (scaled-down pools); 0 = up to ``end_layer``."""
    start_layer: int = 0
    """First model layer of the pool: a pipeline-parallel stage holds layers ``[start_layer, end_layer)``."""
    end_layer: int = 0
    """One past the pool's last model layer; 0 = the model's last (or ``start_layer + num_layers``)."""
    kv_cache_dtype: str = "fp8"
    """``fp8`` (656-byte DSA rows) or ``bf16``."""
    page_size: int = 64
    """Tokens per page."""
    tenant: str = DEFAULT_TENANT
    """The tenant that owns the pool (``--pool`` pools belong to ``default``)."""

    def __post_init__(self) -> None:
        check_field_types(self, "[[pools]] ")  # model = 5 and pool_id = 5 were tracebacks (attack pass 7, A7-1)
        if not self.model:
            raise ValueError("a pool needs a model")
        check_tenant_name(self.tenant)
        if (self.tokens == 0) == (self.memory_bytes == 0):
            raise ValueError(f"pool {self.pool_id!r}: give exactly one of tokens and memory_bytes")

    @classmethod
    def parse(cls, text: str) -> PoolSpec:
        """``[ID=]MODEL:TOKENS`` or ``[ID=]MODEL:BYTES`` with a unit (``glm-5.2:65536``,
        ``main=glm-5.2:2GiB``). Raises ValueError on another form."""
        pool_id, _, rest = text.rpartition("=")
        model, sep, cap = rest.rpartition(":")
        if not sep or not model or not cap:
            raise ValueError(f"--pool must look like [ID=]MODEL:TOKENS or [ID=]MODEL:BYTES (e.g. glm-5.2:65536), got {text!r}")
        kwargs: dict[str, Any] = {"model": model, "pool_id": pool_id or "default"}
        if cap.isdigit():
            kwargs["tokens"] = int(cap)
        else:
            kwargs["memory_bytes"] = parse_bytes(cap, "--pool capacity")
        return cls(**kwargs)


def _unix_peers(value: Any) -> tuple[str, ...]:
    """``pd_peers`` as resolved ``unix://`` addresses. Raises ValueError for anything else."""
    from kvtier.addresses import is_unix, resolve_address

    if isinstance(value, str):
        value = [v for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"pd_peers must be a list of unix:///path addresses, got {type(value).__name__}")
    peers = []
    for v in value:
        address = resolve_address(str(v).strip()) if isinstance(v, str) and v.strip() else ""
        if not is_unix(address):
            raise ValueError(f"pd_peers lists unix-socket peers (unix:///path); {v!r} is not one (TCP peers need no listing)")
        peers.append(address)
    return tuple(peers)


@dataclass(frozen=True)
class DaemonConfig:
    """Everything ``kvtier serve`` can be told. Byte sizes are in bytes."""

    listen: str = ""
    """``unix:///path`` or ``HOST:PORT`` (port 0 picks a free one). Empty: a unix socket
    ``kvtier.sock`` in a private directory (mode 0700; the socket 0600), see :func:`kvtier.addresses.default_socket_path`.
    TCP is accepted only on a loopback host unless ``tls_cert``/``tls_key`` are set."""
    device: str = "auto"
    """Where pools live unless a request says otherwise: ``auto`` (CUDA if present), ``cpu``, ``cuda``."""
    host_memory_bytes: int = 4 * GiB
    """Byte budget of the host tier that holds offloaded copies."""
    pool_memory_bytes: int = 0
    """Cap on the bytes of all pools together; 0 = no cap beyond what the device can allocate."""
    workers: int = 16
    """gRPC worker threads (each in-flight call, streams included, holds one)."""
    max_streams: int = 0
    """KV streams (WriteKV, ReadKV, ReadPages, PutUnits, GetUnits, and PullKVs that ask a peer) in
    flight at once; one more is refused at once with RESOURCE_EXHAUSTED. 0: half the workers (at
    least 1), so the other half always serve control calls. Set, it must be below ``workers`` (a
    value as large let stalled streams hold every worker): one higher is refused at start."""
    max_streams_per_tenant: int = 0
    """KV streams (as counted by ``max_streams``) one tenant may hold at once; one more of that tenant
    is refused at once with RESOURCE_EXHAUSTED, so one tenant cannot take the data path from the
    others. 0: every slot on a daemon with one tenant (no ``auth_tokens``, or a tokens file naming one
    tenant), half of them, rounded up, with more. Above ``max_streams``: ``max_streams``."""
    stream_idle_seconds: float = 30.0
    """A stream that moves no message for this long (a stalled sender or a reader that stopped
    reading) is cancelled, freeing its worker thread and stream slot."""
    request_arrival_seconds: float = 5.0
    """A call whose request message has not arrived this long after the call started (a client that
    sent the call's headers and then nothing) is cancelled, freeing its thread
    (``kvtier.server.service.arrival``). Unary stubs send the message with the headers."""
    peer_retry_seconds: float = 30.0
    """A PullKV without a deadline resends a ReadPages its peer refused as "changed nothing" (every
    stream slot taken, source pages a write is landing on) for at most this long after the first
    refusal; a pull with a deadline resends it until the deadline."""
    torch_threads: int = 1
    """torch intra-op threads. Calls already run in parallel on the workers; more than 1 made row
    gathers/scatters ~30x slower on a busy 2-core machine (OpenMP threads spin against each other)."""
    copy_threads: int = 0
    """Threads a large host copy (a request's ``get_cpu_copy`` / ``load_cpu_copy``, a WriteKV commit)
    is split over, each a plain thread running one numpy copy with the GIL released. 0: the
    machine's cores (at most 64). Measured on 2 cores (docs/bench/threads, load average ~3): a
    request's load_cpu_copy ran 10.9 GB/s on 2 copy threads against 6.3 on 1, while torch's OpenMP
    threads at 2 fell to 0.3-0.9 GB/s whenever the machine was busy: torch_threads stays 1."""
    log_level: str = "INFO"
    """``DEBUG``, ``INFO``, ``WARNING`` or ``ERROR``."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest gRPC message either way (``grpc.max_send/receive_message_length``); set the
    client's ``max_message_bytes`` to the same value."""
    chunk_bytes: int = 1 * MiB
    """Data bytes per KV chunk the daemon streams back (ReadKV) when the request does not say;
    at most ``max_message_bytes - 1024``."""
    grace_seconds: float = 10.0
    """On SIGTERM/SIGINT: how long in-flight calls may run on before they are cancelled."""
    close_seconds: float = 60.0
    """After the grace period: how long the shutdown work (moving device and host records down to
    the disk tier, closing LMDB) may take; past it, or with a call stuck in a worker, the daemon
    logs what is left and exits anyway."""
    tls_cert: str = ""
    """PEM certificate file; with ``tls_key`` the daemon serves TLS and may listen beyond loopback."""
    tls_key: str = ""
    """PEM private key file for ``tls_cert``."""
    tls_client_ca: str = ""
    """PEM file of the CA that signs client certificates: with it (and ``tls_cert``), every client
    must present a certificate it signed (mutual TLS)."""
    peer_tls_ca: str = ""
    """PEM CA file for PullKV's calls to peer daemons: set it to reach peers over TLS (the daemon's
    own ``tls_cert``/``tls_key`` are presented as its client certificate). Without it peers are
    reached in plaintext, and then only on loopback or unix sockets when a token is forwarded."""
    pd_peers: tuple[str, ...] = ()
    """Unix-socket PD peers PullKV may name besides this daemon's own address (``unix:///path``; TOML
    list, ``--pd-peers`` comma-separated). Other unix-socket peers are refused: they are this machine's
    private daemons, whose file permissions the daemon would bypass for its caller. TCP peers need no
    listing."""
    auth_tokens: str = ""
    """TOML file with a ``[tokens]`` table (token -> tenant), owned by the daemon's user, mode 0600.
    With it every call needs ``authorization: Bearer <token>``; without it there is one tenant
    ``default`` and the daemon listens only on its private unix socket or loopback."""
    allow_unauthenticated: bool = False
    """Serve a loopback TCP ``listen`` without ``auth_tokens`` or mutual TLS (a WARNING at start):
    every local user, whatever its uid, may then read, overwrite and free every pool's KV. Without
    it such a daemon is refused at start; a unix socket (0600, the daemon's user only) needs neither."""
    quotas: Quotas = field(default_factory=Quotas)
    """Per-tenant byte quotas, ``[quotas.<tenant>]`` tables (``pool_bytes``, ``host_bytes``,
    ``disk_bytes``; ``[quotas."*"]`` for every tenant without its own), see ``kvtier.server.daemon.quotas``."""
    tenants: dict[str, TenantSettings] = field(default_factory=dict)
    """Per-tenant settings, ``[tenants.<name>]`` tables (``attach_uids``: uids besides the daemon's own
    that may attach the tenant's pools), see :class:`~kvtier.server.daemon.tenants.TenantSettings`."""
    attach_staging_bytes: int = 256 * MiB
    """Local attach: bytes of staging buffers (page transfers) one attach session may hold at once."""
    attach_staging_tenant_bytes: int = 4 * GiB
    """Local attach: bytes of staging buffers all sessions of one tenant may hold at once (the
    daemon makes them, so they are budgeted per tenant as well as per session)."""
    attach_sessions_per_tenant: int = 256
    """Local attach: live attach and storage sessions one tenant may hold at once (the daemon holds
    1024 at most), so one tenant cannot take every session of the daemon."""
    ready_file: str = ""
    """If set, the bound address is written to this file once the daemon serves (for port 0)."""
    pools: tuple[PoolSpec, ...] = field(default=())
    """Pools created at start."""
    tiers: TierSettings = field(default_factory=TierSettings)  # [tiers] table / --disk-* flags (kvtier.server.daemon.tier_settings)
    units: UnitSettings = field(default_factory=UnitSettings)  # [units] table: the unit store (kvtier.server.daemon.unit_settings)
    transfer_engine: str = "none"
    """PD transfer engine: ``mooncake`` (Mooncake Transfer Engine, registers pool buffers) or ``none`` (gRPC fallback only)."""
    transfer_host: str = "127.0.0.1"
    """Address the transfer engine binds and publishes to peers."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on ``http://metrics_host:metrics_port/metrics`` (0: a free port, shown by
    ``kvtier status``); unset: no metrics endpoint and no RPC timing."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint binds (loopback by default: it names pools)."""
    metrics_token_file: str = ""
    """A file holding the bearer token every scrape must send (``Authorization: Bearer <token>``;
    Prometheus: ``authorization: credentials_file:``): owned by the daemon's user, mode 0600, at least
    16 characters; anything else is 401. ``metrics_port`` needs it unless ``metrics_insecure``."""
    metrics_insecure: bool = False
    """Serve ``metrics_port`` without a token (logged as a WARNING at start): every local user who can
    reach the port reads tenant names, pool ids and per-tenant call counts."""
    log_format: str = "text"
    """``text`` or ``json`` (one JSON object a line: ts, level, logger, message, thread, exception)."""

    def __post_init__(self) -> None:
        _check_field_types(self)
        object.__setattr__(self, "pd_peers", _unix_peers(self.pd_peers))
        # the [tiers] and [units] tables are checked with the rest of the file, not first when the daemon
        # builds its tiers (attack pass 7, A7-1)
        object.__setattr__(self, "tiers", TierSettings.coerce(self.tiers))
        object.__setattr__(self, "units", UnitSettings.coerce(self.units))
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        # upper bounds: 100,000 torch threads took the machine's thread limit and crashed (attack pass 6, A6-8)
        if not 2 <= self.workers <= MAX_WORKERS:  # 1: its one stream slot was the only worker (attack pass 8, A8-9)
            raise ValueError(f"workers must be 2..{MAX_WORKERS} (KV streams take at most all but one, so control calls "
                             f"always have a thread), got {self.workers}")
        if not 1 <= self.torch_threads <= 256:
            raise ValueError(f"torch_threads must be 1..256, got {self.torch_threads}")
        if not 0 <= self.copy_threads <= 64:
            raise ValueError(f"copy_threads must be 0 (the machine's cores) or 1..64, got {self.copy_threads}")
        if not 64 * 1024 <= self.max_message_bytes <= MAX_MESSAGE_BYTES:
            raise ValueError(f"max_message_bytes must be 65536..{MAX_MESSAGE_BYTES} (gRPC's limit), got "
                             f"{self.max_message_bytes}")
        if not MIN_CHUNK_BYTES <= self.chunk_bytes <= self.max_message_bytes - CHUNK_OVERHEAD_BYTES:
            raise ValueError(
                f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, max_message_bytes - {CHUNK_OVERHEAD_BYTES}] = "
                f"[{MIN_CHUNK_BYTES}, {self.max_message_bytes - CHUNK_OVERHEAD_BYTES}], got {self.chunk_bytes}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        if not 0 <= self.max_streams <= MAX_STREAMS:
            raise ValueError(f"max_streams must be 0..{MAX_STREAMS}, got {self.max_streams}")
        if self.max_streams >= self.workers:  # streams then held every worker (attack pass 7, A7-11)
            raise ValueError(
                f"max_streams ({self.max_streams}) must be below workers ({self.workers}), so control calls always "
                f"have a thread: set --max-streams (max_streams) to at most {self.workers - 1}, or leave it unset "
                f"(half the workers)")
        if not 0 <= self.max_streams_per_tenant <= MAX_STREAMS:
            raise ValueError(f"max_streams_per_tenant must be 0..{MAX_STREAMS}, got {self.max_streams_per_tenant}")
        if self.stream_idle_seconds <= 0:
            raise ValueError(f"stream_idle_seconds must be > 0, got {self.stream_idle_seconds}")
        if self.request_arrival_seconds <= 0:
            raise ValueError(f"request_arrival_seconds must be > 0, got {self.request_arrival_seconds}")
        if self.peer_retry_seconds <= 0:
            raise ValueError(f"peer_retry_seconds must be > 0, got {self.peer_retry_seconds}")
        if self.close_seconds <= 0:
            raise ValueError(f"close_seconds must be > 0, got {self.close_seconds}")
        if not isinstance(self.tenants, dict) or not all(isinstance(v, TenantSettings) for v in self.tenants.values()):
            raise ValueError("tenants must map tenant names to TenantSettings (a [tenants.<name>] table in TOML)")
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        for name in ("attach_staging_bytes", "attach_staging_tenant_bytes"):  # attack pass 5: 10^18 was taken
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= memory:
                raise ValueError(f"{name} must be 0..{memory} (the machine's memory), got {value!r}")
        if isinstance(self.attach_sessions_per_tenant, bool) or not isinstance(self.attach_sessions_per_tenant, int) \
                or not 1 <= self.attach_sessions_per_tenant <= MAX_ATTACH_SESSIONS:
            raise ValueError(f"attach_sessions_per_tenant must be 1..{MAX_ATTACH_SESSIONS}, got "
                             f"{self.attach_sessions_per_tenant!r}")
        if not isinstance(self.quotas, Quotas):
            raise ValueError("quotas must be a Quotas object (a [quotas.<tenant>] table in TOML)")
        if self.transfer_engine not in TRANSFER_ENGINES:
            raise ValueError(f"transfer_engine must be one of {TRANSFER_ENGINES}, got {self.transfer_engine!r}")
        if self.metrics_port is not None and (isinstance(self.metrics_port, bool) or not isinstance(self.metrics_port, int)
                                              or not 0 <= self.metrics_port <= 65535):
            raise ValueError(f"metrics_port must be 0..65535, got {self.metrics_port!r}")
        if not isinstance(self.metrics_insecure, bool):
            raise ValueError(f"metrics_insecure must be true or false, got {self.metrics_insecure!r}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {self.log_format!r}")
        if self.grace_seconds < 0:
            raise ValueError(f"grace_seconds must be >= 0, got {self.grace_seconds}")
        for name in ("stream_idle_seconds", "request_arrival_seconds", "peer_retry_seconds", "close_seconds",
                     "grace_seconds"):  # a larger value overflows the deadlines built from it (time_t)
            if getattr(self, name) > MAX_SECONDS:
                raise ValueError(f"{name} must be at most {MAX_SECONDS:g} (a day), got {getattr(self, name)}")
        ids = [(p.tenant, p.pool_id) for p in self.pools]  # pool ids are per tenant (attack pass 4, A4-11)
        if len(set(ids)) != len(ids):
            twice = sorted({f"{t}/{i}" for t, i in ids if ids.count((t, i)) > 1})
            raise ValueError(f"pool ids repeat within a tenant: {', '.join(twice)}")

    def check_metrics_auth(self) -> None:
        """Refuse a metrics endpoint nobody decided how to guard (``kvtier serve`` calls it before
        anything is allocated; the server again before it serves metrics). Not in ``__post_init__``:
        a config file's ``metrics_port`` may get its ``--metrics-token-file`` from the command line.

        Raises:
            ValueError: ``metrics_port`` without ``metrics_token_file`` or ``metrics_insecure``, both
                of them, or either without ``metrics_port``; one line naming the flags to pass.
        """
        if self.metrics_port is None:
            if self.metrics_token_file or self.metrics_insecure:
                raise ValueError("--metrics-token-file and --metrics-insecure (metrics_token_file, metrics_insecure) "
                                 "guard the metrics endpoint: give --metrics-port (metrics_port) too")
            return
        if self.metrics_token_file and self.metrics_insecure:
            raise ValueError("--metrics-token-file and --metrics-insecure (metrics_token_file, metrics_insecure) "
                             "contradict each other: give one")
        if not self.metrics_token_file and not self.metrics_insecure:
            raise ValueError("--metrics-port needs --metrics-token-file FILE (metrics_token_file: a file of this "
                             "user, mode 0600, holding the bearer token every scrape must send) or, to let every "
                             "local user who reaches the port read tenant names and pool ids, --metrics-insecure")

    @property
    def stream_slots(self) -> int:
        """KV streams allowed in flight at once (``max_streams``, or half the workers)."""
        return self.max_streams or max(1, self.workers // 2)

    def tenant_stream_slots(self, tenants: int) -> int:
        """KV streams one tenant may hold at once on a daemon serving ``tenants`` tenants
        (``max_streams_per_tenant``; by default every slot with one tenant, half of them, rounded up, with more)."""
        if self.max_streams_per_tenant:
            return min(self.max_streams_per_tenant, self.stream_slots)
        return self.stream_slots if tenants <= 1 else -(-self.stream_slots // 2)

    @property
    def max_chunk_bytes(self) -> int:
        """Largest data bytes a KV chunk may carry under ``max_message_bytes``."""
        return self.max_message_bytes - CHUNK_OVERHEAD_BYTES

    def grpc_options(self) -> list[tuple[str, int]]:
        """Channel/server options for the message limits."""
        return [("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.max_receive_message_length", self.max_message_bytes)]

    def replace(self, **changes: Any) -> DaemonConfig:
        """A copy with ``changes`` (None values are ignored, so CLI flags not given keep the file's)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    @classmethod
    def from_mapping(cls, data: dict[str, Any]) -> DaemonConfig:
        """Build from a parsed TOML document. Raises ValueError on unknown keys or bad values."""
        check_known_keys(cls, data, "config")
        kwargs = dict(data)
        for key in ("host_memory_bytes", "pool_memory_bytes", "max_message_bytes", "chunk_bytes", "attach_staging_bytes",
                    "attach_staging_tenant_bytes"):
            if key in kwargs:
                kwargs[key] = parse_bytes(kwargs[key], key)
        if "tenants" in kwargs:
            kwargs["tenants"] = TenantSettings.table_from_mapping(kwargs["tenants"])
        if "quotas" in kwargs:
            kwargs["quotas"] = Quotas.from_mapping(kwargs["quotas"], parse_bytes)
        if "pools" in kwargs:
            specs = []
            tables = kwargs["pools"]
            if not isinstance(tables, (list, tuple)) or not all(isinstance(t, dict) for t in tables):
                raise ValueError(f"pools must be [[pools]] tables, got {tables!r}")  # a traceback (attack pass 6, A6-7)
            for table in tables:
                check_known_keys(PoolSpec, table, "[[pools]]")
                if "model" not in table:
                    raise ValueError("a [[pools]] table needs model (a preset name or a config.json path)")
                table = dict(table)
                if "memory_bytes" in table:
                    table["memory_bytes"] = parse_bytes(table["memory_bytes"], "memory_bytes")
                specs.append(PoolSpec(**table))
            kwargs["pools"] = tuple(specs)
        return cls(**kwargs)

    @classmethod
    def from_toml(cls, path: str | Path) -> DaemonConfig:
        """Read a TOML file, once it passed :func:`~kvtier.server.daemon.private_files.read_trusted_file`
        (no other user could have written it). Raises ValueError (bad keys/values, bad TOML, a file
        another user could write) or OSError."""
        raw = read_trusted_file(path, "--config")
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: {e}") from None
        return cls.from_mapping(data)


MAX_SECONDS = 86400.0
"""Largest value of a ``*_seconds`` setting (a day): deadlines are built from them."""
MAX_MESSAGE_BYTES = (1 << 31) - 1
"""gRPC's largest message limit (its channel arguments are C ints)."""


def _check_field_types(config: object) -> None:
    """Refuse a value of the wrong type (a TOML ``"5"`` for a number, ``true`` for a count, NaN or inf
    for seconds) in one line naming the key, before any range check compares it.

    Raises:
        ValueError: ``KEY must be TYPE, got VALUE``.
    """
    check_field_types(config, skip=("pd_peers",))  # pd_peers: a list or a comma-separated string (_unix_peers)
