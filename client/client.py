"""``KVTierClient``: everything a worker calls on a kvtier daemon, one class.

It is :class:`~kvtier.client.base.BaseClient` (channel, deadlines, retries) plus one mixin per
service. To add a service's methods, write a mixin in its own module (a subclass of ``BaseClient``
that reaches the daemon through ``self.stub(XStub)`` and ``self.unary``/``self.server_stream``) and
add it to the bases below, e.g. ``class KVTierClient(PoolMixin, TierMixin, BaseClient)``.
"""

from __future__ import annotations

from kvtier.client.attach import AttachMixin
from kvtier.client.base import BaseClient
from kvtier.client.pool import PoolMixin
from kvtier.client.staging import StagingMixin
from kvtier.client.storage import StorageMixin
from kvtier.client.tiers import TierMixin
from kvtier.client.transfer import TransferMixin


class KVTierClient(PoolMixin, TierMixin, TransferMixin, StorageMixin, StagingMixin, AttachMixin, BaseClient):
    """Client of a kvtier daemon; see :class:`~kvtier.client.base.BaseClient` for the arguments.

    Example::

        with KVTierClient("unix:///tmp/kvtier-1000/kvtier.sock", timeout=10) as c:
            slots = c.allocate_slots("default", 100)
            c.write_kv("default", slots, latent={0: rows}, index={0: (keys, scales)})
            kv = c.read_kv("default", slots)

        with KVTierClient() as c, c.attach("default") as pool:   # local attach: the pool's memory, mapped here
            slots = pool.allocate_slots(64)
            pool.set_kv_buffer(0, slots, rows)                    # writes the daemon's bytes directly
    """

    def __enter__(self) -> KVTierClient:
        return self
