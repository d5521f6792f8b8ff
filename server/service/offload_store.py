"""Where offloaded requests' host copies live: a keyed, budget-checked store.

``Offload`` puts a pool's :meth:`~kvtier.server.pool.DSATokenToKVPool.get_cpu_copy` result here under
a key; ``Restore`` gets it back for ``load_cpu_copy``; ``Drop`` removes it. :class:`OffloadStore` keeps
copies in host memory under a byte budget. The daemon only talks to the :class:`CopyStore` protocol,
so a tier stack (host tier spilling to LMDB) can take its place: pass it as ``DaemonState(copy_store=...)``.

A copy is one unit: its latent rows and its live-layer indexer pages are stored, budgeted and
dropped together, never apart.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kvtier.server.service.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted


@dataclass(frozen=True)
class HostCopy:
    """One offloaded request.

    Attributes:
        copy: the ``get_cpu_copy`` result (``{"kv", "index_k", "src_loc"}``, host tensors).
        nbytes: host bytes its tensors take (latent rows plus live-layer indexer page rows).
        num_tokens: slots it covers.
        layout: the fingerprint (``DSAModelConfig.fingerprint()``) of the pool layout it came from.
        layout_digest: that fingerprint's digest; restore refuses a pool whose digest differs.
        source_pool: id of the pool it came from.
    """

    copy: Mapping[str, Any]
    nbytes: int
    num_tokens: int
    layout: Mapping[str, Any]
    layout_digest: str
    source_pool: str


class CopyStore(Protocol):
    """What the daemon needs from a store of host copies (all methods thread-safe)."""

    def check_room(self, key: str, nbytes: int) -> None:
        """Raise AlreadyExists if ``key`` is taken, ResourceExhausted if ``nbytes`` cannot fit."""

    def put(self, key: str, copy: HostCopy) -> bool | None:
        """Store ``copy`` under ``key``; same errors as :meth:`check_room`; nothing stored on error.
        Returns True if the copy is durable (committed to persistent storage), else False/None."""

    def get(self, key: str) -> HostCopy:
        """The copy under ``key``; NotFound if none."""

    def drop(self, key: str) -> HostCopy | None:
        """Remove and return the copy under ``key`` (None if there was none)."""

    def contains(self, key: str) -> bool:
        """Whether ``key`` holds a copy."""

    def usage_bytes(self) -> int:
        """Bytes held."""

    def budget_bytes(self) -> int:
        """The byte budget."""

    def __len__(self) -> int:
        """Copies held."""


class OffloadStore:
    """Host-memory :class:`CopyStore` with a byte budget (no eviction: a full store refuses).

    Args:
        budget_bytes: most bytes of copies held at once.

    Raises:
        ValueError: negative budget.
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self._budget = budget_bytes
        self._copies: dict[str, HostCopy] = {}
        self._used = 0
        self._lock = threading.Lock()

    def _check(self, key: str, nbytes: int) -> None:
        if not key:
            raise InvalidArgument("offload key must not be empty")
        if key in self._copies:
            raise AlreadyExists(f"offload key {key!r} already holds a copy; drop it first")
        if self._used + nbytes > self._budget:
            raise ResourceExhausted(
                f"host tier full: the copy needs {nbytes} bytes, {self._budget - self._used} of "
                f"{self._budget} are free")

    def check_room(self, key: str, nbytes: int) -> None:
        """See :meth:`CopyStore.check_room`."""
        with self._lock:
            self._check(key, nbytes)

    def put(self, key: str, copy: HostCopy) -> None:
        """See :meth:`CopyStore.put`."""
        with self._lock:
            self._check(key, copy.nbytes)
            self._copies[key] = copy
            self._used += copy.nbytes

    def get(self, key: str) -> HostCopy:
        """See :meth:`CopyStore.get`."""
        with self._lock:
            try:
                return self._copies[key]
            except KeyError:
                raise NotFound(f"no offloaded copy under key {key!r}") from None

    def drop(self, key: str) -> HostCopy | None:
        """See :meth:`CopyStore.drop`."""
        with self._lock:
            copy = self._copies.pop(key, None)
            if copy is not None:
                self._used -= copy.nbytes
            return copy

    def contains(self, key: str) -> bool:
        """See :meth:`CopyStore.contains`."""
        with self._lock:
            return key in self._copies

    def usage_bytes(self) -> int:
        """See :meth:`CopyStore.usage_bytes`."""
        with self._lock:
            return self._used

    def budget_bytes(self) -> int:
        """See :meth:`CopyStore.budget_bytes`."""
        return self._budget

    def __len__(self) -> int:
        with self._lock:
            return len(self._copies)
