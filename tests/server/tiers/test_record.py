"""The record format: exact sizes (skip layers store nothing), round trip, and damage detection."""

from __future__ import annotations

import pytest
import torch

from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool import create_pool, slots_of_pages
from kvtier.server.tiers import RecordCodec, RecordError, verify_record
from tierkit import INDEX_PAGE, PAGE, ROW, fill_page, read_page, record_of, verify_same_page

def test_page_record_holds_latent_for_every_layer_and_indexer_for_live_layers_only(model, pool, codec):
    rec = record_of(codec, pool, 3, seed=1)
    # layers 0,1,2 run the indexer, layer 3 skips it (GLM-5.2: index_topk_freq=4, offset=3)
    latent = 4 * PAGE * ROW            # 167,936
    index = 3 * INDEX_PAGE             # 25,344 -- nothing for skip layer 3
    src = PAGE * 8                     # 512
    header = codec.header_nbytes
    assert header % 64 == 0 and header < 1024
    assert rec.numel() == header + latent + index + src == header + 193_792
    assert codec.page_nbytes() == rec.numel()

def test_full_glm52_page_record_size():
    m = DSAModelConfig.from_preset("glm-5.2")
    c = RecordCodec(m)
    # 78 layers of 656-byte rows; 21 live indexer layers of 8448-byte page rows; 57 skip layers: 0 bytes
    assert c.nbytes(64, 1) - c.header_nbytes == 78 * 64 * 656 + 21 * 8448 + 64 * 8
    # a naive record with an indexer page on every layer would be 57 * 8448 = 481,536 bytes larger
    assert RecordCodec(m, (True,) * 78).nbytes(64, 1) - c.nbytes(64, 1) == 57 * 8448

def test_round_trip_into_other_slots_is_byte_exact(model, pool, codec):
    written = fill_page(pool, 2, seed=7)
    rec = codec.encode_from_pool(pool, slots_of_pages(torch.tensor([2]), PAGE))
    other = create_pool(model, 16 * PAGE, device="cpu")
    other.load_cpu_copy(codec.to_cpu_copy(rec), slots_of_pages(torch.tensor([9]), PAGE))
    verify_same_page(written, read_page(other, 9))

def test_request_copy_of_scattered_slots_round_trips(model, pool, codec):
    fill_page(pool, 1, seed=1)
    fill_page(pool, 4, seed=2)
    slots = torch.tensor([64 + 5, 4 * 64 + 63, 64 + 6, 4 * 64 + 1])
    rec = codec.encode_from_pool(pool, slots)
    info = codec.check(rec)
    assert (info.n_tokens, info.n_pages) == (4, 2)
    other = create_pool(model, 16 * PAGE, device="cpu")
    target = torch.tensor([640, 641, 700, 701])
    other.load_cpu_copy(codec.to_cpu_copy(rec), target)
    for layer in range(4):
        assert torch.equal(other.get_kv_buffer_rows(layer, target), pool.get_kv_buffer_rows(layer, slots))
    for layer in (0, 1, 2):
        k1, s1 = other.get_index_k_scale(layer, target)
        k0, s0 = pool.get_index_k_scale(layer, slots)
        assert torch.equal(k1, k0) and torch.equal(s1.view(torch.int32), s0.view(torch.int32))

@pytest.mark.parametrize("where", ["magic", "checksum", "fingerprint", "mask", "latent", "index", "src_loc", "last"])
def test_a_flipped_byte_anywhere_is_detected(pool, codec, where):
    rec = record_of(codec, pool, 1, seed=3)
    h = codec.header_nbytes
    pos = {"magic": 0, "checksum": 50, "fingerprint": 60, "mask": 56 + len(codec._fp) + 1, "latent": h + 1000,
           "index": h + 4 * PAGE * ROW + 5000, "src_loc": rec.numel() - 100, "last": rec.numel() - 1}[where]
    bad = rec.clone()
    bad[pos] ^= 0x10
    with pytest.raises(RecordError):
        codec.check(bad)
    with pytest.raises(RecordError):
        verify_record(bad) if where not in ("fingerprint", "mask") else codec.check(bad)
    codec.check(rec)  # the original is fine

def test_truncated_record_is_rejected(pool, codec):
    rec = record_of(codec, pool, 1, seed=3)
    with pytest.raises(RecordError, match="header accounts"):
        verify_record(rec[:-1].clone())

def test_another_model_or_role_cannot_read_the_record(model, pool, codec):
    rec = record_of(codec, pool, 1, seed=3)
    deepseek = DSAModelConfig.from_preset("deepseek-v3.2", num_layers=4)
    with pytest.raises(RecordError, match="fingerprint"):
        RecordCodec(deepseek).check(rec)
    with pytest.raises(RecordError, match="layer mask"):
        RecordCodec(model, (True,) * 4).check(rec)  # a draft pool keeps an indexer on every layer


def test_page_fast_path_equals_the_general_encoding_and_loads_byte_exact(model, pool, codec):
    written = fill_page(pool, 5, seed=11)
    fast = codec.encode_page(pool, 5)
    general = codec.encode_from_pool(pool, slots_of_pages(torch.tensor([5]), PAGE))
    assert torch.equal(fast, general)
    other = create_pool(model, 16 * PAGE, device="cpu")
    codec.load_page(other, fast, 12)
    verify_same_page(written, read_page(other, 12))
    scattered = codec.encode_from_pool(pool, torch.tensor([64 * 5 + 3, 64 * 5 + 1]))
    with pytest.raises(RecordError, match="one-page"):
        codec.load_page(other, scattered, 12)


def test_page_fast_load_checks_the_record_as_check_does(model, pool, codec):
    """The one-page load compares the header with the codec's and checksums the payload itself:
    a flipped payload byte, another model's record or a cut record is refused, the pool unchanged."""
    fill_page(pool, 5, seed=12)
    good = codec.encode_page(pool, 5)
    other = create_pool(model, 16 * PAGE, device="cpu")
    before = other.arena("latent").clone()
    bad = good.clone()
    bad[codec.header_nbytes + 1000] ^= 1
    with pytest.raises(RecordError, match="checksum"):
        codec.load_page(other, bad, 3)
    with pytest.raises(RecordError, match="fingerprint"):
        RecordCodec(DSAModelConfig.from_preset("deepseek-v3.2", num_layers=4)).load_page(other, good, 3)
    with pytest.raises(RecordError):
        codec.load_page(other, good[:-8].clone(), 3)
    assert torch.equal(other.arena("latent"), before)


def test_verified_skips_only_the_hash(pool, codec):
    """A record a tier verified as it read it is checked again for everything but the hash: a
    damaged payload passes (the tier already vouched for it), another model's header does not."""
    rec = record_of(codec, pool, 1, seed=5)
    payload_flip = rec.clone()
    payload_flip[codec.header_nbytes + 7] ^= 1
    codec.check(payload_flip, checksum=False)
    with pytest.raises(RecordError):
        codec.check(payload_flip)
    wrong_len = rec[:-8].clone()
    with pytest.raises(RecordError):
        codec.check(wrong_len, checksum=False)


def test_load_page_verified_skips_only_the_hash(model, pool, codec):
    """load_page(verified=True) (a tier hashed the record as it read it) still checks the header:
    a payload flip is written as it is, another model's record is refused and the pool unchanged."""
    fill_page(pool, 5, seed=13)
    good = codec.encode_page(pool, 5)
    flip = good.clone()
    flip[codec.header_nbytes + 3] ^= 1
    other = create_pool(model, 16 * PAGE, device="cpu")
    codec.load_page(other, flip, 2, verified=True)
    first_row = other.arena("latent").view(model.num_layers, other.num_slots, codec.row_bytes)[0, 2 * PAGE]
    assert int(first_row[3]) == int(flip[codec.header_nbytes + 3])
    before = other.arena("latent").clone()
    with pytest.raises(RecordError, match="fingerprint"):
        RecordCodec(DSAModelConfig.from_preset("deepseek-v3.2", num_layers=4)).load_page(other, good, 3, verified=True)
    assert torch.equal(other.arena("latent"), before)
