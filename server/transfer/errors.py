"""Typed errors of PD transfer. The gRPC layer maps each to one status code in one place.

* :class:`LayoutMismatchError` -- the peers' pools differ (fingerprint, page size, row bytes, skip
  mask, item lengths); raised before any byte moves (FAILED_PRECONDITION).
* :class:`PageMappingError` -- a bad source -> destination slot/page mapping (INVALID_ARGUMENT).
* :class:`TransferEngineUnavailable` -- the Mooncake Transfer Engine is not installed or did not
  start (FAILED_PRECONDITION).
* :class:`TransferError` -- the engine (or the fallback stream) failed while moving bytes: a
  non-zero return code, an injected failure, a broken stream (ABORTED / UNAVAILABLE).
* :class:`PageChanged` -- a source page changed (written, freed, allocated again) while a pull read
  it, so its layers may come from two writes (ABORTED).
"""

from __future__ import annotations


class TransferError(RuntimeError):
    """Moving bytes between peers failed. The destination pages hold undefined bytes afterwards.

    Attributes:
        batch: 0-based index of the batch that failed (None when not batch-specific).
        return_code: the engine's return code, when there was one.
    """

    def __init__(self, message: str, *, batch: int | None = None, return_code: int | None = None) -> None:
        super().__init__(message)
        self.batch = batch
        self.return_code = return_code


class PageChanged(TransferError):
    """A source page's write generation changed between the pull's layout fetch and the last byte
    read of it (a write, a free, an allocation to another request): the pull must not deliver it."""


class TransferEngineUnavailable(TransferError):
    """The Mooncake Transfer Engine cannot be used (not installed, libraries missing, init failed)."""


class LayoutMismatchError(ValueError):
    """Two pools' layouts differ; the message names the first difference. Nothing was moved."""


class PageMappingError(ValueError):
    """A source -> destination mapping is invalid (lengths, duplicates, padding page, alignment)."""
