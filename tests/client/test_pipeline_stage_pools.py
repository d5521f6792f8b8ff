"""Pipeline-stage pools on real daemons: model layer ids on the wire, PD transfer between equal stages.

A stage of GLM-5.2 layers 20..27 (``--pool-layers 20:28``): layer l skips top-k iff
``max(l - 2, 0) % 4 != 0``, so layers 22 and 26 own an indexer buffer and the stage's first layer
(20) skips — its top-k comes from the previous stage.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.client import DaemonProcess, FailedPreconditionError, InvalidArgumentError, KVTierClient

STAGE = list(range(20, 28))
LIVE = [22, 26]
PS = 64


def glm_skips(layer: int) -> bool:
    return max(layer - 2, 0) % 4 != 0


def random_stage_kv(n: int, seed: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    latent = {x: torch.randint(0, 256, (n, 656), dtype=torch.uint8, generator=g) for x in STAGE}
    index = {x: (torch.randint(0, 256, (n, 128), dtype=torch.uint8, generator=g), torch.rand(n, generator=g))
             for x in LIVE}
    return latent, index


@pytest.fixture(scope="module")
def stages():
    """Two daemons with a pool of layers 20..27 and one with layers 21..28, all with the Mooncake engine."""
    started = []
    try:
        for layers in ("20:28", "20:28", "21:29"):
            d = DaemonProcess("127.0.0.1:0", allow_unauthenticated=True, extra_args=["--device", "cpu", "--pool", "glm-5.2:1024", "--pool-layers",
                                                         layers, "--transfer-engine", "mooncake"])
            d.start()
            started.append(d)
        yield started
    finally:
        for d in started:
            d.stop()
            d.cleanup()


def test_stage_pool_describes_itself_with_model_layer_ids(stages):
    assert [glm_skips(x) for x in STAGE] == [True, True, False, True, True, True, False, True]
    with KVTierClient(stages[0].address) as c:
        info = c.describe_pool("default")
        assert (info.layout.start_layer, info.layout.num_layers, info.layout.skip_mask) == (20, 8, "SSFSSSFS")
        assert list(info.live_layers) == LIVE
        assert [x.layer_id for x in info.layers] == STAGE
        assert [x.index_bytes > 0 for x in info.layers] == [not glm_skips(x) for x in STAGE]
        infos = c.buffer_infos("default")
        assert [b.layer_id for b in infos.state] == STAGE == [b.layer_id for b in infos.contiguous]
        assert [b.data_len > 0 for b in infos.state] == [not glm_skips(x) for x in STAGE]


def test_kv_calls_take_model_layer_ids(stages):
    with KVTierClient(stages[0].address) as c:
        slots = c.allocate_slots("default", 2 * PS)
        latent, index = random_stage_kv(slots.numel(), seed=3)
        c.write_kv("default", slots, latent=latent, index=index)
        kv = c.read_kv("default", slots)
        assert sorted(kv.latent) == STAGE and sorted(kv.index_k) == LIVE
        for x in STAGE:
            assert torch.equal(kv.latent[x], latent[x])
        for x in LIVE:
            assert torch.equal(kv.index_k[x], index[x][0]) and torch.equal(kv.index_scale[x], index[x][1])
        with pytest.raises(InvalidArgumentError, match=r"outside the pool's layers \[20, 28\)"):
            c.write_kv("default", slots, latent={3: latent[20]})
        with pytest.raises(FailedPreconditionError, match="layer 20 skips top-k"):
            c.write_kv("default", slots, index={20: index[22]})
        c.offload("default", "stage-copy", slots)
        back = c.restore("default", "stage-copy", drop=True)
        kv2 = c.read_kv("default", back)
        assert all(torch.equal(kv2.latent[x], latent[x]) for x in STAGE)
        c.free_slots("default", back)
        c.free_slots("default", slots)


@pytest.mark.parametrize("transport", ["mooncake", "grpc"])
def test_equal_stages_pull_byte_exact_and_other_stages_are_refused(stages, transport):
    a, b, other = stages
    with KVTierClient(a.address) as pre, KVTierClient(b.address) as dec, KVTierClient(other.address) as oth:
        src = pre.allocate_slots("default", 3 * PS)
        latent, index = random_stage_kv(src.numel(), seed=7)
        pre.write_kv("default", src, latent=latent, index=index)
        dst = dec.allocate_slots("default", 3 * PS)
        r = dec.pull_kv("default", a.address, "default", src_pages=(src[::PS] // PS).tolist(),
                        dst_pages=(dst[::PS] // PS).tolist(), transport=transport)
        assert r.index_bytes == len(LIVE) * 3 * 8448 and r.latent_bytes == 8 * 3 * PS * 656
        assert [x.layer_id for x in r.layers] == STAGE
        assert [x.index_bytes for x in r.layers] == [0 if glm_skips(x) else 3 * 8448 for x in STAGE]
        kv = dec.read_kv("default", dst)
        assert all(torch.equal(kv.latent[x], latent[x]) for x in STAGE)
        assert all(torch.equal(kv.index_k[x], index[x][0]) for x in LIVE)
        mine = oth.allocate_slots("default", 3 * PS)
        with pytest.raises(FailedPreconditionError, match="layer ranges differ: model layers 21-28 here, 20-27 on the peer"):
            oth.pull_kv("default", a.address, "default", src_pages=(src[::PS] // PS).tolist(),
                        dst_pages=(mine[::PS] // PS).tolist(), transport=transport)
        for c, s in ((pre, src), (dec, dst), (oth, mine)):
            c.free_slots("default", s)


def test_create_pool_takes_a_layer_range(stages):
    with KVTierClient(stages[0].address) as c:
        info = c.create_pool("glm-5.2", size_tokens=256, pool_id="stage-70", start_layer=70)
        assert (info.layout.start_layer, info.layout.num_layers) == (70, 8)
        assert list(info.live_layers) == [x for x in range(70, 78) if not glm_skips(x)]
        with pytest.raises(InvalidArgumentError, match="runs past the model's 78 layers"):
            c.create_pool("glm-5.2", size_tokens=256, pool_id="bad", start_layer=70, end_layer=80)
        c.delete_pool("stage-70")
