"""The disk tier's native window read (``server/tiers/_recordio.c`` via ``disk_reads.copy_records``):
byte-exact copies, the same verdict as ``verify_record`` (the Python reference, hashing with the
``xxhash`` package) for a damaged byte in each part of a record, absent keys, and destinations too
small refused before anything is copied. Every test of the calls runs on the native module and on its
pure-Python stand-in (``recordio_py``, used where the extension was not built)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import xxhash

from kvtier.server.pool import slots_of_pages
from kvtier.server.tiers import RecordError, verify_record
from kvtier.server.tiers import _recordio, recordio_py
from kvtier.server.tiers.disk_reads import ABSENT, damage_reason
from tierkit import PAGE, ROW, fill_page, record_of


@pytest.fixture(params=[_recordio, recordio_py], ids=["native", "pure"])
def rio(request):
    return request.param


def _dst(n: int) -> memoryview:
    return memoryview(np.zeros(n, dtype=np.uint8))


def _multi_page_record(codec, pool, first: int, pages: int, tokens: int) -> torch.Tensor:
    for p in range(first, first + pages):
        fill_page(pool, p, seed=100 + p)
    return codec.encode_from_pool(pool, slots_of_pages(torch.arange(first, first + pages), PAGE)[:tokens])


def test_a_window_comes_back_byte_for_byte_with_each_records_token_count(rio, pool, codec):
    """Records of different sizes (one page; three pages cut to 150 tokens), one absent key, in one
    call: each copy equals its source, the codes are the token counts and ABSENT."""
    recs = [record_of(codec, pool, 1, seed=1), _multi_page_record(codec, pool, 2, 3, 150), record_of(codec, pool, 6, seed=2)]
    views = [memoryview(recs[0].numpy()), None, memoryview(recs[1].numpy()), memoryview(recs[2].numpy())]
    dsts = [_dst(recs[0].numel() + 100), None, _dst(recs[1].numel()), _dst(recs[2].numel())]
    codes = rio.copy_check(views, dsts, True)
    assert codes == [PAGE, ABSENT, 150, PAGE]
    for rec, d in zip(recs, [dsts[0], dsts[2], dsts[3]]):
        assert bytes(d[:rec.numel()]) == rec.numpy().tobytes()
    assert bytes(dsts[0][recs[0].numel():]) == bytes(100)  # nothing past the record is written


def test_the_checksum_is_xxh3_64_as_the_python_package_computes_it(rio):
    """Records written before (hashed by the ``xxhash`` package) must still read: the linked library's
    XXH3_64bits gives the same value at every length class of xxh3 (0-16, 17-128, 129-240, long)."""
    for n in (0, 1, 3, 8, 16, 17, 100, 128, 129, 240, 241, 1024, 4096 + 7, 194_048):
        data = os.urandom(n)
        assert rio.xxh3_64(data) == xxhash.xxh3_64_intdigest(data), n


@pytest.mark.parametrize("where", ["magic", "version", "n_tokens", "fp_len", "latent_len", "src_len", "checksum",
                                   "fingerprint", "layer_mask", "pad", "latent", "index", "src_loc", "last"])
def test_a_damaged_byte_anywhere_is_refused_as_verify_record_refuses_it(rio, pool, codec, where):
    """One flipped byte in each part of a record: verify_record (the reference) refuses it, and so
    does the native check, naming a failure; the good record next to it in the window still passes."""
    rec = record_of(codec, pool, 1, seed=3)
    h, n = codec.header_nbytes, rec.numel()
    pad = 56 + len(codec._meta)
    assert pad < h  # this geometry has header padding to damage
    pos = {"magic": 1, "version": 4, "n_tokens": 8, "fp_len": 20, "latent_len": 25, "src_len": 40, "checksum": 50,
           "fingerprint": 60, "layer_mask": pad - 1, "pad": pad, "latent": h + 1000, "index": h + 4 * PAGE * ROW + 5000,
           "src_loc": n - 100, "last": n - 1}[where]
    bad = rec.clone()
    bad[pos] ^= 0x10
    with pytest.raises(RecordError):
        verify_record(bad)
    dsts = [_dst(n), _dst(n)]
    codes = rio.copy_check([memoryview(bad.numpy()), memoryview(rec.numpy())], dsts, True)
    assert codes[0] < 0 and codes[0] != ABSENT and codes[1] == PAGE
    assert damage_reason(codes[0])
    assert bytes(dsts[1]) == rec.numpy().tobytes()
    assert torch.equal(bad[pos], rec[pos] ^ 0x10)  # the source is never written


def test_the_failed_check_is_named(rio, pool, codec):
    rec = record_of(codec, pool, 1, seed=4)
    n = rec.numel()
    cases = {}
    for name, pos in (("magic", 0), ("version", 4), ("latent_len", 24), ("n_tokens", 8), ("checksum", 200)):
        bad = rec.clone()
        bad[pos] ^= 1
        cases[name] = bad.numpy()
    cut = rec[:-8].clone().numpy()
    codes = rio.copy_check([memoryview(cases[k]) for k in cases] + [memoryview(cut), memoryview(bytes(20))],
                         [_dst(n) for _ in range(len(cases) + 2)], True)
    reasons = [damage_reason(c) for c in codes]
    assert "magic" in reasons[0] and "version" in reasons[1] and "length" in reasons[2]
    assert "src_loc" in reasons[3]  # another token count: the lengths still add up, src_loc does not
    assert "checksum" in reasons[4] and "length" in reasons[5] and "shorter" in reasons[6]


def test_without_verify_the_bytes_are_copied_unchecked(rio, pool, codec):
    rec = record_of(codec, pool, 1, seed=5)
    bad = rec.clone()
    bad[codec.header_nbytes + 7] ^= 1
    d = _dst(rec.numel())
    assert rio.copy_check([memoryview(bad.numpy())], [d], False) == [0]
    assert bytes(d) == bad.numpy().tobytes()


def test_a_destination_too_small_is_refused_before_any_copy(rio, pool, codec):
    """The third of three destinations is one byte short: ValueError, and not one byte of the first
    two (which fit) was written."""
    recs = [record_of(codec, pool, 1 + i, seed=6 + i) for i in range(3)]
    dsts = [_dst(recs[0].numel()), _dst(recs[1].numel()), _dst(recs[2].numel() - 1)]
    with pytest.raises(ValueError, match="too small"):
        rio.copy_check([memoryview(r.numpy()) for r in recs], dsts, True)
    assert all(bytes(d) == bytes(len(d)) for d in dsts)
    with pytest.raises(ValueError, match="sources"):
        rio.copy_check([memoryview(recs[0].numpy())], [], True)
    with pytest.raises(BufferError):
        rio.copy_check([memoryview(recs[0].numpy())], [bytes(recs[0].numel())], True)  # not writable


def _cpu_has_avx2() -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and " avx2" in line for line in f)


def test_the_one_pass_copy_and_hash_runs_where_the_cpu_has_avx2():
    """On an x86-64 CPU with AVX2 (this machine's and CI's kind) records are copied and hashed in
    one pass; elsewhere the copy-then-hash path serves (the same digests, tested below either way)."""
    import platform

    assert recordio_py.FUSED_COPY_HASH == 0
    if platform.machine() == "x86_64":
        assert _recordio.FUSED_COPY_HASH == int(_cpu_has_avx2())
    else:
        assert _recordio.FUSED_COPY_HASH == 0


@pytest.mark.parametrize("n", [56, 64, 200, 240, 241, 255, 256, 1023, 1024, 1025, 1088, 2047, 2048, 4096 + 7,
                               16 * 1024 - 1, 194_048, 1_000_003])
def test_copy_and_hash_equals_xxh3_of_the_record_with_its_checksum_field_zeroed(rio, n):
    """``copy_xxh3`` (the path ``copy_check`` takes: one pass on AVX2) returns the ``xxhash``
    package's xxh3_64 of the source with bytes 48-55 read as zeros, at every length class of xxh3's
    long input (stripes, 1 KiB blocks, a last partial block, a last stripe overlapping the one
    before), from unaligned sources into unaligned destinations; the copy is byte-exact, the bytes
    after it are not written, and the source keeps its checksum field."""
    rng = np.random.default_rng(n)
    for src_off, dst_off in ((0, 0), (3, 17), (61, 1)):
        src = rng.integers(0, 256, size=n + src_off, dtype=np.uint8)
        dst = np.full(n + dst_off + 64, 0xA5, dtype=np.uint8)
        s, d = memoryview(src)[src_off:], memoryview(dst)[dst_off:dst_off + n + 64]
        digest = rio.copy_xxh3(d, s)
        expect = xxhash.xxh3_64_intdigest(bytes(s[:48]) + bytes(8) + bytes(s[56:]))
        assert digest == expect, (n, src_off, dst_off)
        assert bytes(d[:n]) == bytes(s)
        assert bytes(d[n:]) == b"\xa5" * 64
        assert bytes(dst[:dst_off]) == b"\xa5" * dst_off


def test_copy_and_hash_catches_a_flip_in_every_stripe_of_a_block(rio):
    """One flipped bit at each 64-byte stripe of the first 2 KiB and near the end changes the digest
    (the checksum field itself excepted: it is read as zeros)."""
    base = np.random.default_rng(1).integers(0, 256, size=5000, dtype=np.uint8)
    ref = rio.copy_xxh3(bytearray(5000), base)
    for pos in [*range(0, 2048, 64), 4935, 4999]:
        bad = base.copy()
        bad[pos] ^= 0x04
        got = rio.copy_xxh3(bytearray(5000), bad)
        assert (got == ref) == (48 <= pos < 56), pos
    assert rio.copy_xxh3(bytearray(5000), base) == ref
    field = base.copy()
    field[50] ^= 0xFF
    assert rio.copy_xxh3(bytearray(5000), field) == ref


def test_copy_and_hash_refuses_short_inputs_and_small_destinations(rio):
    with pytest.raises(ValueError, match="at least 56"):
        rio.copy_xxh3(bytearray(64), bytes(55))
    with pytest.raises(ValueError, match="too small"):
        rio.copy_xxh3(bytearray(100), bytes(101))
