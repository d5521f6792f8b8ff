"""What inference workers embed to talk to a kvtier daemon (never imports ``kvtier.server``).

Modules: ``base`` (channel, deadlines, retries), ``errors`` (one exception per status code),
``pool`` (PoolService methods), ``attach`` (local attach: ``KVTierClient.attach`` ->
:class:`AttachedPool`; imports the pool core ``kvtier.server.pool`` lazily, nothing else of the
server), ``storage`` (StorageService: units), ``staging`` (storage sessions: shared-memory staging
buffers for the unit store's staged calls), ``client`` (KVTierClient = all mixins), ``spawn`` (start a daemon as a subprocess, for
tests and embedded use).
"""

from kvtier.client.attach import AttachedPool
from kvtier.client.client import KVTierClient
from kvtier.client.errors import (
    AbortedError, AlreadyExistsError, CancelledError, DeadlineExceededError, FailedPreconditionError, InvalidArgumentError, KVTierError,
    NotFoundError, ResourceExhaustedError, UnauthenticatedError, UnavailableError,
)
from kvtier.client.pool import KVData, OffloadResult
from kvtier.client.spawn import DaemonProcess, spawn_daemon

__all__ = [
    "AbortedError", "AlreadyExistsError", "CancelledError", "AttachedPool", "DaemonProcess", "DeadlineExceededError", "FailedPreconditionError", "InvalidArgumentError",
    "KVData", "KVTierClient", "KVTierError", "NotFoundError", "OffloadResult", "ResourceExhaustedError",
    "UnauthenticatedError", "UnavailableError", "spawn_daemon",
]
