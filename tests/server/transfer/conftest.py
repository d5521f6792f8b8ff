"""Fixtures for the transfer domain tests."""

from __future__ import annotations

import pytest

from kvtier.server.model_config import DSAModelConfig


@pytest.fixture
def model() -> DSAModelConfig:
    """GLM-5.2 cut to 8 layers: full 0, 1, 2, 6; skip 3, 4, 5, 7."""
    return DSAModelConfig.from_preset("glm-5.2", num_layers=8)
