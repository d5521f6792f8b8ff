"""Case ``disk``: the LMDB disk tier's spill and restore against a plain file of the same records.

Page records as the replay's default scale makes them (GLM-5.2 layers 0-3: 194,048 bytes each, three
indexer layers and one skip layer). Each round, interleaved, on the file system of ``--out``:

* spill: each record written by its own ``DiskTier.write([(key, record)])`` call (one transaction per
  record, as the host tier's write-back cascade writes them) vs ``write()`` of the same bytes to a
  plain file; with fsync (``sync=True``: LMDB syncs every commit; the file is fsynced after every
  record) and without; and, without fsync, 8 records a ``write`` (what a cascade handing a request's
  victims down together would cost);
* restore: each record read back the way kvtier's callers read it -- ``DiskTier.borrow([key])`` (what
  ``Restore`` and the prefix cache's load call: a verified copy in a host buffer), ``borrow`` of 8
  keys a call (one read transaction) and ``read_into`` a reused buffer -- checksum verified, vs
  ``readinto`` of the same bytes from the plain file into a reused buffer. Both read from the page
  cache (the files were just written).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from kvtier.bench.case import BenchContext, Case, CaseResult, Comparison, interleaved, throughput
from kvtier.server.pool import create_pool, slots_of_pages
from kvtier.server.replay.scale import ReplayScale
from kvtier.server.tiers import DiskTier, DiskTierConfig, RecordCodec


def page_records(n: int, seed: int = 0) -> list[torch.Tensor]:
    """``n`` sealed one-page records of the replay's default model scale (random bytes, 64 distinct pages)."""
    model = ReplayScale().model_config()
    pool = create_pool(model, 64 * 64, device="cpu")
    g = torch.Generator().manual_seed(seed)
    slots = torch.arange(64, 64 * 65)
    for layer in range(model.num_layers):
        pool.set_kv_buffer(layer, slots, torch.randint(0, 256, (slots.numel(), model.latent_row_bytes), dtype=torch.uint8, generator=g))
    for layer in model.live_indexer_layers:
        pool.set_index_k_scale_buffer(layer, slots, torch.randint(0, 256, (slots.numel(), 128), dtype=torch.uint8, generator=g),
                                      torch.rand(slots.numel(), generator=g))
    codec = RecordCodec(model)
    return [codec.encode_from_pool(pool, slots_of_pages(torch.tensor([1 + i % 64]), 64)) for i in range(n)]


class DiskRound:
    """One round's files: a fresh LMDB environment and a fresh plain file under ``workdir``."""

    def __init__(self, records: list[torch.Tensor], workdir: Path, sync: bool) -> None:
        self.records, self.workdir, self.sync = records, workdir, sync
        self.keys = [b"page-%06d" % i for i in range(len(records))]
        self.total = sum(int(r.numel()) for r in records)
        self.buf = torch.zeros(max(int(r.numel()) for r in records), dtype=torch.uint8)
        self.rounds = 0
        self.disk: DiskTier | None = None
        self.path: Path | None = None
        self.offsets: list[tuple[int, int]] = []

    def setup(self) -> None:
        """Untimed, before each round: the last round's files removed, a fresh environment opened
        (the batch spill writes into a second fresh one)."""
        self.rounds += 1
        self.close()
        if self.path is not None:
            self.path.unlink(missing_ok=True)
        d = self.workdir / f"lmdb-{self.sync}-{self.rounds}"
        self.disk = DiskTier(DiskTierConfig(path=str(d), capacity_bytes=3 * self.total + (64 << 20), sync=self.sync))
        self.disk.open()
        self.path = self.workdir / f"plain-{self.sync}-{self.rounds}.bin"

    def lmdb_spill(self) -> None:
        assert self.disk is not None
        for k, r in zip(self.keys, self.records):
            self.disk.write([(k, r)])

    def lmdb_spill_batch(self, per_call: int = 8) -> None:
        """The same records, ``per_call`` a ``write`` (one transaction each batch): what a cascade that
        hands a request's victims down together would cost."""
        assert self.disk is not None
        items = [(b"batch-" + k, r) for k, r in zip(self.keys, self.records)]  # not the keys lmdb_spill wrote
        for i in range(0, len(items), per_call):
            self.disk.write(items[i:i + per_call])

    def file_spill(self) -> None:
        assert self.path is not None
        self.offsets = []
        with open(self.path, "wb", buffering=0) as f:
            pos = 0
            for r in self.records:
                f.write(memoryview(r.numpy()))
                if self.sync:
                    os.fsync(f.fileno())
                self.offsets.append((pos, int(r.numel())))
                pos += int(r.numel())

    def lmdb_borrow(self) -> None:
        assert self.disk is not None
        for k in self.keys:
            with self.disk.borrow([k]) as (rec,):
                if rec is None:
                    raise RuntimeError(f"disk tier lost record {k!r}")
            del rec

    def lmdb_borrow_batch(self, per_call: int = 8) -> None:
        assert self.disk is not None
        for i in range(0, len(self.keys), per_call):
            with self.disk.borrow(self.keys[i:i + per_call]) as recs:
                if any(r is None for r in recs):
                    raise RuntimeError("disk tier lost a record")
            del recs

    def lmdb_read_into(self) -> None:
        assert self.disk is not None
        for k in self.keys:
            if not self.disk.read_into([k], [self.buf])[0]:
                raise RuntimeError(f"disk tier lost record {k!r}")

    def file_read(self) -> None:
        assert self.path is not None
        mv = memoryview(self.buf.numpy())
        with open(self.path, "rb", buffering=0) as f:
            for off, n in self.offsets:
                f.seek(off)
                f.readinto(mv[:n])

    def verify(self) -> None:
        """Every record comes back byte for byte, from LMDB and from the file."""
        assert self.disk is not None and self.path is not None
        for k, r in zip(self.keys, self.records):
            with self.disk.borrow([k]) as (rec,):
                if rec is None or not torch.equal(rec, r):
                    raise RuntimeError(f"disk tier returned other bytes for {k!r}")
        data = self.path.read_bytes()
        for (off, n), r in zip(self.offsets, self.records):
            if data[off:off + n] != r.numpy().tobytes():
                raise RuntimeError("the plain file returned other bytes")

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
            shutil.rmtree(self.disk.config.path, ignore_errors=True)
            self.disk = None
        if self.path is not None:
            self.path.unlink(missing_ok=True)


class DiskCase(Case):
    name = "disk"
    title = "LMDB disk tier: spill and restore of page records vs a plain file"

    def settings(self, ctx: BenchContext) -> dict[str, Any]:
        return {"records": 256 if ctx.quick else 512, "record_bytes": 194_048, "reps": 3 if ctx.quick else 7,
                "sync_reps": 2 if ctx.quick else 5, "warmup": 1, "workdir_fs": "the file system of --out"}

    def steps(self, ctx: BenchContext) -> int:
        s = self.settings(ctx)
        return 1 + s["reps"] + s["sync_reps"] + 2 * s["warmup"]

    def run(self, ctx: BenchContext) -> CaseResult:
        s = self.settings(ctx)
        res = CaseResult(self.name, self.title, s)
        records = page_records(s["records"])
        total = sum(int(r.numel()) for r in records)
        s["record_bytes"], s["total_bytes"] = int(records[0].numel()), total
        ctx.advance(1)
        nosync = DiskRound(records, ctx.workdir, sync=False)
        try:
            t = interleaved({"lmdb_spill": nosync.lmdb_spill, "file_spill": nosync.file_spill,
                             "lmdb_spill_batch": nosync.lmdb_spill_batch,
                             "lmdb_borrow": nosync.lmdb_borrow, "lmdb_borrow_batch": nosync.lmdb_borrow_batch,
                             "lmdb_read_into": nosync.lmdb_read_into,
                             "file_read": nosync.file_read}, s["reps"], warmup=s["warmup"], tick=lambda: ctx.advance(1),
                            setup=nosync.setup)
            nosync.verify()
        finally:
            nosync.close()
        synced = DiskRound(records, ctx.workdir, sync=True)
        try:
            ts = interleaved({"lmdb_spill": synced.lmdb_spill, "file_spill": synced.file_spill},
                             s["sync_reps"], warmup=s["warmup"], tick=lambda: ctx.advance(1), setup=synced.setup)
        finally:
            synced.close()
        gb = lambda label, secs: throughput(label, total, secs)  # noqa: E731
        c = res.comparisons
        c.append(Comparison("disk.spill_vs_file", "spill host->disk, one transaction a record, no fsync, vs plain file write()",
                            "GB/s", gb("LMDB tier write()", t["lmdb_spill"]), gb("plain file write()", t["file_spill"]), target=0.8))
        c.append(Comparison("disk.spill_batch_vs_file", "spill 8 records a write (one transaction a batch), no fsync, vs plain file write()",
                            "GB/s", gb("LMDB tier write(8 records)", t["lmdb_spill_batch"]), gb("plain file write()", t["file_spill"])))
        c.append(Comparison("disk.spill_fsync_vs_file", "spill with fsync (LMDB sync every commit) vs plain file write()+fsync a record",
                            "GB/s", gb("LMDB tier write(), sync", ts["lmdb_spill"]), gb("plain file write()+fsync", ts["file_spill"]),
                            target=0.9))
        c.append(Comparison("disk.restore_borrow_vs_file", "restore disk->host as the prefix cache reads (borrow, checksum verified) vs plain file readinto",
                            "GB/s", gb("LMDB tier borrow()", t["lmdb_borrow"]), gb("plain file readinto()", t["file_read"]), target=0.8))
        c.append(Comparison("disk.restore_borrow_batch_vs_file", "restore 8 records a call (one read transaction, checksums verified) vs plain file readinto",
                            "GB/s", gb("LMDB tier borrow(8 keys)", t["lmdb_borrow_batch"]), gb("plain file readinto()", t["file_read"]),
                            target=0.8))
        c.append(Comparison("disk.restore_read_into_vs_file", "restore into a reused buffer (read_into, checksum verified) vs plain file readinto",
                            "GB/s", gb("LMDB tier read_into()", t["lmdb_read_into"]), gb("plain file readinto()", t["file_read"]),
                            target=0.8))
        res.figures["seconds"] = {"no_fsync": t, "fsync": ts}
        return res
