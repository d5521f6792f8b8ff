"""Typed errors of the tier layer; the daemon maps each to one gRPC status code in one place."""

from __future__ import annotations


class TierError(Exception):
    """Base class of tier errors."""


class TierFullError(TierError):
    """A write could not be placed: the record is larger than the tier, every candidate victim is
    pinned, or LMDB ran out of map space. Nothing of the failed write is visible afterwards.

    Attributes:
        done: items of a batch write handled (stored, or already held and touched) before the one
            that failed; their effects stay. Set by the tier's ``write``; 0 for a single record.
        written: keys among those ``done`` items that were stored.
    """

    done: int = 0
    written: tuple[bytes, ...] = ()


class RecordError(TierError, ValueError):
    """A record failed its checks: bad magic/version, lengths, checksum, or a model fingerprint
    that differs from the reader's. Readers turn it into a miss plus a counter and a log line."""


class LeaseError(TierError, KeyError):
    """An unknown or already released prefix-cache lease."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown lease"


class EnvironmentInUseError(TierError):
    """A second LMDB Environment for a file this process already has open."""


class DiskPathError(TierError, ValueError):
    """The disk tier's directory cannot hold an LMDB environment (a file, a pseudo or read-only
    filesystem, not writable). Raised when the daemon starts; the message says what to do."""


class DiskPathInUseError(DiskPathError):
    """Another process (another kvtier daemon) holds the disk directory's lock: one daemon a
    ``--disk-path`` (:mod:`~kvtier.server.tiers.disk_lock`). The message names its pid."""


class TierUnavailableError(TierError):
    """The tier is unhealthy (its storage failed: ENOSPC, EIO, a store whose master went away) and
    bypassed until a probe succeeds; the tier marked itself unhealthy before raising. Nothing of the
    failed call is visible in the tier (records of a batch stored before it stay: ``written``).

    Attributes:
        tier: the tier's name.
        reason: why it is unhealthy.
        written: keys of a batch write stored before the failure (they stay; e.g. the Mooncake Store
            tier's earlier store calls of the batch); empty for a single-record write.
        done: items of the batch handled (stored or already held) before the failure (0: none).
    """

    done: int = 0

    def __init__(self, tier: str, reason: str, *, written: tuple[bytes, ...] = ()) -> None:
        super().__init__(f"the {tier} tier is unhealthy ({reason}); it is bypassed until a probe succeeds")
        self.tier = tier
        self.reason = reason
        self.written = tuple(written)
