"""Moving a copy between a pool's buffers and host memory: row gathers into a host buffer, and on
CUDA the staged path DESIGN.md asks for.

A copy is a list of *parts*, each ``(src, index)``: ``src`` a ``(groups, rows, words)`` word view of a
pool component (layers x slots x row words, or live layers x pages x page words) and ``index`` the
rows to take. The host bytes of a copy are the parts one after another, each ``(groups, len(index),
words)``, exactly the ``get_cpu_copy`` / record payload layout.

* CPU: one gather per group (numpy's ``take``) straight into its slice of the host buffer (one pass
  over the bytes; ~2x faster than one gather along dim 1), and a load's scatters of every layer, each
  split over :func:`copy_threads` plain threads with the GIL released (:func:`gather_jobs`,
  :func:`scatter_jobs`): the copies use the machine's cores without torch's OpenMP threads.
* CUDA: every part is gathered on the device into one contiguous staging buffer (on the current
  stream, after the work that wrote the pool), then a side stream that waits for it copies the whole
  staging buffer to the (page-locked) host buffer in one DMA and records an event; only that event is
  waited for -- never the whole device. Host to device is the reverse: the host bytes go up in one
  DMA on the side stream when they lie back to back (a ``get_cpu_copy`` result or a record payload),
  else one DMA per tensor, and the current stream waits for that event before the pool is written.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

Part = tuple[torch.Tensor, torch.Tensor]


def part_nbytes(src: torch.Tensor, index: torch.Tensor) -> int:
    """Host bytes of one part: ``groups * len(index) * words * word size``."""
    return src.shape[0] * index.numel() * src.shape[2] * src.element_size()


def host_views(flat: torch.Tensor, parts: Sequence[Part]) -> list[torch.Tensor]:
    """``(groups, len(index), words)`` views of consecutive slices of the uint8 buffer ``flat``, in
    the part's word dtype; a slice that does not start on a whole word (a model whose latent rows are
    not whole words, e.g. 1,022 bytes, puts the indexer pages after ``layers * n * 1022`` bytes) is a
    ``(groups, len(index), words * word size)`` uint8 view instead, which :func:`gather_rows` fills
    through a uint8 view of the source."""
    views, start = [], 0
    for src, index in parts:
        n = part_nbytes(src, index)
        piece = flat[start:start + n]
        if piece.storage_offset() % src.element_size():
            views.append(piece.view(src.shape[0], index.numel(), src.shape[2] * src.element_size()))
        else:
            views.append(piece.view(src.dtype).view(src.shape[0], index.numel(), src.shape[2]))
        start += n
    return views


def gather_rows(src: torch.Tensor, dim: int, index: torch.Tensor, out: torch.Tensor) -> None:
    """``index_select(src, dim, index, out=out)``, through a uint8 view of ``src`` when ``out`` is the
    uint8 form :func:`host_views` gives an unaligned slice."""
    torch.index_select(src if out.dtype == src.dtype else src.view(out.dtype), dim, index, out=out)


def slot_runs(index: torch.Tensor, max_runs: int) -> list[tuple[int, int]] | None:
    """``(first, count)`` of each run of consecutive values of the 1-D int64 ``index`` (``index[i+1]
    == index[i] + 1`` inside a run), in order; None when there are more than ``max_runs`` runs.
    Whole pages of a request's slots are runs of at least ``page_size``."""
    n = index.numel()
    if n == 0:
        return []
    breaks = torch.nonzero(index[1:] - index[:-1] != 1).reshape(-1)
    if breaks.numel() + 1 > max_runs:
        return None
    starts = [0, *(breaks + 1).tolist()]
    firsts = index[starts].tolist()
    return [(f, e - s) for f, s, e in zip(firsts, starts, [*starts[1:], n])]


MAX_COPY_THREADS = 64
"""The most threads :func:`set_copy_threads` accepts."""

PARALLEL_MIN_BYTES = 8 << 20
"""A host copy (:func:`copy_pairs`, :func:`gather_jobs`, :func:`scatter_jobs`) moving less than this
runs on the caller's thread alone."""

_helpers: ThreadPoolExecutor | None = None
_helpers_lock = threading.Lock()
_copy_threads = max(1, min(os.cpu_count() or 1, MAX_COPY_THREADS))
_idle = threading.Semaphore(_copy_threads - 1)  # helper slots free; replaced by set_copy_threads


def copy_threads() -> int:
    """Threads a large host copy is split over (the caller's and ``copy_threads() - 1`` helpers').
    Default: the machine's cores (:func:`os.cpu_count`), at most :data:`MAX_COPY_THREADS`."""
    return _copy_threads


def set_copy_threads(n: int) -> None:
    """Split large host copies over ``n`` threads from now on (calls in flight finish as they began).

    The daemon sets it from its ``copy_threads`` setting, ``kvtier bench --torch-threads N`` to N.
    Plain threads, not torch's OpenMP ones: each runs one numpy copy with the GIL released, so a
    busy machine slows them as it slows any thread (torch's OpenMP teams fell to 0.3-0.9 GB/s at 2
    threads on a busy 2-core machine, where these kept 3.5-11 GB/s: docs/bench/threads).

    Raises:
        ValueError: ``n`` not in ``1 .. MAX_COPY_THREADS``.
    """
    global _copy_threads, _idle
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_COPY_THREADS:
        raise ValueError(f"copy threads must be an integer in 1..{MAX_COPY_THREADS}, got {n!r}")
    with _helpers_lock:
        _copy_threads, _idle = n, threading.Semaphore(n - 1)


def _helper_pool() -> ThreadPoolExecutor:
    global _helpers
    with _helpers_lock:
        if _helpers is None:
            _helpers = ThreadPoolExecutor(MAX_COPY_THREADS - 1, thread_name_prefix="kvtier-copy")
        return _helpers


Pair = tuple[torch.Tensor, torch.Tensor]
"""``(dst, src)`` of one host copy."""


def _copy_one(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def _copy_all(pairs: Sequence[Pair], copy: Callable[[torch.Tensor, torch.Tensor], None] = _copy_one) -> None:
    for dst, src in pairs:
        copy(dst, src)


def _run_all(items: Sequence[Any], fn: Callable[[Any], None]) -> None:
    for item in items:
        fn(item)


def _run_helper(items: Sequence[Any], fn: Callable[[Any], None], slot: threading.Semaphore) -> None:
    try:
        _run_all(items, fn)
    finally:
        slot.release()


def _groups(sizes: Sequence[int], k: int) -> list[tuple[int, int]]:
    """At most ``k`` consecutive, non-empty ``(start, end)`` ranges of ``sizes``' indexes, cut where
    the running sum first reaches each ``g / k`` of the total (about equal bytes each)."""
    total, bounds, acc = sum(sizes), [0], 0
    for i, size in enumerate(sizes[:-1]):
        acc += size
        if len(bounds) < k and acc * k >= total * len(bounds):
            bounds.append(i + 1)
    bounds.append(len(sizes))
    return list(zip(bounds, bounds[1:]))


def split_run(items: Sequence[Any], sizes: Sequence[int], fn: Callable[[Any], None]) -> None:
    """``fn(item)`` for every item, complete when this returns; with :data:`PARALLEL_MIN_BYTES` or
    more in all (``sizes``: each item's bytes), the items are cut into :func:`copy_threads` groups
    of about equal bytes, the first run by the caller and the others by helper threads (``fn`` must
    release the GIL to gain). A group whose helper is busy (another call's), or that has not started
    when the caller's is done, the caller runs itself: a call never waits behind another. If any
    group raises, this raises once every started group is done (none still writing).

    Lock order: none taken (the helpers are leaves; callers may hold a pool's lock).
    """
    n, slot = _copy_threads, _idle
    if n < 2 or len(items) < 2 or sum(sizes) < PARALLEL_MIN_BYTES:
        _run_all(items, fn)
        return
    groups = [items[a:b] for a, b in _groups(sizes, min(n, len(items)))]
    futures = []
    for group in groups[1:]:
        if not slot.acquire(blocking=False):
            break
        try:
            futures.append((_helper_pool().submit(_run_helper, group, fn, slot), group))
        except RuntimeError:  # interpreter shutting down
            slot.release()
            break
    error: BaseException | None = None
    try:
        _run_all(groups[0], fn)
        for group in groups[1 + len(futures):]:
            _run_all(group, fn)
    except BaseException as e:  # noqa: BLE001 - raised below, once no helper is still writing
        error = e
    for fut, group in futures:
        if fut.cancel():  # never started: run it here (or, after a failure, not at all)
            slot.release()
            if error is None:
                try:
                    _run_all(group, fn)
                except BaseException as e:  # noqa: BLE001
                    error = e
        else:
            exc = fut.exception()  # waits: never return (and let a lock go) while a helper writes
            error = error or exc
    if error is not None:
        raise error


def copy_pairs(pairs: Sequence[Pair], copy: Callable[[torch.Tensor, torch.Tensor], None] = _copy_one) -> None:
    """``copy(dst, src)`` for every ``(dst, src)`` pair of host tensors, complete when this returns.
    By default ``dst.copy_(src)`` (same shapes); a scatter passes its own (numpy's fancy assignment
    of ``src``'s rows at an index into ``dst``, :func:`scatter_layers`). ``src`` holds the bytes a pair
    moves; the pairs' destinations do not overlap, and ``copy`` must release the GIL to gain.

    Large calls are split over :func:`copy_threads` threads (:func:`split_run`): memory streams in
    parallel (1.8-2.0x one thread for two on this machine) for the copies that run while the client
    waits (a WriteKV commit).
    """
    split_run(pairs, [src.numel() * src.element_size() for _, src in pairs], lambda p: copy(p[0], p[1]))


Job = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""``(dst, index, src)`` of one row copy along dim 0 (a gather: ``dst = src[index]``; a scatter:
``dst[index] = src``), host tensors of one word dtype."""


def _take(job: Job) -> None:
    dst, index, src = job
    # mode="clip": no bounds check (the pool checked the slots) and no buffered out= (numpy buffers
    # `out` in the default mode); the GIL is released for the copy
    np.take(src.numpy(), index.numpy(), axis=0, out=dst.numpy(), mode="clip")


def gather_jobs(jobs: Sequence[Job]) -> None:
    """``dst = src[index]`` (rows along dim 0) for every ``(dst, index, src)`` job of host tensors,
    split over :func:`copy_threads` threads (numpy's ``take``, the GIL released: one memory stream a
    thread, none of torch's OpenMP threads). ``index``: ``(n,)`` int64 rows of ``src`` (checked by
    the caller); ``dst``: ``(n, *src.shape[1:])``, contiguous."""
    split_run(jobs, [d.numel() * d.element_size() for d, _, _ in jobs], _take)


def scatter_jobs(jobs: Sequence[Job]) -> None:
    """``dst[index] = src`` (rows along dim 0) for every ``(dst, index, src)`` job of host tensors,
    ``index`` distinct: rows in at most :data:`MAX_COPY_RUNS` runs of consecutive slots are block
    copies, others numpy's fancy assignment (each row one block: 1.5-1.7x torch's ``index_copy_``),
    all split over :func:`copy_threads` threads (the work of many layers spread over the cores; one
    layer a thread at a time). Jobs that share an index tensor (every layer of one copy) find its
    runs once."""
    runs_of: dict[tuple[int, int], list[tuple[int, int]] | None] = {}
    items: list[Job] = []
    for dst, index, src in jobs:
        key = (index.data_ptr(), index.numel())
        if key not in runs_of:
            runs_of[key] = slot_runs(index, MAX_COPY_RUNS)
        runs = runs_of[key]
        if runs is None:
            items.append((dst, index, src))
        else:
            items.extend((d, _NO_INDEX, r) for d, r in run_pairs(dst, runs, src))
    split_run(items, [s.numel() * s.element_size() for _, _, s in items], _put)


_NO_INDEX = torch.empty(0, dtype=torch.int64)


def _put(job: Job) -> None:
    dst, index, src = job
    if index is _NO_INDEX:
        dst.numpy()[...] = src.numpy()
    else:
        dst.numpy()[index.numpy()] = src.numpy()


def scatter_layers(pairs: Sequence[Pair], index: torch.Tensor) -> None:
    """``dst[index[i]] = src[i]`` along dim 0 for every ``(dst, src)`` pair of host tensors (several
    layers, the same distinct ``(n,)`` int64 slots ``index``, scattered: more runs than
    :data:`MAX_COPY_RUNS`), through numpy's fancy assignment, layers split over the copy threads
    (:func:`copy_pairs`; 1.8x one thread for 78 GLM-5.2 layers of 4,096 scattered slots on 2 cores).
    The index is read once for every layer."""
    rows = index.numpy()

    def put(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.numpy()[rows] = src.numpy()

    copy_pairs(pairs, put)


MAX_COPY_RUNS = 16
"""Up to this many runs of consecutive rows a scatter copies run by run (one block copy each);
more, and numpy's fancy assignment (a block a row) is cheaper than a Python call a run."""


def scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor, *,
                 runs: list[tuple[int, int]] | None = None) -> None:
    """``dst[index[i]] = src[i]`` along dim 0 (``index`` distinct, checked by the caller).

    On the CPU: rows whose slots make at most :data:`MAX_COPY_RUNS` runs are copied a run at a time
    (one ``copy_`` of contiguous memory each; BENCHMARKS.md fix 13), others through numpy's fancy
    assignment, which copies each row as
    one block: 1.5-1.7x torch's element-wise ``index_copy_`` on the same int64 rows (measured,
    BENCHMARKS.md). On a device, ``index_copy_``. ``runs``: ``slot_runs(index, MAX_COPY_RUNS)``
    when the caller has it already (several layers, the same slots; :func:`scatter_layers` when
    that was None).
    """
    if dst.device.type == "cpu":
        runs = runs if runs is not None else slot_runs(index, MAX_COPY_RUNS)
        if runs is None:
            dst.numpy()[index.numpy()] = src.numpy()
            return
        _copy_all(run_pairs(dst, runs, src))
    else:
        dst.index_copy_(0, index, src)


def run_pairs(dst: torch.Tensor, runs: Sequence[tuple[int, int]], src: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``(dst rows, src rows)`` block copies of a scatter of ``src`` (one row per slot, in slot
    order) onto ``dst`` rows ``runs`` (:func:`slot_runs`), for :func:`copy_pairs` or one by one."""
    pairs, done = [], 0
    for first, count in runs:
        pairs.append((dst[first:first + count], src[done:done + count]))
        done += count
    return pairs


def contiguous_span(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One uint8 view covering ``tensors`` when they are contiguous, on the CPU, in one storage and
    back to back in this order; else None."""
    if not tensors or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return None
    storage = tensors[0].untyped_storage()
    start = tensors[0].data_ptr()
    end = start
    for t in tensors:
        if t.untyped_storage().data_ptr() != storage.data_ptr() or t.data_ptr() != end:
            return None
        end += t.numel() * t.element_size()
    offset = start - storage.data_ptr()
    return torch.empty(0, dtype=torch.uint8).set_(storage, offset, (end - start,))


class CopyEngine:
    """Gathers to host and uploads for one pool device (a side stream on CUDA, made on first use)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: torch.cuda.Stream | None = None
        self._lock = threading.Lock()

    def _side_stream(self) -> torch.cuda.Stream:
        with self._lock:
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            return self._stream

    def gather_to_host(self, parts: Sequence[Part], flat: torch.Tensor) -> None:
        """Copy every part's rows into the host buffer ``flat`` (laid out as :func:`host_views`);
        complete when this returns."""
        if self.device.type != "cuda":
            gather_jobs([(dst[g], index, src[g] if dst.dtype == src.dtype else src[g].view(dst.dtype))
                         for (src, index), dst in zip(parts, host_views(flat, parts)) if index.numel()
                         for g in range(src.shape[0])])
            return
        nbytes = sum(part_nbytes(s, i) for s, i in parts)
        if nbytes == 0:
            return
        current = torch.cuda.current_stream(self.device)
        staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        for (src, index), dst in zip(parts, host_views(staging, parts)):
            if index.numel():
                gather_rows(src, 1, index, dst)  # one gather per component, on the device
        side = self._side_stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            flat[:nbytes].copy_(staging, non_blocking=True)  # one DMA into page-locked memory
            staging.record_stream(side)
        done = torch.cuda.Event()
        done.record(side)
        done.synchronize()

    def to_device(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` (host) as device tensors of the same shapes and dtypes; on the CPU the tensors
        themselves. On CUDA the current stream waits (an event, not a device sync) until they are there."""
        if self.device.type != "cuda" or not tensors:
            return list(tensors)
        if all(t.device == self.device for t in tensors):
            return list(tensors)
        sizes = [t.numel() * t.element_size() for t in tensors]
        staging = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
        current = torch.cuda.current_stream(self.device)
        side = self._side_stream()
        side.wait_stream(current)  # the staging memory may have been in use on the current stream
        span = contiguous_span(tensors)
        with torch.cuda.stream(side):
            if span is not None:
                staging.copy_(span, non_blocking=True)  # one DMA for the whole copy
            else:
                start = 0
                for t, n in zip(tensors, sizes):
                    staging[start:start + n].copy_(t.contiguous().view(-1).view(torch.uint8), non_blocking=True)
                    start += n
            staging.record_stream(side)
        uploaded = torch.cuda.Event()
        uploaded.record(side)
        current.wait_event(uploaded)
        out, start = [], 0
        for t, n in zip(tensors, sizes):
            out.append(staging[start:start + n].view(t.dtype).view(t.shape))
            start += n
        return out

    def finish(self) -> None:
        """Wait (an event on the current stream, not a device sync) until the pool writes queued so
        far are done, so the host sources may be dropped or reused."""
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            done.synchronize()
