"""Fixtures for tier tests: a scaled GLM-5.2 (layers 0-3: three indexer layers, one skip layer)."""

from __future__ import annotations

import pytest

from kvtier.server.model_config import DSAModelConfig
from kvtier.server.pool import PagedTokenAllocator, create_pool
from kvtier.server.tiers import RecordCodec


@pytest.fixture
def model() -> DSAModelConfig:
    return DSAModelConfig.from_preset("glm-5.2", num_layers=4)


@pytest.fixture
def pool(model):
    return create_pool(model, 16 * 64, device="cpu")


@pytest.fixture
def allocator(pool):
    return PagedTokenAllocator(pool.size, pool.page_size)


@pytest.fixture
def codec(model, pool):
    return RecordCodec.for_pool(model, pool)
