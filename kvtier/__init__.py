"""kvtier: KV-cache tiering daemon for DeepSeek-sparse-attention (DSA) models.

Sub-packages:
  kvtier.server  the daemon: skip-aware pools, tiers, transfer, gRPC service (folder ``server/``)
  kvtier.client  what inference workers embed (folder ``client/``)
  kvtier.v1      generated wire contract (folder ``proto/kvtier/v1``)
"""

__version__ = "0.1.0"
