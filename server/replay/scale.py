"""The scale knobs of a replay and the tier configs they imply.

The trace's 512-token blocks with GLM-5.2's 78 layers would need terabytes of KV (288,500 block
accesses, 182,790 distinct blocks, ~21 MiB a block). A replay keeps the real page geometry (64-token
pages, 656-byte fp8 latent rows, 8448-byte indexer page rows, the model's skip mask) and scales:

* ``tokens_per_block``: tokens a trace block stands for (default 64 = one page);
* ``num_layers``: the model's first N layers (default 4: GLM-5.2 layers 0-2 run the indexer, layer 3
  skips it), so one page record is 194,048 bytes;
* the tier budgets: device pool tokens, host bytes, disk bytes (LMDB map size).

With the defaults the whole trace (12,031 requests) replays on a 2-core, 24 GiB machine in minutes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvtier.server.model_config import DSAModelConfig
from kvtier.server.tiers.disk import DiskTierConfig, disk_charge
from kvtier.server.tiers.host import HostTierConfig
from kvtier.server.tiers.policies import resolve_policy
from kvtier.server.tiers.record import RecordCodec


@dataclass(frozen=True)
class ReplayScale:
    """Documented knobs of a replay.

    Attributes:
        model: preset name (``glm-5.2``, ``deepseek-v3.2``).
        num_layers: layers kept (the model's first ``num_layers``, with their skip mask).
        tokens_per_block: tokens per trace block (multiple of the 64-token page).
        device_tokens: device pool capacity in tokens (multiple of the page size).
        host_bytes: host tier budget.
        disk_bytes: disk tier budget (LMDB map size); records may use ``1 - reserve`` of it.
        write_back: host tier write-back (True) or write-through (False).
        policy: eviction policy of every tier (:func:`~kvtier.server.tiers.policies.make_policy`).
    """

    model: str = "glm-5.2"
    num_layers: int = 4
    tokens_per_block: int = 64
    device_tokens: int = 1024 * 64
    host_bytes: int = 1 << 30
    disk_bytes: int = 4 << 30
    write_back: bool = True
    policy: str = "default"

    def validate(self) -> None:
        """Raise ValueError naming a bad knob."""
        m = self.model_config()
        if self.tokens_per_block <= 0 or self.tokens_per_block % m.page_size:
            raise ValueError(f"tokens_per_block must be a positive multiple of {m.page_size}, got {self.tokens_per_block}")
        if self.device_tokens <= 0 or self.device_tokens % m.page_size:
            raise ValueError(f"device_tokens must be a positive multiple of {m.page_size}, got {self.device_tokens}")
        if self.host_bytes < 0 or self.disk_bytes < 0:
            raise ValueError("host_bytes and disk_bytes must be >= 0")
        resolve_policy(self.policy)

    def model_config(self) -> DSAModelConfig:
        """The scaled model (the preset's first ``num_layers`` layers)."""
        return DSAModelConfig.from_preset(self.model, num_layers=self.num_layers)

    def codec(self) -> RecordCodec:
        """Record codec of a target pool of the scaled model."""
        return RecordCodec(self.model_config())

    def tier_configs(self, disk_path: str) -> list[HostTierConfig | DiskTierConfig]:
        """Host and disk tier configs for these budgets (a zero budget leaves the tier out)."""
        return [HostTierConfig(capacity_bytes=self.host_bytes, write_back=self.write_back, policy=self.policy),
                DiskTierConfig(path=disk_path, capacity_bytes=self.disk_bytes, policy=self.policy)]

    def capacity_pages(self) -> dict[str, int]:
        """Pages each tier holds at most: ``{"device", "host", "disk"}``."""
        rec = self.codec().page_nbytes()
        disk = DiskTierConfig(path="-", capacity_bytes=self.disk_bytes).record_budget if self.disk_bytes else 0
        return {"device": self.device_tokens // self.model_config().page_size, "host": self.host_bytes // rec,
                "disk": disk // disk_charge(rec)}

    def describe(self) -> dict[str, Any]:
        """The knobs plus derived sizes (what ``kvtier replay`` prints as the scale used)."""
        m = self.model_config()
        return {**asdict(self), "page_size": m.page_size, "pages_per_block": self.tokens_per_block // m.page_size,
                "skip_mask": m.fingerprint()["skip_mask"], "page_record_bytes": self.codec().page_nbytes(),
                "capacity_pages": self.capacity_pages()}
