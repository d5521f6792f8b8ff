"""TransferLayout messages <-> PoolLayout: a pool's layout survives the round trip; malformed peers are refused."""

from __future__ import annotations

import pytest

from kvtier.server.model_config import DSAModelConfig
from kvtier.server.daemon.pools import PoolRegistry, PoolRequest
from kvtier.server.daemon.tenants import Caller
from kvtier.server.service.transfer_messages import peer_layout, transfer_layout
from kvtier.server.transfer import LayoutMismatchError, check_compatible, pool_layout


def test_layout_round_trip_keeps_fingerprint_infos_and_engine():
    entry = PoolRegistry("cpu").create(Caller.default(), PoolRequest(pool_id="p", preset="glm-5.2", num_layers=8, size_tokens=512))
    local = pool_layout(entry.pool, entry.model.fingerprint()).with_engine("127.0.0.1:1234", [(4096, 100)])
    back = peer_layout(transfer_layout(entry, local))
    assert back == local
    assert back.fingerprint == DSAModelConfig.from_preset("glm-5.2", num_layers=8).fingerprint()
    check_compatible(local, back)


def test_malformed_peer_layouts_are_layout_mismatches():
    entry = PoolRegistry("cpu").create(Caller.default(), PoolRequest(pool_id="p", preset="glm-5.2", num_layers=8, size_tokens=512))
    msg = transfer_layout(entry, pool_layout(entry.pool, entry.model.fingerprint()))
    shuffled = type(msg)()
    shuffled.CopyFrom(msg)
    shuffled.index[0].layer_id, shuffled.index[1].layer_id = 1, 0
    with pytest.raises(LayoutMismatchError, match="not one entry a layer in layer order"):
        peer_layout(shuffled)
    short = type(msg)()
    short.CopyFrom(msg)
    short.layout.skip_mask = "FFF"
    with pytest.raises(LayoutMismatchError, match="skip mask has 3 layers but the buffer infos have 8"):
        peer_layout(short)
