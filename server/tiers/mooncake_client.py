"""The Mooncake Store client as the mooncake tier uses it: a setup that cannot hang, every return
code checked and classified, batches cut to sizes the store handles.

What the ``mooncake.store.MooncakeDistributedStore`` of ``mooncake-transfer-engine-non-cuda``
0.3.13.post1 really does (tried against a real ``mooncake_master`` on 127.0.0.1, TCP transport):

* ``setup(local_hostname, metadata_server, global_segment_size, local_buffer_size, protocol,
  rdma_devices, master_server_addr)`` returns 0 in ~40 ms when the master is up. With the master down
  it does not fail: it retries (20 times, ~4.4 s each) **holding the GIL**, so the whole process stops.
  :meth:`StoreClient.open` therefore connects to the master's RPC port (and an HTTP metadata server's
  port) first and calls ``setup`` only when both answer.
* The global segment (memory this client lends to the store) is mapped lazily: a 1 GiB segment
  costs no resident memory until objects land in it. It must be 0 (lend none; the client still puts
  and gets) or at least 16 MiB (smaller: ``setup`` fails, INVALID_PARAMS, "Total size must be at least
  16777216"). Objects live in *some* client's segment (random allocation by default), so a client that
  goes away takes its objects with it. The store evicts approximately LRU (tried: a re-read object
  survived, the newest survived) ~5% at a time once a segment passes 90% full.
* Every batch call returns one int per key: ``batch_put_from``/``batch_remove`` 0 or a negative
  ``ErrorCode``; ``batch_get_into`` the object's size or a negative code; ``batch_is_exist`` 1, 0
  or -1 (error, e.g. -900 when the master is gone). A put of a key that exists returns 0 and moves no
  bytes (the first writer wins); ``batch_upsert_from`` replaces.
* Codes met: -704 OBJECT_NOT_FOUND (miss), -706 OBJECT_HAS_LEASE (remove within the read lease,
  ``default_kv_lease_ttl`` 10 s on the master; ``force=True`` removes anyway), -600 INVALID_PARAMS
  (empty key; a get into a buffer smaller than the object; a soft-pin TTL without soft pin), -200
  NO_AVAILABLE_HANDLE (store full: eviction runs at the master's 90% high watermark, a moment later;
  also right after a master restart until clients have remounted their segments), -800 TRANSFER_FAIL
  (the peer holding the bytes is gone: until the master drops that client after ``client_ttl``, 10 s,
  its objects still exist but cannot be read; also a batch above ~2,000 items, the transfer engine's
  queue limit, hence :data:`MAX_BATCH_KEYS`), -900 RPC_FAIL (master unreachable).
* Master gone: ``batch_is_exist``/``batch_get_into`` fail at once (-900); ``batch_put_from`` and
  ``batch_remove`` block ~4.3-4.5 s in the client's retries first (they release the GIL).
  ``health_check()`` reports 2 only after the client's ping thread noticed (it said 0 right after a
  kill), so a probe must do real work. Master back (same ports): clients remount by themselves within
  ~1-2 s; the restarted master has no objects (unless run with HA/snapshots): every earlier key misses.
  A master restarted on the same HTTP port right after a kill can fail to bind and exit (retry).
* Keys are str; 5,000-character keys are accepted, the empty key is not. Unregistered memory worked
  over TCP, but RDMA needs registered memory, so the tier always stages in a registered region.
* ``replica_num`` > 1 needs that many segments; a put whose second replica cannot be written fails
  whole (-800). Soft pin: ``ReplicateConfig.soft_pin_action = SoftPinAction.ENABLE`` (optionally
  ``soft_pin_ttl_ms``, at most the master's ``max_kv_soft_pin_ttl``); soft-pinned objects are evicted
  after the others (and not at all if the master runs ``--allow_evict_soft_pinned_objects=false``).
* Every client of one store must use the same metadata mode: an HTTP-metadata client could not open
  a P2PHANDSHAKE client's segment. Both modes recover after a master restart (P2PHANDSHAKE: the first
  puts answer NO_AVAILABLE_HANDLE until the segments are mounted again). Besides ``local_hostname``
  the client's transfer engine also listens on the first non-loopback interface's address. ``setup(..., tenant_id=...)`` exists (master
  ``--enable_multi_tenants``); kvtier does not use it: its keys carry their namespace.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvtier.server.tiers.errors import TierError

log = logging.getLogger(__name__)
_warned = threading.Event()


def _warn_open_ports_once() -> None:
    """Say once a process that the store client's transfer engine is reachable by anyone (README, Security)."""
    if not _warned.is_set():
        _warned.set()
        log.warning("the Mooncake Store client's transfer engine listens on every interface and serves the store's "
                    "objects and this process's memory without authentication: run the store only where "
                    "every host and local user that can reach it is trusted (README, Security)")

OK = 0
NO_AVAILABLE_HANDLE = -200
BUFFER_OVERFLOW = -10
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900

#: ``ErrorCode`` names (mooncake-store/include/types.h) of the codes a tier can meet.
CODE_NAMES: dict[int, str] = {
    0: "OK", -1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -100: "SHARD_INDEX_OUT_OF_RANGE",
    -101: "SEGMENT_NOT_FOUND", -102: "SEGMENT_ALREADY_EXISTS", -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE", -300: "INVALID_VERSION", -400: "INVALID_KEY", -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS", -601: "ILLEGAL_CLIENT", -700: "INVALID_WRITE", -701: "INVALID_READ",
    -702: "INVALID_REPLICA", -703: "REPLICA_IS_NOT_READY", -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS", -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED",
    -708: "OBJECT_HAS_REPLICATION_TASK", -710: "REPLICA_NOT_FOUND", -712: "REPLICA_IS_GONE",
    -800: "TRANSFER_FAIL", -900: "RPC_FAIL", -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
    -1011: "UNAVAILABLE_IN_CURRENT_MODE",
}

#: Codes that mean "this object is not (or no longer) readable" rather than a failing store.
MISS_CODES = frozenset({OBJECT_NOT_FOUND, -703, -707, -710, -712})
#: Codes that mean "the store has no room now".
FULL_CODES = frozenset({NO_AVAILABLE_HANDLE, BUFFER_OVERFLOW, -101})
#: Largest batch one call sends (3,000 puts of 8 KiB already failed in part with TRANSFER_FAIL).
MAX_BATCH_KEYS = 1000


def code_name(code: int) -> str:
    """``-704`` -> ``"OBJECT_NOT_FOUND (-704)"``."""
    return f"{CODE_NAMES.get(code, 'UNKNOWN')} ({code})"


class StoreUnavailable(TierError):
    """The store cannot serve now (master or peer gone, client not set up): the tier turns unhealthy."""


class StoreFull(TierError):
    """The store has no room for an object now."""


def split_host_port(addr: str, what: str) -> tuple[str, int]:
    """``"127.0.0.1:50051"`` -> ``("127.0.0.1", 50051)``. Raises ValueError naming ``what``."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} must be HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


def metadata_endpoint(metadata: str) -> tuple[str, int] | None:
    """Host and port of an HTTP metadata server URL; None for ``P2PHANDSHAKE``.

    Raises:
        ValueError: neither ``P2PHANDSHAKE`` nor an ``http://HOST:PORT/...`` URL.
    """
    if metadata == "P2PHANDSHAKE":
        return None
    parts = urlsplit(metadata)
    if parts.scheme != "http" or not parts.hostname or not parts.port:
        raise ValueError(f"mooncake metadata must be P2PHANDSHAKE or http://HOST:PORT/metadata, got {metadata!r}")
    return parts.hostname, parts.port


def reachable(host: str, port: int, timeout_s: float) -> str:
    """"" if a TCP connection to ``host:port`` opens within ``timeout_s``, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return ""
    except OSError as e:
        return f"{host}:{port} does not answer ({e.strerror or e})"


@dataclass(frozen=True)
class ClientSettings:
    """What :meth:`StoreClient.open` passes to ``setup`` (see ``MooncakeStoreTierConfig``)."""

    local_hostname: str
    metadata: str
    global_segment_bytes: int
    local_buffer_bytes: int
    protocol: str
    rdma_devices: str
    master: str
    connect_timeout_s: float


class StoreClient:
    """One ``MooncakeDistributedStore``, set up on demand, with checked batch calls.

    Thread-safe: the store's calls are (the C++ client serves many threads); :meth:`open` and
    :meth:`close` are serialised by a lock that no data call takes.

    Raises:
        ValueError: the ``mooncake`` package (``pip install 'kvtier[mooncake]'``) is missing: a stack
            that names the mooncake tier cannot be built.
    """

    def __init__(self, settings: ClientSettings) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig, SoftPinAction
        except ImportError as e:
            raise ValueError("the mooncake tier needs the mooncake package (mooncake-transfer-engine-non-cuda): "
                             "pip install 'kvtier[mooncake]'") from e

        self.settings = settings
        self._store_cls = MooncakeDistributedStore
        self._replicate_cls = ReplicateConfig
        self._soft_pin = SoftPinAction
        self._store: Any = None
        self._registered: list[tuple[int, int]] = []
        self._open_lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        """Whether ``setup`` succeeded and the client was not closed since."""
        return self._store is not None

    def replicate_config(self, replicas: int, soft_pin: bool, soft_pin_ttl_ms: int) -> Any:
        """A ``ReplicateConfig`` for puts (``data_type`` KVCACHE)."""
        cfg = self._replicate_cls()
        cfg.replica_num = replicas
        if soft_pin:
            cfg.soft_pin_action = self._soft_pin.ENABLE
            if soft_pin_ttl_ms:
                cfg.soft_pin_ttl_ms = soft_pin_ttl_ms
        try:
            from mooncake.store import ObjectDataType

            cfg.data_type = ObjectDataType.KVCACHE
        except (ImportError, AttributeError):  # older wheels have no data types
            pass
        return cfg

    def open(self, regions: Sequence[tuple[int, int]]) -> None:
        """Set the client up (if not yet) and register ``regions`` ``(ptr, nbytes)`` with it.

        Raises:
            StoreUnavailable: the master (or HTTP metadata server) does not answer, or ``setup`` or
                ``register_buffer`` returned an error.
        """
        s = self.settings
        with self._open_lock:
            if self._store is not None:
                return
            why = reachable(*split_host_port(s.master, "mooncake master"), s.connect_timeout_s)
            meta = metadata_endpoint(s.metadata)
            if not why and meta is not None:
                why = reachable(*meta, s.connect_timeout_s)
            if why:
                raise StoreUnavailable(f"mooncake master unreachable: {why}")
            store = self._store_cls()
            rc = store.setup(s.local_hostname, s.metadata, s.global_segment_bytes, s.local_buffer_bytes,
                             s.protocol, s.rdma_devices, s.master)
            if rc != 0:
                store.close()
                raise StoreUnavailable(f"mooncake setup failed: {code_name(rc)}")
            for ptr, n in regions:
                rc = store.register_buffer(ptr, n)
                if rc != 0:
                    store.close()
                    raise StoreUnavailable(f"mooncake register_buffer({n} bytes) failed: {code_name(rc)}")
            self._registered = list(regions)
            self._store = store
            log.info("mooncake store client %s set up (master %s, metadata %s, %s, segment %d bytes)",
                     store.get_hostname(), s.master, s.metadata, s.protocol, s.global_segment_bytes)
            _warn_open_ports_once()

    def _live(self) -> Any:
        store = self._store
        if store is None:
            raise StoreUnavailable("the mooncake store client is not set up")
        return store

    @staticmethod
    def _chunks(n: int) -> list[slice]:
        return [slice(i, min(i + MAX_BATCH_KEYS, n)) for i in range(0, n, MAX_BATCH_KEYS)]

    def exist(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is in the store.

        Raises:
            StoreUnavailable: the store answered -1 (error) for any key.
        """
        store = self._live()
        out: list[bool] = []
        for sl in self._chunks(len(keys)):
            codes = store.batch_is_exist(list(keys[sl]))
            if len(codes) != sl.stop - sl.start or any(c not in (0, 1) for c in codes):
                bad = next((c for c in codes if c not in (0, 1)), None)
                raise StoreUnavailable(f"batch_is_exist failed ({code_name(bad) if bad is not None else 'short answer'})")
            out.extend(c == 1 for c in codes)
        return out

    def put_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int], config: Any,
                 *, upsert: bool = False) -> list[int]:
        """``batch_put_from`` (or ``batch_upsert_from``): one code per key, checked by the caller."""
        store = self._live()
        call = store.batch_upsert_from if upsert else store.batch_put_from
        codes = call(list(keys), list(ptrs), list(sizes), config)
        if len(codes) != len(keys):
            raise StoreUnavailable(f"batch put answered {len(codes)} codes for {len(keys)} keys")
        return list(codes)

    def get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """``batch_get_into``: per key the object's bytes or a negative code, checked by the caller."""
        codes = self._live().batch_get_into(list(keys), list(ptrs), list(sizes))
        if len(codes) != len(keys):
            raise StoreUnavailable(f"batch_get_into answered {len(codes)} codes for {len(keys)} keys")
        return list(codes)

    def remove(self, keys: Sequence[str], *, force: bool = False) -> list[int]:
        """``batch_remove``: one code per key."""
        codes = self._live().batch_remove(list(keys), force)
        if len(codes) != len(keys):
            raise StoreUnavailable(f"batch_remove answered {len(codes)} codes for {len(keys)} keys")
        return list(codes)

    def hostname(self) -> str:
        """The client's ``host:port`` name in the store ("" before setup)."""
        store = self._store
        return store.get_hostname() if store is not None else ""

    def close(self) -> None:
        """Unregister the regions and close the client (blocks a few seconds if the master is gone)."""
        with self._open_lock:
            store, self._store = self._store, None
            if store is None:
                return
            for ptr, _ in self._registered:
                rc = store.unregister_buffer(ptr)
                if rc != 0:
                    log.warning("mooncake unregister_buffer failed: %s", code_name(rc))
            rc = store.close()
            if rc != 0:
                log.warning("mooncake store close returned %s", code_name(rc))
