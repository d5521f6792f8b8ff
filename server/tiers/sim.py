"""A size-only tier for cache simulation: the same index, budget, charges and policy as a real
tier, no bytes. ``kvtier replay --simulate`` runs the prefix cache over these, so its hit counts
equal a real run's exactly (same decisions, no data)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvtier.server.tiers.base import EvictHook, RecordLike, Tier, TierConfig, record_nbytes
from kvtier.server.tiers.disk import DiskTierConfig, disk_charge
from kvtier.server.tiers.errors import TierFullError
from kvtier.server.tiers.host import HostTierConfig
from kvtier.server.tiers.mooncake_config import MooncakeStoreTierConfig


@dataclass
class SimTierConfig(TierConfig):
    """A simulated tier.

    Attributes:
        name: the tier it stands for (``host`` or ``disk``).
        capacity_bytes: budget in charged bytes (the real tier's record budget).
        lmdb_charge: charge records as the LMDB tier does (:func:`disk_charge`) instead of their size.
        write_back: as :attr:`HostTierConfig.write_back`.
        shared: stands for a shared tier (published to at store time, not cascaded into); its LRU over
            ``capacity_bytes`` only approximates a real store, which other daemons fill too and which
            evicts by its own rules.
    """

    kind: ClassVar[str] = "sim"
    name: str = "host"
    lmdb_charge: bool = False
    write_back: bool = True
    shared: bool = False

    @classmethod
    def like(cls, config: TierConfig) -> SimTierConfig:
        """The simulated twin of a real tier config (same budget, charges and write policy)."""
        if isinstance(config, HostTierConfig):
            return cls(capacity_bytes=config.capacity_bytes, name="host", write_back=config.write_back,
                       policy=config.policy)
        if isinstance(config, DiskTierConfig):
            return cls(capacity_bytes=config.record_budget, name="disk", lmdb_charge=True, policy=config.policy)
        if isinstance(config, MooncakeStoreTierConfig):
            return cls(capacity_bytes=config.capacity_bytes, name="mooncake", shared=True, policy=config.policy)
        if isinstance(config, SimTierConfig):
            return config
        raise ValueError(f"no simulated twin for {type(config).__name__}")


class SimTier(Tier):
    """Holds record sizes only; reads succeed for present keys and touch them."""

    def __init__(self, config: SimTierConfig) -> None:
        config.validate()
        self.name = config.name
        self.shared = config.shared
        super().__init__(config.make_index(config.capacity_bytes))
        self.config = config
        self._sizes: dict[bytes, int] = {}

    def admits(self, items: Sequence[tuple[bytes, RecordLike]]) -> list[bool]:
        """The disk tier's admission rule, for the disk's twin (others admit everything)."""
        if not self.config.lmdb_charge:
            return [True] * len(items)
        with self.index.lock:
            return [self.index.admit(k, self._charge(record_nbytes(r))) for k, r in items]

    def _charge(self, n: int) -> int:
        return disk_charge(n) if self.config.lmdb_charge else n

    def nbytes(self, keys: Sequence[bytes]) -> list[int | None]:
        with self.index.lock:
            return [self._sizes.get(k) for k in keys]

    def read_into(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor]) -> list[int]:
        with self.index.lock:
            got = [self._sizes.get(k, 0) for k in keys]
            for k, n in zip(keys, got):
                if n:
                    self.index.touch(k)
        self._count(hits=sum(1 for n in got if n), misses=sum(1 for n in got if not n), bytes_read=sum(got))
        return got

    @contextmanager
    def borrow(self, keys: Sequence[bytes]) -> Iterator[list[RecordLike | None]]:
        got = self.read_into(keys, [])
        yield [n or None for n in got]

    def write(self, items: Sequence[tuple[bytes, RecordLike]], *, on_evict: EvictHook | None = None,
              replace: bool = False) -> list[bytes]:
        written: list[bytes] = []
        with self.index.lock:
            for pos, (key, rec) in enumerate(items):
                if key in self.index:
                    if not replace:
                        self.index.touch(key)
                        continue
                    self.remove([key])
                n = record_nbytes(rec)
                try:
                    victims = self.index.plan_insert(key, self._charge(n))
                except TierFullError as e:
                    self._count(full_errors=1)
                    e.done, e.written = pos, tuple(written)  # the batch's earlier items stay
                    raise
                for v in victims:
                    if on_evict is not None:
                        on_evict(v, self._sizes[v])
                    self._count(evictions=1, bytes_evicted=self._sizes.pop(v))
                self.index.commit_insert(key, self._charge(n), victims)
                self._sizes[key] = n
                self._count(writes=1, bytes_written=n)
                written.append(key)
        return written

    def remove(self, keys: Sequence[bytes]) -> int:
        n = 0
        with self.index.lock:
            for k in keys:
                if self.index.remove(k):
                    del self._sizes[k]
                    n += 1
        return n
