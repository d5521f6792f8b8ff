"""How unit bytes travel between the backend and its daemon: one small interface, two movers.

The backend decides *what* moves (which keys, which part, which host pages) and gathers or scatters
the pages' bytes through a per-thread staging buffer; a :class:`UnitTransport` moves the staging
buffer's bytes to or from the daemon:

* :class:`GrpcTransport`: the parts travel as gRPC streams (``StorageService.PutUnits`` /
  ``GetUnits``), chunked under the message limit: any daemon, local or remote.
* shared memory (same machine): a per-session staging memfd that the daemon creates and passes over
  its attach channel (SCM_RIGHTS); calls then name offsets in it instead of carrying bytes. It needs
  the daemon's attach channel (issue 9); until that is in kvtier, ``transport = "shm"`` is refused and
  ``auto`` uses gRPC.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch

from kvtier.client import KVTierClient
from kvtier.client.storage import UnitSpaceSpec
from kvtier.integrations.sglang.settings import BackendSettings


class UnitTransport(Protocol):
    """Moves units' parts between this process's staging buffer and the daemon."""

    name: str

    def staging(self, nbytes: int) -> torch.Tensor:
        """This thread's staging buffer, at least ``nbytes`` uint8 (reused between calls)."""

    def exists(self, space: UnitSpaceSpec, keys: list[bytes]) -> int:
        """Longest prefix of ``keys`` whose units are whole and present."""

    def put(self, space: UnitSpaceSpec, keys: list[bytes], part: str) -> list[bool]:
        """Store ``part`` of each key's unit from the staging buffer (unit ``i`` at ``i * part bytes``)."""

    def get(self, space: UnitSpaceSpec, keys: list[bytes], part: str) -> list[bool]:
        """Read ``part`` of each key's unit into the staging buffer; per key whether it was there."""

    def clear(self, space: UnitSpaceSpec) -> int:
        """Remove the space's units; returns how many."""

    def stats(self) -> dict[str, int]:
        """The daemon's unit counters of this tenant."""

    def close(self) -> None:
        """Release the connection."""


class GrpcTransport:
    """Unit parts as gRPC streams to any kvtier daemon (``settings.address``)."""

    name = "grpc"

    def __init__(self, settings: BackendSettings) -> None:
        self.client = KVTierClient(
            settings.address or None, timeout=settings.timeout_s, chunk_bytes=settings.chunk_bytes,
            max_message_bytes=settings.max_message_bytes, retries=1, token=settings.token or None,
            tls_root_cert=settings.tls_root_cert or None, tls_client_cert=settings.tls_client_cert or None,
            tls_client_key=settings.tls_client_key or None)
        self._local = threading.local()

    def staging(self, nbytes: int) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._local.buf = torch.empty(nbytes, dtype=torch.uint8)
        return buf

    def exists(self, space: UnitSpaceSpec, keys: list[bytes]) -> int:
        return self.client.exist_units(space, keys)

    def put(self, space: UnitSpaceSpec, keys: list[bytes], part: str) -> list[bool]:
        data = self.staging(len(keys) * space.part_nbytes(part))
        return self.client.put_units(space, keys, part, data).accepted

    def get(self, space: UnitSpaceSpec, keys: list[bytes], part: str) -> list[bool]:
        return self.client.get_units(space, keys, part, self.staging(len(keys) * space.part_nbytes(part)))

    def clear(self, space: UnitSpaceSpec) -> int:
        return self.client.clear_units(space)

    def stats(self) -> dict[str, int]:
        return self.client.unit_stats()

    def close(self) -> None:
        self.client.close()


def make_transport(settings: BackendSettings) -> UnitTransport:
    """The transport ``settings.transport`` names.

    Raises:
        ValueError: ``shm``, which needs the daemon's attach channel (not in this kvtier yet).
    """
    if settings.transport == "shm":
        raise ValueError("kvtier backend: transport 'shm' needs the daemon's attach channel (local attach, issue 9), "
                         "which this kvtier does not have yet; use transport 'grpc' (or 'auto')")
    return GrpcTransport(settings)
