"""kvtier's pool has exactly the shapes and buffer infos of SGLang's own ``DSATokenToKVPool``.

Both pools are built here with the same arguments: GLM-5.2's pipeline stage of layers 20-39 (its
first layer, 20, skips top-k: GLM-5.2 skips layer l iff max(l - 2, 0) % 4 != 0), fp8 (656-byte rows
stored as uint8), 1,024 tokens, 64-token pages; and the whole first stage for comparison.
"""

from __future__ import annotations

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool as SGLangDSAPool
from sglang.srt.runtime_context import get_parallel

from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool import create_pool

SIZE, PS = 1024, 64


def glm_skips(layer: int) -> bool:
    return max(layer - 2, 0) % 4 != 0


def pools(start: int, end: int):
    """(SGLang's pool, kvtier's pool) of GLM-5.2 layers [start, end). SGLang sizes the indexer from the
    decode-context-parallel width when ``index_buf_size`` is not given: one rank here, as without DCP."""
    skip = [glm_skips(layer) for layer in range(start, end)]
    with get_parallel().override(attn_dcp_size=1):
        theirs = SGLangDSAPool(size=SIZE, page_size=PS, kv_lora_rank=512, dtype=torch.float8_e4m3fn, qk_rope_head_dim=64,
                               layer_num=end - start, device="cpu", index_head_dim=128, enable_memory_saver=False,
                               kv_cache_dim=656, start_layer=start, end_layer=end, skip_topk_layers=skip)
    ours = create_pool(DSAModelConfig.from_preset("glm-5.2", start_layer=start, end_layer=end), SIZE, device="cpu")
    return theirs, ours


@pytest.mark.parametrize("start, end", [(20, 40), (0, 19), (58, 78)])
def test_same_shapes_dtypes_and_buffer_infos_as_sglangs_pool(start, end):
    theirs, ours = pools(start, end)
    assert glm_skips(20) and ours.skip_topk_layers[0] == (start == 20)
    assert list(ours.skip_topk_layers) == list(theirs.skip_topk_layers)
    assert (ours.start_layer, ours.layer_num, ours.page_size, ours.size) == (theirs.start_layer, theirs.layer_num,
                                                                            theirs.page_size, theirs.size)
    assert len(ours.kv_buffer) == len(theirs.kv_buffer) == end - start
    for a, b in zip(ours.kv_buffer, theirs.kv_buffer):
        assert (tuple(a.shape), a.dtype, a.nbytes) == (tuple(b.shape), b.dtype, b.nbytes)
    assert len(ours.index_k_with_scale_buffer) == len(theirs.index_k_with_scale_buffer)
    for a, b in zip(ours.index_k_with_scale_buffer, theirs.index_k_with_scale_buffer):
        assert (tuple(a.shape), a.dtype, a.nbytes) == (tuple(b.shape), b.dtype, b.nbytes)
    for mine, sglang_infos in ((ours.get_state_buf_infos(), theirs.get_state_buf_infos()),
                               (ours.get_contiguous_buf_infos(), theirs.get_contiguous_buf_infos())):
        (p1, n1, i1), (p2, n2, i2) = mine, sglang_infos
        assert list(n1) == list(n2) and list(i1) == list(i2)
        assert [p == 0 for p in p1] == [p == 0 for p in p2]  # null pointers exactly on skip layers
    assert ours.get_kv_size_bytes() == theirs.get_kv_size_bytes()
    for layer in range(start, end):  # SGLang indexes its lists by model layer id - start_layer
        if not glm_skips(layer):
            assert tuple(ours.index_k_with_scale_buffer[layer - start].shape) == \
                tuple(theirs.get_index_k_with_scale_buffer(layer).shape)
