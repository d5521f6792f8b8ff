"""Case ``disk``: the LMDB disk tier's spill and restore against a plain file of the same records.

Page records as the replay's default scale makes them (GLM-5.2 layers 0-3: 194,048 bytes each, three
indexer layers and one skip layer), on the file system of ``--out``. What is measured, each round,
interleaved (each phase starts at the next function every round, so none always runs first):

* **the environment is warm, as a running daemon's is**: one LMDB environment serves every round;
  the round's setup (untimed) removes the last round's records, so the spill writes into pages LMDB
  freed and reuses (a daemon's disk tier fills once, then every write recycles an evicted record's
  pages). The first fill of a new environment (a fresh one each round, its file growing) is
  measured too, as ``spill_fresh``;
* spill: as the daemon spills, the host tier's victims of one eviction batch
  (:data:`~kvtier.server.tiers.prefix.EVICT_BATCH`, 64 pages) in one ``DiskTier.write`` call (one
  transaction a batch: ``TierStack.put_many``, BENCHMARKS.md fix 14), and each record by its own
  call (one transaction a record), vs ``write()`` of the same bytes to a new plain file; with fsync
  (``sync=True``: LMDB syncs every commit, here one record a commit; the file is fsynced after every
  record) and without;
* restore, checksum verified: ``DiskTier.borrow`` as the prefix cache calls it (a request's pages
  ``DiskTier.borrow_batch`` (4) at a time), and one page record a call (``borrow`` and ``read_into``
  one reused buffer: what a call's fixed cost weighs against a 194 KB read; no daemon path reads
  page records one a call); vs ``readinto`` of the same bytes from the plain file into one
  reused buffer. Both read from the page cache (the files were just written). The LRU updates a
  read defers (``TierIndex.touch_later``) are applied inside the timed run;
* offloaded request copies (``Offload``/``Restore``: one record a request, GLM-5.2's 78 layers and
  21 indexer layers, 256 tokens, 13.8 MB): spilled one record a write, and restored one record a
  call with ``borrow`` as ``Restore`` reads them, vs the plain file's ``write()`` and ``readinto``
  of the same bytes;
* LMDB's ``writemap`` (examined, not used): raw LMDB put+commit of the same records, no kvtier code,
  into a warm environment whose pages were written back to disk (``fsync`` in the setup, as the
  pages of records evicted minutes ago are), with ``writemap=True`` (one copy, into the map) against
  the default (a copy into LMDB's dirty page, then ``pwrite``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import lmdb
import torch

from kvtier.bench.case import BenchContext, Case, CaseResult, Comparison, interleaved, throughput
from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool import create_pool, slots_of_pages
from kvtier.server.replay.scale import ReplayScale
from kvtier.server.tiers import DiskTier, DiskTierConfig, RecordCodec
from kvtier.server.tiers.disk import BORROW_BATCH
from kvtier.server.tiers.prefix import EVICT_BATCH


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


def offloaded_copies(n: int, tokens: int, seed: int = 0) -> list[torch.Tensor]:
    """``n`` sealed records of offloaded GLM-5.2 requests of ``tokens`` tokens (random bytes; every
    layer's latent rows and the 21 indexer layers' pages), as ``Offload`` stores one a request."""
    model = DSAModelConfig.from_preset("glm-5.2")
    pool = create_pool(model, tokens + 64, device="cpu")
    g = torch.Generator().manual_seed(seed)
    slots = torch.arange(64, 64 + tokens)
    for layer in range(model.num_layers):
        pool.set_kv_buffer(layer, slots, torch.randint(0, 256, (tokens, model.latent_row_bytes), dtype=torch.uint8, generator=g))
    for layer in model.live_indexer_layers:
        pool.set_index_k_scale_buffer(layer, slots, torch.randint(0, 256, (tokens, 128), dtype=torch.uint8, generator=g),
                                      torch.rand(tokens, generator=g))
    rec = RecordCodec(model).encode_from_pool(pool, slots)
    return [rec.clone() for _ in range(n)]  # distinct memory each (the bytes need not differ)


class DiskRound:
    """The environments and files of the case under ``workdir``: a warm LMDB environment kept across
    rounds, a fresh one (with ``fresh``) and a new plain file each round."""

    def __init__(self, records: list[torch.Tensor], workdir: Path, sync: bool, fresh: bool = True) -> None:
        self.records, self.workdir, self.sync, self.with_fresh = records, workdir, sync, fresh
        workdir.mkdir(parents=True, exist_ok=True)
        self.keys = [b"page-%06d" % i for i in range(len(records))]
        self.batch_keys = [b"batch-" + k for k in self.keys]
        self.total = sum(int(r.numel()) for r in records)
        self.buf = torch.zeros(max(int(r.numel()) for r in records), dtype=torch.uint8)
        self.rounds = 0
        cap = 4 * self.total + (64 << 20)
        self.disk = DiskTier(DiskTierConfig(path=str(workdir / f"lmdb-warm-{sync}"), capacity_bytes=cap, sync=sync))
        self.disk.open()
        self.fresh: DiskTier | None = None
        self.capacity = cap
        self.path = workdir / f"plain-{sync}.bin"
        self.offsets: list[tuple[int, int]] = []

    def setup(self) -> None:
        """Untimed, before each round: the last round's records removed from the warm environment
        (their pages are freed for this round's spill), a new fresh environment, the plain file gone."""
        self.rounds += 1
        self.disk.remove(self.keys + self.batch_keys)
        self._close_fresh()
        if self.with_fresh:
            self._open_fresh()
        self.path.unlink(missing_ok=True)

    def _open_fresh(self) -> None:
        self.fresh = DiskTier(DiskTierConfig(path=str(self.workdir / f"lmdb-fresh-{self.sync}-{self.rounds}"),
                                             capacity_bytes=self.capacity, sync=self.sync))
        self.fresh.open()

    def lmdb_spill(self) -> None:
        for k, r in zip(self.keys, self.records):
            self.disk.write([(k, r)])

    def lmdb_spill_fresh(self) -> None:
        assert self.fresh is not None
        for k, r in zip(self.keys, self.records):
            self.fresh.write([(k, r)])

    def lmdb_spill_batch(self, per_call: int = EVICT_BATCH) -> None:
        """The same records, ``per_call`` a ``write`` (one transaction each batch), as the victims of
        one eviction batch go down the stack."""
        items = list(zip(self.batch_keys, self.records))
        for i in range(0, len(items), per_call):
            self.disk.write(items[i:i + per_call])

    def file_spill(self) -> None:
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
        """As the prefix cache loads a request's disk pages: ``BORROW_BATCH`` keys a call."""
        for i in range(0, len(self.keys), BORROW_BATCH):
            with self.disk.borrow(self.keys[i:i + BORROW_BATCH]) as recs:
                if any(r is None for r in recs):
                    raise RuntimeError("disk tier lost a record")
            del recs
        self.disk.index.apply_touches()  # the reads' deferred LRU updates, timed here (a daemon's next write applies them)

    def lmdb_borrow_one(self) -> None:
        for k in self.keys:
            with self.disk.borrow([k]) as (rec,):
                if rec is None:
                    raise RuntimeError(f"disk tier lost record {k!r}")
            del rec
        self.disk.index.apply_touches()

    def lmdb_read_into(self) -> None:
        for k in self.keys:
            if not self.disk.read_into([k], [self.buf])[0]:
                raise RuntimeError(f"disk tier lost record {k!r}")
        self.disk.index.apply_touches()

    def file_read(self) -> None:
        mv = memoryview(self.buf.numpy())
        with open(self.path, "rb", buffering=0) as f:
            for off, n in self.offsets:
                f.seek(off)
                f.readinto(mv[:n])

    def verify(self) -> None:
        """Every record comes back byte for byte, from LMDB and from the file."""
        for tier in (self.disk, self.fresh) if self.with_fresh else (self.disk,):
            assert tier is not None
            for k, r in zip(self.keys, self.records):
                with tier.borrow([k]) as (rec,):
                    if rec is None or not torch.equal(rec, r):
                        raise RuntimeError(f"disk tier returned other bytes for {k!r}")
        data = self.path.read_bytes()
        for (off, n), r in zip(self.offsets, self.records):
            if data[off:off + n] != r.numpy().tobytes():
                raise RuntimeError("the plain file returned other bytes")

    def _close_fresh(self) -> None:
        if self.fresh is not None:
            self.fresh.close()
            shutil.rmtree(self.fresh.config.path, ignore_errors=True)
            self.fresh = None

    def close(self) -> None:
        self._close_fresh()
        self.disk.close()
        shutil.rmtree(self.disk.config.path, ignore_errors=True)
        self.path.unlink(missing_ok=True)


class RawLMDB:
    """Raw LMDB (no kvtier code), one warm environment per ``writemap`` setting: the records put one
    transaction each; the setup deletes them and writes the freed pages back to disk (``fsync``)."""

    def __init__(self, records: list[torch.Tensor], workdir: Path) -> None:
        self.values = [memoryview(r.numpy()) for r in records]
        self.keys = [b"raw-%06d" % i for i in range(len(records))]
        size = 4 * sum(len(v) for v in self.values) + (64 << 20)
        self.envs = {wm: lmdb.open(str(workdir / f"raw-writemap-{wm}"), map_size=size, writemap=wm, sync=False,
                                   metasync=False, readahead=False, meminit=False) for wm in (False, True)}
        for wm in self.envs:
            self.put(wm)

    def put(self, writemap: bool) -> None:
        env = self.envs[writemap]
        for k, v in zip(self.keys, self.values):
            with env.begin(write=True) as txn:
                txn.put(k, v)

    def setup(self) -> None:
        for env in self.envs.values():
            with env.begin(write=True) as txn:
                for k in self.keys:
                    txn.delete(k)
            for _ in range(2):  # LMDB reuses freed pages two transactions later
                with env.begin(write=True) as txn:
                    txn.put(b"tick", b"x")
            env.sync(True)  # written back: the next write to a page of the map is a write fault

    def close(self) -> None:
        for env in self.envs.values():
            path = env.path()
            env.close()
            shutil.rmtree(path, ignore_errors=True)


class DiskCase(Case):
    name = "disk"
    title = "LMDB disk tier: spill and restore of page records vs a plain file"

    def settings(self, ctx: BenchContext) -> dict[str, Any]:
        return {"records": 256 if ctx.quick else 512, "record_bytes": 194_048, "reps": 5 if ctx.quick else 9,
                "offloaded_records": 4 if ctx.quick else 16, "offloaded_tokens": 256,
                "sync_reps": 3 if ctx.quick else 5, "warmup": 1, "restore_batch": BORROW_BATCH,
                "workdir_fs": "the file system of --out", "environment": "warm (one environment, records removed between rounds)"}

    def steps(self, ctx: BenchContext) -> int:
        s = self.settings(ctx)
        return 1 + 3 * s["reps"] + s["sync_reps"] + 4 * s["warmup"]

    def run(self, ctx: BenchContext) -> CaseResult:
        s = self.settings(ctx)
        res = CaseResult(self.name, self.title, s)
        records = page_records(s["records"])
        total = sum(int(r.numel()) for r in records)
        s["record_bytes"], s["total_bytes"] = int(records[0].numel()), total
        ctx.advance(1)
        tick = lambda: ctx.advance(1)  # noqa: E731
        nosync = DiskRound(records, ctx.workdir, sync=False)
        try:
            t = interleaved([{"lmdb_spill": nosync.lmdb_spill, "file_spill": nosync.file_spill,
                              "lmdb_spill_batch": nosync.lmdb_spill_batch, "lmdb_spill_fresh": nosync.lmdb_spill_fresh},
                             {"lmdb_borrow": nosync.lmdb_borrow, "lmdb_borrow_one": nosync.lmdb_borrow_one,
                              "lmdb_read_into": nosync.lmdb_read_into, "file_read": nosync.file_read}],
                            s["reps"], warmup=s["warmup"], tick=tick, setup=nosync.setup, rotate=True)
            nosync.verify()
        finally:
            nosync.close()
        synced = DiskRound(records, ctx.workdir, sync=True)
        try:
            ts = interleaved({"lmdb_spill": synced.lmdb_spill, "file_spill": synced.file_spill},
                             s["sync_reps"], warmup=s["warmup"], tick=tick, setup=synced.setup, rotate=True)
        finally:
            synced.close()
        copies = offloaded_copies(s["offloaded_records"], s["offloaded_tokens"])
        copy_bytes = sum(int(r.numel()) for r in copies)
        s["offloaded_record_bytes"] = int(copies[0].numel())
        offl = DiskRound(copies, ctx.workdir / "offloaded", sync=False, fresh=False)
        try:
            to = interleaved([{"lmdb_spill": offl.lmdb_spill, "file_spill": offl.file_spill},
                              {"lmdb_borrow_one": offl.lmdb_borrow_one, "file_read": offl.file_read}],
                             s["reps"], warmup=s["warmup"], tick=tick, setup=offl.setup, rotate=True)
            offl.verify()
        finally:
            offl.close()
        del copies
        raw = RawLMDB(records, ctx.workdir)
        try:
            tw = interleaved({"writemap": lambda: raw.put(True), "pwrite": lambda: raw.put(False)},
                             s["reps"], warmup=s["warmup"], tick=tick, setup=raw.setup, rotate=True)
        finally:
            raw.close()
        gb = lambda label, secs: throughput(label, total, secs)  # noqa: E731
        file_w, file_r = gb("plain file write()", t["file_spill"]), gb("plain file readinto()", t["file_read"])
        c = res.comparisons
        c.append(Comparison("disk.spill_vs_file", f"spill host->disk as the daemon evicts ({EVICT_BATCH} records a write, one transaction a batch), "
                            "warm environment, no fsync, vs plain file write()",
                            "GB/s", gb(f"LMDB tier write({EVICT_BATCH} records)", t["lmdb_spill_batch"]), file_w, target=0.8))
        c.append(Comparison("disk.spill_one_vs_file", "spill one record a write (one transaction a record), no fsync, vs plain file write()",
                            "GB/s", gb("LMDB tier write(1 record)", t["lmdb_spill"]), file_w))
        c.append(Comparison("disk.spill_fresh_vs_file", "first fill: spill into a new environment (its file growing), no fsync, vs plain file write()",
                            "GB/s", gb("LMDB tier write(), new environment", t["lmdb_spill_fresh"]), file_w))
        c.append(Comparison("disk.spill_fsync_vs_file", "spill with fsync (LMDB syncs every commit), warm environment, vs plain file write()+fsync a record",
                            "GB/s", gb("LMDB tier write(), sync", ts["lmdb_spill"]), gb("plain file write()+fsync", ts["file_spill"]),
                            target=0.9))
        c.append(Comparison("disk.restore_borrow_vs_file", f"restore as the prefix cache reads (borrow, {BORROW_BATCH} pages a call, checksum verified) vs plain file readinto",
                            "GB/s", gb(f"LMDB tier borrow({BORROW_BATCH} keys)", t["lmdb_borrow"]), file_r, target=0.8))
        gbo = lambda label, secs: throughput(label, copy_bytes, secs)  # noqa: E731
        c.append(Comparison("disk.restore_offloaded_vs_file", "restore of offloaded request copies as Restore reads them (borrow, one "
                            f"{s['offloaded_record_bytes'] / 1e6:.1f} MB record a call, checksum verified) vs plain file readinto",
                            "GB/s", gbo("LMDB tier borrow(1 key), offloaded copies", to["lmdb_borrow_one"]),
                            gbo("plain file readinto()", to["file_read"]), target=0.8))
        c.append(Comparison("disk.spill_offloaded_vs_file", f"offload of request copies to disk (one {s['offloaded_record_bytes'] / 1e6:.1f} MB "
                            "record a write, warm environment, no fsync) vs plain file write()",
                            "GB/s", gbo("LMDB tier write(1 record), offloaded copies", to["lmdb_spill"]),
                            gbo("plain file write()", to["file_spill"])))
        c.append(Comparison("disk.restore_borrow_one_vs_file", "one 194 KB page record a call (borrow, checksum verified: a call's fixed cost "
                            "against a small read) vs plain file readinto", "GB/s", gb("LMDB tier borrow(1 key)", t["lmdb_borrow_one"]), file_r))
        c.append(Comparison("disk.restore_read_into_vs_file", "one 194 KB page record a call into a reused buffer (read_into, checksum "
                            "verified) vs plain file readinto", "GB/s", gb("LMDB tier read_into()", t["lmdb_read_into"]), file_r))
        c.append(Comparison("disk.lmdb_writemap_vs_pwrite", "raw LMDB put+commit, warm map written back: writemap=True vs the default (pwrite), not used by kvtier",
                            "GB/s", gb("raw LMDB, writemap=True", tw["writemap"]), gb("raw LMDB, default", tw["pwrite"])))
        res.figures["seconds"] = {"no_fsync": t, "fsync": ts, "raw_lmdb": tw, "offloaded": to}
        return res
