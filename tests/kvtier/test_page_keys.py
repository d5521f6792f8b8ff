"""Chained page keys: equal prefixes give equal keys, a key depends on every earlier token."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from kvtier.page_keys import ROOT_KEY, page_keys


def test_keys_are_the_documented_chain():
    toks = np.arange(200, dtype=np.int32)
    keys = page_keys(toks, 64)
    assert len(keys) == 3  # the 8-token tail is not a full page
    k0 = xxhash.xxh3_128(ROOT_KEY + toks[:64].astype("<i4").tobytes()).digest()
    k1 = xxhash.xxh3_128(k0 + toks[64:128].astype("<i4").tobytes()).digest()
    assert keys[:2] == [k0, k1]


def test_a_change_anywhere_changes_every_later_key():
    a = np.arange(256)
    b = a.copy()
    b[70] += 1
    ka, kb = page_keys(a, 64), page_keys(b, 64)
    assert ka[0] == kb[0] and all(x != y for x, y in zip(ka[1:], kb[1:]))
    assert page_keys(a[64:], 64, parent=ka[0]) == ka[1:]


@pytest.mark.parametrize("bad", [dict(page_size=0), dict(parent=b"short"), dict(token_ids=[1.5] * 64),
                                 dict(token_ids=[2**31] * 64)])
def test_bad_arguments_are_refused(bad):
    args = {"token_ids": list(range(64)), "page_size": 64, **bad}
    with pytest.raises(ValueError):
        page_keys(**args)
