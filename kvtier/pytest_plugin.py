"""pytest plugin (entry point ``pytest11: kvtier``): an ephemeral kvtier daemon with tiny tier budgets.

For people who test tier eviction against kvtier. The fixture ``kvtier_daemon`` starts a real daemon
subprocess (unix socket, LMDB disk tier in a temp dir) whose tiers hold only a few pages, with one
small pool, and tears it down afterwards::

    def test_lru_order(kvtier_daemon):
        d = kvtier_daemon
        keys = d.page_keys(6)                       # six chained page keys
        for k in keys:
            d.put_pages([k])                        # load (miss) -> write KV -> store -> release
        assert d.client.where_is(d.pool_id, keys[:1]) == [["disk"]]

``kvtier_daemon_factory(**budgets)`` starts more (or differently sized) daemons; all stop at the end
of the test. ``kvtier_attached_pool`` is the tiny pool attached to the test process (local attach:
its tensors are the daemon's memory), and ``d.attach()`` attaches more; every attached pool is
detached at the end of the test::

    def test_my_worker(kvtier_attached_pool):
        ap = kvtier_attached_pool
        lease = ap.load_prefix(keys)
        ap.kv_buffer[0][lease.slots] = rows.view(-1, 1, 656)     # write KV through the tensors
        ap.store_prefix(lease, keys, lease.slots)
        ap.release_prefix(lease)
 Budgets: ``device_pages`` (pool pages), ``host_pages`` and ``disk_pages`` (records of one
page each; the LMDB map is twice the records' size), ``write_through``, ``num_layers`` (of ``model``),
``policy`` (the eviction policy of every tier: ``lru`` unless given, so eviction order is the
recency order a test can work out by hand; ``default``, ``s3fifo``, ``arc``, ``hitdensity`` or ``duel`` test another).
The daemon is configured by a TOML file in its temp dir (``[tiers]`` table).

``mooncake_master`` starts a real ``mooncake_master`` with its HTTP metadata server on free ports of
127.0.0.1 (:class:`kvtier.mooncake_master.MooncakeMaster`: ``.master``, ``.metadata``, ``.kill()``,
``.start()``) and always kills it afterwards; a missing mooncake wheel fails the test.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

LMDB_PAGE = 4096


def _record_bytes(num_layers: int, live_layers: int, page_size: int = 64) -> int:
    """Bytes of one page record of an fp8 pool (header <= 1 KiB, see kvtier.server.tiers.record)."""
    return 1024 + num_layers * page_size * 656 + live_layers * page_size * 132 + page_size * 8


@dataclass
class TinyDaemon:
    """A running ephemeral daemon and a pool on it.

    Attributes:
        address: where it listens.
        client: a connected :class:`kvtier.client.KVTierClient`.
        pool_id: the pool's id.
        page_size: tokens per page.
        budgets: the budgets it was started with.
        workdir: its temp dir (the LMDB environment lives in ``workdir / "disk"``).
    """

    address: str
    client: Any
    pool_id: str
    page_size: int
    budgets: dict[str, Any]
    workdir: Path
    process: Any = field(repr=False, default=None)
    attached: list[Any] = field(repr=False, default_factory=list)

    def attach(self) -> Any:
        """The pool attached to this process (a :class:`kvtier.client.AttachedPool`); detached when
        the daemon is stopped, at the end of the test."""
        ap = self.client.attach(self.pool_id)
        self.attached.append(ap)
        return ap

    def page_keys(self, n: int, seed: int = 0) -> list[bytes]:
        """``n`` chained page keys of a synthetic token sequence (distinct per ``seed``)."""
        from kvtier.page_keys import page_keys

        start = seed * 1_000_003
        return page_keys(list(range(start, start + n * self.page_size)), self.page_size)

    def put_pages(self, keys: list[bytes], attached: Any = None) -> list[str]:
        """One request over ``keys``: load the present prefix, write random KV into the rest, store,
        release. Returns the tier each loaded page came from. With ``attached`` (from :meth:`attach`)
        the KV is written through its tensors in its session instead of over gRPC."""
        import torch

        c = attached.client if attached is not None else self.client
        lease = c.load_prefix(self.pool_id, keys)
        try:
            n = lease.loaded_pages
            fresh = lease.slots[n * self.page_size:]
            if fresh.numel():
                lay = c.layout(self.pool_id)
                rows = torch.randint(0, 256, (fresh.numel(), lay.latent_row_bytes), dtype=torch.uint8)
                live = [i for i, ch in enumerate(lay.skip_mask) if ch == "F"]
                index = {i: (torch.randint(0, 256, (fresh.numel(), lay.index_head_dim), dtype=torch.uint8),
                             torch.rand(fresh.numel())) for i in live}
                if attached is not None:
                    for i in range(lay.num_layers):
                        attached.kv_buffer[i][fresh] = rows.view(fresh.numel(), 1, -1)
                    for i, (k, sc) in index.items():
                        attached.set_index_k_scale_buffer(i, fresh, k, sc)
                else:
                    c.write_kv(self.pool_id, fresh, latent={i: rows for i in range(lay.num_layers)}, index=index)
                c.store_prefix(lease, keys[n:], fresh)
            return lease.tiers
        finally:
            c.release_prefix(lease)


def start_tiny_daemon(workdir: Path, *, device_pages: int = 8, host_pages: int = 4, disk_pages: int = 8,
                      write_through: bool = False, model: str = "glm-5.2", num_layers: int = 4,
                      policy: str = "lru") -> TinyDaemon:
    """Start a daemon whose tiers hold ``host_pages`` and ``disk_pages`` one-page records, with a pool
    of ``device_pages`` pages, every tier evicting by ``policy``. Stop it with :func:`stop_tiny_daemon`."""
    from kvtier.client import KVTierClient
    from kvtier.client.spawn import DaemonProcess

    live = num_layers  # upper bound for sizing; the real record is smaller on skip layers
    rec = _record_bytes(num_layers, live)
    host_bytes = host_pages * (rec - 1024 + 384)  # records carry a <1 KiB header: size to the real record
    charge = -(-(rec + 16) // LMDB_PAGE) * LMDB_PAGE + 256
    # half the map for records (disk_pages of them), half kept free: LMDB reuses freed pages only
    # two transactions later, so a tiny map with big records needs a big reserve
    disk_bytes = max(-(-(2 * (disk_pages * charge + charge // 2)) // LMDB_PAGE) * LMDB_PAGE, 64 * LMDB_PAGE)
    config = workdir / "kvtier.toml"
    config.write_text(f'device = "cpu"\nlog_level = "WARNING"\nhost_memory_bytes = {host_bytes}\n\n[tiers]\n'
                      f'disk_path = "{workdir / "disk"}"\ndisk_bytes = {disk_bytes}\ndisk_reserve_fraction = 0.5\n'
                      f'write_through = {"true" if write_through else "false"}\npolicy = "{policy}"\n')
    args = ["--config", str(config)]
    proc = DaemonProcess(extra_args=args)
    proc.start()
    client = KVTierClient(proc.address, timeout=60.0)
    info = client.create_pool(model, num_layers=num_layers, size_tokens=device_pages * 64, pool_id="tiny")
    budgets = {"device_pages": device_pages, "host_bytes": host_bytes, "disk_bytes": disk_bytes,
               "write_through": write_through, "model": model, "num_layers": num_layers, "policy": policy}
    return TinyDaemon(proc.address, client, info.pool_id, info.layout.page_size, budgets, workdir, proc)


def stop_tiny_daemon(d: TinyDaemon) -> int | None:
    """Detach its attached pools, close the client, stop the daemon (SIGTERM), return its exit code."""
    for ap in d.attached:
        ap.detach()
    d.client.close()
    code = d.process.stop()
    d.process.cleanup()
    return code


@pytest.fixture
def kvtier_daemon_factory() -> Iterator[Callable[..., TinyDaemon]]:
    """Start ephemeral daemons: ``kvtier_daemon_factory(host_pages=2, disk_pages=3, ...)``; all are
    stopped and their temp dirs removed after the test."""
    started: list[TinyDaemon] = []
    dirs: list[Path] = []

    def start(**budgets: Any) -> TinyDaemon:
        workdir = Path(tempfile.mkdtemp(prefix="kvtier-tiny-"))
        dirs.append(workdir)
        d = start_tiny_daemon(workdir, **budgets)
        started.append(d)
        return d

    try:
        yield start
    finally:
        for d in started:
            stop_tiny_daemon(d)
        for w in dirs:
            shutil.rmtree(w, ignore_errors=True)


@pytest.fixture
def kvtier_daemon(kvtier_daemon_factory: Callable[..., TinyDaemon]) -> TinyDaemon:
    """An ephemeral daemon with tiny budgets (pool 8 pages, host 4 pages, disk 8 pages) and a pool
    ``tiny`` of GLM-5.2's first 4 layers."""
    return kvtier_daemon_factory()


@pytest.fixture
def kvtier_attached_pool(kvtier_daemon: TinyDaemon) -> Any:
    """The pool ``tiny`` of ``kvtier_daemon`` attached to this process (an :class:`kvtier.client.AttachedPool`:
    ``kv_buffer``, ``index_k_with_scale_buffer``, ``set_kv_buffer``, ... on the daemon's memory, and
    ``load_prefix``/``store_prefix``/``release_prefix``/``allocate_slots`` in its session); detached after the test."""
    return kvtier_daemon.attach()


@pytest.fixture
def mooncake_master() -> Iterator[Any]:
    """A real ``mooncake_master`` (HTTP metadata server on) on free 127.0.0.1 ports, killed after the test."""
    from kvtier.mooncake_master import MooncakeMaster

    m = MooncakeMaster()
    try:
        m.start()
        yield m
    finally:
        m.cleanup()
